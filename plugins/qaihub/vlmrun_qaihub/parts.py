"""``--compiler qaihub`` for qnn_htp's decoder parts form (``decoder_form = "parts"``): the route Qualcomm ships
LLMs by on AI Hub.

The ``decoder/parts`` export holds P parts, each a prompt (AR-N) and a token (AR-1) graph
(``vlmrun_ort_reference.decoder_parts``). With qnn_htp's ``followup_ar`` (default 32; 0 = none) each part has a
third graph, "followup": the prompt graph of the same part at that AR, in the same export
(``vlmrun_qualcomm.parts.part_graphs``), so that a conversation's next turn costs one small call, as in a local
compile. With ``weight_sharing`` on (the default for a hub compile: the
binaries are for a device, see ``vlmrun_qnn_htp.options.resolve_sharing``):

1. every graph is uploaded and compiled by one compile job, ``--target_runtime qnn_dlc --qnn_graph_name <name>``
   (Genie's ``{prompt|token}_ar{T}_cl{C}_{k}_of_{P}``; the follow-up graph is ``prompt_ar{F}_cl{C}_{k}_of_{P}``)
   with ``input_specs`` the graph's own input shapes, plus ``--qairt_version`` and ``hub_options`` as the other
   stages' hub compiles take them: 2P or 3P compile jobs, submitted together, then waited for one by one;
2. one link job per part over that part's compiled models (``submit_link_job(models=[prompt, token,
   followup])``; the client takes a list of one or more distinct DLCs): the hub returns ONE context binary holding
   the part's graphs with their weights once. Link jobs take QNN DLC models
   (the client refuses anything else: "Input model must be a QNN DLC model"), which is why step 1 compiles to
   ``qnn_dlc`` and not to ``qnn_context_binary``;
3. the binaries are downloaded as ``part{k}_of_{P}_qnn.bin`` with an EP-context wrapper per graph, and the
   manifest is qnn_htp's own (``decoder_parts``, written by ``vlmrun_qnn_htp.parts_compile.compile_parts`` for a local
   compile), so qnn_htp loads the artifact and writes Genie's configuration from it unchanged; it records the jobs
   (``hub_compile_job`` per graph, ``hub_link_job`` per part, ``hub_link_jobs`` / ``hub_compile_jobs``).

With ``weight_sharing = "off"`` each graph is compiled straight to ``qnn_context_binary`` (one binary per graph,
``part{k}_of_{P}_{kind}_qnn.bin``, no link job): the form the x86_64 HTP emulator can load.

Precision: fp16 only. The w8a16 / w4a16 recipe (16-bit activations, calibration feeds recorded through the
chained float parts, the clipped mask range) is qnn_htp's local compile; the hub's own quantizer would be fed
another recipe, so those precisions are refused in one line before anything is uploaded.

Every job is recorded in the artifact's job ledger (``qaihub-jobs.json`` in its state directory) under a key
naming the hub, the device, the options, the part and the graph: a rerun after Ctrl-C, a timeout or a lost hub
re-attaches to the jobs already submitted and resubmits none that finished; a failed job is dropped from the
ledger (the rerun submits that one again, the finished ones are kept); ``--rebuild`` re-attaches to nothing.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from pathlib import Path

from vlmrun.atomic import link_or_copy
from vlmrun.errors import BackendError, UsageError
from vlmrun_qualcomm import parts as qparts  # the form's arithmetic, shared with qnn_htp
from vlmrun_qualcomm.parts import exported_followup_ar, part_graphs
from vlmrun_qualcomm.manifest import ContextManifest, onnx_io, write_ctx_onnx

from . import hub as hubmod
from .devices import built_for, check_device_soc, expected_soc, make_device, resolve_device
from .downloads import download_model_into, spec_entry
from .errors import HubJobFailed, HubJobTimeout, HubNotFound, HubUnreachable
from .ledger import Ledger
from .options import device_of, qairt_version_of
from .reattach import forgotten, rerun_note



def is_parts(source) -> bool:
    return str(source.manifest.get("form", "")).startswith("decoder/parts")


def check_precision(precision: str) -> None:
    if precision != "fp16":
        raise UsageError(f"--compiler qaihub compiles decoder_form = \"parts\" at fp16 only, not {precision}: the"
                         " w8a16/w4a16 recipe (16-bit activations, calibration through the chained parts) is qnn_htp's"
                         " local compile; drop --compiler qaihub for it, or use --precision fp16")


def graph_options(runtime: str, graph: str, qairt: str | None, extra: str) -> str:
    opts = [f"--target_runtime {runtime}", f"--qnn_graph_name {graph}"]
    if qairt:
        opts.append(f"--qairt_version {qairt}")
    if extra:
        opts.append(extra)
    return " ".join(opts)


def base_name(name: str) -> str:
    """A graph name as asked for: the fake hub zero-pads names before ``_<k>_of_<P>`` (tests/fake_hub.py)."""
    return re.sub(r"_0*(?=_\d+_of_\d+$)", "", name)


def _upload_path(src_dir: Path, files: list[str], work: Path) -> Path:
    """One graph as the client uploads it: the .onnx alone, or a directory with the .onnx and its .data."""
    onnx_file = src_dir / files[0]
    data = [src_dir / f for f in files[1:]]
    if not data:
        return onnx_file
    if len(data) > 1 or not data[0].name.endswith(".data"):
        raise BackendError(f"{src_dir.name}: AI Hub takes one external data file ending in .data per ONNX graph,"
                           f" found {', '.join(f.name for f in data)}")
    d = work / onnx_file.name
    d.mkdir()
    for f in (onnx_file, data[0]):
        link_or_copy(f, d / f.name)
    return d


def input_specs(path: Path) -> dict:
    """The compile job's ``input_specs`` of the ONNX graph ``path``: ``{name: (shape, dtype)}`` of its inputs of
    fixed shape (every one in the parts export: the graph's rows, ``attention_mask`` [1, T, C], ...)."""
    return {t["name"]: (tuple(t["shape"]), t["dtype"]) for t in onnx_io(path)["inputs"]
            if all(isinstance(d, int) and d > 0 for d in t["shape"])}


def graph_bytes(out_dir: Path, parts: list[dict], share: bool) -> dict | None:
    """Bytes of each graph kind over the parts (what the follow-up graph costs), when each graph has its own
    binary; ``None`` when weight-shared (a part's graphs share its binary), as qnn_htp's manifest says it."""
    if share:
        return None
    out: dict = {}
    for e in parts:
        for kind, g in e["graphs"].items():
            out[kind] = out.get(kind, 0) + (Path(out_dir) / g["binary"]).stat().st_size
    return out


def _spec(io_spec, graph: str | None) -> tuple[list[dict], list[str]]:
    """The tensors of ``graph`` in a client IOSpec ({graph: [TensorSpec]}), and the graph names it has."""
    names = [g for g in (io_spec or {}) if g]
    tensors = (io_spec or {}).get(graph) or []
    return [spec_entry(t) for t in tensors], names


class _Steps:
    """The jobs of one parts compile: ledger keys, re-attaching, submitting, waiting."""

    def __init__(self, hub, ledger, base: str, dev, rerun: str, P: int):
        self.hub, self.ledger, self.base, self.dev, self.rerun, self.P = hub, ledger, base, dev, rerun, P

    def key(self, *what) -> str:
        return "|".join([self.base, *map(str, what)])

    def attach(self, key: str, kind: str):
        """The job the ledger holds for ``key`` (None: none, or the hub forgot it)."""
        entry = self.ledger.get(key) or {}
        if entry.get("state") not in ("submitted", "done") or not entry.get("job_id"):
            return None
        what = "re-attaching to" if entry["state"] == "submitted" else "reusing"
        self.hub.say(f"AI Hub: {what} {kind} job {entry['job_id']} ({entry.get('what', key)}) submitted earlier")
        try:
            return self.hub.call(f"lookup of {kind} job {entry['job_id']}", self.hub.client.get_job, entry["job_id"])
        except HubNotFound as exc:
            forgotten(self.hub, kind, entry["job_id"], exc)
            self.ledger.drop(key)
            return None

    def wait(self, key: str, job, kind: str, what: str):
        """Wait for ``job``; a failure names the job, the part and graph and the hub's reason (one line)."""
        try:
            self.hub.wait(job, kind, rerun=self.rerun)
        except HubJobFailed as exc:
            self.ledger.drop(key)  # the rerun submits this one again; the finished ones stay
            raise HubJobFailed(f"{what}: {exc}") from None
        except (HubUnreachable, HubJobTimeout, KeyboardInterrupt):
            raise  # still running on the hub: the ledger keeps it for the rerun
        except HubNotFound:
            self.ledger.drop(key)
            raise
        self.ledger.update(key, state="done")

    def target(self, job, what: str):
        model = self.hub.call(f"target model of job {job.job_id}", job.get_target_model)
        if model is None:
            raise BackendError(f"{what}: AI Hub job {job.job_id} finished without a target model"
                               f" ({hubmod.redact(job.url)})")
        return model


def compile_parts_on_hub(hub: hubmod.Hub, model, source, options: dict, out_dir: Path, target: str, *,
                         state_dir: Path, rebuild: bool = False) -> dict:
    """Compile every part of the ``decoder/parts`` export ``source`` on the hub into ``out_dir``; the manifest."""
    import qai_hub
    from qai_hub.client import ModelMetadataKey

    t0 = time.perf_counter()
    precision = str(options["precision"]).lower()
    check_precision(precision)
    share = str(options["weight_sharing"]).lower() != "off"  # qnn_htp's "auto" is "on" for a hub compile
    qairt = qairt_version_of(options)
    extra = str(options.get("hub_options") or "").strip()
    spec = device_of(options)
    want = expected_soc(options, target)
    dev = resolve_device(hub, spec)  # an unknown device or a SoC mismatch stops here, before any upload
    check_device_soc(dev, want)
    src_dir = source.path
    desc = json.loads((src_dir / "parts.json").read_text())
    P, ar, ctx = len(desc["parts"]), desc["ar"], desc["ctx"]
    table = {p["index"]: part_graphs(p) for p in desc["parts"]}  # part -> kind -> graph (follow-up too)
    limit = int(options["part_limit_mb"]) * 1_000_000
    runtime = "qnn_dlc" if share else "qnn_context_binary"
    link_opts = f"--qairt_version {qairt}" if qairt else ""
    ledger = Ledger(state_dir)
    base = f"parts|{hub.api_url}|{spec}|{runtime}|{qairt or ''}|{extra}"
    steps = _Steps(hub, ledger, base, dev, rerun_note(rebuild), P)
    if rebuild:
        for k in ledger.keys(base + "|"):
            e = ledger.get(k) or {}
            if e.get("state") == "submitted" and e.get("job_id"):
                hub.say(f"AI Hub: --rebuild: not re-attaching to {e.get('kind', 'compile')} job {e['job_id']};"
                        " submitting a new one")
            ledger.drop(k)
    client = hub.client

    # 1. one compile job per graph: re-attach or upload and submit them all, then wait for each
    cjobs: dict[tuple[int, str], object] = {}
    for p in desc["parts"]:
        k = p["index"]
        for kind, g in table[k].items():
            key = steps.key("compile", k, kind)
            what = f"decoder part {k}/{P} {kind} graph"
            job = None if rebuild else steps.attach(key, "compile")
            if job is None:
                entry = ledger.get(key) or {}
                hub_model = None
                if entry.get("state") == "uploaded" and entry.get("model_id"):
                    try:
                        hub_model = hub.call(f"lookup of model {entry['model_id']}", client.get_model,
                                             entry["model_id"])
                    except HubNotFound:
                        hub_model = None
                if hub_model is None:
                    work = Path(tempfile.mkdtemp(prefix="vlmrun-qaihub-up-"))
                    try:
                        path = _upload_path(src_dir, g["files"], work)
                        hub.say(f"AI Hub: uploading {what} ({g['file']}) from {src_dir.name}")
                        hub_model = hub.call("model upload", client.upload_model, str(path),
                                             name=f"vlmrun-decoder-{Path(g['file']).stem}-{src_dir.name}")
                    finally:
                        shutil.rmtree(work, ignore_errors=True)
                    ledger.update(key, state="uploaded", model_id=hub_model.model_id, what=what, kind="compile")
                specs = input_specs(src_dir / g["file"])
                opts = graph_options(runtime, g["name"], qairt, extra)
                job = hub.call("compile job submission", client.submit_compile_job, hub_model, make_device(dev.spec),
                               name=f"vlmrun decoder part{k}_of_{P} {kind} {precision}", input_specs=specs or None,
                               options=opts, retry=False, idempotent=False)
                ledger.update(key, state="submitted", job_id=job.job_id, model_id=hub_model.model_id,
                              url=hubmod.redact(job.url), device=dev.spec, options=opts, api_url=hub.api_url)
                hub.say(f"AI Hub: compile job {job.job_id} submitted for {what} on {dev.name} ({opts})"
                        f" {hubmod.redact(job.url)}")
            cjobs[(k, kind)] = job
    for (k, kind), job in cjobs.items():
        steps.wait(steps.key("compile", k, kind), job, "compile", f"decoder part {k}/{P} {kind} graph")

    # 2. one link job per part over its compiled graphs (weight sharing), then wait for each
    finals: dict[int, object] = {}  # part -> the job whose target model is the part's binary (link jobs)
    if share:
        for p in desc["parts"]:
            k = p["index"]
            key = steps.key("link", k)
            job = None if rebuild else steps.attach(key, "link")
            if job is None:
                models = [steps.target(cjobs[(k, kind)], f"decoder part {k}/{P} {kind} graph") for kind in table[k]]
                job = hub.call("link job submission", client.submit_link_job, models, make_device(dev.spec),
                               name=f"vlmrun decoder part{k}_of_{P} {precision}", options=link_opts,
                               idempotent=False)
                ledger.update(key, state="submitted", job_id=job.job_id, url=hubmod.redact(job.url), kind="link",
                              what=f"decoder part {k}/{P}", models=[m.model_id for m in models], device=dev.spec,
                              api_url=hub.api_url)
                hub.say(f"AI Hub: link job {job.job_id} submitted for decoder part {k}/{P}"
                        f" ({', '.join(m.model_id for m in models)}) {hubmod.redact(job.url)}")
            finals[k] = job
        for k, job in finals.items():
            steps.wait(steps.key("link", k), job, "link", f"decoder part {k}/{P} ({' + '.join(table[k])} graphs)")

    # 3. download the binaries, write a wrapper per graph and qnn_htp's parts manifest
    parts, wrappers, binaries, graphs = [], [], [], []
    qnn = soc_model = hexagon = None
    for p in desc["parts"]:
        k = p["index"]
        entry = {"index": k, "layers": p["layers"], "graphs": {}, "binaries": [],
                 "source_sha256": {kind: qparts.graph_digest(src_dir / g["file"]) for kind, g in table[k].items()},
                 "hub_compile_jobs": {kind: cjobs[(k, kind)].job_id for kind in table[k]}}
        pieces = ([(None, finals[k], f"part{k}_of_{P}_qnn.bin")] if share else
                  [(kind, cjobs[(k, kind)], f"part{k}_of_{P}_{kind}_qnn.bin") for kind in table[k]])
        for only, job, bin_name in pieces:
            what = f"decoder part {k}/{P}" + (f" {only} graph" if only else "")
            tm = steps.target(job, what)
            download_model_into(hub, tm, out_dir, bin_name)
            meta = hub.call("target model metadata", lambda: tm.metadata) or {}
            in_spec = hub.call("target model inputs", lambda: tm.input_spec)
            out_spec = hub.call("target model outputs", lambda: tm.output_spec)
            qnn = qnn or meta.get(ModelMetadataKey.QAIRT_SDK_VERSION) or meta.get(ModelMetadataKey.QNN_SDK_VERSION)
            soc_model = soc_model or meta.get(ModelMetadataKey.QNN_CONTEXT_BIN_SOC_MODEL)
            hexagon = hexagon or meta.get(ModelMetadataKey.QNN_CONTEXT_BIN_HEXAGON_VERSION)
            got = [n.strip() for n in re.split(r"[,;]", meta.get(ModelMetadataKey.QNN_CONTEXT_BIN_GRAPH_NAMES) or "")
                   if n.strip()]
            for kind in ([only] if only else table[k]):
                g = table[k][kind]
                name = next((n for n in got if base_name(n) == g["name"]), None)
                if name is None:
                    raise BackendError(f"{what}: AI Hub job {job.job_id} returned a binary with graphs"
                                       f" {', '.join(got) or 'none named'}, not {g['name']}")
                ins, names = _spec(in_spec, name)
                outs, _ = _spec(out_spec, name)
                entry["graphs"][kind] = {"wrapper": f"part{k}_of_{P}_{kind}_ctx.onnx", "binary": bin_name,
                                         "ar": g["ar"], "name": name, "inputs": ins or g["inputs"],
                                         "outputs": outs or g["outputs"],
                                         "hub_compile_job": cjobs[(k, kind)].job_id}
            if bin_name not in entry["binaries"]:
                entry["binaries"].append(bin_name)
        if share:
            entry["hub_link_job"] = finals[k].job_id
        entry["bytes"] = sum((out_dir / b).stat().st_size for b in entry["binaries"])
        parts.append(entry)

    soc, soc_model_n = built_for(dev, want, soc_model, "the decoder parts")
    if not qnn and qairt and qairt[0].isdigit():
        qnn = qairt
    sdk = f"v{str(qnn).lstrip('vV')}" if qnn else None
    for e in parts:
        for g in e["graphs"].values():
            write_ctx_onnx(out_dir / g["wrapper"], g["binary"], g["inputs"], g["outputs"], graph_name=g["name"],
                           sdk_version=sdk)
            wrappers.append(g["wrapper"])
            graphs.append(g["name"])
        binaries += e["binaries"]
    qparts.check_part_limits(out_dir, parts, limit, " from AI Hub")
    weight_bytes = qparts.weight_bytes(model, precision)
    total = sum(e["bytes"] for e in parts)
    first, last = parts[0]["graphs"]["prompt"], parts[-1]["graphs"]["prompt"]
    link_ids = [e["hub_link_job"] for e in parts] if share else []
    k1 = parts[0]["index"]
    compile_ids = [job for e in parts for job in e["hub_compile_jobs"].values()]
    return ContextManifest(
        files=[*wrappers, *binaries], graphs=graphs, inputs=first["inputs"], outputs=last["outputs"],
        stage="decoder", precision=precision, compiler="qaihub", target=target,
        qnn_version=str(qnn).lstrip("vV") if qnn else None, ep_sdk_version=sdk,
        soc=soc.name if soc else None, soc_model=soc_model_n or (soc.soc_model if soc else None),
        arch=soc.arch if soc else (f"v{str(hexagon).lstrip('vV')}" if hexagon else None),
        source_form=source.manifest.get("form", "decoder/parts"), compile_s=round(time.perf_counter() - t0, 3),
        binary_bytes={b: (out_dir / b).stat().st_size for b in binaries},
        extra={
            "decoder_parts": {
                "ar": ar, "ctx": ctx, "parts": parts, "count": P, "layers": desc["layers"],
                "followup_ar": exported_followup_ar(desc), "graph_bytes": graph_bytes(out_dir, parts, share),
                "weight_sharing": share, "graphs_per_binary": len(table[k1]) if share else 1,
                "binaries_in_order": binaries, "total_bytes": total, "limit_bytes": limit,
                "weight_bytes": weight_bytes, "bytes_over_weights": round(total / weight_bytes, 4),
                "loads_on_emulator": not share,
            },
            # where the binaries came from (scalars: `vlmrun compile` shows them; job ids comma-separated in part
            # order, prompt, token, follow-up; decoder_parts has them per part and graph)
            "hub_device": dev.name,
            "hub_link_jobs": ",".join(link_ids),
            "hub_compile_jobs": ",".join(compile_ids),
            "hub_url": hubmod.redact((finals[k1] if share else cjobs[(k1, "prompt")]).url),
            "hub": {"api_url": hub.api_url, "device_spec": dev.spec, "chipset": dev.chipset,
                    "compile_options": graph_options(runtime, "<graph>", qairt, extra), "link_options": link_opts,
                    "qairt_version": qairt, "client": str(getattr(qai_hub, "__version__", "?"))},
        },
    ).to_dict()
