"""vlmrun plugin ``qaihub``: compile FastVLM stages on Qualcomm AI Hub, run and profile them on hosted devices.

* As a compiler (``--compiler qaihub``, e.g. with ``--backend qnn_htp``): resolves the device on the hub and
  checks its SoC against ``soc`` (before any upload), uploads the stage's ONNX (a directory with its external
  data when it has some), submits a compile job for ``--target_runtime qnn_context_binary`` (precision flags,
  calibration data for int8, ``--qairt_version`` when pinned), waits showing the job state and its web link,
  downloads the context binary into the artifact store and writes the EP-context wrapper and a manifest in
  qnn_htp's format, so qnn_htp loads it like its own. The manifest records where it came from:
  ``hub_compile_job``, ``hub_url`` (the job's page), ``hub_target_model``, ``hub_device``.
* qnn_htp's decoder parts form (``--compiler qaihub --decoder-form parts``, fp16): one compile job per part graph
  (``qnn_dlc``), then one link job per part, so each part comes back as ONE context binary holding its prompt and
  token graphs with shared weights; the artifact has qnn_htp's parts manifest plus the job ids (:mod:`.parts`).
* As a backend (``--vision qaihub`` ...): the stage is compiled the same way and every ``run_stage`` is an
  inference job with ``profile=True`` on the hosted device; the handle reports the device's own figures in
  ``handle.last_profile`` (``inference_ms`` is the stage's device time; see :func:`profile_figures`).
  ``vlmrun profile --backend qaihub --stage vision --device ...`` prints them.
* Batches (``run_stage_batch``, which ``vlmrun eval`` calls once per stage over every pending item): the whole
  data set goes to the hosted device as ONE inference job per stage (a multi-sample dataset), not one job per
  item; outputs are split back per item in order. Inputs of different shapes are grouped (one job per shape),
  never padded beyond the stage's own chunking; a batch above ``batch_mb`` is split into as few jobs as fit.
  Finished batch jobs stay in the ledger, so a rerun of an interrupted eval downloads their outputs instead of
  submitting again (:meth:`HostedStage.run_batch`).

Per-stage options (``vlmrun plugins --options``):

=================== ============================================================================================
``device``          AI Hub device name (default from ``soc``: SM8750 -> "Snapdragon 8 Elite QRD"), or
                    ``chipset:...`` / other ``key:value`` attributes. ``$VLMRUN_QAIHUB_DEVICE`` is the fallback.
``precision``       ``fp16`` (default), ``int8`` or ``a16w8`` (hub-side quantization with calibration data)
``qairt_version``   pin the hub's QAIRT version (``--qairt_version``), e.g. ``2.45``; also ``latest``, ``default``
``hub_options``     extra compile options appended verbatim
``job_timeout``     seconds to wait for one job (default 3 h; ``$VLMRUN_QAIHUB_TIMEOUT``); the job keeps running
``network_timeout`` seconds one hub operation keeps retrying a hub that does not answer (default 30)
``batch_mb``        megabytes of inputs one batch inference job uploads at most (default 1024, vlmrun's own cap)
=================== ============================================================================================

Per-layer precision (qnn_htp's ``keep_fp`` / ``keep_a16w16``, which ``vlmrun diff --what-if`` sets) is refused
with ``--compiler qaihub``, before any export or upload (:func:`check_per_layer_precision`): the hub quantizes the
stage itself, as a whole (``--quantize_full_type``), and vlmrun sends it no per-layer precision, so a rebuild with
those options would compile the same binary again and report that keeping the layer recovers nothing.
``vlmrun diff --locate`` itself works on hub-compiled stages: qnn_htp compiles the stage's probe form through the
same compile hook, i.e. as one more compile job on the hub with the stage's options (``tests/test_qaihub_probe.py``).

The device, the QAIRT version, the hub options and the calibration sample count key the compiled artifact, so
changing any of them compiles again. Jobs are recorded in a ledger in the artifact's state directory
(``<store>/state/<artifact>/qaihub-jobs.json``), keyed by the hub (api_url), the device and the options: a rerun
after Ctrl-C, a timeout or a lost connection re-attaches to the job instead of uploading and submitting again
(inference jobs too, for the same inputs); ``--rebuild`` never re-attaches; a job the hub no longer knows is
dropped from the ledger and submitted again.
"""

from __future__ import annotations

import difflib
import hashlib
import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import attrs
import numpy as np

from vlmrun import hookimpl
from vlmrun.errors import BackendError, UsageError, VlmrunError
from vlmrun.handles import StageHandle
from vlmrun.options import Option
from vlmrun.plugins import BackendInfo, Check, mine
from vlmrun.stages import ExportForm

from . import hub as hubmod
from .hub import HubAuthError, HubJobTimeout, HubNotFound, HubTooLarge, HubUnreachable
from vlmrun_qualcomm import socs
from vlmrun_qualcomm.manifest import ContextManifest, onnx_io, write_ctx_onnx

NAME = "qaihub"
__version__ = "0.1.0"

HOSTED_STAGES = ("vision", "projector", "embed")
COMPILE_STAGES = (*HOSTED_STAGES, "decoder")  # --compiler qaihub also compiles qnn_htp's decoder parts form (parts.py)
PRECISIONS = ("fp16", "int8", "a16w8")
DEFAULT_DEVICE = "Snapdragon 8 Elite QRD"
DEFAULT_EMBED_SEQ = 32
DEFAULT_BATCH_MB = 1024.0  # vlmrun's cap on one batch job's inputs (no limit is documented; see run_batch)
BATCH_JOBS_KEPT = 32  # finished batch jobs the ledger remembers per artifact (a rerun downloads their outputs)
BATCH_PREFIX = "inference-batch|"
ENV_DEVICE = "VLMRUN_QAIHUB_DEVICE"
ENV_TIMEOUT = "VLMRUN_QAIHUB_TIMEOUT"
DOCTOR_NETWORK_TIMEOUT_S = 5.0
QAIRT_VERSION = re.compile(r"^(\d+\.\d+(\.\d+)*|latest|default)$")
REATTACH = "rerun the same command to re-attach to it"
REBUILD_NOTE = "--rebuild never re-attaches: a rerun with --rebuild submits a new job"

QUANT_FLAGS = {"int8": "--quantize_full_type int8", "a16w8": "--quantize_full_type w8a16"}
#: qnn_htp's per-layer precision options (vlmrun diff --what-if) and what each would do to the layer
PER_LAYER = {"keep_fp": "keeps layers out of quantization", "keep_a16w16": "quantizes layers at a16w16",
             "layer_precision": "sets precision per layer"}
#: qnn_htp's quantization recipe (its quantizer and how it chooses weights): the hub quantizes with its own
RECIPE = ("quantizer", "weight_scheme", "block_size", "algorithm", "seq_mse_candidates", "adaround_iterations")


