"""``vlmrun eval``: accuracy and drift over a data set, equal to figures computed here independently; resuming
recomputes nothing finished; bad records are one line each, skipped and counted (or --strict stops); worker
processes and batched stages give the same results."""

from __future__ import annotations

import json
import re
import shutil
import types
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli

SLICE = 8  # items of the held-out set in the reference / all-npu test (2 per question kind: the kinds cycle)
MAX_NEW = 48


# -- independent figures ------------------------------------------------------------------------------------------

def norm(text: str) -> str:
    return " ".join(re.sub(r"[^\w\s]", " ", text.lower()).split())


def cos_sqnr(ref, dev) -> tuple[float, float]:
    r = np.asarray(ref, dtype=np.float64).ravel()
    d = np.asarray(dev, dtype=np.float64).ravel()
    noise = float(((d - r) ** 2).sum())
    sqnr = 200.0 if noise == 0 else min(200.0, 10 * np.log10(float((r ** 2).sum()) / noise))
    cos = 1.0 if noise == 0 else float(r @ d / (np.linalg.norm(r) * np.linalg.norm(d)))
    return cos, sqnr


def records(path: Path, n: int) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:n]
    for r in rows:
        r["image_path"] = path.parent / r["image"]
    return rows


@pytest.fixture(scope="module")
def heldout(store) -> Path:
    from vlmrun.eval import heldout_dataset

    return heldout_dataset(store)


# -- reference and all-npu fp16 on a slice ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cli_report(cache_dir, ref_pipe):
    res = run_cli(["eval", "--limit", str(SLICE), "-L", "reference", "-L", "all-npu", "--json",
                   "--max-new-tokens", str(MAX_NEW)], cache_dir, timeout=1800)
    assert res.returncode == 0, res.stderr
    assert "item/s" in res.stderr  # the progress bar shows items per second
    return json.loads(res.stdout)


@pytest.mark.slow
def test_accuracy_and_drift_equal_independent_figures(cli_report, heldout, tiny_model, ref_pipe, store):
    from vlmrun import GenerationSettings, Pipeline

    report = cli_report
    assert report["items"] == SLICE and report["skipped"] == 0
    ref_lay, npu = report["layouts"]
    assert ref_lay["label"] == "reference" and ref_lay["is_reference"]
    assert npu["label"] == "all-npu" and npu["layout"] == dict.fromkeys(("vision", "projector", "embed", "decoder"),
                                                                           "qnn_htp")
    settings = GenerationSettings(max_new_tokens=MAX_NEW)
    htp = Pipeline.build(tiny_model, "all-npu", store=store, registry=ref_pipe.registry)
    rows = records(heldout, SLICE)
    correct = {"reference": {}, "all-npu": {}}
    drift: dict[str, list] = {}
    for r in rows:
        ref = ref_pipe.capture(r["image_path"], r["question"], settings)
        ref_tokens = [int(t) for t in ref["tokens"]]
        dev = htp.capture(r["image_path"], r["question"], settings, teacher_tokens=ref_tokens)
        for label, cap in (("reference", ref), ("all-npu", dev)):
            text = tiny_model.tokenizer.decode([int(t) for t in cap["tokens"]], skip_special_tokens=True)
            correct[label].setdefault(r["kind"], []).append(norm(text) == norm(r["answer"]))
        for name in ("image_features", "image_embeds", "text_embeds", "inputs_embeds", "logits"):
            c, s = cos_sqnr(ref[name], dev[name])
            drift.setdefault(name + ".cosine", []).append(c)
            drift.setdefault(name + ".sqnr", []).append(s)
        top1 = (ref["logits"][0].argmax(-1) == dev["logits"][0].argmax(-1)).mean()
        drift.setdefault("top1", []).append(float(top1))

    for lay, label in ((ref_lay, "reference"), (npu, "all-npu")):
        for kind, oks in correct[label].items():
            assert lay["accuracy"][kind] == {"correct": sum(oks), "n": len(oks), "accuracy": sum(oks) / len(oks)}
        every = [ok for oks in correct[label].values() for ok in oks]
        assert lay["accuracy"]["all"]["accuracy"] == pytest.approx(sum(every) / len(every))
    # the trained default model answers this slice on the reference layout
    assert ref_lay["accuracy"]["all"]["accuracy"] >= 0.9

    boundaries = {"image_features": "vision/image_features", "image_embeds": "projector/image_embeds",
                  "text_embeds": "embed/text_embeds", "inputs_embeds": "splice/inputs_embeds",
                  "logits": "decoder/logits"}
    for name, cp in boundaries.items():
        got = npu["drift"][cp]
        for metric, key in (("cosine", "cosine"), ("sqnr", "sqnr_db")):
            values = np.asarray(drift[f"{name}.{metric}"])
            assert got[key]["median"] == pytest.approx(float(np.median(values)), rel=1e-6, abs=1e-9), (cp, key)
            assert got[key]["p5"] == pytest.approx(float(np.percentile(values, 5)), rel=1e-6, abs=1e-9), (cp, key)
            assert got[key]["min"] == pytest.approx(float(values.min()), rel=1e-6, abs=1e-9), (cp, key)
    top1 = np.asarray(drift["top1"])
    got = npu["drift"]["decoder/logits"]["top1_agreement"]
    assert got["median"] == pytest.approx(float(np.median(top1)))
    assert got["p5"] == pytest.approx(float(np.percentile(top1, 5)))
    assert got["mean"] == pytest.approx(float(top1.mean()))
    # and they are the figures of a real fp16 NPU build, not a trivial pass
    assert 20 < npu["drift"]["vision/image_features"]["sqnr_db"]["median"] < 120
    assert len(npu["worst_items"]) == 5


