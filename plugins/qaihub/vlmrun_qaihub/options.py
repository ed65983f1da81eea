"""qaihub's options: the plugin's name and stages, the options it declares (``vlmrun plugins --options``), and
reading them: the hub device they name, the precision and QAIRT version as hub compile options, the hub's
timeouts, and the per-layer precision a hub compile refuses."""

from __future__ import annotations

import os
import re
from pathlib import Path

import attrs

from vlmrun.errors import UsageError
from vlmrun.options import Option
from vlmrun_qualcomm import socs

from . import hub as hubmod

NAME = "qaihub"

HOSTED_STAGES = ("vision", "projector", "embed")
COMPILE_STAGES = (*HOSTED_STAGES, "decoder")  # --compiler qaihub also compiles qnn_htp's decoder parts form (parts.py)
PRECISIONS = ("fp16", "int8", "a16w8")
DEFAULT_DEVICE = "Snapdragon 8 Elite QRD"
DEFAULT_EMBED_SEQ = 32
DEFAULT_BATCH_MB = 1024.0  # vlmrun's cap on one batch job's inputs (no limit is documented; see hosted.py's run_batch)
ENV_DEVICE = "VLMRUN_QAIHUB_DEVICE"
ENV_TIMEOUT = "VLMRUN_QAIHUB_TIMEOUT"
QAIRT_VERSION = re.compile(r"^(\d+\.\d+(\.\d+)*|latest|default)$")

QUANT_FLAGS = {"int8": "--quantize_full_type int8", "a16w8": "--quantize_full_type w8a16"}
#: qnn_htp's per-layer precision options (vlmrun diff --what-if and vlmrun tune set layer_precision) and what each
#: would do to the layer
PER_LAYER = {"keep_fp": "keeps layers out of quantization", "keep_a16w16": "quantizes layers at a16w16",
             "layer_precision": "sets precision per layer"}
#: qnn_htp's quantization recipe (its quantizer and how it chooses weights): the hub quantizes with its own
RECIPE = ("quantizer", "weight_scheme", "block_size", "algorithm", "seq_mse_candidates", "adaround_iterations")


# -- declaring them --------------------------------------------------------------------------------------------
def _option(*args, keyed: bool = False, key=None, **kwargs) -> Option:
    """An Option; ``keyed``: its value changes what the hub compiles, so it keys the artifact when qaihub compiles
    for another backend (a core that does not know ``keyed`` / ``key`` yet gets the option without them)."""
    fields = attrs.fields_dict(Option)
    if keyed and "keyed" in fields:
        kwargs["keyed"] = True
    if key is not None and "key" in fields:
        kwargs["key"] = key
    return Option(*args, **kwargs)


def declared_options() -> list[Option]:
    """Every option qaihub declares (the ``register_options`` hook registers them)."""
    return [
        _option(NAME, "device", str, flag="--device", keyed=True, key=device_key, stages=COMPILE_STAGES,
                help='AI Hub device name (e.g. "Snapdragon 8 Elite QRD") or "chipset:..." attributes'
                     f" [default: from soc; env {ENV_DEVICE}]"),
        _option(NAME, "hub_device", str, flag="--hub-device", stages=COMPILE_STAGES,  # keyed through device
                help="AI Hub device when qaihub compiles for another backend (--compiler qaihub) [default: from soc]"),
        Option(NAME, "soc", str, choices=tuple(socs.SOCS), flag="--soc",
               help="target Snapdragon SoC (picks the hub's reference device) [default: the named device's own;"
                    f" {socs.DEFAULT_SOC} when no device is named]"),
        Option(NAME, "precision", str, choices=PRECISIONS, default="fp16", flag="--precision", stages=COMPILE_STAGES,
               help="numeric precision (hub-side quantization with calibration data)"),
        Option(NAME, "calibration_images", Path, flag="--calibration-images",
               help="folder of images to calibrate int8 (default: seeded random data)"),
        _option(NAME, "calibration_samples", int, default=8, minimum=1, keyed=True, stages=COMPILE_STAGES,
                help="calibration samples per input"),
        Option(NAME, "embed_seq", int, stages=("embed",), default=DEFAULT_EMBED_SEQ, minimum=1,
               help="static sequence length of the embed graph"),
        _option(NAME, "qairt_version", str, flag="--qairt-version", keyed=True, stages=COMPILE_STAGES,
                help="QAIRT version the hub compiles (and runs) with, e.g. 2.45 (hub option --qairt_version;"
                     " also latest, default) [default: the hub's]"),
        _option(NAME, "hub_options", str, keyed=True, stages=COMPILE_STAGES,
                help="extra AI Hub compile options, appended verbatim"),
        Option(NAME, "job_timeout", float, minimum=0.01, flag="--job-timeout", stages=COMPILE_STAGES,
               help="seconds to wait for one AI Hub job; it keeps running on the hub after a timeout and a rerun"
                    f" re-attaches [default: 10800; env {ENV_TIMEOUT}]"),
        Option(NAME, "network_timeout", float, minimum=0.1, flag="--network-timeout", stages=COMPILE_STAGES,
               help="seconds one AI Hub request keeps retrying a hub that does not answer (refused, unresolvable,"
                    f" timing out, HTTP 5xx) [default: {hubmod.DEFAULT_NETWORK_TIMEOUT_S:g}]"),
        Option(NAME, "poll_interval", float, minimum=0.01, stages=COMPILE_STAGES,
               help="seconds between job status polls [default: 10]"),
        Option(NAME, "batch_mb", float, minimum=0.001, stages=HOSTED_STAGES, default=DEFAULT_BATCH_MB,
               help="megabytes of inputs one inference job of a batch (vlmrun eval) uploads at most; a larger batch"
                    " is split into as few jobs as fit (vlmrun's cap: no hub limit is documented; an upload the hub"
                    " refuses with HTTP 413 is halved)"),
    ]


