"""A local stand-in for Qualcomm AI Hub: the protobuf REST subset the real ``qai_hub`` client speaks.

Runs on 127.0.0.1 (random port) in a thread. Models (create, multipart upload with ETags, get, download),
devices, compile jobs (the uploaded ONNX compiled to a QNN context binary by onnxruntime-qnn on the HTP
emulator), datasets (h5 upload by multipart POST, download), inference jobs (the context binary run on the
emulator, outputs as an h5 dataset, a profile), link jobs (below). Faults are switched on through attributes of
the server:

* ``fail_compile = "reason"``: the next compile job ends FAILED with that reason
* ``fail_link = "reason"``: the next link job ends FAILED with that reason
* ``fail_inference = "reason"``: the next inference job ends FAILED with that reason
* ``max_dataset_bytes = n``: a dataset upload of more than n bytes is refused with HTTP 413 when the client asks
  for its upload URL (which names the file size), as the hub refuses an asset it finds too large (the client's
  message for 413: "The uploaded asset is too large"); the real hub's limit is not documented
* ``never_finish = True``: compile jobs stay in OPTIMIZING_MODEL forever (every job stays in progress)
* ``hold_links = True``: link jobs stay in LINKING_MODELS until it is False again
* ``errors = {"GET jobs": n}``: the next n matching requests answer HTTP 500
* ``drops = {"GET jobs": n}``: the next n matching requests get their connection closed with no answer
* ``download_name = "../../x"``: the file name the server gives a target model download
* ``slow = {"GET jobs/": seconds}``: matching requests are answered only after that delay
* ``job_seconds = s``: every job stays in progress for at least ``s`` seconds
* :meth:`FakeHub.restart`: the server goes down and comes back on the same port having forgotten every job,
  model and dataset (as a hub that deleted or expired them, or another account's ids);
  :meth:`FakeHub.stop_serving`: the port closes (a hub killed mid-wait); :func:`closed_port_url`: a URL nothing
  listens on

``seen_tokens`` records the Authorization tokens received; ``log`` the requests (method, path);
``compile_options`` / ``inference_options`` the options string of each job submitted; ``jobs[id]["input_specs"]``
the ``input_specs`` a compile job was submitted with (``{name: (shape, dtype)}``, echoed back in the job's
``tensor_type_list``, as the hub does): specs not compatible with the uploaded model (an input it does not have, a
rank or a fixed extent other than the model's) fail the job, the client's documented contract; ``inference_jobs`` each
inference job submitted: id, name, ``samples`` (how many its input dataset holds: the client sends a dataset of
input name -> list of N arrays, and the job runs every sample, its outputs a list of N per output, in order) and
the input shapes of its first sample; ``jobs[id]["calibration"]``, a compile job's calibration dataset id (None
without), and :meth:`FakeHub.dataset_digest`, a digest of a dataset's arrays (this fake does not quantize: it
compiles the float graph whatever ``--quantize_full_type`` says, but records the calibration data it was given).
A compile job whose
options pin ``--qairt_version X`` records X as the target model's QAIRT/QNN SDK version (the binary itself is
built by the local onnxruntime-qnn).

Graph names: ``--qnn_graph_name NAME`` (or the client's ``--qnn_options context_enable_graphs=NAME``) names the
compiled graph. The real hub writes NAME as given; this fake rewrites onnxruntime-qnn's graph name inside the
binary in place, which keeps its length, so NAME is zero-padded to that length before a ``_<k>_of_<P>`` suffix
(else at its end with ``_``), the way ``vlmrun_qnn_htp.genie_names.genie_name`` pads; a NAME longer than
onnxruntime-qnn's fails the job.

Link jobs (``submit_link_job``: ``POST jobs`` with ``Job.link_job``: ``models`` a ModelList of model ids, ``device``,
``name``, ``options``; polled with ``GET jobs/<id>``, in progress as CREATED / LINKING_MODELS; ``target_model``
seeded at creation) and the contract the real service states ("the input models to a link job must be compiled
through AI Hub and target the same device"; the client allows only QNN DLC models): a compile job with
``--target_runtime qnn_dlc`` yields a MODEL_TYPE_QNN_DLC target model; a link job FAILS (job state FAILED with
the reason, as the hub reports a job's failure) when an input is not a QNN DLC model, is not the target model of
a successful compile job, was compiled for another device than the others or than the link job's, or when
inputs or graph names repeat. What the fake's "DLC" is: not QNN's DLC format (no QNN SDK converter here), but
the uploaded ONNX kept as it was uploaded (one file, or a zip of the model directory), with the graph name
and I/O the compile job gave it; only the link job compiles. The link job compiles its DLCs with
onnxruntime-qnn on the HTP emulator into ONE context binary holding every graph with shared weights, the same
mechanism ``vlmrun_qnn_htp.parts_compile`` uses locally for ``weight_sharing = "on"`` (``ep.share_ep_contexts`` on every
session, ``ep.stop_share_ep_contexts`` on the last), names the graphs as asked (above), and gives the target
model (MODEL_TYPE_QNN_CONTEXT_BINARY) the graph names in its metadata and input/output specs per graph
(``graph_name``). ``link_jobs`` records each link job submitted (id, model ids, device, options).

Start one by hand (``scripts/fake-hub --help``): it writes a client.ini for the ``qai-hub`` client and prints
the environment to point vlmrun at it.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import itertools
import os
import random
import re
import secrets
import shutil
import signal
import socket
import string
import sys
import tempfile
import threading
import time
import zipfile
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlparse

import numpy as np
from qai_hub import public_api_pb2 as pb

DEVICES = [
    ("Snapdragon 8 Elite QRD", "15", ["chipset:qualcomm-snapdragon-8-elite", "framework:qnn", "framework:onnx",
                                      "hexagon:v79", "os:android"], 69),
    ("Snapdragon 8 Gen 3 QRD", "14", ["chipset:qualcomm-snapdragon-8gen3", "framework:qnn", "framework:onnx",
                                      "hexagon:v75", "os:android"], 57),
    ("Samsung Galaxy S25 (Family)", "15", ["chipset:qualcomm-snapdragon-8-elite", "framework:qnn",
                                           "framework:onnx", "hexagon:v79", "os:android", "vendor:samsung"], 69),
]
DTYPES = {"float32": pb.TENSOR_DTYPE_FLOAT32, "float16": pb.TENSOR_DTYPE_FLOAT16, "int32": pb.TENSOR_DTYPE_INT32,
          "int64": pb.TENSOR_DTYPE_INT64, "uint8": pb.TENSOR_DTYPE_UINT8, "int8": pb.TENSOR_DTYPE_INT8,
          "uint16": pb.TENSOR_DTYPE_UINT16, "int16": pb.TENSOR_DTYPE_INT16, "bool": pb.TENSOR_DTYPE_BOOL}


def _ts(pbts, t=None):
    t = time.time() if t is None else t
    pbts.seconds = int(t)


def closed_port_url() -> str:
    """``http://127.0.0.1:<port>`` where nothing listens (the port was just bound and released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def write_client_ini(path: Path, token: str, url: str) -> Path:
    """A ``qai-hub`` client configuration pointing at ``url`` (QAIHUB_CLIENT_INI names it)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"[api]\napi_token = {token}\napi_url = {url}\nweb_url = {url}/web/\nverbose = False\n")
    return path


@contextlib.contextmanager
def serving(token: str, ini_dir: Path):
    """A started FakeHub with the qai-hub client pointed at it (``QAIHUB_CLIENT_INI``, no proxy for 127.0.0.1,
    no ``VLMRUN_QAIHUB_TIMEOUT``, fast polling); the environment and the client are restored afterwards."""
    import qai_hub.client

    server = FakeHub(token).start()
    ini = write_client_ini(Path(ini_dir) / "client.ini", token, server.url)
    saved = {k: os.environ.get(k) for k in ("QAIHUB_CLIENT_INI", "NO_PROXY", "no_proxy", "VLMRUN_QAIHUB_TIMEOUT")}
    os.environ.update(QAIHUB_CLIENT_INI=str(ini), NO_PROXY="127.0.0.1", no_proxy="127.0.0.1")
    os.environ.pop("VLMRUN_QAIHUB_TIMEOUT", None)
    interval = qai_hub.client.Job._polling_interval
    qai_hub.client.Job._polling_interval = 0.05  # tests only: poll fast
    try:
        yield server
    finally:
        qai_hub.client.Job._polling_interval = interval
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


def _qairt(options: str) -> str | None:
    m = re.search(r"--qairt_version[ =](\S+)", options or "")
    if not m:
        return None
    v = m.group(1)
    return v + ".0" if re.fullmatch(r"\d+\.\d+", v) else v


_WORKING = {"compile": pb.JOB_STATE_OPTIMIZING_MODEL, "link": pb.JOB_STATE_LINKING_MODELS,
            "inference": pb.JOB_STATE_RUNNING_INFERENCE}  # a job's state while it works


def _runtime(options: str) -> str:
    m = re.search(r"--target_runtime[ =](\S+)", options or "")
    return m.group(1) if m else "tflite"


def _graph_name(options: str) -> str | None:
    m = re.search(r"--qnn_graph_name[ =](\S+)", options or "") or re.search(
        r"context_enable_graphs=([^\s;,]+)", options or "")
    return m.group(1) if m else None


def _input_specs(types) -> dict:
    """A compile job's ``input_specs`` as sent (``CompileJob.tensor_type_list``): ``{name: (shape, dtype)}``."""
    return {t.name: (tuple(int(d) for d in t.tensor_type.shape),
                     pb.TensorDtype.Name(t.tensor_type.dtype).removeprefix("TENSOR_DTYPE_").lower())
            for t in types.types}


