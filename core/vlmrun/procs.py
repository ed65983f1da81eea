"""Running external tools: argument lists, a timeout, and the whole process group killed on a hang.

Plugins drive SDK tools, device transports and worker processes through these two calls:

>>> result = run(["tool", "--flag", value], timeout=60, what="tool")       # CompletedProcess (text)
>>> with watched(argv, timeout=600, what="worker") as w:                   # stream a long-running process
...     for line in w.proc.stdout: ...

A tool is started in its own session (process group), so a timeout or an interrupt kills it *and* whatever it
started (a shell, a device server's round trip, a child holding the pipes). Failing to start and timing out are one
`vlmrun.errors.BackendError` line each; a non-zero exit is the caller's to judge (it knows the tool).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Iterator, Mapping, Sequence

import attrs

from .errors import BackendError


class Terminated(BaseException):
    """SIGTERM reached a vlmrun command (`raise_on_sigterm`): raised in its main thread so that, as for Ctrl-C,
    every `watched` tool's group is killed and every half-written artifact removed on the way out. Before, a worker
    in its own session outlived a terminated vlmrun. A BaseException: no ``except Exception`` swallows it."""


def _terminated(signum, frame) -> None:
    raise Terminated()


def raise_on_sigterm() -> None:
    """Turn SIGTERM into `Terminated` in this process (from its main thread; elsewhere a no-op). A server that
    installs its own handlers (uvicorn's) replaces this one."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminated)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc``'s process group (``proc`` itself when the group is gone) and reap it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        with contextlib.suppress(OSError):
            proc.kill()
    with contextlib.suppress(Exception):
        proc.wait(timeout=5)


@attrs.define
class Watch:
    """A started process under a deadline: ``proc`` (its pipes are yours to read) and ``timed_out``."""

    proc: subprocess.Popen
    timeout: float
    timed_out: bool = False
    stacks_signal: int | None = None

    def _expire(self) -> None:
        self.timed_out = True
        ask_for_stacks(self.proc, self.stacks_signal)
        kill_group(self.proc)


def ask_for_stacks(proc: subprocess.Popen, sig: int | None, wait_s: float = 1.0) -> None:
    """Send a hung ``proc`` the signal on which it dumps its threads' stacks (to its stderr) and give it
    ``wait_s`` to write them, before it is killed; nothing when ``sig`` is None."""
    if sig is None or proc.poll() is not None:
        return
    with contextlib.suppress(OSError):
        os.kill(proc.pid, sig)
    time.sleep(wait_s)


def _start(argv: Sequence[str], what: str, **kw) -> subprocess.Popen:
    if isinstance(argv, (str, bytes)):
        raise TypeError("argv must be a list of arguments, never a shell string")
    try:
        return subprocess.Popen([str(a) for a in argv], start_new_session=True, **kw)
    except OSError as exc:
        raise BackendError(f"{what} could not start ({argv[0]}): {exc.strerror or exc}") from None


@contextlib.contextmanager
def watched(argv: Sequence[str], *, timeout: float, what: str, cwd: str | os.PathLike | None = None,
            env: Mapping[str, str] | None = None, text: bool = True,
            stdin: int | None = subprocess.DEVNULL, stacks_signal: int | None = None) -> Iterator[Watch]:
    """Start ``argv`` with piped stdout/stderr and kill its group after ``timeout`` s, on an exception in the
    block, or when the block ends with the process still running. ``env`` replaces the environment.
    ``stacks_signal``: sent before a timeout's kill to a process that dumps its stacks on it (vlmrun's workers)."""
    proc = _start(argv, what, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=stdin, cwd=cwd,
                  env=dict(env) if env is not None else None, text=text)
    w = Watch(proc, timeout, stacks_signal=stacks_signal)
    timer = threading.Timer(timeout, w._expire)
    timer.daemon = True
    timer.start()
    try:
        yield w
    finally:
        timer.cancel()
        if proc.poll() is None:
            kill_group(proc)
        for f in (proc.stdout, proc.stderr):
            with contextlib.suppress(Exception):
                f.close()


def run(argv: Sequence[str], *, timeout: float, what: str, cwd: str | os.PathLike | None = None,
        env: Mapping[str, str] | None = None, on_stdout: Callable[[str], None] | None = None,
        hint: str = "") -> subprocess.CompletedProcess:
    """Run ``argv`` to completion (text output). ``on_stdout`` gets stdout as it arrives (for streaming).

    :raises BackendError: the tool could not start, or ran past ``timeout`` (its group is killed); ``hint``
        is appended to the timeout line (what the user can do about it).
    """
    with watched(argv, timeout=timeout, what=what, cwd=cwd, env=env, text=False) as w:
        err_box: list[bytes] = []
        err_reader = threading.Thread(target=lambda: err_box.append(w.proc.stderr.read()), daemon=True)
        err_reader.start()
        chunks: list[bytes] = []
        for chunk in iter(lambda: w.proc.stdout.read1(4096), b""):
            chunks.append(chunk)
            if on_stdout is not None:
                on_stdout(chunk.decode("utf-8", "replace"))
        w.proc.wait()
        err_reader.join(5)
    if w.timed_out:
        raise BackendError(f"{what} timed out after {timeout:g} s (killed){'; ' + hint if hint else ''}")
    return subprocess.CompletedProcess(list(argv), w.proc.returncode, b"".join(chunks).decode("utf-8", "replace"),
                                       b"".join(err_box).decode("utf-8", "replace"))


@contextlib.contextmanager
def stdout_to_stderr():
    """Point file descriptor 1 at stderr while the block runs: native libraries that print banners on stdout
    (runtimes loading their backends) would otherwise corrupt ``--json`` output and anything that parses it."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
