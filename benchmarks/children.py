"""What the benchmark scripts share: a measured child process, and ``vlmrun serve`` on loopback.

The scripts run as ``python benchmarks/NAME.py``, so this module is importable by its bare name from them.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from typing import Iterator, Sequence


def run_child(argv: Sequence[str], log, rss_key: str = "child_peak_rss_mb") -> dict:
    """``python ARGV`` in a child process whose last stdout line is a JSON object: that object, plus the child's
    wall seconds (``child_wall_s``) and peak RSS (``rss_key``, MB); ``failed`` and ``exit`` when it did not end
    well. Each heavy step in its own process, so one step's memory does not inflate the next's figure."""
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=log, text=True)
    text = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    code = os.waitstatus_to_exitcode(status)
    res = {"child_wall_s": round(time.perf_counter() - t0, 1), rss_key: round(usage.ru_maxrss / 1024)}
    lines = [ln for ln in text.splitlines() if ln.startswith("{")]
    if code != 0 or not lines:
        res.update(failed=True, exit=code)
        return res
    res.update(json.loads(lines[-1]))
    return res


def run_step(argv: Sequence[str], step: str) -> dict:
    """`run_child` for a benchmark step whose figures are quoted as ``wall_s`` and ``peak_rss_gb`` (10^9 bytes),
    with what the step reports; a failed step ends the benchmark, naming it."""
    res = run_child(argv, sys.stderr, rss_key="peak_rss_mib")
    if res.get("failed"):
        raise SystemExit(f"step {step} failed (exit {res['exit']})")
    return {"wall_s": res.pop("child_wall_s"), "peak_rss_gb": round(res.pop("peak_rss_mib") * 1024 / 1e6, 2), **res}


class DiskPeak:
    """Samples the bytes under ``paths`` every ``every`` seconds in a thread while its ``with`` block runs (files
    counted once however many names they have): ``start`` and ``peak`` bytes."""

    def __init__(self, paths: Sequence[str], every: float = 5.0):
        import threading

        self.paths, self.every = list(paths), every
        self.start = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def bytes_now(self) -> int:
        seen, total = set(), 0
        for root in self.paths:
            for dirpath, _dirs, files in os.walk(root):
                for name in files:
                    with contextlib.suppress(OSError):
                        st = os.lstat(os.path.join(dirpath, name))
                        if (st.st_dev, st.st_ino) not in seen:
                            seen.add((st.st_dev, st.st_ino))
                            total += st.st_blocks * 512  # on disk (a sparse file counts what it holds)
        return total

    def _sample(self) -> None:
        while not self._stop.wait(self.every):
            self.peak = max(self.peak, self.bytes_now())

    def __enter__(self) -> "DiskPeak":
        self.start = self.peak = self.bytes_now()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.bytes_now())


class Served:
    """A running ``vlmrun serve``: its base URL, process id and model id."""

    def __init__(self, base: str, pid: int, model_id: str):
        self.base, self.pid, self.model_id = base, pid, model_id


@contextlib.contextmanager
def serve_process(layout: str, port: int, extra: Sequence[str] = ()) -> Iterator[Served]:
    """``vlmrun serve --layout LAYOUT --port PORT EXTRA`` in a subprocess, once its /health answers; stopped after."""
    import httpx

    server = subprocess.Popen([sys.executable, "-m", "vlmrun.cli", "serve", "--layout", layout, "--port", str(port),
                               *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        base = f"http://127.0.0.1:{port}"
        for _ in range(600):
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        yield Served(base, server.pid, httpx.get(f"{base}/v1/models").json()["data"][0]["id"])
    finally:
        server.terminate()
        server.wait(30)
