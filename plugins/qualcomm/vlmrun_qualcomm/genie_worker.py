"""libGenie in a worker process. libGenie's QnnHtp backend shares libQnnHtp.so with onnxruntime-qnn's execution
provider; in one process the two were seen to corrupt each other (wrong, run-to-run different tokens after the EP
compiled or ran graphs). So vlmrun runs a Genie dialog in a small worker process that never loads onnxruntime:
tokens stream back one per line on a pipe, errors come back as one line, a hang is killed by a timeout.

    python -m vlmrun_qualcomm.genie_worker --lib libGenie.so --config dialog.json --embeddings e.raw --lut lut.npy
        [--profile profile.json] [--tap tap.json]

The worker writes `TOKEN id` per generated token (and `LOGITS k V TOKEN` per step through the logits tap of
`genie_sampler`), then `DONE`; or one `CONTEXT reason` (the context limit) or `ERROR reason` line and exits 3.
`stream_tokens_worker` is the host's side; `WorkerLines` reads any worker of this line protocol (the pipeline's
and the accuracy runner's too).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
from pathlib import Path
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

from vlmrun import procs
from vlmrun.errors import BackendError

from .genie import ContextLimitError, last_error_line, parse_profile, write_embeddings
from .genie_binding import GenieLibrary
from .genie_sampler import LogitsRows, LogitsTap, custom_sampler_block
from .worker_protocol import STACKS_SIGNAL, Replies, hung_worker_stacks

#: the name a diff gives Genie when it generates over binaries vlmrun's host engine also runs
RUNTIME_NAME = "Genie (libGenie dialog)"


def tap_arguments(request, model) -> dict:
    """`stream_tokens_worker`'s logits-tap arguments for a `decode` request (`vlmrun.stages.DecodeRequest`): its
    `on_logits` and `teacher_tokens`, the model's vocabulary limit."""
    return {"on_logits": request.on_logits, "teacher_tokens": request.teacher_tokens,
            "vocab_limit": getattr(model, "vocab_limit", None)}


# -- the worker -------------------------------------------------------------------------------------------------
def _worker(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vlmrun_qualcomm.genie_worker")
    ap.add_argument("--lib", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--embeddings", required=True)
    ap.add_argument("--lut", required=True, help=".npy float32 [V,H]")
    ap.add_argument("--profile")
    ap.add_argument("--tap", help="JSON: the logits tap (rows file, forced tokens, vocab limit), genie_sampler.py")
    a = ap.parse_args(argv)
    out = Replies()
    try:
        lut = np.load(a.lut, mmap_mode="r")
        emb = np.fromfile(a.embeddings, dtype=np.float32).reshape(-1, lut.shape[1])
        cfg = Path(a.config).read_text()
        lib = GenieLibrary(a.lib)
        tap = None
        if a.tap:  # registered before the dialog exists; the config's sampler block names it
            t = json.loads(Path(a.tap).read_text())
            tap = LogitsTap(lib.lib, out.out, t["rows"], t.get("forced") or (), t.get("vocab_limit"))
        with lib.dialog(cfg, profile=bool(a.profile)) as dialog:
            for tok in dialog.stream_tokens(emb, lut):
                out.write("TOKEN", tok)
            if a.profile:
                Path(a.profile).write_text(json.dumps(dialog.profile()))
        if tap is not None:
            tap.close()
        out.write("DONE")
        return 0
    except BackendError as exc:  # ContextLimitError too: one CONTEXT line
        return out.failed(exc)


class WorkerLines:
    """A worker process of this package's line protocol (one `WORD rest` line per event on stdout, its own
    stderr for native noise): iterate for `(word, rest)`. When the iteration ends, `returncode`, `timed_out`
    and `stderr` say how the process ended. A consumer that stops early still lets the worker finish, within the
    deadline (Genie writes its profile at the end); a hang is killed at `timeout`."""

    def __init__(self, argv: Sequence[str], *, timeout: float, what: str, env: Mapping[str, str],
                 cwd: str | os.PathLike | None = None):
        self.argv, self.timeout, self.what, self.env, self.cwd = list(argv), timeout, what, env, cwd
        self.returncode: int | None = None
        self.timed_out = False
        self.stderr = ""
        self.hang_detail = ""  # after a timeout: where the worker's stacks were saved (`hung_worker_stacks`)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        err_box: list = []
        with procs.watched(self.argv, timeout=self.timeout, what=self.what, env=self.env, cwd=self.cwd,
                           stacks_signal=STACKS_SIGNAL) as w:
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
                if self.timed_out:
                    self.hang_detail = hung_worker_stacks(self.stderr, self.what)


def stream_tokens_worker(lib_path: str | os.PathLike, config: Mapping, embeds: np.ndarray,
                         lut_npy: str | os.PathLike, *, timeout: float = 600.0,
                         profile_out: dict | None = None, env: Mapping[str, str] | None = None,
                         on_logits: Callable[[np.ndarray], None] | None = None,
                         teacher_tokens: Sequence[int] | None = None,
                         vocab_limit: int | None = None) -> Iterator[int]:
    """Genie's `embeddingTokenQuery` in a worker process: yields token ids as they arrive.

    `profile_out` (a dict) receives the parsed profile timings when the query finishes. `on_logits` or
    `teacher_tokens`: the dialog samples through the logits tap (`genie_sampler`, Genie's custom sampler):
    each step's row reaches `on_logits`; step k takes `teacher_tokens[k]`, else the argmax below
    `vocab_limit`. The config's sampler block is replaced by the tap's.
    """
    tmp = Path(tempfile.mkdtemp(prefix="vlmrun-genie-"))
    cfg_path, emb_path, prof = tmp / "genie_config.json", tmp / "embeddings.raw", tmp / "profile.json"
    tapped = on_logits is not None or teacher_tokens is not None
    if tapped:
        config = json.loads(json.dumps(config))
        config["dialog"]["sampler"] = custom_sampler_block()
    cfg_path.write_text(json.dumps(config, indent=1))
    write_embeddings(emb_path, embeds)
    argv = [sys.executable, "-m", "vlmrun_qualcomm.genie_worker", "--lib", str(lib_path), "--config", str(cfg_path),
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
        raise BackendError(f"Genie timed out after {timeout:g} s (worker killed){run.hang_detail}")
    if error:
        raise (ContextLimitError if limit else BackendError)(error)
    if not done or run.returncode != 0:
        detail = last_error_line(run.stderr) or "no message"
        raise BackendError(f"the Genie worker exited with status {run.returncode}: {detail}")


if __name__ == "__main__":
    sys.exit(_worker())
