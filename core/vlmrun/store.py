"""The artifact store: exported and compiled stages, keyed by everything that determines their bytes.

One directory per key (weights hash, stage, backend, form, options, versions) with a ``manifest.json``
that lists every file with its size and sha256. Artifacts are built in a temporary directory and renamed
into place (`vlmrun.atomic.atomic_directory`), so a killed run never leaves a directory that looks
complete; an artifact whose files do not match its manifest is rebuilt. `ArtifactStore.clean_stale`
removes the temporary directories of builders that are gone. The mtime of an artifact's ``manifest.json`` is
when it was last used (``lookup`` touches it; the manifest is not among the checksummed files).

`ArtifactStore.entries`, `ArtifactStore.verify` and `ArtifactStore.prune` are what
``vlmrun store list|verify|prune`` show.

Location: ``--cache-dir``, else ``$VLMRUN_CACHE_DIR``, else ``$XDG_CACHE_HOME/vlmrun`` (``~/.cache/vlmrun``).
"""

from __future__ import annotations

import calendar
import hashlib
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Iterable, Mapping

import attrs

from . import atomic
from .atomic import atomic_directory
from .errors import UsageError, VlmrunError

ENV_CACHE_DIR = "VLMRUN_CACHE_DIR"
MANIFEST = "manifest.json"


