"""Genie's pipeline API (``GeniePipeline.h`` / ``GenieNode.h`` in libGenie.so): a whole VLM in one runtime.

A VLM bundle is three nodes: an ``image-encoder`` (one context binary: pixels -> image embeddings at the
decoder's width), a ``text-encoder`` of type ``lut`` (text -> embeddings from a table) and a ``text-generator``
(the dialog config body under the key ``text-generator`` with an ``embedding`` LUT block, which embeds the
generated tokens). Both encoders are connected to the generator's embedding input; the prompt is spliced by call
order: every ``setData`` on a connected encoder appends its embeddings, so a FastVLM request is the chat template
up to the image (text), the image, the rest of the template (text), then ``execute``.

libGenie reports most failures through its log, not its status codes, and some not at all (the pitfalls of
``../shared/reference/genie-vlm-pipeline.md``): a float image input is dropped with status 0, a generator
without its LUT block stops after one token with status 0. So the worker here checks what it can see: the image
encoder's embeddings must come out of the node (its embedding callback), the run must produce text.

As for dialogs (`genie_worker`), libGenie runs in a worker process (``python -m vlmrun_qualcomm.genie_pipeline``)
that never loads onnxruntime; text pieces stream back one per line on a pipe.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import numpy as np

from vlmrun.errors import BackendError

from . import emulator
from .genie import CONTEXT_LIMIT, NOT_A_REASON, ContextLimitError, last_error_line
from .genie_binding import capture_fd, status_name
from .genie_sampler import LogitsRows, LogitsTap
from .genie_session import WorkerSession
from .genie_worker import WorkerLines
from .worker_protocol import Replies, pipeline_text, serve_commands

# GenieNode_IOName_t
TEXT_GENERATOR_TEXT_INPUT, TEXT_GENERATOR_EMBEDDING_INPUT, TEXT_GENERATOR_TEXT_OUTPUT = 0, 1, 2
TEXT_ENCODER_TEXT_INPUT, TEXT_ENCODER_EMBEDDING_OUTPUT = 100, 101
IMAGE_ENCODER_IMAGE_INPUT, IMAGE_ENCODER_EMBEDDING_OUTPUT = 200, 201
IO_NAMES = {
    "GENIE_NODE_TEXT_GENERATOR_EMBEDDING_INPUT": TEXT_GENERATOR_EMBEDDING_INPUT,
    "GENIE_NODE_TEXT_GENERATOR_TEXT_OUTPUT": TEXT_GENERATOR_TEXT_OUTPUT,
    "GENIE_NODE_TEXT_ENCODER_TEXT_INPUT": TEXT_ENCODER_TEXT_INPUT,
    "GENIE_NODE_TEXT_ENCODER_EMBEDDING_OUTPUT": TEXT_ENCODER_EMBEDDING_OUTPUT,
    "GENIE_NODE_IMAGE_ENCODER_IMAGE_INPUT": IMAGE_ENCODER_IMAGE_INPUT,
    "GENIE_NODE_IMAGE_ENCODER_EMBEDDING_OUTPUT": IMAGE_ENCODER_EMBEDDING_OUTPUT,
}
LOG_LEVEL_WARN = 2  # GenieLog_Level_t: ERROR 1, WARN 2, INFO 3, VERBOSE 4

TextCB = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p)
EmbeddingCB = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_uint32), ctypes.c_uint32, ctypes.c_size_t,
                               ctypes.c_void_p, ctypes.c_void_p)


class PipelineLibrary:
    """The pipeline half of ``libGenie.so`` (ctypes)."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        emulator.route_pow(Path(self.path).parent)  # the HTP backend libGenie loads from its own folder
        try:
            self.lib = lib = ctypes.CDLL(self.path)
        except OSError as exc:
            raise BackendError(f"cannot load {self.path}: {exc}") from None
        vp, i32 = ctypes.c_void_p, ctypes.c_int32
        sig = {
            "GenieNodeConfig_createFromJson": ([ctypes.c_char_p, ctypes.POINTER(vp)], i32),
            "GenieNodeConfig_free": ([vp], i32),
            "GenieNode_create": ([vp, ctypes.POINTER(vp)], i32),
            "GenieNode_free": ([vp], i32),
            "GenieNode_setTextCallback": ([vp, i32, TextCB], i32),
            "GenieNode_setEmbeddingCallback": ([vp, i32, EmbeddingCB], i32),
            "GenieNode_setData": ([vp, i32, vp, ctypes.c_size_t, ctypes.c_char_p], i32),
            "GeniePipelineConfig_createFromJson": ([ctypes.c_char_p, ctypes.POINTER(vp)], i32),
            "GeniePipelineConfig_free": ([vp], i32),
            "GeniePipeline_create": ([vp, ctypes.POINTER(vp)], i32),
            "GeniePipeline_addNode": ([vp, vp], i32),
            "GeniePipeline_connect": ([vp, vp, i32, vp, i32], i32),
            "GeniePipeline_execute": ([vp, vp], i32),
            "GeniePipeline_reset": ([vp], i32),
            "GeniePipeline_free": ([vp], i32),
            "GenieLog_create": ([vp, vp, i32, ctypes.POINTER(vp)], i32),
            "GenieLog_free": ([vp], i32),
            "GenieNodeConfig_bindLogger": ([vp, vp], i32),
            "GenieNodeConfig_bindProfiler": ([vp, vp], i32),
            "GenieProfile_create": ([vp, ctypes.POINTER(vp)], i32),
            "GenieProfile_free": ([vp], i32),
        }
        missing = [name for name in sig if getattr(lib, name, None) is None]
        if missing:
            raise BackendError(f"{self.path} has no Genie pipeline API ({', '.join(missing[:3])} missing); it needs"
                               " libGenie from QAIRT 2.34 or newer (onnxruntime-qnn 2.7.0 ships one)")
        for name, (args, res) in sig.items():
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = args, res

    def check(self, status: int, what: str, log: list[str]) -> None:
        """A failed call as a BackendError; the log's reason is added by `_with_reason` once the log is
        read (native output is captured until the block ends)."""
        if int(status) == 0:
            return
        detail = last_error_line("".join(log))
        raise BackendError(f"Genie {what} failed: {status_name(status)}" + (f": {detail}" if detail else ""))

    def parse_node_config(self, text: str, what: str) -> None:
        """Parse a node config with libGenie's own ``GenieNodeConfig_createFromJson`` (parse only: files are
        checked when a node is created)."""
        handle, log = ctypes.c_void_p(), []
        with capture_fd(2, log, 2), capture_fd(1, [], None):
            status = self.lib.GenieNodeConfig_createFromJson(text.encode(), ctypes.byref(handle))
        if status == 0:
            self.lib.GenieNodeConfig_free(handle)
        self.check(status, f"parse of {what}", log)


