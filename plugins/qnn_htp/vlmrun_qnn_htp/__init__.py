"""vlmrun plugin ``qnn_htp``: FastVLM stages as QNN context binaries on the Qualcomm HTP.

Compile: ONNX -> QNN context binary with onnxruntime-qnn (EPContext, embed mode 0, CPU fallback disabled,
static shapes, ``soc_model`` from `vlmrun_qualcomm.socs`), fp16 by default or quantized by the stage's recipe
(`.recipe`, `.quantizer`; calibration data: `.calibration`).
Where things are: options (`.options`), the onnxruntime-qnn session and EP checks (`.ep`), the fixed
forms' handles (`.handles`), the parts form (`.parts_compile`, `.parts_run`, Genie naming in
`.genie_names`), Genie engines (`.genie_engine`, `.genie_phone`), probes and per-layer precision
(`.probe`, `.layers`), the phone (`.netrun`), the SDK's own tools (`.sdk_compile`).
Run: locally on the HTP backend of onnxruntime-qnn (the v79 emulator on x86_64, the NPU on a Snapdragon
host), or with ``target = "android"`` on a phone through the SDK's ``qnn-net-run`` over adb (`.netrun`).
Decode: a host-driven fixed-KV loop over an AR-N prefill graph and an AR-1 graph (`.decoder`).

Per-stage options (layout TOML or ``vlmrun compile`` flags):

=================== ====================================================================================
``precision``       ``fp16`` (default), ``int8`` (a8w8, 16-bit Softmax) or ``a16w8``: every stage (decoder:
                    host engine only)
``soc``             ``SM8750`` (default), ``SM8650``, ``SM8550``, ... (see `vlmrun_qualcomm.socs.SOCS`)
``calibration_images`` folder of images for int8 (default: random data for vision/projector, labelled so in
                    the manifest; the demo image for the decoder; embed calibrates on token ids)
``context_length``  decoder context the graphs are compiled for (default 512)
``prefill_ar``      decoder prefill chunk (AR-N) (default 64)
``engine``          decoder engine: ``host`` (this loop) or ``genie`` (Genie on QnnHtp via libGenie from
                    onnxruntime-qnn, graphs in Genie's I/O layout, see `.genie_engine`)
``rmsnorm``         decoder RMSNorm as exported: ``safe`` (default: each row scaled by its max |x| before
                    squaring, so fp16 does not overflow on massive activations) or ``plain`` (transformers' form;
                    overflows in fp16 once |x| > 256, kept to show the failure)
``decoder_form``    ``parts`` (default; int8 picks ``fixed``) or ``fixed`` (one fp16/int8 graph per binary, AR-N + AR-1). ``parts``: Qualcomm's
                    shipping form (`.parts_compile`): P parts, each a prompt (AR-N) and a token (AR-1) graph in Genie's
                    I/O layout, ``fp16``/``w8a16``/``w4a16``, both graphs of a part in one weight-shared binary
``parts``           parts: number of parts (0 = the fewest whose binaries stay under ``part_limit_mb``, default
                    1000 MB); ``weight_sharing``: ``auto`` (shared except on the x86_64 emulator, which cannot load
                    shared binaries), ``on`` or ``off``; ``prefill_ar`` defaults to 128 there (capped at the hidden size)
``embed_seq``       static sequence length of the embed graph; longer inputs run in chunks (default 32)
``keep_fp``         int8/a16w8/w8a16/w4a16: layers kept out of quantization (run in fp16), comma-separated: layer
                    names as ``vlmrun diff --locate`` prints them (``vision.stage2``, ``decoder.layer1``) or node-name
                    prefixes starting with ``/`` (not in the parts form); in the parts form the layer's nodes in
                    its part's prompt and token graphs (`.probe`)
``keep_a16w16``     int8/a16w8/w8a16/w4a16: layers quantized with 16-bit activations and weights (the rest stays
                    at the stage's precision), the same entries as ``keep_fp``
``layer_precision`` per-layer map ``LAYER=fp16|a16w16|w8|w4`` (`.layers`)
``quantizer``       quantized precisions: ``onnxruntime`` (default) or ``aimet`` (AIMET-ONNX, the ``aimet`` extra);
                    with ``weight_scheme`` (``per_channel``, ``lpbq``: AIMET w4a16's default), ``block_size`` (64),
                    ``algorithm`` (``minmax``, ``seq_mse``, ``adaround``), ``seq_mse_candidates``,
                    ``adaround_iterations``: the recipe (`.recipe`, applied by `.quantizer`)
``target``          ``local`` (default) or ``android``; with ``device``, ``adb``, ``sdk_root``,
                    ``native_outputs``, ``timeout``; the decoder on a phone needs engine ``genie`` (the SDK's
                    genie-t2t-run on the phone's HTP, `.genie_phone`; ``ndk_root`` for libc++_shared.so)
``toolchain``       ``onnxruntime`` (default: onnxruntime-qnn, QNN 2.51) or ``sdk``: the QAIRT SDK's own
                    converter, model-lib generator and context-binary generator (`.sdk_compile`), for
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
from vlmrun.plugins import BackendInfo, Check, Preset, mine
from vlmrun.stages import STAGES, ExportForm
from vlmrun_qualcomm import emulator, precisions, socs
from vlmrun_qualcomm.genie_session import DialogState
from vlmrun_qualcomm.manifest import ContextManifest
from vlmrun_qualcomm.sdk import Sdk, newer_than

from . import bundle_run, calibration, ep, image_encoder, recipe
from .decoder import FixedKVDecoder, FixedKVState
from .handles import ChunkedEmbed, DecoderHandle, LocalStage
from .layers import LAYER_OPTIONS
from .options import NAME, binary_version, compiled_artifact, declarations, forms
from .options import Q_STAGES, stage_options  # noqa: F401 (vlmrun_qnn_htp.stage_options: tests, scripts)
from .plan import StagePlan
from .qdq_facts import io_quant
from .quantizer import quantize

__version__ = "0.1.1"


# -- hooks -------------------------------------------------------------------------------------------------


@hookimpl
def register_presets(register):
    # vlmrun tune starts from all-npu with each quantized stage at its cheapest precision
    register(Preset("all-npu", dict.fromkeys(STAGES, NAME), "every stage on the Hexagon NPU (QNN HTP)",
                    tune={"vision": {"precision": "int8"}, "projector": {"precision": "int8"},
                          "decoder": {"precision": "w4a16"}}))


@hookimpl
def register_precisions(register):
    precisions.register(register)


@hookimpl
def register_options(register):
    for o in declarations():  # .options: each option's default lives in its declaration only
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
    if ok and ep.is_emulator():
        status = emulator.route_pow(Path(detail).parent)
        checks.append(Check("HTP emulator's pow fast path", status.startswith("on") or "=0" in status, status))
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
    plan = StagePlan.of(stage, options)
    opts, rt = plan.opts, plan.runtime
    if stage == "decoder":  # an LPBQ block that does not divide the weights' input channels: before any export
        recipe.check_block_size(plan.recipe, model)
    if plan.toolchain == "sdk" and plan.compiled_here:
        sdk = Sdk.find(opts.get("sdk_root"))
        sdk.require_compile_tools('for toolchain = "sdk"')
        if not sdk.version():
            raise BackendError(f"cannot read the QNN version of the SDK at {sdk.root} (no sdk.yaml): binaries made"
                               " with toolchain = \"sdk\" must record it; use a complete QAIRT SDK")
    if plan.target == "android":
        from .netrun import check_runtime, device_files, phone_sdk

        sdk = phone_sdk(rt.sdk_root)
        if stage == "decoder":  # engine genie: genie-t2t-run and the HTP runtime (genie_phone), not qnn-net-run
            from .genie_phone import device_files as genie_device_files

            genie_device_files(sdk, plan.soc, rt.ndk_root)
        else:
            device_files(sdk.root, plan.soc.arch)
        built = binary_version(opts, options)
        if built:
            check_runtime({"qnn_version": built, "compiler": plan.compiler if not plan.compiled_here else
                           ("qnn_htp with the SDK's tools" if plan.toolchain == "sdk" else "onnxruntime-qnn")},
                          sdk, stage)


@hookimpl
def compile(backend, request):
    if not mine(backend, NAME):
        return None
    return compile_stage(request.stage, request.model, request.source, request.options, Path(request.out_dir),
                         context=request.context, all_options=request.stage_options, rebuild=request.rebuild)


def _compile_binary(src: Path, out_dir: Path, name: str, soc, precision: str, options: dict, work: Path,
                    feeds, what: str) -> tuple[dict, dict]:
    """(manifest fields, extra) from onnxruntime-qnn, or from the SDK's own tools with toolchain = "sdk"."""
    if options.get("toolchain") == "sdk":
        from .sdk_compile import compile_onnx_sdk

        info = compile_onnx_sdk(src, out_dir, name, soc, precision, Sdk.find(options.get("sdk_root")), work,
                                calibration=feeds, what=what)
        return info, {"toolchain": info.pop("toolchain")}
    return ep.compile_onnx(src, out_dir, name, soc, what), {}


