"""The decoder in the form Qualcomm ships LLMs to the HTP (``decoder_form = "parts"``).

Form (export ``decoder/parts``, :mod:`vlmrun_ort_reference.decoder_parts`):

* the decoder split into P parts of consecutive layers, the last part with the final norm and the lm_head;
* each part as two graphs in Genie's I/O layout: "prompt" (AR-N rows, default 128, capped at the hidden size
  because Genie reads AR from embedding inputs as elements / largest dim) and "token" (AR-1), both at one fixed
  context C; inputs ``inputs_embeds`` (first part) or ``residual_{lo}`` (the residual stream from the previous
  part), ``attention_mask`` [1,T,C], ``position_ids_cos``/``_sin``, the part's past keys (transposed,
  [KV,1,D,C-T]) and values; outputs only the NEW keys/values of the part's layers, plus ``residual_{hi}`` or,
  from the last part, ``logits``;
* graph names ``{prompt|token}_ar{T}_cl{C}_..._{k}_of_{P}``: Genie orders the parts of one (AR, CL) by that suffix;
* precision ``fp16``, ``w8a16`` or ``w4a16``: 16-bit activations (QUInt16) with int8 or int4 per-channel
  symmetric weights (every MatMul weight, lm_head included), through onnxruntime's QNN-aware QDQ recipe;
  other parameters (RMSNorm gains) int8, biases int32. Calibration: the host loop over the float part graphs on
  the CPU, fed the reference prompt embeddings of the calibration images (the demo image by default) and 8
  greedy tokens, once with the prompt graphs and once with the token graphs only; the attention mask is
  clipped at :data:`MASK_CLIP` in the calibration feeds, so its 16-bit range is [-100, 0] and any larger
  negative a runtime feeds (vlmrun's -65504, Genie's own) saturates there;
* ``weight_sharing``: ``on`` puts each part's prompt and token graphs in ONE context binary that holds the
  weights once (onnxruntime-qnn ``ep.share_ep_contexts``: one ``.bin`` per part, two ``_ctx.onnx`` wrappers);
  ``off`` compiles each graph into its own binary (the same graphs, the weights twice). ``auto`` (default) is
  ``on`` except on the x86_64 HTP emulator, which cannot load weight-shared binaries (below).

The number of parts (option ``parts``, 0 = auto) is the fewest whose estimated part binary stays under
``part_limit_mb`` (default :data:`DEFAULT_PART_LIMIT_MB` MB = 1 GB: the HTP is a 32-bit co-processor and one
context must map into its address space; qai-hub-models ships ~1 GB parts). Layers are spread so the parts'
weights are balanced, the lm_head counting toward the last part. Every compiled part is checked against the
limit.

Running: the host engine (:class:`PartsDecoder`, vlmrun's loop: diffs, teacher forcing) and the Genie engine
(:class:`GeniePartsHandle`: libGenie, ``ctx-bins`` = the part binaries in order) both run the binaries of one
compiled artifact.

Weight-shared binaries on this machine: the HTP emulator inside onnxruntime-qnn 2.7.0 (QNN 2.51, libQnnHtp.so
on x86_64) refuses them in ``QnnContext_createFromBinary`` with "<E> Shared weights buffer isn't supported on this
platform" / "Fail to create context from binary with err 1000" (QNN_COMMON_ERROR_NOT_SUPPORTED), then calls a
NULL function pointer while cleaning up the half-made context: a segfault, through onnxruntime and through
libGenie alike. ``QnnContext_createFromBinaryListAsync`` (``htp_share_resource_optimization``) is not supported
by that backend either. So vlmrun never opens a weight-shared binary on the emulator: it says so in one line
(:func:`check_loadable`).
"""

from __future__ import annotations

import json
import platform
import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from vlmrun.errors import BackendError, UsageError
from vlmrun.handles import DecoderHandle
from vlmrun_qualcomm.manifest import ContextManifest, describe_ctx_onnx

from . import ep, quant

PRECISIONS = ("fp16", "w8a16", "w4a16")
ALIASES = {"a16w8": "w8a16"}  # the fixed form's name for the same recipe
SHARING = ("auto", "on", "off")
DEFAULT_PREFILL_AR = 128
DEFAULT_PART_LIMIT_MB = 1000  # MB (10^6 bytes) per part binary
WEIGHT_BITS = {"fp16": 16, "w8a16": 8, "w4a16": 4}
OVERHEAD = 1.08  # estimated binary bytes / weight bytes (graph, I/O and spill buffers, biases), from measurements
MASK_CLIP = -100.0  # quantized forms: the mask range the calibration sees (larger negatives saturate here)
GEN_STEPS = 8  # greedy tokens decoded after each calibration prompt
PROMPT_GEN_STEPS = 8  # ... for the prompt graph's calibration (each a whole AR-N call for one real row)
MAX_SAMPLES = 64  # calibration feeds kept per graph
CALIBRATION = "parts-demo-image-v1"  # the calibration key when no images are given
EMULATOR_REFUSAL = ("the x86_64 HTP emulator of onnxruntime-qnn cannot load weight-shared context binaries (QNN:"
                    " \"Shared weights buffer isn't supported on this platform\", contextCreateFromBinary error"
                    " 1000, then a crash in its cleanup)")


