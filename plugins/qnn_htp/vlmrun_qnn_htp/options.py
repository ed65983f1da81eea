"""qnn_htp's per-stage options: declared (`declarations`, what ``register_options`` registers), filled
(`fill`), normalised and checked (`stage_options`), what keys a binary (`compile_key`), and the export forms a
stage compiles (`forms`).

Every option's default lives in its declaration only. The core fills the declared defaults in before a hook sees
the options (`vlmrun.options.StageOptions`); `fill` does the same, from these declarations, for a plain mapping
(a bundle's runtime options, a direct call), so the code below reads ``o["timeout"]`` and never spells a default
of its own. `vlmrun_qnn_htp.plan.StagePlan` is what the hooks read the options into, once.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Mapping

from vlmrun.errors import UsageError
from vlmrun.options import Option, OptionTable, StageOptions
from vlmrun.stages import ArtifactKind, ExportForm
from vlmrun_qualcomm import socs
from vlmrun_qualcomm.parts import DEFAULT_PART_LIMIT_MB
from vlmrun_qualcomm.parts import PRECISIONS as PARTS_PRECISIONS
from vlmrun_qualcomm.sdk import Sdk, phone_options

from . import calibration, ep, recipe
from .layers import LAYER_OPTIONS, check_keep_fp, keep_fp_key, parse_keep_fp, parts_keep_key
from .memory import parts_for_budget

NAME = "qnn_htp"
PRECISIONS = ("fp16", "int8", "a16w8", "w8a16", "w4a16")  # w8a16, w4a16: decoder_form = "parts" only
DECODER_FORMS = ("fixed", "parts")
ENGINES = ("host", "genie")
RMSNORMS = ("safe", "plain")  # the decoder exports' RMSNorm (vlmrun_ort_reference.onnx_export.safe_rms_norm)
TOOLCHAINS = ("onnxruntime", "sdk")
DEFAULT_CONTEXT = 512
DEFAULT_PREFILL_AR = 64
DEFAULT_EMBED_SEQ = 32
PARTS_ALIASES = {"a16w8": "w8a16"}  # the fixed form's name for the parts form's recipe
SHARING = ("auto", "on", "off")
DEFAULT_PARTS_PREFILL_AR = 128
#: the parts form's follow-up prompt graph (AR-32 beside AR-128 and AR-1): a conversation's next turn (20-30 new
#: positions) costs one AR-32 call instead of an AR-128 one (docs/measured.md, "Conversations")
DEFAULT_FOLLOWUP_AR = 32
Q_STAGES = ("vision", "projector", "embed", "decoder")


@functools.cache
def declarations() -> tuple[Option, ...]:
    """qnn_htp's per-stage options, with their defaults and help (what ``register_options`` registers)."""
    return (
        Option(NAME, "precision", str, choices=PRECISIONS, default="fp16", flag="--precision",
               help="numeric precision: fp16, int8 (a8w8, 16-bit Softmax) or a16w8; the decoder's parts form also"
                    " w8a16 or w4a16 (16-bit activations, 8- or 4-bit weights)"),
        Option(NAME, "soc", str, choices=tuple(socs.SOCS), default=socs.DEFAULT_SOC, flag="--soc",
               help="target Snapdragon SoC"),
        Option(NAME, "calibration_images", Path, flag="--calibration-images",
               help="folder of images to calibrate int8 (default: random data, labelled so in the manifest)"),
        Option(NAME, "context_length", int, stages=("decoder",), default=DEFAULT_CONTEXT, minimum=8,
               flag="--context-length", help="decoder context the graphs are compiled for"),
        Option(NAME, "prefill_ar", int, stages=("decoder",), minimum=1,
               help=f"decoder prefill chunk (AR-N); default: {DEFAULT_PARTS_PREFILL_AR} in the parts form (capped at the"
                    f" hidden size), {DEFAULT_PREFILL_AR} in the fixed form"),
        Option(NAME, "followup_ar", int, stages=("decoder",), default=DEFAULT_FOLLOWUP_AR, minimum=0,
               help="parts form: rows of a second, smaller prompt graph per part, compiled beside the AR-N and AR-1"
                    " graphs (in the same binary when weight-shared) for prompts it covers, such as a"
                    f" conversation's follow-up turn (default {DEFAULT_FOLLOWUP_AR}; 0 = none; ignored unless below"
                    " prefill_ar)"),
        Option(NAME, "engine", str, stages=("decoder",), choices=ENGINES, flag="--decoder-engine",
               help="how the compiled decoder graphs are driven: vlmrun's host loop or Qualcomm's Genie (libGenie);"
                    " default: genie for the parts form on a phone, host otherwise"),
        Option(NAME, "rmsnorm", str, stages=("decoder",), choices=RMSNORMS, default="safe",
               help="decoder RMSNorm: safe (rows scaled by their max |x| before squaring: no fp16 overflow on"
                    " massive activations) or plain (overflows in fp16 once |x| > 256)"),
        Option(NAME, "decoder_form", str, stages=("decoder",), choices=DECODER_FORMS,
               flag="--decoder-form", help="decoder graphs: parts (Qualcomm's shipping form: parts of layers, prompt"
                    " + token graphs per part in one weight-shared binary, Genie layout) or fixed (one graph per"
                    " binary, AR-N + AR-1); default: fixed for precision int8, parts otherwise"),
        Option(NAME, "embeds_input", str, stages=("decoder",), default="float",
               help="parts form: the decoder's inputs_embeds as float, or uint16:LO:HI (quantized over [LO, HI], as"
                    " a bundle compiles it so Genie's generator takes a 16-bit LUT)"),
        Option(NAME, "parts", int, stages=("decoder",), default=0, minimum=0,
               help="parts form: number of parts (0 = the fewest whose binaries stay under part_limit_mb)"),
        Option(NAME, "part_limit_mb", int, stages=("decoder",), default=DEFAULT_PART_LIMIT_MB, minimum=1,
               help="parts form: largest part binary, MB (the HTP maps one context into a 32-bit address space)"),
        Option(NAME, "calibration_order", str, stages=("decoder",), choices=calibration.ORDERS, default="auto",
               help="parts form, quantized: the calibration's host loop over every part's float graph open at once"
                    " (whole), one part at a time (sequence: memory of one part, the same feeds), or whole while the"
                    " float decoder fits in the memory budget or half this machine's memory (auto)"),
        Option(NAME, "weight_sharing", str, stages=("decoder",), choices=SHARING, default="auto",
               help="parts form: a part's prompt and token graphs in one binary sharing weights (on), one binary per"
                    " graph (off), or on except on the x86_64 emulator, which cannot load shared binaries (auto)"),
        Option(NAME, "keep_fp", str, stages=("vision", "projector", "decoder"),
               help="int8/a16w8: layers kept in fp16, comma-separated: names as vlmrun diff --locate prints them"
                    " (vision.stage2, decoder.layer1) or node-name prefixes starting with /"),
        Option(NAME, "keep_a16w16", str, stages=("vision", "projector", "decoder"),
               help="int8/a16w8: layers quantized at 16 bits (activations and weights), comma-separated: names as"
                    " vlmrun diff --locate prints them or node-name prefixes starting with /"),
        Option(NAME, "quantizer", str, stages=Q_STAGES, choices=recipe.QUANTIZERS, default="onnxruntime",
               flag="--quantizer", help="quantization engine: onnxruntime (QDQ tools, min-max) or aimet (AIMET-ONNX,"
                    f" Qualcomm's toolkit: LPBQ, Sequential MSE, AdaRound; {recipe.AIMET_EXTRA})"),
        Option(NAME, "weight_scheme", str, stages=Q_STAGES, choices=recipe.WEIGHT_SCHEMES,
               help="weights: per_channel, or lpbq (4-bit blocks along the input channel, AIMET, w4a16; the"
                    " default there)"),
        Option(NAME, "block_size", int, stages=("decoder",), minimum=1, flag="--block-size",
               help=f"LPBQ block size along the input channel (must divide it); default {recipe.DEFAULT_BLOCK_SIZE}"
                    " with weight_scheme lpbq, refused with any other scheme"),
        Option(NAME, "algorithm", str, stages=Q_STAGES, choices=recipe.ALGORITHMS, default="minmax",
               flag="--quant-algorithm", help="how weight encodings are chosen: minmax, seq_mse (Sequential MSE)"
                    " or adaround (AIMET)"),
        Option(NAME, "seq_mse_candidates", int, stages=Q_STAGES, default=recipe.DEFAULT_SEQ_MSE_CANDIDATES,
               minimum=1, help="Sequential MSE: encoding candidates tried per weight"),
        Option(NAME, "adaround_iterations", int, stages=Q_STAGES, default=recipe.DEFAULT_ADAROUND_ITERATIONS,
               minimum=1, help="AdaRound: optimisation steps per layer"),
        Option(NAME, "layer_precision", str, stages=("vision", "projector", "decoder"),
               help="per-layer precision map, LAYER=fp16|a16w16|w8|w4 comma-separated (e.g. decoder.lm_head=w8):"
                    " what vlmrun tune writes"),
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
    )