class PipelineRun:
    """A pipeline's nodes created and connected (``{node name: config JSON}``, ``connections``), ready to take inputs
    and execute; `close` frees them. The generator keeps its KV cache between executions until `reset`:
    a conversation's next turn is its new inputs and another `execute` (``genie-vlm-pipeline.md``,
    "Conversations").

    ``on_text(text, sentence_code)`` gets the generator's text, ``on_embedding(raw, dims)`` the image encoder's
    embeddings (raw bytes as uint8 and the dims)."""

    def __init__(self, lib: PipelineLibrary, nodes: Mapping[str, str], connections: Sequence[Sequence[str]],
                 on_text, on_embedding, log: list[str] | None = None):
        self.lib = lib
        self.log = [] if log is None else log  # a caller's log: it captures native output itself (no capture here)
        self._capture = log is None
        self.handles: dict[str, ctypes.c_void_p] = {}
        self.configs: list[ctypes.c_void_p] = []
        self.keep: list = []
        self.pcfg, self.pipe, self.logger = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()

        def text_cb(text, code, _user):
            on_text((text or b"").decode("utf-8", "replace"), int(code))
            return 0

        def emb_cb(dims, rank, size, buf, _user):
            shape = [int(dims[i]) for i in range(int(rank))]
            on_embedding(np.ctypeslib.as_array(ctypes.cast(buf, ctypes.POINTER(ctypes.c_uint8)), (int(size),)).copy(),
                         shape)

        try:
            with self._native():
                self._create(nodes, connections, text_cb, emb_cb)
        except BaseException:
            self.close()
            raise

    @contextlib.contextmanager
    def _native(self):
        """Genie's default logger and QNN's banner captured; a failure's reason (only in the log: every failure is
        status -1) added to its BackendError."""
        if not self._capture:
            yield
            return
        with _with_reason(self.log), capture_fd(2, self.log, 2), capture_fd(1, self.log, None):
            yield

    def _create(self, nodes, connections, text_cb, emb_cb) -> None:
        lib, L, log = self.lib, self.lib.lib, self.log
        lib.check(L.GenieLog_create(None, None, LOG_LEVEL_WARN, ctypes.byref(self.logger)), "GenieLog_create", log)
        lib.check(L.GeniePipelineConfig_createFromJson(b"{}", ctypes.byref(self.pcfg)), "pipeline config", log)
        lib.check(L.GeniePipeline_create(self.pcfg, ctypes.byref(self.pipe)), "GeniePipeline_create", log)
        for name, text in nodes.items():
            cfg = ctypes.c_void_p()
            lib.check(L.GenieNodeConfig_createFromJson(text.encode(), ctypes.byref(cfg)), f"{name} config", log)
            self.configs.append(cfg)
            lib.check(L.GenieNodeConfig_bindLogger(cfg, self.logger), f"bindLogger ({name})", log)
            if os.environ.get("VLMRUN_GENIE_PROFILE"):
                prof = ctypes.c_void_p()
                lib.check(L.GenieProfile_create(None, ctypes.byref(prof)), "GenieProfile_create", log)
                self.keep.append(prof)
                lib.check(L.GenieNodeConfig_bindProfiler(cfg, prof), f"bindProfiler ({name})", log)
            node = ctypes.c_void_p()
            lib.check(L.GenieNode_create(cfg, ctypes.byref(node)), f"GenieNode_create ({name})", log)
            self.handles[name] = node
            kind = next(iter(json.loads(text)), "")  # the config's root key names the node type
            if kind == "text-generator":
                cb = TextCB(text_cb)
                self.keep.append(cb)
                lib.check(L.GenieNode_setTextCallback(node, TEXT_GENERATOR_TEXT_OUTPUT, cb),
                          f"setTextCallback ({name})", log)
            if kind == "image-encoder":
                cb = EmbeddingCB(emb_cb)
                self.keep.append(cb)
                lib.check(L.GenieNode_setEmbeddingCallback(node, IMAGE_ENCODER_EMBEDDING_OUTPUT, cb),
                          f"setEmbeddingCallback ({name})", log)
            lib.check(L.GeniePipeline_addNode(self.pipe, node), f"GeniePipeline_addNode ({name})", log)
        for prod, pio, cons, cio in connections:
            lib.check(L.GeniePipeline_connect(self.pipe, self.handles[prod], IO_NAMES[pio], self.handles[cons],
                                              IO_NAMES[cio]), f"GeniePipeline_connect ({prod} -> {cons})", log)

    def run(self, inputs: Sequence[Sequence[str]]) -> None:
        """Set the ``inputs`` (``[node, kind, value]``: kind ``text`` with the text, ``image`` with a float32
        ``.raw`` path) in order, and execute."""
        lib, L, log = self.lib, self.lib.lib, self.log
        with self._native():
            for node, kind, value in inputs:
                if kind in ("text", "gtext"):
                    data = value.encode()
                    buf = ctypes.create_string_buffer(data)  # NUL-terminated: Genie reads the text as a C string
                    io = TEXT_ENCODER_TEXT_INPUT if kind == "text" else TEXT_GENERATOR_TEXT_INPUT
                else:
                    data = Path(value).read_bytes()
                    buf = ctypes.create_string_buffer(data, len(data))
                    io = IMAGE_ENCODER_IMAGE_INPUT
                self.keep.append(buf)  # Genie may read the buffer until execute: it must outlive the whole run
                lib.check(L.GenieNode_setData(self.handles[node], io, ctypes.cast(buf, ctypes.c_void_p), len(data),
                                              None), f"GenieNode_setData ({node}, {kind})", log)
            lib.check(L.GeniePipeline_execute(self.pipe, None), "GeniePipeline_execute", log)

    def reset(self) -> None:
        """Forget the conversation (the generator's KV cache)."""
        with self._native():
            self.lib.check(self.lib.lib.GeniePipeline_reset(self.pipe), "GeniePipeline_reset", self.log)

    def close(self) -> None:
        L = self.lib.lib
        for node in self.handles.values():
            L.GenieNode_free(node)
        for cfg in self.configs:
            L.GenieNodeConfig_free(cfg)
        if self.pipe:
            L.GeniePipeline_free(self.pipe)
        if self.pcfg:
            L.GeniePipelineConfig_free(self.pcfg)
        if self.logger:
            L.GenieLog_free(self.logger)
        self.handles, self.configs = {}, []
        self.pipe = self.pcfg = self.logger = None