# -- reading them ----------------------------------------------------------------------------------------------
def device_key(options) -> str | None:
    """The hub device a compile really targets (``--device``, ``--hub-device`` or the SoC's reference device):
    what keys the artifact, so naming the default device compiles nothing new."""
    try:
        return device_of(options)
    except UsageError:
        return None


def device_of(options) -> str:
    """The hub device the options name: ``hub_device``, ``device``, ``$VLMRUN_QAIHUB_DEVICE``, else the reference
    device of the SoC (``soc``); a UsageError when that SoC has none."""
    o = dict(options or {})
    dev = o.get("hub_device") or o.get("device") or os.environ.get(ENV_DEVICE)
    if dev:
        return str(dev).strip()
    soc = socs.soc(o.get("soc"))
    if soc.hub_device is None:
        raise UsageError(f"no AI Hub device is known for {soc.name}; name one with the device option"
                         f" (e.g. --device \"{DEFAULT_DEVICE}\")")
    return soc.hub_device


def qairt_version_of(options) -> str | None:
    v = str(dict(options or {}).get("qairt_version") or "").strip()
    if not v:
        return None
    if not QAIRT_VERSION.match(v):
        raise UsageError(f"qairt_version '{v}' is not a QAIRT version such as 2.45 (or latest, default)")
    return v


def hub_for(options) -> hubmod.Hub:
    """A Hub with the options' ``job_timeout`` (or ``$VLMRUN_QAIHUB_TIMEOUT``), ``network_timeout`` and
    ``poll_interval``."""
    o = dict(options or {})
    timeout = o.get("job_timeout") or os.environ.get(ENV_TIMEOUT)
    return hubmod.Hub(network_timeout=float(o["network_timeout"]) if o.get("network_timeout") else None,
                      timeout=float(timeout) if timeout else None,
                      poll=float(o["poll_interval"]) if o.get("poll_interval") else None)


def compile_options(precision: str, extra: str = "", qairt: str | None = None) -> str:
    if precision not in PRECISIONS:
        raise UsageError(f"precision '{precision}' is not one of {', '.join(PRECISIONS)}")
    opts = ["--target_runtime qnn_context_binary"]
    if precision in QUANT_FLAGS:
        opts.append(QUANT_FLAGS[precision])
    if qairt:
        opts.append(f"--qairt_version {qairt}")
    if extra:
        opts.append(str(extra).strip())
    return " ".join(opts)


def check_per_layer_precision(stage: str, asked, precision: str) -> None:
    """A one-line UsageError when a stage compiled on the hub at ``precision`` asks for per-layer precision
    (qnn_htp's ``layer_precision``, which ``vlmrun diff --what-if`` sets, or ``keep_fp`` / ``keep_a16w16``) or for
    qnn_htp's own quantizer:
    the hub quantizes the stage itself, as a whole, and vlmrun sends it no per-layer precision, so the option would
    be ignored (the same binary compiled again). ``asked``: the options the layout set (``options.given``: a
    recipe option at its declared default asks for nothing)."""
    o = dict(asked or {})
    recipe = [k for k in RECIPE if o.get(k) not in (None, "") and not (k == "quantizer" and o[k] == "onnxruntime")]
    if recipe:
        raise UsageError(f"{stage}: {recipe[0]} = {o[recipe[0]]!r} chooses qnn_htp's own quantizer, which"
                         " --compiler qaihub does not run (AI Hub quantizes the stage itself); drop --compiler qaihub"
                         " to quantize locally, or drop the option")
    per_layer = [k for k in PER_LAYER if o.get(k) not in (None, "", (), [])]
    if not per_layer:
        return
    opt = per_layer[0]
    precision = str(precision).lower()
    how = f" ({QUANT_FLAGS[precision]})" if precision in QUANT_FLAGS else " (at int8 or a16w8)"
    alt = (", or quantize the whole stage with 16-bit activations on the hub (precision = \"a16w8\")"
           if precision == "int8" else "")
    raise UsageError(f"{stage}: {opt} ({PER_LAYER[opt]}; vlmrun diff --what-if sets layer_precision) is not"
                     f" available with --compiler qaihub: AI Hub quantizes the stage itself, as a whole{how}, and"
                     " takes no per-layer precision from vlmrun, so the rebuilt binary would be the same; to try it,"
                     f" compile {stage} locally with qnn_htp's quantizer (drop --compiler qaihub / compiler ="
                     f" \"qaihub\") and locate against that build{alt}")
