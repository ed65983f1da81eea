"""A small adb transport shared by plugins that run on an Android device (qnn_htp's qnn-net-run, Genie).

Every call takes an argument list (never a shell string built by hand), quotes remote paths with
`shlex.quote` inside ``adb shell`` command lines, and has a timeout. Device selection gives one clear
line for: adb missing, no device, several devices without ``--device``, an unauthorized or offline device.

>>> adb = Adb.connect(serial=None)                # exactly one authorized device, else BackendError
>>> adb.push("model.bin", "/data/local/tmp/vlmrun/model.bin")   # skipped when the remote sha256 matches
>>> adb.shell(["ls", "/data/local/tmp/vlmrun"], timeout=10)
>>> run = adb.stream(["./tool", "-s", "script.txt"], cwd=rd, timeout=600, what="tool")
>>> for text in run: ...                          # stdout as it arrives; then run.stdout, run.stderr, run.returncode
"""

from __future__ import annotations

import codecs
import hashlib
import os
import shlex
import shutil
import subprocess
import threading
import time
from pathlib import Path
from typing import Iterator, Mapping, Sequence

from vlmrun import procs
from vlmrun.errors import BackendError

DEFAULT_TIMEOUT = 60.0
ENV_ADB = "VLMRUN_ADB"


def find_adb(path: str | os.PathLike | None = None) -> str:
    """The adb executable: ``path``, else ``$VLMRUN_ADB``, else ``adb`` on PATH (BackendError if none)."""
    cand = str(path) if path else os.environ.get(ENV_ADB) or shutil.which("adb")
    if not cand or not (os.path.isfile(cand) or shutil.which(cand)):
        raise BackendError("adb not found: install Android platform-tools or set VLMRUN_ADB to the adb executable")
    return cand


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _run(argv: Sequence[str], timeout: float, what: str) -> subprocess.CompletedProcess:
    """Run ``argv`` with a timeout; on timeout the whole process group is killed (no orphan holds the pipes)."""
    return procs.run(argv, timeout=timeout, what=what)


def _first_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def list_devices(adb: str | None = None, timeout: float = 10.0) -> list[tuple[str, str]]:
    """``adb devices`` as (serial, state) pairs; state is ``device``, ``unauthorized``, ``offline``, ..."""
    exe = find_adb(adb)
    res = _run([exe, "devices"], timeout, "adb devices")
    if res.returncode != 0:
        raise BackendError(f"adb devices failed: {_first_line(res.stderr or res.stdout)}")
    out = []
    for line in res.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2 and not line.startswith(("List of devices", "*")):
            out.append((parts[0], parts[1]))
    return out