# -- options ---------------------------------------------------------------------------------------------------
def is_emulator() -> bool:
    """True where the local HTP backend is onnxruntime-qnn's x86_64 emulator (not an NPU)."""
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")


def normalise(o: dict, precision: str) -> dict:
    """The parts form's options (UsageError for bad values); ``o`` is the stage's raw option dict."""
    precision = ALIASES.get(precision, precision)
    if precision not in PRECISIONS:
        raise UsageError(f"precision '{precision}' is not available for decoder_form = \"parts\" (choose"
                         f" {', '.join(PRECISIONS)})")
    sharing = str(o.get("weight_sharing") or "auto").lower()
    if sharing not in SHARING:
        raise UsageError(f"weight_sharing '{sharing}' is not one of {', '.join(SHARING)}")
    parts = int(o.get("parts") or 0)
    limit = int(o.get("part_limit_mb") or DEFAULT_PART_LIMIT_MB)
    if parts < 0 or limit < 1:
        raise UsageError("parts must be >= 0 (0 = the fewest under part_limit_mb) and part_limit_mb >= 1")
    return {"precision": precision, "weight_sharing": resolve_sharing(sharing, o.get("compiler")), "parts": parts,
            "part_limit_mb": limit, "prefill_ar": int(o.get("prefill_ar") or DEFAULT_PREFILL_AR)}


def resolve_sharing(sharing: str, compiler: str | None = None) -> str:
    """``auto``: on, except for a local compile on the x86_64 emulator; another compiler (``--compiler qaihub``)
    builds the binaries for a device, so shared there."""
    if sharing == "auto":
        if compiler and str(compiler) != "qnn_htp":
            return "on"
        return "off" if is_emulator() else "on"
    return sharing


# -- planning ----------------------------------------------------------------------------------------------------
def weight_counts(model) -> tuple[int, int, int]:
    """(MatMul weight elements per layer, other parameters per layer, lm_head elements) from the model config."""
    H, nh, kv, D = model.hidden_size, model.num_heads, model.num_kv_heads, model.head_dim
    inter = int(model.text_config.get("intermediate_size") or 4 * H)
    mm = H * nh * D * 2 + H * kv * D * 2 + 3 * H * inter  # q, o, k, v, gate, up, down
    other = nh * D + 2 * kv * D + 2 * H  # q/k/v biases, two RMSNorm gains
    return mm, other, model.vocab_size * H


def estimate_bytes(model, precision: str, layers: int, last: bool) -> int:
    """Estimated bytes of a part binary holding ``layers`` layers (+ norm and lm_head when ``last``)."""
    mm, other, head = weight_counts(model)
    bits = WEIGHT_BITS[precision]
    mm_bytes = (layers * mm + (head if last else 0)) * bits / 8
    rest = layers * other * (2 if precision == "fp16" else 4) + (model.hidden_size * 2 if last else 0)
    return int((mm_bytes + rest) * OVERHEAD)


def split_layers(model, precision: str, parts: int) -> list[int]:
    """Layers per part for ``parts`` parts: the split with the smallest largest part (lm_head in the last)."""
    L = model.num_layers
    if parts > L:
        raise UsageError(f"parts = {parts} exceeds the model's {L} layers")
    if parts == 1:
        return [L]
    best = None
    for last in range(1, L - parts + 2):
        rest = L - last
        base, extra = divmod(rest, parts - 1)
        counts = [base + (1 if i < extra else 0) for i in range(parts - 1)] + [last]
        if min(counts) < 1:
            continue
        worst = max(estimate_bytes(model, precision, c, i == parts - 1) for i, c in enumerate(counts))
        if best is None or worst < best[0]:
            best = (worst, counts)
    return best[1]