# -- options ---------------------------------------------------------------------------------------------------
def _option(*args, keyed: bool = False, key=None, **kwargs) -> Option:
    """An Option; ``keyed``: its value changes what the hub compiles, so it keys the artifact when qaihub compiles
    for another backend (a core that does not know ``keyed`` / ``key`` yet gets the option without them)."""
    fields = attrs.fields_dict(Option)
    if keyed and "keyed" in fields:
        kwargs["keyed"] = True
    if key is not None and "key" in fields:
        kwargs["key"] = key
    return Option(*args, **kwargs)


def device_key(options) -> str | None:
    """The hub device a compile really targets (``--device``, ``--hub-device`` or the SoC's reference device):
    what keys the artifact, so naming the default device compiles nothing new."""
    try:
        return device_of(options)
    except UsageError:
        return None


def device_of(options) -> str:
    o = dict(options or {})
    dev = o.get("hub_device") or o.get("device") or os.environ.get(ENV_DEVICE)
    if dev:
        return str(dev).strip()
    soc = socs.soc(o.get("soc"))
    if soc.hub_device is None:
        raise UsageError(f"no AI Hub device is known for {soc.name}; name one with the device option"
                         f" (e.g. --device \"{DEFAULT_DEVICE}\")")
    return soc.hub_device


def _attributes(spec: str) -> list[str] | None:
    """``chipset:...,os:android`` -> attribute list; a device name -> None."""
    if re.match(r"^[a-z_]+:", spec):
        return [a.strip() for a in spec.split(",") if a.strip()]
    return None


def make_device(spec: str):
    import qai_hub

    attrs_ = _attributes(spec)
    return qai_hub.Device(attributes=attrs_) if attrs_ else qai_hub.Device(spec)


def qairt_version_of(options) -> str | None:
    v = str(dict(options or {}).get("qairt_version") or "").strip()
    if not v:
        return None
    if not QAIRT_VERSION.match(v):
        raise UsageError(f"qairt_version '{v}' is not a QAIRT version such as 2.45 (or latest, default)")
    return v


def hub_for(options) -> hubmod.Hub:
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


def check_per_layer_precision(stage: str, options) -> None:
    """A one-line UsageError when a stage compiled on the hub asks for per-layer precision (qnn_htp's ``keep_fp`` /
    ``keep_a16w16``, which ``vlmrun diff --what-if`` sets): the hub quantizes the stage itself, as a whole, and
    vlmrun sends it no per-layer precision, so the option would be ignored (the same binary compiled again)."""
    o = dict(options or {})
    recipe = [k for k in RECIPE if o.get(k) not in (None, "") and not (k == "quantizer" and o[k] == "onnxruntime")]
    if recipe:
        raise UsageError(f"{stage}: {recipe[0]} = {o[recipe[0]]!r} chooses qnn_htp's own quantizer, which"
                         " --compiler qaihub does not run (AI Hub quantizes the stage itself); drop --compiler qaihub"
                         " to quantize locally, or drop the option")
    asked = [k for k in PER_LAYER if o.get(k) not in (None, "", (), [])]
    if not asked:
        return
    opt = asked[0]
    precision = str(o.get("precision") or "fp16").lower()
    how = f" ({QUANT_FLAGS[precision]})" if precision in QUANT_FLAGS else " (at int8 or a16w8)"
    alt = (", or quantize the whole stage with 16-bit activations on the hub (precision = \"a16w8\")"
           if precision == "int8" else "")
    raise UsageError(f"{stage}: {opt} ({PER_LAYER[opt]}; vlmrun diff --what-if sets it) is not available with"
                     f" --compiler qaihub: AI Hub quantizes the stage itself, as a whole{how}, and takes no"
                     " per-layer precision from vlmrun, so the rebuilt binary would be the same; to try it, compile"
                     f" {stage} locally with qnn_htp's quantizer (drop --compiler qaihub / compiler = \"qaihub\") and"
                     f" locate against that build{alt}")


# -- devices ---------------------------------------------------------------------------------------------------
@attrs.frozen
class HubDevice:
    """A device as the hub describes it, with the SoC vlmrun knows it by (None: not in the SoC table)."""

    spec: str  # what was asked for (a name or attributes)
    name: str  # the (first) matching device
    chipset: str | None
    arch: str | None  # HTP architecture from the hexagon attribute, e.g. "v79"
    soc: socs.Soc | None


def _attr(device, key: str) -> str | None:
    return next((a.split(":", 1)[1] for a in device.attributes if a.startswith(key + ":")), None)


def resolve_device(hub: hubmod.Hub, spec: str) -> HubDevice:
    """Find ``spec`` among the hub's devices and tell its SoC; a UsageError (one line) when the hub has none."""
    devices = hub.devices()
    wanted = _attributes(spec)
    if wanted:
        found = [d for d in devices if all(a in d.attributes for a in wanted)]
    else:
        found = [d for d in devices if d.name == spec]
    if not found:
        names = sorted({d.name for d in devices})
        close = difflib.get_close_matches(spec, names, n=3, cutoff=0.5)
        hint = (f"did you mean {' or '.join(repr(c) for c in close)}?" if close
                else f"it offers {len(names)} devices, e.g. {', '.join(repr(n) for n in names[:3])}")
        raise UsageError(f"Qualcomm AI Hub ({hub.api_url}) has no device {spec!r}; {hint}"
                         " (`qai-hub list-devices` lists them)")
    d = found[0]
    chipset, hexagon = _attr(d, "chipset"), _attr(d, "hexagon")
    arch = f"v{hexagon.lstrip('vV')}" if hexagon else None
    soc = None
    by_name = {x.name: x for x in devices}
    for s in socs.SOCS.values():  # the SoC whose reference device has the same chipset
        ref = by_name.get(s.hub_device or "")
        if chipset and ref is not None and _attr(ref, "chipset") == chipset:
            soc = s
            break
    if soc is None and arch:  # else the only SoC with that HTP architecture
        same = [s for s in socs.SOCS.values() if s.arch == arch]
        soc = same[0] if len(same) == 1 else None
    return HubDevice(spec, d.name, chipset, arch, soc)


def check_device_soc(dev: HubDevice, want: socs.Soc | None) -> None:
    """A UsageError when ``dev`` cannot run a binary for ``want`` (checked before anything is uploaded)."""
    if want is None:
        return
    if dev.soc is not None and dev.soc.name != want.name:
        ref = f' (e.g. "{want.hub_device}")' if want.hub_device else ""
        raise UsageError(f"AI Hub device {dev.spec!r} has a {dev.soc.marketing} ({dev.soc.name}, {dev.soc.arch}) but"
                         f" the binary is for {want.name} ({want.marketing}); add --soc {dev.soc.name}, or choose a"
                         f" {want.name} device{ref}")
    if dev.soc is None and dev.arch and dev.arch != want.arch:
        raise UsageError(f"AI Hub device {dev.spec!r} (chipset {dev.chipset or '?'}) has an HTP {dev.arch} but the"
                         f" binary is for {want.name} ({want.arch}); choose a device with that SoC or change --soc")


