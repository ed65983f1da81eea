"""Calibration in sequence (qnn_htp ``calibration_order``): the parts decoder's calibration host loop with one
part's float graph open at a time instead of all of them, so that its memory follows a part, not the model. On
the tiny model split into three parts: the same feeds as whole-at-once, array for array, hence the same quantized
graphs and the same logits on the emulator; ``auto`` picks the order from the memory budget."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

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
    art = pipe.handles["decoder"].artifact
    src = source_dir(pipe.store, art)
    desc = json.loads((src / "parts.json").read_text())
    assert len(desc["parts"]) == 3 and all(sorted(p["graphs"]) == ["followup", "prompt", "token"]
                                           for p in desc["parts"])
    return src, desc


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

    src, desc = calibration_inputs(whole)
    ctx = compile_context(whole, "decoder")
    feeds, opened = {}, {}
    for order in ("whole", "sequence"):
        count = Opened(monkeypatch)
        feeds[order] = calibration.parts_calibration_feeds(tiny_model, src, desc, [], ctx, order)
        opened[order] = (count.most, count.opened)
    (a, label_a), (b, label_b) = feeds["whole"], feeds["sequence"]
    assert sorted(a) == sorted(b) == [(k, kind) for k in (1, 2, 3) for kind in ("followup", "prompt", "token")]
    for key in a:
        assert len(a[key]) == len(b[key]) > 0, key
        for fa, fb in zip(a[key], b[key]):
            assert sorted(fa) == sorted(fb), key
            for name in fa:
                assert fa[name].dtype == fb[name].dtype and np.array_equal(fa[name], fb[name]), (key, name)
    # whole-at-once opens a graph set's 3 parts together; in sequence one at a time: each part once for the
    # prefills (part-major), then once per round of greedy steps (a round per step of the prompt making most)
    assert opened["whole"] == (3, 9)
    import re

    m = re.fullmatch(re.escape(label_a) + r"; in sequence \(one part's float graph at a time, (\d+) graphs opened, at"
                     r" most (\d+\.\d\d) GB of kept feeds on disk\)", label_b)
    assert m, label_b
    C, prompts = desc["ctx"], list(calibration.CALIBRATION_PROMPTS)
    lengths = [min(f["inputs_embeds"].shape[1], C - desc["ar"] - calibration.GEN_STEPS)
               for f in ctx.reference_inputs(None, prompts)]
    calls, rounds = {}, {}
    for kind, rows, _ in calibration.parts_graph_sets(src, desc):
        steps = calibration.GEN_STEPS if kind == "token" else calibration.PROMPT_GEN_STEPS
        calls[kind] = [calibration.host_loop_calls(n, rows, steps, C) for n in lengths]
        rounds[kind] = max(c - -(-n // rows) for c, n in zip(calls[kind], lengths))  # greedy steps of a prompt
    assert rounds == {"prompt": 8, "token": 8, "followup": 8}  # every prompt's 8 steps fit the context
    assert opened["sequence"] == (1, int(m[1])) == (1, sum(3 * (1 + r) for r in rounds.values())) == (1, 81)
    # before, a round per call of the longest prompt: 3 x (13 + 86 + 18), the token graphs' prefill row by row
    assert sum(3 * max(c) for c in calls.values()) == 351


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

    src, desc = calibration_inputs(whole)
    ctx = compile_context(whole, "decoder")
    recipe = from_key(whole.handles["decoder"].artifact.manifest["key"]["options"])
    graph = src / desc["parts"][1]["graphs"]["prompt"]["file"]  # part 2: its inputs are part 1's outputs
    qdq = {}
    for order in ("whole", "sequence"):
        feeds, _ = calibration.parts_calibration_feeds(tiny_model, src, desc, [], ctx, order)
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

    src, desc = calibration_inputs(whole)
    ctx = compile_context(whole, "decoder")
    in_memory, _ = calibration.parts_calibration_feeds(tiny_model, src, desc, [], ctx, "sequence")
    paths, label = calibration.parts_calibration_feeds(tiny_model, src, desc, [], ctx, "sequence",
                                                       into=tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"feeds_part{k}_{kind}.npz" for k in (1, 2, 3) for kind in ("followup", "prompt", "token"))  # spill gone
    for key, path in paths.items():
        on_disk = calibration.load_feeds(path)
        assert len(on_disk) == len(in_memory[key]) > 0
        for a, b in zip(on_disk, in_memory[key]):
            assert sorted(a) == sorted(b), key
            for n in a:
                assert a[n].dtype == b[n].dtype and a[n].shape == b[n].shape, (key, n)
                assert a[n].tobytes() == b[n].tobytes(), (key, n)  # to the bit
    # the pasts' unfilled positions are not written (vlmrun_qnn_htp.feed_files): a part's files take less than the
    # arrays they hold (context 128: the prompts' 60-70 rows and their greedy steps filled; more at full size)
    raw = {key: sum(v.nbytes for f in in_memory[key] for v in f.values()) for key in paths}
    for k in (1, 2, 3):
        size = {kind: Path(paths[(k, kind)]).stat().st_size / raw[(k, kind)] for kind in ("prompt", "token",
                                                                                          "followup")}
        # measured: token 0.38, prompt 0.57-0.64, followup 0.51-0.54
        assert size["token"] < 0.45 and size["prompt"] < 0.7 and size["followup"] < 0.6, (k, size)
    assert "GB of kept feeds on disk" in label
    real = shutil.disk_usage
    monkeypatch.setattr(calibration.shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    with pytest.raises(UsageError, match=r"calibrating the prompt graphs in sequence \(\d+ kept calls x 3 parts\)"
                                         r" in .* needs \d+ bytes \([\d.]+ GB\) free on its disk, which has 1000 "):
        calibration.parts_calibration_feeds(tiny_model, src, desc, [], ctx, "sequence",
                                            into=tmp_path / "full")


def test_auto_calibrates_in_sequence_when_the_float_decoder_does_not_fit_the_budget(whole, monkeypatch):
    from vlmrun_qnn_htp import calibration

    src, desc = calibration_inputs(whole)
    sets = calibration.parts_graph_sets(src, desc)
    need = 2 * max(calibration.graph_set_bytes(paths) for _, _, paths in sets)
    assert need > 0
    monkeypatch.delenv("VLMRUN_MEMORY_BUDGET_GB", raising=False)
    assert calibration.calibration_order("auto", sets) == "whole"  # a few MB: half of any machine's memory
    monkeypatch.setenv("VLMRUN_MEMORY_BUDGET_GB", str(need / 1e9 * 1.01))
    assert calibration.calibration_order("auto", sets) == "whole"
    monkeypatch.setenv("VLMRUN_MEMORY_BUDGET_GB", str(need / 1e9 * 0.99))
    assert calibration.calibration_order("auto", sets) == "sequence"
    assert calibration.calibration_order("whole", sets) == "whole"  # given: as given


def test_a_float_graph_packs_its_weights_in_parallel_when_a_second_copy_fits_a_quarter_of_the_budget(
        whole, monkeypatch):
    """Calibration's CPU sessions pack their weights in parallel (onnxruntime's session.prepack.enable_parallel)
    only while the open's second copy of the weights fits a quarter of the memory allowed; either way a part's
    outputs are the same to the bit."""
    from vlmrun_qnn_htp import calibration

    src, desc = calibration_inputs(whole)
    path = src / desc["parts"][0]["graphs"]["prompt"]["file"]
    size = calibration.graph_set_bytes([path])

    def opened(budget_bytes):
        monkeypatch.setenv("VLMRUN_MEMORY_BUDGET_GB", str(budget_bytes / 1e9))
        graph = calibration.CpuGraph(path)
        options = graph.sess.get_session_options()
        try:
            return graph, options.get_session_config_entry("session.prepack.enable_parallel")
        except RuntimeError:  # onnxruntime: "SessionOptions does not have configuration with key"
            return graph, None

    parallel, flag = opened(4 * size * 1.01)
    assert flag == "1"
    serial, flag = opened(4 * size * 0.99)
    assert flag is None
    rng = np.random.default_rng(0)
    feeds = {i.name: rng.standard_normal([d if isinstance(d, int) else 1 for d in i.shape]).astype(np.float32)
             for i in serial.sess.get_inputs()}
    feeds["attention_mask"] = np.zeros_like(feeds["attention_mask"])
    a, b = parallel.run(feeds), serial.run(feeds)
    assert sorted(a) == sorted(b) and all(np.array_equal(a[k], b[k]) for k in a)


FACTS = SimpleNamespace(layers=4, kv_heads=1, head_dim=2, hidden=4, rope_theta=10000.0, vocab=5)
SPLIT = [(0, 2), (2, 3), (3, 4)]  # the layers of 3 fake parts
TABLE = np.random.default_rng(0).standard_normal((FACTS.vocab, FACTS.hidden)).astype(np.float32)  # token embeddings
HEAD = np.random.default_rng(1).standard_normal((FACTS.hidden, FACTS.vocab)).astype(np.float32)


class Part:
    """A fake part graph with the parts export's I/O (`vlmrun_ort_reference.decoder_parts.part_io`): layers
    ``lo..hi-1`` of a toy attention (each row takes in the past keys and values its mask shows it, and writes its
    own from its hidden state and position), the hidden state on to the next part as ``residual_{hi}``, the logits
    from the last part."""

    def __init__(self, layers: tuple[int, int]):
        self.lo, self.hi = layers
        own = [f"past_{kv}_{i}" for i in range(self.lo, self.hi) for kv in ("key", "value")]
        self.input_names = ["inputs_embeds" if self.lo == 0 else f"residual_{self.lo}", "attention_mask",
                            "position_ids_cos", "position_ids_sin", *(n + "_in" for n in own)]
        self.outputs = ["logits" if self.hi == FACTS.layers else f"residual_{self.hi}", *(n + "_out" for n in own)]

    def run(self, feeds: dict) -> dict:
        h = feeds[self.input_names[0]]
        T = h.shape[1]
        seen = (feeds["attention_mask"][0, :, :-T] > -50).astype(np.float32)  # [T, past slots]
        pos = feeds["position_ids_cos"][0, 0] + feeds["position_ids_sin"][0, 0]  # [T, 1]
        out = {}
        for i in range(self.lo, self.hi):
            keys, values = feeds[f"past_key_{i}_in"][0, 0], feeds[f"past_value_{i}_in"][0, 0]  # [D, past], [past, D]
            k, v = h[0, :, :2] * (i + 1) + pos, h[0, :, 2:] - pos
            out[f"past_key_{i}_out"], out[f"past_value_{i}_out"] = k.T[None, None], v[None, None]
            h = np.tanh(h + np.concatenate([seen @ keys.T, seen @ values], axis=1)[None] / 4 + 0.1 * (i + 1))
        out[self.outputs[0]] = h @ HEAD if self.hi == FACTS.layers else h
        return out


class Opener:
    """Opens fake parts (``fail``: the parts that raise, by (part, nth open)), counting the graphs opened and
    those open at once."""

    def __init__(self, fail=()):
        self.opened, self.live, self.most, self.fail, self.per_part = 0, 0, 0, set(fail), {}
        opener = self

        class Counted(Part):
            def __init__(self, layers):
                super().__init__(layers)
                k = SPLIT.index(layers)
                opener.per_part[k] = opener.per_part.get(k, 0) + 1
                self.fails = (k, opener.per_part[k]) in opener.fail
                opener.opened, opener.live = opener.opened + 1, opener.live + 1
                opener.most = max(opener.most, opener.live)

            def run(self, feeds):
                if self.fails:
                    raise RuntimeError("part 2 failed")
                return super().run(feeds)

            def __del__(self):
                opener.live -= 1

        self.graph = Counted

    def __call__(self, layers):
        return self.graph(layers)


def prompt_loops(rows: int, lengths=(5, 9, 13), steps: int = 4, ctx: int = 16, embed_tokens=None):
    """The calibration's host loop (`PromptLoop` over `GenieLayoutDecoder`) for prompts of ``lengths`` rows."""
    from vlmrun_qnn_htp.calibration import PromptLoop

    rng = np.random.default_rng(2)
    embeds = [rng.standard_normal((1, n, FACTS.hidden)).astype(np.float32) for n in lengths]
    return [PromptLoop(e, rows, steps, ctx, FACTS, embed_tokens or (lambda ids: TABLE[ids][None])) for e in embeds]


