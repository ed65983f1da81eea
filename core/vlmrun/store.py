"""The artifact store: exported and compiled stages, keyed by everything that determines their bytes.

One directory per key (weights hash, stage, backend, form, options, versions) with a ``manifest.json``
that lists every file with its size and sha256. Artifacts are built in a temporary directory and renamed
into place, so a killed run never leaves a directory that looks complete; an artifact whose files do not
match its manifest is rebuilt.

Location: ``--cache-dir``, else ``$VLMRUN_CACHE_DIR``, else ``$XDG_CACHE_HOME/vlmrun`` (``~/.cache/vlmrun``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable, Mapping

import attrs

from .errors import VlmrunError

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
        path = self.path_for(key)
        try:
            manifest = json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        if path not in self._verified:
            for name, meta in manifest.get("checksums", {}).items():
                if not _intact(path / name, meta):
                    return None
            self._verified.add(path)
        return Artifact(path, manifest)

    def get_or_build(
        self,
        key: Mapping[str, object],
        build: Callable[[Path], dict | None],
        *,
        rebuild: bool = False,
    ) -> Artifact:
        """Return the artifact for ``key``, building it with ``build(tmp_dir) -> manifest`` when needed."""
        if not rebuild:
            found = self.lookup(key)
            if found is not None:
                return found
        path = self.path_for(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{path.name}-", dir=path.parent))
        try:
            manifest = build(tmp)
            if manifest is None:
                raise VlmrunError(f"nothing built artifact {path.name}")
            manifest = dict(manifest)
            manifest["key"] = dict(key)
            manifest["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            manifest["checksums"] = {
                str(f.relative_to(tmp)): {"size": f.stat().st_size, "mtime_ns": f.stat().st_mtime_ns,
                                          "sha256": sha256_file(f)}
                for f in sorted(tmp.rglob("*"))
                if f.is_file()
            }
            (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))
            if path.exists():
                shutil.rmtree(path)
            os.replace(tmp, path)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        self.builds.append(path.name)
        self._verified.add(path)
        return Artifact(path, manifest)

    def clean_stale(self, older_than_s: float = 3600.0) -> None:
        """Remove temporary build directories left by killed runs."""
        parent = self.root / "artifacts"
        if not parent.is_dir():
            return
        now = time.time()
        for d in parent.glob(".tmp-*"):
            try:
                if now - d.stat().st_mtime > older_than_s:
                    shutil.rmtree(d, ignore_errors=True)
            except OSError:
                pass
