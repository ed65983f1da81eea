"""Where ``vlmrun tune`` builds and measures candidates: in this process (the default) or as Ray tasks (``--ray
ADDRESS``, `vlmrun.cluster`: every node sees the store at the same path). The executors themselves are
`vlmrun.cluster`'s (``vlmrun bundle --ray`` uses them too)."""

from __future__ import annotations

from pathlib import Path

from ..cluster import MIN_TASK_MEMORY, LocalExecutor, RayExecutor, executor

__all__ = ["MIN_TASK_MEMORY", "LocalExecutor", "RayExecutor", "compile_memory_bytes", "executor_for"]


def compile_memory_bytes(model) -> int:
    """The memory one candidate build of ``model`` may take, declared to Ray so two large compiles do not land on
    one node: 8x the checkpoint's weights (FastVLM-0.5B's 4-bit-weight decoder compile peaks at ~17 GB), at least 1 GiB."""
    return max(MIN_TASK_MEMORY, 8 * model.weight_file_bytes)


def executor_for(address: str | None, store_root: Path, model):
    if not address:
        return LocalExecutor()
    return executor(address, store_root, compile_memory_bytes(model))
