"""One quantizer for every graph qnn_htp compiles: `quantize` applies a `.recipe.Recipe`.

Every form (vision, projector, embed, the fixed decoder's AR-N / AR-1 graphs, the parts decoder's prompt and token
graphs, and their probes) goes through `quantize`: the float ONNX graph and calibration feeds in, a QDQ ONNX
model that onnxruntime-qnn compiles out, plus the facts the manifest records. The steps:

1. ``qnn_preprocess_model(fuse_layernorm=True)``: Erf sequences fused into Gelu (the HTP refuses Erf in QDQ);
2. per-layer node sets (`.layers`): ``keep_fp`` left in float, ``keep_a16w16`` at 16 bits, ``keep_w8`` /
   ``keep_w4`` weights at 8 / 4 bits;
3. Softmax input ranges of graphs with an additive attention mask (`softmax_ranges`);
4. onnxruntime: the opset raised without the weights (`.quantizer_opset`), a big graph calibrated apart;
5. the engine:

   * ``onnxruntime`` (default): ``get_qnn_qdq_config`` + ``quantize`` with MinMax calibration; per-channel
     symmetric weights (int8; the parts form's MatMul weights int4/int8 on the output axis), LayerNorm gamma as
     asymmetric uint8 (the only form the HTP accepted), 16-bit Softmax at int8, per-layer overrides as
     ``TensorQuantOverrides``;
   * ``aimet``: `.aimet_engine` (AIMET-ONNX's QuantizationSimModel with the v79 HTP config, LPBQ,
     Sequential MSE, AdaRound).

6. what the QDQ model really stores (`.qdq_facts.stored_dtypes`).
"""

from __future__ import annotations

import importlib.util
import logging
import sys
import time
from pathlib import Path

import numpy as np
from vlmrun.onnx_files import graph_files

from .memory import in_child, peak_rss_mb, release_memory
from .qdq_facts import stored_dtypes
from .quantizer_edits import graph_edits_in_c
from .quantizer_opset import at_quantizer_opset
from .recipe import Recipe

SOFTMAX_SPAN = 64.0  # Softmax is shift-invariant: logits this far below the max weigh < 1e-27
BIG_GRAPH_BYTES = 512 * 1024 * 1024  # graphs above this (or with external data) are saved with external data
PARTS_PRECISIONS = ("w8a16", "w4a16")


def onnxruntime_tools_without_torch() -> None:
    """Register the package ``onnxruntime.tools`` without running its ``__init__``, which imports torch whenever
    torch is installed (5.5 s of an 11.6 s tiny-graph quantization, profiled) to re-export a torch export helper
    that quantization never calls. Its submodules (the QNN preprocessing's model utilities) import as usual;
    nothing changes when the package is already imported."""
    if "onnxruntime.tools" in sys.modules:
        return
    import onnxruntime

    spec = importlib.util.find_spec("onnxruntime.tools")
    if spec is None or spec.submodule_search_locations is None:
        return
    tools = importlib.util.module_from_spec(spec)  # a package with its __path__, its __init__ not run
    sys.modules["onnxruntime.tools"] = tools
    onnxruntime.tools = tools


def is_big(path: Path) -> bool:
    """A graph with its weights outside it, or a big one: quantized in a child process, saved with external data."""
    return len(graph_files(path)) > 1 or path.stat().st_size > BIG_GRAPH_BYTES


def quantize(src: Path, dst: Path, feeds: list[dict] | Path, recipe: Recipe, work: Path,
             layers: dict | None = None) -> dict:
    """Write the QDQ model of ``src`` under ``recipe`` to ``dst``; return the quantization facts for the manifest.

    ``feeds``: calibration inputs (or the ``.npz`` `.calibration.spill_feeds` wrote them to); ``layers``:
    ``{option: entries}`` for the per-layer options of `.layers.LAYER_OPTIONS` (entries as
    `.layers.excluded_nodes` takes them: this graph's). A big graph (a full-size decoder part) is quantized in
    a child process (`.memory.in_child`): its peak is the child's alone and none of it outlives the step."""
    from .calibration import load_feeds, spill_feeds

    if not is_big(src):
        return _quantize(src, dst, load_feeds(feeds) if isinstance(feeds, Path) else feeds, recipe, work, layers)
    if not isinstance(feeds, Path):
        feeds = spill_feeds(feeds, work / f"{src.stem}.feeds.npz")
    facts = in_child(_quantize_from_file, src, dst, feeds, recipe, work, layers,
                     what=f"quantizing {src.name} ({recipe.describe()})")
    facts["process"] = "child (a big graph: its memory is freed before the compile)"
    return facts


