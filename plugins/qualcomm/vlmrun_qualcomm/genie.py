"""Genie (Qualcomm's LLM runtime), shared by the plugins that decode through it (``qnn_htp`` engine ``genie`` and
``genie_cpu``): dialog configs generated from the model's own config, the sampler from vlmrun's settings, a
ctypes binding of ``libGenie.so``, and a runner for the SDK's ``genie-t2t-run``.

No runtime is imported here: the caller names the ``libGenie.so`` to load (``onnxruntime-qnn`` ships one; the
QAIRT SDK has one per target) and the ``genie-t2t-run`` executable (or an adb transport) to run.

Dialog config (root ``"dialog"``, as ``genie-t2t-run`` and ``GenieDialogConfig_createFromJson`` read it)::

    {"dialog": {"version": 1, "type": "basic", "max-num-tokens": N,
                "context": {"version": 1, "size", "n-vocab", "bos-token", "eos-token", "pad-token", "n-embd"},
                "sampler": {"version": 1, "seed", "temp", "top-k", "top-p", "greedy"},
                "tokenizer": {"version": 1, "path": "tokenizer.json"},
                "embedding": {"version": 1, "size": H, "datatype": "float32"},          (embedding input)
                "engine": {"version": 1, "n-threads", "backend": {...}, "model": {...}}}}

``genie-t2t-run`` contract (QAIRT ``genie-t2t-run``): ``-c CFG (-p P | --prompt_file F | -e EMB[,T,S,O] [-t LUT]
| -tok F) [--embedding_query_output_type text|token] [--profile FILE] [--log LEVEL]``; ``-t`` needs ``-e``,
``-e`` excludes ``-p``/``--prompt_file``/``-tok``, the ``--profile`` file must not exist. It prints
``[BEGIN]: <text>...[END]`` on stdout, its exceptions on stderr ("Failed to create the dialog.", ...) and exits 1
on failure. Errors are read from stderr and the exit status only, never from the generated text. When the
prompt plus the generated tokens reach the dialog context, Genie prints "Context Size was exceeded." and the tool
"Failed to query with embedding." (exit 1); libGenie returns ``GENIE_STATUS_WARNING_CONTEXT_EXCEEDED``: both are
a :class:`ContextLimitError`, and :func:`check_context` refuses such a query before it starts.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import re
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import attrs
import numpy as np

from vlmrun import procs
from vlmrun.errors import BackendError, InputError, UsageError
from vlmrun.sampling import SamplingSettings

BACKENDS = ("QnnHtp", "QnnGenAiTransformer")

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


# -- model facts and configs ----------------------------------------------------------------------------------
@attrs.frozen
class GenieModel:
    """What a Genie config needs to know about the LLM, read from the model's own config."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    bos: int
    eos: tuple[int, ...]
    pad: int
    max_context: int

    @classmethod
    def from_config(cls, config: Mapping, extra_eos: Sequence[int] = ()) -> "GenieModel":
        """From a checkpoint's ``config.json`` dict (native ``fast_vlm`` with ``text_config``, or a bare LLM)."""
        text = dict(config.get("text_config") or config)

        def pick(key, default=None):
            for src in (text, config):
                if src.get(key) is not None:
                    return src[key]
            return default

        try:
            hidden = int(text["hidden_size"])
            heads = int(text["num_attention_heads"])
            vocab = int(text["vocab_size"])
            layers = int(text["num_hidden_layers"])
        except KeyError as exc:
            raise UsageError(f"the model config has no {exc.args[0]}: cannot generate a Genie config") from None
        eos_raw = pick("eos_token_id")
        eos = [eos_raw] if isinstance(eos_raw, int) else list(eos_raw or [])
        eos += [int(e) for e in extra_eos if int(e) not in eos]
        if not eos:
            raise UsageError("the model config has no eos_token_id: cannot generate a Genie config")
        bos = pick("bos_token_id", eos[0])
        pad = pick("pad_token_id", bos)
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        theta = float(rope.get("rope_theta") or text.get("rope_theta") or 10000.0)
        return cls(
            vocab=vocab, hidden=hidden, layers=layers, heads=heads,
            kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            rope_theta=theta, bos=int(bos), eos=tuple(int(e) for e in eos), pad=int(pad),
            max_context=int(text.get("max_position_embeddings") or 32768),
        )

    @classmethod
    def from_model(cls, model) -> "GenieModel":
        """From a :class:`vlmrun.model.FastVLMModel` (its config plus the stop ids of its generation config)."""
        facts = cls.from_config(model.config)
        extra = sorted(set(model.stop_ids) - set(facts.eos))
        return attrs.evolve(facts, eos=facts.eos + tuple(extra)) if extra else facts


