"""Memory of long compiles: a step in a child process of its own (`in_child`), the running peak RSS (recorded in
manifests), handing freed heap back to the OS, and the parts decoder planned from the memory budget
(`parts_for_budget`)."""

from __future__ import annotations

from vlmrun.checkpoint_stream import MEMORY_BUDGET_ENV, export_peak_bytes, memory_budget
from vlmrun.errors import BackendError, UsageError
from vlmrun_qualcomm.parts import split_layers, weight_counts


#: the largest own peak (kB) of a child `in_child` ran, as the child measured it
_children_peak_kb = 0


def peak_rss_mb() -> int | None:
    """The peak resident memory so far, in MB, of this process or of any child `in_child` ran for it (a graph
    quantized in a child), whichever is larger (None where the OS does not say).

    Each peak is the process's own high-water mark (``VmHWM``), not ``ru_maxrss``: Linux keeps ``ru_maxrss`` across
    fork and exec, so a spawned child's started at its parent's peak (a quantization child of a 3.6 GB parent said
    3.6 GB for a step that took less), and ``RUSAGE_CHILDREN`` carried the same figure back."""
    own = _vm_hwm_kb()
    if own is None:
        try:
            import resource

            own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # Linux: kilobytes
        except (ImportError, OSError):
            return None
    return int(max(own, _children_peak_kb) / 1024)


