"""onnxruntime's MinMax calibration in batches of tensors (qnn_htp `calibration_batches`): the 1024 x 1024 image
encoder's augmented graph held every activation at once (above 15.9 GB). On the tiny model's vision graph, with
the batch limit lowered so that it takes several batches: the same QDQ graph as onnxruntime's one pass, byte for
byte, at a16w8 and int8."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime_qnn")


@pytest.fixture(scope="module")
def vision_graph(ref_pipe, store):
    """The reference's export of the vision stage."""
    return next(store.artifacts_dir.glob("vision-onnx-vision-*/*.onnx"))


@pytest.mark.parametrize("precision", ["a16w8", "int8"])
def test_calibrated_in_batches_the_qdq_graph_is_one_passes(precision, vision_graph, tiny_model, tmp_path,
                                                           monkeypatch):
    from vlmrun_qnn_htp import calibration, calibration_batches, quantizer
    from vlmrun_qnn_htp.recipe import Recipe

    feeds, _ = calibration.calibration_samples("vision", tiny_model, None)
    recipe = Recipe(precision=precision)
    one, several = tmp_path / "one", tmp_path / "several"
    one.mkdir(), several.mkdir()
    facts_one = quantizer.quantize(vision_graph, one / "q.onnx", feeds, recipe, one)
    assert "calibration_batches" not in facts_one  # a few MB of activations: onnxruntime's own pass
    monkeypatch.setattr(calibration_batches, "BATCH_BYTES", 2_000_000)
    facts_several = quantizer.quantize(vision_graph, several / "q.onnx", feeds, recipe, several)
    assert facts_several["calibration_batches"] >= 3
    assert facts_several["stored"] == facts_one["stored"]
    assert (one / "q.onnx").read_bytes() == (several / "q.onnx").read_bytes()
    assert sorted(p.name for p in several.iterdir()) == ["q.onnx"]  # no scratch left


def test_tensors_go_in_consecutive_batches_up_to_the_limit():
    from vlmrun_qnn_htp.calibration_batches import batches

    sizes = {"a": 4, "b": 4, "c": 9, "d": 1, "e": 12, "f": 2}
    assert batches(sizes, list(sizes), 10) == [["a", "b"], ["c", "d"], ["e"], ["f"]]
    assert batches(sizes, list(sizes), 100) == [list(sizes)]
    assert np.sum([sizes[n] for g in batches(sizes, list(sizes), 10) for n in g]) == sum(sizes.values())


def test_a_graph_under_the_limit_is_decided_from_its_weightless_proto(vision_graph, tmp_path, monkeypatch):
    """The bound from the weightless proto covers what onnxruntime would calibrate; under the limit no calibrator is
    built (a decoder part's would load its weights a second time just to be measured)."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantType
    from onnxruntime.quantization import calibrate as ort_calibrate
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config
    from vlmrun_qnn_htp import calibration_batches
    from vlmrun_qnn_htp.calibration import Reader

    proto = onnx.load(str(vision_graph), load_external_data=False)
    bound = calibration_batches.activation_bound(proto)
    config = get_qnn_qdq_config(str(vision_graph), Reader([]), calibrate_method=CalibrationMethod.MinMax,
                                activation_type=QuantType.QUInt16, weight_type=QuantType.QInt8)
    probe = ort_calibrate.MinMaxCalibrater(str(vision_graph), config.op_types_to_quantize,
                                           str(tmp_path / "probe.onnx"))
    tensors, infos = probe.select_tensors_to_calibrate(probe.model)
    exact = sum(calibration_batches.tensor_bytes(infos[n]) for n in tensors)
    assert 0 < exact <= bound < 4 * exact  # an upper bound, not a wild one

    def no_calibrator(*args, **kwargs):
        raise AssertionError("a calibrator was built for a graph under the limit")

    monkeypatch.setattr(ort_calibrate, "MinMaxCalibrater", no_calibrator)
    assert calibration_batches.calibrate_in_batches(vision_graph, [], config, False, tmp_path, limit=bound,
                                                    proto=proto) is None
    with pytest.raises(AssertionError, match="calibrator was built"):  # over the bound: the exact probe runs
        calibration_batches.calibrate_in_batches(vision_graph, [], config, False, tmp_path, limit=bound - 1,
                                                 proto=proto)