def _quantize_from_file(src: Path, dst: Path, feeds: Path, recipe: Recipe, work: Path, layers: dict | None) -> dict:
    from .calibration import load_feeds

    return _quantize(src, dst, load_feeds(feeds), recipe, work, layers)


def _quantize(src: Path, dst: Path, feeds: list[dict], recipe: Recipe, work: Path, layers: dict | None) -> dict:
    """`quantize` in this process."""
    import onnx

    onnxruntime_tools_without_torch()
    from onnxruntime.quantization.execution_providers.qnn import qnn_preprocess_model

    from .layers import LAYER_OPTIONS, excluded_nodes

    big = is_big(src)
    pre = work / f"{src.stem}.pre.onnx"
    times, peaks = {}, {}
    t0 = time.perf_counter()
    ok = qnn_preprocess_model(str(src), str(pre), fuse_layernorm=True, save_as_external_data=big,
                              all_tensors_to_one_file=True, external_data_location=pre.name + ".data")
    model_in = pre if ok else src
    proto = onnx.load(str(model_in), load_external_data=False)
    times["preprocess_s"] = time.perf_counter() - t0
    peaks["preprocess"] = peak_rss_mb()
    nodes: dict[str, list[str]] = {}
    taken: set[str] = set()
    for option in LAYER_OPTIONS:  # a node in two sets goes to the first (keep_fp wins over keep_a16w16)
        entries = (layers or {}).get(option)
        if entries:
            nodes[option] = sorted(set(excluded_nodes(proto, entries, option)) - taken)
            taken |= set(nodes[option])
    t0 = time.perf_counter()
    ranges = softmax_ranges(model_in, proto, feeds, work, big) if recipe.quantizer == "onnxruntime" and any(
        "attention_mask" in f for f in feeds[:1]) else {}
    times["softmax_ranges_s"] = time.perf_counter() - t0
    peaks["softmax_ranges"] = peak_rss_mb()
    t0 = time.perf_counter()
    if recipe.quantizer == "aimet":
        from .aimet_engine import quantize_aimet

        del proto
        release_memory(big)
        facts = quantize_aimet(model_in, dst, feeds, recipe, work, nodes, big)
    else:
        facts = _onnxruntime(model_in, proto, dst, feeds, recipe, nodes, ranges, big, work)
    times["calibrate_quantize_s"] = time.perf_counter() - t0
    peaks["calibrate_quantize"] = peak_rss_mb()
    for f in work.glob(f"{src.stem}.pre.onnx*"):
        f.unlink()
    facts["recipe"] = recipe.describe()
    facts.update(engine_version(recipe))
    if ranges:
        facts["softmax_input"] = f"calibrated max - {SOFTMAX_SPAN:g} .. max (the additive mask saturates)"
    for option, names in nodes.items():
        entry = {"layers": [e[0] for e in layers[option]], "nodes": len(names)}
        facts[{"keep_fp": "kept_fp", "keep_a16w16": "a16w16"}.get(option, option)] = {
            **entry, **facts.pop(f"_{option}", {})}
    if "a16w16" in facts:
        facts["a16w16"]["qdq_16bit"] = count_16bit_qdq(dst, nodes["keep_a16w16"])
    facts["stored"] = stored_dtypes(dst)
    facts["calibration_feeds"] = len(feeds)
    facts["times"] = {k: round(v, 3) for k, v in times.items()}
    facts["peak_rss_mb_after"] = peaks
    return facts


def engine_version(recipe: Recipe) -> dict:
    """The engine and its version, for the manifest."""
    from importlib.metadata import PackageNotFoundError, version

    dist = "aimet-onnx" if recipe.quantizer == "aimet" else "onnxruntime"
    try:
        return {"quantizer": recipe.quantizer, "quantizer_version": version(dist)}
    except PackageNotFoundError:
        return {"quantizer": recipe.quantizer}


