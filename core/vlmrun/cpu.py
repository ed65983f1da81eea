"""How many threads a backend's CPU inference may use.

``VLMRUN_CPU_THREADS`` (`ENV_CPU_THREADS`): the threads of each CPU inference session a plugin opens (the reference
stages, calibration runs). Unset, the runtime decides: onnxruntime takes one thread per physical core and keeps
them spinning between ops, the fastest for one process alone on a machine (FastVLM-0.5B's reference decoded
12.9-13.5 tokens/s, 12.1 with spinning off). Several vlmrun processes sharing the cores (eval or tune workers, a
test suite on two workers) lose that time to each other's spinning threads: there ``VLMRUN_CPU_THREADS=1`` runs
each session on its caller's thread alone.

`onnxruntime_options` is the one place the plugins that open onnxruntime CPU sessions (the reference stages, a
backend's calibration runs) get their session options; onnxruntime is theirs to install, imported only when called.
`one_thread_per_worker` is what a worker process that is one of several per machine (eval's workers, a Ray task
declaring one CPU) sets before it builds anything.
"""

from __future__ import annotations

import os

from .errors import UsageError

ENV_CPU_THREADS = "VLMRUN_CPU_THREADS"


def cpu_threads() -> int | None:
    """`ENV_CPU_THREADS` as a number of threads; ``None`` when unset (the runtime's default)."""
    value = os.environ.get(ENV_CPU_THREADS, "").strip()
    if not value:
        return None
    if not value.isdigit() or int(value) < 1:
        raise UsageError(f"{ENV_CPU_THREADS}={value!r} is not a number of threads (1, 2, ...); unset it for the"
                         " runtime's default")
    return int(value)


def onnxruntime_options(parallel_prepack: bool = False):
    """onnxruntime ``SessionOptions`` for a CPU session: quiet (errors only), `cpu_threads` intra-op threads when
    ``VLMRUN_CPU_THREADS`` is set, else onnxruntime's default.

    ``parallel_prepack``: onnxruntime packs a graph's constant MatMul weights into its kernels' layout when the
    session opens, one weight after another; with this set (``session.prepack.enable_parallel``) its intra-op
    threads pack them together. The outputs are the same to the bit and the open takes about half the time on 2
    cores (a FastVLM-1.5B part of 11 layers, 1.87 GB of float32: 1.42 -> 0.78 s), but every weight is held packed
    and unpacked at once, so the open peaks at about twice the weights instead of once: for a caller that opens the
    same large graphs again and again and has that memory to spare."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.log_severity_level = 3
    threads = cpu_threads()
    if threads:
        so.intra_op_num_threads = threads
    if parallel_prepack:
        so.add_session_config_entry("session.prepack.enable_parallel", "1")
    return so


def one_thread_per_worker() -> None:
    """In a worker that is one of several sharing a machine's cores: one thread per CPU session, OpenMP's
    (``OMP_NUM_THREADS``) and onnxruntime's (`ENV_CPU_THREADS`: onnxruntime does not read OMP_*), unless set."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault(ENV_CPU_THREADS, "1")
