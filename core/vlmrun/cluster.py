"""Ray, when vlmrun runs work on a cluster (``vlmrun tune --ray``, ``vlmrun eval --ray``, ``vlmrun bundle --ray``):
joining it, checking that every node sees the artifact store, and running independent jobs where the user asked
(`LocalExecutor`: in this process, in order; `RayExecutor`: each job a Ray task declaring one CPU and its memory).

The store is shared by path: every node must see it at the same path (a shared filesystem). Tasks compile into it
(the store's atomic builds make two nodes building one artifact safe) and write their eval results there; what they
return to the driver are figures. `connect` checks that each node sees the store before any task runs, and
says what to do when one does not.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Callable, Sequence

from .cpu import one_thread_per_worker
from .errors import BackendError, UsageError, VlmrunError

RAY_EXTRA = "pip install 'vlmrun[tune]'"


def _ray():
    try:
        import ray
    except ImportError:
        raise UsageError(f"--ray needs Ray, which is not installed: {RAY_EXTRA}") from None
    return ray


def _sees(path: str) -> tuple[str, bool]:
    import socket

    return socket.gethostname(), Path(path).is_file()


def connect(address: str, store_root: Path):
    """Join the Ray cluster at ``address`` and check that its nodes see the store; UsageError otherwise."""
    host, _, port = address.rpartition(":")
    if host in ("127.0.0.1", "localhost", "::1"):  # a loopback cluster: the driver must not swap in the machine's
        os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # network address (read when Ray is imported)
    ray = _ray()
    if not ray.is_initialized():
        try:
            import socket

            socket.create_connection((host or "127.0.0.1", int(port)), timeout=10).close()
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot join the Ray cluster at {address}: {exc.strerror or exc} (start one with: ray"
                             " start --head, and give its HOST:PORT)") from None
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False, configure_logging=False)
        except Exception as exc:  # ConnectionError, RuntimeError ... : one line
            raise UsageError(f"cannot join the Ray cluster at {address}: {str(exc).splitlines()[0] if str(exc) else exc}"
                             " (start one with: ray start --head)") from None
    token = Path(store_root) / "tune" / f".ray-check-{uuid.uuid4().hex}"
    token.parent.mkdir(parents=True, exist_ok=True)
    token.write_text("vlmrun")
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive")]
        checks = [ray.remote(num_cpus=0)(_sees).options(
            scheduling_strategy=ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
        ).remote(str(token)) for n in nodes]
        for host, seen in ray.get(checks, timeout=120):
            if not seen:
                raise UsageError(f"Ray node {host} does not see the store {store_root}: put it on a filesystem every"
                                 " node mounts at the same path (--cache-dir)")
    finally:
        token.unlink(missing_ok=True)
    return ray


MIN_TASK_MEMORY = 1 << 30  # what a task declares at least (bytes)


class LocalExecutor:
    """Jobs in this process, in order."""

    remote = False  # the jobs see this machine's files

    def map(self, fn: Callable, jobs: Sequence, memory=None, names=None) -> list:
        return [fn(j) for j in jobs]


class RayExecutor:
    """Each job a Ray task on the cluster at ``address`` (joined and checked by `connect`) declaring one CPU and
    ``memory`` bytes (per `map`, one figure for all jobs or one per job; at least `MIN_TASK_MEMORY`), so that Ray
    puts no two jobs on a node that has not the memory for both."""

    remote = True  # the jobs see only what every node sees: the store

    def __init__(self, address: str, store_root: Path, memory: int = MIN_TASK_MEMORY):
        self.address = address
        self.ray = connect(address, store_root)
        self.memory = memory

    def map(self, fn: Callable, jobs: Sequence, memory=None, names=None) -> list:
        """``[fn(job) for job in jobs]`` as Ray tasks (``fn`` module-level, the jobs picklable); the results in
        ``jobs`` order. A failing task: its own `VlmrunError` as it was, anything else one line naming it
        (``names[i]``, default "a Ray task"); the other tasks are cancelled."""
        ray = self.ray
        jobs = list(jobs)
        memory = self.memory if memory is None else memory
        per_job = list(memory) if isinstance(memory, (list, tuple)) else [memory] * len(jobs)
        names = list(names) if names is not None else ["a Ray task"] * len(jobs)
        task = ray.remote(num_cpus=1, max_retries=0)(_run_job)
        refs = [task.options(memory=max(MIN_TASK_MEMORY, int(m)), name=f"vlmrun: {name}"[:100]).remote(fn, j)
                for j, m, name in zip(jobs, per_job, names)]
        out = []
        for i, ref in enumerate(refs):
            try:
                out.append(ray.get(ref))
            except ray.exceptions.RayError as exc:
                for other in refs[i + 1:]:
                    ray.cancel(other, force=True)
                raise_task_error(exc, names[i])
        return out


def _run_job(fn, job):
    one_thread_per_worker()  # a task declares one CPU
    return fn(job)


def executor(address: str | None, store_root: Path, memory: int = MIN_TASK_MEMORY):
    """`RayExecutor` on ``address`` (joined and checked now: a UsageError line when it cannot be), else
    `LocalExecutor`."""
    return RayExecutor(address, store_root, memory) if address else LocalExecutor()


def raise_task_error(exc, what: str):
    """A failed Ray task or actor as vlmrun's error: the task's own VlmrunError as it was, else one line."""
    cause = getattr(exc, "cause", None) or exc
    if isinstance(cause, VlmrunError):
        raise cause from None
    first = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
    raise BackendError(f"{what} failed: {first}") from None