@pytest.mark.slow
def test_terminal_table_and_html_report(cli_report, cache_dir, tmp_path):
    # everything is cached now: the table and the report come without recomputing
    res = run_cli(["eval", "--limit", str(SLICE), "-L", "reference", "-L", "all-npu", "--report",
                   str(tmp_path / "rep"), "--max-new-tokens", str(MAX_NEW)], cache_dir, timeout=600)
    assert res.returncode == 0, res.stderr
    out = res.stdout
    ref_acc = cli_report["layouts"][0]["accuracy"]
    assert f"{100 * ref_acc['all']['accuracy']:.1f}%" in out
    assert "drift against the reference" in out and "vision/image_features" in out
    assert f"0/{SLICE}" in out  # computed nothing: all from the cache
    assert "items where all-npu departs the most" in out
    page = (tmp_path / "rep" / "index.html").read_text()
    assert page.count("data:image/png;base64,") == 3
    saved = json.loads((tmp_path / "rep" / "eval.json").read_text())
    assert saved["layouts"][1]["drift"] == cli_report["layouts"][1]["drift"]


# -- resuming -----------------------------------------------------------------------------------------------------

class Interrupt(BaseException):
    pass


@pytest.fixture
def counted_captures(monkeypatch):
    from vlmrun.diff import capture as capture_mod

    calls = []
    real = capture_mod.capture_pipeline

    def counting(pipe, image, prompt, *args, **kwargs):
        calls.append((pipe.layout.name, str(image)))
        return real(pipe, image, prompt, *args, **kwargs)

    monkeypatch.setattr(capture_mod, "capture_pipeline", counting)
    return calls


def small_set(heldout: Path, tmp_path: Path, n: int) -> Path:
    d = tmp_path / "data"
    (d / "images").mkdir(parents=True)
    lines = heldout.read_text().splitlines()[:n]
    for line in lines:
        shutil.copy(heldout.parent / json.loads(line)["image"], d / json.loads(line)["image"])
    (d / "data.jsonl").write_text("\n".join(lines) + "\n")
    return d / "data.jsonl"


# results are keyed by the generation settings: a budget no other test uses keeps this test's results its own
RESUME_MAX_NEW = 46
AGAIN = "again=reference,decoder.context_length=600"  # a second host layout: same numbers, its own results


