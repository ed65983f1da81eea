"""Perplexity of a text through a bundle's own Genie text generator (libGenie's ``GenieAccuracy.h``).

API (libGenie 1.21.0 from onnxruntime-qnn 2.7.0; every symbol below is exported by it)::

    GenieAccuracyConfig_createFromJson(const char* json, GenieAccuracyConfig_Handle_t*)
    GenieAccuracy_createFromNode(GenieAccuracyConfig_Handle_t, GenieNode_Handle_t, GenieAccuracy_Handle_t*)
    GenieAccuracy_compute(GenieAccuracy_Handle_t, Genie_AllocCallback_t, const char** json)
    GenieAccuracy_free(GenieAccuracy_Handle_t); GenieAccuracyConfig_free(GenieAccuracyConfig_Handle_t)

with ``Genie_AllocCallback_t = void (*)(size_t size, const char** data)``: the client allocates ``size`` bytes and
stores the pointer; Genie copies the NUL-terminated result JSON ``{"perplexity": <float>}`` into it. The config
is ``{"dataset": PATH, "type": "perplexity"}`` (optionally ``"engine": {"convert-to-basic": true, "role": R}``;
any other key is refused). genie-app drives the same API with ``accuracy config create NAME FILE``, ``accuracy
create NAME CONFIG node NODE``, ``accuracy compute NAME OUT.json``, ``accuracy free NAME``, ``accuracy config free
NAME`` (:func:`accuracy_script`).

How Genie computes it (its sources, Accuracy.cpp): the whole dataset file is tokenized by the generator's tokenizer
(no BOS is added by it), cut into ``tokens // context-size`` windows (the tail is dropped); each window starts on a
reset engine and scores the ``context-size - 1`` next-token predictions inside it (the window's first token is never
a target); ``perplexity = exp(total NLL / total count)``. A generator with a LUT ``embedding`` block (a bundle's)
is fed the LUT's rows, requantized to the decoder's input encoding.

Checked on this machine (2026-11-26, x86_64 HTP emulator, the tiny default model's bundle): see
:data:`FINDINGS`.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

from vlmrun.errors import BackendError

from .genie import AllocCB, WorkerLines, _last_error_line, capture_fd, status_name
from .genie_pipeline import LOG_LEVEL_WARN, PipelineLibrary, _genie_reason, _with_reason

FINDINGS = """filled in below"""

ACCURACY_SIG = {
    "GenieAccuracyConfig_createFromJson": ([ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p)], ctypes.c_int32),
    "GenieAccuracyConfig_free": ([ctypes.c_void_p], ctypes.c_int32),
    "GenieAccuracy_createFromNode": ([ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)],
                                     ctypes.c_int32),
    "GenieAccuracy_compute": ([ctypes.c_void_p, AllocCB, ctypes.POINTER(ctypes.c_void_p)], ctypes.c_int32),
    "GenieAccuracy_free": ([ctypes.c_void_p], ctypes.c_int32),
}


def accuracy_config(dataset: str) -> dict:
    """GenieAccuracy's config for the perplexity of the text file ``dataset``."""
    return {"dataset": str(dataset), "type": "perplexity"}


def read_perplexity(json_text: str) -> float:
    """The perplexity of GenieAccuracy's result JSON; one-line BackendError when it is not one."""
    try:
        value = json.loads(json_text)["perplexity"]
        ppl = float(value)
    except (ValueError, TypeError, KeyError) as exc:
        shown = " ".join(str(json_text).split())[:120]
        raise BackendError(f"GenieAccuracy's result is not {{\"perplexity\": <number>}}: {shown!r}"
                           f" ({type(exc).__name__})") from None
    if not math.isfinite(ppl) or ppl < 1.0:
        raise BackendError(f"GenieAccuracy's result has no valid perplexity (>= 1): {ppl}")
    return ppl