def _vm_hwm_kb() -> int | None:
    """This process's peak resident set in kB (``VmHWM`` of /proc/self/status), or None where there is none."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def in_child(fn, *args, what: str):
    """``fn(*args)`` in a fresh (spawned) process; its result. A step that parses a 2 GB graph several times
    (AIMET's simulation, onnxruntime's calibration) leaves the heap of this process fragmented and large; in a
    child, all of it goes back to the OS when the step ends, before the next step (the QNN compile) starts. An
    error the step raises comes back as itself; a child that dies is one line naming ``what`` and how it ended
    (`child_death`): the kernel's SIGKILL (most likely its out-of-memory killer), another signal (a crash in a
    native library), or an exit code. The child's own peak memory counts in `peak_rss_mb` from then on.

    Steps nest (the image encoder made in a child quantizes its big graph in a child of its own), so the child is
    not a daemon (a daemon may have no children); an interrupt or error here ends it instead."""
    global _children_peak_kb
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_run_in_child, args=(send, fn, args), daemon=False, name=f"vlmrun: {what}"[:60])
    proc.start()
    send.close()  # the child holds the only sending end: a dead child is EOF here
    try:
        ok, value, peak_kb = receive.recv()
    except EOFError:
        proc.join()
        raise BackendError(f"{what}: {child_death(proc.exitcode)}") from None
    except BaseException:  # Ctrl-C, or this process told to stop: the child's work is not wanted any more
        proc.terminate()
        proc.join()
        raise
    finally:
        receive.close()
    proc.join()
    _children_peak_kb = max(_children_peak_kb, peak_kb or 0)
    if ok:
        return value
    raise value


def _run_in_child(send, fn, args) -> None:
    import traceback

    try:
        result = (True, fn(*args))
    except BaseException as exc:  # noqa: BLE001 (handed back to the parent, raised there)
        exc.add_note("in the child process:\n" + "".join(traceback.format_exception(exc)).rstrip())  # --debug
        result = (False, exc)
    peak = _vm_hwm_kb()
    try:
        send.send((*result, peak))
    except Exception as exc:  # an exception (or a result) that does not pickle: its text
        send.send((False, BackendError(f"{type(result[1]).__name__}: {result[1]}" if not result[0] else
                                       f"the step's result could not be sent back: {exc}"), peak))
    send.close()


def child_death(exitcode: int | None) -> str:
    """How a child that sent no result ended, and what to do, in words."""
    import signal

    if exitcode == -signal.SIGKILL:
        return ("its worker process was killed (SIGKILL: most likely the kernel's out-of-memory killer); free memory,"
                " or split the decoder into more parts (-o decoder.parts=N)")
    if exitcode is not None and exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"its worker process died of {name} (a crash in a native library); rerun with --debug and report it"
    return f"its worker process exited with code {exitcode} before sending a result; rerun with --debug"


def release_memory(big: bool) -> None:
    """Give freed heap back to the OS (glibc keeps it otherwise): the parse of a 2 GB graph leaves gigabytes of
    freed protobuf heap that would still count in the next step's peak. Only after a ``big`` graph (see
    `.quantizer.is_big`): a full collection costs 0.2-0.5 s in a process that has imported torch, and a small graph
    leaves nothing worth it (a tiny model's parts compile called it 7 times: 1.6 of its 26 s)."""
    if not big:
        return
    import gc

    gc.collect()
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


#: peak memory of quantizing one part graph in its child, in copies of the part's float32 layer weights.
#: onnxruntime's min-max, measured after `.quantizer_opset` and the calibration apart (`.calibration_batches`): a
#: 1.5B part of 7 layers 4.08-4.13 (1.25 GB), a 7B part of 3 layers 2.55 (2.81 GB; prompt and token graphs made as a
#: bundle makes a part, `benchmarks/family.py --make-parts`); the largest plus about 10% (it was 9 before those
#: fixes: FastVLM-0.5B in one part, 1.98 GB, peaked at 17.3 GB). AIMET's simulation peaked at 12.9 GB over 1.56 GB
#: and was killed at 21.7 GB over 1.98 GB.
QUANTIZE_COPIES = {"onnxruntime": 4.5, "aimet": 11}
#: ... and of the lm_head's float32 weights, one MatMul with few activations for its size: the 1.5B and 7B lm_heads
#: alone 3.19 and 3.13, the 1.5B last part (1 layer and the lm_head) 3.4 in all, the 7B last part 2.76 in all
#: (8.59 GB over 3.11 GB); the largest plus about 10%. AIMET: no lm_head measured, its layers' figure.
HEAD_QUANTIZE_COPIES = {"onnxruntime": 3.75, "aimet": 11}


def part_peak_bytes(model, quantizer: str | None, layers: int, last: bool) -> int:
    """The estimated peak memory of making one decoder part of ``layers`` layers (+ the lm_head when ``last``): its
    export (`vlmrun.checkpoint_stream.export_peak_bytes`) or, quantized by ``quantizer`` (None: not quantized),
    its quantization, whichever is larger."""
    return max(_step_peaks(model, quantizer, layers, last).values())


def _step_peaks(model, quantizer: str | None, layers: int, last: bool) -> dict[str, int]:
    """`part_peak_bytes` by step: ``{"exporting": bytes, "quantizing": bytes}`` (the latter when quantized)."""
    mm, other, head = weight_counts(model)
    layers_fp32, head_fp32 = layers * (mm + other) * 4, (head * 4 if last else 0)
    peaks = {"exporting": export_peak_bytes(layers_fp32 + head_fp32)}
    if quantizer is not None:
        copies, head_copies = QUANTIZE_COPIES[quantizer], HEAD_QUANTIZE_COPIES[quantizer]
        peaks["quantizing"] = int(copies * layers_fp32 + head_copies * head_fp32)
    return peaks


def parts_for_budget(model, precision: str, quantizer: str | None, at_least: int) -> int:
    """The fewest parts (at least ``at_least``: what the binary limit asks) whose every part is made within the
    memory budget (``VLMRUN_MEMORY_BUDGET_GB``; unset: ``at_least``). `UsageError` (exit 2, before any work) when
    even one layer a part does not fit, naming the size needed."""
    budget = memory_budget()
    if budget is None:
        return at_least
    for parts in range(at_least, model.num_layers + 1):
        counts = split_layers(model, precision, parts)
        worst = max(part_peak_bytes(model, quantizer, n, i == parts - 1) for i, n in enumerate(counts))
        if worst <= budget:
            return parts
    steps = _step_peaks(model, quantizer, 1, True)  # the worst part at one layer a part: the last
    what = max(steps, key=steps.get)
    raise UsageError(f"{what} the decoder needs about {worst / 1e9:.2f} GB of memory for its largest part even at one"
                     f" layer a part (the last, with the lm_head), more than the budget {MEMORY_BUDGET_ENV}="
                     f"{budget / 1e9:g} GB; raise the budget to at least that")