def test_resume_recomputes_nothing_finished(heldout, tiny_model, store, ref_pipe, tmp_path, counted_captures):
    from vlmrun import eval as ev

    data = small_set(heldout, tmp_path, 6)
    before = set((store.root / "eval").glob("*/*.json"))  # other tests' results in the session's store
    seen = []

    def stop_after_three(record, results):
        seen.append(record.key)
        if len(seen) == 3:
            raise Interrupt

    with pytest.raises(Interrupt):
        ev.evaluate(["reference", AGAIN], data, model=tiny_model, store=store, registry=ref_pipe.registry,
                    max_new_tokens=RESUME_MAX_NEW, on_item=stop_after_three)
    assert len(counted_captures) == 6  # 3 items x 2 layouts
    result_files = sorted(set((store.root / "eval").glob("*/*.json")) - before)
    finished = [f for f in result_files if f.name != "layout.json" and f.stem in seen]
    assert len(finished) == 6 and not [f for f in result_files
                                       if f.name != "layout.json" and f.stem not in seen]
    stamps = {f: f.stat().st_mtime_ns for f in finished}

    counted_captures.clear()
    run = ev.evaluate(["reference", AGAIN], data, model=tiny_model, store=store, registry=ref_pipe.registry,
                      max_new_tokens=RESUME_MAX_NEW)
    assert len(counted_captures) == 6  # only the 3 unfinished items, on both layouts
    assert {str(Path(image).name) for _, image in counted_captures} == {
        r.image.name for r in run.records if r.key not in seen}
    assert {f: f.stat().st_mtime_ns for f in finished} == stamps
    for lay in run.report["layouts"]:
        assert (lay["computed"], lay["cached"], lay["items"]) == (3, 3, 6)
    again = run.report["layouts"][1]
    assert again["drift"]["decoder/logits"]["sqnr_db"]["min"] == 200.0  # the same backend: no drift

    counted_captures.clear()
    rerun = ev.evaluate(["reference", AGAIN], data, model=tiny_model, store=store, registry=ref_pipe.registry,
                      max_new_tokens=RESUME_MAX_NEW)
    assert counted_captures == [] and rerun.report["layouts"][0]["computed"] == 0
    assert rerun.report["layouts"][0]["accuracy"] == run.report["layouts"][0]["accuracy"]


def test_added_layout_reuses_the_reference(heldout, tiny_model, store, ref_pipe, tmp_path, counted_captures):
    from vlmrun import eval as ev

    data = small_set(heldout, tmp_path, 3)
    ev.evaluate(["reference"], data, model=tiny_model, store=store, registry=ref_pipe.registry,
                max_new_tokens=47)
    assert len(counted_captures) == 3
    counted_captures.clear()
    run = ev.evaluate(["reference", "again2=reference,decoder.context_length=700"], data, model=tiny_model,
                      store=store, registry=ref_pipe.registry, max_new_tokens=47)
    assert len(counted_captures) == 3  # again2 only: the reference came from its stored captures
    assert run.report["layouts"][0]["computed"] == 0 and run.report["layouts"][1]["computed"] == 3


def test_a_device_result_is_kept_per_reference(heldout, tiny_model, store, ref_pipe, tmp_path, counted_captures):
    from vlmrun import eval as ev

    data = small_set(heldout, tmp_path, 2)
    other = "other=reference,decoder.context_length=600"
    kw = dict(model=tiny_model, store=store, registry=ref_pipe.registry, max_new_tokens=45)
    ev.evaluate([other], data, reference=other, **kw)  # `other` as the reference: answers, no diff
    counted_captures.clear()
    run = ev.evaluate([other], data, **kw)  # as a device against the reference: diffed, not the answers reused
    dev = run.report["layouts"][1]
    assert dev["label"] == "other" and dev["computed"] == 2 and dev["diff_pass_rate"] == 1.0
    assert len(counted_captures) == 2 + 2  # the reference's items and the device's, teacher-forced on them
    counted_captures.clear()
    again = ev.evaluate([other], data, reference="third=reference,decoder.context_length=650", **kw)
    assert again.report["layouts"][1]["computed"] == 2  # measured against another reference: measured again
    counted_captures.clear()
    rerun = ev.evaluate([other], data, **kw)
    assert rerun.report["layouts"][1]["computed"] == 0 and counted_captures == []  # the same reference: cached


# -- bad records --------------------------------------------------------------------------------------------------