def _specs_mismatch(specs: dict, inputs: list[dict]) -> str | None:
    """Why ``input_specs`` are not compatible with the uploaded model's inputs (None: they are), as the client
    documents the contract ("If input_specs is not None, it must be compatible with the model, or the server will
    return an error"): a spec names one of the model's inputs, or renames them all in order; its rank and every
    fixed extent are the model's (a dynamic extent may be set)."""
    if not specs:
        return None
    names = [t["name"] for t in inputs]
    if all(n in names for n in specs):
        pairs = [(n, specs[n][0], next(t for t in inputs if t["name"] == n)) for n in specs]
    elif len(specs) == len(inputs):  # the inputs renamed, in order
        pairs = [(n, spec[0], t) for (n, spec), t in zip(specs.items(), inputs)]
    else:
        return (f"input_specs name {', '.join(n for n in specs if n not in names)}, which the model's inputs"
                f" ({', '.join(names)}) do not have")
    for name, shape, t in pairs:
        model = list(t["shape"])
        if len(shape) != len(model) or any(isinstance(d, int) and d > 0 and d != s for d, s in zip(model, shape)):
            return (f"input_specs are not compatible with the model: {name} {list(shape)}, the model's input"
                    f" {t['name']} is {model}")
    return None


def _fit_name(want: str, old: str) -> str:
    """``want`` at the length of ``old`` (see the module docstring: graph names are rewritten in place)."""
    if len(want) == len(old):
        return want
    if len(want) > len(old):
        raise RuntimeError(f"graph name {want} is longer than {len(old)} characters, which this fake hub cannot"
                           " write (it renames onnxruntime-qnn's graphs in place)")
    m = re.match(r"(.*)(_\d+_of_\d+)$", want)
    if m:
        return m.group(1) + "_" + "0" * (len(old) - len(want) - 1) + m.group(2)
    return want + "_" * (len(old) - len(want))