def default_cache_dir() -> Path:
    if os.environ.get(ENV_CACHE_DIR):
        return Path(os.environ[ENV_CACHE_DIR]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "vlmrun"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def key_digest(key: Mapping[str, object]) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


FULL_HASH_LIMIT = 256 * 1024 * 1024  # bytes; larger files are re-hashed only when size or mtime changed


def _intact(f: Path, meta: Mapping[str, object]) -> bool:
    """Does ``f`` still match its manifest entry? Files up to FULL_HASH_LIMIT are always re-hashed (compiled
    binaries, small graphs); a multi-GB weight file is re-hashed when its size or mtime differ from the
    manifest's, which keeps a warm start of a full-size model from reading gigabytes."""
    try:
        st = f.stat()
    except OSError:
        return False
    if st.st_size != meta["size"]:
        return False
    if st.st_size > FULL_HASH_LIMIT and meta.get("mtime_ns") == st.st_mtime_ns:
        return True
    return sha256_file(f) == meta["sha256"]


class _Held:
    """A held `filelock.FileLock`, released when the ``with`` block ends."""

    def __init__(self, lock):
        self.lock = lock

    def __enter__(self):
        return self.lock

    def __exit__(self, *exc):
        self.lock.release()


@attrs.frozen
class Artifact:
    """A complete, verified directory in the store."""

    path: Path
    manifest: dict

    def file(self, name: str | None = None) -> Path:
        """A file of the artifact: ``name``, or the first one the manifest lists under ``files``."""
        return self.path / (name or self.manifest["files"][0])


class ArtifactStore:
    """See the module docstring. ``builds`` counts how many artifacts this instance built (for tests)."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root).expanduser() if root else default_cache_dir()
        self.builds: list[str] = []
        self._verified: set[Path] = set()

    def path_for(self, key: Mapping[str, object]) -> Path:
        name = "-".join(str(key.get(k)) for k in ("stage", "backend", "kind") if key.get(k))
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "artifact"
        return self.root / "artifacts" / f"{safe}-{key_digest(key)}"

    def lookup(self, key: Mapping[str, object]) -> Artifact | None:
        """The artifact for ``key`` if it exists and every file matches its manifest."""
        return self._open(self.path_for(key))

    def artifact(self, name: str) -> Artifact | None:
        """The artifact stored under ``name`` (its directory's name, as a key's ``source`` or a bundle records it)
        if it exists and every file matches its manifest; ``None`` otherwise."""
        if not name or "/" in name or name in (".", ".."):
            return None
        return self._open(self.artifacts_dir / name)

    def find(self, where: Callable[[dict], bool] | None = None) -> list[Artifact]:
        """Every complete artifact whose key ``where(key)`` accepts (all of them without it), in name order; files
        are not re-hashed (`artifact` or `lookup` does that before one is used)."""
        found = []
        for mf in sorted(self.artifacts_dir.glob(f"*/{MANIFEST}")):
            manifest = _read_manifest(mf.parent)
            if manifest is not None and (where is None or where(dict(manifest.get("key") or {}))):
                found.append(Artifact(mf.parent, manifest))
        return found

    def state_dir(self, name: str) -> Path:
        """A directory beside artifact ``name`` that persists across runs and rebuilds (a remote job ledger, a
        plugin's bookkeeping), created on first call."""
        d = self.root / "state" / name
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _open(self, path: Path) -> Artifact | None:
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        if path not in self._verified:
            for name, meta in manifest.get("checksums", {}).items():
                if not _intact(path / name, meta):
                    return None
            self._verified.add(path)
        _touch(path)
        return Artifact(path, manifest)

    def get_or_build(
        self,
        key: Mapping[str, object],
        build: Callable[[Path], dict | None],
        *,
        rebuild: bool = False,
    ) -> Artifact:
        """Return the artifact for ``key``, building it with ``build(tmp_dir) -> manifest`` when needed.

        One process builds a key at a time (a file lock per key under ``locks/``): a second vlmrun (a server, an
        eval beside it, a test worker) that needs the same artifact waits for it and reuses it instead of building
        it again."""
        if not rebuild:
            found = self.lookup(key)
            if found is not None:
                return found
        path = self.path_for(key)
        with self._build_lock(path):
            if not rebuild:
                found = self.lookup(key)  # built by another process while this one waited
                if found is not None:
                    return found
            return self._build(key, path, build)

    def _lock(self, name: str):
        """The build lock of artifact ``name`` (a `filelock.FileLock` under ``locks/``, not acquired)."""
        from filelock import FileLock

        locks = self.root / "locks"
        locks.mkdir(parents=True, exist_ok=True)
        return FileLock(str(locks / f"{name}.lock"))

    def _build_lock(self, path: Path):
        from filelock import Timeout

        lock = self._lock(path.name)
        try:
            lock.acquire(timeout=0)
        except Timeout:
            import sys

            print(f"vlmrun: waiting for another process that is building {path.name}", file=sys.stderr, flush=True)
            lock.acquire()
        return _Held(lock)

    def _build(self, key: Mapping[str, object], path: Path, build: Callable[[Path], dict | None]) -> Artifact:
        with atomic_directory(path, replace=True) as tmp:
            manifest = build(tmp)
            if manifest is None:
                raise VlmrunError(f"nothing built artifact {path.name}")
            manifest = dict(manifest)
            manifest["key"] = dict(key)
            manifest["created"] = time.strftime(TIME_FORMAT, time.gmtime())
            manifest["checksums"] = {
                str(f.relative_to(tmp)): {"size": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns,
                                          "sha256": sha256_file(f)}
                for f in sorted(tmp.rglob("*"))
                if f.is_file()
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
        self.builds.append(path.name)
        self._verified.add(path)
        return Artifact(path, manifest)

    # -- hygiene --------------------------------------------------------------------------------------------
    @property
    def artifacts_dir(self) -> Path:
        return self.root / "artifacts"

    def temp_dirs(self) -> list[Path]:
        """Temporary build directories in the store, stale or in progress."""
        return atomic.temp_dirs(self.artifacts_dir)

    def stale_temp_dirs(self, older_than_s: float = atomic.UNOWNED_STALE_S) -> list[Path]:
        """Temporary build directories whose builder is gone (``older_than_s`` applies to those without an owner
        file, left by older vlmrun versions)."""
        return atomic.stale_temp_dirs(self.artifacts_dir, unowned_after_s=older_than_s)

    def clean_stale(self, older_than_s: float = atomic.UNOWNED_STALE_S) -> list[Path]:
        """Remove temporary build directories left by killed runs (never one whose builder still runs);
        returns what was removed. Called when a pipeline opens the store."""
        removed = []
        for d in self.stale_temp_dirs(older_than_s):
            shutil.rmtree(d, ignore_errors=True)
            if not os.path.lexists(d):
                removed.append(d)
        return removed

    def unfinished_states(self) -> list[Path]:
        """State folders (`state_dir`) that hold something for an artifact the store does not have, no build of it
        running: what a stopped build kept to resume from (a parts decoder's made parts, a cloud compile's job
        ledger). The next build of the same artifact takes them; `prune` with ``everything`` removes them."""
        from filelock import Timeout

        root = self.root / "state"
        if not root.is_dir():
            return []
        found = []
        for d in sorted(root.iterdir()):
            if not d.is_dir() or (self.artifacts_dir / d.name).exists() or not any(d.iterdir()):
                continue
            lock = self._lock(d.name)
            try:
                lock.acquire(timeout=0)
            except Timeout:  # its build is running
                continue
            lock.release()
            found.append(d)
        return found

    # -- listing, verifying, pruning ------------------------------------------------------------------------
    def entries(self) -> list["StoreEntry"]:
        """Every artifact directory in the store (complete or not), sorted by name."""
        parent = self.artifacts_dir
        if not parent.is_dir():
            return []
        dirs = sorted(p for p in parent.iterdir() if p.is_dir() and not p.name.startswith("."))
        manifests = {p.name: _read_manifest(p) for p in dirs}
        names = _model_names(self.root, manifests)
        return [_entry(p, manifests, names) for p in dirs]

    def verify(self, entries: "list[StoreEntry] | None" = None) -> list["Verdict"]:
        """Re-hash every file of every artifact against its manifest (no size/mtime shortcut)."""
        verdicts = []
        for entry in self.entries() if entries is None else entries:
            problems = _problems(entry)
            if problems:
                self._verified.discard(entry.path)
            verdicts.append(Verdict(entry, tuple(problems)))
        return verdicts

    def prune(
        self,
        *,
        stages: Iterable[str] = (),
        backends: Iterable[str] = (),
        older_than_s: float | None = None,
        unused_for_s: float | None = None,
        everything: bool = False,
        dry_run: bool = False,
        now: float | None = None,
    ) -> "PruneResult":
        """Remove the artifacts matching every given filter (stage in ``stages``, backend in ``backends``, created
        more than ``older_than_s`` ago, last used more than ``unused_for_s`` ago) and the stale temporary build
        directories. With no filter, ``everything=True`` is required (every artifact goes, and the state a stopped
        build kept to resume from: `unfinished_states`)."""
        stages, backends = set(stages), set(backends)
        if not (stages or backends or older_than_s is not None or unused_for_s is not None or everything):
            raise UsageError("pruning needs a filter (stage, backend, age, unused time) or everything=True")
        now = time.time() if now is None else now

        def matches(e: StoreEntry) -> bool:
            if stages and e.stage not in stages:
                return False
            if backends and e.backend not in backends:
                return False
            if older_than_s is not None and not (e.created is not None and now - e.created > older_than_s):
                return False
            if unused_for_s is not None and not (e.last_used is not None and now - e.last_used > unused_for_s):
                return False
            return True

        chosen = [e for e in self.entries() if matches(e)]
        temps = [(d, atomic.tree_size(d)) for d in self.stale_temp_dirs()]
        states = [(d, atomic.tree_size(d)) for d in self.unfinished_states()] if everything else []
        if not dry_run:
            for e in chosen:
                atomic.discard(e.path)
                self._verified.discard(e.path)
            temps = [(d, size) for d, size in temps if _remove(d)]
            states = [(d, size) for d, size in states if _remove(d)]
        return PruneResult(tuple(chosen), tuple(temps), dry_run, tuple(states))


TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


def _touch(path: Path) -> None:
    """Record a use of an artifact: the mtime of its manifest.json (not among the checksummed files)."""
    try:
        os.utime(path / MANIFEST)
    except OSError:  # a read-only store still works
        pass


def _remove(d: Path) -> bool:
    shutil.rmtree(d, ignore_errors=True)
    return not os.path.lexists(d)


def _iso(t: float | None) -> str | None:
    return None if t is None else time.strftime(TIME_FORMAT, time.gmtime(t))


def _read_manifest(path: Path) -> dict | None:
    try:
        m = json.loads((path / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    return m if isinstance(m, dict) else None


@attrs.frozen
class StoreEntry:
    """One artifact directory as ``vlmrun store list`` shows it. ``manifest`` is None for an incomplete one."""

    name: str
    path: Path
    manifest: dict | None
    model: str | None  # weights hash of the model the artifact was made from (followed through "source")
    model_name: str | None  # that model's name or directory, when the store knows it
    stage: str | None
    backend: str | None
    compiler: str | None
    kind: str | None
    form: str | None
    precision: str | None
    size: int  # bytes, every file in the directory
    created: float | None  # epoch seconds
    last_used: float | None

    def to_json(self) -> dict:
        return {
            "name": self.name, "path": str(self.path), "model": self.model, "model_name": self.model_name,
            "stage": self.stage, "backend": self.backend, "compiler": self.compiler, "kind": self.kind,
            "form": self.form, "precision": self.precision, "size": self.size, "created": _iso(self.created),
            "last_used": _iso(self.last_used), "complete": self.manifest is not None,
        }


@attrs.frozen
class Verdict:
    entry: StoreEntry
    problems: tuple[str, ...]

    @property
    def ok(self) -> bool:
        return not self.problems


@attrs.frozen
class PruneResult:
    removed: tuple[StoreEntry, ...]
    temp_dirs: tuple[tuple[Path, int], ...]  # (path, bytes)
    dry_run: bool
    states: tuple[tuple[Path, int], ...] = ()  # (path, bytes): `ArtifactStore.unfinished_states`

    @property
    def freed(self) -> int:
        return (sum(e.size for e in self.removed) + sum(size for _, size in self.temp_dirs)
                + sum(size for _, size in self.states))


def _model_names(root: Path, manifests: Mapping[str, dict | None]) -> dict[str, str]:
    """weights hash -> a name for the model, from the store's weights-hash cache (model directory -> hash)."""
    try:
        cache = json.loads((root / "weights-hashes.json").read_text())
    except (OSError, ValueError):
        return {}
    artifacts = (root / "artifacts").resolve()
    names = {}
    for path, entry in cache.items() if isinstance(cache, dict) else ():
        digest = entry.get("sha256") if isinstance(entry, dict) else None
        if not isinstance(digest, str):
            continue
        p = Path(path)
        m = manifests.get(p.name) if p.parent == artifacts else None
        key = (m or {}).get("key") or {}
        if m and m.get("converted_from"):
            names[digest] = str(m["converted_from"])
        elif m and key.get("stage") == "model":
            names[digest] = " ".join(str(v) for v in (key.get("kind"), key.get("image_size") and
                                                      f"{key['image_size']}px") if v)
        else:
            names[digest] = path
    return names


def _model_of(name: str, manifests: Mapping[str, dict | None], depth: int = 0) -> str | None:
    key = (manifests.get(name) or {}).get("key") or {}
    if key.get("weights"):
        return str(key["weights"])
    if key.get("source") and depth < 8:
        return _model_of(str(key["source"]), manifests, depth + 1)
    return None


def _entry(path: Path, manifests: Mapping[str, dict | None], names: Mapping[str, str]) -> StoreEntry:
    m = manifests.get(path.name)
    key = (m or {}).get("key") or {}
    options = key.get("options") if isinstance(key.get("options"), dict) else {}
    model = _model_of(path.name, manifests)
    if model is None and key.get("stage") == "model":
        model_name = " ".join(str(v) for v in (key.get("kind"), key.get("image_size") and f"{key['image_size']}px")
                              if v)
    else:
        model_name = names.get(model) if model else None
    created = None
    if m and isinstance(m.get("created"), str):
        try:
            created = float(calendar.timegm(time.strptime(m["created"], TIME_FORMAT)))
        except ValueError:
            created = None
    try:
        last_used = (path / MANIFEST).stat().st_mtime if m else None
    except OSError:
        last_used = None
    if created is None:
        try:
            created = path.stat().st_mtime
        except OSError:
            pass

    def text(v) -> str | None:
        return None if v is None else str(v)

    return StoreEntry(
        name=path.name, path=path, manifest=m, model=model, model_name=model_name, stage=text(key.get("stage")),
        backend=text(key.get("backend")), compiler=text(key.get("compiler")), kind=text(key.get("kind")),
        form=text((m or {}).get("form") or (m or {}).get("source_form")),
        precision=text((m or {}).get("precision") or options.get("precision")),
        size=atomic.tree_size(path), created=created, last_used=last_used if last_used is not None else created,
    )


def _problems(entry: StoreEntry) -> list[str]:
    if entry.manifest is None:
        return [f"{MANIFEST} missing or unreadable (an incomplete artifact)"]
    checksums = entry.manifest.get("checksums")
    if not isinstance(checksums, dict):
        return [f"{MANIFEST} has no checksums"]
    problems = []
    for name, meta in sorted(checksums.items()):
        f = entry.path / name
        try:
            size = f.stat().st_size
        except OSError:
            problems.append(f"{name}: missing")
            continue
        if size != meta.get("size"):
            problems.append(f"{name}: {size} bytes, the manifest says {meta.get('size')}")
        elif sha256_file(f) != meta.get("sha256"):
            problems.append(f"{name}: sha256 differs from the manifest")
    return problems