def run_pipeline(lib: PipelineLibrary, nodes: Mapping[str, str], connections: Sequence[Sequence[str]],
                 inputs: Sequence[Sequence[str]], on_text, on_embedding) -> None:
    """One request: create the nodes (`PipelineRun`), set the ``inputs`` in order, execute, free; native
    output captured once around the whole request."""
    log: list[str] = []
    with _with_reason(log), capture_fd(2, log, 2), capture_fd(1, log, None):  # Genie's logger and QNN's banner
        run = PipelineRun(lib, nodes, connections, on_text, on_embedding, log)
        try:
            run.run(inputs)
        finally:
            run.close()


@contextlib.contextmanager
def _with_reason(log: list[str]):
    """A BackendError raised inside the block gets the log's reason (`_genie_reason`) appended; one whose log
    says the generator ran out of its context ("Context Size was exceeded.", which the pipeline reports as
    status UNKNOWN) is a `ContextLimitError`."""
    try:
        yield
    except BackendError as exc:
        text = "".join(log)
        if CONTEXT_LIMIT.search(text):
            raise ContextLimitError(f"{exc}: Context Size was exceeded.") from None
        reason = _genie_reason(text)
        if reason and reason not in str(exc):
            raise BackendError(f"{exc}: {reason}") from None
        raise