def built_for(dev: HubDevice, want: socs.Soc | None, soc_model, what: str) -> tuple[socs.Soc | None, int | None]:
    """(the SoC, its soc_model number) that the hub's binary metadata (``soc_model``) says ``what`` was built for;
    BackendError when that is not ``want``, the SoC asked for."""
    soc_model_n = int(soc_model) if soc_model and str(soc_model).isdigit() else None
    got = socs.by_soc_model(soc_model_n) or dev.soc
    if want is not None and got is not None and got.name != want.name:
        raise BackendError(f"AI Hub device {dev.name!r} built {what} for {got.name}/{got.arch} but {want.name} was"
                           f" asked for; choose a device with that SoC (--device) or --soc {got.name}")
    return want or got, soc_model_n


def expected_soc(options: dict, target: str) -> socs.Soc | None:
    """The SoC the binary must be for: qnn_htp's ``soc`` (default SM8750); for hosted runs the device's own
    unless ``soc`` was given."""
    if target == NAME and not options.get("soc"):
        return None
    return socs.soc(options.get("soc"))


# -- hooks -----------------------------------------------------------------------------------------------------
@hookimpl
def describe():
    return BackendInfo(NAME, HOSTED_STAGES,
                       "Qualcomm AI Hub: compiles QNN context binaries in the cloud (--compiler qaihub) and runs or"
                       " profiles stages on hosted Snapdragon devices", precision="fp16")


@hookimpl
def doctor():
    """The client, its configuration, and whether the hub answers and accepts the token (one quick request)."""
    checks = []
    try:
        import qai_hub

        checks.append(Check("qai-hub client", True, str(getattr(qai_hub, "__version__", "?"))))
    except Exception as exc:
        return [Check("qai-hub client", False, f"not importable: {hubmod.one_line(exc)}")]
    path = hubmod.config_path()
    if not path.is_file():
        checks.append(Check("AI Hub configuration", False,
                            f"{path} not found (qai-hub configure --api_token ..., or QAIHUB_CLIENT_INI)"))
        return checks
    hub = hubmod.Hub(network_timeout=DOCTOR_NETWORK_TIMEOUT_S, out=open(os.devnull, "w"))
    try:
        try:
            api_url = hub.api_url
        except VlmrunError as exc:
            checks.append(Check("AI Hub configuration", False, str(exc)))
            return checks
        checks.append(Check("AI Hub configuration", True, f"{path}: api_url {api_url}, token set"))
        try:
            devices = hub.devices()
        except HubAuthError:
            checks.append(Check("AI Hub token", False, f"rejected by {api_url} (HTTP 401): check api_token in {path}"))
        except HubUnreachable as exc:
            checks.append(Check("AI Hub connection", False, str(exc)))
        except VlmrunError as exc:
            checks.append(Check("AI Hub connection", False, str(exc)))
        else:
            names = {d.name for d in devices}
            default = socs.soc(None).hub_device
            checks.append(Check("AI Hub connection", True,
                                f"{api_url} answered, token accepted, {len(names)} devices"
                                f" (default {default!r} {'listed' if default in names else 'NOT listed'})"))
    finally:
        hub.out.close()
    return checks


