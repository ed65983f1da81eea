"""The x86_64 HTP emulator's hot spot: libm's ``pow``, routed to an exact fast path.

onnxruntime-qnn's HTP backend on an x86_64 host (``libQnnHtp.so``) emulates the NPU, and about half of its time
in a graph's run goes to libm's ``pow``: tens of millions of calls per run of the tiny model's prompt graph, every one
``pow(2.0, n)`` with a whole ``n`` (measured with a counting shim). Those values are exact (a normal result is the
double whose exponent field alone is set; outside that range ``ldexp(1.0, n)`` rounds as ``pow`` does), so
`route_pow` rewrites the library's ``pow`` slots (its GOT entries) to a function that takes that path and hands any
other argument to libm (`_emulator_pow.c`, built with this package when a C compiler is there). The prompt graph of
the tiny all-npu decoder then runs in 0.8 s instead of 1.8 s, its outputs identical byte for byte.

It is applied once per process, before the first HTP session, Genie dialog or bundle pipeline (`vlmrun_qnn_htp.ep`,
`genie_binding.GenieLibrary`, `genie_pipeline.PipelineLibrary`), on the x86_64 Linux emulator only;
``VLMRUN_EMULATOR_FAST_POW=0`` turns it off. ``vlmrun doctor`` says whether it is on.
"""

from __future__ import annotations

import ctypes
import os
import platform
from pathlib import Path

from vlmrun.procs import stdout_to_stderr

ENV = "VLMRUN_EMULATOR_FAST_POW"
LIBRARY = "libQnnHtp.so"

#: the libraries loaded here: kept for the process's life, so that the routed copy is the one every later dlopen of
#: the same file (onnxruntime's QNN EP, libGenie) gets
_loaded: dict[str, ctypes.CDLL] = {}
_status: str | None = None


def is_emulator() -> bool:
    """True where the local HTP backend is onnxruntime-qnn's x86_64 emulator (not an NPU)."""
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")  # the C part: x86_64 only


def route_pow(lib_dir: str | Path) -> str:
    """Route ``pow`` of ``lib_dir``'s libQnnHtp.so to the exact fast path, once per process; returns a status line
    (on, or why not). Never raises: without it the emulator gives the same values, only slower."""
    global _status
    if _status is not None:
        return _status
    if os.environ.get(ENV, "1") == "0":
        _status = f"off ({ENV}=0)"
        return _status
    if not is_emulator() or not platform.system() == "Linux":
        _status = f"off (not the x86_64 Linux emulator: {platform.system()} {platform.machine()})"
        return _status
    try:
        from vlmrun_qualcomm import _emulator_pow
    except ImportError as exc:
        _status = f"off (vlmrun_qualcomm._emulator_pow was not built: {exc}; reinstall with a C compiler)"
        return _status
    path = Path(lib_dir) / LIBRARY
    if not path.is_file():
        return f"off (no {LIBRARY} in {lib_dir})"  # not kept: another caller may name the folder that has it
    try:
        with stdout_to_stderr():  # the library prints a banner on stdout when it loads (--json output, workers)
            _loaded[LIBRARY] = ctypes.CDLL(str(path))
    except OSError as exc:
        _status = f"off ({path} does not load: {exc})"
        return _status
    found, routed, failed = _emulator_pow.route(LIBRARY)  # by name: whoever loaded it first
    if found and routed and not failed:
        _status = f"on ({LIBRARY}: {routed} pow slot{'s' if routed != 1 else ''} routed to ldexp for pow(2, n))"
    else:
        _status = f"off ({LIBRARY}: {found} loaded, {routed} slots routed, {failed} not writable)"
    return _status


def status() -> str | None:
    """`route_pow`'s status in this process, or None before it ran."""
    return _status