def _rename_graph(binary: Path, wrapper: Path | None, old: str, new: str) -> None:
    """Rename graph ``old`` in a context binary (same length) and in the EPContext wrapper over it."""
    from vlmrun_qnn_htp.genie_names import rename_graph

    rename_graph(binary, old, new)
    if wrapper is not None:
        import onnx

        m = onnx.load(str(wrapper))
        for node in m.graph.node:
            for a in node.attribute:
                if a.name == "partition_name" and a.s.decode() == old:
                    a.s = new.encode()
        onnx.save(m, str(wrapper))


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        if isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError, ConnectionAbortedError)):
            return  # the client gave up on a slow answer or a dropped connection: expected here
        super().handle_error(request, client_address)


class FakeHub:
    def __init__(self, token: str, port: int = 0):
        self.token = token
        self.root = Path(tempfile.mkdtemp(prefix="fake-hub-"))
        self.lock = threading.RLock()
        self._forget()
        self.fail_compile: str | None = None
        self.fail_link: str | None = None
        self.fail_inference: str | None = None
        self.max_dataset_bytes: int | None = None
        self.never_finish = False
        self.hold_links = False
        self.errors: dict[str, int] = {}
        self.drops: dict[str, int] = {}
        self.slow: dict[str, float] = {}
        self.job_seconds = 0.0  # a job stays in progress at least this long
        self.download_name: str | None = None
        self.seen_tokens: set[str] = set()
        self.log: list[tuple[str, str]] = []
        self.compile_options: list[str] = []
        self.link_jobs: list[dict] = []
        self.inference_options: list[str] = []
        self.inference_jobs: list[dict] = []
        self.server = self._serve(port)
        self.port = self.server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"

    def _forget(self):
        # ids carry a per-run tag, as a real hub's never repeat: a restarted fake hub does not reuse them
        self.tag = "".join(random.choice(string.ascii_lowercase) for _ in range(3))
        self.ids = itertools.count(1)
        self.models: dict[str, dict] = {}
        self.datasets: dict[str, dict] = {}
        self.jobs: dict[str, dict] = {}
        self.files: dict[str, bytes] = {}

    def _serve(self, port: int) -> ThreadingHTTPServer:
        server = _Server(("127.0.0.1", port), self._handler())
        server.daemon_threads = True
        self.thread = threading.Thread(target=server.serve_forever, daemon=True)
        return server

    def start(self) -> "FakeHub":
        self.thread.start()
        return self

    def stop_serving(self):
        """Close the port (requests are refused from now on); :meth:`restart` opens it again."""
        if self.server is not None:
            self.server.shutdown()
            self.server.server_close()
            self.server = None

    def restart(self, forget: bool = True) -> "FakeHub":
        """Go down and come back on the same port; ``forget``: without any job, model or dataset."""
        self.stop_serving()
        with self.lock:
            if forget:
                self._forget()
        self.server = self._serve(self.port)
        return self.start()

    def stop(self):
        self.stop_serving()
        shutil.rmtree(self.root, ignore_errors=True)

    def count(self, method: str, path: str) -> int:
        """How many requests ``method path`` (exact, slashes ignored) the server received."""
        return sum(1 for m, p in self.log if m == method and p.strip("/") == path.strip("/"))

    def new_id(self, kind: str) -> str:
        return f"{kind}{self.tag}{next(self.ids):04d}"

    # -- compile / inference workers ------------------------------------------------------------------------
    def _extract(self, model: dict, into: Path) -> Path:
        """The ONNX file of an uploaded model (a single file, or a zipped model directory) under ``into``."""
        into.mkdir(parents=True)
        data = model["data"]
        if model["is_directory"] or data[:2] == b"PK":
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                z.extractall(into)
            return next(into.rglob("*.onnx"))
        path = into / "model.onnx"
        path.write_bytes(data)
        return path

    @staticmethod
    def _soc_of(device: str):
        from vlmrun_qualcomm import socs

        dev = next(d for d in DEVICES if d[0] == device)
        return dev, next(s for s in socs.SOCS.values() if s.soc_model == dev[3])

    def _compile(self, job_id: str):
        from vlmrun_qnn_htp import ep
        from vlmrun_qualcomm.manifest import onnx_io

        job = self.jobs[job_id]
        src_model = self.models[job["model_id"]]
        work = self.root / job_id
        work.mkdir()
        try:
            onnx_path = self._extract(src_model, work / "src")
            why = _specs_mismatch(job.get("input_specs") or {}, onnx_io(onnx_path)["inputs"])
            if why:
                raise RuntimeError(why)
            dev, soc = self._soc_of(job["device"])
            graph = _graph_name(job["options"])
            tid = job["target"]
            if _runtime(job["options"]) == "qnn_dlc":  # the fake "DLC": the uploaded ONNX, named (module docstring)
                io_ = onnx_io(onnx_path)
                graph = graph or re.sub(r"\W", "_", Path(src_model["name"]).stem) or "graph"
                sdk = _qairt(job["options"]) or ep.qnn_version()
                self.models[tid] = {"name": f"{job['name']}.dlc", "model_type": pb.MODEL_TYPE_QNN_DLC,
                                    "data": src_model["data"], "is_directory": False, "graph": graph,
                                    "inputs": [{**t, "graph": graph} for t in io_["inputs"]],
                                    "outputs": [{**t, "graph": graph} for t in io_["outputs"]], "producer": job_id,
                                    "meta": {pb.MODEL_METADATA_KEY_QNN_SDK_VERSION: sdk,
                                             pb.MODEL_METADATA_KEY_QAIRT_SDK_VERSION: sdk,
                                             pb.MODEL_METADATA_KEY_QNN_MODEL_GRAPH_NAMES: graph}}
                job["result_state"] = pb.JOB_STATE_DONE
                return
            out = work / "out"
            out.mkdir()
            info = ep.compile_onnx(onnx_path, out, "hub", soc)
            binary = out / info["files"][1]
            if graph:  # --qnn_graph_name: the graph renamed in the binary and in the wrapper the fake runs
                new = _fit_name(graph, info["graphs"][0])
                _rename_graph(binary, out / info["files"][0], info["graphs"][0], new)
                info["graphs"] = [new]
            sdk = _qairt(job["options"]) or info["ep_sdk_version"].lstrip("v")
            self.models[tid] = {"name": f"{job['name']}.bin", "model_type": pb.MODEL_TYPE_QNN_CONTEXT_BINARY,
                                "data": binary.read_bytes(), "is_directory": False, "ctx": out / "hub_ctx.onnx",
                                "inputs": info["inputs"], "outputs": info["outputs"], "producer": job_id,
                                "meta": {pb.MODEL_METADATA_KEY_QNN_SDK_VERSION: sdk,
                                         pb.MODEL_METADATA_KEY_QAIRT_SDK_VERSION: sdk,
                                         pb.MODEL_METADATA_KEY_QNN_MODEL_GRAPH_NAMES: ",".join(info["graphs"]),
                                         pb.MODEL_METADATA_KEY_QNN_CONTEXT_BIN_SOC_MODEL: str(dev[3]),
                                         pb.MODEL_METADATA_KEY_QNN_CONTEXT_BIN_HEXAGON_VERSION: soc.arch.lstrip("v")}}
            job["result_state"] = pb.JOB_STATE_DONE
        except Exception as exc:  # a compile error is the job's failure reason, as on the hub
            job["result_state"] = pb.JOB_STATE_FAILED
            job["reason"] = " ".join(str(exc).split())[:300]

    def _link_contract(self, job: dict) -> str | None:
        """Why the hub would refuse these inputs (None: they are fine)."""
        ids = job["model_ids"]
        if not ids:
            return "A link job takes at least one input model."
        if len(set(ids)) != len(ids):
            return "All input models to a link job must be distinct."
        for mid in ids:
            m = self.models[mid]
            if m["model_type"] != pb.MODEL_TYPE_QNN_DLC:
                kind = pb.ModelType.Name(m["model_type"]).replace("MODEL_TYPE_", "")
                return (f"Input model {mid} ({m['name']}) is a {kind} model; link jobs take QNN DLC models"
                        " compiled through AI Hub (a compile job with --target_runtime qnn_dlc).")
            producer = self.jobs.get(m.get("producer") or "")
            if producer is None or producer["kind"] != "compile" or producer.get("result_state") != pb.JOB_STATE_DONE:
                return f"Input model {mid} ({m['name']}) was not produced by a successful AI Hub compile job."
            if producer["device"] != job["device"]:
                return (f"Input model {mid} was compiled for {producer['device']}, not {job['device']}; the input"
                        " models to a link job must target the same device.")
        graphs = [self.models[mid]["graph"] for mid in ids]
        if len(set(graphs)) != len(graphs):
            return f"Graph names must be unique across the input models of a link job, got {', '.join(graphs)}."
        return None

    def _link(self, job_id: str):
        """One context binary holding every input's graph, weights shared (see the module docstring)."""
        from vlmrun_qnn_htp import ep
        from vlmrun_qnn_htp.ep import compile_session as _compile_session
        from vlmrun_qualcomm.manifest import describe_ctx_onnx

        job = self.jobs[job_id]
        try:
            why = self._link_contract(job)
            if why:
                raise RuntimeError(why)
            dev, soc = self._soc_of(job["device"])
            work = self.root / job_id
            out = work / "out"
            out.mkdir(parents=True)
            models = [self.models[mid] for mid in job["model_ids"]]
            share = len(models) > 1
            wrappers = []
            for i, m in enumerate(models):
                onnx_path = self._extract(m, work / f"dlc{i}")
                wrapper = out / f"graph{i}_ctx.onnx"
                try:
                    _compile_session(onnx_path, wrapper, soc, share, stop=i == len(models) - 1)
                except Exception as exc:
                    raise RuntimeError(f"QNN could not link graph {m['graph']}: {ep._one_line(exc)}") from None
                wrappers.append(wrapper)
            infos = [describe_ctx_onnx(w) for w in wrappers]
            bins = sorted({b for info in infos for b in info["binaries"]})
            if len(bins) != 1:
                raise RuntimeError(f"linking produced {len(bins)} context binaries, expected one")
            binary = out / bins[0]
            names = []
            for m, info in zip(models, infos):
                new = _fit_name(m["graph"], info["graphs"][0])
                _rename_graph(binary, None, info["graphs"][0], new)
                names.append(new)
            sdk = _qairt(job["options"]) or infos[0]["ep_sdk_version"].lstrip("v")
            self.models[job["target"]] = {
                "name": f"{job['name']}.bin", "model_type": pb.MODEL_TYPE_QNN_CONTEXT_BINARY,
                "data": binary.read_bytes(), "is_directory": False, "producer": job_id,
                "inputs": [{**t, "graph": g} for g, info in zip(names, infos) for t in info["inputs"]],
                "outputs": [{**t, "graph": g} for g, info in zip(names, infos) for t in info["outputs"]],
                "meta": {pb.MODEL_METADATA_KEY_QNN_SDK_VERSION: sdk, pb.MODEL_METADATA_KEY_QAIRT_SDK_VERSION: sdk,
                         pb.MODEL_METADATA_KEY_QNN_MODEL_GRAPH_NAMES: ",".join(names),
                         pb.MODEL_METADATA_KEY_QNN_CONTEXT_BIN_SOC_MODEL: str(dev[3]),
                         pb.MODEL_METADATA_KEY_QNN_CONTEXT_BIN_HEXAGON_VERSION: soc.arch.lstrip("v")}}
            job["result_state"] = pb.JOB_STATE_DONE
        except Exception as exc:  # the reason a failed link job shows
            job["result_state"] = pb.JOB_STATE_FAILED
            job["reason"] = " ".join(str(exc).split())[:300]

    def _infer(self, job_id: str):
        import h5py
        from qai_hub.util.dataset_entries_converters import dataset_entries_to_h5, h5_to_dataset_entries
        from vlmrun_qnn_htp import ep
        from vlmrun_qualcomm import socs

        job = self.jobs[job_id]
        try:
            model = self.models[job["model_id"]]
            ctx = model.get("ctx")
            if ctx is None:
                raise RuntimeError("this fake hub only runs context binaries it compiled")
            dev = next(d for d in DEVICES if d[0] == job["device"])
            soc = next(s for s in socs.SOCS.values() if s.soc_model == dev[3])
            with h5py.File(io.BytesIO(self.datasets[job["dataset_id"]]["data"]), "r") as h5f:
                entries = h5_to_dataset_entries(h5f)
            sess = ep.HtpSession(ctx, soc, "fake hub")
            n = len(next(iter(entries.values())))
            outs: dict[str, list] = {name: [] for name in sess.outputs}
            t0 = time.perf_counter()
            for i in range(n):
                r = sess.run({k: np.asarray(v[i], dtype=sess.inputs[k][1]) for k, v in entries.items()})
                for k in sess.outputs:
                    outs[k].append(r[k])
            us = int((time.perf_counter() - t0) * 1e6 / max(n, 1))
            buf = io.BytesIO()
            with h5py.File(buf, "w") as h5f:
                dataset_entries_to_h5(outs, h5f)
            did = self.new_id("d")
            self.datasets[did] = {"name": "outputs.h5", "data": buf.getvalue()}
            job["output_dataset"] = did
            peak = sum(int(np.asarray(v[0]).nbytes) for v in outs.values()) + len(model["data"])
            job["profile"] = {"execution_time": us, "load_time": int(sess.load_s * 1e6), "peak_memory": peak}
            job["result_state"] = pb.JOB_STATE_DONE
        except Exception as exc:
            job["result_state"] = pb.JOB_STATE_FAILED
            job["reason"] = " ".join(str(exc).split())[:300]

    def dataset_summary(self, did: str) -> dict:
        """``samples`` (per input the same) and ``shapes`` (of the first sample) of an uploaded dataset."""
        import h5py
        from qai_hub.util.dataset_entries_converters import h5_to_dataset_entries

        if not did:
            return {"samples": 0, "shapes": {}}
        with h5py.File(io.BytesIO(self.datasets[did]["data"]), "r") as h5f:
            entries = h5_to_dataset_entries(h5f)
        return {"samples": len(next(iter(entries.values()))),
                "shapes": {k: tuple(np.asarray(v[0]).shape) for k, v in entries.items()}}

    def dataset_digest(self, did: str) -> str:
        """A digest of an uploaded dataset's arrays (input names, sample order, shapes, dtypes and values)."""
        import hashlib

        import h5py
        from qai_hub.util.dataset_entries_converters import h5_to_dataset_entries

        with h5py.File(io.BytesIO(self.datasets[did]["data"]), "r") as h5f:
            entries = h5_to_dataset_entries(h5f)
        h = hashlib.sha256()
        for name in sorted(entries):
            for a in entries[name]:
                a = np.ascontiguousarray(a)
                h.update(f"{name}|{a.dtype}|{a.shape}|".encode())
                h.update(a.tobytes())
        return h.hexdigest()

    def web_page(self, rel: str) -> str:
        """The plain-text page behind a job or model link (``<url>/web/jobs/<id>/``)."""
        parts = [p for p in rel.split("/") if p]
        with self.lock:
            if parts[1:2] == ["jobs"] and len(parts) > 2 and parts[2] in self.jobs:
                j = self.jobs[parts[2]]
                state = pb.JobState.Name(j.get("result_state", _WORKING[j["kind"]]))
                return (f"fake AI Hub {j['kind']} job {j['id']}: {state}\ndevice: {j['device']}\n"
                        f"options: {j.get('options', '')}\n" + (f"reason: {j['reason']}\n" if j.get("reason") else ""))
            if parts[1:2] == ["models"] and len(parts) > 2 and parts[2] in self.models:
                m = self.models[parts[2]]
                return f"fake AI Hub model {parts[2]}: {m['name']} ({len(m['data'])} bytes)\n"
        return f"fake AI Hub: no such page /{rel} (it forgets everything when it restarts)\n"

    # -- protobuf views --------------------------------------------------------------------------------------
    def model_pb(self, mid: str) -> pb.Model:
        m = self.models[mid]
        out = pb.Model(model_id=mid, name=m["name"], model_type=m["model_type"], file_upload_complete=True,
                       is_directory=m["is_directory"], producer_id=m.get("producer", ""))
        _ts(out.creation_time)
        for key, val in m.get("meta", {}).items():
            out.metadata.entries[key] = val
        for spec, lst in ((out.input_spec, m.get("inputs", [])), (out.output_spec, m.get("outputs", []))):
            for t in lst:
                nt = spec.types.add(name=t["name"])
                if t.get("graph"):
                    nt.graph_name = t["graph"]
                nt.tensor_type.shape.extend(int(d) for d in t["shape"])
                nt.tensor_type.dtype = DTYPES[t["dtype"]]
        return out

    def state_of(self, job: dict) -> int:
        job["polls"] += 1
        kind = job["kind"]
        held = kind == "link" and self.hold_links
        if self.never_finish or held or job.get("hold") or time.time() - job.get("created", 0) < self.job_seconds:
            return pb.JOB_STATE_PROVISIONING_DEVICE if kind == "inference" else _WORKING[kind]
        if job["polls"] == 1:
            return _WORKING[kind]
        if "result_state" not in job:
            {"compile": self._compile, "link": self._link, "inference": self._infer}[kind](job["id"])
        return job["result_state"]

    def job_pb(self, jid: str, poll: bool = True) -> pb.Job:
        job = self.jobs[jid]
        state = self.state_of(job) if poll else pb.JOB_STATE_CREATED
        dev = next(d for d in DEVICES if d[0] == job["device"])
        dev_pb = pb.Device(name=dev[0], os=dev[1], attributes=dev[2])
        if job["kind"] == "compile":
            cj = pb.CompileJob(compile_job_id=jid, job_state=state, name=job["name"], options=job["options"],
                               model=self.model_pb(job["model_id"]), device=dev_pb,
                               failure_reason=job.get("reason", "") if state == pb.JOB_STATE_FAILED else "")
            _ts(cj.creation_time)
            cj.tensor_type_list.ParseFromString(job.get("tensor_type_list", b""))  # the input specs it was given
            cj.target_model.CopyFrom(self.model_pb(job["target"]))  # seeded at creation, as the hub does
            return pb.Job(compile_job=cj, hub_version="fake")
        if job["kind"] == "link":
            lj = pb.LinkJob(link_job_id=jid, job_state=state, name=job["name"], options=job["options"], device=dev_pb,
                            failure_reason=job.get("reason", "") if state == pb.JOB_STATE_FAILED else "")
            lj.models.models.extend(self.model_pb(m) for m in job["model_ids"])
            lj.models.total_query_count = len(job["model_ids"])
            _ts(lj.creation_time)
            lj.target_model.CopyFrom(self.model_pb(job["target"]))  # seeded at creation (seed_target_model=true)
            return pb.Job(link_job=lj, hub_version="fake")
        ij = pb.InferenceJob(inference_job_id=jid, job_state=state, name=job["name"], device=dev_pb,
                             model=self.model_pb(job["model_id"]), is_profiling_on=job["profiling"],
                             failure_reason=job.get("reason", "") if state == pb.JOB_STATE_FAILED else "")
        ij.dataset.dataset_id = job["dataset_id"]
        _ts(ij.creation_time)
        return pb.Job(inference_job=ij, hub_version="fake")

    # -- HTTP -------------------------------------------------------------------------------------------------
    def _handler(self):
        hub = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *a):
                pass

            def _send(self, code=200, body=b"", ctype="application/x-protobuf", headers=None):
                if not isinstance(body, (bytes, bytearray)):
                    body = body.SerializeToString()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(body)

            def _body(self) -> bytes:
                if self.headers.get("Transfer-Encoding", "").lower() == "chunked":
                    chunks = []
                    while True:
                        size = int(self.rfile.readline().strip() or b"0", 16)
                        if size == 0:
                            self.rfile.readline()
                            break
                        chunks.append(self.rfile.read(size))
                        self.rfile.readline()
                    return b"".join(chunks)
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _fault(self, method: str, path: str) -> bool:
                label = f"{method} {path}"
                with hub.lock:
                    for table, kind in ((hub.drops, "drop"), (hub.errors, "error")):
                        for prefix, n in list(table.items()):
                            if n > 0 and label.startswith(prefix):
                                table[prefix] = n - 1
                                if kind == "drop":
                                    self.close_connection = True
                                    try:
                                        self.connection.shutdown(2)
                                    except OSError:
                                        pass
                                    return True
                                self._send(500, b"Internal Server Error", "text/plain")
                                return True
                return False

            def handle_one(self, method: str):
                u = urlparse(self.path)
                q = parse_qs(u.query)
                body = self._body()
                auth = self.headers.get("Authorization", "")
                if auth.startswith("token "):
                    hub.seen_tokens.add(auth[6:])
                path = u.path
                api = path.startswith("/api/v1/")
                rel = path[len("/api/v1/"):] if api else path
                hub.log.append((method, rel))
                delay = next((t for prefix, t in list(hub.slow.items()) if f"{method} {rel}".startswith(prefix)), 0)
                if delay:
                    time.sleep(delay)
                if self._fault(method, rel):
                    return
                if method == "GET" and rel.startswith("web/"):
                    return self._send(200, hub.web_page(rel).encode(), "text/plain; charset=utf-8")
                if api and auth != f"token {hub.token}":
                    return self._send(401, b'{"detail": "bad token"}', "application/json")
                try:
                    self.route(method, rel, q, body)
                except KeyError as exc:
                    self._send(404, f"not found: {exc}".encode(), "text/plain")
                except Exception as exc:  # a bug here must not look like a network fault
                    self._send(500, f"fake hub error: {type(exc).__name__}: {exc}".encode(), "text/plain")
                    raise

            def route(self, method, rel, q, body):
                parts = [p for p in rel.split("/") if p]
                with hub.lock:
                    # -- uploads and downloads (plain URLs handed out by the API) --
                    if parts[:2] == ["upload", "models"] and method == "PUT":
                        hub.models[parts[2]]["data"] = body
                        return self._send(200, b"", "text/plain", {"ETag": '"etag-0"'})
                    if parts[:2] == ["upload", "datasets"] and method == "POST":
                        from requests_toolbelt.multipart.decoder import MultipartDecoder

                        dec = MultipartDecoder(body, self.headers["Content-Type"])
                        for part in dec.parts:
                            if b'name="file"' in part.headers.get(b"Content-Disposition", b""):
                                hub.datasets[parts[2]]["data"] = part.content
                        return self._send(204, b"", "text/plain")
                    if parts[:1] == ["files"] and method == "GET":
                        fpath = hub.files[parts[1]]
                        return self._send(200, fpath, "application/octet-stream")
                    # -- API --
                    if parts == ["models"] and method == "POST":
                        m = pb.Model()
                        m.ParseFromString(body)
                        mid = hub.new_id("m")
                        hub.models[mid] = {"name": m.name, "model_type": m.model_type, "data": b"",
                                           "is_directory": m.is_directory}
                        return self._send(200, pb.CreateUpdateResponse(id=mid))
                    if parts[0] == "models" and len(parts) == 3 and parts[2] == "multipart_upload":
                        mid = parts[1]
                        if method == "GET":
                            hub.models[mid]
                            r = pb.FileUploadResponse()
                            r.multipart_url.urls.append(f"{hub.url}/upload/models/{mid}/0")
                            r.multipart_url.upload_id = "up-" + mid
                            r.multipart_url.max_part_size = 1 << 34
                            return self._send(200, r)
                        c = pb.FileMultipartUploadComplete()
                        c.ParseFromString(body)
                        return self._send(200, pb.CreateUpdateResponse(id=mid))
                    if parts[0] == "models" and len(parts) == 2 and method == "GET":
                        return self._send(200, hub.model_pb(parts[1]))
                    if parts[0] == "models" and len(parts) == 3 and parts[2] == "download":
                        m = hub.models[parts[1]]
                        fid = hub.new_id("f")
                        hub.files[fid] = m["data"]
                        name = hub.download_name or m["name"]
                        r = pb.FileDownloadResponse()
                        r.url.url, r.url.filename = f"{hub.url}/files/{fid}", name
                        return self._send(200, r)
                    if parts == ["devices"]:
                        name = (q.get("name") or [""])[0]
                        attrs = q.get("attributes") or []
                        found = [d for d in DEVICES if (not name or d[0] == name) and all(a in d[2] for a in attrs)]
                        if (q.get("select") or ["False"])[0] == "True":
                            found = found[:1]
                        dl = pb.DeviceList(devices=[pb.Device(name=d[0], os=d[1], attributes=d[2]) for d in found])
                        return self._send(200, dl)
                    if parts == ["jobs"] and method == "POST":
                        j = pb.Job()
                        j.ParseFromString(body)
                        jid = hub.new_id("j")
                        created = time.time()
                        if j.HasField("compile_job"):
                            cj = j.compile_job
                            dev = cj.devices.devices[0].name if cj.devices.devices else cj.device.name
                            hub.models[cj.model.model_id]  # an unknown model is a 404, as on the hub
                            hub.compile_options.append(cj.options)
                            hub.jobs[jid] = {"id": jid, "kind": "compile", "model_id": cj.model.model_id,
                                             "device": dev, "options": cj.options, "name": cj.name, "polls": 0,
                                             "created": created,
                                             "calibration": cj.calibration_dataset.dataset_id or None,
                                             "input_specs": _input_specs(cj.tensor_type_list),
                                             "tensor_type_list": cj.tensor_type_list.SerializeToString()}
                            tid = hub.new_id("m")
                            dlc = _runtime(cj.options) == "qnn_dlc"
                            hub.models[tid] = {"name": f"{cj.name}.{'dlc' if dlc else 'bin'}", "data": b"",
                                               "is_directory": False, "producer": jid,
                                               "model_type": pb.MODEL_TYPE_QNN_DLC if dlc
                                               else pb.MODEL_TYPE_QNN_CONTEXT_BINARY}
                            hub.jobs[jid]["target"] = tid
                            if hub.fail_compile:
                                hub.jobs[jid].update(result_state=pb.JOB_STATE_FAILED, reason=hub.fail_compile)
                                hub.fail_compile = None
                        elif j.HasField("link_job"):
                            lj = j.link_job
                            ids = [m.model_id for m in lj.models.models]
                            for mid in ids:
                                hub.models[mid]  # an unknown model is a 404, as on the hub
                            dev = lj.device.name
                            hub.jobs[jid] = {"id": jid, "kind": "link", "model_ids": ids, "device": dev,
                                             "options": lj.options, "name": lj.name, "polls": 0, "created": created}
                            tid = hub.new_id("m")
                            hub.models[tid] = {"name": f"{lj.name}.bin", "data": b"", "is_directory": False,
                                               "model_type": pb.MODEL_TYPE_QNN_CONTEXT_BINARY, "producer": jid}
                            hub.jobs[jid]["target"] = tid
                            hub.link_jobs.append({"id": jid, "model_ids": ids, "device": dev, "options": lj.options})
                            if hub.fail_link:
                                hub.jobs[jid].update(result_state=pb.JOB_STATE_FAILED, reason=hub.fail_link)
                                hub.fail_link = None
                        else:
                            ij = j.inference_job
                            hub.models[ij.model.model_id]
                            hub.inference_options.append(ij.options)
                            hub.jobs[jid] = {"id": jid, "kind": "inference", "model_id": ij.model.model_id,
                                             "device": ij.device.name, "dataset_id": ij.dataset.dataset_id,
                                             "profiling": ij.is_profiling_on, "name": ij.name, "polls": 0,
                                             "created": created}
                            hub.inference_jobs.append({"id": jid, "name": ij.name,
                                                       **hub.dataset_summary(ij.dataset.dataset_id)})
                            if hub.fail_inference:
                                hub.jobs[jid].update(result_state=pb.JOB_STATE_FAILED, reason=hub.fail_inference)
                                hub.fail_inference = None
                        r = pb.CreateUpdateResponse(id=jid)
                        _ts(r.creation_time)
                        return self._send(200, r)
                    if parts[0] == "jobs" and len(parts) == 2 and method == "GET":
                        return self._send(200, hub.job_pb(parts[1]))
                    if parts[0] == "jobs" and len(parts) == 3 and parts[2] == "result":
                        job = hub.jobs[parts[1]]
                        r = pb.JobResult()
                        r.inference_job_result.inference_job_id = parts[1]
                        r.inference_job_result.output_dataset_id = job.get("output_dataset", "")
                        p = job.get("profile")
                        if p:
                            d = r.inference_job_result.detail
                            d.major_version, d.minor_version = 1, 2
                            d.execution_time, d.cold_load_time = p["execution_time"], p["load_time"]
                            d.warm_load_time = p["load_time"]
                            d.after_execution_peak_memory = p["peak_memory"]
                            d.after_cold_load_peak_memory = d.after_warm_load_peak_memory = p["peak_memory"]
                            d.all_execution_times.append(p["execution_time"])
                        return self._send(200, r)
                    if parts == ["datasets"] and method == "POST":
                        d = pb.Dataset()
                        d.ParseFromString(body)
                        did = hub.new_id("d")
                        hub.datasets[did] = {"name": d.name, "data": b""}
                        r = pb.CreateUpdateResponse(id=did)
                        _ts(r.creation_time)
                        _ts(r.expiration_time, time.time() + 86400)
                        return self._send(200, r)
                    if parts[0] == "datasets" and len(parts) == 3 and parts[2] == "upload_url":
                        size = int((q.get("file_size") or ["0"])[0])
                        if hub.max_dataset_bytes is not None and size > hub.max_dataset_bytes:
                            return self._send(413, f"Dataset of {size} bytes exceeds the limit of"
                                                   f" {hub.max_dataset_bytes} bytes.".encode(), "text/plain")
                        r = pb.FileUploadResponse()
                        r.url.url, r.url.file_field_name = f"{hub.url}/upload/datasets/{parts[1]}", "file"
                        return self._send(200, r)
                    if parts[0] == "datasets" and len(parts) == 2:
                        ds = hub.datasets[parts[1]]
                        if method == "PATCH":
                            return self._send(200, pb.CreateUpdateResponse(id=parts[1]))
                        d = pb.Dataset(dataset_id=parts[1], name=ds["name"], file_upload_complete=True)
                        _ts(d.creation_time)
                        _ts(d.expiration_time, time.time() + 86400)
                        return self._send(200, d)
                    if parts[0] == "datasets" and len(parts) == 3 and parts[2] == "download_data":
                        fid = hub.new_id("f")
                        hub.files[fid] = hub.datasets[parts[1]]["data"]
                        r = pb.FileDownloadResponse()
                        r.url.url, r.url.filename = f"{hub.url}/files/{fid}", "outputs.h5"
                        return self._send(200, r)
                raise KeyError(f"{method} {rel}")

            def do_GET(self):
                self.handle_one("GET")

            def do_POST(self):
                self.handle_one("POST")

            def do_PUT(self):
                self.handle_one("PUT")

            def do_PATCH(self):
                self.handle_one("PATCH")

        return Handler


