"""Where candidates and eval items run: in this process (the default) or as Ray tasks (``--ray ADDRESS``).

The store is shared by path: every node must see it at the same path (a shared filesystem). Tasks compile into it
(the store's atomic builds make two nodes building one artifact safe) and write their eval results there; what
they return to the driver is a point's figures. :func:`connect` checks that each node sees the store before any
task runs, and says what to do when one does not.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Callable, Sequence

from ..errors import BackendError, UsageError, VlmrunError

RAY_EXTRA = "pip install 'vlmrun[tune]'"
MIN_TASK_MEMORY = 1 << 30


def compile_memory_bytes(model) -> int:
    """The memory one candidate build of ``model`` may take, declared to Ray so two large compiles do not land on
    one node: 8x the checkpoint's weights (FastVLM-0.5B's w4a16 decoder compile peaks at ~17 GB), at least 1 GiB."""
    weights = sum(f.stat().st_size for f in Path(model.path).glob("*.safetensors"))
    return max(MIN_TASK_MEMORY, 8 * weights)


class LocalExecutor:
    def map(self, fn: Callable, jobs: Sequence) -> list:
        return [fn(j) for j in jobs]


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
    ray = _ray()
    if not ray.is_initialized():
        host, _, port = address.rpartition(":")
        if host in ("127.0.0.1", "localhost", "::1"):  # a loopback cluster: the driver must not swap in the
            os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # machine's network address
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
            cause = exc.cause if getattr(exc, "cause", None) is not None else exc
            if isinstance(cause, VlmrunError):
                raise cause from None
            raise BackendError(f"a Ray task failed: {str(cause).splitlines()[0] if str(cause) else type(cause).__name__}"
                               ) from None


def _run_job(fn, job):
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return fn(job)


def executor_for(address: str | None, store_root: Path, model):
    if not address:
        return LocalExecutor()
    return RayExecutor(address, store_root, compile_memory_bytes(model))


# --------------------------------------------------------------------------------------------------------------
# vlmrun eval --ray: items on Ray actors, each holding the layouts' pipelines (built once per actor)


class EvalActor:
    def __init__(self, config):
        from ..eval import engine

        engine._worker_init(config)

    def item(self, record):
        from ..eval import engine

        return engine._worker_item(record)


def run_items_on_ray(address: str, records: Sequence, config, workers: int, on_item) -> None:
    """``vlmrun eval --ray``: ``records`` over ``workers`` Ray actors (0: one per CPU of the cluster); each calls
    ``on_item(key, results, error)`` here as it finishes."""
    ray = connect(address, Path(config.store))
    from ray.util import ActorPool

    if workers <= 1:
        workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
    workers = min(workers, len(records))
    actor = ray.remote(num_cpus=1, max_restarts=0)(EvalActor)
    actors = [actor.remote(config) for _ in range(workers)]
    pool = ActorPool(actors)
    try:
        for key, results, error in pool.map_unordered(lambda a, r: a.item.remote(r), list(records)):
            on_item(key, results, error)
    except ray.exceptions.RayError as exc:
        cause = getattr(exc, "cause", None) or exc
        if isinstance(cause, VlmrunError):
            raise cause from None
        raise BackendError(f"a Ray eval worker failed: {str(cause).splitlines()[0] if str(cause) else exc}") from None
    finally:
        for a in actors:
            ray.kill(a)
