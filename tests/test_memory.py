"""qnn_htp's quantization child (`vlmrun_qnn_htp.memory.in_child`): how a dead child is reported and whose
peak it records.

This module imports nothing heavy at its top: `in_child` spawns a fresh interpreter, which imports this module to
find the function it runs, so the child's own peak here is vlmrun's imports, not torch's or AIMET's.
"""

from __future__ import annotations

import pytest


def _die():
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def _crash():
    import ctypes

    ctypes.string_at(0)  # a null read: SIGSEGV, as a crash in a native library


def _exit():
    import os

    os._exit(3)


def _fail():
    raise ValueError("the step's own error")


def test_a_child_that_dies_is_one_line_saying_how():
    from vlmrun.errors import BackendError
    from vlmrun_qnn_htp.memory import in_child

    with pytest.raises(BackendError) as err:
        in_child(_die, what="quantizing part1")
    assert str(err.value) == ("quantizing part1: its worker process was killed (SIGKILL: most likely the kernel's"
                              " out-of-memory killer); free memory, or split the decoder into more parts"
                              " (-o decoder.parts=N)")
    with pytest.raises(BackendError) as err:  # before, a crash was reported as "most likely out of memory" too
        in_child(_crash, what="quantizing part1")
    assert str(err.value) == ("quantizing part1: its worker process died of SIGSEGV (a crash in a native library);"
                              " rerun with --debug and report it")
    with pytest.raises(BackendError, match=r"^quantizing part1: its worker process exited with code 3 before"):
        in_child(_exit, what="quantizing part1")
    with pytest.raises(ValueError) as err:  # the step's own error comes back as itself
        in_child(_fail, what="quantizing part1")
    assert str(err.value) == "the step's own error"
    assert "in the child process:" in err.value.__notes__[0] and "in _fail" in err.value.__notes__[0]  # for --debug
    assert in_child(divmod, 7, 2, what="a sum") == (3, 1)


def _peak_after_spawn(mb: int = 0):
    from vlmrun_qnn_htp.memory import peak_rss_mb

    if mb:
        block = bytearray(mb * 2**20)
        block[::4096] = b"x" * len(block[::4096])  # touched: resident
        del block
    return peak_rss_mb()


def test_a_childs_peak_is_its_own_not_its_parents(monkeypatch):
    """Linux keeps ru_maxrss across fork and exec: a spawned child's started at its parent's peak. The peak a
    quantization child records is its own (VmHWM)."""
    import ctypes
    import resource

    from vlmrun_qnn_htp.memory import in_child, peak_rss_mb

    big = bytearray(600 * 2**20)
    big[::4096] = b"x" * len(big[::4096])  # touched: 600 MB resident
    del big
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    parent_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    assert parent_peak >= 600 and peak_rss_mb() >= 600
    child = in_child(_peak_after_spawn, what="a child")
    assert child < parent_peak - 300, (child, parent_peak)  # a fresh interpreter with vlmrun's imports
    # a child's own peak comes back into the parent's figure (before: RUSAGE_CHILDREN, the same inherited number)
    from vlmrun_qnn_htp import memory

    monkeypatch.setattr(memory, "_children_peak_kb", 0)  # the largest so far of this worker's earlier children
    base = child  # a child's own peak without the block (its imports: this module is kept light for that)
    child = in_child(_peak_after_spawn, 700, what="a child")
    assert max(700, base) <= child <= base + 700 + 100, (base, child)  # the block on top of the same imports
    assert memory._children_peak_kb // 1024 == child and peak_rss_mb() == max(child, memory._vm_hwm_kb() // 1024)