def _onnxruntime(model_in: Path, proto, dst: Path, feeds: list[dict], recipe: Recipe, nodes: dict, ranges: dict,
                 big: bool, work: Path) -> dict:
    """onnxruntime's QNN-aware QDQ recipe (see the module docstring)."""
    from onnxruntime.quantization import CalibrationMethod, QuantType
    from onnxruntime.quantization import quantize as ort_quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config

    from .calibration import Reader
    from .calibration_batches import calibrate_in_batches, quantize_cached
    from .qdq_inputs import quantize_where_inputs

    parts = recipe.precision in PARTS_PRECISIONS
    inits = {i.name: list(i.dims) for i in proto.graph.initializer}
    overrides: dict[str, list[dict]] = {}
    facts: dict = {}
    n_mm = 0
    for node in proto.graph.node:
        if node.op_type == "LayerNormalization" and len(node.input) > 1 and node.input[1] in inits:
            overrides[node.input[1]] = [{"quant_type": QuantType.QUInt8, "symmetric": False}]
        if node.op_type == "Softmax" and recipe.precision == "int8":
            overrides[node.output[0]] = [{"quant_type": QuantType.QUInt16}]
        if parts and node.op_type == "MatMul" and len(node.input) > 1 and len(inits.get(node.input[1], [])) == 2:
            wq = QuantType.QInt4 if recipe.weight_bits == 4 else QuantType.QInt8
            overrides[node.input[1]] = [{"quant_type": wq, "symmetric": True, "axis": 1}]  # [K, N]: per output
            n_mm += 1
    for name, (lo, hi) in ranges.items():
        o = {"rmin": np.float32(lo), "rmax": np.float32(hi)}
        if recipe.precision == "int8":  # the 16-bit Softmax takes its input at 16 bits too
            o["quant_type"] = QuantType.QUInt16
        overrides.setdefault(name, [{}])[0].update(o)
    for option, bits in (("keep_w8", 8), ("keep_w4", 4)):
        if nodes.get(option):
            facts[f"_{option}"] = {"weights": weight_bits_overrides(proto, nodes[option], bits, overrides)}
    if nodes.get("keep_a16w16"):
        facts["_keep_a16w16"] = a16w16_overrides(proto, nodes["keep_a16w16"], overrides)
    act = QuantType.QUInt8 if recipe.activation_bits == 8 else QuantType.QUInt16
    config = get_qnn_qdq_config(
        str(model_in), Reader(feeds), calibrate_method=CalibrationMethod.MinMax, activation_type=act,
        weight_type=QuantType.QInt8, per_channel=True, init_overrides=overrides or None,
        nodes_to_exclude=nodes.get("keep_fp") or None,
    )
    config.use_external_data_format = big
    if big:  # MinMax over the feeds one at a time (ranges merged feed by feed: the same min/max)
        config.extra_options["CalibStridedMinMax"] = 1
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # onnxruntime.quantization warns through the root logger ("consider pre-processing")
    try:
        with at_quantizer_opset(model_in, proto, config, work) as (graph, graph_proto), graph_edits_in_c():
            batched = calibrate_in_batches(graph, feeds, config, big, work, proto=graph_proto)
            if batched is None:
                ort_quantize(str(graph), str(dst), config)
            else:
                quantize_cached(graph, dst, config, batched[0])
                facts["calibration_batches"] = batched[1]
    finally:
        root.setLevel(level)
    where_inputs = quantize_where_inputs(dst)
    if where_inputs:
        facts["inputs_quantized_at_their_where"] = len(where_inputs)
    facts["activation"] = act.name
    if recipe.precision == "int8":
        facts["softmax"] = "QUInt16"
    if parts:
        facts["weights"] = (f"{'QInt4' if recipe.weight_bits == 4 else 'QInt8'} per-channel symmetric ({n_mm} MatMul"
                            " weights)")
    else:
        facts["weights"] = "QInt8 per-channel"
    return facts


#: the inputs of these ops that are weights (quantized as symmetric int16 under keep_a16w16); biases stay int32
WEIGHT_INPUTS = {"Conv": (1,), "ConvTranspose": (1,), "MatMul": (1,), "Gemm": (1,)}
BIAS_INPUTS = {"Conv": (2,), "ConvTranspose": (2,), "Gemm": (2,), "LayerNormalization": (2,)}
#: constant inputs left at the stage's recipe: the HTP rejects LayerNormalization with a 16-bit gamma
#: ("Unsupported nodes in QNN EP: LayerNormalization" with a QUInt16 gamma; QUInt8 asymmetric, as above, compiles)
RECIPE_INPUTS = {"LayerNormalization": (1,)}