@pytest.mark.parametrize("rows, greedy", [(1, [4, 4, 3]), (4, [4, 4, 0])])
def test_the_part_major_prefill_and_the_greedy_rounds_record_what_one_chain_records(tmp_path, rows, greedy):
    """The token graphs (a call per prefill row) and the prompt graphs (chunks of 4): prompts of 5, 9 and 13 rows in
    a context of 16 (the last one's greedy steps stop at the context). Every call kept, every part's feeds equal to
    whole-at-once's; each part opened once for all the prefills, then once per greedy round."""
    from vlmrun_qnn_htp.calibration import host_loop_calls
    from vlmrun_qnn_htp.calibration_sequence import load, record_in_sequence
    from vlmrun_qnn_htp.parts_run import Chain

    counts = [host_loop_calls(n, rows, 4, 16) for n in (5, 9, 13)]
    assert [c - -(-n // rows) for c, n in zip(counts, (5, 9, 13))] == greedy  # the greedy steps each prompt makes
    keep = set(range(sum(counts)))
    chain = Chain([Part(p) for p in SPLIT], keep, -100.0)
    for loop in prompt_loops(rows):
        loop(chain)
    assert chain.calls == sum(counts)
    opener = Opener()
    folders, names, opened = record_in_sequence(SPLIT, opener, prompt_loops(rows), counts, keep, -100.0,
                                                tmp_path / "spill")
    assert opened == opener.opened == 3 * (1 + max(greedy)) and opener.most == 1
    assert 3 * max(counts) == {1: 48, 4: 21}[rows]  # graphs opened in lockstep rounds over every call
    assert names == [Part(p).input_names for p in SPLIT] and names[1][0] == "residual_2"
    recorded = [[load(f, names[k]) for f in part] for k, part in enumerate(folders)]
    assert [len(part) for part in recorded] == [len(part) for part in chain.recorded] == [len(keep)] * 3
    for k, (ours, theirs) in enumerate(zip(recorded, chain.recorded)):
        for call, (a, b) in enumerate(zip(ours, theirs)):
            assert sorted(a) == sorted(b), (k, call)
            for name in a:
                assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), (k, call, name)
    # meaningful: the past of later calls is filled (keys of part 3's layer from its own prefill pass) and the
    # masks clipped
    last = recorded[2][counts[0] - 1]
    assert np.abs(last["past_key_3_in"]).sum() > 0 and last["attention_mask"].min() == -100.0


def test_a_prompt_making_other_calls_than_counted_is_an_error(tmp_path):
    from vlmrun_qnn_htp.calibration_sequence import record_in_sequence

    with pytest.raises(RuntimeError, match=r"made \[9, 13, 16\] calls, \[9, 12, 16\] expected"):
        record_in_sequence(SPLIT, Opener(), prompt_loops(1), [9, 12, 16], set(), None, tmp_path / "spill")


def test_the_host_loop_calls_are_counted_as_the_loop_makes_them():
    """`host_loop_calls` against the calibration's own loop (`greedy_host_loop` over `GenieLayoutDecoder`, a graph
    of zeros), at lengths where the greedy steps stop at the context."""

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


def test_a_failing_loop_or_graph_stops_the_calibration_with_its_error(tmp_path):
    """A prompt's loop failing in its greedy steps (its thread), a part failing in the prefill pass or in a greedy
    round: the error is raised, and every prompt's thread has ended."""
    import threading

    from vlmrun_qnn_htp.calibration_sequence import record_in_sequence

    def embed_tokens(ids):
        raise ValueError("loop 1 failed")

    loops = prompt_loops(1)
    loops[1] = prompt_loops(1, embed_tokens=embed_tokens)[1]
    before = threading.active_count()
    with pytest.raises(ValueError, match="loop 1 failed"):
        record_in_sequence(SPLIT, Opener(), loops, [9, 13, 16], set(), None, tmp_path / "a")
    for nth, where in ((1, "b"), (2, "c"), (3, "d")):  # part 2's first open: the prefill pass; then greedy rounds
        opener = Opener(fail={(1, nth)})
        with pytest.raises(RuntimeError, match="part 2 failed"):
            record_in_sequence(SPLIT, opener, prompt_loops(1), [9, 13, 16], set(), None, tmp_path / where)
        assert opener.per_part[1] == nth
    assert threading.active_count() == before