def fill(stage: str, options: Mapping[str, object] | None) -> StageOptions:
    """``options`` of ``stage`` as the hooks get them from the core: every option qnn_htp (and the core) declares,
    its declared default filled in when not given (`vlmrun.options.OptionTable.fill`). A `StageOptions` (what the
    core hands the hooks) comes back as it is; a plain mapping (a bundle's runtime options, a direct call) is
    filled from `declarations`, a key given as ``None`` counting as not given."""
    if isinstance(options, StageOptions):
        return options
    given = {k: v for k, v in dict(options or {}).items() if v is not None}
    return _table().fill(stage, NAME, given)


@functools.cache
def _table() -> OptionTable:
    return OptionTable.of(declarations())


def default_form(precision: str) -> str:
    """The decoder's form when the layout names none: ``parts``, Qualcomm's shipping form (what a bundle holds),
    except at int8 (a8w8), which only the single-graph ``fixed`` form has."""
    return "fixed" if precision == "int8" else "parts"


def default_prefill_ar(form: str) -> int:
    """The decoder's prefill chunk (AR-N) when the layout names none (``prefill_ar`` is declared without a default):
    `DEFAULT_PARTS_PREFILL_AR` in the parts form (`vlmrun_qualcomm.parts.plan` caps it at the hidden size),
    `DEFAULT_PREFILL_AR` in the fixed form."""
    return DEFAULT_PARTS_PREFILL_AR if form == "parts" else DEFAULT_PREFILL_AR


