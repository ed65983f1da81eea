"""onnxruntime's MinMax calibration of a graph with big activations, in batches of tensors.

onnxruntime's MinMax calibrator adds a ReduceMin and a ReduceMax of every tensor it calibrates to the graph and runs
that augmented graph over the feeds. Its memory follows the activations it keeps alive, all at once: the image
encoder at 1024 x 1024 (FastVLM's, every size) peaked above 15.9 GB while quantizing to a16w8, where the plain
graph runs in 1.06 GB; 100 of its tensors at a time took 3.95 GB. So when the activations of the tensors to
calibrate (float32, from the graph's inferred shapes) sum to more than `BATCH_BYTES`, they are calibrated in
batches up to that size, one augmented graph per batch over the same feeds, fed one at a time as
``CalibStridedMinMax = 1`` feeds them. Per tensor that is the same reductions over the same values: the merged
ranges are one pass's, written as onnxruntime's calibration cache (`save_tensors_data`), which ``quantize_static``
reads instead of calibrating (tests/test_calibration_batches.py: the same QDQ graph, byte for byte).

Whether a graph needs batches is decided first from its weightless proto (`activation_bound`: every float tensor's
bytes, an upper bound of what onnxruntime would calibrate), so that a graph well under the limit (every decoder
part) is not loaded with its weights a second time just to be measured; only a graph above the bound is probed
exactly (onnxruntime's own choice of tensors).
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path

from vlmrun.cpu import onnxruntime_options

from .memory import release_memory

BATCH_BYTES = 1 << 30  # activations of the tensors one augmented graph calibrates at once

#: quantize_static's extra options that set the MinMax calibrator, and its argument names
_MINMAX_OPTIONS = (("CalibTensorRangeSymmetric", "symmetric"), ("CalibMovingAverage", "moving_average"),
                   ("CalibMovingAverageConstant", "averaging_constant"),
                   ("CalibMaxIntermediateOutputs", "max_intermediate_outputs"))


def tensor_bytes(value_info) -> int:
    """float32 bytes of a tensor from its inferred shape (an unknown dimension counts as 1)."""
    dims = value_info.type.tensor_type.shape.dim
    return 4 * math.prod(max(1, d.dim_value) for d in dims)


def activation_bound(proto) -> int | None:
    """An upper bound of the float32 bytes onnxruntime's MinMax calibrator would reduce in ``proto`` (loaded
    without its weights): every float graph input and node output, by the same shape inference the calibrator
    runs. ``None`` when a node output has no inferred type (the bound would not hold: probe exactly)."""
    import onnx

    inferred = onnx.shape_inference.infer_shapes(proto)
    graph = inferred.graph
    typed = {v.name: v for v in (*graph.input, *graph.value_info, *graph.output)}
    inits = {i.name for i in graph.initializer}
    total = 0
    for name in [i.name for i in graph.input] + [o for node in graph.node for o in node.output]:
        if not name or name in inits:
            continue
        info = typed.get(name)
        if info is None or not info.type.HasField("tensor_type"):
            return None
        if info.type.tensor_type.elem_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16):
            total += tensor_bytes(info)
    return total


def batches(sizes: dict[str, int], order: list[str], limit: int) -> list[list[str]]:
    """``order``'s tensors in consecutive batches whose ``sizes`` sum to at most ``limit`` (a bigger one alone)."""
    out: list[list[str]] = []
    total = limit + 1
    for name in order:
        if total + sizes[name] > limit:
            out.append([])
            total = 0
        out[-1].append(name)
        total += sizes[name]
    return out


