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

SLICE = 24  # items of the held-out set in the reference / all-npu test (6 per question kind)
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
    ]
    (d / "bad.jsonl").write_text("\n".join(lines) + "\n")
    return d / "bad.jsonl", [2, 3, 4, 5, 6, 9, 10]


def eval_results(cache: Path) -> list[Path]:
    return [f for f in (cache / "eval").glob("*/*") if f.name != "layout.json"] if (cache / "eval").exists() else []


@pytest.mark.slow
def test_bad_records_are_skipped_counted_and_named(heldout, cache_dir, tmp_path):
    data, bad_lines = bad_set(heldout, tmp_path)
    cache = tmp_path / "cache"
    shutil.copytree(cache_dir / "artifacts", cache / "artifacts", ignore=shutil.ignore_patterns("*qnn*", "*htp*"))
    res = run_cli(["eval", str(data), "--json"], cache, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "Traceback" not in res.stderr
    skipped_lines = [ln for ln in res.stderr.splitlines() if ln.startswith("vlmrun eval: skipped ")]
    assert [int(re.search(r"bad\.jsonl:(\d+):", ln)[1]) for ln in skipped_lines] == bad_lines
    assert all(str(data) in ln for ln in skipped_lines)
    text = "\n".join(skipped_lines)
    for needle in ("bad.jsonl:2: not valid JSON", "bad.jsonl:3: the record has no question",
                   "bad.jsonl:4: image missing.png not found", "bad.jsonl:5: not a JSON object",
                   "bad.jsonl:6:", "bad.jsonl:9: the record has no answer", "bad.jsonl:10: the prompt is"):
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
        shutil.copytree(cache_dir / "artifacts", cache / "artifacts", ignore=shutil.ignore_patterns("*qnn*"))
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
