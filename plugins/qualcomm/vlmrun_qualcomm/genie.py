"""What every way of running Genie (Qualcomm's LLM runtime) shares: the files it reads (prompt embeddings, the
embedding table), the profile JSON it writes, the context limit it stops at, and the line of its stderr that says
what failed.

When the prompt plus the generated tokens reach the dialog context, Genie prints "Context Size was exceeded." and
`genie-t2t-run` "Failed to query with embedding." (exit 1); libGenie returns
`GENIE_STATUS_WARNING_CONTEXT_EXCEEDED`: both are a `ContextLimitError`, and `check_context` refuses such a query
before it starts.

The rest of Genie is in the modules of its jobs: `genie_config` (dialog configs), `genie_binding` (the ctypes
binding of `libGenie.so`), `genie_t2t` (the SDK's `genie-t2t-run`), `genie_worker` (libGenie in a worker process).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Mapping

import numpy as np

from vlmrun.errors import BackendError, InputError, UsageError


# -- files --------------------------------------------------------------------------------------------------
def write_embeddings(path: str | os.PathLike, inputs_embeds: np.ndarray) -> Path:
    """The `-e` file: raw float32 [N, hidden] in the spliced order (`inputs_embeds` [1,N,H] or [N,H])."""
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
    """The `-t` file: raw float32 [vocab, hidden], row = token id."""
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
    """Genie's profile JSON (`--profile` file or `GenieProfile_getJsonData`) -> vlmrun timings.

    Keys: `genie_init_ms` (dialog create), `ttft_ms`, `prompt_tokens`, `prompt_tokens_per_s`,
    `new_tokens`, `tokens_per_s`, `genie_query_ms` (the last query).
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


# -- errors -------------------------------------------------------------------------------------------------
#: an ``[ ERROR ]`` line the pipeline's encoders log on every run, failed or not (not a reason)
NOT_A_REASON = re.compile(r"does not support kpis method")


def last_error_line(text: str) -> str:
    """The line of native output (Genie's stderr) that says what failed: the last one naming an error, else the
    last one; QNN's LIBNATIVE banner lines and Genie's lines that are never a reason (`NOT_A_REASON`) are skipped."""
    lines = [ln.strip() for ln in text.splitlines()
             if ln.strip() and "LIBNATIVE" not in ln and not NOT_A_REASON.search(ln)]
    for ln in reversed(lines):
        if re.search(r"error|fail|exception|invalid|cannot|unable", ln, re.I):
            return ln[:300]
    return lines[-1][:300] if lines else ""


#: Genie's ContextLimitException (qualla dialogs, the CPU engine, the pipeline's generator): "Context Size was
#: exceeded."
CONTEXT_LIMIT = re.compile(r"Context Size was exceeded|context size exceeded|Context limit exceeded", re.I)


class ContextLimitError(BackendError):
    """Genie stopped because the prompt plus the generated tokens reached the dialog context
    (`GENIE_STATUS_WARNING_CONTEXT_EXCEEDED` from libGenie; exit 1 with "Failed to query with embedding." from
    genie-t2t-run)."""


def context_message(prompt_tokens: int, max_new_tokens: int, context: int) -> str:
    """One line for a prompt plus new tokens that do not fit a Genie context, saying what to change."""
    room = int(context) - int(prompt_tokens)
    fix = (f"lower --max-new-tokens to {room} or raise" if room > 0 else "shorten the prompt or raise")
    return (f"the prompt ({int(prompt_tokens)} tokens) plus {int(max_new_tokens)} new tokens do not fit the Genie"
            f" context of {int(context)} tokens; {fix} the decoder's context_length")


def check_context(prompt_tokens: int, max_new_tokens: int, context: int) -> None:
    """Refuse, before Genie starts, a query whose prompt plus `max_new_tokens` exceed `context` (Genie would
    stop with "Context Size was exceeded." and genie-t2t-run exit 1)."""
    if int(prompt_tokens) + int(max_new_tokens) > int(context):
        raise InputError(context_message(prompt_tokens, max_new_tokens, context))
