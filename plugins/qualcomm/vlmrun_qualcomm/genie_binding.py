"""`libGenie.so` through ctypes (the API of `GenieDialog.h` / `GenieProfile.h`): `GenieLibrary` loads it and checks
dialog configs, `GenieDialog` runs one dialog's queries (prompt embeddings in, tokens or text out, each generated
token embedded from the LUT by a callback) and reads its profile. Genie's status codes and the capture of what
native code prints are here too; the pipeline API is in `genie_pipeline`.

No runtime is imported here: the caller names the `libGenie.so` to load (`onnxruntime-qnn` ships one; the QAIRT
SDK has one per target). Next to onnxruntime-qnn, load it in a worker process (`genie_worker`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import numpy as np

from vlmrun.errors import BackendError

from . import emulator
from .genie import ContextLimitError, last_error_line

# Genie status codes (GenieCommon.h)
STATUS = {
    0: "SUCCESS",
    1: "WARNING_ABORTED",
    2: "WARNING_BOUND_HANDLE",
    3: "WARNING_CONTEXT_EXCEEDED",
    -1: "ERROR_GENERAL",
    -2: "ERROR_INVALID_ARGUMENT",
    -3: "ERROR_MEM_ALLOC",
    -4: "ERROR_INVALID_CONFIG",
    -5: "ERROR_INVALID_HANDLE",
    -6: "ERROR_QUERY_FAILED",
    -7: "ERROR_JSON_FORMAT",
    -8: "ERROR_JSON_SCHEMA",
    -9: "ERROR_JSON_VALUE",
    -10: "ERROR_GENERATE_FAILED",
    -11: "ERROR_GET_HANDLE_FAILED",
    -12: "ERROR_APPLY_CONFIG_FAILED",
    -13: "ERROR_SET_PARAMS_FAILED",
    -14: "ERROR_BOUND_HANDLE",
}
HINTS = {
    -4: "a key or value of the dialog config is invalid",
    -7: "the dialog config is not valid JSON",
    -8: "the dialog config does not follow Genie's schema (a missing or unknown key)",
    -9: "a value in the dialog config is out of range or of the wrong type",
}
SENTENCE_COMPLETE, SENTENCE_BEGIN, SENTENCE_CONTINUE, SENTENCE_END, SENTENCE_ABORT = 0, 1, 2, 3, 4


def status_name(code: int) -> str:
    return f"GENIE_STATUS_{STATUS.get(int(code), 'UNKNOWN')} ({int(code)})"


# -- libGenie via ctypes ------------------------------------------------------------------------------------
QueryCB = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p)
T2ECB = ctypes.CFUNCTYPE(None, ctypes.c_int32, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p)
TokenCB = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_uint32), ctypes.c_uint32, ctypes.c_int, ctypes.c_void_p)
AllocCB = ctypes.CFUNCTYPE(None, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p))


@contextlib.contextmanager
def capture_fd(fd: int, into: list, echo_to: int | None = None):
    """Capture what native code writes to `fd` (e.g. Genie's errors on stderr, QNN's banner on stdout)."""
    import tempfile

    if fd == 1:
        sys.stdout.flush()
    else:
        sys.stderr.flush()
    saved = os.dup(fd)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), fd)
        try:
            yield
        finally:
            os.dup2(saved, fd)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode("utf-8", "replace")
            into.append(text)
            if echo_to is not None and text and os.environ.get("VLMRUN_GENIE_LOG"):
                os.write(echo_to, text.encode())


def alloc_callback() -> tuple[object, list]:
    """A `Genie_AllocCallback_t` (Genie asks the client for `size` bytes and copies its JSON result into them)
    and the list that keeps its buffers alive: hold both until the result is read."""
    buffers: list = []

    def alloc(size, out):
        buf = ctypes.create_string_buffer(int(size))
        buffers.append(buf)
        out[0] = ctypes.cast(buf, ctypes.c_void_p).value

    return AllocCB(alloc), buffers


class GenieLibrary:
    """`libGenie.so` loaded with ctypes (the API of GenieDialog.h / GenieProfile.h)."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        if not Path(self.path).is_file():
            raise BackendError(f"libGenie.so not found at {self.path}")
        emulator.route_pow(Path(self.path).parent)  # the HTP backend libGenie loads from its own folder
        try:
            self.lib = lib = ctypes.CDLL(self.path)
        except OSError as exc:
            raise BackendError(f"cannot load {self.path}: {exc}") from None
        vp, u32, i32 = ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int32
        sig = {
            "Genie_getApiMajorVersion": ([], u32),
            "Genie_getApiMinorVersion": ([], u32),
            "Genie_getApiPatchVersion": ([], u32),
            "GenieDialogConfig_createFromJson": ([ctypes.c_char_p, ctypes.POINTER(vp)], i32),
            "GenieDialogConfig_free": ([vp], i32),
            "GenieDialogConfig_bindProfiler": ([vp, vp], i32),
            "GenieDialog_create": ([vp, ctypes.POINTER(vp)], i32),
            "GenieDialog_free": ([vp], i32),
            "GenieDialog_embeddingQuery": ([vp, vp, u32, ctypes.c_int, T2ECB, QueryCB, vp], i32),
            "GenieDialog_embeddingTokenQuery": ([vp, vp, u32, ctypes.c_int, T2ECB, TokenCB, vp], i32),
            "GenieDialog_tokenQuery": ([vp, ctypes.POINTER(u32), u32, ctypes.c_int, TokenCB, vp], i32),
            "GenieDialog_query": ([vp, ctypes.c_char_p, ctypes.c_int, QueryCB, vp], i32),
            "GenieDialog_reset": ([vp], i32),
            "GenieProfile_create": ([vp, ctypes.POINTER(vp)], i32),
            "GenieProfile_free": ([vp], i32),
            "GenieProfile_getJsonData": ([vp, AllocCB, ctypes.POINTER(vp)], i32),
        }
        for name, (args, res) in sig.items():
            fn = getattr(lib, name, None)
            if fn is None:
                continue
            fn.argtypes, fn.restype = args, res
        self.has = {name for name in sig if getattr(lib, name, None) is not None}

    @property
    def api_version(self) -> str:
        lib = self.lib
        return f"{lib.Genie_getApiMajorVersion()}.{lib.Genie_getApiMinorVersion()}.{lib.Genie_getApiPatchVersion()}"

    def check(self, status: int, what: str, detail: str = "") -> None:
        if int(status) in (0, 1, 3):  # success, aborted, context exceeded (a stop, not a fault)
            return
        hint = HINTS.get(int(status), "")
        extra = "; ".join(x for x in (hint, detail) if x)
        raise BackendError(f"Genie {what} failed: {status_name(status)}" + (f": {extra}" if extra else ""))

    def validate_config(self, config: Mapping | str) -> None:
        """Parse a dialog config with the real `GenieDialogConfig_createFromJson` (BackendError if rejected)."""
        text = config if isinstance(config, str) else json.dumps(config)
        handle = ctypes.c_void_p()
        err: list[str] = []
        with capture_fd(2, err, 2):
            status = self.lib.GenieDialogConfig_createFromJson(text.encode(), ctypes.byref(handle))
        self.check(status, "GenieDialogConfig_createFromJson", last_error_line("".join(err)))
        self.lib.GenieDialogConfig_free(handle)

    def dialog(self, config: Mapping | str, profile: bool = True) -> "GenieDialog":
        return GenieDialog(self, config, profile)


