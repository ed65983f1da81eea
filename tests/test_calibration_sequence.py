"""Calibration in sequence (qnn_htp ``calibration_order``): the parts decoder's calibration host loop with one
part's float graph open at a time instead of all of them, so that its memory follows a part, not the model. On
the tiny model split into three parts: the same feeds as whole-at-once, array for array, hence the same quantized
graphs and the same logits on the emulator; ``auto`` picks the order from the memory budget."""

from __future__ import annotations

import json

import numpy as np
import pytest

pytest.importorskip("onnxruntime_qnn")

from vlmrun import Pipeline  # noqa: E402

from test_quantizer import compile_context, layout, source_dir  # noqa: E402

PARTS3 = {"decoder_form": "parts", "context_length": 128, "prefill_ar": 16, "followup_ar": 8, "parts": 3,
          "weight_sharing": "off", "precision": "w8a16"}


@pytest.fixture(scope="module")
def whole(tiny_model, store):
    return Pipeline.build(tiny_model, layout("decoder", **PARTS3, calibration_order="whole"), store=store)


def calibration_inputs(pipe):
    from vlmrun_qualcomm.parts import followup_export

    art = pipe.handles["decoder"].artifact
    src = source_dir(pipe.store, art)
    desc = json.loads((src / "parts.json").read_text())
    fu_dir, fdesc = followup_export(src, art.manifest["key"]["options"], desc)
    assert len(desc["parts"]) == 3 and fu_dir is not None
    return src, desc, (fu_dir, fdesc)


class Opened:
    """calibration.CpuGraph, counting the float graphs open at once."""

    def __init__(self, monkeypatch):
        from vlmrun_qnn_htp import calibration

        real, self.live, self.most, self.opened = calibration.CpuGraph, 0, 0, 0
        counter = self

        class Counted(real):
            def __init__(self, path):
                super().__init__(path)
                counter.live += 1
                counter.opened += 1
                counter.most = max(counter.most, counter.live)

            def __del__(self):
                counter.live -= 1

        monkeypatch.setattr(calibration, "CpuGraph", Counted)


def test_in_sequence_the_feeds_are_whole_at_onces_with_one_part_open_at_a_time(whole, tiny_model, monkeypatch):
    from vlmrun_qnn_htp import calibration

    src, desc, followup = calibration_inputs(whole)
    ctx = compile_context(whole, "decoder")
    feeds, opened = {}, {}
    for order in ("whole", "sequence"):
        count = Opened(monkeypatch)
        feeds[order] = calibration.parts_calibration_feeds(tiny_model, src, desc, [], ctx, followup, order)
        opened[order] = (count.most, count.opened)
    (a, label_a), (b, label_b) = feeds["whole"], feeds["sequence"]
    assert sorted(a) == sorted(b) == [(k, kind) for k in (1, 2, 3) for kind in ("followup", "prompt", "token")]
    for key in a:
        assert len(a[key]) == len(b[key]) > 0, key
        for fa, fb in zip(a[key], b[key]):
            assert sorted(fa) == sorted(fb), key
            for name in fa:
                assert fa[name].dtype == fb[name].dtype and np.array_equal(fa[name], fb[name]), (key, name)
    # whole-at-once opens a graph set's 3 parts together; in sequence one at a time, part by part each round
    assert opened["whole"] == (3, 9)
    import re

    m = re.fullmatch(re.escape(label_a) + r"; in sequence \(one part's float graph at a time, (\d+) rounds, at most"
                     r" (\d+\.\d\d) GB of kept feeds on disk\)", label_b)
    assert m, label_b
    rounds = int(m[1])
    assert opened["sequence"] == (1, 3 * rounds) and rounds >= 3 * (1 + calibration.GEN_STEPS)


