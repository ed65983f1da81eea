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
NAME`` (`accuracy_script`).

How Genie computes it (its sources, Accuracy.cpp): the whole dataset file is tokenized by the generator's tokenizer
(no BOS is added by it), cut into ``tokens // context-size`` windows (the tail is dropped); each window starts on a
reset engine and scores the ``context-size - 1`` next-token predictions inside it (the window's first token is never
a target); ``perplexity = exp(total NLL / total count)``. A generator with a LUT ``embedding`` block (a bundle's)
is fed the LUT's rows, requantized to the decoder's input encoding.

Checked on this machine (2026-11-26; libGenie 1.21.0 of onnxruntime-qnn 2.7.0, QNN 2.51, x86_64 HTP emulator, the
tiny default model's all-npu bundle: fp16 parts decoder, AR 128, context 512, uint16 LUT):

* the node config is the bundle's ``text-generator.json`` as written (dialog body, sampler, ``embedding`` LUT
  block, ``max-num-tokens`` 512 -- it plays no part: a 1100-token text is scored); the node needs no pipeline;
  the worker's cwd must be the bundle folder (ctx-bins, tokenizer and LUT are relative paths);
* ``GenieAccuracy_createFromNode`` needs a config (the header's "can be NULL" is not what the code does); the
  plain ``{"dataset", "type"}`` config is enough for a ``basic`` generator (no ``engine`` block);
* a key outside the schema: ``GenieAccuracyConfig_createFromJson`` -> GENIE_STATUS_ERROR_JSON_SCHEMA (-8), the
  reason on stderr as a bare line ("Unknown config key: bogus");
* a text shorter than the context: ``GenieAccuracy_compute`` -> GENIE_STATUS_ERROR_GENERAL (-1) with nothing in
  the log (so `perplexity` counts the tokens itself to say why); an unreadable dataset file: status 1
  (EXIT_FAILURE, read as GENIE_STATUS_WARNING_ABORTED), also silent;
* deterministic (the same figure run to run); ~13 s per run for 2 windows of 512 tokens, node creation included;
* its figure is NOT the reference decoder's over the same windows to the last digit: chat-turn text of 1101
  tokens (2 windows): Genie 62108, the reference decoder 69513 (the same binaries run by onnxruntime-qnn: within
  0.2 % of the reference), window 1 alone 42703 vs 39421, window 0 alone 93968 vs 122575. Tokenization (no BOS,
  special tokens matched), a leading pad/EOS, shifted targets and independent 128-token chunks were each ruled
  out on the reference; the cause is inside Genie's LUT scoring path (``computeEmbeddings``) and not found.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

from vlmrun.errors import BackendError

from .genie import last_error_line
from .genie_binding import AllocCB, alloc_callback, capture_fd, status_name
from .genie_pipeline import LOG_LEVEL_WARN, PipelineLibrary
from .genie_worker import WorkerLines
from .worker_protocol import Replies

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
NOISE = re.compile(r"^(warn:|#)|\[(INFO|WARNING|WARN|VERBOSE|DEBUG)\]|\[ (INFO|WARN|VERBOSE) \]|<[IWVD]>|LIBNATIVE")


def genie_reason(text: str) -> str:
    """Genie's reason in its output: the last error line of its logger (``[ERROR]``, ``[ ERROR ]``, ``<E>``), else
    the last line that is no warning or info (libGenie prints its exceptions to stderr as bare lines, e.g.
    "Unknown config key: bogus"); "" when there is none."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    errors = [ln for ln in lines if re.search(r"\[ ?ERROR ?\]|<E>", ln)]
    if errors:
        return re.split(r"\[ ?ERROR ?\]|<E>", errors[-1])[-1].strip().strip('"')[:300]
    rest = [ln for ln in lines if not NOISE.search(ln)]
    return rest[-1][:300] if rest else ""


def _check(status: int, what: str, log: list[str]) -> None:
    if int(status) == 0:
        return
    reason = genie_reason("".join(log))
    if int(status) == 1 and what == "GenieAccuracy_compute" and not reason:
        reason = "the dataset file cannot be read"
    raise BackendError(f"Genie {what} failed: {status_name(status)}" + (f": {reason}" if reason else ""))


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
    cb, _buffers = alloc_callback()  # Genie writes into the callback's buffer after it returns: kept until read
    data = ctypes.c_void_p()
    try:
        try:
            with capture_fd(2, log, 2), capture_fd(1, log, None):  # Genie's reasons are only in its output
                _check(L.GenieLog_create(None, None, LOG_LEVEL_WARN, ctypes.byref(logger)), "GenieLog_create", log)
                _check(L.GenieNodeConfig_createFromJson(node_config.encode(), ctypes.byref(cfg)),
                       "GenieNodeConfig_createFromJson (text-generator)", log)
                _check(L.GenieNodeConfig_bindLogger(cfg, logger), "GenieNodeConfig_bindLogger", log)
                _check(L.GenieNode_create(cfg, ctypes.byref(node)), "GenieNode_create (text-generator)", log)
                _check(L.GenieAccuracyConfig_createFromJson(accuracy_json.encode(), ctypes.byref(acfg)),
                       "GenieAccuracyConfig_createFromJson", log)
                _check(L.GenieAccuracy_createFromNode(acfg, node, ctypes.byref(acc)), "GenieAccuracy_createFromNode",
                       log)
                _check(L.GenieAccuracy_compute(acc, cb, ctypes.byref(data)), "GenieAccuracy_compute", log)
        except BackendError as exc:  # the log is complete once the capture ended
            reason = genie_reason("".join(log))
            if reason and reason not in str(exc):
                raise BackendError(f"{exc}: {reason}") from None
            raise
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
    out = Replies()  # native code's stdout goes to stderr; the protocol has its own fd
    try:
        ppl = compute(PipelineLibrary(a.lib), Path(a.node_config).read_text(), Path(a.accuracy_config).read_text())
        out.write("PERPLEXITY", repr(ppl))
        return 0
    except BackendError as exc:
        out.write("ERROR", " ".join(str(exc).split()))
        return 3


# -- the host side --------------------------------------------------------------------------------------------
def count_tokens(bundle_dir: str | os.PathLike, generator_config: Mapping, text: str) -> int | None:
    """The text's token count by the generator's tokenizer (as Genie encodes it: no BOS added); None when the
    tokenizer cannot be read here."""
    body = next(iter(generator_config.values()), {}) if generator_config else {}
    path = Path(bundle_dir) / str((body.get("tokenizer") or {}).get("path", "tokenizer.json"))
    try:
        from tokenizers import Tokenizer

        return len(Tokenizer.from_file(str(path)).encode(text, add_special_tokens=False).ids)
    except Exception:  # noqa: BLE001 - only to explain a refusal
        return None


def context_size(generator_config: Mapping) -> int | None:
    body = next(iter(generator_config.values()), {}) if generator_config else {}
    size = (body.get("context") or {}).get("size")
    return int(size) if size else None


def perplexity(lib_path: str | os.PathLike, bundle_dir: str | os.PathLike, generator_config: Mapping, text: str, *,
               timeout: float = 600.0) -> float:
    """The perplexity of ``text`` by the text generator ``generator_config`` (``{"text-generator": {...}}``, its
    files relative to ``bundle_dir``), computed by libGenie's GenieAccuracy in a worker process (no onnxruntime in
    it). One-line BackendError on any failure, a timeout, or a text shorter than the generator's context."""
    tmp = Path(tempfile.mkdtemp(prefix="vlmrun-genie-accuracy-"))
    try:
        dataset = tmp / "dataset.txt"
        dataset.write_text(text, encoding="utf-8")
        (tmp / "text-generator.json").write_text(json.dumps(generator_config, indent=1))
        (tmp / "accuracy.json").write_text(json.dumps(accuracy_config(str(dataset))))
        argv = [sys.executable, "-m", "vlmrun_qualcomm.genie_accuracy", "--lib", str(lib_path),
                "--node-config", str(tmp / "text-generator.json"), "--accuracy-config", str(tmp / "accuracy.json")]
        env = {k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"}
        run = WorkerLines(argv, timeout=timeout, what="the GenieAccuracy worker", env=env, cwd=bundle_dir)
        ppl, error = None, None
        for word, rest in run:
            if word == "PERPLEXITY":
                ppl = read_perplexity(json.dumps({"perplexity": float(rest)}))
            elif word == "ERROR":
                error = rest
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if run.timed_out and ppl is None:
        raise BackendError(f"GenieAccuracy timed out after {timeout:g} s (worker killed); give a shorter text or a"
                           f" longer timeout{run.hang_detail}")
    if error:
        ctx, n = context_size(generator_config), count_tokens(bundle_dir, generator_config, text)
        if ctx and n is not None and n < ctx:
            raise BackendError(f"GenieAccuracy refused the text: it is {n} tokens, shorter than the text generator's"
                               f" context of {ctx} tokens (perplexity is scored over whole context windows) ({error})")
        raise BackendError(error)
    if ppl is None or run.returncode != 0:
        detail = last_error_line(run.stderr) or "no message"
        raise BackendError(f"the GenieAccuracy worker exited with status {run.returncode}: {detail}")
    return ppl


if __name__ == "__main__":
    sys.exit(_worker())
