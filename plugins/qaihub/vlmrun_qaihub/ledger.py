"""The job ledger: which hub jobs an artifact's compile or run submitted, so a rerun re-attaches to them.

One JSON file per artifact state directory (``<store>/state/<artifact>/qaihub-jobs.json``), written atomically
under a lock; `compile_jobs`, `parts` and `hosted` record their jobs in it and `reattach` words what a rerun
says about them.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import time
from pathlib import Path

LEDGER = "qaihub-jobs.json"


class Ledger:
    """``<state dir>/qaihub-jobs.json``: key -> {job_id, model_id, state, ...}, so a rerun re-attaches to a job
    an interrupted run submitted instead of uploading and submitting again. Written atomically under a lock.
    The state directory is the artifact's own (``vlmrun.stages.CompileContext.state_dir``); keys name the
    hub (api_url), the device and the options."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.path = self.root / LEDGER

    @contextlib.contextmanager
    def _locked(self):
        self.root.mkdir(parents=True, exist_ok=True)
        lock = open(self.root / (LEDGER + ".lock"), "a+")
        try:
            try:
                import fcntl

                fcntl.flock(lock, fcntl.LOCK_EX)
            except ImportError:  # pragma: no cover (Windows)
                pass
            yield
        finally:
            lock.close()

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _write(self, data: dict) -> None:
        fd, tmp = tempfile.mkstemp(prefix=".qaihub-jobs-", dir=self.root)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
        os.replace(tmp, self.path)

    def get(self, key: str) -> dict | None:
        with self._locked():
            return self._read().get(key)

    def entries(self, prefix: str = "") -> dict[str, dict]:
        """The entries whose keys start with ``prefix`` (one read)."""
        with self._locked():
            return {k: v for k, v in self._read().items() if k.startswith(prefix) and isinstance(v, dict)}

    def keys(self, prefix: str = "") -> list[str]:
        """The keys starting with ``prefix``."""
        with self._locked():
            return sorted(k for k in self._read() if k.startswith(prefix))

    def update(self, key: str, **fields) -> dict:
        with self._locked():
            data = self._read()
            entry = {**data.get(key, {}), **{k: v for k, v in fields.items()}, "updated": time.time()}
            data[key] = entry
            self._write(data)
            return entry

    def prune(self, prefix: str, keep: int, state: str = "done") -> list[str]:
        """Forget all but the ``keep`` most recently updated entries in ``state`` under ``prefix``; their keys."""
        with self._locked():
            data = self._read()
            old = sorted((k for k, v in data.items() if k.startswith(prefix) and isinstance(v, dict)
                          and v.get("state") == state), key=lambda k: data[k].get("updated", 0), reverse=True)
            gone = old[max(0, keep):]
            for k in gone:
                data.pop(k)
            if gone:
                self._write(data)
            return gone

    def drop(self, key: str) -> None:
        with self._locked():
            data = self._read()
            if data.pop(key, None) is not None:
                self._write(data)
