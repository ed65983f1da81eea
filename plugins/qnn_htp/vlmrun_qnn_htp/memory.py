"""Memory of long compiles: the running peak RSS (recorded in manifests) and handing freed heap back to the OS."""

from __future__ import annotations


def peak_rss_mb() -> int | None:
    """This process's peak resident memory so far, in MB (None where the OS does not say)."""
    try:
        import resource

        return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)  # Linux: kilobytes
    except (ImportError, OSError):
        return None


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
