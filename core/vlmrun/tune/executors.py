"""Where ``vlmrun tune`` builds and measures candidates: in this process (the default) or as Ray tasks (``--ray
ADDRESS``, `vlmrun.cluster`: every node sees the store at the same path)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, Sequence

from ..cluster import connect, raise_task_error

MIN_TASK_MEMORY = 1 << 30


def compile_memory_bytes(model) -> int:
    """The memory one candidate build of ``model`` may take, declared to Ray so two large compiles do not land on
    one node: 8x the checkpoint's weights (FastVLM-0.5B's 4-bit-weight decoder compile peaks at ~17 GB), at least 1 GiB."""
    weights = sum(f.stat().st_size for f in Path(model.path).glob("*.safetensors"))
    return max(MIN_TASK_MEMORY, 8 * weights)


class LocalExecutor:
    def map(self, fn: Callable, jobs: Sequence) -> list:
        return [fn(j) for j in jobs]


class RayExecutor:
    """Each job a Ray task declaring one CPU and ``memory`` bytes."""

    def __init__(self, address: str, store_root: Path, memory: int):
        self.ray = connect(address, store_root)
        self.memory = memory

    def map(self, fn: Callable, jobs: Sequence) -> list:
        ray = self.ray
        task = ray.remote(num_cpus=1, memory=self.memory, max_retries=0)(_run_job)
        refs = [task.remote(fn, j) for j in jobs]
        try:
            return ray.get(refs)
        except ray.exceptions.RayTaskError as exc:
            raise_task_error(exc, "a Ray task")


def _run_job(fn, job):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return fn(job)


def executor_for(address: str | None, store_root: Path, model):
    if not address:
        return LocalExecutor()
    return RayExecutor(address, store_root, compile_memory_bytes(model))