def compile_stage(stage, model, source, options, out_dir: Path, *, all_options, context=None,
                  rebuild: bool = False) -> dict:
    """Compile ``source`` into a context binary in ``out_dir`` (``options``: the keyed options; ``all_options``:
    all of the stage's, for the ones that change how it is made but not its bytes); ``context`` (a
    CompileContext) gives int8 calibration its reference activations."""
    if str(source.manifest.get("form", "")).startswith("decoder/parts"):  # every part, both graphs
        from .parts_compile import compile_parts

        return compile_parts(model, source, options, out_dir, context=context, rebuild=rebuild,
                             calibration_order=all_options["calibration_order"])
    soc = socs.soc(options.get("soc"))
    precision = options["precision"]  # the compile key (.options.compile_key) always names it
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
            feeds, label = calibration.calibration_samples(stage, model, options.get("calibration_images"),
                                                            source=source, context=context)
            if options.get("toolchain") == "sdk":  # the SDK's converter quantizes from the samples itself
                extra = {"quantization": {"calibration": label, "samples": len(feeds), "by": "qnn-onnx-converter"}}
            else:
                qdq = work / f"{name}.qdq.onnx"
                layers = {o: options[o] for o in LAYER_OPTIONS if options.get(o)}
                facts = quantize(src, qdq, feeds, recipe.from_key(options), work, layers)
                extra = {"quantization": {**facts, "io_quant": io_quant(qdq), "calibration": label,
                                          "quantize_s": round(time.perf_counter() - t0, 3)}}
                src = qdq
        if form == image_encoder.FORM:  # Genie's image encoder: a quantized pixel_values input (image_encoder.py)
            if options.get("toolchain") == "sdk":
                raise UsageError("the image-encoder form is compiled by onnxruntime-qnn only; drop toolchain = sdk")
            enc = image_encoder.pixel_encoding(model.image_processor_config)
            image_encoder.with_quantized_input(src, work / f"{name}.in.onnx", enc)
            src = work / f"{name}.in.onnx"
            extra["image_input"] = enc
        info, more = _compile_binary(src, out_dir, name, soc, precision, options, work, feeds, what)
        extra.update(more)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    io_q = extra.get("quantization", {}).get("io_quant", {}) or {
        t["name"]: t["quant"] for t in (*info["inputs"], *info["outputs"]) if "quant" in t}
    if "image_input" in extra:  # the input Genie quantizes pixels to is ours, not the QDQ model's inner one
        enc = extra["image_input"]
        io_q = {**io_q, image_encoder.INPUT: {"scale": enc["scale"], "offset": -enc["zero_point"],
                                              "dtype": enc["dtype"]}}
    for t in (*info["inputs"], *info["outputs"]):
        if t["name"] in io_q:
            t["quant"] = io_q[t["name"]]
    return ContextManifest(**info, stage=stage, precision=precision, compiler=NAME, source_form=form,
                           io_quant=io_q, extra=extra).to_dict()