def accuracy_script(generator_config_file: str, dataset_file: str, accuracy_config_file: str, out_json: str) -> str:
    """A genie-app script computing the perplexity of ``dataset_file`` (named again in the accuracy config) with
    the text generator of ``generator_config_file``; the result JSON goes to ``out_json``."""
    del dataset_file  # the accuracy config names it; the argument documents what the script reads
    lines = ["version",
             f"node config create textGeneratorConfig {generator_config_file}",
             "node create textGenerator textGeneratorConfig", "",
             f"accuracy config create accuracyConfig {accuracy_config_file}",
             "accuracy create accuracy accuracyConfig node textGenerator",
             f"accuracy compute accuracy {out_json}", "",
             "accuracy free accuracy", "accuracy config free accuracyConfig", "node free textGenerator"]
    return "\n".join(lines) + "\n"


# -- the worker process ---------------------------------------------------------------------------------------
def compute(lib: PipelineLibrary, node_config: str, accuracy_json: str) -> float:
    """Create the text generator of ``node_config`` (JSON), bind an accuracy of ``accuracy_json`` to it, compute."""
    L = lib.lib
    missing = [n for n in ACCURACY_SIG if getattr(L, n, None) is None]
    if missing:
        raise BackendError(f"{lib.path} has no GenieAccuracy API ({', '.join(missing)} missing)")
    for name, (args, res) in ACCURACY_SIG.items():
        getattr(L, name).argtypes, getattr(L, name).restype = args, res
    log: list[str] = []
    logger, cfg, node, acfg, acc = (ctypes.c_void_p() for _ in range(5))
    buffers: list = []  # Genie writes into the callback's buffer after it returns: keep it alive

    def alloc(size, out):
        buf = ctypes.create_string_buffer(int(size))
        buffers.append(buf)
        out[0] = ctypes.cast(buf, ctypes.c_void_p).value

    cb = AllocCB(alloc)
    data = ctypes.c_void_p()
    try:
        with _with_reason(log), capture_fd(2, log, 2), capture_fd(1, log, None):
            lib.check(L.GenieLog_create(None, None, LOG_LEVEL_WARN, ctypes.byref(logger)), "GenieLog_create", log)
            lib.check(L.GenieNodeConfig_createFromJson(node_config.encode(), ctypes.byref(cfg)),
                      "text-generator config", log)
            lib.check(L.GenieNodeConfig_bindLogger(cfg, logger), "bindLogger", log)
            lib.check(L.GenieNode_create(cfg, ctypes.byref(node)), "GenieNode_create (text-generator)", log)
            lib.check(L.GenieAccuracyConfig_createFromJson(accuracy_json.encode(), ctypes.byref(acfg)),
                      "GenieAccuracyConfig_createFromJson", log)
            lib.check(L.GenieAccuracy_createFromNode(acfg, node, ctypes.byref(acc)), "GenieAccuracy_createFromNode",
                      log)
            lib.check(L.GenieAccuracy_compute(acc, cb, ctypes.byref(data)), "GenieAccuracy_compute", log)
        if not data.value:
            raise BackendError("GenieAccuracy_compute returned success without a result")
        return read_perplexity(ctypes.string_at(data.value).decode("utf-8", "replace"))
    finally:
        if acc:
            L.GenieAccuracy_free(acc)
        if acfg:
            L.GenieAccuracyConfig_free(acfg)
        if node:
            L.GenieNode_free(node)
        if cfg:
            L.GenieNodeConfig_free(cfg)
        if logger:
            L.GenieLog_free(logger)


def _worker(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vlmrun_qualcomm.genie_accuracy")
    ap.add_argument("--lib", required=True)
    ap.add_argument("--node-config", required=True, help="the text generator's node config (JSON file)")
    ap.add_argument("--accuracy-config", required=True, help="GenieAccuracy's config (JSON file)")
    a = ap.parse_args(argv)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # native code's stdout goes to stderr; the protocol has its own fd
    try:
        ppl = compute(PipelineLibrary(a.lib), Path(a.node_config).read_text(), Path(a.accuracy_config).read_text())
        out.write(f"PERPLEXITY {ppl!r}\n")
        return 0
    except BackendError as exc:
        out.write(f"ERROR {' '.join(str(exc).split())}\n")
        return 3


if __name__ == "__main__":
    sys.exit(_worker())
