"""Directories that appear complete or not at all, and the clean-up of the ones a killed run left behind.

`atomic_directory` is the one place vlmrun builds a directory (store artifacts, ``make_tiny``, checkpoint
conversions). It makes a temporary directory next to the destination (same filesystem, so the final rename is
atomic)::

    <parent>/.tmp-<dest name>-<random>/
        vlmrun-owner.json   who is building: pid, the process's start time, host, boot id
        out/                what the caller fills (yielded), renamed onto <dest> on success
        old/                a replaced <dest>, moved aside and deleted with the rest

On any exception (``KeyboardInterrupt`` included) the whole temporary directory is removed. A run killed with
SIGKILL cannot clean up; `is_stale` tells such a leftover from a build in progress: its builder's pid is
gone or belongs to a process started at another time (pid reuse). Builders on another host cannot be checked:
their directories are left alone for a day.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import socket
import tempfile
import time
from pathlib import Path
from typing import Iterator, Mapping

from .errors import UsageError, VlmrunError

TMP_PREFIX = ".tmp-"
OWNER_FILE = "vlmrun-owner.json"
BUILD_DIR = "out"
OLD_DIR = "old"

#: A temporary directory without an owner file (written by an older vlmrun) is removed only after this long.
UNOWNED_STALE_S = 3600.0
#: A temporary directory whose builder ran on another host is removed only after this long.
FOREIGN_STALE_S = 24 * 3600.0

#: Names of temporary build directories: this module's, and those of older vlmrun versions.
TEMP_PATTERNS = (f"{TMP_PREFIX}*", ".*.building-*", ".*.converting-*", ".*.old-*")


# -- who is building ----------------------------------------------------------------------------------------------
def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, start time in clock ticks since boot) from ``/proc/<pid>/stat``; None if unreadable."""
    try:
        data = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    try:
        rest = data[data.rindex(")") + 2:].split()  # the command name (field 2) may hold spaces and parentheses
        return rest[0], int(rest[19])  # fields 3 (state) and 22 (starttime)
    except (ValueError, IndexError):
        return None


def process_start_time(pid: int) -> int | None:
    """The start time of process ``pid`` (clock ticks since boot), None where ``/proc`` is not available."""
    stat = _proc_stat(pid)
    return stat[1] if stat else None


def _boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return None


def owner_record() -> dict:
    """What `atomic_directory` writes into its temporary directory about the current process."""
    pid = os.getpid()
    return {"pid": pid, "start_time": process_start_time(pid), "host": socket.gethostname(), "boot_id": _boot_id(),
            "created": time.time()}


def read_owner(tmp_dir: Path) -> dict | None:
    try:
        owner = json.loads((Path(tmp_dir) / OWNER_FILE).read_text())
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) and isinstance(owner.get("pid"), int) else None


def builder_alive(owner: Mapping) -> bool | None:
    """Is the process an owner record describes still running? None when that cannot be told (another host)."""
    if owner.get("host") != socket.gethostname():
        return None
    boot = _boot_id()
    if owner.get("boot_id") and boot and owner["boot_id"] != boot:
        return False  # the machine rebooted since
    pid = owner["pid"]
    stat = _proc_stat(pid)
    if stat is not None:
        state, start = stat
        if state in ("Z", "X"):  # a zombie: killed, not yet reaped by its parent
            return False
        return owner.get("start_time") in (None, start)  # another start time: the pid was reused
    if Path("/proc/self/stat").exists():
        return False  # /proc works and has no such pid
    try:  # no /proc (macOS): signal 0 only tells whether the pid exists
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def is_stale(tmp_dir: Path, *, unowned_after_s: float = UNOWNED_STALE_S, now: float | None = None) -> bool:
    """May the temporary build directory ``tmp_dir`` be removed? Yes if its builder is gone (whatever its age);
    never while its builder runs; without an owner file (older vlmrun) once older than ``unowned_after_s``."""
    now = time.time() if now is None else now
    try:
        age = now - Path(tmp_dir).stat().st_mtime
    except OSError:
        return False
    owner = read_owner(tmp_dir)
    if owner is None:
        return age > unowned_after_s
    alive = builder_alive(owner)
    if alive is None:
        return age > FOREIGN_STALE_S
    return not alive


def temp_dirs(parent: Path, patterns=TEMP_PATTERNS) -> list[Path]:
    """Temporary build directories directly in ``parent`` (stale or not)."""
    parent = Path(parent)
    if not parent.is_dir():
        return []
    found = {p for pattern in patterns for p in parent.glob(pattern) if p.is_dir() and not p.is_symlink()}
    return sorted(found)


def stale_temp_dirs(parent: Path, *, unowned_after_s: float = UNOWNED_STALE_S) -> list[Path]:
    return [d for d in temp_dirs(parent) if is_stale(d, unowned_after_s=unowned_after_s)]