@hookimpl
def load_stage(backend, stage, ctx):
    if not mine(backend, NAME):
        return None
    if getattr(ctx, "bundle", None):  # a bundle:DIR layout: Genie's VLM pipeline over the folder's files
        from .bundle_stage import load_bundle_stage

        return load_bundle_stage(stage, ctx)
    plan = StagePlan.of(stage, ctx.options)
    opts, soc, rt = plan.opts, plan.soc, plan.runtime
    if plan.form == "parts":
        from .parts_compile import parts_artifact
        from .parts_run import load_parts

        from .genie_phone import attach  # engine genie + --target android: genie-t2t-run on the phone

        return attach(load_parts(ctx, plan, parts_artifact(ctx, plan)), ctx, plan)
    arts = [compiled_artifact(ctx, stage, opts, f) for f in forms(stage, opts)]
    for art in arts:
        ContextManifest.from_dict(art.manifest, f"{stage} artifact {art.path.name}")
        ep.check_binary(art.manifest, art.file(), soc, f"{stage} ({art.path.name})")
    if plan.compiled_here:  # another compiler's binary for this stage goes unused: say so
        import sys

        srcs = {a.manifest.get("key", {}).get("source") for a in arts}

        def elsewhere(k: dict) -> bool:
            ko = k.get("options") or {}
            return (k.get("backend") == NAME and k.get("compiler") not in (None, NAME) and k.get("source") in srcs
                    and (ko.get("precision"), ko.get("soc")) == (opts["precision"], opts["soc"]))

        other = ctx.store.find(elsewhere)
        if other:
            compiler = other[0].manifest["key"]["compiler"]
            print(f"qnn_htp: {stage} runs {arts[0].path.name} (compiled here); {compiler} compiled"
                  f" {other[0].path.name} for it too: add --compiler {compiler} to run that one", file=sys.stderr)
    if stage == "decoder" and plan.engine == "genie":
        from .genie_engine import GenieHtpHandle

        lut = ctx.exported(ExportForm.of("embed", "embed/lut")).file("embed_lut_f32.npy")
        handle = GenieHtpHandle(ctx.model, [(int(f.get("ar")), a) for f, a in zip(forms(stage, opts), arts)],
                                opts["context_length"], soc, lut, rt.timeout)
        from .genie_phone import attach  # --target android: genie-t2t-run on the phone (handle.phone)

        return attach(handle, ctx, plan)
    if stage == "decoder":
        from .decoder import FixedKVDecoder

        sessions, load_s = {}, 0.0
        for f, art in zip(forms(stage, opts), arts):
            s = ep.HtpSession(art.file(), soc, f"decoder ({f.label()})")
            sessions[int(f.get("ar"))] = s
            load_s += s.load_s
        return DecoderHandle(FixedKVDecoder(sessions, opts["context_length"], ctx.model), arts, load_s)
    art = arts[0]
    if plan.target == "android":
        from vlmrun_qualcomm.adb import Adb

        from .netrun import NetRunStage, check_runtime, phone_sdk

        sdk = phone_sdk(rt.sdk_root)
        check_runtime(art.manifest, sdk, f"{stage} ({art.path.name})")  # before adb is even asked for a device
        adb = Adb.connect(rt.device, rt.adb, timeout=rt.adb_timeout)
        runner = NetRunStage(art, stage, sdk=sdk, adb=adb, native_outputs=rt.native_outputs, timeout=rt.timeout)
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
def layer_precisions(backend, stage, options):
    """What ``layer_precision`` can set a layer of ``stage`` to, cheapest first (``vlmrun tune``): a w4a16 decoder's
    layers go to 8-bit weights, then 16-bit activations and weights; other quantized precisions to a16w16."""
    if not mine(backend, NAME):
        return None
    return list(recipe.TUNE_LADDERS.get(str(options["precision"]), ())) if stage != "embed" else []


