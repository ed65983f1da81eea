"""The SDK's `genie-t2t-run` (QAIRT): its command line, checked against the tool's own flag rules, and its output
read into the generated text, an error or the context limit. The tool runs on this host (`run_t2t`) or over adb
(the caller runs it and hands its output to `finish_t2t`); the caller names the executable. (genie-app's
dialog, which keeps a conversation on a phone between turns, is `genie_app`.)

The contract: `-c CFG (-p P | --prompt_file F | -e EMB[,T,S,O] [-t LUT] | -tok F)
[--embedding_query_output_type text|token] [--profile FILE] [--log LEVEL]`; `-t` needs `-e`, `-e` excludes
`-p`/`--prompt_file`/`-tok`, the `--profile` file must not exist. It prints `[BEGIN]: <text>...[END]` on stdout,
its exceptions on stderr ("Failed to create the dialog.", ...) and exits 1 on failure. Errors are read from stderr
and the exit status only, never from the generated text. At the dialog's context it prints "Context Size was
exceeded." and "Failed to query with embedding." (exit 1): a `ContextLimitError` (module `genie`).

Streaming (every phone path: genie-t2t-run, genie-app's dialogs and pipelines): `answer_pieces` turns a tool's
stdout, as it arrives (`vlmrun_qualcomm.adb.ShellStream`), into the answer's new text; `Retokenizer` turns that
text into token ids as soon as their tokenization can no longer change.
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import attrs

from vlmrun import procs
from vlmrun.errors import BackendError, UsageError

from .genie import CONTEXT_LIMIT, ContextLimitError, last_error_line, parse_profile


# -- genie-t2t-run ------------------------------------------------------------------------------------------
@attrs.define
class T2TResult:
    """One run of `genie-t2t-run`: the generated text, what the tool printed and its exit status, the profile it
    wrote and the timings read from it, the run's wall time."""

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
    """The `genie-t2t-run` command line, checked against the tool's own flag rules (UsageError if broken)."""
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
#: Genie's own log line for the cause of a failure (`[ERROR] "Failed to create device: 1008"`), printed before
#: genie-t2t-run's summary ("Failed to create the dialog."); only read when the tool failed
GENIE_ERROR = re.compile(r'^[ \t]*\[ERROR\][ \t]*"?(?P<msg>.*?)"?[ \t]*$', re.M)
#: messages genie-t2t-run prints on stderr when it cleans up (not failures of the query)
BENIGN_LINE = re.compile(r"^\s*Failed to free\b")


def split_t2t_stdout(stdout: str) -> tuple[str | None, str, str]:
    """genie-t2t-run's stdout as (generated text or None, what it printed outside the generation, state).

    The text is what stands between `[BEGIN]: ` and the last `[END]`; state is `end`, `abort` (an
    `[ABORT]` after the text), `cut` (no `[END]`) or `none` (no `[BEGIN]:`)."""
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


#: what ends the generated text on stdout (`split_t2t_stdout`)
END_MARKS = ("[END]", "[ABORT]")


def answer_pieces(chunks: Iterable[str]) -> Iterator[str]:
    """The generated text as it arrives: ``chunks`` are a tool's stdout pieces (genie-t2t-run, genie-app: the answer
    printed between `[BEGIN]: ` and `[END]` as it is generated); each yielded piece is new text of the answer (the
    text `split_t2t_stdout` reads from the whole stdout). Text that may be the start of an `[END]` or `[ABORT]` is
    held back until the next chunk says; errors are the caller's to read from stderr once the run ended."""
    out, sent = "", 0
    for chunk in chunks:
        out += chunk
        text, _, state = split_t2t_stdout(out)
        if text is None:
            continue
        if state == "cut":  # a mark may be arriving: hold back what could start one
            hold = max((k for mark in END_MARKS for k in range(1, len(mark)) if text.endswith(mark[:k])), default=0)
            text = text[: len(text) - hold]
        if len(text) > sent:
            yield text[sent:]
            sent = len(text)


class Retokenizer:
    """Streamed answer text -> token ids. Ids are given out only for text whose tokenization can no longer
    change: everything before the last `HOLD` pre-tokenizer pieces (BPE never merges across pieces); the rest
    comes with `final`."""

    HOLD = 2

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.sent: list[int] = []

    def _encode(self, text: str) -> list[int]:
        return [int(t) for t in self.tok.encode(text, add_special_tokens=False).ids]

    def cut(self, text: str) -> int:
        """Where ``text``'s stable part ends: the tokenization of ``text[:cut]`` is the start of any longer text's."""
        pre = getattr(self.tok, "pre_tokenizer", None)
        try:
            pieces = pre.pre_tokenize_str(text) if pre is not None else None
        except Exception:
            pieces = None
        if pieces is None:
            starts = [m.start() for m in re.finditer(r"\s+(?=\S)", text)]
            return starts[-self.HOLD] if len(starts) >= self.HOLD else 0
        return int(pieces[-self.HOLD][1][0]) if len(pieces) > self.HOLD else 0

    def _emit(self, ids: list[int]) -> list[int]:
        if ids[: len(self.sent)] != self.sent:
            return []
        new = ids[len(self.sent):]
        self.sent += new
        return new

    def stable(self, text: str) -> list[int]:
        """The ids of ``text`` (the answer so far) not given out yet whose tokenization can no longer change."""
        cut = self.cut(text)
        return self._emit(self._encode(text[:cut])) if cut > 0 else []

    def final(self, text: str) -> list[int]:
        """The rest of the ids of ``text``, the whole answer."""
        ids = self._encode(text)
        new = self._emit(ids)
        if ids[: len(self.sent)] != self.sent:  # cannot happen with HOLD pieces held back; never lose the tail
            new = ids[len(self.sent):]
            self.sent += new
        return new


def _error_line(text: str) -> str | None:
    for m in ERROR_LINE.finditer(text or ""):
        line = (text[m.start():].splitlines() or [""])[0].strip()
        if line and not BENIGN_LINE.match(line):
            return line[:300]
    return None


def parse_t2t_output(stdout: str, stderr: str, returncode: int, what: str = "genie-t2t-run") -> str:
    """The generated text between `[BEGIN]:` and `[END]`.

    Errors come from the exit status and stderr (genie-t2t-run prints its exceptions there), never from the
    generated text: a model may well write "Error: ..." or "Failed to ...". A non-zero exit, an error line on
    stderr, an `[ABORT]` or a missing `[END]` is a BackendError; the context limit is a
    `ContextLimitError`."""
    text, outside, state = split_t2t_stdout(stdout)
    err_line = _error_line(stderr)
    if CONTEXT_LIMIT.search(stderr or ""):
        raise ContextLimitError(f"{what} stopped at the Genie context limit (\"Context Size was exceeded.\");"
                                " raise the decoder's context_length or lower --max-new-tokens")
    if returncode != 0:
        detail = (err_line or last_error_line(stderr or "") or _error_line(outside)
                  or last_error_line(outside) or "no message")
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
    """Run `genie-t2t-run` on this host with a timeout (the process group is killed on a hang)."""
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