def qdq_initializers(path) -> dict:
    import onnx
    from onnx import numpy_helper

    return {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def test_a_part_calibrated_in_sequence_quantizes_and_answers_as_whole_at_once(whole, tiny_model, tmp_path):
    """The same feeds give the same QDQ graph (every scale, zero point and quantized weight), and a compile in
    sequence runs on the emulator with the logits of the whole-at-once one. (Context binaries are compared by what
    they compute: two compiles of the same QDQ graph differ in bytes, onnxruntime-qnn names their nodes anew.)"""
    from vlmrun import GenerationSettings
    from vlmrun.model import default_model
    from vlmrun.store import ArtifactStore
    from vlmrun_qnn_htp import calibration
    from vlmrun_qnn_htp.quantizer import quantize
    from vlmrun_qnn_htp.recipe import from_key

    from conftest import IMAGE_SIZE

    src, desc, followup = calibration_inputs(whole)
    ctx = compile_context(whole, "decoder")
    recipe = from_key(whole.handles["decoder"].artifact.manifest["key"]["options"])
    graph = src / desc["parts"][1]["graphs"]["prompt"]["file"]  # part 2: its inputs are part 1's outputs
    qdq = {}
    for order in ("whole", "sequence"):
        feeds, _ = calibration.parts_calibration_feeds(tiny_model, src, desc, [], ctx, followup, order)
        work = tmp_path / order
        work.mkdir()
        quantize(graph, work / "part2_prompt.qdq.onnx", feeds[(2, "prompt")], recipe, work)
        qdq[order] = qdq_initializers(work / "part2_prompt.qdq.onnx")
    assert sorted(qdq["whole"]) == sorted(qdq["sequence"]) and any(n.endswith("_scale") for n in qdq["whole"])
    for name, value in qdq["whole"].items():
        assert value.dtype == qdq["sequence"][name].dtype and np.array_equal(value, qdq["sequence"][name]), name
    # compiled in sequence (another store: the option does not key the binary), run on the emulator
    store = ArtifactStore(tmp_path / "store")
    seq = Pipeline.build(default_model(store, IMAGE_SIZE),
                         layout("decoder", **PARTS3, calibration_order="sequence"), store=store)
    assert "in sequence" in seq.handles["decoder"].artifact.manifest["quantization"]["calibration"]
    assert "in sequence" not in whole.handles["decoder"].artifact.manifest["quantization"]["calibration"]
    from vlmrun.demo_image import demo_image

    runs = [pipe.generate(demo_image(), "Describe the image.", GenerationSettings(max_new_tokens=8),
                          keep_logits=True).run() for pipe in (whole, seq)]
    assert runs[0].token_ids == runs[1].token_ids and len(runs[0].token_ids) == 8
    np.testing.assert_allclose(np.stack(runs[1].step_logits), np.stack(runs[0].step_logits), rtol=0, atol=1e-6)


def test_in_sequence_into_a_folder_the_feeds_go_to_disk_part_by_part_and_a_full_disk_is_refused_first(
        whole, tiny_model, tmp_path, monkeypatch):
    """``into``: each part's feeds written as an .npz (what the quantizer's child reads), the same arrays as in
    memory; the kept feeds' disk is checked before the first round, one line naming what it needs."""
    import shutil

    from vlmrun.errors import UsageError
    from vlmrun_qnn_htp import calibration

    src, desc, followup = calibration_inputs(whole)
    ctx = compile_context(whole, "decoder")
    in_memory, _ = calibration.parts_calibration_feeds(tiny_model, src, desc, [], ctx, followup, "sequence")
    paths, label = calibration.parts_calibration_feeds(tiny_model, src, desc, [], ctx, followup, "sequence",
                                                       into=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"feeds_part{k}_{kind}.npz" for k in (1, 2, 3) for kind in ("followup", "prompt", "token"))  # spill gone
    for key, path in paths.items():
        on_disk = calibration.load_feeds(path)
        assert len(on_disk) == len(in_memory[key]) > 0
        for a, b in zip(on_disk, in_memory[key]):
            assert sorted(a) == sorted(b) and all(np.array_equal(a[n], b[n]) for n in a), key
    assert "GB of kept feeds on disk" in label
    real = shutil.disk_usage
    monkeypatch.setattr(calibration.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(UsageError, match=r"calibrating the prompt graphs in sequence \(\d+ kept calls x 3 parts\)"
                                         r" needs about [\d.]+ GB of disk in .*, 0.00 GB are free"):
        calibration.parts_calibration_feeds(tiny_model, src, desc, [], ctx, followup, "sequence",
                                            into=tmp_path / "full")


def test_auto_calibrates_in_sequence_when_the_float_decoder_does_not_fit_the_budget(whole, monkeypatch):
    from vlmrun_qnn_htp import calibration

    src, desc, followup = calibration_inputs(whole)
    sets = calibration.parts_graph_sets(src, desc, followup)
    need = 2 * max(calibration.graph_set_bytes(paths) for _, _, paths in sets)
    assert need > 0
    monkeypatch.delenv("VLMRUN_MEMORY_BUDGET_GB", raising=False)
    assert calibration.calibration_order("auto", sets) == "whole"  # a few MB: half of any machine's memory
    monkeypatch.setenv("VLMRUN_MEMORY_BUDGET_GB", str(need / 1e9 * 1.01))
    assert calibration.calibration_order("auto", sets) == "whole"
    monkeypatch.setenv("VLMRUN_MEMORY_BUDGET_GB", str(need / 1e9 * 0.99))
    assert calibration.calibration_order("auto", sets) == "sequence"
    assert calibration.calibration_order("whole", sets) == "whole"  # given: as given


class Affine:
    """A fake part graph: ``h_out = h * scale + calls so far``, ``logits`` from the last part."""

    def __init__(self, path):
        self.k, self.last = path
        self.input_names = ["h"]
        self.calls = 0

    def run(self, feeds):
        self.calls += 1
        h = feeds["h"] * (self.k + 1) + 1.0
        return {"h": h, "logits": h.sum(keepdims=True)} if self.last else {"h": h}


def loop_over(start: float, calls: int):
    """A host loop of ``calls`` calls whose next input follows from the last output (as greedy steps do)."""
    def loop(graph):
        h = np.full((1, 2), start, np.float32)
        for _ in range(calls):
            h = graph.run({"h": h})["h"] / 10
    return loop


def test_the_rounds_record_what_one_chain_records_in_its_order(tmp_path):
    from vlmrun_qnn_htp.calibration_sequence import load, record_in_sequence
    from vlmrun_qnn_htp.parts_run import Chain

    paths = [(0, False), (1, False), (2, True)]
    loops = [loop_over(1.0, 3), loop_over(2.0, 5), loop_over(3.0, 1)]  # prompts of different lengths
    keep = {0, 2, 3, 7, 8}
    chain = Chain([Affine(p) for p in paths], keep, None)
    for loop in loops:
        loop(chain)
    spill = tmp_path / "spill"
    folders, names, rounds = record_in_sequence(paths, Affine, loops, [3, 5, 1], keep, None, spill)
    assert rounds == 5 and chain.calls == 9  # a round per call of the longest prompt
    recorded = [[load(f, names[k]) for f in part] for k, part in enumerate(folders)]
    assert [[f["h"].tolist() for f in part] for part in recorded] == \
           [[f["h"].tolist() for f in part] for part in chain.recorded]
    assert len(recorded[0]) == len(keep)
    # only the kept calls reach the disk: 5 of 9 calls, for each of the 3 parts
    assert sorted(p.name for p in spill.iterdir()) == ["part0", "part1", "part2"]
    assert all(len(list((spill / part).iterdir())) == len(keep) for part in ("part0", "part1", "part2"))


def test_a_prompt_making_other_calls_than_counted_is_an_error(tmp_path):
    from vlmrun_qnn_htp.calibration_sequence import record_in_sequence

    loops = [loop_over(1.0, 3), loop_over(2.0, 5)]
    with pytest.raises(RuntimeError, match=r"made \[3, 5\] calls, \[3, 4\] expected"):
        record_in_sequence([(0, False), (1, True)], Affine, loops, [3, 4], {0, 6}, None, tmp_path / "spill")


def test_the_host_loop_calls_are_counted_as_the_loop_makes_them():
    """`host_loop_calls` against the calibration's own loop (`greedy_host_loop` over `GenieLayoutDecoder`, a graph
    of zeros), at lengths where the greedy steps stop at the context."""
    from types import SimpleNamespace

    from vlmrun_qnn_htp.calibration import greedy_host_loop, host_loop_calls
    from vlmrun_qnn_htp.genie_engine import GenieLayoutDecoder

    facts = SimpleNamespace(layers=1, kv_heads=1, head_dim=2, hidden=4, rope_theta=10000.0)

    class Zeros:
        def __init__(self, rows):
            self.rows, self.calls = rows, 0

        def run(self, feeds):
            self.calls += 1
            return {"past_key_0_out": np.zeros((1, 1, 2, self.rows), np.float32),
                    "past_value_0_out": np.zeros((1, 1, self.rows, 2), np.float32),
                    "logits": np.zeros((1, self.rows, 5), np.float32)}

    def loop_calls(length, rows, steps, ctx):
        graph = Zeros(rows)
        dec = GenieLayoutDecoder({rows: graph, 1: graph}, ctx, facts, min_chunk=1)
        greedy_host_loop(dec, np.zeros((1, length, 4), np.float32), rows, steps, lambda ids: np.zeros((1, 1, 4)))
        return graph.calls

    cases = [(20, 8, 4, 128), (20, 1, 4, 128), (120, 8, 4, 128), (118, 8, 4, 128), (125, 1, 8, 128), (30, 16, 8, 48)]
    assert [host_loop_calls(*c) for c in cases] == [loop_calls(*c) for c in cases] == [7, 24, 16, 18, 128, 2 + 3]


def test_a_failing_loop_or_graph_stops_the_rounds_with_its_error(tmp_path):
    from vlmrun_qnn_htp.calibration_sequence import record_in_sequence

    def broken(graph):
        graph.run({"h": np.ones((1, 2), np.float32)})
        raise ValueError("loop 1 failed")

    paths = [(0, False), (1, True)]
    with pytest.raises(ValueError, match="loop 1 failed"):
        record_in_sequence(paths, Affine, [loop_over(1.0, 4), broken], [4, 1], set(), None, tmp_path / "a")

    class Failing(Affine):
        def run(self, feeds):
            raise RuntimeError("part 2 failed")

    def opener(path):
        return Failing(path) if path[0] == 1 else Affine(path)

    import threading

    before = threading.active_count()
    with pytest.raises(RuntimeError, match="part 2 failed"):
        record_in_sequence(paths, opener, [loop_over(1.0, 4), loop_over(2.0, 2)], [4, 2], set(), None,
                           tmp_path / "b")
    assert threading.active_count() == before  # every prompt's thread has ended