def stage_options(stage: str, options) -> dict:
    """Normalise a stage's layout options (UsageError for bad values): what determines its binaries, every value
    resolved (a default that depends on other options included). ``options``: filled (`fill`) or a plain mapping."""
    o = fill(stage, options)
    precision = str(o["precision"]).lower()
    if precision not in PRECISIONS:
        raise UsageError(f"precision '{precision}' is not one of {', '.join(PRECISIONS)}")
    if precision == "w8a16" and stage != "decoder":  # 8-bit weights, 16-bit activations: the stages' a16w8
        precision = "a16w8"  # (so --precision w8a16, which reaches every stage, means the same recipe on each)
    out = {"precision": precision, "soc": socs.soc(o["soc"]).name}
    form = str(o["decoder_form"] or default_form(precision)).lower() if stage == "decoder" else "fixed"
    if form not in DECODER_FORMS:
        raise UsageError(f"decoder_form '{form}' is not one of {', '.join(DECODER_FORMS)}")
    if precision in ("w8a16", "w4a16") and form != "parts":
        raise UsageError(f"precision {precision} is the decoder's parts form only (decoder_form = \"parts\");"
                         " other stages and the fixed decoder take int8 or a16w8")
    if form == "parts":
        out.update(parts_options(o, precision))
    if precision != "fp16":
        cal = o["calibration_images"] if stage != "embed" else None  # embed calibrates on token ids
        out["calibration_images"] = str(Path(cal).expanduser().resolve()) if cal else None
        default = {"embed": calibration.EMBED_CALIBRATION, "decoder": calibration.DECODER_CALIBRATION}.get(stage, "random")
        out["calibration"] = calibration.calibration_digest(cal) or default
        if form == "parts" and not out["calibration_images"]:
            out["calibration"] = calibration.PARTS_CALIBRATION
        if stage == "decoder" and o["engine"] == "genie" and form != "parts":
            raise UsageError(f"precision {precision} is not available for the genie decoder engine on qnn_htp;"
                             " use fp16 or engine = host")
    if stage == "decoder":
        ctx = int(o["context_length"])
        ar = int(o["prefill_ar"] or default_prefill_ar(form))
        if ctx < 8:
            raise UsageError(f"context_length {ctx} is too small")
        out["context_length"] = ctx
        out["prefill_ar"] = max(1, min(ar, ctx // 2)) if form != "parts" else out["prefill_ar"]
        out["decoder_form"] = form
        # on a phone the parts decoder is Genie's (genie-t2t-run): the host loop drives one graph per call
        engine = str(o["engine"] or ("genie" if str(o["target"]).lower() == "android" and form == "parts"
                                     else "host"))
        if engine not in ENGINES:
            raise UsageError(f"decoder engine '{engine}' is not provided by qnn_htp (engines: {', '.join(ENGINES)});"
                             " a Genie engine comes with its own plugin")
        out["engine"] = engine
        rmsnorm = str(o["rmsnorm"]).lower()
        if rmsnorm not in RMSNORMS:
            raise UsageError(f"rmsnorm '{rmsnorm}' is not one of {', '.join(RMSNORMS)}")
        out["rmsnorm"] = rmsnorm
    if stage == "embed":
        out["embed_seq"] = int(o["embed_seq"])
    out.update(layer_options(stage, o, out["precision"]))
    rec = recipe.from_options(stage, o, out["precision"], form)
    if rec is not None:
        if rec.quantizer != "onnxruntime" and str(o["toolchain"]).lower() == "sdk":
            raise UsageError(f"{stage}: quantizer = \"{rec.quantizer}\" needs toolchain = \"onnxruntime\" (the"
                             " SDK's converter quantizes the stage itself)")
        out.update(rec.key())
    target = str(o["target"]).lower()
    if target not in ("local", "android"):
        raise UsageError(f"target '{target}' is not one of local, android")
    if target == "android" and stage == "decoder" and out.get("engine") != "genie":
        raise UsageError("the decoder's host engine cannot run on a phone (qnn-net-run runs one graph per call);"
                         " use --decoder-engine genie: Genie's genie-t2t-run decodes on the phone's HTP")
    out["target"] = target
    toolchain = str(o["toolchain"]).lower()
    if toolchain not in TOOLCHAINS:
        raise UsageError(f"toolchain '{toolchain}' is not one of {', '.join(TOOLCHAINS)}")
    if toolchain == "sdk" and stage == "decoder":
        raise UsageError("toolchain = \"sdk\" compiles vision, projector and embed; the decoder compiles with"
                         " onnxruntime-qnn")
    out["toolchain"] = toolchain
    if toolchain == "sdk":
        out["sdk_root"] = str(o["sdk_root"]) if o["sdk_root"] else None
    return out


RECIPE_KEYS = ("quantizer", "weight_scheme", "block_size", "algorithm", "seq_mse_candidates", "adaround_iterations",
               "aimet")


def layer_options(stage: str, o: Mapping, precision: str) -> dict:
    """The per-layer precision options (`.layers`): ``keep_fp``, ``keep_a16w16`` and ``layer_precision``
    folded into ``{option: layer names}`` for `.layers.LAYER_OPTIONS`; a layer named twice is refused.
    ``o``: the stage's filled options (`fill`)."""
    out: dict[str, tuple] = {}
    for option in ("keep_fp", "keep_a16w16"):
        names = parse_keep_fp(o.get(option))
        if names:
            out[option] = names
    for layer, p in recipe.parse_layer_precision(o.get("layer_precision"), stage).items():
        option = recipe.LAYER_PRECISIONS[p]
        out[option] = (*out.get(option, ()), layer)
    seen: dict[str, str] = {}
    for option in LAYER_OPTIONS:
        check_keep_fp(stage, out.get(option, ()), precision, option)
        for n in out.get(option, ()):
            if n in seen:
                raise UsageError(f"{stage}: {n} is in both {seen[n]} and {option}; choose one")
            seen[n] = option
    if out.get("keep_w4") and precision not in ("w4a16", "w8a16"):
        raise UsageError(f"{stage}: w4 weights are the decoder's parts form (w8a16 / w4a16), not {precision}")
    if any(out.get(k) for k in LAYER_OPTIONS[1:]) and str(o["toolchain"]).lower() == "sdk":
        raise UsageError("keep_a16w16 and layer_precision need toolchain = \"onnxruntime\" (the SDK's converter"
                         " quantizes the stage itself)")
    return out


def compile_key(opts: dict) -> dict:
    """The options that determine the binary's bytes (they key the artifact store)."""
    keep = ("precision", "soc", "calibration", "weight_sharing", "part_limit_mb")  # the last two: parts form
    key = {**{k: opts[k] for k in keep if k in opts}, "qnn": ep.qnn_version(), "fallback": "disabled"}
    key.update({k: opts[k] for k in RECIPE_KEYS if k in opts})  # a recipe other than the default
    if opts.get("embeds_input") not in (None, "float"):  # parts form, a bundle's decoder: quantized embeddings in
        key["embeds_input"] = opts["embeds_input"]
    if opts.get("toolchain") == "sdk":  # the SDK's tools, its QNN version (the onnxruntime default keys as before)
        sdk = Sdk.find(opts.get("sdk_root"))
        key.update(toolchain="sdk", qnn=sdk.version(), sdk_root=str(sdk.root))
    return key


def compiled_artifact(ctx, stage: str, opts: dict, form: ExportForm):
    """The stage's compiled binary for export form ``form`` through the store (`ctx.compiled`), keyed by the
    options that determine its bytes (`compile_key`) and its per-layer precision resolved to the form's layers."""
    src = ctx.exported(form)
    kind = ArtifactKind.of(form, opts["precision"], opts["soc"])
    key_opts = compile_key(opts)
    if opts.get("calibration_images"):
        key_opts["calibration_images"] = opts["calibration_images"]
    for option in LAYER_OPTIONS:  # per-layer precision: the layers' boundaries in this form's graphs (layers.py)
        if opts.get(option):
            resolve = parts_keep_key if form.kind == "decoder/parts" else keep_fp_key
            key_opts[option] = resolve(ctx, form, opts[option], option)
    return ctx.compiled(src, key_opts, kind)


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
        norm = opts["rmsnorm"]  # fp16-safe RMSNorm unless asked otherwise (the declared default)
        if opts.get("engine") == "genie":
            return [ExportForm.of("decoder", "decoder/genie", ar=ar, ctx=ctx, input="embeds", rmsnorm=norm)
                    for ar in ars]
        return [ExportForm.of("decoder", "decoder/fixed", ar=ar, ctx=ctx, rmsnorm=norm) for ar in ars]
    if stage == "embed":
        return [ExportForm.of("embed", seq=opts["embed_seq"])]
    return [ExportForm.of(stage)]


def parts_options(o: Mapping, precision: str) -> dict:
    """The parts form's options (UsageError for bad values); ``o`` is the stage's filled options (`fill`)."""
    precision = PARTS_ALIASES.get(precision, precision)
    if precision not in PARTS_PRECISIONS:
        raise UsageError(f"precision '{precision}' is not available for decoder_form = \"parts\" (choose"
                         f" {', '.join(PARTS_PRECISIONS)})")
    sharing = str(o["weight_sharing"]).lower()
    if sharing not in SHARING:
        raise UsageError(f"weight_sharing '{sharing}' is not one of {', '.join(SHARING)}")
    parts = int(o["parts"])
    limit = int(o["part_limit_mb"])
    if parts < 0 or limit < 1:
        raise UsageError("parts must be >= 0 (0 = the fewest under part_limit_mb) and part_limit_mb >= 1")
    from .image_encoder import parse_embeds_input

    embeds = str(o["embeds_input"])
    parse_embeds_input(embeds)  # UsageError for a bad value, before any work
    return {"precision": precision, "weight_sharing": resolve_sharing(sharing, o["compiler"]), "parts": parts,
            "part_limit_mb": limit, "prefill_ar": int(o["prefill_ar"] or default_prefill_ar("parts")),
            "followup_ar": int(o["followup_ar"]), "embeds_input": embeds}


def resolve_sharing(sharing: str, compiler: str | None = None) -> str:
    """``auto``: on, except for a local compile on the x86_64 emulator; another compiler (``--compiler qaihub``)
    builds the binaries for a device, so shared there."""
    if sharing == "auto":
        if compiler and str(compiler) != "qnn_htp":
            return "on"
        return "off" if ep.is_emulator() else "on"
    return sharing




#: fp32 weight bytes of one part graph that AIMET's engine quantizes within about 16 GB: its simulation holds ~10
#: copies (FastVLM-0.5B size: 17 layers + lm_head, 1.56 GB, peaked at 12.9 GB; all 24 + lm_head, 1.98 GB, was
#: killed at 21.7 GB)
AIMET_GRAPH_LIMIT = 1_600_000_000


def parts_plan(model, opts: dict) -> dict:
    """`vlmrun_qualcomm.parts.plan` (the parts, AR and context of the export), except that with ``parts = 0`` each
    part's float graph also stays under `AIMET_GRAPH_LIMIT` with the AIMET engine, and each part is made within the
    memory budget when one is set (``VLMRUN_MEMORY_BUDGET_GB``: `.memory.parts_for_budget`). A given ``parts``
    is kept (its export still checks the budget)."""
    import math

    from vlmrun_qualcomm.parts import plan, weight_counts

    base = plan(model, opts)
    if opts.get("parts"):
        return base
    fewest = len(base["layers"])
    rec = recipe.from_key(opts)  # None: not quantized (fp16)
    if rec is not None and rec.quantizer == "aimet":
        mm, other, head = weight_counts(model)
        fewest = max(fewest, math.ceil((model.num_layers * (mm + other) + head) * 4 / AIMET_GRAPH_LIMIT))
    parts = parts_for_budget(model, opts["precision"], rec.quantizer if rec is not None else None, fewest)
    return base if parts == len(base["layers"]) else plan(model, {**opts, "parts": parts})
