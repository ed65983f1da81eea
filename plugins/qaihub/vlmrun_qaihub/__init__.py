"""vlmrun plugin ``qaihub``: compile FastVLM stages on Qualcomm AI Hub, run and profile them on hosted devices.

* As a compiler (``--compiler qaihub``, e.g. with ``--backend qnn_htp``): uploads the stage's ONNX (a directory
  with its external data when it has some), submits a compile job for ``--target_runtime qnn_context_binary``
  (precision flags, calibration data for int8), waits showing the job state and its web link, downloads the
  context binary into the artifact store and writes the EP-context wrapper and a manifest in qnn_htp's format,
  so qnn_htp loads it like its own.
* As a backend (``--vision qaihub`` ...): the stage is compiled the same way and every ``run_stage`` is an
  inference job with ``profile=True`` on the hosted device; the handle keeps the device's latency figures
  (``handle.last_profile``). ``vlmrun profile --backend qaihub --stage vision --device ...`` prints them.

Per-stage options:

================= ==============================================================================================
``device``        AI Hub device name (default from ``soc``: SM8750 -> "Snapdragon 8 Elite QRD"), or
                  ``chipset:...`` / other ``key:value`` attributes. ``$VLMRUN_QAIHUB_DEVICE`` is the fallback.
``precision``     ``fp16`` (default), ``int8`` or ``a16w8`` (hub-side quantization with calibration data)
``hub_options``   extra compile options appended verbatim
``timeout``       seconds to wait for a job (default 3 h); the job keeps running on the hub after a timeout
``retries``       network retries per call (default 4, exponential backoff)
================= ==============================================================================================

Jobs are recorded in ``<store>/qaihub-jobs.json`` under the artifact's key: a rerun after Ctrl-C or a timeout
re-attaches to the running job instead of uploading and compiling again; ``--rebuild`` submits a new job.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from vlmrun import hookimpl
from vlmrun.errors import BackendError, UsageError
from vlmrun.handles import StageHandle
from vlmrun.options import Option
from vlmrun.plugins import BackendInfo, Check, mine
from vlmrun.stages import ExportForm

from . import hub as hubmod
from vlmrun_qualcomm import socs
from vlmrun_qualcomm.manifest import ContextManifest, onnx_io, write_ctx_onnx

NAME = "qaihub"
__version__ = "0.1.0"

HOSTED_STAGES = ("vision", "projector", "embed")
PRECISIONS = ("fp16", "int8", "a16w8")
DEFAULT_DEVICE = "Snapdragon 8 Elite QRD"
DEFAULT_EMBED_SEQ = 32
ENV_DEVICE = "VLMRUN_QAIHUB_DEVICE"
# the loading stage's own options (timeout, retries, ...) for the compile hook, which gets only keyed options

QUANT_FLAGS = {"int8": "--quantize_full_type int8", "a16w8": "--quantize_full_type w8a16"}


# -- options ---------------------------------------------------------------------------------------------------
def device_of(options) -> str:
    o = dict(options or {})
    dev = o.get("hub_device") or o.get("device") or os.environ.get(ENV_DEVICE)
    if dev:
        return str(dev)
    soc = socs.soc(o.get("soc"))
    if soc.hub_device is None:
        raise UsageError(f"no AI Hub device is known for {soc.name}; name one with the device option"
                         f" (e.g. --device \"{DEFAULT_DEVICE}\")")
    return soc.hub_device


def make_device(name: str):
    import qai_hub

    if re.match(r"^[a-z_]+:", name):
        return qai_hub.Device(attributes=[a.strip() for a in name.split(",")])
    return qai_hub.Device(name)


def hub_for(options) -> hubmod.Hub:
    o = dict(options or {})
    timeout = o.get("timeout") or os.environ.get("VLMRUN_QAIHUB_TIMEOUT")
    retries = o.get("retries", os.environ.get("VLMRUN_QAIHUB_RETRIES", hubmod.DEFAULT_RETRIES))
    return hubmod.Hub(retries=int(retries), timeout=float(timeout) if timeout else None,
                      poll=float(o["poll_interval"]) if o.get("poll_interval") else None)


def compile_options(precision: str, extra: str = "") -> str:
    if precision not in PRECISIONS:
        raise UsageError(f"precision '{precision}' is not one of {', '.join(PRECISIONS)}")
    opts = ["--target_runtime qnn_context_binary"]
    if precision in QUANT_FLAGS:
        opts.append(QUANT_FLAGS[precision])
    if extra:
        opts.append(str(extra).strip())
    return " ".join(opts)


# -- hooks -----------------------------------------------------------------------------------------------------
@hookimpl
def describe():
    return BackendInfo(NAME, HOSTED_STAGES,
                       "Qualcomm AI Hub: compiles QNN context binaries in the cloud (--compiler qaihub) and runs or"
                       " profiles stages on hosted Snapdragon devices", precision="fp16")


@hookimpl
def doctor():
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
    try:
        import configparser

        cp = configparser.ConfigParser()
        cp.read(path)
        api = cp["api"]
        has_token = bool(api.get("api_token", "").strip())
        detail = f"{path}: api_url {api.get('api_url', '?')}, token {'set' if has_token else 'MISSING'}"
        checks.append(Check("AI Hub configuration", has_token and bool(api.get("api_url")), detail))
    except Exception as exc:
        checks.append(Check("AI Hub configuration", False, f"{path}: {hubmod.one_line(exc)}"))
    return checks


@hookimpl
def register_options(register):
    for o in (
        Option(NAME, "device", str, flag="--device",
               help='AI Hub device name (e.g. "Snapdragon 8 Elite QRD") or "chipset:..." attributes'
                    f" [default: from soc; env {ENV_DEVICE}]"),
        Option(NAME, "hub_device", str, flag="--hub-device",
               help="AI Hub device when qaihub compiles for another backend (--compiler qaihub) [default: from soc]"),
        Option(NAME, "soc", str, choices=tuple(socs.SOCS), default=socs.DEFAULT_SOC, flag="--soc",
               help="target Snapdragon SoC (picks the hub's reference device)"),
        Option(NAME, "precision", str, choices=PRECISIONS, default="fp16", flag="--precision",
               help="numeric precision (hub-side quantization with calibration data)"),
        Option(NAME, "calibration_images", Path, flag="--calibration-images",
               help="folder of images to calibrate int8 (default: seeded random data)"),
        Option(NAME, "calibration_samples", int, default=8, minimum=1, help="calibration samples per input"),
        Option(NAME, "embed_seq", int, stages=("embed",), default=DEFAULT_EMBED_SEQ, minimum=1,
               help="static sequence length of the embed graph"),
        Option(NAME, "hub_options", str, help="extra AI Hub compile options, appended verbatim"),
        Option(NAME, "timeout", float, minimum=0.01, flag="--timeout",
               help="seconds to wait for one hub job [default: 3 h; env VLMRUN_QAIHUB_TIMEOUT]"),
        Option(NAME, "retries", int, default=hubmod.DEFAULT_RETRIES, minimum=0, help="network retries per call"),
        Option(NAME, "poll_interval", float, minimum=0.01, help="seconds between job status polls"),
    ):
        register(o)


@hookimpl
def compile(backend, request):
    if not mine(backend, NAME):
        return None
    merged = {**dict(request.stage_options or {}), **dict(request.options or {})}
    if request.target != NAME:
        # for another backend `device` is its own (qnn_htp: the adb serial of a phone); the hub device is
        # `hub_device`, or `device` when that backend's stage stays on this machine
        device = merged.pop("device", None)
        if not merged.get("hub_device") and str(merged.get("target") or "local") == "local" and device:
            merged["hub_device"] = device
    return compile_on_hub(hub_for(merged), request.stage, request.model, request.source, merged,
                          Path(request.out_dir), request.target, artifact=request.artifact,
                          rebuild=bool(request.rebuild), state_dir=request.context.state_dir())


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


def compile_on_hub(hub: hubmod.Hub, stage, model, source, options: dict, out_dir: Path, target: str, *,
                   artifact: str, state_dir: Path, rebuild: bool = False) -> dict:
    import qai_hub
    from qai_hub.client import ModelMetadataKey

    precision = str(options.get("precision") or "fp16").lower()
    hub_opts = compile_options(precision, str(options.get("hub_options") or ""))
    device = device_of(options)
    form = source.manifest.get("form", stage)
    name = "".join(c if c.isalnum() else "_" for c in form).strip("_") or stage
    src_io = onnx_io(source.file())
    ledger = hubmod.Ledger(state_dir)
    key = f"{artifact}|{device}|{hub_opts}"
    client = hub.client
    t0 = time.perf_counter()

    entry = ledger.get(key) or {}
    if rebuild and entry.get("state") != "submitted":
        entry = {}  # --rebuild: a new upload and job; a job an interrupted run left running is still re-attached
    job = None
    if entry.get("state") == "submitted" and entry.get("job_id"):
        hub.say(f"AI Hub: re-attaching to compile job {entry['job_id']} submitted earlier for this artifact")
        job = hub.call(f"lookup of compile job {entry['job_id']}", client.get_job, entry["job_id"])
    if job is None:
        hub_model = None
        if entry.get("state") == "uploaded" and entry.get("model_id"):
            try:
                hub_model = hub.call(f"lookup of model {entry['model_id']}", client.get_model, entry["model_id"])
            except BackendError:
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
            ledger.update(key, state="uploaded", model_id=hub_model.model_id, stage=stage, device=device)
        specs = {}
        for t in src_io["inputs"]:
            if all(isinstance(d, int) and d > 0 for d in t["shape"]):
                specs[t["name"]] = (tuple(t["shape"]), t["dtype"])
        calib = calibration_data(stage, model, src_io["inputs"], options) if precision != "fp16" else None
        job = hub.call("compile job submission", client.submit_compile_job, hub_model, make_device(device),
                       name=f"vlmrun {stage} {form} {precision}", input_specs=specs or None, options=hub_opts,
                       calibration_data=calib, retry=False)
        ledger.update(key, state="submitted", job_id=job.job_id, model_id=hub_model.model_id, url=job.url,
                      stage=stage, device=device, options=hub_opts)
        hub.say(f"AI Hub: compile job {job.job_id} submitted for {device} ({hub_opts}) {job.url}")

    try:
        hub.wait(job, "compile")
    except BackendError as exc:
        if " failed: " in str(exc):
            ledger.drop(key)  # a failed job is not re-attached to: the next run submits a new one
        raise
    target_model = hub.call(f"target model of job {job.job_id}", job.get_target_model)
    if target_model is None:
        ledger.drop(key)
        raise BackendError(f"AI Hub compile job {job.job_id} finished without a target model ({job.url})")
    in_spec, graph = _spec_list(hub.call("target model inputs", lambda: target_model.input_spec))
    out_spec, _ = _spec_list(hub.call("target model outputs", lambda: target_model.output_spec))
    meta = hub.call("target model metadata", lambda: target_model.metadata) or {}
    bin_name = f"{name}_ctx_qnn.bin"
    _, got_name = hubmod.download_model_into(hub, target_model, out_dir, bin_name)

    qnn = meta.get(ModelMetadataKey.QNN_SDK_VERSION) or meta.get(ModelMetadataKey.QAIRT_SDK_VERSION)
    graphs = [g for g in (meta.get(ModelMetadataKey.QNN_CONTEXT_BIN_GRAPH_NAMES) or "").replace(";", ",").split(",")
              if g.strip()]
    soc_model = meta.get(ModelMetadataKey.QNN_CONTEXT_BIN_SOC_MODEL)
    soc_name = str(options.get("soc") or "").upper() or None
    soc_model_n = int(soc_model) if soc_model and str(soc_model).isdigit() else None
    arch = None
    hub_soc = socs.by_soc_model(soc_model_n)
    if hub_soc is not None:
        arch = hub_soc.arch
        if soc_name and soc_name != hub_soc.name:
            raise BackendError(f"AI Hub device '{device}' built the binary for {hub_soc.name}/{arch} but {soc_name}"
                               f" was asked for; choose a device with that SoC (option device)")
        soc_name = soc_name or hub_soc.name
    if soc_name in socs.SOCS:
        soc_model_n = soc_model_n or socs.SOCS[soc_name].soc_model
        arch = arch or socs.SOCS[soc_name].arch
    hexagon = meta.get(ModelMetadataKey.QNN_CONTEXT_BIN_HEXAGON_VERSION)
    if hexagon and not arch:
        arch = f"v{str(hexagon).lstrip('vV')}"

    inputs = in_spec or [dict(t) for t in src_io["inputs"]]
    outputs = out_spec or [dict(t) for t in src_io["outputs"]]
    graph_name = (graphs[0] if graphs else None) or graph or name
    ctx_name = f"{name}_ctx.onnx"
    sdk = f"v{str(qnn).lstrip('vV')}" if qnn else None
    write_ctx_onnx(out_dir / ctx_name, bin_name, inputs, outputs, graph_name=graph_name, sdk_version=sdk)
    ledger.update(key, state="done")
    manifest = ContextManifest(
        files=[ctx_name, bin_name], graphs=graphs or [graph_name], inputs=inputs, outputs=outputs,
        stage=stage, precision=precision, compiler=NAME, target=target,
        qnn_version=str(qnn).lstrip("vV") if qnn else None, ep_sdk_version=sdk,
        soc=soc_name, soc_model=soc_model_n, arch=arch, source_form=form,
        compile_s=round(time.perf_counter() - t0, 3),
        binary_bytes={bin_name: (out_dir / bin_name).stat().st_size},
        extra={"hub": {
            "compile_job": job.job_id,
            "target_model": target_model.model_id,
            "device": device,
            "options": hub_opts,
            "url": hubmod.redact(job.url),
            "downloaded_as": got_name,
            "client": str(getattr(qai_hub, "__version__", "?")),
        }},
    )
    return manifest.to_dict()


# -- hosted devices --------------------------------------------------------------------------------------------
class HostedStage(StageHandle):
    """A stage compiled on AI Hub; each run is an inference job (profile=True) on the hosted device."""

    def __init__(self, hub: hubmod.Hub, artifact, stage: str, device: str, embed_seq: int | None = None):
        self.hub = hub
        self.artifact = artifact
        self.artifacts = (artifact,)
        self.stage = stage
        self.device = device
        self.embed_seq = embed_seq
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
            mid = self.artifact.manifest.get("hub", {}).get("target_model")
            if mid:
                try:
                    self._model = self.hub.call(f"lookup of model {mid}", client.get_model, mid)
                except BackendError:
                    self._model = None
            if self._model is None:  # the hub forgot it (or another account): upload the binary we have
                bin_path = next(self.artifact.path / f for f in self.artifact.manifest["files"] if f.endswith(".bin"))
                self._model = self.hub.call("context binary upload", client.upload_model, str(bin_path))
        return self._model

    def run_batches(self, batches: dict[str, list[np.ndarray]]) -> dict[str, list[np.ndarray]]:
        client = self.hub.client
        feeds = {}
        for name, arrs in batches.items():
            dtype = self.inputs.get(name, (None, None))[1]
            feeds[name] = [np.ascontiguousarray(a, dtype=dtype) if dtype else np.ascontiguousarray(a) for a in arrs]
        job = self.hub.call("inference job submission", client.submit_inference_job, self._hub_model(),
                            make_device(self.device), inputs=feeds, profile=True,
                            name=f"vlmrun {self.stage}", retry=False)
        self.last_job = job.job_id
        self.hub.say(f"AI Hub: inference job {job.job_id} submitted on {self.device} {job.url}")
        self.hub.wait(job, "inference")
        outs = self.hub.call(f"outputs of job {job.job_id}", job.download_output_data)
        if not outs:
            raise BackendError(f"AI Hub inference job {job.job_id} returned no outputs ({job.url})")
        prof = self.hub.call(f"profile of job {job.job_id}", job.download_profile) or {}
        summary = dict(prof.get("execution_summary") or {})
        self.last_profile = {"job_id": job.job_id, "device": self.device, "url": job.url,
                             **{k: v for k, v in summary.items() if not isinstance(v, (list, tuple)) or k.startswith("all_")}}
        names = list(outs)
        if set(self.output_names) <= set(names):
            return {n: outs[n] for n in self.output_names}
        if len(names) == len(self.output_names):  # the hub renamed them: keep the order
            return dict(zip(self.output_names, (outs[n] for n in names)))
        raise BackendError(f"AI Hub job {job.job_id} returned outputs {names}, expected {self.output_names}")

    def run(self, inputs: dict) -> dict:
        if self.stage == "embed" and self.embed_seq:
            ids = np.asarray(inputs["input_ids"], dtype=np.int64)
            T, E = ids.shape[1], self.embed_seq
            chunks = []
            for i in range(0, T, E):
                c = np.zeros((1, E), np.int64)
                c[0, : min(E, T - i)] = ids[0, i : i + E]
                chunks.append(c)
            out = self.run_batches({"input_ids": chunks})["inputs_embeds"]
            parts = [o[:, : min(E, T - i * E)] for i, o in enumerate(out)]
            return {"inputs_embeds": np.concatenate(parts, axis=1).astype(np.float32)}
        outs = self.run_batches({k: [v] for k, v in inputs.items() if k in self.inputs})
        return {k: np.asarray(v[0]) for k, v in outs.items()}


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
    compile_options(precision)  # validates
    device = device_of(o)
    form = forms(stage, o)
    src = ctx.exported(form)
    key_opts = {"precision": precision, "device": device, "hub_options": str(o.get("hub_options") or ""),
                "soc": o.get("soc"), "calibration_images": o.get("calibration_images")}
    key_opts = {k: v for k, v in key_opts.items() if v}
    art = ctx.compiled(src, key_opts, f"{form.label()}-{precision}-{device.replace(' ', '_')}")
    hub = hub_for(o)
    return HostedStage(hub, art, stage, device, form.get("seq") if stage == "embed" else None)


@hookimpl
def run_stage(backend, stage, handle, inputs):
    if not mine(backend, NAME):
        return None
    return handle.run(dict(inputs))
