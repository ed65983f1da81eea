"""A float graph input that reaches a ``Where`` is quantized at the ``Where`` output's encoding (qnn_htp's parts
form: the past KV zeroed where the mask hides it), the values it computes kept, and nothing else touched."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from vlmrun_qnn_htp.qdq_inputs import quantize_where_inputs

SCALE, ZERO_POINT = 0.01, 300


def where_model(path, *, data_from_input: bool = True):
    """past [2, 8] float (a graph input, or the output of a Relu), seen [1, 8] bool: Where(seen, past, zeros) and
    its QDQ output at SCALE / ZERO_POINT (uint16), as onnxruntime's quantizer leaves the parts graphs."""
    inits = [numpy_helper.from_array(np.zeros((2, 8), np.float32), "zeros"),
             numpy_helper.from_array(np.array(SCALE, np.float32), "out_scale"),
             numpy_helper.from_array(np.array(ZERO_POINT, np.uint16), "out_zp")]
    nodes = [] if data_from_input else [helper.make_node("Relu", ["past"], ["past_relu"], name="relu")]
    data = "past" if data_from_input else "past_relu"
    nodes += [helper.make_node("Where", ["seen", data, "zeros"], ["w"], name="/Where"),
              helper.make_node("QuantizeLinear", ["w", "out_scale", "out_zp"], ["w_q"], name="w_q"),
              helper.make_node("DequantizeLinear", ["w_q", "out_scale", "out_zp"], ["out"], name="w_dq")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("seen", TensorProto.BOOL, [1, 8]),
                                           helper.make_tensor_value_info("past", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 8])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    model.ir_version = 10
    onnx.save(model, str(path))


def run(path, feeds):
    return ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)[0]


def test_a_past_input_is_quantized_at_the_where_outputs_encoding(tmp_path):
    path = tmp_path / "m.onnx"
    where_model(path)
    rng = np.random.default_rng(0)
    feeds = {"seen": np.array([[True] * 5 + [False] * 3]), "past": rng.normal(0, 0.5, (2, 8)).astype(np.float32)}
    before = run(path, feeds)

    assert quantize_where_inputs(path) == ["past"]
    m = onnx.load(str(path))
    by_name = {n.name: n for n in m.graph.node}
    q, dq, where = by_name["past_QuantizeLinear"], by_name["past_DequantizeLinear"], by_name["/Where"]
    assert list(q.input) == ["past", "out_scale", "out_zp"] and list(dq.input[1:]) == ["out_scale", "out_zp"]
    assert where.input[1] == dq.output[0] and where.input[2] == "zeros"
    onnx.checker.check_model(m)  # still a valid graph in topological order

    after = run(path, feeds)
    np.testing.assert_array_equal(after, before)  # the values the graph computed, bit for bit on the CPU
    assert np.all(after[:, 5:] == 0.0)  # hidden slots are still exactly zero

    assert quantize_where_inputs(path) == []  # a second pass finds nothing left in float


def test_a_where_fed_by_a_computed_tensor_is_left_alone(tmp_path):
    path = tmp_path / "m.onnx"
    where_model(path, data_from_input=False)
    data = path.read_bytes()
    assert quantize_where_inputs(path) == []
    assert path.read_bytes() == data


def test_weights_in_external_data_stay_where_they_are(tmp_path):
    """A full-size part keeps its weights beside the graph (``<graph>.data``): the rewrite leaves that file and
    the graph still loads and computes the same."""
    path = tmp_path / "m.onnx"
    where_model(path)
    m = onnx.load(str(path))
    onnx.save(m, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location="m.onnx.data",
              size_threshold=0)
    data = (tmp_path / "m.onnx.data").read_bytes()
    feeds = {"seen": np.array([[True] * 6 + [False] * 2]),
             "past": np.linspace(-1, 1, 16, dtype=np.float32).reshape(2, 8)}
    before = run(path, feeds)

    assert quantize_where_inputs(path) == ["past"]
    assert (tmp_path / "m.onnx.data").read_bytes() == data
    np.testing.assert_array_equal(run(path, feeds), before)


def test_an_input_feeding_two_wheres_gets_one_pair_per_encoding(tmp_path):
    """past feeds the modelled Where and a second one: the same encoding shares one pair; another encoding gets
    its own, named apart, and the graph stays valid and computes the same."""
    path = tmp_path / "m.onnx"
    where_model(path)
    m = onnx.load(str(path))
    g = m.graph
    g.initializer.extend([numpy_helper.from_array(np.array(0.02, np.float32), "out2_scale"),
                          numpy_helper.from_array(np.array(100, np.uint16), "out2_zp")])
    for scale, zp, tag in (("out_scale", "out_zp", "b"), ("out2_scale", "out2_zp", "c")):
        g.node.extend([helper.make_node("Where", ["seen", "past", "zeros"], [f"w_{tag}"], name=f"/Where_{tag}"),
                       helper.make_node("QuantizeLinear", [f"w_{tag}", scale, zp], [f"q_{tag}"], name=f"q_{tag}"),
                       helper.make_node("DequantizeLinear", [f"q_{tag}", scale, zp], [f"out_{tag}"],
                                        name=f"dq_{tag}")])
        g.output.append(helper.make_tensor_value_info(f"out_{tag}", TensorProto.FLOAT, [2, 8]))
    onnx.save(m, str(path))
    feeds = {"seen": np.array([[True] * 4 + [False] * 4]),
             "past": np.linspace(-2, 2, 16, dtype=np.float32).reshape(2, 8)}
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    before = sess.run(None, feeds)

    assert quantize_where_inputs(path) == ["past"]
    m = onnx.load(str(path))
    onnx.checker.check_model(m)
    by_name = {n.name: n for n in m.graph.node}
    assert by_name["/Where"].input[1] == by_name["/Where_b"].input[1] == "past_DequantizeLinear_Output"
    assert by_name["/Where_c"].input[1] == "past_1_DequantizeLinear_Output"
    assert list(by_name["past_1_QuantizeLinear"].input) == ["past", "out2_scale", "out2_zp"]
    after = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, feeds)
    for a, b in zip(after, before):
        np.testing.assert_array_equal(a, b)
