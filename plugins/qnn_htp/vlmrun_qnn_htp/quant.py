"""int8 for the HTP: static QDQ with the QNN-aware recipe (see reference/qualcomm.md).

* ``qnn_preprocess_model(fuse_layernorm=True)`` (fuses Erf sequences into Gelu, which the HTP takes in QDQ)
* ``get_qnn_qdq_config(per_channel=True, weight_type=QInt8, MinMax)``
* LayerNormalization gamma as asymmetric uint8 (the only form the HTP accepted)
* Softmax outputs at 16 bits (8-bit Softmax zeroes attention over many keys)
* option ``keep_a16w16``: the named layers' activations and weights at 16 bits (per-tensor overrides)

``precision``: ``int8`` = a8w8 with 16-bit Softmax; ``a16w8`` = 16-bit activations, 8-bit weights.
Calibration: images from a folder (preprocessed like real inputs) or, when none is given, random data that
the manifest labels ``"calibration": "random"`` (vision, projector). ``embed`` calibrates on token ids
(templated prompts, a vocabulary sweep and the table's extreme rows). ``decoder`` (fixed-KV AR-N / AR-1)
calibrates on feeds recorded from the host loop driven by the float graph on the CPU over the reference
pipeline's prompt embeddings of the calibration images (the demo image when none are given).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from vlmrun.errors import UsageError

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff"}
RANDOM_SAMPLES = 4


def calibration_files(folder: str | Path | None) -> list[Path]:
    if not folder:
        return []
    d = Path(folder).expanduser()
    if not d.is_dir():
        raise UsageError(f"--calibration-images {folder} is not a directory")
    files = sorted(p for p in d.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not files:
        raise UsageError(f"--calibration-images {folder} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    return files


def calibration_digest(folder: str | Path | None) -> str | None:
    """A digest of the calibration images (part of the artifact key), or None for random calibration."""
    files = calibration_files(folder)
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


CALIBRATION_PROMPTS = ("Describe the image.", "What is in the picture?", "What colour is the sky? Answer briefly.")
EMBED_CALIBRATION = "token-ids-v1"   # the calibration key of embed (no images)
DECODER_CALIBRATION = "demo-image-v1"  # the decoder's calibration key when no images are given
DECODER_GEN_STEPS = 8      # greedy tokens decoded (by the float graph) after each calibration prompt
DECODER_MAX_SAMPLES = 64   # feeds kept per decoder graph (evenly spaced over the recorded calls)


def calibration_samples(stage: str, model, folder, seed: int = 0, source=None,
                        context=None) -> tuple[list[dict], str]:
    """Input feeds for calibrating ``stage`` and a label saying where they came from.

    ``source`` (the exported ONNX artifact being quantized) is needed for ``embed`` and ``decoder``;
    ``context`` (the compile request's :class:`vlmrun.stages.CompileContext`) gives the reference activations
    the projector (with images) and the decoder calibrate on.
    """
    files = calibration_files(folder)
    rng = np.random.default_rng(seed)
    if stage == "vision":
        if files:
            from vlmrun.preprocess import load_image, preprocess_image

            feeds = [{"pixel_values": preprocess_image(load_image(f), model.image_processor_config)} for f in files]
            return feeds, f"images:{len(files)}"
        S = model.image_size
        return ([{"pixel_values": rng.random((1, 3, S, S), dtype=np.float32)} for _ in range(RANDOM_SAMPLES)],
                "random")
    if stage == "projector":
        if files:
            return (_require(context).reference_inputs(files),
                    f"images:{len(files)} (through the reference fp32 vision stage)")
        shape = (1, model.image_tokens, model.feature_dim)
        return [{"image_features": rng.standard_normal(shape).astype(np.float32)} for _ in range(RANDOM_SAMPLES)], \
            "random"
    if stage == "embed":
        return _embed_samples(model, source.file())
    if stage == "decoder":
        return _decoder_samples(model, source, files, _require(context))
    raise UsageError(f"int8 is not available for stage '{stage}' on qnn_htp; use --precision fp16")


def _require(context):
    if context is None:
        raise UsageError("calibrating this stage needs reference activations: compile it through a pipeline"
                         " (vlmrun compile), which gives the compiler its context")
    return context


def _ort_cpu(path):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _embed_table(path) -> np.ndarray:
    import onnx
    from onnx import numpy_helper

    proto = onnx.load(str(path))
    big = max(proto.graph.initializer, key=lambda t: int(np.prod(t.dims)))
    return numpy_helper.to_array(big)


def _embed_samples(model, path) -> tuple[list[dict], str]:
    """Token ids in chunks of the graph's static length: the chat-templated calibration prompts, an even
    sweep over the vocabulary, and the rows holding the table's extremes (so MinMax covers every row)."""
    from vlmrun.preprocess import render_prompt, tokenize_prompt

    seq = int(_ort_cpu(path).get_inputs()[0].shape[1])
    table = _embed_table(path)
    V = table.shape[0]
    ids: list[int] = []
    for p in CALIBRATION_PROMPTS:
        text = render_prompt(model.chat_template, p)
        t, _ = tokenize_prompt(model.tokenizer, text, model.image_token_id, model.image_tokens)
        ids += [int(i) for i in t[0]]
    n_prompt = len(ids)
    sweep = np.linspace(0, V - 1, num=min(V, 4 * seq), dtype=np.int64)
    extremes = np.unique(np.concatenate([np.unravel_index([table.argmin(), table.argmax()], table.shape)[0],
                                         np.abs(table).max(axis=1).argsort()[-seq // 2:]]))
    ids += [int(i) for i in sweep] + [int(i) for i in extremes]
    ids += [0] * (-len(ids) % seq)
    arr = np.asarray(ids, np.int64).reshape(-1, seq)
    feeds = [{"input_ids": row[None]} for row in arr]
    return feeds, (f"token-ids:{len(ids)} ({n_prompt} from {len(CALIBRATION_PROMPTS)} templated prompts,"
                   f" {len(sweep)} vocabulary sweep, {len(extremes)} extreme rows)")


class _Recorder:
    """Wraps a float ONNX session as a FixedKVDecoder graph and keeps a copy of every feed."""

    def __init__(self, sess):
        self.sess = sess
        self.outputs = [o.name for o in sess.get_outputs()]
        self.feeds: list[dict] = []

    def run(self, feeds: dict) -> dict:
        self.feeds.append({k: np.array(v, copy=True) for k, v in feeds.items()})
        return dict(zip(self.outputs, self.sess.run(self.outputs, feeds)))


def _decoder_samples(model, source, files, context) -> tuple[list[dict], str]:
    """Realistic feeds for one fixed-KV graph: the host loop (:class:`.decoder.FixedKVDecoder`) driven over the
    reference prompt embeddings with the float graph on the onnxruntime CPU, prefill then greedy decode;
    every call's feeds (mask, positions, past KV from the real prefill) are recorded."""
    from .decoder import FixedKVDecoder

    sess = _ort_cpu(source.file())
    shapes = {i.name: i.shape for i in sess.get_inputs()}
    ar, ctx = int(shapes["attention_mask"][2]), int(shapes["attention_mask"][3])
    rec = _Recorder(sess)
    dec = FixedKVDecoder({ar: rec, 1: rec}, ctx, model, min_chunk=1)  # min_chunk 1: only this AR is picked
    # the calibration images with one prompt each, or the demo image with every prompt
    prompts = [CALIBRATION_PROMPTS[i % len(CALIBRATION_PROMPTS)] for i in range(len(files))] or CALIBRATION_PROMPTS
    embeds = [f["inputs_embeds"] for f in context.reference_inputs(files or None, prompts)]
    embed_tokens, what = context.embed_tokens, (f"images:{len(files)}" if files else "demo image")
    for e in embeds:
        e = e[:, : max(1, ctx - ar - DECODER_GEN_STEPS)].astype(np.float32)
        dec.reset()
        logits = dec.prefill(e)
        for _ in range(DECODER_GEN_STEPS):
            if dec.n_past + ar > ctx:
                break
            tok = int(np.argmax(logits[0, -1]))
            logits = dec._step(embed_tokens(np.array([tok])), ar)
    feeds = rec.feeds
    if len(feeds) > DECODER_MAX_SAMPLES:
        keep = np.unique(np.linspace(0, len(feeds) - 1, DECODER_MAX_SAMPLES).round().astype(int))
        feeds = [feeds[i] for i in keep]
    label = (f"{what} x {len(embeds)} prompt(s), reference (ort_reference) prompt embeddings through the"
             f" float AR-{ar} graph on the CPU (prefill + {DECODER_GEN_STEPS} greedy steps): {len(feeds)} of"
             f" {len(rec.feeds)} host-loop feeds")
    return feeds, label


class _Reader:
    """onnxruntime's CalibrationDataReader over a list of feeds; ``set_range`` lets the calibrator take them in
    strides (``CalibStridedMinMax``: ranges merged stride by stride, so only one stride's activations are held)."""

    def __init__(self, feeds):
        self.feeds = list(feeds)
        self._it = iter(self.feeds)

    def __len__(self):
        return len(self.feeds)

    def get_next(self):
        return next(self._it, None)

    def set_range(self, start_index: int, end_index: int):
        self._it = iter(self.feeds[start_index:end_index])

    def rewind(self):  # some ORT versions call it
        self._it = iter(self.feeds)


def quantize_qdq(src: Path, dst: Path, feeds: list[dict], precision: str, work: Path, keep_fp=None,
                 keep_a16w16=None) -> dict:
    """Write a QDQ model of ``src`` to ``dst``; return the quantization facts for the manifest.

    ``keep_fp``: layers / node prefixes left in float (:func:`.probe.excluded_nodes`, option ``keep_fp``);
    ``keep_a16w16``: layers / node prefixes quantized at 16 bits, activations and weights (:func:`a16w16_overrides`)."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config, qnn_preprocess_model

    pre = work / "preprocessed.onnx"
    model_in = pre if qnn_preprocess_model(str(src), str(pre), fuse_layernorm=True) else src
    proto = onnx.load(str(model_in))
    inits = {i.name for i in proto.graph.initializer}
    overrides: dict[str, list[dict]] = {}
    for node in proto.graph.node:
        if node.op_type == "LayerNormalization" and len(node.input) > 1 and node.input[1] in inits:
            overrides[node.input[1]] = [{"quant_type": QuantType.QUInt8, "symmetric": False}]
        if node.op_type == "Softmax" and precision == "int8":
            overrides[node.output[0]] = [{"quant_type": QuantType.QUInt16}]
    softmax_ranges = _masked_softmax_ranges(model_in, proto, feeds, work) if any(
        "attention_mask" in f for f in feeds[:1]) else {}
    for name, (lo, hi) in softmax_ranges.items():
        o = {"rmin": np.float32(lo), "rmax": np.float32(hi)}
        if precision == "int8":  # the 16-bit Softmax takes its input at 16 bits too
            o["quant_type"] = QuantType.QUInt16
        overrides.setdefault(name, [{}])[0].update(o)
    act = QuantType.QUInt16 if precision == "a16w8" else QuantType.QUInt8
    excluded = []
    if keep_fp:
        from .probe import excluded_nodes

        excluded = excluded_nodes(proto, keep_fp)
    wide, wide_facts = [], {}
    if keep_a16w16:
        from .probe import excluded_nodes

        wide = sorted(set(excluded_nodes(proto, keep_a16w16, "keep_a16w16")) - set(excluded))
        wide_facts = a16w16_overrides(proto, wide, overrides)
    config = get_qnn_qdq_config(
        str(model_in), _Reader(feeds), calibrate_method=CalibrationMethod.MinMax, activation_type=act,
        weight_type=QuantType.QInt8, per_channel=True, init_overrides=overrides or None,
        nodes_to_exclude=excluded or None,
    )
    import logging

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # onnxruntime.quantization warns through the root logger ("consider pre-processing")
    try:
        quantize(str(model_in), str(dst), config)
    finally:
        root.setLevel(level)
    facts = {"activation": act.name, "weights": "QInt8 per-channel", "softmax": "QUInt16" if precision == "int8"
             else act.name, "layernorm_gamma": "QUInt8 asymmetric", "io_quant": io_quant(dst)}
    if softmax_ranges:
        facts["softmax_input"] = f"calibrated max - {SOFTMAX_SPAN:g} .. max (the additive mask saturates)"
    if keep_fp:
        facts["kept_fp"] = {"layers": [e[0] for e in keep_fp], "nodes": len(excluded)}
    if keep_a16w16:
        facts["a16w16"] = {"layers": [e[0] for e in keep_a16w16], "nodes": len(wide), **wide_facts,
                           "qdq_16bit": count_16bit_qdq(dst, wide)}
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
    weight input (:data:`WEIGHT_INPUTS`) as symmetric QInt16 (per-channel where the stage's recipe is), other float
    constant inputs (elementwise constants) as QUInt16; biases are int32 from their input scales; LayerNorm gamma
    keeps the stage's QUInt8 (:data:`RECIPE_INPUTS`, counted as ``kept_8bit``).
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


SOFTMAX_SPAN = 64.0  # Softmax is shift-invariant: logits this far below the max weigh < 1e-27


def _masked_softmax_ranges(model_in: Path, proto, feeds: list[dict], work: Path) -> dict[str, tuple[float, float]]:
    """Ranges for the Softmax inputs of a graph with an additive attention mask.

    MinMax over ``scores + mask`` spans the mask's -65504, which leaves the scores a step of ~1 at 16 bits
    (~257 at 8 bits). The range is set to [max - SOFTMAX_SPAN, max] instead, ``max`` calibrated on the same
    feeds with the float graph: masked entries saturate at the bottom, where exp() is already 0.
    """
    import onnx
    import onnxruntime as ort

    names = [n.input[0] for n in proto.graph.node if n.op_type == "Softmax"]
    if not names:
        return {}
    aug = onnx.load(str(model_in))
    known = {o.name for o in aug.graph.output}
    for n in names:
        if n not in known:
            aug.graph.output.append(onnx.helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, None))
    path = work / "softmax_ranges.onnx"
    onnx.save(aug, str(path))
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    hi = dict.fromkeys(names, -np.inf)
    for f in feeds:
        for n, v in zip(names, sess.run(names, f)):
            hi[n] = max(hi[n], float(np.max(v)))
    ranges = {n: (h - SOFTMAX_SPAN, h) for n, h in hi.items()}
    producers = {o: node for node in proto.graph.node for o in node.output}
    for n, r in list(ranges.items()):  # through a Cast (scores.float()) to the Add of the mask
        p = producers.get(n)
        while p is not None and p.op_type == "Cast":
            ranges[p.input[0]] = r
            p = producers.get(p.input[0])
    return ranges


def io_quant(path: Path) -> dict:
    """Scale/offset (QNN convention, offset = -zero_point) of the Q/DQ pairs at the graph inputs and outputs."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(path))
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    consts = {}
    for n in m.graph.node:
        if n.op_type == "Constant":
            consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    vals = {**inits, **consts}
    ins = {i.name for i in m.graph.input}
    outs = {o.name for o in m.graph.output}
    result = {}
    for n in m.graph.node:
        if n.op_type == "QuantizeLinear" and n.input[0] in ins:
            name = n.input[0]
        elif n.op_type == "DequantizeLinear" and n.output[0] in outs:
            name = n.output[0]
        else:
            continue
        scale = vals.get(n.input[1])
        zp = vals.get(n.input[2]) if len(n.input) > 2 else None
        if scale is None or np.size(scale) != 1:
            continue
        dtype = zp.dtype.name if zp is not None else "uint8"
        result[name] = {"scale": float(scale), "offset": -int(zp) if zp is not None else 0, "dtype": dtype}
    return result