def sampler_config(settings: SamplingSettings, vocab: int) -> dict:
    """Genie's sampler section from vlmrun's sampling settings (top-k 0 = off = the whole vocabulary).

    Greedy is written as ``greedy: true`` AND ``top-k: 1``: Genie's ``greedy`` flag alone did not give the
    argmax on the HTP emulator (it picked a token whose logit was not the largest)."""
    s = settings or SamplingSettings()
    return {
        "version": 1,
        "seed": int(s.seed),
        "temp": float(s.temperature) if not s.greedy else 1.0,
        "top-k": 1 if s.greedy else (int(s.top_k) if s.top_k > 0 else int(vocab)),
        "top-p": float(s.top_p),
        "greedy": bool(s.greedy),
    }


def dialog_config(
    facts: GenieModel,
    backend: str,
    *,
    tokenizer: str | os.PathLike,
    context_size: int,
    sampling: SamplingSettings = SamplingSettings(),
    max_new_tokens: int = 64,
    ctx_bins: Sequence[str | os.PathLike] = (),
    model_bin: str | os.PathLike | None = None,
    embeddings: bool = True,
    eos: Sequence[int] | None = None,
    n_threads: int | None = None,
    kv_quantization: bool = False,
) -> dict:
    """A Genie dialog config for ``backend`` ("QnnHtp": ``ctx_bins``; "QnnGenAiTransformer": ``model_bin``).

    Every model number comes from ``facts`` (the model's own config), never a constant. ``eos`` overrides the
    stop tokens (e.g. the request's). ``embeddings`` declares float32 embedding input of width n-embd.
    """
    if backend not in BACKENDS:
        raise UsageError(f"Genie backend '{backend}' is not one of {', '.join(BACKENDS)}")
    ctx = int(context_size)
    if ctx < 2 or ctx > facts.max_context:
        raise UsageError(f"Genie context size {ctx} is outside 2..{facts.max_context} (the model's maximum)")
    stops = [int(e) for e in (facts.eos if eos is None else eos)]
    context = {
        "version": 1,
        "size": ctx,
        "n-vocab": facts.vocab,
        "bos-token": facts.bos,
        "eos-token": stops[0] if len(stops) == 1 else stops,
        "pad-token": facts.pad,
    }
    if embeddings:
        context["n-embd"] = facts.hidden
    threads = int(n_threads or min(6, os.cpu_count() or 1))
    if backend == "QnnHtp":
        if not ctx_bins:
            raise UsageError("a QnnHtp Genie config needs the context binaries (ctx-bins)")
        be = {
            "version": 1,
            "type": "QnnHtp",
            "QnnHtp": {
                "version": 1,
                "spill-fill-bufsize": 0,
                "use-mmap": False,
                "mmap-budget": 0,
                "poll": False,
                "cpu-mask": "0xe0",
                "kv-dim": facts.head_dim,
                "allow-async-init": False,
            },
        }
        model = {
            "version": 1,
            "type": "binary",
            "binary": {"version": 1, "ctx-bins": [str(b) for b in ctx_bins]},
            "positional-encoding": {"type": "rope", "rope-dim": facts.head_dim // 2, "rope-theta": facts.rope_theta},
        }
    else:
        if not model_bin:
            raise UsageError("a QnnGenAiTransformer Genie config needs the composer's model bin")
        be = {
            "version": 1,
            "type": "QnnGenAiTransformer",
            "QnnGenAiTransformer": {
                "version": 1,
                "use-mmap": False,
                "kv-quantization": bool(kv_quantization),
                "n-logits": 1,
                "n-layer": facts.layers,
                "n-embd": facts.hidden,
                "n-heads": facts.heads,
                "n-kv-heads": facts.kv_heads,
                "model-input": "embeddings" if embeddings else "tokens",
            },
        }
        model = {"version": 1, "type": "library", "library": {"version": 1, "model-bin": str(model_bin)}}
    dialog = {
        "version": 1,
        "type": "basic",
        "max-num-tokens": int(max_new_tokens),
        "context": context,
        "sampler": sampler_config(sampling, facts.vocab),
        "tokenizer": {"version": 1, "path": str(tokenizer)},
        "engine": {"version": 1, "n-threads": threads, "backend": be, "model": model},
    }
    if embeddings:
        dialog["embedding"] = {"version": 1, "size": facts.hidden, "datatype": "float32"}
    return {"dialog": dialog}


# -- files --------------------------------------------------------------------------------------------------
def write_embeddings(path: str | os.PathLike, inputs_embeds: np.ndarray) -> Path:
    """The ``-e`` file: raw float32 [N, hidden] in the spliced order (``inputs_embeds`` [1,N,H] or [N,H])."""
    arr = np.asarray(inputs_embeds, dtype=np.float32)
    if arr.ndim == 3:
        if arr.shape[0] != 1:
            raise UsageError(f"embeddings for Genie must be one sequence, got batch {arr.shape[0]}")
        arr = arr[0]
    if arr.ndim != 2:
        raise UsageError(f"embeddings for Genie must be [N, hidden], got {list(arr.shape)}")
    path = Path(path)
    np.ascontiguousarray(arr).tofile(path)
    return path


def write_lut(path: str | os.PathLike, table: np.ndarray) -> Path:
    """The ``-t`` file: raw float32 [vocab, hidden], row = token id."""
    path = Path(path)
    np.ascontiguousarray(np.asarray(table, dtype=np.float32)).tofile(path)
    return path


# -- profile ------------------------------------------------------------------------------------------------
def _us(entry) -> float | None:
    if isinstance(entry, Mapping):
        value, unit = entry.get("value"), str(entry.get("unit", "us")).lower()
        if value is None:
            return None
        scale = {"us": 1e-3, "ms": 1.0, "s": 1e3, "ns": 1e-6}.get(unit)
        return float(value) * scale if scale is not None else float(value)
    return float(entry) * 1e-3 if isinstance(entry, (int, float)) else None


def _val(entry) -> float | None:
    if isinstance(entry, Mapping):
        v = entry.get("value")
        return float(v) if v is not None else None
    return float(entry) if isinstance(entry, (int, float)) else None


def parse_profile(data: str | bytes | Mapping) -> dict[str, float]:
    """Genie's profile JSON (``--profile`` file or ``GenieProfile_getJsonData``) -> vlmrun timings.

    Keys: ``genie_init_ms`` (dialog create), ``ttft_ms``, ``prompt_tokens``, ``prompt_tokens_per_s``,
    ``new_tokens``, ``tokens_per_s``, ``genie_query_ms`` (the last query).
    """
    if not isinstance(data, Mapping):
        try:
            data = json.loads(data)
        except ValueError as exc:
            raise BackendError(f"Genie's profile is not JSON: {exc}") from None
    out: dict[str, float] = {}
    events = []
    for comp in data.get("components") or []:
        events += list(comp.get("events") or [])
    for ev in events:
        kind = str(ev.get("type") or ev.get("name") or "")
        if kind.endswith("_create"):
            init = _us(ev.get("init-time")) or _us(ev.get("duration"))
            if init is not None:
                out["genie_init_ms"] = init
        elif "query" in kind.lower():
            pairs = {
                "ttft_ms": _us(ev.get("time-to-first-token")),
                "genie_query_ms": _us(ev.get("duration")),
                "prompt_tokens": _val(ev.get("num-prompt-tokens")),
                "prompt_tokens_per_s": _val(ev.get("prompt-processing-rate")),
                "new_tokens": _val(ev.get("num-generated-tokens")),
                "tokens_per_s": _val(ev.get("token-generation-rate")),
            }
            out.update({k: v for k, v in pairs.items() if v is not None})
    if not out:
        raise BackendError("Genie's profile has no dialog create/query events")
    return out


# -- libGenie via ctypes ------------------------------------------------------------------------------------
QueryCB = ctypes.CFUNCTYPE(None, ctypes.c_char_p, ctypes.c_int, ctypes.c_void_p)
T2ECB = ctypes.CFUNCTYPE(None, ctypes.c_int32, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_void_p)
TokenCB = ctypes.CFUNCTYPE(None, ctypes.POINTER(ctypes.c_uint32), ctypes.c_uint32, ctypes.c_int, ctypes.c_void_p)
AllocCB = ctypes.CFUNCTYPE(None, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p))


