"""Genie kept alive between the turns of a conversation: a worker process that holds one dialog (or one pipeline,
`vlmrun_qualcomm.genie_pipeline.PipelineSession`) and answers commands on its stdin, so that the dialog's KV
cache survives from one query to the next (Genie keeps a dialog's state across queries until ``GenieDialog_reset``).

The line protocol: the worker says ``READY`` once it is made; then for each command line on its stdin it writes its
event lines (``TOKEN id``, ``TEXT ...``) and ``DONE``, or ``ERROR reason``; EOF on stdin ends it.

    python -m vlmrun_qualcomm.genie_session --lib libGenie.so --config dialog.json --lut lut.npy
      QUERY embeddings.raw     the rows (float32 [N, H]) fed on top of the dialog's state, then generation
      RESET                    GenieDialog_reset
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import Iterator, Mapping, Sequence

import numpy as np

from vlmrun import procs
from vlmrun.errors import BackendError
from vlmrun.handles import DecoderState

from .genie import ContextLimitError, last_error_line, write_embeddings
from .genie_binding import GenieLibrary
from .worker_protocol import STACKS_SIGNAL, Replies, hung_worker_stacks, serve_commands


class WorkerSession:
    """A worker process of the session protocol (module docstring), started with ``argv`` in ``cwd``. A command past
    ``timeout`` kills it; so does an ``ERROR`` (the state it held is unknown): `alive` is then False."""

    what = "the Genie worker"

    def __init__(self, argv: Sequence[str], *, timeout: float, cwd: str | os.PathLike | None = None,
                 tmp: Path | None = None):
        self.timeout, self._tmp = float(timeout), tmp
        # ``tmp``: the session's own folder, removed by close, else when the session is collected or at exit (a
        # conversation dropped from a cache, a process that ends with sessions open)
        self._remove_tmp = weakref.finalize(self, shutil.rmtree, str(tmp), True) if tmp is not None else None
        env = {k: v for k, v in os.environ.items() if k != "PYTHONSTARTUP"}
        self.proc = procs._start(list(argv), self.what, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, cwd=cwd, env=env, text=True, bufsize=1)
        self._lines: queue.Queue = queue.Queue()
        self._err: list[str] = []

        def pump(stream, sink, last):
            for ln in stream:
                sink(ln)
            if last:
                self._lines.put(None)

        threading.Thread(target=pump, args=(self.proc.stdout, self._lines.put, True), daemon=True).start()
        self._err_pump = threading.Thread(target=pump, args=(self.proc.stderr, self._err.append, False), daemon=True)
        self._err_pump.start()
        for _ in self.events("READY"):
            pass

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def rss(self) -> int:
        """The worker's resident bytes (Linux ``/proc``; 0 where unknown)."""
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
        return 0

    def events(self, end: str = "DONE") -> Iterator[tuple[str, str]]:
        """The worker's event lines up to ``end``: ``(word, rest)``."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                line = self._lines.get(timeout=max(deadline - time.monotonic(), 0.001))
            except queue.Empty:
                procs.ask_for_stacks(self.proc, STACKS_SIGNAL)
                procs.kill_group(self.proc)  # hung: not closed gracefully (that waited 5 s more for it to exit)
                self._err_pump.join(5)  # its stderr, with the stacks, read to the end
                self.close()
                detail = hung_worker_stacks("".join(self._err), self.what)
                raise BackendError(f"{self.what} timed out after {self.timeout:g} s (worker killed); raise --option"
                                   f" timeout{detail}") from None
            if line is None:
                self.close()
                detail = last_error_line("".join(self._err)) or "no message"
                raise BackendError(f"{self.what} exited with status {self.proc.returncode}: {detail}")
            word, _, rest = line.rstrip("\n").partition(" ")
            if word in ("ERROR", "CONTEXT"):
                self.close()
                raise (ContextLimitError if word == "CONTEXT" else BackendError)(rest)
            if word == end:
                return
            yield word, rest

    def send(self, line: str) -> None:
        try:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            self.close()
            raise BackendError(f"{self.what} is gone") from None

    def reset(self) -> None:
        """Forget the conversation (``RESET``)."""
        self.send("RESET")
        for _ in self.events():
            pass

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                procs.kill_group(self.proc)
        if self._remove_tmp is not None:
            self._remove_tmp()


class DialogSession(WorkerSession):
    """One Genie dialog kept in its worker: each `query` feeds embeddings rows on top of what the dialog holds
    and streams the tokens Genie generates (it feeds each back through the LUT but the last)."""

    what = "the Genie dialog worker"

    def __init__(self, lib_path: str | os.PathLike, config: Mapping, lut_npy: str | os.PathLike, *,
                 timeout: float):
        tmp = Path(tempfile.mkdtemp(prefix="vlmrun-genie-dialog-"))
        cfg = tmp / "genie_config.json"
        cfg.write_text(json.dumps(config, indent=1))
        super().__init__([sys.executable, "-m", "vlmrun_qualcomm.genie_session", "--lib", str(lib_path),
                          "--config", str(cfg), "--lut", str(lut_npy)], timeout=timeout, tmp=tmp)

    def query(self, embeds: np.ndarray) -> Iterator[int]:
        path = self._tmp / "embeddings.raw"
        write_embeddings(path, embeds)
        self.send(f"QUERY {path}")
        for word, rest in self.events():
            if word == "TOKEN":
                yield int(rest)


class DialogState(DecoderState):
    """A conversation kept in a Genie dialog (``decoder_state`` of a decoder Genie generates for): the dialog alive
    in its worker between turns, each turn's new rows fed on top of its KV cache. The host keeps the rows the dialog
    holds (prompt rows, and each generated token's row but the last), so what Genie cannot do in place it does by
    replay: a `truncate` to fewer positions, other sampling settings or a lost worker start a new dialog fed
    the kept rows and the new ones in one query (the positions from the divergence on are computed again, as a
    recompute from scratch would).

    ``make_config(request)`` gives the dialog config of a request; ``lut_npy`` the LUT Genie embeds tokens with."""

    def __init__(self, lib_path, make_config, lut_npy, hidden: int, timeout: float):
        self.lib_path, self.make_config, self.lut_npy, self.timeout = lib_path, make_config, lut_npy, timeout
        self.session: DialogSession | None = None
        self.key = ""
        self.rows = np.zeros((0, hidden), np.float32)
        self.length = 0
        self.in_sync = False  # the dialog holds exactly ``rows``

    def truncate(self, n: int) -> bool:
        if n < self.length:
            self.rows, self.length, self.in_sync = self.rows[:n], n, False
        return True

    def reset(self) -> None:
        self.close()
        self.rows, self.length = self.rows[:0], 0

    def close(self) -> None:
        if self.session is not None:
            self.session.close()
        self.session, self.in_sync = None, False

    @property
    def nbytes(self) -> int:
        return int(self.rows.nbytes) + (self.session.rss() if self.session is not None and self.session.alive else 0)

    def decode(self, request) -> Iterator[int]:
        config = self.make_config(request)
        key = json.dumps(config, sort_keys=True)
        new = np.asarray(request.inputs_embeds, np.float32).reshape(-1, self.rows.shape[1])
        self.replayed = 0
        if self.session is None or not self.session.alive or not self.in_sync or key != self.key:
            self.close()
            self.session, self.key = DialogSession(self.lib_path, config, self.lut_npy, timeout=self.timeout), key
            new = np.concatenate([self.rows, new])  # replay what the dialog must hold, then the new rows
            self.replayed, self.rows = len(self.rows), self.rows[:0]
        return self._stream(new, request)

    def _stream(self, feed: np.ndarray, request) -> Iterator[int]:
        base = np.concatenate([self.rows, feed])
        self.in_sync = False
        generated: list[int] = []
        finished = False
        tokens = self.session.query(feed)
        try:
            self.length = len(base)
            for tok in tokens:
                generated.append(tok)
                self.length = len(base) + len(generated) - 1
                yield tok
            finished = True
        except GeneratorExit:  # the caller stopped (its budget, a stop string): Genie ends its query anyway; its
            generated += list(tokens)  # rest, bounded by the session's timeout, keeps the dialog's state known
            finished = True
            raise
        finally:
            # Genie does not hand out the end token it stops at (sampled, not fed): an answer that ended before the
            # budget had every token it handed out fed; at the budget (or stopped early) the last one was not
            fed = generated if finished and len(generated) < request.max_new_tokens else generated[:-1]
            tail = (np.asarray(request.embed_tokens(np.asarray(fed, np.int64)), np.float32).reshape(-1, base.shape[1])
                    if fed else base[:0])
            self.rows = np.concatenate([base, tail])
            self.length = len(self.rows)
            if finished:
                self.in_sync = True
            else:  # stopped mid-query: the dialog's state is unknown; the next turn replays the rows
                self.close()


# -- the worker -------------------------------------------------------------------------------------------------
def _worker(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m vlmrun_qualcomm.genie_session")
    ap.add_argument("--lib", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--lut", required=True, help=".npy float32 [V,H]")
    a = ap.parse_args(argv)
    out = Replies()
    try:
        lut = np.load(a.lut, mmap_mode="r")
        dialog = GenieLibrary(a.lib).dialog(Path(a.config).read_text(), profile=False)
    except BackendError as exc:
        return out.failed(exc)

    def query(path: str) -> None:
        emb = np.fromfile(path, dtype=np.float32).reshape(-1, lut.shape[1])
        for tok in dialog.stream_tokens(emb, lut):
            out.write("TOKEN", tok)

    out.write("READY")
    with dialog:
        serve_commands(out, {"QUERY": query, "RESET": lambda _: dialog.reset()})
    return 0


if __name__ == "__main__":
    sys.exit(_worker())