def calibrate_in_batches(model_in: Path, feeds: list[dict], config, big: bool, work: Path, *, proto,
                         limit: int | None = None) -> tuple[Path, int] | None:
    """onnxruntime's calibration cache of ``model_in`` under ``config`` (the StaticQuantConfig ``quantize_static``
    gets) and the number of batches, when the activations to calibrate exceed ``limit`` (`BATCH_BYTES`) or the
    graph is ``big`` (its weights stored apart: a full-size part); ``None`` when they fit one pass of a small graph
    (onnxruntime calibrates as usual). ``proto`` is ``model_in`` loaded without its weights: whether a graph's
    `activation_bound` is under the limit is decided from it, without loading the graph (a small graph under it is
    answered ``None``, a big one calibrated in one batch); above it (or unbounded), onnxruntime's own calibrator
    measures the tensors it would reduce.

    A big graph is calibrated here even in one batch, for memory: inside ``quantize_static`` the calibrator's
    session is created beside the model the quantizer holds, and onnxruntime pre-packs its MatMul weights, one
    more copy of them; here the session is made without pre-packing (``session.disable_prepacking``: the same
    kernels on the same values, so the same ranges) and freed before ``quantize_static`` loads the graph again.
    A 1.5B lm_head's quantization peaked at 3.66 GB (4.1 copies of its weights) before, 2.93 GB (3.3) after."""
    import onnxruntime as ort
    from onnxruntime.quantization.calibrate import (CalibrationMethod, MinMaxCalibrater, TensorsData,
                                                     save_tensors_data)

    from .calibration import Reader

    limit = BATCH_BYTES if limit is None else limit
    bound = activation_bound(proto)
    fits = bound is not None and bound <= limit
    if fits and not big:
        return None
    extra = config.extra_options or {}
    options = {arg: extra[name] for name, arg in _MINMAX_OPTIONS if name in extra}
    scratch = Path(work) / "calibration-batches"
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        order, groups = None, [None]  # a big graph that fits: one batch of every tensor the calibrator selects
        if not fits:  # onnxruntime's own choice of tensors and their sizes, measured over the loaded graph
            probe = MinMaxCalibrater(str(model_in), config.op_types_to_quantize, str(scratch / "probe.onnx"),
                                     use_external_data_format=big, **options)
            tensors, value_infos = probe.select_tensors_to_calibrate(probe.model)
            order = [name for node in probe.model.graph.node for name in (*node.input, *node.output)
                     if name in tensors]
            order = list(dict.fromkeys(order + sorted(tensors)))  # graph order, each once
            del probe
            release_memory(big)
            sizes = {name: tensor_bytes(value_infos[name]) for name in order}
            if sum(sizes.values()) <= limit and not big:
                return None
            groups = batches(sizes, order, limit)
        ranges: dict = {}
        for i, group in enumerate(groups):
            chosen = None if group is None else set(group)

            class _Batch(MinMaxCalibrater):
                def select_tensors_to_calibrate(self, model):
                    found, infos = super().select_tensors_to_calibrate(model)
                    return (found if chosen is None else found & chosen), infos

                def create_inference_session(self):  # onnxruntime's, without a pre-packed copy of the weights
                    so = onnxruntime_options()
                    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
                    so.add_session_config_entry("session.disable_prepacking", "1")
                    self.infer_session = ort.InferenceSession(self.augmented_model_path, sess_options=so,
                                                              providers=self.execution_providers)

            calibrator = _Batch(str(model_in), config.op_types_to_quantize, str(scratch / f"batch{i}.onnx"),
                                use_external_data_format=big, **options)
            calibrator.augment_graph()
            calibrator.create_inference_session()
            for feed in feeds:  # one at a time, as CalibStridedMinMax = 1
                calibrator.collect_data(Reader([feed]))
            ranges.update(calibrator.compute_data().data)
            del calibrator
            release_memory(big)
            for f in scratch.glob(f"batch{i}.onnx*"):
                f.unlink()
        missing = set(order or ()) - set(ranges)
        if missing:
            raise RuntimeError(f"calibration in batches: no range for {len(missing)} tensors ({sorted(missing)[:3]})")
        cache = Path(work) / "calibration-ranges.json"
        save_tensors_data(TensorsData(CalibrationMethod.MinMax, ranges), cache)
        return cache, len(groups)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def quantize_cached(model_in: Path, dst: Path, config, cache: Path) -> None:
    """``onnxruntime.quantization.quantize(model_in, dst, config)`` with its ranges read from ``cache`` (removed
    after)."""
    from onnxruntime.quantization import quantize_static

    try:
        quantize_static(str(model_in), str(dst), None, calibrate_method=config.calibrate_method,
                        quant_format=config.quant_format, activation_type=config.activation_type,
                        weight_type=config.weight_type, op_types_to_quantize=config.op_types_to_quantize,
                        nodes_to_quantize=config.nodes_to_quantize, nodes_to_exclude=config.nodes_to_exclude,
                        per_channel=config.per_channel, reduce_range=config.reduce_range,
                        use_external_data_format=config.use_external_data_format,
                        calibration_providers=config.calibration_providers, extra_options=config.extra_options,
                        calibration_cache_path=str(cache))
    finally:
        Path(cache).unlink(missing_ok=True)