def bad_set(heldout: Path, tmp_path: Path) -> tuple[Path, list[int]]:
    d = tmp_path / "bad"
    d.mkdir()
    first = json.loads(heldout.read_text().splitlines()[0])
    second = json.loads(heldout.read_text().splitlines()[1])
    shutil.copy(heldout.parent / first["image"], d / "a.png")
    shutil.copy(heldout.parent / second["image"], d / "b.png")
    (d / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not a picture")
    lines = [
        json.dumps({"image": "a.png", "question": first["question"], "answer": first["answer"]}),  # 1 ok
        "{not json",  # 2
        json.dumps({"image": "a.png", "answer": "A circle."}),  # 3 no question
        json.dumps({"image": "missing.png", "question": "What shape is in the image?", "answer": "A star."}),  # 4
        json.dumps(["a", "list"]),  # 5
        json.dumps({"image": "corrupt.png", "question": "What shape is in the image?", "answer": "A star."}),  # 6
        "",  # 7: blank lines are not records
        json.dumps({"image": "b.png", "question": second["question"], "answer": second["answer"]}),  # 8 ok
        json.dumps({"image": "a.png", "question": "What shape is in the image?"}),  # 9 no answer
        json.dumps({"image": "a.png", "question": "word " * 3000, "answer": "A star."}),  # 10 prompt too long
        json.dumps({"image": "a.png", "question": "What shape is in the image?", "answer": "..."}),  # 11 unscorable
    ]
    (d / "bad.jsonl").write_text("\n".join(lines) + "\n")
    return d / "bad.jsonl", [2, 3, 4, 5, 6, 9, 11, 10]  # line 10 is read, then fails when it runs: the last named


def eval_results(cache: Path) -> list[Path]:
    return [f for f in (cache / "eval").glob("*/*") if f.name != "layout.json"] if (cache / "eval").exists() else []


@pytest.mark.slow
def test_bad_records_are_skipped_counted_and_named(heldout, cache_dir, tmp_path):
    data, bad_lines = bad_set(heldout, tmp_path)
    cache = tmp_path / "cache"
    shutil.copytree(cache_dir / "artifacts", cache / "artifacts", ignore=shutil.ignore_patterns("*qnn*", "*htp*", ".tmp-*"))
    res = run_cli(["eval", str(data), "--json"], cache, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    skipped_lines = [ln for ln in res.stderr.splitlines() if ln.startswith("vlmrun eval: skipped ")]
    assert [int(re.search(r"bad\.jsonl:(\d+):", ln)[1]) for ln in skipped_lines] == bad_lines
    assert all(str(data) in ln for ln in skipped_lines)
    text = "\n".join(skipped_lines)
    for needle in ("bad.jsonl:2: not valid JSON", "bad.jsonl:3: the record has no question",
                   "bad.jsonl:4: image missing.png not found", "bad.jsonl:5: not a JSON object",
                   "bad.jsonl:6:", "bad.jsonl:9: the record has no answer", "bad.jsonl:10: the prompt is",
                   "bad.jsonl:11: the answer '...' is punctuation only"):
        assert needle in text, needle
    report = json.loads(res.stdout)
    assert report["items"] == 2 + 1 and report["skipped"] == len(bad_lines)  # line 10 is read, then fails
    assert [s["line"] for s in report["skipped_records"]] == bad_lines
    ref = report["layouts"][0]
    assert ref["items"] == 2 and ref["computed"] == 2
    # nothing stored for the items that failed: two results (json) and two captures (npz), for lines 1 and 8
    stored = eval_results(cache)
    assert sorted(f.suffix for f in stored) == [".json", ".json", ".npz", ".npz"]

    strict = run_cli(["eval", str(data), "--strict"], tmp_path / "cache2", timeout=600)
    assert strict.returncode == 1
    assert "Traceback" not in strict.stderr
    errors = [ln for ln in strict.stderr.splitlines() if ln.startswith("vlmrun: error:")]
    assert len(errors) == 1 and f"{data}:2: not valid JSON" in errors[0] and "--strict" in errors[0]
    assert eval_results(tmp_path / "cache2") == []

    empty = tmp_path / "empty.jsonl"
    empty.write_text("{oops\n")
    res = run_cli(["eval", str(empty)], tmp_path / "cache2", timeout=600)
    assert res.returncode == 2 and "has no usable record (1 skipped)" in res.stderr
    missing = run_cli(["eval", str(tmp_path / "nope.jsonl")], tmp_path / "cache2", timeout=600)
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr


def test_layout_spec_errors_before_any_work(tmp_path):
    for spec, message in (("reference,vision", "is not STAGE=BACKEND"), ("reference,visoin=x", "unknown stage"),
                          ("nope", "unknown layout 'nope'"), ("reference,vision=nobackend", "unknown backend")):
        res = run_cli(["eval", "--limit", "1", "-L", spec], tmp_path, timeout=300)
        assert res.returncode == 2 and message in res.stderr and "Traceback" not in res.stderr, (spec, res.stderr)
    assert not (tmp_path / "artifacts").exists()


# -- workers and batched stages -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_workers_give_the_same_results(heldout, cache_dir, tmp_path):
    data = small_set(heldout, tmp_path, 4)
    runs = {}
    for workers in (1, 2):
        cache = tmp_path / f"cache{workers}"
        shutil.copytree(cache_dir / "artifacts", cache / "artifacts", ignore=shutil.ignore_patterns("*qnn*", ".tmp-*"))
        res = run_cli(["eval", str(data), "--workers", str(workers), "--json", "-L", "reference", "-L", AGAIN],
                      cache, timeout=900)
        assert res.returncode == 0, res.stderr
        runs[workers] = json.loads(res.stdout)
        results = sorted(f for f in (cache / "eval").glob("*/*.json") if f.name != "layout.json")
        runs[workers]["texts"] = sorted(json.loads(f.read_text())["text"] for f in results)
    assert runs[2]["workers"] == 2 and runs[2]["layouts"][0]["computed"] == 4
    assert runs[1]["texts"] == runs[2]["texts"]
    for a, b in zip(runs[1]["layouts"], runs[2]["layouts"]):
        assert a["accuracy"] == b["accuracy"]


def batch_plugin(calls):
    """A backend for vision, projector and embed that runs ort_reference's sessions and implements
    ``run_stage_batch`` (as a hosted device would: one call per stage for the whole data set)."""
    from vlmrun import BackendInfo, hookimpl

    mod = types.ModuleType("batchy")
    name = "batchy"
    state = {}

    @hookimpl
    def describe():
        return BackendInfo(name, ("vision", "projector", "embed"), "batched test backend")

    @hookimpl
    def load_stage(backend, stage, ctx):
        if backend != name:
            return None
        state["hook"] = ctx.registry.hook
        return ctx.registry.hook.load_stage(backend="ort_reference", stage=stage, ctx=ctx)

    @hookimpl
    def run_stage(backend, stage, handle, inputs):
        if backend != name:
            return None
        calls.append(("single", stage))
        return state["hook"].run_stage(backend="ort_reference", stage=stage, handle=handle, inputs=inputs)

    @hookimpl
    def run_stage_batch(backend, stage, handle, inputs):
        if backend != name:
            return None
        calls.append(("batch", stage, len(inputs)))
        return [state["hook"].run_stage(backend="ort_reference", stage=stage, handle=handle, inputs=i)
                for i in inputs]

    mod.describe, mod.load_stage, mod.run_stage, mod.run_stage_batch = describe, load_stage, run_stage, \
        run_stage_batch
    return mod


def test_batched_stages_run_once_per_stage(heldout, tiny_model, store, tmp_path):
    from vlmrun import eval as ev
    from vlmrun.plugins import load

    calls = []
    registry = load(extra=[batch_plugin(calls)])
    data = small_set(heldout, tmp_path, 5)
    run = ev.evaluate(["reference", "hosted=reference,vision=batchy,projector=batchy,embed=batchy"], data,
                      model=tiny_model, store=store, registry=registry)
    assert calls == [("batch", "vision", 5), ("batch", "projector", 5), ("batch", "embed", 5)]
    hosted = run.report["layouts"][1]
    assert hosted["batched_stages"] == ["vision", "projector", "embed"]
    assert hosted["accuracy"] == run.report["layouts"][0]["accuracy"]
    assert hosted["drift"]["decoder/logits"]["sqnr_db"]["min"] == 200.0


# -- conversations ------------------------------------------------------------------------------------------------

def test_generated_conversations():
    import itertools

    from vlmrun import shapes

    convs = list(itertools.islice(shapes.conversations(shapes.HELDOUT_SEED), 200))
    assert convs[:20] == list(itertools.islice(shapes.conversations(shapes.HELDOUT_SEED), 20))  # deterministic
    assert {len(c) for c in convs} == {1, 2, 3}
    follow_ups = 0
    for conv in convs:
        assert conv[0].scene is not None and conv[0].question == shapes.QUESTIONS[conv[0].kind]
        scene = conv[0].scene
        for before, turn in itertools.pairwise(conv):
            if turn.question == shapes.FOLLOW_UP:  # a new picture, the same kind of answer about it
                follow_ups += 1
                assert turn.scene is not None and turn.kind == before.kind and turn.answer != before.answer
                scene = turn.scene
            else:
                assert turn.scene is None and turn.question == shapes.QUESTIONS[turn.kind]
            assert turn.kind in scene.kinds() and turn.answer == scene.answer(turn.kind)
    assert 30 < follow_ups < 150


def conversation_lines(tmp_path: Path) -> tuple[Path, list[str]]:
    from vlmrun import shapes

    path = shapes.write_conversations(tmp_path / "conv", 5)
    return path, path.read_text().splitlines()


def test_conversation_records_parse_and_bad_ones_are_skipped(tmp_path):
    from vlmrun.errors import InputError
    from vlmrun.eval import read_dataset

    path, lines = conversation_lines(tmp_path)
    first = json.loads(lines[1])  # three turns, the last bringing its own picture
    assert len(first["turns"]) == 3 and first["turns"][2]["question"] == "And this one?"
    assert "image" in first["turns"][2] and first["kind"] == "conversation"
    img = first["image"]
    q1, a1 = first["turns"][0]["question"], first["turns"][0]["answer"]
    extra = [
        json.dumps({"image": img, "question": q1, "answer": a1}),  # 6: a one-turn record
        json.dumps({"image": img, "turns": [{"question": q1, "answer": a1}]}),  # 7: the same, as one turn
        json.dumps({"image": img, "turns": "What shape is in the image?"}),  # 8
        json.dumps({"image": img, "turns": []}),  # 9
        json.dumps({"image": img, "turns": [{"question": q1}]}),  # 10
        json.dumps({"image": img, "turns": [{"question": q1, "answer": a1}, {"answer": "Red."}]}),  # 11
        json.dumps({"image": img, "turns": [{"question": q1, "answer": a1},
                                            {"image": "images/gone.png", "question": "And this one?",
                                             "answer": "A star."}]}),  # 12
        json.dumps({"turns": [{"question": q1, "answer": a1}, {"question": "Again?", "answer": "A."}]}),  # 13
        json.dumps({"image": img, "turns": [{"question": q1, "answer": a1}, "Red."]}),  # 14
        json.dumps({"image": img, "question": q1, "answer": a1,
                    "turns": [{"question": q1, "answer": a1}, {"question": "Again?", "answer": "A."}]}),  # 15
        json.dumps({"turns": [{"image": img, "question": q1, "answer": a1},
                              {"question": "Again?", "answer": "A."}]}),  # 16: the picture in its first turn
    ]
    path.write_text("\n".join(lines + extra) + "\n")
    seen = []
    records, skipped = read_dataset(path, on_skip=seen.append)
    assert [r.line for r in records] == [1, 2, 3, 4, 5, 6, 7, 16] and skipped == seen
    reasons = {s.line: s.reason for s in skipped}
    assert reasons[8].startswith("the record's turns are a str, not a list of turns")
    assert reasons[9].startswith("the record's turns are an empty list")
    assert reasons[10] == "turn 1 has no answer (a non-empty string 'answer')"
    assert reasons[11] == "turn 2 has no question (a non-empty string 'question')"
    assert reasons[12].startswith("turn 2: image images/gone.png not found (looked for ")
    assert reasons[13] == "the record has no image (a path 'image', relative to the data set file)"
    assert reasons[14] == "turn 2 is not a JSON object (a str)"
    assert reasons[15].startswith("the record has both turns and a question or answer")
    assert all("\n" not in s.message and s.message.startswith(f"{path}:{s.line}: ") for s in skipped)

    conv = records[1]
    assert [t.question for t in conv.turns] == [t["question"] for t in first["turns"]]
    assert [t.answer for t in conv.turns] == [t["answer"] for t in first["turns"]]
    assert conv.image == path.parent / img and conv.turns[0].image == conv.image and conv.turns[1].image is None
    assert conv.turns[2].image == path.parent / first["turns"][2]["image"]
    assert (conv.question, conv.answer, conv.kind) == (q1, a1, "conversation")
    one, one_as_turns = records[5], records[6]
    assert one.turns == () and one_as_turns.turns == () and one.asked == one_as_turns.asked
    assert one.key == one_as_turns.key and one.kind == one_as_turns.kind  # the same record, the same results
    assert conv.key != one.key and records[7].turns[0].image == conv.image
    assert len({r.key for r in records[:5]}) == 5

    with pytest.raises(InputError, match=r":8: the record's turns are a str.*--strict"):
        read_dataset(path, strict=True)


def test_conversations_are_answered_and_scored_per_turn(tiny_model, store, ref_pipe, tmp_path):
    from vlmrun import GenerationSettings
    from vlmrun import eval as ev

    path, lines = conversation_lines(tmp_path)
    first = json.loads(lines[0])
    one_turn = {"image": first["image"], "question": first["turns"][0]["question"],
                "answer": first["turns"][0]["answer"]}
    path.write_text("\n".join([*lines, json.dumps(one_turn)]) + "\n")
    run = ev.evaluate(["reference"], path, model=tiny_model, store=store, registry=ref_pipe.registry,
                      max_new_tokens=MAX_NEW)
    records = run.records
    convs = [r for r in records if r.turns]
    assert len(records) == 6 and len(convs) == 5
    report = run.report
    lay = report["layouts"][0]
    n_turns = sum(len(r.turns) for r in convs) + 1
    assert report["turns"] == lay["turns"] == lay["accuracy"]["all"]["n"] == n_turns
    by_turn = lay["accuracy_by_turn"]
    assert list(by_turn) == ["turn 1", "turn 2", "turn 3"]
    assert by_turn["turn 1"]["n"] == 6 and by_turn["turn 2"]["n"] == 5
    assert by_turn["turn 3"]["n"] == sum(len(r.turns) == 3 for r in convs)
    assert sum(t["n"] for t in by_turn.values()) == n_turns
    assert sum(t["correct"] for t in by_turn.values()) == lay["accuracy"]["all"]["correct"]
    assert lay["accuracy"]["conversation"]["n"] == n_turns - 1  # the one-turn record asks a kind of its own

    # each turn answered as a chat with the model's own answers in the history (computed here from scratch,
    # no kept decoder state) and scored against its expected answer
    settings = GenerationSettings(max_new_tokens=MAX_NEW)
    assert [rec["line"] for rec in lay["records"]] == [r.line for r in records]
    for r, rec in zip(records, lay["records"]):
        chat = ref_pipe.chat(settings=settings, keep_state=False)
        got = [chat.ask(t.question, image=t.image).run().text for t in r.asked]
        assert [t["got"] for t in rec["turns"]] == got
        assert [t["expected"] for t in rec["turns"]] == [t.answer for t in r.asked]
        assert [t["correct"] for t in rec["turns"]] == [norm(g) == norm(t.answer) for g, t in zip(got, r.asked)]
        assert set(rec["turns"][0]) == {"question", "expected", "got", "correct"}
        assert all(set(t) - {"image"} == {"question", "expected", "got", "correct"} for t in rec["turns"])
        assert [("image" in t) for t in rec["turns"][1:]] == [t.image is not None for t in r.asked[1:]]
        cached = run.results[lay["key"]][r.key]
        if r.turns:
            assert [t["text"] for t in cached["turns"]] == got and "text" not in cached
            assert cached["turns"][1]["reused_tokens"] > 0  # the kept state: only the new turn was prefilled
    # turn 1 of a conversation is the one-turn question's answer, as a one-turn record gets it
    conv0, single = records[0], records[-1]
    assert single.turns == () and single.image == conv0.image and single.question == conv0.question
    assert lay["records"][0]["turns"][0]["got"] == lay["records"][-1]["turns"][0]["got"] \
        == run.results[lay["key"]][single.key]["text"]
    assert ref_pipe.generate(single.image, single.question, settings).run().text == \
        lay["records"][-1]["turns"][0]["got"]
    assert all(by_turn[t]["accuracy"] == by_turn[t]["correct"] / by_turn[t]["n"] for t in by_turn)
    assert by_turn["turn 1"]["accuracy"] >= 5 / 6  # the model's own question kinds, one turn: it knows them

    table = ev.format_table(report)
    assert f"({len(records)} items, {n_turns} turns, 0 skipped)" in table
    assert "accuracy per turn" in table and f"({by_turn['turn 2']['correct']}/5)" in table
    json.dumps(report)  # JSON-able

    # a second run computes nothing; a data set of one-turn records keeps the report it had
    again = ev.evaluate(["reference"], path, model=tiny_model, store=store, registry=ref_pipe.registry,
                        max_new_tokens=MAX_NEW)
    assert again.report["layouts"][0]["computed"] == 0
    assert again.report["layouts"][0]["accuracy_by_turn"] == by_turn
    plain = tmp_path / "conv" / "one.jsonl"
    plain.write_text(json.dumps(one_turn) + "\n")
    one = ev.evaluate(["reference"], plain, model=tiny_model, store=store, registry=ref_pipe.registry,
                      max_new_tokens=MAX_NEW).report
    assert "turns" not in one and not {"turns", "accuracy_by_turn", "records"} & set(one["layouts"][0])
    assert one["layouts"][0]["computed"] == 0  # the conversation set's one-turn record: the same result
    assert "accuracy per turn" not in ev.format_table(one)


def test_cli_evaluates_the_generated_conversations(cache_dir, ref_pipe, tmp_path):
    res = run_cli(["eval", "--conversations", "--limit", "4", "--json"], cache_dir, timeout=600)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["items"] == 4 and report["dataset"].endswith("conversations.jsonl")
    lay = report["layouts"][0]
    assert report["turns"] == lay["turns"] == sum(len(r["turns"]) for r in lay["records"])
    assert sum(t["n"] for t in lay["accuracy_by_turn"].values()) == report["turns"]
    table = run_cli(["eval", "--conversations", "--limit", "4"], cache_dir, timeout=600)
    assert table.returncode == 0 and "accuracy per turn" in table.stdout and "0/4" in table.stdout
    both = run_cli(["eval", str(tmp_path / "x.jsonl"), "--conversations"], cache_dir, timeout=300)
    assert both.returncode == 2 and "not both" in both.stderr and "Traceback" not in both.stderr


def test_a_number_keeps_its_sign_point_and_percent_when_answers_are_compared():
    from vlmrun.eval.answers import is_correct, normalize_answer

    assert normalize_answer(" A red  Circle. ") == "a red circle" and is_correct("Light-blue.", "light blue")
    for a, b in (("-1", "1"), ("5%", "5"), ("1.5", "15"), ("+3", "3")):
        assert not is_correct(a, b), (a, b)
    assert is_correct("It is -1.5%.", "it is -1.5%") and is_correct("(-2)", "-2")


def test_a_layout_that_ran_no_item_is_an_error_not_an_empty_report(heldout, tiny_model, store, ref_pipe, tmp_path):
    from vlmrun import eval as ev
    from vlmrun.errors import VlmrunError

    first = json.loads(heldout.read_text().splitlines()[0])
    shutil.copy(heldout.parent / first["image"], tmp_path / "a.png")
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"image": "a.png", "question": "word " * 3000, "answer": "A star."}) + "\n")
    with pytest.raises(VlmrunError, match=r"layout 'reference' ran none of the 1 items: each one failed \(the first:"
                                          r" .*long.jsonl:1: the prompt is"):
        ev.evaluate(["reference"], data, model=tiny_model, store=store, registry=ref_pipe.registry)