@contextlib.contextmanager
def capture_fd(fd: int, into: list, echo_to: int | None = None):
    """Capture what native code writes to ``fd`` (e.g. Genie's errors on stderr, QNN's banner on stdout)."""
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


def _last_error_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip() and "LIBNATIVE" not in ln]
    for ln in reversed(lines):
        if re.search(r"error|fail|exception|invalid|cannot|unable", ln, re.I):
            return ln[:300]
    return lines[-1][:300] if lines else ""


def alloc_callback() -> tuple[object, list]:
    """A ``Genie_AllocCallback_t`` (Genie asks the client for ``size`` bytes and copies its JSON result into them)
    and the list that keeps its buffers alive: hold both until the result is read."""
    buffers: list = []

    def alloc(size, out):
        buf = ctypes.create_string_buffer(int(size))
        buffers.append(buf)
        out[0] = ctypes.cast(buf, ctypes.c_void_p).value

    return AllocCB(alloc), buffers


class GenieLibrary:
    """``libGenie.so`` loaded with ctypes (the API of GenieDialog.h / GenieProfile.h)."""

    def __init__(self, path: str | os.PathLike):
        self.path = str(path)
        if not Path(self.path).is_file():
            raise BackendError(f"libGenie.so not found at {self.path}")
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
        """Parse a dialog config with the real ``GenieDialogConfig_createFromJson`` (BackendError if rejected)."""
        text = config if isinstance(config, str) else json.dumps(config)
        handle = ctypes.c_void_p()
        err: list[str] = []
        with capture_fd(2, err, 2):
            status = self.lib.GenieDialogConfig_createFromJson(text.encode(), ctypes.byref(handle))
        self.check(status, "GenieDialogConfig_createFromJson", _last_error_line("".join(err)))
        self.lib.GenieDialogConfig_free(handle)

    def dialog(self, config: Mapping | str, profile: bool = True) -> "GenieDialog":
        return GenieDialog(self, config, profile)


