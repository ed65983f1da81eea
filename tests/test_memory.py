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


def _matmul_graph(path, hidden=64, vocab=4096, opset=17):
    """An lm_head-like graph (one MatMul) at ``opset``, its weights as external data, as a big part is stored."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = (np.random.default_rng(0).standard_normal((hidden, vocab)) * 0.02).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["logits"], name="lm_head")], "lm_head",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8, hidden])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, 8, vocab])], [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=path.name + ".data",
              size_threshold=0)
    return w.nbytes


def test_the_opset_is_raised_without_the_weights_and_the_qdq_graph_is_onnxruntimes(tmp_path, monkeypatch):
    """onnxruntime's quantize_static raises an a16 graph below opset 21 by converting the whole model, weights
    included, then deep-copying it: the peak of a big part's quantization (a 1.5B lm_head: 5.4 GB for 0.93 GB of
    weights). qnn_htp converts the weightless graph instead: the converter never holds a weight, onnxruntime gets
    a graph already at 21. A big graph is also calibrated before quantize_static, by a session without
    onnxruntime's pre-packed copy of the weights. The QDQ graph is byte for byte the one onnxruntime's own
    conversion and calibration give."""
    import contextlib

    import numpy as np
    import onnx

    from onnxruntime.quantization.quant_utils import get_opset_version

    from vlmrun_qnn_htp import calibration_batches, quantizer
    from vlmrun_qnn_htp.recipe import Recipe

    src_dir = tmp_path / "export"
    src_dir.mkdir()
    src = src_dir / "lm_head.onnx"
    _matmul_graph(src)
    feeds = [{"x": np.random.default_rng(i).standard_normal((1, 8, 64)).astype(np.float32)} for i in range(3)]
    converted = []
    real_convert = onnx.version_converter.convert_version

    def spy(model, target):
        data = sum(len(i.raw_data) + 4 * len(i.float_data) for i in model.graph.initializer)
        converted.append((target, data, len(model.graph.initializer)))
        return real_convert(model, target)

    monkeypatch.setattr(onnx.version_converter, "convert_version", spy)
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir(), theirs.mkdir()
    for precision in ("w4a16", "w8a16"):
        converted.clear()
        facts = quantizer._quantize(src, ours / f"{precision}.onnx", feeds, Recipe(precision), ours, None)
        assert facts["calibration_batches"] == 1  # a big graph (its weights apart) is calibrated before, in one batch
        graphs = [c for c in converted if c[2]]  # (the other: the empty graph onnxruntime is asked its target for)
        assert graphs == [(21, 0, 1)], converted  # once, to 21, over a proto whose one weight holds no bytes
        left = [p.name for p in ours.iterdir() if not p.name.startswith(("w4a16.onnx", "w8a16.onnx"))]
        assert left == [], left  # the converted graph and the copy of its data are gone
        qdq = onnx.load(str(ours / f"{precision}.onnx"))
        assert get_opset_version(qdq) == 21 and qdq.graph.node[0].op_type in ("DequantizeLinear", "QuantizeLinear")

        with monkeypatch.context() as m:  # onnxruntime's own conversion, over the weights, and its own calibration
            m.setattr(quantizer, "at_quantizer_opset", lambda model_in, proto, config, work: contextlib.nullcontext(
                (model_in, proto)))
            m.setattr(calibration_batches, "calibrate_in_batches", lambda *a, **k: None)
            converted.clear()
            quantizer._quantize(src, theirs / f"{precision}.onnx", feeds, Recipe(precision), theirs, None)
            assert converted and converted[0][1] == 64 * 4096 * 4  # it converted the model with its weights
        assert (ours / f"{precision}.onnx").read_bytes() == (theirs / f"{precision}.onnx").read_bytes(), precision
    assert sorted(p.name for p in src_dir.iterdir()) == ["lm_head.onnx", "lm_head.onnx.data"]  # the export untouched

    # a recipe without 16-bit tensors (int8) keeps the graph's opset: nothing is converted
    converted.clear()
    quantizer._quantize(src, ours / "int8.onnx", feeds, Recipe("int8"), ours, None)
    assert not [c for c in converted if c[2]] and get_opset_version(onnx.load(str(ours / "int8.onnx"))) == 17


def _nested(a: int, b: int):
    from vlmrun_qnn_htp.memory import in_child

    return in_child(divmod, a, b, what="the inner step")  # e.g. the image encoder's child quantizing its graph


def _sleep_and_say(pid_file: str):
    import os
    import time

    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)


_INTERRUPTED = """
import signal
import sys
signal.signal(signal.SIGINT, signal.default_int_handler)  # a shell's background job starts with SIGINT ignored
sys.path.insert(0, sys.argv[2])
from test_memory import _sleep_and_say
from vlmrun_qnn_htp.memory import in_child
in_child(_sleep_and_say, sys.argv[1], what="a long step")
"""


def test_steps_in_children_nest_and_an_interrupt_ends_the_child(tmp_path):
    """A step in a child may run its own step in a child (at 7B the bundle's image-encoder child quantizes a big
    graph in one: a daemonic child could not, "daemonic processes are not allowed to have children"); a Ctrl-C
    to a process whose child is working ends that child too (none is left running), and the process stops with
    the KeyboardInterrupt."""
    import os
    import signal
    import subprocess
    import sys
    import time
    from pathlib import Path

    from vlmrun_qnn_htp.memory import in_child

    assert in_child(_nested, 7, 2, what="the outer step") == (3, 1)
    pid_file = tmp_path / "child.pid"
    proc = subprocess.Popen([sys.executable, "-c", _INTERRUPTED, str(pid_file), str(Path(__file__).parent)],
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not pid_file.is_file() or not pid_file.read_text():
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    child = int(pid_file.read_text())
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    for _ in range(100):  # the child was terminated and reaped by its parent before it exited
        if not Path(f"/proc/{child}").exists():
            break
        time.sleep(0.05)
    assert not Path(f"/proc/{child}").exists(), f"child {child} still running after its parent's Ctrl-C"