def a16w16_overrides(proto, nodes, overrides: dict) -> dict:
    """Add 16-bit tensor overrides (onnxruntime's ``TensorQuantOverrides``) for the nodes named ``nodes`` of
    ``proto`` to ``overrides``, in place: every float output as QUInt16 (ranges already set stay), every float
    weight input (`WEIGHT_INPUTS`) as symmetric QInt16 (per-channel where the stage's recipe is), other float
    constant inputs (elementwise constants) as QUInt16; biases are int32 from their input scales; LayerNorm gamma
    keeps the stage's QUInt8 (`RECIPE_INPUTS`, counted as ``kept_8bit``).
    ``get_qnn_qdq_config`` then converts 8 <-> 16 bits where the layer meets the rest of the graph. Returns the
    counts for the manifest."""
    import onnx
    from onnxruntime.quantization import QuantType

    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16)
    inferred = onnx.shape_inference.infer_shapes(proto)
    g = inferred.graph
    float_t = {v.name for v in (*g.value_info, *g.output, *g.input)
               if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type in floats}
    inits = {i.name: i for i in proto.graph.initializer}
    chosen = set(nodes)
    acts, weights, consts, kept = set(), set(), set(), set()
    for node in proto.graph.node:
        if node.name not in chosen:
            continue
        for o in node.output:
            if o in float_t:
                overrides.setdefault(o, [{}])[0]["quant_type"] = QuantType.QUInt16
                acts.add(o)
        for k, name in enumerate(node.input):
            init = inits.get(name)
            if init is None or init.data_type not in floats or k in BIAS_INPUTS.get(node.op_type, ()):
                continue
            if k in RECIPE_INPUTS.get(node.op_type, ()):
                kept.add(name)
                continue
            if k in WEIGHT_INPUTS.get(node.op_type, ()):
                overrides[name] = [{"quant_type": QuantType.QInt16, "symmetric": True}]
                weights.add(name)
            else:
                overrides[name] = [{"quant_type": QuantType.QUInt16, "symmetric": False}]
                consts.add(name)
    return {"activations": len(acts), "weights": len(weights), "constants": len(consts), "kept_8bit": len(kept)}


def weight_bits_overrides(proto, nodes, bits: int, overrides: dict) -> int:
    """Set the MatMul / Conv / Gemm weights of the nodes named ``nodes`` to ``bits``-bit symmetric per-channel
    (``layer_precision`` ``w8`` / ``w4``), in place; the number of weights set."""
    from onnxruntime.quantization import QuantType

    inits = {i.name: list(i.dims) for i in proto.graph.initializer}
    chosen, n = set(nodes), 0
    q = QuantType.QInt4 if bits == 4 else QuantType.QInt8
    for node in proto.graph.node:
        if node.name in chosen and node.op_type in WEIGHT_INPUTS and len(node.input) > 1 and node.input[1] in inits:
            axis = 1 if node.op_type == "MatMul" else 0  # MatMul [K, N]; Conv / Gemm [N, ...]
            overrides[node.input[1]] = [{"quant_type": q, "symmetric": True, "axis": axis}]
            n += 1
    return n


def count_16bit_qdq(path: Path, nodes) -> dict:
    """16-bit QuantizeLinear / DequantizeLinear nodes of the QDQ model at ``path``: in all, and those feeding or fed
    by the nodes named ``nodes`` (the layers kept at a16w16)."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(path), load_external_data=False)
    zp = {i.name: numpy_helper.to_array(i).dtype.name for i in m.graph.initializer}
    chosen = set(nodes)
    touch = {t for n in m.graph.node if n.name in chosen for t in (*n.input, *n.output)}
    total = near = 0
    for n in m.graph.node:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear") and len(n.input) > 2 \
                and zp.get(n.input[2]) in ("uint16", "int16"):
            total += 1
            near += bool(touch.intersection((*n.input, *n.output)))
    return {"total": total, "at_layers": near}


def softmax_ranges(model_in: Path, proto, feeds: list[dict], work: Path, big: bool) -> dict[str, tuple[float, float]]:
    """Ranges for the Softmax inputs of a graph with an additive attention mask.

    MinMax over ``scores + mask`` spans the mask's -65504, which leaves the scores a step of ~1 at 16 bits
    (~257 at 8 bits). The range is set to [max - SOFTMAX_SPAN, max] instead, ``max`` calibrated on the same
    feeds with the float graph: masked entries saturate at the bottom, where exp() is already 0. The range is
    carried back through Casts (``scores.float()``) to the Add of the mask.
    """
    import onnx

    from .calibration import cpu_session

    names = [n.input[0] for n in proto.graph.node if n.op_type == "Softmax"]
    if not names:
        return {}
    aug = onnx.load(str(model_in))
    known = {o.name for o in aug.graph.output}
    for n in names:
        if n not in known:
            aug.graph.output.append(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None))
    path = work / "softmax_ranges.onnx"
    if big:
        onnx.save_model(aug, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=path.name + ".data")
    else:
        onnx.save(aug, str(path))
    del aug
    sess = cpu_session(path)
    hi = dict.fromkeys(names, -np.inf)
    for f in feeds:
        for n, v in zip(names, sess.run(names, f)):
            hi[n] = max(hi[n], float(np.max(v)))
    del sess
    ranges = {n: (h - SOFTMAX_SPAN, h) for n, h in hi.items()}
    producers = {o: node for node in proto.graph.node for o in node.output}
    for n, r in list(ranges.items()):
        p = producers.get(n)
        while p is not None and p.op_type == "Cast":
            ranges[p.input[0]] = r
            p = producers.get(p.input[0])
    for f in work.glob("softmax_ranges.onnx*"):
        f.unlink()
    return ranges