def _genie_reason(text: str) -> str:
    """The last ``[ ERROR ]`` line of Genie's default logger that is a reason (not the encoders' "does not support
    kpis method", logged on every run), else the last line that reads as an error."""
    errors = [ln.split("]", 1)[-1].strip() for ln in text.splitlines()
              if "[ ERROR ]" in ln and not NOT_A_REASON.search(ln)]
    if errors:
        return errors[-1][:300]
    return last_error_line(text)


# -- the worker process ---------------------------------------------------------------------------------------
def _worker(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vlmrun_qualcomm.genie_pipeline")
    ap.add_argument("--lib", required=True)
    ap.add_argument("--request", required=True, help="JSON: nodes, connections, inputs, embeddings_out")
    ap.add_argument("--session", action="store_true",
                    help="keep the pipeline: then read TURN {inputs, embeddings_out} / RESET lines on stdin until EOF")
    a = ap.parse_args(argv)
    out = Replies()
    req = json.loads(Path(a.request).read_text())
    embeds: list = []

    def on_embedding(raw, dims):
        # Genie calls this during the image's setData, and it must return at once: slow work here (file I/O) made
        # the next setData fail ("... does not support kpis method") or splice wrong, run to run
        embeds.append((raw, dims))

    def flush_embeddings():  # before the first text: the host has the image's embeddings with the first token
        if embeds and req.get("embeddings_out"):
            raw, dims = embeds.pop()
            embeds.clear()
            np.save(req["embeddings_out"], raw)
            out.write("EMBEDDINGS", json.dumps(dims))

    def on_text(text, code):
        flush_embeddings()
        out.write("TEXT", json.dumps([text, code]))

    if a.session:
        return _session(a.lib, req, out, embeds, flush_embeddings, on_text, on_embedding)
    try:
        lib = PipelineLibrary(a.lib)
        tap = None
        if req.get("logits"):  # the generator's sampler block names this callback (genie_sampler.py)
            t = req["logits"]
            tap = LogitsTap(lib.lib, out.out, t["rows"], t.get("forced") or (), t.get("vocab_limit"))
        run_pipeline(lib, req["nodes"], req["connections"], req["inputs"], on_text, on_embedding)
        flush_embeddings()
        if tap is not None:
            tap.close()
        out.write("DONE")
        return 0
    except BackendError as exc:
        return out.failed(exc)


def _session(lib_path: str, req: dict, out: Replies, embeds: list, flush_embeddings, on_text, on_embedding) -> int:
    """The worker of a `PipelineSession`: one pipeline for a whole conversation. ``READY`` once it is made;
    then per stdin line ``TURN {"inputs": [...], "embeddings_out": PATH}`` (those inputs, execute: the generator
    continues from its KV cache) or ``RESET``; each answered by ``DONE`` or ``ERROR reason``; EOF ends it."""
    try:
        run = PipelineRun(PipelineLibrary(lib_path), req["nodes"], req["connections"], on_text, on_embedding)
    except BackendError as exc:
        return out.failed(exc)

    def turn(rest: str) -> None:
        turn = json.loads(rest)
        req["embeddings_out"] = turn.get("embeddings_out")
        embeds.clear()
        run.run(turn["inputs"])
        flush_embeddings()

    out.write("READY")
    try:
        serve_commands(out, {"TURN": turn, "RESET": lambda _: run.reset()})
    finally:
        run.close()
    return 0


class PipelineSession(WorkerSession):
    """A Genie pipeline kept alive in its worker for a whole conversation (``--session``; the protocol of
    `.genie_session`): each `turn` sets that turn's inputs and executes, the generator continuing from the
    KV cache the earlier turns left; `reset` forgets them. A turn past ``timeout`` kills the worker (the
    conversation is then gone: `alive` is False)."""

    what = "the Genie pipeline worker"

    def __init__(self, lib_path: str | os.PathLike, request: Mapping, *, cwd: str | os.PathLike, timeout: float):
        tmp = Path(tempfile.mkdtemp(prefix="vlmrun-genie-session-"))
        req_path = tmp / "request.json"
        req_path.write_text(json.dumps(request))
        super().__init__([sys.executable, "-m", "vlmrun_qualcomm.genie_pipeline", "--lib", str(lib_path),
                          "--request", str(req_path), "--session"], timeout=timeout, cwd=cwd, tmp=tmp)

    def turn(self, inputs: Sequence[Sequence[str]], embeddings_out: str | None, result: dict) -> Iterator[str]:
        """This turn's inputs, executed on top of the kept state: its text pieces; ``result`` as
        `stream_pipeline`'s."""
        self.send("TURN " + json.dumps({"inputs": [list(i) for i in inputs], "embeddings_out": embeddings_out}))
        yield from pipeline_text(self.events(), result)


def stream_pipeline(lib_path: str | os.PathLike, request: Mapping, *, cwd: str | os.PathLike, timeout: float = 600.0,
                    result: dict | None = None, logits: LogitsRows | None = None) -> Iterator[str]:
    """Run ``request`` (see `_worker`) in a worker process whose working directory is ``cwd`` (the bundle:
    its configs name their files relative to it, as genie-app runs them on a phone); yield the generator's text
    pieces. ``result`` gets ``embeddings_dims`` when the image encoder's callback fired, and ``tokens``, the ids
    the custom sampler wrote, when ``request["logits"]`` taps the logits (each row to ``logits``)."""

    tmp = Path(tempfile.mkdtemp(prefix="vlmrun-genie-pipeline-"))
    req_path = tmp / "request.json"
    req_path.write_text(json.dumps(request))
    argv = [sys.executable, "-m", "vlmrun_qualcomm.genie_pipeline", "--lib", str(lib_path), "--request", str(req_path)]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"}
    run = WorkerLines(argv, timeout=timeout, what="the Genie pipeline worker", env=env, cwd=cwd)
    result = result if result is not None else {}
    try:
        yield from pipeline_text(run, result, logits)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    done, error, limit = result.pop("done", False), result.pop("error", None), result.pop("context_limit", False)
    if run.timed_out and not done:
        raise BackendError(f"the Genie pipeline timed out after {timeout:g} s (worker killed); raise --option"
                           f" timeout or check the bundle with vlmrun bundle --verify{run.hang_detail}")
    if error:
        raise (ContextLimitError if limit else BackendError)(error)
    if not done or run.returncode != 0:
        detail = last_error_line(run.stderr) or "no message"
        raise BackendError(f"the Genie pipeline worker exited with status {run.returncode}: {detail}")


if __name__ == "__main__":
    sys.exit(_worker())