def plan(model, opts: dict) -> dict:
    """The parts, AR and context the form is exported with (the ``decoder/parts`` export params)."""
    precision, limit = opts["precision"], opts["part_limit_mb"] * 1_000_000
    parts = opts["parts"]
    if not parts:
        for p in range(1, model.num_layers + 1):
            counts = split_layers(model, precision, p)
            if max(estimate_bytes(model, precision, c, i == p - 1) for i, c in enumerate(counts)) <= limit:
                parts = p
                break
        else:
            raise UsageError(f"the decoder does not fit part binaries of {opts['part_limit_mb']} MB even one layer"
                             " per part; raise part_limit_mb")
    counts = split_layers(model, precision, parts)
    ctx = int(opts["context_length"])
    # AR <= hidden: Genie reads AR from an embedding input as elements / largest dim; AR < ctx / 2: with the
    # prompt graph's past as long as its rows (AR = ctx / 2) Genie decoded wrong tokens on the emulator
    ar = max(2, min(int(opts["prefill_ar"]), model.hidden_size, (ctx - 1) // 2))
    return {"layers": counts, "ar": ar, "ctx": ctx}


# -- calibration --------------------------------------------------------------------------------------------------
class _Chain:
    """The parts of one AR run in order as one graph (``run(feeds) -> outputs``), feeds recorded per part on the
    calls ``keep`` selects."""

    def __init__(self, runners: list, keep=None, clip: float | None = None):
        self.runners, self.keep, self.clip = runners, keep, clip
        self.calls = 0
        self.recorded: list[list[dict]] = [[] for _ in runners]

    def run(self, feeds: dict) -> dict:
        record = self.keep is not None and self.calls in self.keep
        self.calls += 1
        values, out = dict(feeds), {}
        for i, r in enumerate(self.runners):
            f = {n: values[n] for n in r.input_names}
            if record:
                copy = {k: np.array(v, copy=True) for k, v in f.items()}
                if self.clip is not None and "attention_mask" in copy:
                    copy["attention_mask"] = np.maximum(copy["attention_mask"], np.float32(self.clip))
                self.recorded[i].append(copy)
            res = r.run(f)
            values.update(res)
            out.update(res)
        return out


class _CpuGraph:
    def __init__(self, path: Path):
        self.sess = quant._ort_cpu(path)
        self.input_names = [i.name for i in self.sess.get_inputs()]
        self.outputs = [o.name for o in self.sess.get_outputs()]

    def run(self, feeds: dict) -> dict:
        return dict(zip(self.outputs, self.sess.run(self.outputs, feeds)))


def calibration_feeds(model, src_dir: Path, desc: dict, files, context) -> tuple[dict, str]:
    """{(part index, "prompt"|"token"): [feeds]} recorded from the float part graphs on the CPU, and a label."""
    from vlmrun_qualcomm.genie import GenieModel

    from .genie_engine import GenieLayoutDecoder

    facts = GenieModel.from_model(model)
    ar, ctx = desc["ar"], desc["ctx"]
    prompts = [quant.CALIBRATION_PROMPTS[i % len(quant.CALIBRATION_PROMPTS)] for i in range(len(files))] or list(
        quant.CALIBRATION_PROMPTS)
    embeds = [f["inputs_embeds"][:, : max(1, ctx - ar - GEN_STEPS)].astype(np.float32)
              for f in context.reference_inputs(files or None, prompts)]
    out: dict = {}
    for kind, rows in (("prompt", ar), ("token", 1)):
        steps = PROMPT_GEN_STEPS if kind == "prompt" else GEN_STEPS
        calls = sum(-(-e.shape[1] // rows) + steps for e in embeds)
        keep = set(np.unique(np.linspace(0, calls - 1, min(calls, MAX_SAMPLES)).round().astype(int)).tolist())
        runners = [_CpuGraph(src_dir / p["graphs"][kind]["file"]) for p in desc["parts"]]
        chain = _Chain(runners, keep, MASK_CLIP)
        dec = GenieLayoutDecoder({rows: chain, 1: chain}, ctx, facts, min_chunk=1)  # only this AR is picked
        for e in embeds:
            dec.reset()
            logits = dec.prefill(e)
            for _ in range(steps):
                if dec.n_past + rows > ctx:
                    break
                tok = int(np.argmax(logits[0, -1]))
                logits = dec._step(context.embed_tokens(np.array([tok])), rows)
        for p, rec in zip(desc["parts"], chain.recorded):
            out[(p["index"], kind)] = rec
        del runners, chain
    what = f"images:{len(files)}" if files else "demo image"
    n = {k: len(v) for k, v in out.items() if k[0] == 1}
    label = (f"{what} x {len(embeds)} prompt(s): reference (ort_reference) prompt embeddings through the float part"
             f" graphs on the CPU (prefill + {GEN_STEPS} greedy steps, prompt graphs and token graphs separately);"
             f" {n.get((1, 'prompt'), 0)} prompt / {n.get((1, 'token'), 0)} token feeds per part; mask clipped"
             f" at {MASK_CLIP:g}")
    return out, label


# -- quantization -------------------------------------------------------------------------------------------------
def peak_rss_mb() -> int | None:
    """This process's peak resident memory so far, in MB (None where the OS does not say)."""
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # Linux: kilobytes
    except (ImportError, OSError):
        return None


def release_memory() -> None:
    """Give freed heap back to the OS (glibc keeps it otherwise): the parse of a 2 GB graph leaves gigabytes of
    freed protobuf heap that would still count in the next step's peak."""
    import gc

    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def spill_feeds(feeds: list[dict], path: Path) -> Path:
    """Write calibration feeds to ``path`` (.npz) so they are not held while other graphs are quantized."""
    np.savez(path, **{f"{i}/{name}": v for i, f in enumerate(feeds) for name, v in f.items()})
    return path


def load_feeds(path: Path) -> list[dict]:
    with np.load(path) as z:
        out: dict[int, dict] = {}
        for key in z.files:
            i, name = key.split("/", 1)
            out.setdefault(int(i), {})[name] = z[key]
    return [out[i] for i in sorted(out)]


def _is_big(path: Path) -> bool:
    return any(path.parent.glob(path.name + ".data")) or path.stat().st_size > 512 * 1024 * 1024


def _softmax_ranges(model_in: Path, feeds: list[dict], work: Path, big: bool) -> dict[str, tuple[float, float]]:
    """[max - SPAN, max] for each Softmax input (and through Casts to the Add of the mask), max calibrated on the
    float graph: the same rule as :func:`vlmrun_qnn_htp.quant._masked_softmax_ranges`, for graphs with external
    weights."""
    import onnx
    import onnxruntime as ort

    proto = onnx.load(str(model_in), load_external_data=False)
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
    so = ort.SessionOptions()
    so.log_severity_level = 3
    sess = ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])
    hi = dict.fromkeys(names, -np.inf)
    for f in feeds:
        for n, v in zip(names, sess.run(names, f)):
            hi[n] = max(hi[n], float(np.max(v)))
    del sess
    ranges = {n: (h - quant.SOFTMAX_SPAN, h) for n, h in hi.items()}
    producers = {o: node for node in proto.graph.node for o in node.output}
    for n, r in list(ranges.items()):
        p = producers.get(n)
        while p is not None and p.op_type == "Cast":
            ranges[p.input[0]] = r
            p = producers.get(p.input[0])
    for f in work.glob("softmax_ranges.onnx*"):
        f.unlink()
    return ranges


def quantize_graph(src: Path, dst: Path, feeds: list[dict], precision: str, work: Path, keep_fp=None,
                   keep_a16w16=None) -> dict:
    """A QDQ model of one part graph: 16-bit activations, int8/int4 per-channel symmetric MatMul weights.

    ``keep_fp`` / ``keep_a16w16``: this graph's entries of the per-layer options (:func:`.probe.part_keep`): the
    layers' nodes left in float, or with 16-bit weights too (:func:`.quant.a16w16_overrides`)."""
    import logging

    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config, qnn_preprocess_model

    big = _is_big(src)
    pre = work / f"{src.stem}.pre.onnx"
    times = {}
    t0 = time.perf_counter()
    ok = qnn_preprocess_model(str(src), str(pre), fuse_layernorm=True, save_as_external_data=big,
                              all_tensors_to_one_file=True, external_data_location=pre.name + ".data")
    model_in = pre if ok else src
    proto = onnx.load(str(model_in), load_external_data=False)
    dims = {i.name: list(i.dims) for i in proto.graph.initializer}
    wq = QuantType.QInt4 if precision == "w4a16" else QuantType.QInt8
    overrides: dict[str, list[dict]] = {}
    n_mm = 0
    for node in proto.graph.node:
        if node.op_type == "MatMul" and len(node.input) > 1 and len(dims.get(node.input[1], [])) == 2:
            overrides[node.input[1]] = [{"quant_type": wq, "symmetric": True, "axis": 1}]  # [K, N]: per output
            n_mm += 1
    times["preprocess_s"] = time.perf_counter() - t0
    peaks = {"preprocess": peak_rss_mb()}
    t0 = time.perf_counter()
    for name, (lo, hi) in _softmax_ranges(model_in, feeds, work, big).items():
        overrides.setdefault(name, [{}])[0].update({"rmin": np.float32(lo), "rmax": np.float32(hi)})
    times["softmax_ranges_s"] = time.perf_counter() - t0
    peaks["softmax_ranges"] = peak_rss_mb()
    excluded, wide, kept = [], [], {}
    if keep_fp or keep_a16w16:
        from .probe import excluded_nodes

        excluded = excluded_nodes(proto, keep_fp) if keep_fp else []
        if keep_a16w16:
            wide = sorted(set(excluded_nodes(proto, keep_a16w16, "keep_a16w16")) - set(excluded))
            kept["a16w16"] = {"layers": [e[0] for e in keep_a16w16], "nodes": len(wide),
                              **quant.a16w16_overrides(proto, wide, overrides)}
        if keep_fp:
            kept["kept_fp"] = {"layers": [e[0] for e in keep_fp], "nodes": len(excluded)}
    del proto
    release_memory()
    config = get_qnn_qdq_config(
        str(model_in), quant._Reader(feeds), calibrate_method=CalibrationMethod.MinMax,
        activation_type=QuantType.QUInt16, weight_type=QuantType.QInt8, per_channel=True,
        init_overrides=overrides or None, nodes_to_exclude=excluded or None,
    )
    config.use_external_data_format = big
    # MinMax over the feeds one at a time (ranges merged feed by feed, the same min/max) instead of holding every
    # feed's intermediate tensors until the end; at full size the compile's peak is elsewhere (onnxruntime's weight
    # quantization of the 2 GB fp32 graph: README, "Full size"), so this saved only 0.5 GB there
    config.extra_options["CalibStridedMinMax"] = 1
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # onnxruntime.quantization warns through the root logger
    t0 = time.perf_counter()
    try:
        quantize(str(model_in), str(dst), config)
    finally:
        root.setLevel(level)
    times["calibrate_quantize_s"] = time.perf_counter() - t0
    peaks["calibrate_quantize"] = peak_rss_mb()
    for f in work.glob(f"{src.stem}.pre.onnx*"):
        f.unlink()
    return {"activation": "QUInt16", "weights": f"{'QInt4' if precision == 'w4a16' else 'QInt8'} per-channel"
            f" symmetric ({n_mm} MatMul weights)", "other_weights": "QInt8", "mask_range": f"[{MASK_CLIP:g}, 0]",
            "softmax_input": f"calibrated max - {quant.SOFTMAX_SPAN:g} .. max", "calibration_feeds": len(feeds),
            "times": {k: round(v, 3) for k, v in times.items()}, "peak_rss_mb_after": peaks, **kept}


# -- compile ------------------------------------------------------------------------------------------------------
def graph_digest(path: Path) -> str:
    """sha256 of an ONNX graph and its external data: what a binary was compiled from (the float export, or the
    QDQ model), so binaries compiled with and without weight sharing can be shown to hold the same graphs."""
    import hashlib

    h = hashlib.sha256()
    for f in [path, *sorted(path.parent.glob(path.name + ".data"))]:
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()


def _compile_session(src: Path, ctx_path: Path, soc, share: bool, stop: bool) -> None:
    ort, so = ep.session_options(soc, context_path=ctx_path)
    if share:
        so.add_session_config_entry("ep.share_ep_contexts", "1")
        if stop:
            so.add_session_config_entry("ep.stop_share_ep_contexts", "1")
    with ep.stdout_to_stderr():
        ort.InferenceSession(str(src), so)


def rename_graph(binary: Path, old: str, new: str) -> int:
    """Rename QNN graph ``old`` to ``new`` inside a context binary, in place; returns the occurrences replaced.

    onnxruntime-qnn names graphs after its fused nodes (``QNNExecutionProvider_QNNExecutionProvider_<hash>_<id>_0``,
    ``ep.context_node_name_prefix`` does not change them) and Genie orders the parts of a model by a
    ``_<k>_of_<P>`` suffix, so the names are rewritten. The binary stores each name as a length-prefixed string;
    ``new`` must have the same length (see :func:`genie_name`)."""
    if len(new) != len(old):
        raise ValueError(f"graph name {new!r} must have the length of {old!r}")
    data = binary.read_bytes()
    n = data.count(old.encode())
    if n == 0:
        raise BackendError(f"{binary.name}: graph {old} not found in the context binary")
    binary.write_bytes(data.replace(old.encode(), new.encode()))
    return n


def genie_name(base: str, old: str) -> str:
    """``base`` (``prompt_ar128_cl1024_1_of_2``) padded to the length of ``old`` before its ``_k_of_P`` suffix."""
    m = re.match(r"(.*)(_\d+_of_\d+)$", base)
    head, tail = m.group(1), m.group(2)
    fill = len(old) - len(head) - len(tail)
    if fill < 1:
        raise BackendError(f"graph name {old} is too short to rename to {base}")
    return head + "_" + "0" * (fill - 1) + tail


def _rewrite_wrapper(path: Path, graph: str, binary: str) -> None:
    """Point the EPContext node of ``path`` at ``binary`` under the graph name ``graph``."""
    import onnx

    m = onnx.load(str(path))
    node = next(n for n in m.graph.node if n.op_type == "EPContext")
    node.name = graph
    for a in node.attribute:
        if a.name == "partition_name":
            a.s = graph.encode()
        elif a.name == "ep_cache_context":
            a.s = binary.encode()
    onnx.save(m, str(path))


def compile_parts(model, source, options: dict, out_dir: Path, context=None) -> dict:
    """Compile every part of the ``decoder/parts`` export ``source`` into ``out_dir``; the manifest."""
    from vlmrun_qualcomm import socs

    from .probe import part_keep

    soc = socs.soc(options.get("soc"))
    precision = options["precision"]
    share = options.get("weight_sharing", "on") == "on"
    src_dir = source.path
    desc = json.loads((src_dir / "parts.json").read_text())
    if desc.get("probe_part"):  # one part's probe graph (vlmrun diff --locate): probe.compile_part_probe
        from .probe import compile_part_probe

        return compile_part_probe(model, source, options, out_dir, context=context)
    P, ar, ctx = len(desc["parts"]), desc["ar"], desc["ctx"]
    limit = int(options.get("part_limit_mb") or DEFAULT_PART_LIMIT_MB) * 1_000_000
    work = Path(tempfile.mkdtemp(prefix="vlmrun-qnn-parts-"))
    extra: dict = {}
    t_all = time.perf_counter()
    try:
        feeds, label, quant_s, q_times, q_peaks = {}, None, 0.0, {}, {}
        if precision != "fp16":
            t0 = time.perf_counter()
            files = quant.calibration_files(options.get("calibration_images"))
            feeds, label = calibration_feeds(model, src_dir, desc, files, quant._require(context))
            # on disk until their graph is quantized: only one graph's feeds are in memory at a time
            feeds = {key: spill_feeds(f, work / f"feeds_part{key[0]}_{key[1]}.npz") for key, f in feeds.items()}
            release_memory()
            quant_s += time.perf_counter() - t0
            q_times["record_feeds_s"] = time.perf_counter() - t0
            q_peaks["record_feeds"] = peak_rss_mb()
        parts, wrappers, binaries, graphs, facts, per_layer = [], [], [], [], None, {}
        compile_s = 0.0
        for p in desc["parts"]:
            k = p["index"]
            srcs = {}
            for kind in ("prompt", "token"):
                g = p["graphs"][kind]
                srcs[kind] = src_dir / g["file"]
                if precision != "fp16":
                    t0 = time.perf_counter()
                    dst = work / f"part{k}_{kind}.qdq.onnx"
                    facts = quantize_graph(srcs[kind], dst, load_feeds(feeds.pop((k, kind))), precision, work,
                                           keep_fp=part_keep(options.get("keep_fp"), k, kind),
                                           keep_a16w16=part_keep(options.get("keep_a16w16"), k, kind))
                    for step, sec in facts.pop("times", {}).items():  # where the quantization time goes
                        q_times[step] = q_times.get(step, 0.0) + sec
                    for step, mb in facts.pop("peak_rss_mb_after", {}).items():  # and the memory (running peak)
                        q_peaks[f"part{k}_{kind}_{step}"] = mb
                    for option in ("kept_fp", "a16w16"):  # per-layer precision: what each graph got
                        if option in facts:
                            per_layer.setdefault(option, {})[f"part{k}_{kind}"] = facts.pop(option)
                    srcs[kind] = dst
                    release_memory()
                    quant_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            entry = {"index": k, "layers": p["layers"], "graphs": {}, "binaries": [],
                     "source_sha256": {kind: graph_digest(srcs[kind]) for kind in srcs}}
            for i, kind in enumerate(("prompt", "token")):
                wrapper = out_dir / f"part{k}_of_{P}_{kind}_ctx.onnx"
                what = f"decoder part {k}/{P} {kind} graph ({precision})"
                try:
                    _compile_session(srcs[kind], wrapper, soc, share, stop=i == 1)
                except Exception as exc:
                    rejected = ep.unsupported_nodes(srcs[kind], soc)
                    why = (f"unsupported op(s) {', '.join(rejected[:5])}" if rejected else ep._one_line(exc))
                    raise BackendError(f"QNN HTP ({soc.name}/{soc.arch}) could not compile {what}: {why}") from None
                release_memory()
                q_peaks[f"part{k}_{kind}_qnn_compile"] = peak_rss_mb()
                info = describe_ctx_onnx(wrapper)
                if info["non_qnn_nodes"] or len(info["graphs"]) != 1 or len(info["binaries"]) != 1:
                    raise BackendError(f"{what}: expected one EPContext graph on QNN, got {info['graphs']}"
                                       f" ({', '.join(info['non_qnn_nodes'][:3]) or 'no other nodes'})")
                entry["graphs"][kind] = {"wrapper": wrapper.name, "ort_graph": info["graphs"][0],
                                         "binary": info["binaries"][0], "ar": p["graphs"][kind]["ar"],
                                         "inputs": info["inputs"], "outputs": info["outputs"]}
            compile_s += time.perf_counter() - t0
            # name the binaries and the graphs as Genie wants them
            names = ([f"part{k}_of_{P}_qnn.bin"] * 2 if share else
                     [f"part{k}_of_{P}_prompt_qnn.bin", f"part{k}_of_{P}_token_qnn.bin"])
            for kind, new_bin in zip(("prompt", "token"), names):
                g = entry["graphs"][kind]
                if (out_dir / g["binary"]).exists() and g["binary"] != new_bin:
                    (out_dir / g["binary"]).rename(out_dir / new_bin)
                g["binary"] = new_bin
                g["name"] = genie_name(p["graphs"][kind]["name"], g["ort_graph"])
                rename_graph(out_dir / new_bin, g["ort_graph"], g["name"])
                _rewrite_wrapper(out_dir / g["wrapper"], g["name"], new_bin)
                wrappers.append(g["wrapper"])
                graphs.append(g["name"])
            entry["binaries"] = sorted(set(names), key=names.index)
            entry["bytes"] = sum((out_dir / b).stat().st_size for b in entry["binaries"])
            binaries += entry["binaries"]
            parts.append(entry)
        compile_s_total = round(compile_s, 3)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    check_part_limits(out_dir, parts, limit)
    weights = weight_bytes(model, precision)
    total = sum(e["bytes"] for e in parts)
    first, last = parts[0]["graphs"]["prompt"], parts[-1]["graphs"]["prompt"]
    extra["decoder_parts"] = {
        "ar": ar, "ctx": ctx, "parts": parts, "count": P, "layers": desc["layers"],
        "weight_sharing": share, "graphs_per_binary": 2 if share else 1,
        "binaries_in_order": binaries, "total_bytes": total, "limit_bytes": limit,
        "weight_bytes": weights, "bytes_over_weights": round(total / weights, 4),
        "loads_on_emulator": not share,
    }
    extra["peak_rss_mb_after"] = q_peaks  # the compile's running peak after each step (where the memory goes)
    if precision != "fp16":
        extra["quantization"] = {**(facts or {}), **per_layer, "calibration": label, "quantize_s": round(quant_s, 3),
                                 "times": {k: round(v, 3) for k, v in q_times.items()}}
    return ContextManifest(
        files=[*wrappers, *binaries], graphs=graphs, inputs=first["inputs"], outputs=last["outputs"],
        stage="decoder", precision=precision, compiler="qnn_htp", qnn_version=ep.qnn_version(),
        ep_sdk_version=describe_ctx_onnx(out_dir / wrappers[0])["ep_sdk_version"], soc=soc.name,
        soc_model=soc.soc_model, arch=soc.arch, source_form=source.manifest.get("form", "decoder/parts"),
        compile_s=compile_s_total, binary_bytes={b: (out_dir / b).stat().st_size for b in binaries},
        extra={**extra, "compile_wall_s": round(time.perf_counter() - t_all, 3)},
    ).to_dict()


def weight_bytes(model, precision: str) -> int:
    """Bytes of one copy of the decoder's weights at ``precision``: the MatMul weights and the lm_head at the
    precision's weight bits, the rest (norms, biases) at 16 bits; what ``bytes_over_weights`` divides by."""
    mm, other, head = weight_counts(model)
    return int((model.num_layers * mm + head) * WEIGHT_BITS[precision] / 8 + model.num_layers * other * 2)


def check_part_limits(out_dir: Path, parts: list[dict], limit: int, where: str = "") -> None:
    """BackendError when a part's binary (``parts``: the manifest's entries) is over ``limit`` bytes."""
    P = len(parts)
    for e in parts:
        for b in e["binaries"]:
            size = (Path(out_dir) / b).stat().st_size
            if size > limit:
                raise BackendError(f"decoder part {e['index']}/{P}: its binary {b}{where} is {size / 1e6:.0f} MB,"
                                   f" over the {limit / 1e6:.0f} MB part limit; compile with parts = {P + 1} (or"
                                   " raise part_limit_mb)")


# -- running ------------------------------------------------------------------------------------------------------
def check_loadable(manifest: dict, what: str = "decoder") -> None:
    """Refuse, in one line, to open weight-shared part binaries on the x86_64 HTP emulator (it would crash)."""
    d = manifest.get("decoder_parts") or {}
    if d.get("weight_sharing") and is_emulator():
        raise BackendError(f"{what}: these part binaries share weights between their prompt and token graphs;"
                           f" {EMULATOR_REFUSAL}. Run them on a device (Genie), or compile with weight_sharing ="
                           " \"off\" to run the same graphs one per binary here")


class _HtpGraph:
    def __init__(self, path: Path, soc, what: str):
        self.session = ep.HtpSession(path, soc, what)
        self.input_names = list(self.session.inputs)
        self.load_s = self.session.load_s

    def run(self, feeds: dict) -> dict:
        return self.session.run(feeds)


def open_chains(artifact, soc) -> tuple[dict, float]:
    """{AR: a chain running every part's graph of that AR on the local HTP}, load seconds."""
    d = artifact.manifest["decoder_parts"]
    check_loadable(artifact.manifest)
    chains, load_s = {}, 0.0
    for kind in ("prompt", "token"):
        runners = []
        for p in d["parts"]:
            g = p["graphs"][kind]
            r = _HtpGraph(artifact.path / g["wrapper"], soc, f"decoder part {p['index']}/{d['count']} ({kind})")
            load_s += r.load_s
            runners.append(r)
        chains[int(d["parts"][0]["graphs"][kind]["ar"])] = _Chain(runners)
    return chains, load_s


class PartsHandle(DecoderHandle):
    """The decoder stage in the parts form, run by the host engine (``decoder``: vlmrun's loop over every part's
    graphs). Sessions open on first use, so compiling, and refusing a weight-shared binary the emulator cannot
    load, happen without opening them."""

    def __init__(self, model, artifact, soc):
        from vlmrun_qualcomm import genie as genie_mod

        self.model, self.artifact, self.soc = model, artifact, soc
        self.artifacts = [artifact]
        self.parts = artifact.manifest["decoder_parts"]
        self.ctx = int(self.parts["ctx"])
        self.facts = genie_mod.GenieModel.from_model(model)
        self.ctx_bins = [str(artifact.path / b) for b in self.parts["binaries_in_order"]]
        self._host = None
        self.load_s = 0.0
        self.last_timings: dict = {}

    @property
    def context_length(self) -> int:
        return self.ctx

    @property
    def decoder(self):
        if self._host is None:
            from .genie_engine import GenieLayoutDecoder

            chains, self.load_s = open_chains(self.artifact, self.soc)
            self._host = GenieLayoutDecoder(chains, self.ctx, self.facts)
        return self._host


class GeniePartsHandle(PartsHandle):
    """Engine ``genie``: Genie (libGenie, in its worker process) decodes over the part binaries, ``ctx-bins`` in
    part order; ``decoder`` (teacher forcing, diffs) stays the host engine over the same binaries."""

    def __init__(self, model, artifact, soc, lut_npy: Path, timeout: float = 600.0):
        from vlmrun_qualcomm import genie as genie_mod

        from .genie_engine import libgenie_path

        super().__init__(model, artifact, soc)
        self.lut_npy = Path(lut_npy)
        self.timeout = float(timeout)
        self.lib = genie_mod.GenieLibrary(libgenie_path())

    def config(self, request) -> dict:
        from vlmrun_qualcomm import genie as genie_mod

        from .genie_engine import GenieHtpHandle

        stops = sorted(request.stop_ids) if request.stop_ids else [GenieHtpHandle._never_token(self)]
        return genie_mod.dialog_config(
            self.facts, "QnnHtp", tokenizer=self.model.path / "tokenizer.json", context_size=self.ctx,
            sampling=getattr(request.sampler, "settings", None), max_new_tokens=request.max_new_tokens,
            ctx_bins=self.ctx_bins, eos=stops)

    def genie_generate(self, request):
        from vlmrun.errors import InputError
        from vlmrun_qualcomm import genie as genie_mod

        check_loadable(self.artifact.manifest, "decoder (Genie)")
        limit = min(int(request.context_length or self.ctx), self.ctx)
        if request.inputs_embeds.shape[1] >= limit:
            raise InputError(f"the prompt is {request.inputs_embeds.shape[1]} tokens but the compiled decoder"
                             f" context holds {limit}; compile the decoder with a larger context_length")
        self.last_timings = {}
        yield from genie_mod.stream_tokens_worker(self.lib.path, self.config(request), request.inputs_embeds,
                                                  self.lut_npy, timeout=self.timeout, profile_out=self.last_timings)


def load_parts(ctx, opts: dict, soc, artifact) -> PartsHandle:
    """The handle of a compiled parts artifact (``load_stage``)."""
    from vlmrun.stages import ExportForm

    if "decoder_parts" not in artifact.manifest:
        raise BackendError(f"decoder artifact {artifact.path.name} is not a parts artifact; compile it again with"
                           " --rebuild")
    ContextManifest.from_dict(artifact.manifest, f"decoder artifact {artifact.path.name}")
    ep.check_binary(artifact.manifest, artifact.file(), soc, f"decoder ({artifact.path.name})")
    if opts.get("engine") == "genie":
        lut = ctx.exported(ExportForm.of("embed", "embed/lut")).file("embed_lut_f32.npy")
        return GeniePartsHandle(ctx.model, artifact, soc, lut, float(ctx.options.get("timeout") or 600))
    return PartsHandle(ctx.model, artifact, soc)