def main(argv=None) -> int:
    """Run a fake hub by hand: ``scripts/fake-hub [--port N] [--ini PATH] [--slow SECONDS]``."""
    ap = argparse.ArgumentParser(
        prog="fake-hub", description="A local stand-in for Qualcomm AI Hub (127.0.0.1) that the real qai-hub client"
        " talks to: compiles on the HTP emulator (onnxruntime-qnn), runs inference jobs there. For trying"
        " `--compiler qaihub` and `--vision qaihub` without an account.")
    ap.add_argument("--port", type=int, default=0, help="port to listen on (default: a free one)")
    ap.add_argument("--token", default=None, help="API token it accepts (default: a random one)")
    ap.add_argument("--ini", type=Path, default=None,
                    help="client.ini to write for the qai-hub client (default: <temp dir>/client.ini)")
    ap.add_argument("--slow", type=float, default=0.0, help="answer every API request after this many seconds")
    ap.add_argument("--job-seconds", type=float, default=0.0,
                    help="keep every job in progress at least this long (to try Ctrl-C and re-attaching)")
    args = ap.parse_args(argv)
    token = args.token or "fakehub-" + secrets.token_hex(12)
    hub = FakeHub(token, args.port)
    if args.slow:
        hub.slow = {"": args.slow}
    hub.job_seconds = args.job_seconds
    ini = write_client_ini(args.ini or hub.root / "client.ini", token, hub.url)
    hub.start()
    restart = threading.Event()
    if hasattr(signal, "SIGUSR1"):
        signal.signal(signal.SIGUSR1, lambda *_: restart.set())

    def interrupt(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    signal.signal(signal.SIGINT, interrupt)  # also when started in the background (which ignores SIGINT)
    print(f"fake AI Hub listening on {hub.url} (pid {os.getpid()})\n"
          f"  export QAIHUB_CLIENT_INI={ini} NO_PROXY=127.0.0.1 no_proxy=127.0.0.1\n"
          "  vlmrun compile --compiler qaihub --backend qnn_htp --stage vision --image-size 256\n"
          "  vlmrun --vision qaihub --image-size 256 --image photo.jpg --prompt 'Describe the image.'\n"
          "  vlmrun doctor\n"
          "Jobs are polled every 10 s by the client. Ctrl-C (or kill <pid>) stops it; `kill -USR1 <pid>` restarts it"
          " without its jobs and models (as if the hub had forgotten them).", flush=True)
    try:
        while True:
            if restart.wait(0.5):
                restart.clear()
                hub.restart(forget=True)
                print("fake AI Hub restarted: every job, model and dataset forgotten", flush=True)
    except KeyboardInterrupt:
        pass
    finally:
        hub.stop()
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