def check_query_status(genie: GenieLibrary, status: int, what: str) -> None:
    """A query's status: the context limit (``GENIE_STATUS_WARNING_CONTEXT_EXCEEDED``, which genie-t2t-run turns
    into exit 1) is a :class:`ContextLimitError`, as on the genie-t2t-run path; other failures as ``check``."""
    if int(status) == 3:
        raise ContextLimitError(f"Genie {what} stopped at the context limit ({status_name(status)}); raise the"
                                " decoder's context_length or lower --max-new-tokens")
    genie.check(status, what)


class GenieDialog:
    """One Genie dialog (config + dialog + optional profile handle). Close it (or use ``with``)."""

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
            detail = _last_error_line("".join(err))
            raise BackendError(f"{exc}" + (f": {detail}" if detail and detail not in str(exc) else "")) from None
        if st != 0:
            self.close()
            genie.check(st, "GenieDialog_create", _last_error_line("".join(err)))
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
        """The token-to-embedding callback over ``lut``: a [V,H] float32 array, or a function ids -> [1,n,H]."""

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
        """``GenieDialog_embeddingTokenQuery``: prompt embeddings [N,H] (spliced), the LUT [V,H] (or a function
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
        """``GenieDialog_embeddingQuery`` (text output, what genie-t2t-run's default mode uses)."""
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
        """``GenieDialog_tokenQuery``: prompt token ids in, generated token ids out (blocking)."""
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


# -- genie-t2t-run ------------------------------------------------------------------------------------------
@attrs.define
class T2TResult:
    text: str
    stdout: str
    stderr: str
    returncode: int
    profile: dict | None = None
    timings: dict = attrs.field(factory=dict)
    seconds: float = 0.0


def t2t_argv(
    exe: str,
    config: str,
    *,
    prompt: str | None = None,
    prompt_file: str | None = None,
    embedding_file: str | None = None,
    lut: str | None = None,
    tokens_file: str | None = None,
    output_type: str | None = None,
    profile: str | None = None,
    log: str | None = None,
    check_profile_path: bool = True,
) -> list[str]:
    """The ``genie-t2t-run`` command line, checked against the tool's own flag rules (UsageError if broken)."""
    if lut and not embedding_file:
        raise UsageError("genie-t2t-run: -t (embedding table) needs -e (embedding file)")
    if embedding_file and (prompt is not None or prompt_file or tokens_file):
        raise UsageError("genie-t2t-run: -e (embedding file) excludes -p/--prompt_file/-tok")
    if not embedding_file and not tokens_file and (prompt is None) == (not prompt_file):
        raise UsageError("genie-t2t-run: give exactly one of -p, --prompt_file, -e or -tok")
    if output_type and output_type not in ("text", "token"):
        raise UsageError(f"genie-t2t-run: --embedding_query_output_type {output_type} is not text or token")
    if log and log not in ("error", "warn", "info", "verbose"):
        raise UsageError(f"genie-t2t-run: --log {log} is not one of error, warn, info, verbose")
    if profile and check_profile_path and Path(profile).exists():
        raise UsageError(f"genie-t2t-run: the --profile file {profile} already exists (the tool refuses it)")
    argv = [str(exe), "-c", str(config)]
    if prompt is not None:
        argv += ["-p", prompt]
    if prompt_file:
        argv += ["--prompt_file", str(prompt_file)]
    if embedding_file:
        argv += ["-e", str(embedding_file)]
    if lut:
        argv += ["-t", str(lut)]
    if tokens_file:
        argv += ["-tok", str(tokens_file)]
    if output_type:
        argv += ["--embedding_query_output_type", output_type]
    if profile:
        argv += ["--profile", str(profile)]
    if log:
        argv += ["--log", log]
    return argv


#: an error line of genie-t2t-run or Genie on stderr (errors are never read from the generated text)
ERROR_LINE = re.compile(r"^\s*(ERROR\b|Error\b|error:|Failed to|Unknown option|CANNOT LINK|.*doesn't exists"
                        r"|.*Exception|.*error while loading shared libraries)", re.M)
#: Genie's own log line for the cause of a failure (``[ERROR] "Failed to create device: 1008"``), printed before
#: genie-t2t-run's summary ("Failed to create the dialog."); only read when the tool failed
GENIE_ERROR = re.compile(r'^[ \t]*\[ERROR\][ \t]*"?(?P<msg>.*?)"?[ \t]*$', re.M)
#: messages genie-t2t-run prints on stderr when it cleans up (not failures of the query)
BENIGN_LINE = re.compile(r"^\s*Failed to free\b")
#: Genie's ContextLimitException (qualla dialogs and the CPU engine): "Context Size was exceeded."
CONTEXT_LIMIT = re.compile(r"Context Size was exceeded|context size exceeded|Context limit exceeded", re.I)


class ContextLimitError(BackendError):
    """Genie stopped because the prompt plus the generated tokens reached the dialog context
    (``GENIE_STATUS_WARNING_CONTEXT_EXCEEDED`` from libGenie; exit 1 with "Failed to query with embedding." from
    genie-t2t-run)."""


def context_message(prompt_tokens: int, max_new_tokens: int, context: int) -> str:
    """One line for a prompt plus new tokens that do not fit a Genie context, saying what to change."""
    room = int(context) - int(prompt_tokens)
    fix = (f"lower --max-new-tokens to {room} or raise" if room > 0 else "shorten the prompt or raise")
    return (f"the prompt ({int(prompt_tokens)} tokens) plus {int(max_new_tokens)} new tokens do not fit the Genie"
            f" context of {int(context)} tokens; {fix} the decoder's context_length")


def check_context(prompt_tokens: int, max_new_tokens: int, context: int) -> None:
    """Refuse, before Genie starts, a query whose prompt plus ``max_new_tokens`` exceed ``context`` (Genie would
    stop with "Context Size was exceeded." and genie-t2t-run exit 1)."""
    if int(prompt_tokens) + int(max_new_tokens) > int(context):
        raise InputError(context_message(prompt_tokens, max_new_tokens, context))


def split_t2t_stdout(stdout: str) -> tuple[str | None, str, str]:
    """genie-t2t-run's stdout as (generated text or None, what it printed outside the generation, state).

    The text is what stands between ``[BEGIN]: `` and the last ``[END]``; state is ``end``, ``abort`` (an
    ``[ABORT]`` after the text), ``cut`` (no ``[END]``) or ``none`` (no ``[BEGIN]:``)."""
    stdout = stdout or ""
    start = stdout.find("[BEGIN]:")
    if start < 0:
        return None, stdout, "none"
    body = stdout[start + len("[BEGIN]:"):]
    end = body.rfind("[END]")
    if end >= 0:
        text, outside, state = body[:end], stdout[:start] + body[end + len("[END]"):], "end"
    else:
        ab = body.rfind("[ABORT]")
        text, outside, state = (body[:ab], stdout[:start], "abort") if ab >= 0 else (body, stdout[:start], "cut")
    return (text[1:] if text.startswith(" ") else text), outside, state


def _error_line(text: str) -> str | None:
    for m in ERROR_LINE.finditer(text or ""):
        line = (text[m.start():].splitlines() or [""])[0].strip()
        if line and not BENIGN_LINE.match(line):
            return line[:300]
    return None


def parse_t2t_output(stdout: str, stderr: str, returncode: int, what: str = "genie-t2t-run") -> str:
    """The generated text between ``[BEGIN]:`` and ``[END]``.

    Errors come from the exit status and stderr (genie-t2t-run prints its exceptions there), never from the
    generated text: a model may well write "Error: ..." or "Failed to ...". A non-zero exit, an error line on
    stderr, an ``[ABORT]`` or a missing ``[END]`` is a BackendError; the context limit is a
    :class:`ContextLimitError`."""
    text, outside, state = split_t2t_stdout(stdout)
    err_line = _error_line(stderr)
    if CONTEXT_LIMIT.search(stderr or ""):
        raise ContextLimitError(f"{what} stopped at the Genie context limit (\"Context Size was exceeded.\");"
                                " raise the decoder's context_length or lower --max-new-tokens")
    if returncode != 0:
        detail = (err_line or _last_error_line(stderr or "") or _error_line(outside)
                  or _last_error_line(outside) or "no message")
        cause = next((m.group("msg") for text in (stderr or "", outside) for m in GENIE_ERROR.finditer(text)
                      if m.group("msg")), None)
        if cause and cause not in detail:  # Genie's first [ERROR] names what failed (device, file, config)
            detail = f'{detail} (Genie: "{cause[:200]}")'
        raise BackendError(f"{what} exited with status {returncode}: {detail}")
    if err_line:
        raise BackendError(f"{what} reported an error: {err_line}")
    if state == "abort":
        raise BackendError(f"{what} aborted the query")
    if state == "none":
        raise BackendError(f"{what} printed no [BEGIN]: (no generation in its output)")
    if state == "cut":
        raise BackendError(f"{what} output ended without [END] (the generation was cut off)")
    return text


def run_t2t(argv: Sequence[str], *, timeout: float = 600.0, cwd: str | os.PathLike | None = None,
            env: Mapping[str, str] | None = None, profile: str | os.PathLike | None = None,
            on_output: Callable[[str], None] | None = None) -> T2TResult:
    """Run ``genie-t2t-run`` on this host with a timeout (the process group is killed on a hang)."""
    t0 = time.perf_counter()
    res = procs.run(argv, timeout=timeout, what="genie-t2t-run", cwd=cwd, env=dict(os.environ, **(env or {})),
                    on_stdout=on_output, hint="raise the decoder's timeout option if the model is large")
    return finish_t2t(res.stdout, res.stderr, res.returncode, profile, time.perf_counter() - t0)


def finish_t2t(stdout: str, stderr: str, returncode: int, profile: str | os.PathLike | None,
               seconds: float, what: str = "genie-t2t-run") -> T2TResult:
    text = parse_t2t_output(stdout, stderr, returncode, what)
    result = T2TResult(text, stdout, stderr, returncode, seconds=seconds)
    if profile:
        p = Path(profile)
        if not p.is_file():
            raise BackendError(f"{what} wrote no profile file {p}")
        result.profile = json.loads(p.read_text() or "{}")
        result.timings = parse_profile(result.profile)
    return result


#: the name a diff gives Genie when it generates over binaries vlmrun's host engine also runs
RUNTIME_NAME = "Genie (libGenie dialog)"


def tap_arguments(request, model) -> dict:
    """:func:`stream_tokens_worker`'s logits-tap arguments for a ``decode`` request (``vlmrun.stages
    .DecodeRequest``): its ``on_logits`` and ``teacher_tokens``, the model's vocabulary limit."""
    return {"on_logits": request.on_logits, "teacher_tokens": request.teacher_tokens,
            "vocab_limit": getattr(model, "vocab_limit", None)}


# -- libGenie in a worker process ----------------------------------------------------------------------------
# libGenie's QnnHtp backend shares libQnnHtp.so with onnxruntime-qnn's execution provider; in one process the two
# were seen to corrupt each other (wrong, run-to-run different tokens after the EP compiled or ran graphs).
# So vlmrun runs Genie in a small worker process (``python -m vlmrun_qualcomm.genie``) that never loads onnxruntime:
# tokens stream back one per line on a pipe, errors come back as one line, a hang is killed by a timeout.

def _worker(argv: Sequence[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m vlmrun_qualcomm.genie")
    ap.add_argument("--lib", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--embeddings", required=True)
    ap.add_argument("--lut", required=True, help=".npy float32 [V,H]")
    ap.add_argument("--profile")
    ap.add_argument("--tap", help="JSON: the logits tap (rows file, forced tokens, vocab limit), genie_sampler.py")
    a = ap.parse_args(argv)
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # anything native code prints on stdout goes to stderr; the protocol has its own fd
    try:
        lut = np.load(a.lut, mmap_mode="r")
        emb = np.fromfile(a.embeddings, dtype=np.float32).reshape(-1, lut.shape[1])
        cfg = Path(a.config).read_text()
        lib = GenieLibrary(a.lib)
        tap = None
        if a.tap:  # registered before the dialog exists; the config's sampler block names it
            from .genie_sampler import LogitsTap

            t = json.loads(Path(a.tap).read_text())
            tap = LogitsTap(lib.lib, out, t["rows"], t.get("forced") or (), t.get("vocab_limit"))
        with lib.dialog(cfg, profile=bool(a.profile)) as dialog:
            for tok in dialog.stream_tokens(emb, lut):
                out.write(f"TOKEN {tok}\n")
            if a.profile:
                Path(a.profile).write_text(json.dumps(dialog.profile()))
        if tap is not None:
            tap.close()
        out.write("DONE\n")
        return 0
    except ContextLimitError as exc:
        out.write(f"CONTEXT {exc}\n")
        return 3
    except BackendError as exc:
        out.write(f"ERROR {exc}\n")
        return 3


class WorkerLines:
    """A worker process of this package's line protocol (one ``WORD rest`` line per event on stdout, its own
    stderr for native noise): iterate for ``(word, rest)``. When the iteration ends, ``returncode``, ``timed_out``
    and ``stderr`` say how the process ended. A consumer that stops early still lets the worker finish, within the
    deadline (Genie writes its profile at the end); a hang is killed at ``timeout``."""

    def __init__(self, argv: Sequence[str], *, timeout: float, what: str, env: Mapping[str, str],
                 cwd: str | os.PathLike | None = None):
        self.argv, self.timeout, self.what, self.env, self.cwd = list(argv), timeout, what, env, cwd
        self.returncode: int | None = None
        self.timed_out = False
        self.stderr = ""

    def __iter__(self) -> Iterator[tuple[str, str]]:
        err_box: list = []
        with procs.watched(self.argv, timeout=self.timeout, what=self.what, env=self.env, cwd=self.cwd) as w:
            reader = threading.Thread(target=lambda: err_box.append(w.proc.stderr.read()), daemon=True)
            reader.start()
            try:
                for line in w.proc.stdout:
                    word, _, rest = line.rstrip("\n").partition(" ")
                    yield word, rest
            finally:
                with contextlib.suppress(ValueError, OSError):
                    for _ in w.proc.stdout:
                        pass
                w.proc.wait()
                reader.join(5)
                self.returncode, self.timed_out = w.proc.returncode, w.timed_out
                self.stderr = "".join(e for e in err_box if e)


def stream_tokens_worker(lib_path: str | os.PathLike, config: Mapping, embeds: np.ndarray,
                         lut_npy: str | os.PathLike, *, timeout: float = 600.0,
                         profile_out: dict | None = None, env: Mapping[str, str] | None = None,
                         on_logits: Callable[[np.ndarray], None] | None = None,
                         teacher_tokens: Sequence[int] | None = None,
                         vocab_limit: int | None = None) -> Iterator[int]:
    """Genie's ``embeddingTokenQuery`` in a worker process: yields token ids as they arrive.

    ``profile_out`` (a dict) receives the parsed profile timings when the query finishes. ``on_logits`` or
    ``teacher_tokens``: the dialog samples through the logits tap (:mod:`.genie_sampler`, Genie's custom sampler):
    each step's row reaches ``on_logits``; step k takes ``teacher_tokens[k]``, else the argmax below
    ``vocab_limit``. The config's sampler block is replaced by the tap's.
    """
    import shutil
    import tempfile

    from .genie_sampler import LogitsRows, custom_sampler_block

    tmp = Path(tempfile.mkdtemp(prefix="vlmrun-genie-"))
    cfg_path, emb_path, prof = tmp / "genie_config.json", tmp / "embeddings.raw", tmp / "profile.json"
    tapped = on_logits is not None or teacher_tokens is not None
    if tapped:
        config = json.loads(json.dumps(config))
        config["dialog"]["sampler"] = custom_sampler_block()
    cfg_path.write_text(json.dumps(config, indent=1))
    write_embeddings(emb_path, embeds)
    argv = [sys.executable, "-m", "vlmrun_qualcomm.genie", "--lib", str(lib_path), "--config", str(cfg_path),
            "--embeddings", str(emb_path), "--lut", str(lut_npy), "--profile", str(prof)]
    rows = LogitsRows(tmp / "rows.f32", on_logits)
    if tapped:
        (tmp / "tap.json").write_text(json.dumps({"rows": str(rows.path), "forced": list(teacher_tokens or ()),
                                                  "vocab_limit": vocab_limit}))
        argv += ["--tap", str(tmp / "tap.json")]
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"}, **(env or {})}
    run = WorkerLines(argv, timeout=timeout, what="the Genie worker", env=env)
    done, error, limit = False, None, False
    try:
        for word, rest in run:
            if word == "TOKEN":
                yield int(rest)
            elif word == "LOGITS":
                rows.event(rest)
            elif word == "DONE":
                done = True
            elif word in ("ERROR", "CONTEXT"):
                error, limit = rest, word == "CONTEXT"
    finally:
        prof_text = prof.read_text() if prof.is_file() else ""
        shutil.rmtree(tmp, ignore_errors=True)
        if profile_out is not None and prof_text:
            profile_out.clear()
            with contextlib.suppress(BackendError, ValueError):
                profile_out.update(parse_profile(prof_text))
    if run.timed_out and not done:
        raise BackendError(f"Genie timed out after {timeout:g} s (worker killed)")
    if error:
        raise (ContextLimitError if limit else BackendError)(error)
    if not done or run.returncode != 0:
        detail = _last_error_line(run.stderr) or "no message"
        raise BackendError(f"the Genie worker exited with status {run.returncode}: {detail}")


if __name__ == "__main__":
    sys.exit(_worker())
