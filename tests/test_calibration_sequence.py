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
    rounds = int(label_b.rsplit(", ", 1)[1].split()[0])
    assert opened["sequence"] == (1, 3 * rounds) and rounds >= 3 * (1 + calibration.GEN_STEPS)
    assert label_b == label_a + f"; in sequence (one part's float graph at a time, {rounds} rounds)"


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
    from vlmrun_qnn_htp.calibration_sequence import record_in_sequence
    from vlmrun_qnn_htp.parts_run import Chain

    paths = [(0, False), (1, False), (2, True)]
    loops = [loop_over(1.0, 3), loop_over(2.0, 5), loop_over(3.0, 1)]  # prompts of different lengths
    keep = {0, 2, 3, 7, 8}
    chain = Chain([Affine(p) for p in paths], keep, None)
    for loop in loops:
        loop(chain)
    recorded, rounds = record_in_sequence(paths, Affine, loops, keep, None, tmp_path / "spill")
    assert rounds == 5 and chain.calls == 9  # a round per call of the longest prompt
    assert [[f["h"].tolist() for f in part] for part in recorded] == \
           [[f["h"].tolist() for f in part] for part in chain.recorded]
    assert len(recorded[0]) == len(keep)


def test_a_failing_loop_or_graph_stops_the_rounds_with_its_error(tmp_path):
    from vlmrun_qnn_htp.calibration_sequence import record_in_sequence

    def broken(graph):
        graph.run({"h": np.ones((1, 2), np.float32)})
        raise ValueError("loop 1 failed")

    paths = [(0, False), (1, True)]
    with pytest.raises(ValueError, match="loop 1 failed"):
        record_in_sequence(paths, Affine, [loop_over(1.0, 4), broken], set(), None, tmp_path / "a")

    class Failing(Affine):
        def run(self, feeds):
            raise RuntimeError("part 2 failed")

    def opener(path):
        return Failing(path) if path[0] == 1 else Affine(path)

    import threading

    before = threading.active_count()
    with pytest.raises(RuntimeError, match="part 2 failed"):
        record_in_sequence(paths, opener, [loop_over(1.0, 4), loop_over(2.0, 2)], set(), None, tmp_path / "b")
    assert threading.active_count() == before  # every prompt's thread has ended