def check_query_status(genie: GenieLibrary, status: int, what: str) -> None:
    """A query's status: the context limit (`GENIE_STATUS_WARNING_CONTEXT_EXCEEDED`, which genie-t2t-run turns
    into exit 1) is a `ContextLimitError`, as on the genie-t2t-run path; other failures as `check`."""
    if int(status) == 3:
        raise ContextLimitError(f"Genie {what} stopped at the context limit ({status_name(status)}); raise the"
                                " decoder's context_length or lower --max-new-tokens")
    genie.check(status, what)


class GenieDialog:
    """One Genie dialog (config + dialog + optional profile handle). Close it (or use `with`)."""

    def __init__(self, genie: GenieLibrary, config: Mapping | str, profile: bool = True):
        self.genie, lib = genie, genie.lib
        text = config if isinstance(config, str) else json.dumps(config)
        self.config = json.loads(text)
        self._cfg, self._dlg, self._prof = ctypes.c_void_p(), ctypes.c_void_p(), ctypes.c_void_p()
        self._keep: list = []
        self._t2e_errors: list[int] = []
        err: list[str] = []
        t0 = time.perf_counter()
        try:
            with capture_fd(2, err, 2), capture_fd(1, [], None):  # QNN prints a banner on stdout
                st = lib.GenieDialogConfig_createFromJson(text.encode(), ctypes.byref(self._cfg))
                genie.check(st, "GenieDialogConfig_createFromJson", "")
                if profile and "GenieProfile_create" in genie.has:
                    genie.check(lib.GenieProfile_create(None, ctypes.byref(self._prof)), "GenieProfile_create")
                    genie.check(lib.GenieDialogConfig_bindProfiler(self._cfg, self._prof), "bindProfiler")
                st = lib.GenieDialog_create(self._cfg, ctypes.byref(self._dlg))
                if st != 0:
                    self._dlg = ctypes.c_void_p()
        except BackendError as exc:
            self.close()
            detail = last_error_line("".join(err))
            raise BackendError(f"{exc}" + (f": {detail}" if detail and detail not in str(exc) else "")) from None
        if st != 0:
            self.close()
            genie.check(st, "GenieDialog_create", last_error_line("".join(err)))
        self.create_s = time.perf_counter() - t0

    def close(self):
        lib = self.genie.lib
        if self._dlg:
            lib.GenieDialog_free(self._dlg)
            self._dlg = ctypes.c_void_p()
        if self._cfg:
            lib.GenieDialogConfig_free(self._cfg)
            self._cfg = ctypes.c_void_p()
        if self._prof:
            lib.GenieProfile_free(self._prof)
            self._prof = ctypes.c_void_p()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()

    def reset(self):
        if self._dlg and "GenieDialog_reset" in self.genie.has:
            self.genie.check(self.genie.lib.GenieDialog_reset(self._dlg), "GenieDialog_reset")

    def profile(self) -> dict:
        """The profile JSON Genie collected so far ({} without a profile handle)."""
        if not self._prof:
            return {}
        cb, _buffers = alloc_callback()
        data = ctypes.c_void_p()
        self.genie.check(self.genie.lib.GenieProfile_getJsonData(self._prof, cb, ctypes.byref(data)), "profile")
        return json.loads(ctypes.string_at(data.value).decode("utf-8", "replace")) if data.value else {}

    # -- queries -----------------------------------------------------------------------------------------
    def _t2e(self, lut, seen: list):
        """The token-to-embedding callback over `lut`: a [V,H] float32 array, or a function ids -> [1,n,H]."""

        def row(token):
            if callable(lut):
                return np.ascontiguousarray(np.asarray(lut(np.array([token], np.int64)), np.float32).reshape(-1))
            return lut[token] if 0 <= token < lut.shape[0] else None

        def t2e(token, dst, size, _user):
            seen.append(int(token))
            try:
                r = row(int(token))
            except Exception:  # never raise through C
                r = None
            if r is None or r.nbytes != size:
                ctypes.memset(dst, 0, size)
                self._t2e_errors.append(int(token))
                return
            ctypes.memmove(dst, r.ctypes.data, size)

        return T2ECB(t2e)

    def _prep(self, embeds, lut, hidden: int | None):
        hidden = int(hidden or (lut.shape[1] if not callable(lut) else np.asarray(embeds).shape[-1]))
        emb = np.ascontiguousarray(np.asarray(embeds, np.float32).reshape(-1, hidden))
        if not callable(lut):
            lut = np.ascontiguousarray(lut, dtype=np.float32)
        self._t2e_errors = []
        return emb, lut

    def stream_tokens(self, embeds: np.ndarray, lut, hidden: int | None = None) -> Iterator[int]:
        """`GenieDialog_embeddingTokenQuery`: prompt embeddings [N,H] (spliced), the LUT [V,H] (or a function
        ids -> [1,n,H]) for the token-to-embedding callback; yields generated token ids as Genie produces them."""
        emb, lut = self._prep(embeds, lut, hidden)
        q: queue.Queue = queue.Queue()
        done = object()
        seen: list[int] = []

        def on_tokens(ptr, n, code, _user):
            for i in range(int(n)):
                q.put(int(ptr[i]))

        cbs = (self._t2e(lut, seen), TokenCB(on_tokens))

        def run():
            try:
                st = self.genie.lib.GenieDialog_embeddingTokenQuery(
                    self._dlg, emb.ctypes.data, emb.nbytes, SENTENCE_COMPLETE, cbs[0], cbs[1], None)
                q.put(("status", st))
            except BaseException as exc:  # pragma: no cover - ctypes errors
                q.put(("exc", exc))
            q.put(done)

        return self._drain(run, q, done, "GenieDialog_embeddingTokenQuery", cbs, emb)

    def stream_text(self, embeds: np.ndarray, lut, hidden: int | None = None) -> Iterator[str]:
        """`GenieDialog_embeddingQuery` (text output, what genie-t2t-run's default mode uses)."""
        emb, lut = self._prep(embeds, lut, hidden)
        q: queue.Queue = queue.Queue()
        done = object()
        seen: list[int] = []

        def on_text(text, code, _user):
            if text:
                q.put(text.decode("utf-8", "replace"))

        cbs = (self._t2e(lut, seen), QueryCB(on_text))

        def run():
            st = self.genie.lib.GenieDialog_embeddingQuery(
                self._dlg, emb.ctypes.data, emb.nbytes, SENTENCE_COMPLETE, cbs[0], cbs[1], None)
            q.put(("status", st))
            q.put(done)

        return self._drain(run, q, done, "GenieDialog_embeddingQuery", cbs, emb)

    def token_query(self, tokens: Sequence[int]) -> list[int]:
        """`GenieDialog_tokenQuery`: prompt token ids in, generated token ids out (blocking)."""
        arr = (ctypes.c_uint32 * len(tokens))(*[int(t) for t in tokens])
        out: list[int] = []

        def on_tokens(ptr, n, code, _user):
            out.extend(int(ptr[i]) for i in range(int(n)))

        cb = TokenCB(on_tokens)
        st = self.genie.lib.GenieDialog_tokenQuery(self._dlg, arr, len(tokens), SENTENCE_COMPLETE, cb, None)
        check_query_status(self.genie, st, "GenieDialog_tokenQuery")
        return out

    def _drain(self, run, q, done, what, keep, emb):
        if not self._dlg:
            raise BackendError("the Genie dialog is closed")
        worker = threading.Thread(target=run, name="genie-query", daemon=True)
        worker.start()
        status = 0
        try:
            while True:
                item = q.get()
                if item is done:
                    break
                if isinstance(item, tuple):
                    if item[0] == "exc":
                        raise BackendError(f"Genie {what} raised {item[1]}")
                    status = int(item[1])
                    continue
                yield item
        finally:
            worker.join()
            del keep, emb
        check_query_status(self.genie, status, what)
        if self._t2e_errors:
            raise BackendError(f"Genie asked for the embedding of token {self._t2e_errors[0]}, which the LUT"
                               " does not have (or of the wrong width)")