def test_an_item_a_layout_cannot_run_is_scored_wrong_not_left_out(heldout, tiny_model, store, ref_pipe, tmp_path):
    """A layout whose context is too short for one item: the item was left out of its score (accuracy and diff
    pass rate over the items it could run; a bundle's verification said "passed on all N" of fewer than asked)."""
    from vlmrun import eval as ev
    from vlmrun.bundle import verification_failures

    data = small_set(heldout, tmp_path, 2)
    lines = data.read_text().splitlines()
    long = json.loads(lines[1])
    long["question"] = "Look closely at the picture, " * 12 + long["question"]
    data.write_text(lines[0] + "\n" + json.dumps(long) + "\n")
    run = ev.evaluate(["short=reference,decoder.context_length=110"], data, model=tiny_model, store=store,
                      registry=ref_pipe.registry, max_new_tokens=44)
    ref, short = run.report["layouts"]
    assert ref["items"] == 2 and short["items"] == 1 and short["not_run"] == 1
    assert short["diff_pass_rate"] == 0.5 and short["culprits"] == {"not run": 1}
    assert short["accuracy"]["all"]["n"] == 2 and short["accuracy"]["all"]["correct"] <= 1
    assert [s.line for s in run.skipped] == [2] and "but the context holds 110" in run.skipped[0].message
    # a bundle's verification with such an item: not passed
    assert verification_failures({"items": 1, "asked": 2, "not_run": 1, "diff_pass_rate": 0.5}) == [
        "the bundle ran 1 of the 2 held-out items asked (the others failed)",
        "vlmrun diff failed on 1 of 2 held-out items (same answer as the reference 0%)"]
