"""onnxruntime's QDQ quantizer renames a tensor in every node of the graph once per tensor it quantizes.

``ONNXModel.replace_input_of_all_nodes`` (and ``..._output_...``) visit every node and, in Python, every input of
it for each tensor quantized: quadratic in the graph's size, with a Python-level step per node input. On the tiny
model's w4a16 decoder (3 graphs, 1068 renames, 862k node visits) that was 1.96 of the quantizer's 7.3 s (cProfile).
`graph_edits_in_c` swaps them, while it is open, for versions that ask each node whether it names the tensor at
all (``name in node.input``: one membership test in protobuf's C code) and rename only where it does, with
onnxruntime's own ``replace_node_input``/``replace_node_output``: the same nodes get the same names in the same
order, so the quantized graph is the same to the byte (tests/test_quantizer.py).

Its min-max calibrator (``MinMaxCalibrater.augment_graph``) is quadratic the same way: for each tensor it calibrates
it rebuilds a dict of every value info, output and input, and finds where to put the tensor's ReduceMin/ReduceMax
pair by scanning the nodes from the first for one that reads it: 1.97 s of the same 7.3 s. `_augment_graph` makes the
same graph (the same nodes, at the same places, with the same outputs; only the fresh uuid names onnxruntime draws
per run differ, as they do between two of its own runs) from one pass over the nodes: where each tensor is first
read, plus the places already used (a sorted list: the nodes inserted before a place).
"""

from __future__ import annotations

import bisect
import uuid
from contextlib import contextmanager

import numpy as np


def _replace_input_of_all_nodes(self, old_input_name, new_input_name):
    assert isinstance(old_input_name, str) and isinstance(new_input_name, str)
    for node in self.model.graph.node:
        if old_input_name in node.input:
            self.replace_node_input(node, old_input_name, new_input_name)  # onnxruntime's own (a staticmethod)


def _replace_output_of_all_nodes(self, old_output_name, new_output_name):
    assert isinstance(old_output_name, str) and isinstance(new_output_name, str)
    for node in self.model.graph.node:
        if old_output_name in node.output:
            self.replace_node_output(node, old_output_name, new_output_name)


#: the onnxruntime release whose ``MinMaxCalibrater.augment_graph`` `_augment_graph` follows step for step
AUGMENT_OF = "1.32."


def _augment_graph(self):
    """``MinMaxCalibrater.augment_graph`` of onnxruntime 1.32 (quantization/calibrate.py), step for step, with its
    two per-tensor scans replaced by lookups: a ReduceMin and a Reshape, then a ReduceMax and a Reshape, inserted
    right before the first node that reads the tensor (the ReduceMax pair before the ReduceMin pair, which then reads
    it first), appended when no node reads it; each reduced output appended to the graph's outputs."""
    import onnx
    from onnx import helper, numpy_helper

    graph = self.model.graph
    tensors, _ = self.select_tensors_to_calibrate(self.model)
    reshape_shape_name = str(uuid.uuid4())
    reshape_shape = numpy_helper.from_array(np.array([-1], dtype=np.int64), reshape_shape_name)
    graph.initializer.append(reshape_shape)

    def get_op_version(op_type, model):
        for opset_import in model.opset_import:
            if onnx.defs.has(op_type, opset_import.domain):
                return opset_import.version
        raise RuntimeError(f"Model does not contain a version for '{op_type}'.")

    first_reader: dict[str, int] = {}
    for i, node in enumerate(graph.node):
        for name in node.input:
            first_reader.setdefault(name, i)
    used: list[int] = []  # the first reader of each tensor done so far, sorted: 4 nodes inserted before each
    # onnxruntime looks a tensor up in {value_info} updated by {outputs} then {inputs}, rebuilt per tensor (the
    # outputs growing as reduced outputs are appended): the same lookup, kept up to date instead
    value_info = {vi.name: vi for vi in graph.value_info}
    outputs = {o.name: o for o in graph.output}
    inputs = {i.name: i for i in graph.input}

    def lookup(name):
        for table in (inputs, outputs, value_info):
            if name in table:
                return table[name]
        return None

    def add_reduce_min_max(tensor_name, reduce_op_name, at):
        keepdims = 1
        reduce_output = tensor_name + "_" + reduce_op_name
        intermediate_output = reduce_output + "_Reshape"
        reduce_node = onnx.helper.make_node(
            reduce_op_name, [tensor_name], [intermediate_output], keepdims=keepdims, name=reduce_output
        )
        reshape_node = onnx.helper.make_node(
            "Reshape", inputs=[intermediate_output, reshape_shape_name], outputs=[reduce_output],
            name=intermediate_output,
        )
        info = lookup(tensor_name)
        if info is None:
            raise ValueError(
                f"Unable to guess tensor type for tensor {tensor_name!r}, "
                "running shape inference before quantization may resolve this issue."
            )
        onnx_type = info.type.tensor_type.elem_type
        if self.per_channel:
            tensor_rank = len(info.type.tensor_type.shape.dim)
            reduced_axes = [0, *range(2, tensor_rank)]
            if get_op_version(reduce_op_name, self.model) < 18:
                reduce_node.attribute.append(helper.make_attribute("axes", reduced_axes))
            else:
                reduce_axes_name = str(uuid.uuid4())
                reduce_axes = numpy_helper.from_array(np.array(reduced_axes, dtype=np.int64), reduce_axes_name)
                reduce_node.input.append(reduce_axes_name)
                graph.initializer.append(reduce_axes)
        index = len(graph.node) if at is None else at
        graph.node.insert(index, reduce_node)
        graph.node.insert(index + 1, reshape_node)
        output = helper.make_tensor_value_info(reduce_output, onnx_type, [None])
        graph.output.append(output)
        outputs[reduce_output] = output
        return index

    for tensor in tensors:
        first = first_reader.get(tensor)
        at = None if first is None else first + 4 * bisect.bisect_right(used, first)
        at = add_reduce_min_max(tensor, "ReduceMin", at)  # where the pair went: the tensor's first reader now
        add_reduce_min_max(tensor, "ReduceMax", at)
        if first is not None:
            bisect.insort(used, first)

    onnx.save(self.model, self.augmented_model_path, save_as_external_data=self.use_external_data_format)


@contextmanager
def graph_edits_in_c():
    """onnxruntime's ``ONNXModel`` renames done through a C membership test, and its min-max calibrator's graph
    made from one pass over the nodes (`_augment_graph`), while the block runs."""
    import onnxruntime
    from onnxruntime.quantization.calibrate import MinMaxCalibrater
    from onnxruntime.quantization.onnx_model import ONNXModel

    saved = (ONNXModel.replace_input_of_all_nodes, ONNXModel.replace_output_of_all_nodes,
             MinMaxCalibrater.augment_graph)
    ONNXModel.replace_input_of_all_nodes = _replace_input_of_all_nodes
    ONNXModel.replace_output_of_all_nodes = _replace_output_of_all_nodes
    if onnxruntime.__version__.startswith(AUGMENT_OF):  # another onnxruntime's calibrator is left as it is
        MinMaxCalibrater.augment_graph = _augment_graph
    try:
        yield
    finally:
        (ONNXModel.replace_input_of_all_nodes, ONNXModel.replace_output_of_all_nodes,
         MinMaxCalibrater.augment_graph) = saved
