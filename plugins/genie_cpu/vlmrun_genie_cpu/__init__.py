"""vlmrun plugin ``genie_cpu``: the decoder on Genie's QnnGenAiTransformer (CPU) backend from the QAIRT SDK.

Compile: the SDK's genai-transformer composer turns the model's Qwen2 weights (extracted from the FastVLM
checkpoint into a plain Qwen2 directory) into a model bin (``--quantize none|z8|q4``); the artifact also holds
the float32 LUT [V,H] (``-t``) and tokenizer.json. Decode: libGenie in a worker process when
libQnnGenAiTransformer.so and libGenie.so are found on the host, else ``genie-t2t-run`` on the host SDK, or on a
phone over adb with ``target = "android"``. Genie's profile becomes ``handle.last_timings``. Conversations on a
phone keep Genie's dialog state there between turns (genie-app's dialog save/restore, ``decoder_state``); on this
host every turn runs from the start.

Per-stage options: ``quantize`` (none, z8, q4), ``context_length`` (default 1024), ``sdk_root`` (else
``$QAIRT_SDK_ROOT`` / ``$QNN_SDK_ROOT``), ``runner`` (auto, libgenie, t2t), ``target`` (local, android) with
``device``, ``adb``, ``remote_dir``, ``ndk_root`` (else ``$ANDROID_NDK_ROOT``: the phone needs the NDK's
``libc++_shared.so``); ``timeout`` (s, default 600); ``composer_python``, ``compose_timeout``.
"""

from __future__ import annotations

from vlmrun import hookimpl
from vlmrun.plugins import BackendInfo, Check, Preset, mine

from vlmrun_qualcomm import sdk

from .options import NAME, DecoderPlan, declarations

__version__ = "0.1.0"


@hookimpl
def describe():
    return BackendInfo(NAME, ("decoder",), "Genie on the QnnGenAiTransformer CPU backend (QAIRT SDK; host or adb)")


@hookimpl
def doctor():
    try:
        found = sdk.Sdk.find(None)
    except Exception as exc:  # never raise from doctor
        return [Check("QAIRT SDK", False, str(exc))]
    if found.root is None:
        return [Check("QAIRT SDK", False, "QAIRT_SDK_ROOT / QNN_SDK_ROOT not set: genie_cpu needs the SDK")]
    version, where = found.version_info()
    checks = [Check("QAIRT SDK", True, f"{found.root} (QNN {version or 'version unknown'}"
                                       + (f", from {where})" if where else ")"))]
    for label, path in found.tools("local").items():
        checks.append(Check(label, path is not None, str(path) if path else f"not found under {found.root}"))
    for label, path in found.tools("android").items():
        if label not in ("composer",):
            checks.append(Check(f"{label} (android)", path is not None, str(path) if path else "not found"))
    return checks


@hookimpl
def register_presets(register):
    register(Preset("hybrid", {"vision": "qnn_htp", "projector": "qnn_htp", "embed": "qnn_htp", "decoder": NAME},
                    "vision, projector and embed on the NPU (qnn_htp); the decoder on Genie's CPU backend"))


@hookimpl
def register_options(register):
    for o in declarations():  # .options: each option's default lives in its declaration only
        register(o)


@hookimpl
def compile(backend, request):
    if not mine(backend, NAME):
        return None
    from .compose import compile_decoder

    # the key options (quantize, context, SDK) decide the bytes; the stage's other options say how to run the tool
    plan = DecoderPlan.of({**request.stage_options, **request.options})
    return compile_decoder(request.model, request.source, plan, request.out_dir)


@hookimpl
def preflight(backend, stage, model, options):
    if not mine(backend, NAME):
        return
    from .runner import require_tools

    require_tools(options, model)


@hookimpl
def load_stage(backend, stage, ctx):
    if not mine(backend, NAME):
        return None
    from .runner import load_decoder

    return load_decoder(ctx)


@hookimpl
def run_stage(backend, stage, handle, inputs):
    if not mine(backend, NAME):
        return None
    from vlmrun.errors import BackendError

    raise BackendError("genie_cpu cannot return logits (Genie only generates): teacher forcing and `vlmrun diff`"
                       " need another decoder backend")


@hookimpl
def decode(backend, handle, request):
    if not mine(backend, NAME):
        return None
    return handle.generate(request)


@hookimpl
def decoder_state(backend, handle):
    """On a phone with the SDK's genie-app: Genie's dialog state saved there after each turn and restored by the
    next (`vlmrun_genie_cpu.runner.GenieCpuDecoder.dialog_state`); else ``None`` (every turn from the start)."""
    if not mine(backend, NAME):
        return None
    return handle.dialog_state()
