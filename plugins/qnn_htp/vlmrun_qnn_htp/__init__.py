"""vlmrun plugin ``qnn_htp``: FastVLM stages as QNN context binaries on the Qualcomm HTP.

Compile: ONNX -> QNN context binary with onnxruntime-qnn (EPContext, embed mode 0, CPU fallback disabled,
static shapes, ``soc_model`` from :mod:`vlmrun_qualcomm.socs`), fp16 by default or int8 via static QDQ (:mod:`.quant`).
Run: locally on the HTP backend of onnxruntime-qnn (the v79 emulator on x86_64, the NPU on a Snapdragon
host), or with ``target = "android"`` on a phone through the SDK's ``qnn-net-run`` over adb (:mod:`.netrun`).
Decode: a host-driven fixed-KV loop over an AR-N prefill graph and an AR-1 graph (:mod:`.decoder`).

Per-stage options (layout TOML or ``vlmrun compile`` flags):

=================== ====================================================================================
``precision``       ``fp16`` (default), ``int8`` (a8w8, 16-bit Softmax) or ``a16w8``: every stage (decoder:
                    host engine only)
``soc``             ``SM8750`` (default), ``SM8650``, ``SM8550``, ... (see :data:`vlmrun_qualcomm.socs.SOCS`)
``calibration_images`` folder of images for int8 (default: random data for vision/projector, labelled so in
                    the manifest; the demo image for the decoder; embed calibrates on token ids)
``context_length``  decoder context the graphs are compiled for (default 512)
``prefill_ar``      decoder prefill chunk (AR-N) (default 64)
``engine``          decoder engine: ``host`` (this loop) or ``genie`` (Genie on QnnHtp via libGenie from
                    onnxruntime-qnn, graphs in Genie's I/O layout, see :mod:`.genie_engine`)
``rmsnorm``         decoder RMSNorm as exported: ``safe`` (default: each row scaled by its max |x| before
                    squaring, so fp16 does not overflow on massive activations) or ``plain`` (transformers' form;
                    overflows in fp16 once |x| > 256, kept to show the failure)
``decoder_form``    ``fixed`` (default: one fp16/int8 graph per binary, AR-N + AR-1, host engine) or ``parts``: Qualcomm's
                    shipping form (:mod:`.parts`): P parts, each a prompt (AR-N) and a token (AR-1) graph in Genie's
                    I/O layout, ``fp16``/``w8a16``/``w4a16``, both graphs of a part in one weight-shared binary
``parts``           parts: number of parts (0 = the fewest whose binaries stay under ``part_limit_mb``, default
                    1000 MB); ``weight_sharing``: ``auto`` (shared except on the x86_64 emulator, which cannot load
                    shared binaries), ``on`` or ``off``; ``prefill_ar`` defaults to 128 there (capped at the hidden size)
``embed_seq``       static sequence length of the embed graph; longer inputs run in chunks (default 32)
``keep_fp``         int8/a16w8/w8a16/w4a16: layers kept out of quantization (run in fp16), comma-separated: layer
                    names as ``vlmrun diff --locate`` prints them (``vision.stage2``, ``decoder.layer1``) or node-name
                    prefixes starting with ``/`` (not in the parts form); in the parts form the layer's nodes in
                    its part's prompt and token graphs (:mod:`.probe`)
``keep_a16w16``     int8/a16w8/w8a16/w4a16: layers quantized with 16-bit activations and weights (the rest stays
                    at the stage's precision), the same entries as ``keep_fp``
``target``          ``local`` (default) or ``android``; with ``device``, ``adb``, ``sdk_root``,
                    ``native_outputs``, ``timeout``; the decoder on a phone needs engine ``genie`` (the SDK's
                    genie-t2t-run on the phone's HTP, :mod:`.genie_phone`; ``ndk_root`` for libc++_shared.so)
``toolchain``       ``onnxruntime`` (default: onnxruntime-qnn, QNN 2.51) or ``sdk``: the QAIRT SDK's own
                    converter, model-lib generator and context-binary generator (:mod:`.sdk_compile`), for
                    binaries that carry the SDK's QNN version (a phone running an older QAIRT)
=================== ====================================================================================
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from vlmrun import hookimpl
from vlmrun.errors import BackendError, UsageError
from vlmrun.handles import DecoderHandle as DecoderHandleBase
from vlmrun.handles import StageHandle
from vlmrun.options import Option
from vlmrun.plugins import BackendInfo, Check, mine
from vlmrun.stages import STAGES, ExportForm
from vlmrun_qualcomm import socs
from vlmrun_qualcomm.manifest import ContextManifest
from vlmrun_qualcomm.sdk import Sdk, newer_than, phone_options

from . import ep, quant

NAME = "qnn_htp"
__version__ = "0.1.0"

PRECISIONS = ("fp16", "int8", "a16w8", "w8a16", "w4a16")  # w8a16, w4a16: decoder_form = "parts" only
DECODER_FORMS = ("fixed", "parts")
ENGINES = ("host", "genie")
RMSNORMS = ("safe", "plain")  # the decoder exports' RMSNorm (vlmrun_ort_reference.onnx_export.safe_rms_norm)
TOOLCHAINS = ("onnxruntime", "sdk")
DEFAULT_CONTEXT = 512
DEFAULT_PREFILL_AR = 64
DEFAULT_EMBED_SEQ = 32


# -- options -----------------------------------------------------------------------------------------------
def stage_options(stage: str, options) -> dict:
    """Normalise a stage's layout options (UsageError for bad values)."""
    o = dict(options or {})
    precision = str(o.get("precision") or "fp16").lower()
    if precision not in PRECISIONS:
        raise UsageError(f"precision '{precision}' is not one of {', '.join(PRECISIONS)}")
    out = {"precision": precision, "soc": socs.soc(o.get("soc")).name}
    form = str(o.get("decoder_form") or "fixed").lower() if stage == "decoder" else "fixed"
    if form not in DECODER_FORMS:
        raise UsageError(f"decoder_form '{form}' is not one of {', '.join(DECODER_FORMS)}")
    if precision in ("w8a16", "w4a16") and form != "parts":
        raise UsageError(f"precision {precision} is the decoder's parts form only (decoder_form = \"parts\");"
                         " other stages and the fixed decoder take int8 or a16w8")
    if form == "parts":
        from . import parts

        out.update(parts.normalise(o, precision))
    if precision != "fp16":
        cal = o.get("calibration_images") if stage != "embed" else None  # embed calibrates on token ids
        out["calibration_images"] = str(Path(cal).expanduser().resolve()) if cal else None
        default = {"embed": quant.EMBED_CALIBRATION, "decoder": quant.DECODER_CALIBRATION}.get(stage, "random")
        out["calibration"] = quant.calibration_digest(cal) or default
        if form == "parts" and not out["calibration_images"]:
            out["calibration"] = parts.CALIBRATION
        if stage == "decoder" and str(o.get("engine") or "host") == "genie" and form != "parts":
            raise UsageError(f"precision {precision} is not available for the genie decoder engine on qnn_htp;"
                             " use fp16 or engine = host")
    if stage == "decoder":
        ctx = int(o.get("context_length") or DEFAULT_CONTEXT)
        ar = int(o.get("prefill_ar") or DEFAULT_PREFILL_AR)
        if ctx < 8:
            raise UsageError(f"context_length {ctx} is too small")
        out["context_length"] = ctx
        out["prefill_ar"] = max(1, min(ar, ctx // 2)) if form != "parts" else out["prefill_ar"]
        out["decoder_form"] = form
        engine = str(o.get("engine") or "host")
        if engine not in ENGINES:
            raise UsageError(f"decoder engine '{engine}' is not provided by qnn_htp (engines: {', '.join(ENGINES)});"
                             " a Genie engine comes with its own plugin")
        out["engine"] = engine
        rmsnorm = str(o.get("rmsnorm") or "safe").lower()
        if rmsnorm not in RMSNORMS:
            raise UsageError(f"rmsnorm '{rmsnorm}' is not one of {', '.join(RMSNORMS)}")
        out["rmsnorm"] = rmsnorm
    if stage == "embed":
        out["embed_seq"] = int(o.get("embed_seq") or DEFAULT_EMBED_SEQ)
    from .probe import check_keep_fp, parse_keep_fp  # per-layer precision (vlmrun diff --what-if)

    keep_fp = parse_keep_fp(o.get("keep_fp"))
    check_keep_fp(stage, keep_fp, out["precision"])
    if keep_fp:
        out["keep_fp"] = keep_fp
    keep16 = parse_keep_fp(o.get("keep_a16w16"))  # per-layer 16-bit: same entries, quantized at a16w16
    check_keep_fp(stage, keep16, out["precision"], "keep_a16w16")
    if keep16:
        if str(o.get("toolchain") or "onnxruntime").lower() == "sdk":
            raise UsageError("keep_a16w16 needs toolchain = \"onnxruntime\" (the SDK's converter quantizes the"
                             " stage itself)")
        both = sorted(set(keep16) & set(keep_fp))
        if both:
            raise UsageError(f"{stage}: {', '.join(both)} is in both keep_fp and keep_a16w16; choose one")
        out["keep_a16w16"] = keep16
    target = str(o.get("target") or "local").lower()
    if target not in ("local", "android"):
        raise UsageError(f"target '{target}' is not one of local, android")
    if target == "android" and stage == "decoder" and out.get("engine") != "genie":
        raise UsageError("the decoder's host engine cannot run on a phone (qnn-net-run runs one graph per call);"
                         " use --decoder-engine genie: Genie's genie-t2t-run decodes on the phone's HTP")
    out["target"] = target
    toolchain = str(o.get("toolchain") or "onnxruntime").lower()
    if toolchain not in TOOLCHAINS:
        raise UsageError(f"toolchain '{toolchain}' is not one of {', '.join(TOOLCHAINS)}")
    if toolchain == "sdk" and stage == "decoder":
        raise UsageError("toolchain = \"sdk\" compiles vision, projector and embed; the decoder compiles with"
                         " onnxruntime-qnn")
    out["toolchain"] = toolchain
    if toolchain == "sdk":
        out["sdk_root"] = str(o["sdk_root"]) if o.get("sdk_root") else None
    return out


def compile_key(opts: dict) -> dict:
    """The options that determine the binary's bytes (they key the artifact store)."""
    keep = ("precision", "soc", "calibration", "weight_sharing", "part_limit_mb")  # the last two: parts form
    key = {**{k: opts[k] for k in keep if k in opts}, "qnn": ep.qnn_version(), "fallback": "disabled"}
    if opts.get("toolchain") == "sdk":  # the SDK's tools, its QNN version (the onnxruntime default keys as before)
        sdk = Sdk.find(opts.get("sdk_root"))
        key.update(toolchain="sdk", qnn=sdk.version(), sdk_root=str(sdk.root))
    return key


def binary_version(opts: dict, options) -> str | None:
    """The QNN version the stage's binary will carry, when it is known before compiling."""
    compiler = str(dict(options or {}).get("compiler") or NAME)
    if compiler != NAME:
        v = dict(options or {}).get("qairt_version")  # the qaihub plugin's pin of the hub's QAIRT version
        return str(v) if v else None
    return Sdk.find(opts.get("sdk_root")).version() if opts.get("toolchain") == "sdk" else ep.qnn_version()


def forms(stage: str, opts: dict) -> list[ExportForm]:
    if stage == "decoder":
        ctx = opts["context_length"]
        ars = sorted({opts["prefill_ar"], 1}, reverse=True)
        norm = opts.get("rmsnorm") or "safe"  # fp16-safe RMSNorm unless asked otherwise
        if opts.get("engine") == "genie":
            return [ExportForm.of("decoder", "decoder/genie", ar=ar, ctx=ctx, input="embeds", rmsnorm=norm)
                    for ar in ars]
        return [ExportForm.of("decoder", "decoder/fixed", ar=ar, ctx=ctx, rmsnorm=norm) for ar in ars]
    if stage == "embed":
        return [ExportForm.of("embed", seq=opts["embed_seq"])]
    return [ExportForm.of(stage)]


# -- hooks -------------------------------------------------------------------------------------------------
@hookimpl
def register_options(register):
    for o in (
        Option(NAME, "precision", str, choices=PRECISIONS, default="fp16", flag="--precision",
               help="numeric precision: fp16, int8 (a8w8, 16-bit Softmax) or a16w8"),
        Option(NAME, "soc", str, choices=tuple(socs.SOCS), default=socs.DEFAULT_SOC, flag="--soc",
               help="target Snapdragon SoC"),
        Option(NAME, "calibration_images", Path, flag="--calibration-images",
               help="folder of images to calibrate int8 (default: random data, labelled so in the manifest)"),
        Option(NAME, "context_length", int, stages=("decoder",), default=DEFAULT_CONTEXT, minimum=8,
               flag="--context-length", help="decoder context the graphs are compiled for"),
        Option(NAME, "prefill_ar", int, stages=("decoder",), default=DEFAULT_PREFILL_AR, minimum=1,
               help="decoder prefill chunk (AR-N); parts form: default 128, capped at the hidden size"),
        Option(NAME, "engine", str, stages=("decoder",), choices=ENGINES, default="host", flag="--decoder-engine",
               help="how the compiled decoder graphs are driven: vlmrun's host loop or Qualcomm's Genie (libGenie)"),
        Option(NAME, "rmsnorm", str, stages=("decoder",), choices=RMSNORMS, default="safe",
               help="decoder RMSNorm: safe (rows scaled by their max |x| before squaring: no fp16 overflow on"
                    " massive activations) or plain (overflows in fp16 once |x| > 256)"),
        Option(NAME, "decoder_form", str, stages=("decoder",), choices=DECODER_FORMS, default="fixed",
               flag="--decoder-form", help="decoder graphs: fixed (one graph per binary) or parts (Qualcomm's shipping"
                    " form: parts of layers, prompt + token graphs per part in one weight-shared binary, Genie layout)"),
        Option(NAME, "parts", int, stages=("decoder",), default=0, minimum=0,
               help="parts form: number of parts (0 = the fewest whose binaries stay under part_limit_mb)"),
        Option(NAME, "part_limit_mb", int, stages=("decoder",), default=1000, minimum=1,
               help="parts form: largest part binary, MB (the HTP maps one context into a 32-bit address space)"),
        Option(NAME, "weight_sharing", str, stages=("decoder",), choices=("auto", "on", "off"), default="auto",
               help="parts form: a part's prompt and token graphs in one binary sharing weights (on), one binary per"
                    " graph (off), or on except on the x86_64 emulator, which cannot load shared binaries (auto)"),
        Option(NAME, "keep_fp", str, stages=("vision", "projector", "decoder"),
               help="int8/a16w8: layers kept in fp16, comma-separated: names as vlmrun diff --locate prints them"
                    " (vision.stage2, decoder.layer1) or node-name prefixes starting with /"),
        Option(NAME, "keep_a16w16", str, stages=("vision", "projector", "decoder"),
               help="int8/a16w8: layers quantized at 16 bits (activations and weights), comma-separated: names as"
                    " vlmrun diff --locate prints them or node-name prefixes starting with /"),
        Option(NAME, "embed_seq", int, stages=("embed",), default=DEFAULT_EMBED_SEQ, minimum=1,
               help="static sequence length of the embed graph; longer inputs run in chunks"),
        Option(NAME, "native_outputs", bool, default=False,
               help="qnn-net-run --use_native_output_files: quantized outputs arrive quantized (phone)"),
        Option(NAME, "timeout", float, default=600.0, minimum=1, help="seconds for one stage run (phone, Genie)"),
        Option(NAME, "toolchain", str, choices=TOOLCHAINS, default="onnxruntime", flag="--toolchain",
               help="what compiles the context binaries: onnxruntime-qnn (QNN 2.51, default) or sdk, the QAIRT"
                    " SDK's own tools (binaries for that SDK's QNN version, e.g. an older phone runtime)"),
        Option(NAME, "ndk_root", Path, stages=("decoder",),
               help="engine genie on a phone: the Android NDK whose libc++_shared.so goes to the phone with"
                    " genie-t2t-run, when the SDK has none (default: $ANDROID_NDK_ROOT)"),
        *phone_options(NAME),
    ):
        register(o)


@hookimpl
def describe():
    return BackendInfo(NAME, STAGES, "Qualcomm QNN HTP (v79 emulator via onnxruntime-qnn, the NPU, or a phone over adb)",
                       precision="fp16")


@hookimpl
def doctor():
    checks = []
    try:
        v = ep.versions()
        checks.append(Check("onnxruntime-qnn", True, f"{v['onnxruntime_qnn']} (QNN {v['qnn']}, onnxruntime {v['onnxruntime']})"))
    except Exception as exc:
        checks.append(Check("onnxruntime-qnn", False, f"not usable: {exc}"))
        return checks
    ok, detail = ep.htp_backend_loads()
    checks.append(Check("HTP backend (libQnnHtp.so)", ok, detail))
    found_sdk = Sdk.find(None)
    root = found_sdk.root
    if root:
        tools = ["bin/x86_64-linux-clang/qnn-net-run", "bin/x86_64-linux-clang/qnn-context-binary-generator",
                 "bin/aarch64-android/qnn-net-run", "lib/aarch64-android/libQnnHtp.so"]
        found = [t for t in tools if (Path(root) / t).is_file()]
        missing = [t for t in tools if t not in found]
        checks.append(Check("QNN SDK tools", not missing,
                            f"{root}: found {len(found)}/{len(tools)}" + (f", missing {', '.join(missing)}" if missing else "")))
        sdk_v = found_sdk.version()
        ok = sdk_v is not None and not newer_than(v["qnn"], sdk_v)
        checks.append(Check("QNN SDK version (phone runtime)", ok,
                            f"QAIRT {sdk_v or 'unknown'}; onnxruntime-qnn builds QNN {v['qnn']} binaries"
                            + ("" if ok else ": older phone runtime, use toolchain sdk or --compiler qaihub"
                               " with qairt_version")))
    else:
        checks.append(Check("QNN SDK tools", False, "QAIRT_SDK_ROOT / QNN_SDK_ROOT not set (needed for --target android)"))
    try:
        from vlmrun_qualcomm.adb import list_devices

        devs = list_devices(timeout=5)
        checks.append(Check("adb devices", bool(devs), ", ".join(f"{s} ({st})" for s, st in devs) or "none connected"))
    except Exception as exc:
        checks.append(Check("adb devices", False, str(exc)))
    checks.append(Check("SoCs", True, ", ".join(f"{s.name}/{s.arch}" for s in socs.SOCS.values())
                        + f" (default {socs.DEFAULT_SOC})"))
    return checks


@hookimpl
def preflight(backend, stage, model, options):
    """Before any export or compile: the SDK's compile tools (toolchain sdk), and on a phone the SDK's runtime
    files and a QNN version no older than the binary the compiler will make."""
    if not mine(backend, NAME):
        return
    opts = stage_options(stage, options)
    o = dict(options or {})
    if opts["toolchain"] == "sdk" and str(o.get("compiler") or NAME) == NAME:
        sdk = Sdk.find(opts.get("sdk_root"))
        sdk.require_compile_tools('for toolchain = "sdk"')
        if not sdk.version():
            raise BackendError(f"cannot read the QNN version of the SDK at {sdk.root} (no sdk.yaml): binaries made"
                               " with toolchain = \"sdk\" must record it; use a complete QAIRT SDK")
    if opts["target"] == "android":
        from .netrun import check_runtime, device_files, phone_sdk

        sdk = phone_sdk(o.get("sdk_root"))
        if stage == "decoder":  # engine genie: genie-t2t-run and the HTP runtime (genie_phone), not qnn-net-run
            from .genie_phone import device_files as genie_device_files

            genie_device_files(sdk, socs.soc(opts["soc"]), o.get("ndk_root"))
        else:
            device_files(sdk.root, socs.soc(opts["soc"]).arch)
        built = binary_version(opts, options)
        compiler = str(o.get("compiler") or NAME)
        if built:
            check_runtime({"qnn_version": built, "compiler": compiler if compiler != NAME else
                           ("qnn_htp with the SDK's tools" if opts["toolchain"] == "sdk" else "onnxruntime-qnn")},
                          sdk, stage)


@hookimpl
def compile(backend, request):
    if not mine(backend, NAME):
        return None
    return compile_stage(request.stage, request.model, request.source, request.options, Path(request.out_dir),
                         context=request.context)


def _compile_binary(src: Path, out_dir: Path, name: str, soc, precision: str, options: dict, work: Path,
                    feeds, what: str) -> tuple[dict, dict]:
    """(manifest fields, extra) from onnxruntime-qnn, or from the SDK's own tools with toolchain = "sdk"."""
    if options.get("toolchain") == "sdk":
        from .sdk_compile import compile_onnx_sdk

        info = compile_onnx_sdk(src, out_dir, name, soc, precision, Sdk.find(options.get("sdk_root")), work,
                                calibration=feeds, what=what)
        return info, {"toolchain": info.pop("toolchain")}
    return ep.compile_onnx(src, out_dir, name, soc, what), {}


def compile_stage(stage, model, source, options, out_dir: Path, context=None) -> dict:
    """Compile ``source`` into a context binary in ``out_dir``; ``context`` (a CompileContext) gives int8
    calibration its reference activations."""
    if str(source.manifest.get("form", "")).startswith("decoder/parts"):  # every part, both graphs (parts.py)
        from .parts import compile_parts

        return compile_parts(model, source, options, out_dir, context=context)
    soc = socs.soc(options.get("soc"))
    precision = options.get("precision", "fp16")
    form = source.manifest.get("form", stage)
    name = "".join(c if c.isalnum() else "_" for c in form).strip("_")
    what = f"stage '{stage}' ({form}, {precision})"
    src = source.file()
    extra: dict = {}
    work = Path(tempfile.mkdtemp(prefix="vlmrun-qnn-quant-"))
    try:
        feeds = None
        if precision != "fp16":
            t0 = time.perf_counter()
            feeds, label = quant.calibration_samples(stage, model, options.get("calibration_images"), source=source,
                                                      context=context)
            if options.get("toolchain") == "sdk":  # the SDK's converter quantizes from the samples itself
                extra = {"quantization": {"calibration": label, "samples": len(feeds), "by": "qnn-onnx-converter"}}
            else:
                qdq = work / f"{name}.qdq.onnx"
                facts = quant.quantize_qdq(src, qdq, feeds, precision, work, keep_fp=options.get("keep_fp"),
                                           keep_a16w16=options.get("keep_a16w16"))
                extra = {"quantization": {**facts, "calibration": label,
                                          "quantize_s": round(time.perf_counter() - t0, 3)}}
                src = qdq
        info, more = _compile_binary(src, out_dir, name, soc, precision, options, work, feeds, what)
        extra.update(more)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    io_q = extra.get("quantization", {}).get("io_quant", {}) or {
        t["name"]: t["quant"] for t in (*info["inputs"], *info["outputs"]) if "quant" in t}
    for t in (*info["inputs"], *info["outputs"]):
        if t["name"] in io_q:
            t["quant"] = io_q[t["name"]]
    return ContextManifest(**info, stage=stage, precision=precision, compiler=NAME, source_form=form,
                           io_quant=io_q, extra=extra).to_dict()


class LocalStage(StageHandle):
    """A compiled non-decoder stage on the local HTP backend."""

    def __init__(self, session: ep.HtpSession, artifact):
        self.session = session
        self.artifact = artifact
        self.artifacts = (artifact,)
        self.load_s = session.load_s

    def run(self, inputs: dict) -> dict:
        feeds = {}
        for name, (shape, dtype) in self.session.inputs.items():
            feeds[name] = np.ascontiguousarray(inputs[name], dtype=dtype)
        return self.session.run(feeds)


class ChunkedEmbed(StageHandle):
    """The static-shape embed graph (seq E) over any length: pad with token 0, run in chunks, slice."""

    def __init__(self, runner: StageHandle, seq: int):
        self.runner = runner
        self.seq = seq
        self.artifacts = runner.artifacts
        self.artifact = runner.artifacts[0] if runner.artifacts else None
        self.load_s = runner.load_s

    def run(self, inputs: dict) -> dict:
        ids = np.asarray(inputs["input_ids"], dtype=np.int64)
        T, E = ids.shape[1], self.seq
        parts = []
        for i in range(0, T, E):
            chunk = np.zeros((1, E), np.int64)
            n = min(E, T - i)
            chunk[0, :n] = ids[0, i : i + n]
            out = self.runner.run({"input_ids": chunk})["inputs_embeds"]
            if not isinstance(out, np.ndarray):  # QuantizedTensor from a phone
                out = out.dequantize()
            parts.append(out[:, :n])
        return {"inputs_embeds": np.concatenate(parts, axis=1).astype(np.float32)}


class DecoderHandle(DecoderHandleBase):
    def __init__(self, decoder, artifacts, load_s):
        self.decoder = decoder
        self.artifacts = list(artifacts)
        self.load_s = load_s

    @property
    def context_length(self) -> int:
        """The context the graphs were compiled for (the core checks prompt lengths against it)."""
        return self.decoder.ctx


def _compiled(ctx, stage: str, opts: dict, form: ExportForm):
    src = ctx.exported(form)
    kind = f"{form.label()}-{opts['precision']}-{opts['soc']}"
    key_opts = compile_key(opts)
    if opts.get("calibration_images"):
        key_opts["calibration_images"] = opts["calibration_images"]
    for option in ("keep_fp", "keep_a16w16"):  # per-layer precision: the layers' boundaries in this form's graphs
        if opts.get(option):  # keep_fp: left in float; keep_a16w16: activations and weights at 16 bits (probe.py)
            from .probe import keep_fp_key, parts_keep_key

            resolve = parts_keep_key if form.kind == "decoder/parts" else keep_fp_key
            key_opts[option] = resolve(ctx, form, opts[option], option)
    return ctx.compiled(src, key_opts, kind)


@hookimpl
def load_stage(backend, stage, ctx):
    if not mine(backend, NAME):
        return None
    opts = stage_options(stage, ctx.options)
    soc = socs.soc(opts["soc"])
    if opts.get("decoder_form") == "parts":
        from .parts import load_parts, plan

        p = plan(ctx.model, opts)
        form = ExportForm.of("decoder", "decoder/parts", ar=p["ar"], ctx=p["ctx"],
                             layers=",".join(map(str, p["layers"])), rmsnorm=opts.get("rmsnorm") or "safe")
        from .genie_phone import attach  # engine genie + --target android: genie-t2t-run on the phone

        return attach(load_parts(ctx, opts, soc, _compiled(ctx, stage, opts, form)), ctx, opts, soc)
    arts = [_compiled(ctx, stage, opts, f) for f in forms(stage, opts)]
    for art in arts:
        ContextManifest.from_dict(art.manifest, f"{stage} artifact {art.path.name}")
        ep.check_binary(art.manifest, art.file(), soc, f"{stage} ({art.path.name})")
    if str(ctx.options.get("compiler") or NAME) == NAME:  # another compiler's binary for this stage goes unused: say so
        import json
        import sys

        srcs = {a.manifest.get("key", {}).get("source") for a in arts}
        for mf in sorted(ctx.store.artifacts_dir.glob("*/manifest.json")):
            try:
                k = json.loads(mf.read_text()).get("key") or {}
            except (OSError, ValueError):
                continue
            ko = k.get("options") or {}
            same = (ko.get("precision"), ko.get("soc")) == (opts["precision"], opts["soc"])
            if k.get("backend") == NAME and k.get("compiler") not in (None, NAME) and k.get("source") in srcs and same:
                print(f"qnn_htp: {stage} runs {arts[0].path.name} (compiled here); {k['compiler']} compiled"
                      f" {mf.parent.name} for it too: add --compiler {k['compiler']} to run that one", file=sys.stderr)
                break
    if stage == "decoder" and opts["engine"] == "genie":
        from .genie_engine import GenieHtpHandle

        lut = ctx.exported(ExportForm.of("embed", "embed/lut")).file("embed_lut_f32.npy")
        handle = GenieHtpHandle(ctx.model, [(int(f.get("ar")), a) for f, a in zip(forms(stage, opts), arts)],
                                opts["context_length"], soc, lut, float(ctx.options.get("timeout") or 600))
        from .genie_phone import attach  # --target android: genie-t2t-run on the phone (handle.phone)

        return attach(handle, ctx, opts, soc)
    if stage == "decoder":
        from .decoder import FixedKVDecoder

        sessions, load_s = {}, 0.0
        for f, art in zip(forms(stage, opts), arts):
            s = ep.HtpSession(art.file(), soc, f"decoder ({f.label()})")
            sessions[int(f.get("ar"))] = s
            load_s += s.load_s
        return DecoderHandle(FixedKVDecoder(sessions, opts["context_length"], ctx.model), arts, load_s)
    art = arts[0]
    if opts["target"] == "android":
        from vlmrun_qualcomm.adb import Adb

        from .netrun import NetRunStage, check_runtime, phone_sdk

        o = dict(ctx.options)
        sdk = phone_sdk(o.get("sdk_root"))
        check_runtime(art.manifest, sdk, f"{stage} ({art.path.name})")  # before adb is even asked for a device
        adb = Adb.connect(o.get("device"), o.get("adb"), timeout=float(o.get("adb_timeout") or 120))
        runner = NetRunStage(art, stage, sdk=sdk, adb=adb, native_outputs=bool(o.get("native_outputs")),
                             timeout=float(o.get("timeout") or 300))
    else:
        runner = LocalStage(ep.HtpSession(art.file(), soc, f"{stage} ({art.path.name})"), art)
    if stage == "embed":
        return ChunkedEmbed(runner, opts["embed_seq"])
    return runner


@hookimpl
def run_stage(backend, stage, handle, inputs):
    if not mine(backend, NAME):
        return None
    if stage == "decoder":
        return {"logits": handle.decoder.forward_all(np.asarray(inputs["inputs_embeds"], np.float32))}
    return handle.run(dict(inputs))  # GenieHtpHandle.decoder is the host loop over the same Genie-layout graphs


@hookimpl
def load_probe(backend, stage, ctx):
    """The stage's probe form compiled like the stage (:mod:`.probe`), for ``vlmrun diff --locate``."""
    if not mine(backend, NAME):
        return None
    from .probe import load_probe as load

    opts = stage_options(stage, ctx.options)
    return load(ctx, stage, opts, socs.soc(opts["soc"]), lambda form: _compiled(ctx, stage, opts, form),
                lambda: load_stage(backend, stage, ctx))


@hookimpl
def run_probe(backend, stage, handle, inputs):
    if not mine(backend, NAME):
        return None
    return handle.run(dict(inputs))


@hookimpl
def decode(backend, handle, request):
    if not mine(backend, NAME):
        return None
    if getattr(handle, "phone", None) is not None:  # engine genie on a phone: genie-t2t-run over adb
        return handle.phone.generate(handle, request)
    if hasattr(handle, "genie_generate"):
        return handle.genie_generate(request)
    return handle.decoder.generate(request)