@hookimpl
def run_request(backend, handles, request):
    """A bundle's whole request through Genie's pipeline (`.bundle`); other layouts go stage by stage."""
    if not mine(backend, NAME) or not hasattr(handles.get("decoder"), "runtime"):
        return None
    from .bundle_stage import run_request as run

    return run(handles, request)


@hookimpl
def request_state(backend, handles):
    """A bundle's conversation kept in Genie's pipeline between turns (`.bundle_run.BundleConversation`)."""
    if not mine(backend, NAME):
        return None
    return bundle_run.request_state(handles)


@hookimpl
def write_bundle(backend, request):
    if not mine(backend, NAME):
        return None
    from .bundle import write_bundle as write

    return write(request)


@hookimpl
def verify_bundle(backend, path, options):
    if not mine(backend, NAME):
        return None
    from vlmrun_qualcomm.genie_pipeline import PipelineLibrary

    from .bundle import verify_bundle as verify
    from .genie_engine import libgenie_path

    sdk_qnn = None
    if options.get("sdk_root"):
        sdk_qnn = Sdk.find(options["sdk_root"]).version()
    lib = PipelineLibrary(libgenie_path())
    return verify(Path(path), soc_name=options.get("soc"), sdk_qnn=sdk_qnn, parse=lib.parse_node_config)


@hookimpl
def load_probe(backend, stage, ctx):
    """The stage's probe form compiled like the stage (`.probe`), for ``vlmrun diff --locate``."""
    if not mine(backend, NAME):
        return None
    from .probe import load_probe as load

    plan = StagePlan.of(stage, ctx.options)
    return load(ctx, plan, lambda form: compiled_artifact(ctx, stage, plan.opts, form),
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


@hookimpl
def decoder_state(backend, handle):
    """A conversation's state kept between turns: the host engine's KV buffers (fixed and parts forms); with engine
    ``genie``, Genie's dialog alive in its worker (`vlmrun_qualcomm.genie_session.DialogState`); on a phone, Genie's
    dialog state saved there by genie-app after each turn and restored by the next
    (`vlmrun_qualcomm.genie_app.AppDialogState`; ``None`` when the SDK has no genie-app: every turn from the start).
    Each turn feeds its new rows only. A bundle keeps its conversation through ``request_state``."""
    if not mine(backend, NAME) or hasattr(handle, "runtime"):
        return None
    if getattr(handle, "phone", None) is not None:  # engine genie on a phone (.genie_phone)
        return handle.phone.dialog_state(handle)
    if hasattr(handle, "genie_generate"):  # engine genie: the dialog kept in its worker between turns
        return DialogState(handle.lib.path, getattr(handle, "dialog_config", handle.config), handle.lut_npy,
                           handle.facts.hidden, handle.timeout)
    decoder = getattr(handle, "decoder", None)
    return FixedKVState(decoder) if isinstance(decoder, FixedKVDecoder) else None