# -- building -----------------------------------------------------------------------------------------------------
def _write_owner(work: Path) -> None:
    tmp = work / f".{OWNER_FILE}.tmp"
    tmp.write_text(json.dumps(owner_record()))
    os.replace(tmp, work / OWNER_FILE)


def _new_work_dir(dest: Path) -> Path:
    dest.parent.mkdir(parents=True, exist_ok=True)
    # what an earlier, killed build of the same destination left beside it (its builder gone) goes first
    for old in dest.parent.glob(f"{TMP_PREFIX}{dest.name}-*"):
        if old.is_dir() and not old.is_symlink() and is_stale(old):
            shutil.rmtree(old, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}{dest.name}-", dir=dest.parent))
    try:
        _write_owner(work)
    except BaseException:
        shutil.rmtree(work, ignore_errors=True)
        raise
    return work


@contextlib.contextmanager
def atomic_directory(dest: str | os.PathLike, *, replace: bool = False) -> Iterator[Path]:
    """Yield an empty directory to fill; on success it is renamed onto ``dest``, on any exception removed.

    ``replace``: an existing ``dest`` is moved aside and deleted after the rename (readers see the old or the new
    directory, never a mix). Without it ``dest`` must not exist or be an empty directory.
    """
    dest = Path(dest).expanduser().absolute()
    work = _new_work_dir(dest)
    old = work / OLD_DIR
    try:
        out = work / BUILD_DIR
        out.mkdir()
        yield out
        if replace and os.path.lexists(dest):
            os.replace(dest, old)
        try:
            os.replace(out, dest)
        except OSError as err:
            if err.errno in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise VlmrunError(f"{dest} already exists; remove it or choose another directory") from None
            raise
    except BaseException:
        if os.path.lexists(old) and not os.path.lexists(dest):
            with contextlib.suppress(OSError):
                os.replace(old, dest)
        shutil.rmtree(work, ignore_errors=True)
        raise
    shutil.rmtree(work, ignore_errors=True)


def discard(path: str | os.PathLike) -> None:
    """Delete the directory ``path`` as one step for readers: it is first renamed into an owned temporary
    directory (which a killed run leaves for `is_stale` to find), then removed."""
    path = Path(path).absolute()
    if not os.path.lexists(path):
        return
    work = _new_work_dir(path)
    try:
        os.replace(path, work / OLD_DIR)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def destination_problem(path: str | os.PathLike, *, folder: bool) -> str | None:
    """Why ``path`` cannot become a new folder (``folder``) or file, or None: checked before any work, so that a
    long run does not end in an error writing its result. A file where a folder goes (or the converse), a parent
    that is a file, or a place nothing can be created in (a read-only or virtual file system: tried, not guessed)."""
    p = Path(path).expanduser().absolute()
    if p.is_dir():
        return None if folder else "is a folder; give a file name"
    if p.exists():
        return "is a file, not a folder" if folder else None
    parent = p.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot be created: {parent} is a file, not a folder"
    try:
        probe = tempfile.mkdtemp(prefix=TMP_PREFIX + "probe-", dir=parent)
    except OSError as exc:
        return f"cannot be created in {parent} ({exc.strerror or exc})"
    with contextlib.suppress(OSError):
        os.rmdir(probe)
    return None


def check_free_space(target: str | os.PathLike, need: int, label: str | None = None, margin: int = 64 << 20) -> None:
    """Refuse, in one line (`UsageError`), to start writing ``need`` bytes at ``target`` (a file or directory, made
    or to be made) when its disk has fewer than ``need + margin`` free. ``label`` says what needs the room (default:
    ``target`` itself)."""
    parent = Path(target).absolute()
    while not parent.exists():
        parent = parent.parent
    free = shutil.disk_usage(parent).free
    total = need + margin
    if free < total:
        raise UsageError(f"{label or target} needs {total} bytes ({total / 1e9:.1f} GB) free on its disk, which has"
                         f" {free} ({free / 1e9:.1f} GB); free space there or choose another directory (the artifact"
                         " store: --cache-dir or VLMRUN_CACHE_DIR; temporary files: TMPDIR)")


def tree_size(path: Path) -> int:
    """Bytes in the files under ``path`` (apparent sizes; symlinks not followed)."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def link_or_copy(src: str | os.PathLike, dst: str | os.PathLike) -> None:
    """``dst`` as a hard link to ``src`` (no bytes copied), or a copy where the file system has no hard links or
    they cross file systems; an existing ``dst`` is replaced."""
    Path(dst).unlink(missing_ok=True)
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder and a rename: a reader sees the old
    file or the new one, never half of one."""
    import tempfile

    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
