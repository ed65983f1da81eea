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
  token graphs with shared weights; the artifact has qnn_htp's parts manifest plus the job ids (``parts.py``).
* As a backend (``--vision qaihub`` ...): the stage is compiled the same way and every ``run_stage`` is an
  inference job with ``profile=True`` on the hosted device; the handle reports the device's own figures in
  ``handle.last_profile`` (``inference_ms`` is the stage's device time; see ``figures.profile_figures``).
  ``vlmrun profile --backend qaihub --stage vision --device ...`` prints them.
* Batches (``run_stage_batch``, which ``vlmrun eval`` calls once per stage over every pending item): the whole
  data set goes to the hosted device as ONE inference job per stage (a multi-sample dataset), not one job per
  item; outputs are split back per item in order. Inputs of different shapes are grouped (one job per shape),
  never padded beyond the stage's own chunking; a batch above ``batch_mb`` is split into as few jobs as fit.
  Finished batch jobs stay in the ledger, so a rerun of an interrupted eval downloads their outputs instead of
  submitting again (``hosted.HostedStage.run_batch``).

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

Per-layer precision (qnn_htp's ``layer_precision``, which ``vlmrun diff --what-if`` sets, ``keep_fp``,
``keep_a16w16``) is refused with ``--compiler qaihub``, before any export or upload
(``options.check_per_layer_precision``): the hub quantizes the stage itself, as a whole (``--quantize_full_type``),
and vlmrun sends it no per-layer precision, so a rebuild with those options would compile the same binary again and
report that keeping the layer recovers nothing.
``vlmrun diff --locate`` itself works on hub-compiled stages: qnn_htp compiles the stage's probe form through the
same compile hook, i.e. as one more compile job on the hub with the stage's options (``tests/test_qaihub_probe.py``).

The device, the QAIRT version, the hub options and the calibration sample count key the compiled artifact, so
changing any of them compiles again. Jobs are recorded in a ledger in the artifact's state directory
(``<store>/state/<artifact>/qaihub-jobs.json``), keyed by the hub (api_url), the device and the options: a rerun
after Ctrl-C, a timeout or a lost connection re-attaches to the job instead of uploading and submitting again
(inference jobs too, for the same inputs); ``--rebuild`` never re-attaches; a job the hub no longer knows is
dropped from the ledger and submitted again.

This module holds the hook implementations only; the work is in:

* ``options.py``: the plugin's name, stages and declared options, and reading them (device, precision, QAIRT
  version, hub timeouts, the per-layer precision a hub compile refuses);
* ``devices.py``: the hub's devices, the SoC each has, and the checks that a binary is for the SoC asked for;
* ``compile_jobs.py``: a stage compiled on the hub (upload, compile job, download, wrapper and manifest);
* ``parts.py``: qnn_htp's decoder parts form compiled on the hub (compile jobs per graph, a link job per part);
* ``hosted.py``: ``HostedStage``, a stage run as inference jobs on the hosted device, and its batches;
* ``figures.py``: the device's profile figures with units in their names;
* ``reattach.py``: what vlmrun says about jobs in the ledger (re-attaching, ``--rebuild``, forgotten jobs);
* ``doctor_checks.py``: ``vlmrun doctor``'s checks of the client, its configuration and the hub;
* ``hub.py``: the ``qai-hub`` client as vlmrun calls it (network budget, waiting for jobs);
* ``errors.py``: the hub's errors, each client message as one line, the API token redacted;
* ``ledger.py``: the job ledger (``qaihub-jobs.json``) a rerun re-attaches from;
* ``downloads.py``: compiled models downloaded safely, their I/O as manifest entries.
"""

from __future__ import annotations

from vlmrun import hookimpl
from vlmrun.plugins import BackendInfo, mine
from vlmrun_qualcomm import precisions

from .compile_jobs import calibration_data, compile_on_hub, compile_request
from .devices import HubDevice, built_for, check_device_soc, expected_soc, make_device, resolve_device
from .doctor_checks import hub_checks
from .figures import profile_figures
from .hosted import HostedStage, load_hosted_stage
from .options import (COMPILE_STAGES, DEFAULT_DEVICE, HOSTED_STAGES, NAME, PRECISIONS, check_per_layer_precision,
                      compile_options, declared_options, device_key, device_of, hub_for, qairt_version_of)

__version__ = "0.1.0"

# re-exported: the names this module held before it was split by job
__all__ = [
    "COMPILE_STAGES", "DEFAULT_DEVICE", "HOSTED_STAGES", "NAME", "PRECISIONS", "HostedStage", "HubDevice",
    "built_for", "calibration_data", "check_device_soc", "check_per_layer_precision", "compile_on_hub",
    "compile_options", "device_key", "device_of", "expected_soc", "hub_for", "make_device", "profile_figures",
    "qairt_version_of", "resolve_device",
]


@hookimpl
def describe():
    return BackendInfo(NAME, HOSTED_STAGES,
                       "Qualcomm AI Hub: compiles QNN context binaries in the cloud (--compiler qaihub) and runs or"
                       " profiles stages on hosted Snapdragon devices", precision="fp16")


@hookimpl
def doctor():
    """The client, its configuration, and whether the hub answers and accepts the token (one quick request)."""
    return hub_checks()


@hookimpl
def register_options(register):
    for o in declared_options():
        register(o)


@hookimpl
def register_precisions(register):
    precisions.register(register)


@hookimpl
def preflight(backend, stage, model, options):
    """A stage compiled on the hub for another backend (``--compiler qaihub``) takes no per-layer precision: refused
    here, before anything is exported or uploaded (``options.check_per_layer_precision``)."""
    if str(options["compiler"] or backend) == NAME and backend != NAME:
        check_per_layer_precision(stage, options.given, options["precision"])


@hookimpl
def compile(backend, request):
    """A stage compiled on the hub, for qaihub or (``--compiler qaihub``) another backend: ``compile_jobs.py``."""
    if not mine(backend, NAME):
        return None
    return compile_request(request)


@hookimpl
def load_stage(backend, stage, ctx):
    """A hosted stage (compiled on the hub, run as inference jobs on its device): ``hosted.py``."""
    if not mine(backend, NAME):
        return None
    return load_hosted_stage(stage, ctx)


@hookimpl
def run_stage(backend, stage, handle, inputs):
    if not mine(backend, NAME):
        return None
    return handle.run(dict(inputs))


@hookimpl
def run_stage_batch(backend, stage, handle, inputs):
    """``vlmrun eval``'s data set for one stage in one inference job (as few as the hub allows), outputs split
    back per item in order: ``hosted.HostedStage.run_batch``."""
    if not mine(backend, NAME):
        return None
    return handle.run_batch([dict(i) for i in inputs])
