"""Memory of long compiles: the running peak RSS (recorded in manifests) and handing freed heap back to the OS."""

from __future__ import annotations


def peak_rss_mb() -> int | None:
    """The peak resident memory so far, in MB, of this process or of any child it waited for (a graph quantized in
    a child: `in_child`), whichever is larger (None where the OS does not say)."""
    try:
        import resource

        return int(max(resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
                   / 1024)  # Linux: kilobytes
    except (ImportError, OSError):
        return None


def in_child(fn, *args, what: str):
    """``fn(*args)`` in a fresh (spawned) process; its result. A step that parses a 2 GB graph several times
    (AIMET's simulation, onnxruntime's calibration) leaves the heap of this process fragmented and large; in a
    child, all of it goes back to the OS when the step ends, before the next step (the QNN compile) starts. An
    error the step raises comes back as itself; a child the kernel kills is one line naming ``what``."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    from vlmrun.errors import BackendError

    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        try:
            return pool.submit(fn, *args).result()
        except BrokenProcessPool:
            raise BackendError(f"{what}: its worker process died (killed by the kernel: most likely out of memory);"
                               " free memory, or split the decoder into more parts (-o decoder.parts=N)") from None


def release_memory() -> None:
    """Give freed heap back to the OS (glibc keeps it otherwise): the parse of a 2 GB graph leaves gigabytes of
    freed protobuf heap that would still count in the next step's peak."""
    import gc

    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass
