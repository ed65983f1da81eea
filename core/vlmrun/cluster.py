"""Ray, when vlmrun runs work on a cluster (``vlmrun tune --ray``, ``vlmrun eval --ray``): joining it, and
checking that every node sees the artifact store.

The store is shared by path: every node must see it at the same path (a shared filesystem). Tasks compile into it
(the store's atomic builds make two nodes building one artifact safe) and write their eval results there; what they
return to the driver are figures. `connect` checks that each node sees the store before any task runs, and
says what to do when one does not.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

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




def raise_task_error(exc, what: str):
    """A failed Ray task or actor as vlmrun's error: the task's own VlmrunError as it was, else one line."""
    cause = getattr(exc, "cause", None) or exc
    if isinstance(cause, VlmrunError):
        raise cause from None
    first = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
    raise BackendError(f"{what} failed: {first}") from None
