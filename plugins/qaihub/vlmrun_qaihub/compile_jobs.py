"""Compile jobs: a stage's ONNX compiled on the hub into a QNN context binary, written into the artifact store as
qnn_htp's own (the EP-context wrapper and a manifest that records the job, its page, the target model and the
device); calibration data for the hub's quantizer; the job recorded in the artifact's ledger, so a rerun
re-attaches to it. qnn_htp's decoder parts form is compiled by ``parts.py``."""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from vlmrun.atomic import link_or_copy
from vlmrun.errors import BackendError, VlmrunError
from vlmrun_qualcomm.manifest import ContextManifest, onnx_io, write_ctx_onnx

from . import hub as hubmod
from . import parts
from .devices import built_for, check_device_soc, expected_soc, make_device, resolve_device
from .downloads import download_model_into, spec_entry
from .errors import HubJobTimeout, HubNotFound, HubUnreachable
from .ledger import Ledger
from .options import NAME, check_per_layer_precision, compile_options, device_of, hub_for, qairt_version_of
from .reattach import forgotten, rerun_note


def compile_request(request) -> dict:
    """The ``compile`` hook's work: ``request`` (a stage to compile for qaihub or, with ``--compiler qaihub``, for
    another backend) compiled on the hub; returns the manifest."""
    merged = {**request.stage_options, **request.options}
    if request.target != NAME:  # preflight skipped (a StageContext built by hand)
        check_per_layer_precision(request.stage, {**request.stage_options.given, **request.options},
                                  merged["precision"])
        # for another backend `device` is its own (qnn_htp: the adb serial of a phone); the hub device is
        # `hub_device`, or `device` when that backend's stage stays on this machine
        device = merged.pop("device", None)
        if not merged.get("hub_device") and merged.get("target") in (None, "local") and device:
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
        link_or_copy(f, d / f.name if f.suffix in (".onnx", ".data") else d / (f.name + ".data"))
    if not data[0].name.endswith(".data"):  # the client needs a .data suffix: keep the location the ONNX names
        raise BackendError(f"{source.path.name}: external data file {data[0].name} must end in .data for AI Hub")
    return d


def calibration_data(stage, model, io_in: list[dict], options: dict) -> dict:
    """Calibration samples per input: images for ``pixel_values`` when given, else seeded random data."""
    rng = np.random.default_rng(0)
    n = int(options["calibration_samples"])
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
        out += [spec_entry(t) for t in tensors]
    return out, graph



def compile_on_hub(hub: hubmod.Hub, stage, model, source, options: dict, out_dir: Path, target: str, *,
                   artifact: str, state_dir: Path, rebuild: bool = False) -> dict:
    """Compile ``source`` on the hub into ``out_dir`` (see the module docstring); returns the manifest."""
    if parts.is_parts(source):  # qnn_htp's decoder parts form: compile jobs per graph, a link job per part
        return parts.compile_parts_on_hub(hub, model, source, options, out_dir, target, state_dir=state_dir,
                                          rebuild=rebuild)
    precision = str(options["precision"]).lower()
    qairt = qairt_version_of(options)
    hub_opts = compile_options(precision, str(options.get("hub_options") or ""), qairt)
    spec = device_of(options)
    want = expected_soc(options, target)
    dev = resolve_device(hub, spec)  # an unknown device or a SoC mismatch stops here, before any upload
    check_device_soc(dev, want)
    ledger = Ledger(state_dir)
    key = f"compile|{hub.api_url}|{spec}|{hub_opts}"
    rerun = rerun_note(rebuild)
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
            forgotten(hub, "compile", entry["job_id"], exc)
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
            forgotten(hub, "compile", job.job_id, exc)
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
    _, got_name = download_model_into(hub, target_model, out_dir, bin_name)

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