class Adb:
    """One selected device. Build with `connect`."""

    def __init__(self, exe: str, serial: str, timeout: float = DEFAULT_TIMEOUT):
        self.exe = exe
        self.serial = serial
        self.timeout = timeout
        self.pushed: list[str] = []  # remote paths actually transferred (skips are not listed)
        self.skipped: list[str] = []

    @classmethod
    def connect(cls, serial: str | None = None, adb: str | None = None, timeout: float = DEFAULT_TIMEOUT) -> "Adb":
        exe = find_adb(adb)
        devices = list_devices(exe, min(timeout, 15.0))
        if serial:
            states = dict(devices)
            if serial not in states:
                seen = ", ".join(s for s, _ in devices) or "none"
                raise BackendError(f"device {serial} is not connected (adb sees: {seen})")
            _check_state(serial, states[serial])
            return cls(exe, serial, timeout)
        if not devices:
            raise BackendError("no Android device connected: plug one in and enable USB debugging (adb devices)")
        if len(devices) > 1:
            listed = ", ".join(f"{s} ({st})" for s, st in devices)
            raise BackendError(f"several Android devices connected ({listed}); choose one with --device SERIAL")
        _check_state(*devices[0])
        return cls(exe, devices[0][0], timeout)

    # -- raw ---------------------------------------------------------------------------------------------
    def _argv(self, *args: str) -> list[str]:
        return [self.exe, "-s", self.serial, *args]

    def run(self, args: Sequence[str], timeout: float | None = None, what: str | None = None,
            check: bool = True) -> subprocess.CompletedProcess:
        what = what or f"adb {args[0] if args else ''}".strip()
        res = _run(self._argv(*args), timeout or self.timeout, what)
        if check and res.returncode != 0:
            msg = _first_line(res.stderr) or _first_line(res.stdout) or f"exit code {res.returncode}"
            raise BackendError(f"{what} failed on {self.serial}: {msg}")
        return res

    # -- shell ---------------------------------------------------------------------------------------------
    @staticmethod
    def command_line(argv: Sequence[str], cwd: str | None = None, env: Mapping[str, str] | None = None) -> str:
        """The remote shell line for ``argv``: every argument (paths included) shlex-quoted."""
        parts = []
        if cwd:
            parts.append(f"cd {shlex.quote(cwd)} &&")
        if env:
            parts.append("env " + " ".join(f"{k}={shlex.quote(str(v))}" for k, v in env.items()))
        parts.append(shlex.join([str(a) for a in argv]))
        return " ".join(parts)

    def shell(self, argv: Sequence[str], *, cwd: str | None = None, env: Mapping[str, str] | None = None,
              timeout: float | None = None, what: str | None = None, check: bool = True
              ) -> subprocess.CompletedProcess:
        line = self.command_line(argv, cwd, env)
        return self.run(["shell", line], timeout, what or f"adb shell {Path(str(argv[0])).name}", check)

    def stream(self, argv: Sequence[str], *, cwd: str | None = None, env: Mapping[str, str] | None = None,
               timeout: float | None = None, what: str | None = None, hint: str = "") -> "ShellStream":
        """``argv`` run on the device (`command_line`: every argument shlex-quoted) with its stdout read as it
        arrives: iterate the returned `ShellStream`."""
        line = self.command_line(argv, cwd, env)
        return ShellStream(self._argv("shell", line), timeout or self.timeout,
                           what or f"adb shell {Path(str(argv[0])).name}", hint, line)

    def remote_sha256(self, remote: str, timeout: float | None = None) -> str | None:
        res = self.shell(["sha256sum", remote], timeout=timeout, check=False, what="adb shell sha256sum")
        if res.returncode != 0:
            return None
        word = (res.stdout.split() or [""])[0].lower()
        return word if len(word) == 64 else None

    def mkdir(self, remote: str, timeout: float | None = None) -> None:
        self.shell(["mkdir", "-p", remote], timeout=timeout, what="adb shell mkdir")

    # -- files ---------------------------------------------------------------------------------------------
    def push(self, local: str | os.PathLike, remote: str, timeout: float | None = None, skip_same: bool = True) -> bool:
        """Copy ``local`` to ``remote``; returns False (and transfers nothing) when the remote sha256 matches."""
        local = Path(local)
        if not local.is_file():
            raise BackendError(f"adb push: local file {local} does not exist")
        if skip_same and self.remote_sha256(remote, timeout) == _sha256(local):
            self.skipped.append(remote)
            return False
        self.run(["push", str(local), remote], timeout, f"adb push {local.name}")
        self.pushed.append(remote)
        return True

    def pull(self, remote: str, local: str | os.PathLike, timeout: float | None = None) -> Path:
        local = Path(local)
        local.parent.mkdir(parents=True, exist_ok=True)
        self.run(["pull", remote, str(local)], timeout, f"adb pull {Path(remote).name}")
        if not local.exists():
            raise BackendError(f"adb pull {remote}: nothing arrived at {local}")
        return local


class ShellStream:
    """One device command whose stdout is read as it arrives (for answers printed while they are generated).

    Iterating yields stdout text pieces (UTF-8 decoded incrementally, a character never split) as adb hands them
    over; once the command has ended, ``stdout``, ``stderr``, ``returncode`` and ``seconds`` hold the whole run.
    The command runs in its own process group, killed past ``timeout`` seconds (one BackendError line, ``hint``
    appended) or when the iteration is abandoned (the caller stopped reading). A non-zero exit is the caller's to
    judge. ``line``: the remote shell line, as run."""

    def __init__(self, argv: Sequence[str], timeout: float, what: str, hint: str = "", line: str = ""):
        self.argv, self.timeout, self.what, self.hint, self.line = list(argv), float(timeout), what, hint, line
        self.stdout = self.stderr = ""
        self.returncode: int | None = None
        self.seconds = 0.0

    def __iter__(self) -> Iterator[str]:
        decoder = codecs.getincrementaldecoder("utf-8")("replace")
        out: list[str] = []
        err: list[bytes] = []
        t0 = time.perf_counter()
        with procs.watched(self.argv, timeout=self.timeout, what=self.what, text=False) as w:
            reader = threading.Thread(target=lambda: err.append(w.proc.stderr.read()), daemon=True)
            reader.start()
            for chunk in iter(lambda: w.proc.stdout.read1(4096), b""):
                text = decoder.decode(chunk)
                out.append(text)
                if text:
                    yield text
            w.proc.wait()
            reader.join(5)
        self.seconds = time.perf_counter() - t0
        if w.timed_out:
            raise BackendError(f"{self.what} timed out after {self.timeout:g} s (killed)"
                               f"{'; ' + self.hint if self.hint else ''}")
        tail = decoder.decode(b"", final=True)
        out.append(tail)
        if tail:
            yield tail
        self.stdout = "".join(out)
        self.stderr = b"".join(e for e in err if e).decode("utf-8", "replace")
        self.returncode = w.proc.returncode


def _check_state(serial: str, state: str) -> None:
    if state == "device":
        return
    if state == "unauthorized":
        raise BackendError(f"device {serial} is unauthorized: accept the USB debugging prompt on the phone")
    raise BackendError(f"device {serial} is {state}: reconnect it (adb reconnect) and check adb devices")
