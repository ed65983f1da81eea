"""Per-step logits out of Genie itself, and teacher forcing through Genie: its custom sampler.

libGenie hands a *custom* sampler the full logits row of every step (``GenieSampler.h``)::

    Genie_Status_t GenieSampler_registerUserDataCallback(const char* name, GenieSampler_UserDataCallback_t cb,
                                                         const void* userData);
    typedef void (*GenieSampler_UserDataCallback_t)(const uint32_t logitsSize, const void* logits,
                                                    const uint32_t numTokens, int32_t* tokens,
                                                    const void* userData);

registered before the node or dialog is created, and named by the sampler block, which must be exactly
``{"version": 1, "type": "custom", "callback-name": NAME}`` (with ``temp``, ``top-k`` or ``top-p`` beside it the
node fails schema validation). ``logitsSize`` is in BYTES; the logits arrive as float32; the callback must write
``tokens[0..numTokens)`` itself (nothing is chosen for it; an id past the vocabulary gives "T2E conversion
overflow"). Checked on this machine with libGenie 1.21 (../shared/reference/genie-vlm-pipeline.md).

`LogitsTap` is the worker's side (it runs inside the process that loaded libGenie): each row is appended to
a float32 file and announced by one ``LOGITS k V TOKEN`` line of the worker protocol; the token written back is the
teacher's token ``k`` while there are teacher tokens, else the argmax below the vocabulary limit (greedy).
`LogitsRows` is the host's side: it reads row ``k`` when the line arrives and hands it to ``on_logits``.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from vlmrun.errors import BackendError

CALLBACK_NAME = "vlmrun-logits-tap"
SamplerCB = ctypes.CFUNCTYPE(None, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_uint32,
                             ctypes.POINTER(ctypes.c_int32), ctypes.c_void_p)


def custom_sampler_block(name: str = CALLBACK_NAME) -> dict:
    """The sampler block that hands every step's logits to the callback registered as ``name``."""
    return {"version": 1, "type": "custom", "callback-name": name}


class LogitsTap:
    """The custom sampler, in the worker: rows to ``rows_path`` (float32, appended), one ``LOGITS k V TOKEN`` line each on
    ``out``; the token chosen is ``forced[k]`` while ``k < len(forced)``, else the argmax of ``logits[:limit]``."""

    def __init__(self, lib: ctypes.CDLL, out, rows_path: str | os.PathLike, forced: Sequence[int] = (),
                 vocab_limit: int | None = None):
        fn = getattr(lib, "GenieSampler_registerUserDataCallback", None)
        if fn is None:
            raise BackendError("this libGenie has no GenieSampler_registerUserDataCallback (a custom sampler): per-step"
                               " logits out of Genie need libGenie from QAIRT 2.34 or newer")
        fn.argtypes, fn.restype = [ctypes.c_char_p, SamplerCB, ctypes.c_void_p], ctypes.c_int32
        self.out = out
        self.rows = open(rows_path, "wb")
        self.forced = [int(t) for t in forced]
        self.limit = None if vocab_limit is None else int(vocab_limit)
        self.steps = 0
        self.errors: list[str] = []
        self._cb = SamplerCB(self._call)  # kept alive as long as the tap
        status = fn(CALLBACK_NAME.encode(), self._cb, None)
        if status != 0:
            raise BackendError(f"GenieSampler_registerUserDataCallback failed with status {status}")

    def _call(self, size, logits, n, tokens, _user) -> None:
        try:  # never raise through C
            row = np.ctypeslib.as_array(ctypes.cast(logits, ctypes.POINTER(ctypes.c_float)), (int(size) // 4,))
            row = np.array(row, np.float32)
            self.rows.write(row.tobytes())
            self.rows.flush()
            k = self.steps
            self.steps += 1
            tok = self.forced[k] if k < len(self.forced) else int(np.argmax(row[: self.limit]))
            for i in range(int(n)):
                tokens[i] = tok
            self.out.write(f"LOGITS {k} {row.size} {tok}\n")
        except Exception as exc:  # noqa: BLE001 - reported after the query
            self.errors.append(repr(exc))
            for i in range(int(n)):
                tokens[i] = 0

    def close(self) -> None:
        self.rows.close()
        if self.errors:
            raise BackendError(f"the logits tap failed inside Genie: {self.errors[0]}")


class LogitsRows:
    """The host's side: ``row(k, width)`` reads row ``k`` the worker appended to ``path``."""

    def __init__(self, path: str | os.PathLike, on_logits: Callable[[np.ndarray], None] | None):
        self.path, self.on_logits = Path(path), on_logits
        self.tokens: list[int] = []  # the ids the sampler wrote, step by step

    def event(self, rest: str) -> None:
        """A ``LOGITS k V TOKEN`` line: hand row k to ``on_logits``."""
        k, width, tok = (int(x) for x in rest.split())
        self.tokens.append(tok)
        if self.on_logits is None:
            return
        with open(self.path, "rb") as fh:
            fh.seek(k * width * 4)
            data = fh.read(width * 4)
        if len(data) != width * 4:
            raise BackendError(f"Genie's logits row {k} is incomplete ({len(data)} of {width * 4} bytes)")
        self.on_logits(np.frombuffer(data, np.float32).copy())