@hookimpl
def register_options(register):
    for o in (
        _option(NAME, "device", str, flag="--device", keyed=True, key=device_key, stages=COMPILE_STAGES,
                help='AI Hub device name (e.g. "Snapdragon 8 Elite QRD") or "chipset:..." attributes'
                     f" [default: from soc; env {ENV_DEVICE}]"),
        _option(NAME, "hub_device", str, flag="--hub-device", stages=COMPILE_STAGES,  # keyed through device
                help="AI Hub device when qaihub compiles for another backend (--compiler qaihub) [default: from soc]"),
        Option(NAME, "soc", str, choices=tuple(socs.SOCS), default=socs.DEFAULT_SOC, flag="--soc",
               help="target Snapdragon SoC (picks the hub's reference device)"),
        Option(NAME, "precision", str, choices=PRECISIONS, default="fp16", flag="--precision",
               help="numeric precision (hub-side quantization with calibration data)"),
        Option(NAME, "calibration_images", Path, flag="--calibration-images",
               help="folder of images to calibrate int8 (default: seeded random data)"),
        _option(NAME, "calibration_samples", int, default=8, minimum=1, keyed=True,
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
    ):
        register(o)


@hookimpl
def preflight(backend, stage, model, options):
    """A stage compiled on the hub for another backend (``--compiler qaihub``) takes no per-layer precision: refused
    here, before anything is exported or uploaded (:func:`check_per_layer_precision`)."""
    o = dict(options or {})
    if str(o.get("compiler") or backend) == NAME and backend != NAME:
        check_per_layer_precision(stage, o)


@hookimpl
def compile(backend, request):
    if not mine(backend, NAME):
        return None
    merged = {**dict(request.stage_options or {}), **dict(request.options or {})}
    if request.target != NAME:
        check_per_layer_precision(request.stage, merged)  # preflight skipped (a StageContext built by hand)
        # for another backend `device` is its own (qnn_htp: the adb serial of a phone); the hub device is
        # `hub_device`, or `device` when that backend's stage stays on this machine
        device = merged.pop("device", None)
        if not merged.get("hub_device") and str(merged.get("target") or "local") == "local" and device:
            merged["hub_device"] = device
    return compile_on_hub(hub_for(merged), request.stage, request.model, request.source, merged,
                          Path(request.out_dir), request.target, artifact=request.artifact,
                          rebuild=bool(request.rebuild), state_dir=Path(request.context.state_dir()))


def _upload_dir(source, work: Path) -> Path:
    """The stage ONNX as the client wants it: the .onnx alone, or a directory with the .onnx and one .data."""
    files = [source.path / f for f in source.manifest.get("files", []) if (source.path / f).is_file()]
    onnx_files = [f for f in files if f.suffix == ".onnx"]
    data = [f for f in files if f.suffix != ".onnx" and f.name.startswith(onnx_files[0].name)] if onnx_files else []
    if not onnx_files:
        raise BackendError(f"export artifact {source.path.name} has no .onnx file")
    if not data:
        return onnx_files[0]
    if len(data) > 1:
        raise BackendError(f"{source.path.name}: AI Hub takes at most one external data file, found {len(data)}")
    d = work / onnx_files[0].name  # directory named like the model
    d.mkdir()
    for f in (onnx_files[0], data[0]):
        dst = d / f.name if f.suffix in (".onnx", ".data") else d / (f.name + ".data")
        try:
            os.link(f, dst)
        except OSError:
            shutil.copy2(f, dst)
    if not data[0].name.endswith(".data"):  # the client needs a .data suffix: keep the location the ONNX names
        raise BackendError(f"{source.path.name}: external data file {data[0].name} must end in .data for AI Hub")
    return d


def calibration_data(stage, model, io_in: list[dict], options: dict) -> dict:
    """Calibration samples per input: images for ``pixel_values`` when given, else seeded random data."""
    rng = np.random.default_rng(0)
    n = int(options.get("calibration_samples") or 8)
    data: dict[str, list[np.ndarray]] = {}
    images = options.get("calibration_images")
    for t in io_in:
        shape = tuple(int(d) if isinstance(d, int) and d > 0 else 1 for d in t["shape"])
        if t["name"] == "pixel_values" and images:
            from vlmrun.preprocess import load_image, preprocess_image

            paths = sorted(p for p in Path(images).iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
            data[t["name"]] = [preprocess_image(load_image(p), model.image_processor_config) for p in paths[:n]]
        elif np.issubdtype(np.dtype(t["dtype"]), np.integer):
            hi = int(getattr(model, "vocab_size", 100) or 100)
            data[t["name"]] = [rng.integers(0, hi, shape).astype(t["dtype"]) for _ in range(n)]
        else:
            data[t["name"]] = [rng.standard_normal(shape).astype(t["dtype"]) for _ in range(n)]
    lens = {len(v) for v in data.values()}
    if len(lens) > 1:
        m = min(lens)
        data = {k: v[:m] for k, v in data.items()}
    return data


def _spec_list(io_spec) -> tuple[list[dict], str | None]:
    """A client IOSpec ({graph: [TensorSpec]}) as manifest I/O entries, plus the first graph name."""
    out, graph = [], None
    for g, tensors in (io_spec or {}).items():
        graph = graph or g
        for t in tensors:
            e = {"name": t.name, "shape": list(t.shape or []), "dtype": t.dtype}
            if t.scale is not None:
                e["quant"] = {"scale": t.scale, "offset": t.zero_point}
            out.append(e)
    return out, graph


def _forgotten(hub: hubmod.Hub, kind: str, job_id: str, exc: BaseException) -> None:
    hub.say(f"AI Hub no longer knows {kind} job {job_id} ({str(exc).rsplit(': ', 1)[-1]}); it was deleted, expired,"
            " belongs to another account, or the hub restarted: dropped from the ledger, submitting a new job")


def compile_on_hub(hub: hubmod.Hub, stage, model, source, options: dict, out_dir: Path, target: str, *,
                   artifact: str, state_dir: Path, rebuild: bool = False) -> dict:
    """Compile ``source`` on the hub into ``out_dir`` (see the module docstring); returns the manifest."""
    from . import parts

    if parts.is_parts(source):  # qnn_htp's decoder parts form: compile jobs per graph, a link job per part
        return parts.compile_parts_on_hub(hub, model, source, options, out_dir, target, state_dir=state_dir,
                                          rebuild=rebuild)
    precision = str(options.get("precision") or "fp16").lower()
    qairt = qairt_version_of(options)
    hub_opts = compile_options(precision, str(options.get("hub_options") or ""), qairt)
    spec = device_of(options)
    want = expected_soc(options, target)
    dev = resolve_device(hub, spec)  # an unknown device or a SoC mismatch stops here, before any upload
    check_device_soc(dev, want)
    ledger = hubmod.Ledger(state_dir)
    key = f"compile|{hub.api_url}|{spec}|{hub_opts}"
    rerun = REBUILD_NOTE if rebuild else REATTACH
    t0 = time.perf_counter()

    entry = ledger.get(key) or {}
    if rebuild and entry:
        if entry.get("job_id") and entry.get("state") == "submitted":
            hub.say(f"AI Hub: --rebuild: not re-attaching to compile job {entry['job_id']} ({entry.get('url', '')});"
                    " submitting a new one")
        ledger.drop(key)
        entry = {}
    job = None
    if entry.get("state") in ("submitted", "done") and entry.get("job_id"):
        what = "re-attaching to" if entry["state"] == "submitted" else "downloading the result of"
        hub.say(f"AI Hub: {what} compile job {entry['job_id']} submitted earlier for this artifact")
        try:
            job = hub.call(f"lookup of compile job {entry['job_id']}", hub.client.get_job, entry["job_id"])
        except HubNotFound as exc:
            _forgotten(hub, "compile", entry["job_id"], exc)
            ledger.drop(key)
            entry = {}
    attached = job is not None
    while True:
        if job is None:
            job = _submit_compile(hub, ledger, key, entry, stage, model, source, options, precision, hub_opts, dev)
        try:
            manifest = _finish_compile(hub, job, dev, want, stage, source, options, precision, hub_opts, qairt,
                                       out_dir, target, rerun)
        except HubNotFound as exc:
            ledger.drop(key)
            if not attached:
                raise
            _forgotten(hub, "compile", job.job_id, exc)
            attached, job, entry = False, None, {}
            continue
        except (HubUnreachable, HubJobTimeout):
            raise  # the job may still be running: the ledger keeps it for a rerun
        except VlmrunError:
            ledger.drop(key)  # a failed job, a binary for the wrong SoC, ...: the next run submits a new job
            raise
        ledger.update(key, state="done")
        manifest["compile_s"] = round(time.perf_counter() - t0, 3)
        return manifest


def _submit_compile(hub, ledger, key, entry, stage, model, source, options, precision, hub_opts, dev):
    client = hub.client
    form = source.manifest.get("form", stage)
    hub_model = None
    if entry.get("state") == "uploaded" and entry.get("model_id"):
        try:
            hub_model = hub.call(f"lookup of model {entry['model_id']}", client.get_model, entry["model_id"])
        except HubNotFound:
            hub_model = None
    if hub_model is None:
        work = Path(tempfile.mkdtemp(prefix="vlmrun-qaihub-up-"))
        try:
            path = _upload_dir(source, work)
            hub.say(f"AI Hub: uploading {stage} ({form}) from {source.path.name}")
            hub_model = hub.call("model upload", client.upload_model, str(path),
                                 name=f"vlmrun-{stage}-{source.path.name}")
        finally:
            shutil.rmtree(work, ignore_errors=True)
        ledger.update(key, state="uploaded", model_id=hub_model.model_id, stage=stage, device=dev.spec)
    specs = {}
    src_io = onnx_io(source.file())
    for t in src_io["inputs"]:
        if all(isinstance(d, int) and d > 0 for d in t["shape"]):
            specs[t["name"]] = (tuple(t["shape"]), t["dtype"])
    calib = calibration_data(stage, model, src_io["inputs"], options) if precision != "fp16" else None
    job = hub.call("compile job submission", client.submit_compile_job, hub_model, make_device(dev.spec),
                   name=f"vlmrun {stage} {form} {precision}", input_specs=specs or None, options=hub_opts,
                   calibration_data=calib, retry=False, idempotent=False)
    ledger.update(key, state="submitted", job_id=job.job_id, model_id=hub_model.model_id,
                  url=hubmod.redact(job.url), stage=stage, device=dev.spec, options=hub_opts, api_url=hub.api_url)
    hub.say(f"AI Hub: compile job {job.job_id} submitted for {dev.name} ({hub_opts}) {hubmod.redact(job.url)}")
    return job


def _finish_compile(hub, job, dev, want, stage, source, options, precision, hub_opts, qairt, out_dir, target,
                    rerun) -> dict:
    import qai_hub
    from qai_hub.client import ModelMetadataKey

    form = source.manifest.get("form", stage)
    name = "".join(c if c.isalnum() else "_" for c in form).strip("_") or stage
    src_io = onnx_io(source.file())
    hub.wait(job, "compile", rerun=rerun)
    target_model = hub.call(f"target model of job {job.job_id}", job.get_target_model)
    if target_model is None:
        raise BackendError(f"AI Hub compile job {job.job_id} finished without a target model ({job.url})")
    in_spec, graph = _spec_list(hub.call("target model inputs", lambda: target_model.input_spec))
    out_spec, _ = _spec_list(hub.call("target model outputs", lambda: target_model.output_spec))
    meta = hub.call("target model metadata", lambda: target_model.metadata) or {}
    bin_name = f"{name}_ctx_qnn.bin"
    _, got_name = hubmod.download_model_into(hub, target_model, out_dir, bin_name)

    qnn = meta.get(ModelMetadataKey.QAIRT_SDK_VERSION) or meta.get(ModelMetadataKey.QNN_SDK_VERSION)
    if not qnn and qairt and qairt[0].isdigit():
        qnn = qairt  # the hub did not say: the version it was asked for
    graphs = [g for g in (meta.get(ModelMetadataKey.QNN_CONTEXT_BIN_GRAPH_NAMES) or "").replace(";", ",").split(",")
              if g.strip()]
    soc, soc_model_n = built_for(dev, want, meta.get(ModelMetadataKey.QNN_CONTEXT_BIN_SOC_MODEL), "the binary")
    arch = soc.arch if soc else None
    hexagon = meta.get(ModelMetadataKey.QNN_CONTEXT_BIN_HEXAGON_VERSION)
    if hexagon and not arch:
        arch = f"v{str(hexagon).lstrip('vV')}"

    inputs = in_spec or [dict(t) for t in src_io["inputs"]]
    outputs = out_spec or [dict(t) for t in src_io["outputs"]]
    graph_name = (graphs[0] if graphs else None) or graph or name
    ctx_name = f"{name}_ctx.onnx"
    sdk = f"v{str(qnn).lstrip('vV')}" if qnn else None
    write_ctx_onnx(out_dir / ctx_name, bin_name, inputs, outputs, graph_name=graph_name, sdk_version=sdk)
    manifest = ContextManifest(
        files=[ctx_name, bin_name], graphs=graphs or [graph_name], inputs=inputs, outputs=outputs,
        stage=stage, precision=precision, compiler=NAME, target=target,
        qnn_version=str(qnn).lstrip("vV") if qnn else None, ep_sdk_version=sdk,
        soc=soc.name if soc else None, soc_model=soc_model_n or (soc.soc_model if soc else None), arch=arch,
        source_form=form,
        binary_bytes={bin_name: (out_dir / bin_name).stat().st_size},
        extra={
            # where the binary came from (scalars: `vlmrun compile` shows them)
            "hub_compile_job": job.job_id,
            "hub_url": hubmod.redact(job.url),
            "hub_target_model": target_model.model_id,
            "hub_device": dev.name,
            "hub": {
                "api_url": hub.api_url,
                "device_spec": dev.spec,
                "chipset": dev.chipset,
                "options": hub_opts,
                "qairt_version": qairt,
                "downloaded_as": got_name,
                "client": str(getattr(qai_hub, "__version__", "?")),
            },
        },
    )
    return manifest.to_dict()


# -- hosted devices --------------------------------------------------------------------------------------------
_US = ("estimated_inference_time", "first_load_time", "warm_load_time", "compile_time")
_RENAME = {
    "estimated_inference_time": "inference_each_ms",
    "estimated_inference_peak_memory": "inference_peak_memory_bytes",
    "first_load_time": "load_cold_ms",
    "first_load_peak_memory": "load_cold_peak_memory_bytes",
    "warm_load_time": "load_warm_ms",
    "warm_load_peak_memory": "load_warm_peak_memory_bytes",
    "compile_time": "device_compile_ms",
    "compile_peak_memory": "device_compile_peak_memory_bytes",
}


def profile_figures(summary: dict, inferences: int) -> dict:
    """The client's ``execution_summary`` (times in microseconds, memory in bytes, unit-less keys) with units in
    the key names: ``*_ms`` milliseconds, ``*_bytes`` bytes. ``inference_ms`` is the device time of the whole
    stage run (``inference_each_ms`` x ``inferences``); missing metrics are left out."""
    out: dict = {}
    for k, v in summary.items():
        if v is None:
            continue
        if k in _RENAME:
            out[_RENAME[k]] = round(v / 1000.0, 3) if k in _US else int(v)
        elif k.startswith("all_") and k.endswith("_times") and isinstance(v, (list, tuple)):
            out[f"{k[4:-6]}_runs_ms"] = [round(t / 1000.0, 3) for t in v]
        elif k.endswith("_range") and isinstance(v, (list, tuple)):
            out[f"{k[: -len('_range')]}_range_bytes"] = [int(x) for x in v]
    if "inference_each_ms" in out:
        out["inferences"] = int(inferences)
        out["inference_ms"] = round(out["inference_each_ms"] * inferences, 3)
    return out


def _digest(batches: dict[str, list[np.ndarray]]) -> str:
    h = hashlib.sha256()
    for name in sorted(batches):
        for a in batches[name]:
            h.update(f"{name}|{a.dtype}|{a.shape}|".encode())
            h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:24]


def _sample_digest(sample: dict[str, np.ndarray]) -> str:
    return _digest({k: [v] for k, v in sample.items()})


def _merge_figures(figures: list[dict]) -> dict:
    """The figures of several jobs as one: ``inferences`` and ``inference_ms`` add up, ``inference_each_ms`` is
    their ratio, lists are joined, other figures (load times, peak memory) are the largest."""
    if len(figures) == 1:
        return dict(figures[0])
    out: dict = {}
    for f in figures:
        for k, v in f.items():
            if isinstance(v, list):
                out[k] = [*out.get(k, []), *v]
            elif k in ("inferences", "inference_ms"):
                out[k] = round(out.get(k, 0) + v, 3)
            else:
                out[k] = max(out.get(k, v), v)
    if out.get("inferences"):
        out["inference_each_ms"] = round(out["inference_ms"] / out["inferences"], 3)
    return out


class HostedStage(StageHandle):
    """A stage compiled on AI Hub; each run is an inference job (profile=True) on the hosted device, recorded in
    the artifact's job ledger so that an interrupted run's job is re-attached by a rerun with the same inputs.

    ``last_profile`` (after a run): ``job_id``, ``url``, ``device``, ``target_model``, and the device's figures
    with units in their names (:func:`profile_figures`): ``inference_ms`` (the stage on the device),
    ``inference_each_ms``, ``inferences``, ``inference_peak_memory_bytes``, ``load_cold_ms``, ``load_warm_ms``,
    ``*_peak_memory_bytes``, ``*_runs_ms``, ``*_range_bytes``, and ``job_wall_ms`` (submission to results, queue
    and polling included). After :meth:`run_batch` it describes the batch's job(s): see there.

    Samples. The binary has static shapes, so one run may be several samples of one inference job: embed's token
    ids are cut into chunks of the compiled sequence length (``embed_seq``), the last chunk zero-padded (an
    embedding is a per-token lookup: the padding changes no real token's row, and the padded rows are cut off);
    every other stage is one sample per run."""

    def __init__(self, hub: hubmod.Hub, artifact, stage: str, device: str, embed_seq: int | None = None,
                 state_dir: Path | None = None, qairt: str | None = None, batch_mb: float | None = None):
        self.hub = hub
        self.artifact = artifact
        self.artifacts = (artifact,)
        self.stage = stage
        self.device = device
        self.embed_seq = embed_seq
        self.qairt = qairt
        self.batch_bytes = int(float(batch_mb or DEFAULT_BATCH_MB) * 1e6)
        self.ledger = hubmod.Ledger(state_dir) if state_dir else None
        self.load_s = 0.0
        self.last_profile: dict = {}
        self.last_job: str | None = None
        self._model = None
        m = artifact.manifest
        self.inputs = {t["name"]: (tuple(t["shape"]), t["dtype"]) for t in m["inputs"]}
        self.output_names = [t["name"] for t in m["outputs"]]

    def _hub_model(self):
        if self._model is None:
            client = self.hub.client
            m = self.artifact.manifest
            mid = m.get("hub_target_model") or (m.get("hub") or {}).get("target_model")
            if mid:
                try:
                    self._model = self.hub.call(f"lookup of model {mid}", client.get_model, mid)
                except HubNotFound:  # the hub forgot it (or another account): upload the binary we have
                    self._model = None
            if self._model is None:
                bin_path = next(self.artifact.path / f for f in m["files"] if f.endswith(".bin"))
                self.hub.say(f"AI Hub: uploading the stored context binary {bin_path.name}"
                             + (f" (the hub no longer has model {mid})" if mid else ""))
                self._model = self.hub.call("context binary upload", client.upload_model, str(bin_path))
        return self._model

    def _submit(self, feeds, kind: str = "inference"):
        n = max((len(v) for v in feeds.values()), default=1)
        many = f" ({n} samples)" if n > 1 else ""
        job = self.hub.call("inference job submission", self.hub.client.submit_inference_job, self._hub_model(),
                            make_device(self.device), inputs=feeds, profile=True,
                            name=f"vlmrun {self.stage}" + (f" batch of {n}" if kind != "inference" else ""),
                            options=f"--qairt_version {self.qairt}" if self.qairt else "",
                            retry=False, idempotent=False)
        self.hub.say(f"AI Hub: {kind} job {job.job_id} submitted on {self.device}{many} {hubmod.redact(job.url)}")
        return job

    def _named(self, job, outs: dict) -> dict:
        names = list(outs)
        if set(self.output_names) <= set(names):
            return {k: outs[k] for k in self.output_names}
        if len(names) == len(self.output_names):  # the hub renamed them: keep the order
            return dict(zip(self.output_names, (outs[k] for k in names)))
        raise BackendError(f"AI Hub job {job.job_id} returned outputs {names}, expected {self.output_names}")

    def _fetch(self, job, kind: str, rerun: str) -> tuple[dict, dict]:
        """Wait for ``job``: its outputs (by the manifest's names, a list per output) and execution summary."""
        self.hub.wait(job, kind, rerun=rerun)
        outs = self.hub.call(f"outputs of job {job.job_id}", job.download_output_data)
        prof = self.hub.call(f"profile of job {job.job_id}", job.download_profile) or {}
        if not outs:
            raise BackendError(f"AI Hub inference job {job.job_id} returned no outputs ({hubmod.redact(job.url)})")
        return self._named(job, outs), dict(prof.get("execution_summary") or {})

    def _job(self, key: str, feeds: dict, kind: str = "inference", *, keep: bool = False,
             record: dict | None = None):
        """One inference job over ``feeds``, recorded under ``key`` in the ledger: re-attached when an earlier run
        submitted it, else submitted. ``keep``: once done the ledger keeps it (state ``done``, with ``record``) so
        that a rerun downloads its outputs instead of running it again; else its entry is dropped.
        Returns (job, outputs by name (a list each), execution summary)."""
        ledger = self.ledger
        entry = (ledger.get(key) if ledger else None) or {}
        job = None
        if entry.get("job_id"):
            self.hub.say(f"AI Hub: re-attaching to inference job {entry['job_id']} submitted earlier for these inputs")
            try:
                job = self.hub.call(f"lookup of inference job {entry['job_id']}", self.hub.client.get_job,
                                    entry["job_id"])
            except HubNotFound as exc:
                _forgotten(self.hub, "inference", entry["job_id"], exc)
                ledger.drop(key)
        attached = job is not None
        while True:
            if job is None:
                job = self._submit(feeds, kind)
                if ledger:
                    ledger.update(key, state="submitted", job_id=job.job_id, url=hubmod.redact(job.url),
                                  kind=kind, stage=self.stage, device=self.device, **(record or {}))
            self.last_job = job.job_id
            try:
                outs, summary = self._fetch(job, kind, REATTACH if ledger else "a rerun submits a new job")
            except HubNotFound as exc:
                if ledger:
                    ledger.drop(key)
                if not attached:
                    raise
                _forgotten(self.hub, "inference", job.job_id, exc)
                attached, job = False, None
                continue
            except (HubUnreachable, HubJobTimeout):
                raise
            except VlmrunError:
                if ledger:
                    ledger.drop(key)
                raise
            break
        if ledger:
            if keep:
                ledger.update(key, state="done")
                ledger.prune(BATCH_PREFIX, BATCH_JOBS_KEPT)
            else:
                ledger.drop(key)
        return job, outs, summary

    def _profile(self, used: list[tuple], t0: float, **extra) -> dict:
        """``last_profile`` for the jobs in ``used`` ((job, samples, execution summary) each)."""
        m = self.artifact.manifest
        job = used[0][0]
        prof = {"job_id": job.job_id, "url": hubmod.redact(job.url), "device": self.device,
                "target_model": getattr(self._model, "model_id", None) or m.get("hub_target_model")}
        if len(used) > 1:
            prof["job_ids"] = [j.job_id for j, _, _ in used]
        prof.update(extra)
        prof.update(_merge_figures([profile_figures(summary, n) for _, n, summary in used]))
        prof["job_wall_ms"] = round((time.perf_counter() - t0) * 1e3, 1)
        return prof

    def run_batches(self, batches: dict[str, list[np.ndarray]]) -> dict[str, list[np.ndarray]]:
        """One inference job over the samples in ``batches`` (input name -> one array per sample); its ledger
        entry is dropped once it is done."""
        feeds = {name: [self._cast(name, a) for a in arrs] for name, arrs in batches.items()}
        n = max((len(v) for v in feeds.values()), default=1)
        key = f"inference|{self.hub.api_url}|{self.device}|{self.qairt or ''}|{_digest(feeds)}"
        t0 = time.perf_counter()
        job, outs, summary = self._job(key, feeds)
        self.last_profile = self._profile([(job, n, summary)], t0)
        return outs

    def _cast(self, name: str, a) -> np.ndarray:
        dtype = self.inputs.get(name, (None, None))[1]
        return np.ascontiguousarray(a, dtype=dtype) if dtype else np.ascontiguousarray(a)

    def _samples(self, inputs: dict) -> list[dict[str, np.ndarray]]:
        """One run's inputs as samples of the binary (see the class docstring), in the binary's input order."""
        if self.stage == "embed" and self.embed_seq:
            ids = np.asarray(inputs["input_ids"], dtype=np.int64)
            T, E = ids.shape[1], self.embed_seq
            samples = []
            for i in range(0, T, E):
                c = np.zeros((1, E), np.int64)
                c[0, : min(E, T - i)] = ids[0, i : i + E]
                samples.append({"input_ids": c})
        else:
            samples = [{k: inputs[k] for k in self.inputs if k in inputs}]
        return [{k: self._cast(k, v) for k, v in s.items()} for s in samples]

    def _assemble(self, inputs: dict, outs: list[dict]) -> dict:
        """One run's outputs from its samples' outputs (the inverse of :meth:`_samples`)."""
        if self.stage == "embed" and self.embed_seq:
            T, E = np.asarray(inputs["input_ids"]).shape[1], self.embed_seq
            parts = [np.asarray(o["inputs_embeds"])[:, : min(E, T - i * E)] for i, o in enumerate(outs)]
            return {"inputs_embeds": np.concatenate(parts, axis=1).astype(np.float32)}
        return {k: np.asarray(v) for k, v in outs[0].items()}

    def run(self, inputs: dict) -> dict:
        samples = self._samples(inputs)
        outs = self.run_batches({name: [s[name] for s in samples] for name in samples[0]})
        return self._assemble(inputs, [{k: v[i] for k, v in outs.items()} for i in range(len(samples))])

    # -- a data set's worth in one go (run_stage_batch) ----------------------------------------------------------
    def run_batch(self, items: list[dict]) -> list[dict]:
        """Run every item of ``items`` (each what :meth:`run` takes) in as few inference jobs as the hub allows;
        the outputs per item, in order, equal to what :meth:`run` gives each.

        * One job carries many samples (a dataset of input name -> list of N arrays, as the client sends it);
          the outputs come back in the same order and are split per item. Identical samples are sent once.
        * Shapes: the binary's are static, so nothing is padded beyond what :meth:`run` does (embed's chunks,
          see the class docstring; that makes embed's token ids of any length one job). Samples are grouped by
          their input shapes and dtypes, one job per group (grouping, not padding: a padded tensor would be
          another input than the stage contract's); with the binary's static shapes there is one group.
        * Size: neither the ``qai-hub`` client nor Qualcomm's documents state a limit on an inference job's
          dataset; the hub answers HTTP 413 ("The uploaded asset is too large") to an upload it refuses. vlmrun
          caps one job's inputs at ``batch_mb`` (its own default, :data:`DEFAULT_BATCH_MB` MB) and splits a
          larger group into as few jobs of even size as fit, saying so; a 413 halves the job and tries again.
        * Ledger: each job is recorded with its samples' digests and kept once done (the most recent
          :data:`BATCH_JOBS_KEPT` per artifact), so a rerun (an interrupted ``vlmrun eval``, which asks again
          for the items it has not finished) downloads the outputs of finished jobs instead of submitting new
          ones, re-attaches to jobs still running, and submits only samples no job has.
        * ``last_profile``: the first job's ``job_id`` and ``url`` (``job_ids`` when there were several),
          ``items``, and the device figures of the job(s) the outputs came from (``inferences``: their samples,
          ``inference_ms`` the sum, ``inference_each_ms`` the mean; merged figures: the largest load times and
          peak memory).
        * A failed job raises one line naming the job, the stage and the hub's reason.
        """
        if not items:
            return []
        t0 = time.perf_counter()
        kind = f"{self.stage} inference"
        per_item = [self._samples(dict(i)) for i in items]
        digests = [[_sample_digest(s) for s in samples] for samples in per_item]
        unique: dict[str, dict] = {}
        for samples, ds in zip(per_item, digests):
            for s, d in zip(samples, ds):
                unique.setdefault(d, s)
        got: dict[str, dict] = {}
        used: list[tuple] = []
        prefix = f"{BATCH_PREFIX}{self.hub.api_url}|{self.device}|{self.qairt or ''}|{self._model_tag()}|"
        if self.ledger:
            self._from_ledger(prefix, unique, got, used, kind)
        for group in self._plan([d for d in unique if d not in got], unique):
            self._run_group(group, unique, got, used, kind, prefix)
        self.last_profile = self._profile(used, t0, items=len(items))
        return [self._assemble(dict(inp), [got[d] for d in ds]) for inp, ds in zip(items, digests)]

    def _model_tag(self) -> str:
        m = self.artifact.manifest
        return str(m.get("hub_target_model") or (m.get("hub") or {}).get("target_model") or self.artifact.path.name)

    def _from_ledger(self, prefix: str, unique: dict, got: dict, used: list, kind: str) -> None:
        """Outputs of batch jobs earlier runs submitted (re-attached while running), for the samples they hold."""
        entries = sorted(self.ledger.entries(prefix).items(), key=lambda kv: -float(kv[1].get("updated") or 0))
        for key, entry in entries:
            samples = list(entry.get("samples") or [])
            hits = [i for i, d in enumerate(samples) if d in unique and d not in got]
            if not entry.get("job_id") or not hits:
                continue
            jid, done = entry["job_id"], entry.get("state") == "done"
            self.hub.say(f"AI Hub: {'downloading the outputs of' if done else 're-attaching to'} {kind} job {jid}"
                         f" ({'finished' if done else 'submitted'} earlier; {len(hits)} of its {len(samples)} samples"
                         " are wanted)")
            try:
                job = self.hub.call(f"lookup of inference job {jid}", self.hub.client.get_job, jid)
                outs, summary = self._fetch(job, kind, REATTACH)
            except HubNotFound as exc:
                _forgotten(self.hub, "inference", jid, exc)
                self.ledger.drop(key)
                continue
            except (HubUnreachable, HubJobTimeout):
                raise
            except VlmrunError as exc:
                self.ledger.drop(key)
                if not done:
                    raise  # the job failed: the hub's reason
                self.hub.say(f"AI Hub: the outputs of {kind} job {jid} are gone ({exc}); running those samples again")
                continue
            if any(len(v) != len(samples) for v in outs.values()):
                self.ledger.drop(key)
                self.hub.say(f"AI Hub: {kind} job {jid} returned {min(len(v) for v in outs.values())} outputs for"
                             f" {len(samples)} samples; running those samples again")
                continue
            if not done:
                self.ledger.update(key, state="done")
            for i in hits:
                got[samples[i]] = {k: v[i] for k, v in outs.items()}
            used.append((job, len(samples), summary))

    def _plan(self, todo: list[str], unique: dict) -> list[list[str]]:
        """``todo``'s samples as jobs: grouped by input shapes and dtypes, a group split to fit ``batch_mb``."""
        groups: dict[tuple, list[str]] = {}
        for d in todo:
            s = unique[d]
            groups.setdefault(tuple((k, a.shape, str(a.dtype)) for k, a in s.items()), []).append(d)
        if len(groups) > 1:
            self.hub.say(f"AI Hub: the {self.stage} inputs come in {len(groups)} shapes: one inference job per shape")
        jobs = []
        for ds in groups.values():
            each = sum(a.nbytes for a in unique[ds[0]].values())
            per_job = max(1, self.batch_bytes // max(1, each))
            n_jobs = -(-len(ds) // per_job)
            size = -(-len(ds) // n_jobs)
            if n_jobs > 1:
                self.hub.say(f"AI Hub: {len(ds)} {self.stage} samples ({len(ds) * each / 1e6:.0f} MB) exceed"
                             f" batch_mb {self.batch_bytes / 1e6:g}: {n_jobs} inference jobs of at most {size}")
            jobs.extend(ds[i : i + size] for i in range(0, len(ds), size))
        return jobs

    def _run_group(self, ds: list[str], unique: dict, got: dict, used: list, kind: str, prefix: str) -> None:
        feeds = {name: [unique[d][name] for d in ds] for name in unique[ds[0]]}
        try:
            job, outs, summary = self._job(prefix + _digest(feeds), feeds, kind, keep=True,
                                           record={"samples": ds})
        except HubTooLarge as exc:
            mb = sum(a.nbytes for v in feeds.values() for a in v) / 1e6
            if len(ds) == 1:
                raise HubTooLarge(f"AI Hub refused one {self.stage} sample of {mb:.1f} MB as too large: {exc}"
                                  ) from None
            half = (len(ds) + 1) // 2
            self.hub.say(f"AI Hub refused the dataset of {len(ds)} {self.stage} samples ({mb:.0f} MB) as too large"
                         f" (HTTP 413): splitting it into two jobs of {half} and {len(ds) - half}")
            self._run_group(ds[:half], unique, got, used, kind, prefix)
            self._run_group(ds[half:], unique, got, used, kind, prefix)
            return
        if any(len(v) != len(ds) for v in outs.values()):
            raise BackendError(f"AI Hub {kind} job {job.job_id} returned {min(len(v) for v in outs.values())}"
                               f" outputs for {len(ds)} samples ({hubmod.redact(job.url)})")
        for i, d in enumerate(ds):
            got[d] = {k: v[i] for k, v in outs.items()}
        used.append((job, len(ds), summary))


def forms(stage: str, options) -> ExportForm:
    if stage == "embed":
        return ExportForm.of("embed", seq=int(options.get("embed_seq") or DEFAULT_EMBED_SEQ))
    return ExportForm.of(stage)


@hookimpl
def load_stage(backend, stage, ctx):
    if not mine(backend, NAME):
        return None
    if stage not in HOSTED_STAGES:
        raise UsageError(f"qaihub runs {', '.join(HOSTED_STAGES)} on hosted devices, not '{stage}'")
    o = dict(ctx.options)
    precision = str(o.get("precision") or "fp16").lower()
    qairt = qairt_version_of(o)
    compile_options(precision)  # validates
    device = device_of(o)
    form = forms(stage, o)
    src = ctx.exported(form)
    key_opts = {"precision": precision, "device": device, "hub_options": str(o.get("hub_options") or ""),
                "soc": o.get("soc"), "calibration_images": o.get("calibration_images"), "qairt_version": qairt,
                "calibration_samples": o.get("calibration_samples") if precision != "fp16" else None}
    key_opts = {k: v for k, v in key_opts.items() if v}
    art = ctx.compiled(src, key_opts, f"{form.label()}-{precision}-{device.replace(' ', '_')}")
    hub = hub_for(o)
    state_dir = Path(ctx.store.root) / "state" / art.path.name  # the artifact's state directory (its job ledger)
    return HostedStage(hub, art, stage, device, form.get("seq") if stage == "embed" else None,
                       state_dir=state_dir, qairt=qairt, batch_mb=o.get("batch_mb"))


@hookimpl
def run_stage(backend, stage, handle, inputs):
    if not mine(backend, NAME):
        return None
    return handle.run(dict(inputs))


@hookimpl
def run_stage_batch(backend, stage, handle, inputs):
    """``vlmrun eval``'s data set for one stage in one inference job (as few as the hub allows), outputs split
    back per item in order: :meth:`HostedStage.run_batch`."""
    if not mine(backend, NAME):
        return None
    return handle.run_batch([dict(i) for i in inputs])
