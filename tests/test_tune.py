"""``vlmrun tune``: every point of the front is a build measured on the emulator (its figures equal an independent
``vlmrun eval`` / ``vlmrun compile`` of its layout on a store that has no eval results); the TOML it writes
reproduces the winner; a resumed tune builds nothing; bad arguments are one line each before any work; on a real
local Ray cluster (loopback only) the same tune gives the same points, and ``vlmrun eval --ray`` the same figures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import free_port, run_cli

LAYERS = "decoder.layer0,decoder.lm_head"
ITEMS = 3  # not the docs' 2 (tune.md runs a tune like this one on the same session store)
SMALL = ["tune", "--stages", "decoder", "--layers", LAYERS, "--limit", str(ITEMS), "--beam", "2",
         "--max-candidates", "4", "--json"]
UNREACHABLE = ["--min-logits-sqnr", "80"]


def artifact_dirs(cache: Path) -> set[str]:
    return {p.name for p in (cache / "artifacts").iterdir()} if (cache / "artifacts").is_dir() else set()


def fresh_copy(cache: Path, dest: Path) -> Path:
    """The store's model and compiled artifacts, without any eval result or tuned point."""
    dest.mkdir(parents=True)
    for p in cache.iterdir():
        if p.name in ("eval", "tune"):
            continue
        (shutil.copytree if p.is_dir() else shutil.copy2)(p, dest / p.name)
    return dest


def eval_figures(cache: Path, layout_file: Path, extra=(), env=None) -> dict:
    res = run_cli(["eval", "-L", f"pt={layout_file}", "--limit", str(ITEMS), "--json", *extra], cache, env_extra=env,
                  timeout=900)
    assert res.returncode == 0, res.stderr
    lay = next(e for e in json.loads(res.stdout)["layouts"] if not e["is_reference"])
    return {"accuracy": lay["accuracy"]["all"]["accuracy"], "answers": lay["same_answer_as_reference"],
            "sqnr": lay["drift"]["decoder/logits"]["sqnr_db"]["median"]}


def compiled_bytes(cache: Path, layout_file: Path) -> int:
    """Bytes of the binaries a layout compiles to, from the files on disk."""
    res = run_cli(["compile", "--layout-file", str(layout_file), "--json"], cache, timeout=900)
    assert res.returncode == 0, res.stderr
    total = 0
    for art in json.loads(res.stdout)["artifacts"]:
        for name in art.get("binary_bytes") or {}:
            total += (Path(art["path"]) / name).stat().st_size
    return total


@pytest.fixture(scope="module")
def first_tune(cache_dir, tmp_path_factory):
    """A small tune whose budget no build meets: it climbs until --max-candidates (4 builds)."""
    before = artifact_dirs(cache_dir)
    res = run_cli([*SMALL, *UNREACHABLE], cache_dir, timeout=1800)
    assert res.returncode == 1, res.stderr
    assert "no build met the budget" in res.stderr.splitlines()[-1]
    assert "Traceback" not in res.stderr
    return json.loads(res.stdout), before


def test_points_are_measured_builds(first_tune, cache_dir, tmp_path_factory):
    result, _ = first_tune
    points = result["points"]
    assert [p["label"] for p in points] == ["base", "c1", "c2", "c3"]
    assert result["built"] == 4 and result["winner"] is None
    # step 1 raised the two most sensitive layers, one each; every raise is a rung of the w4a16 ladder
    assert result["ladders"] == {"decoder": ["w8", "a16w16"]}
    ranked = [name for name, _ in result["sensitivity"]["decoder"] if name in LAYERS.split(",")]
    assert [next(iter(p["layers"])) for p in points[1:3]] == ranked
    assert all(set(p["layers"]) <= set(LAYERS.split(",")) for p in points)
    assert all(v in ("w8", "a16w16") for p in points for v in p["layers"].values())
    assert len({p["key"] for p in points}) == 4  # four distinct builds

    # a point's figures equal an independent eval (no cached results) and compile of its layout: the base and the
    # last point, which holds every raise of the climb (the other two are checked the same way by the Ray test)
    from vlmrun.tune.front import layout_text
    from vlmrun.tune.search import Point

    copy = fresh_copy(cache_dir, tmp_path_factory.mktemp("tune-independent") / "cache")
    for p in (points[0], points[-1]):
        toml = copy.parent / f"{p['label']}.toml"
        toml.write_text(layout_text(Point.from_json(p), "test"))
        got = eval_figures(copy, toml)
        assert got["accuracy"] == p["accuracy"]
        assert got["answers"] == p["answers_as_reference"]
        assert got["sqnr"] == pytest.approx(p["logits_sqnr_db"], abs=1e-6)
        assert compiled_bytes(copy, toml) == p["bytes"]

    # the front: exactly the points no other point dominates, computed here
    def objectives(p):
        return (-p["bytes"], p["logits_sqnr_db"], p["answers_as_reference"], p["accuracy"])

    def dominated(p):
        return any(all(a >= b for a, b in zip(objectives(q), objectives(p))) and objectives(q) != objectives(p)
                   for q in points)

    assert sorted(result["front"]) == sorted(p["label"] for p in points if not dominated(p))
    assert result["front"]


def test_winner_toml_and_resume(first_tune, cache_dir, tmp_path):
    result, _ = first_tune
    points = {p["label"]: p for p in result["points"]}
    step1 = [points["c1"], points["c2"]]
    target = max(p["logits_sqnr_db"] for p in step1) - 1e-3
    expected = min((p for p in step1 if p["logits_sqnr_db"] >= target), key=lambda p: p["bytes"])
    before = artifact_dirs(cache_dir)
    out, report = tmp_path / "best.toml", tmp_path / "report"
    res = run_cli([*SMALL, "--min-logits-sqnr", str(target), "--out", str(out), "--report", str(report)], cache_dir)
    assert res.returncode == 0, res.stderr
    again = json.loads(res.stdout)
    assert again["built"] == 0  # every point came back from the store
    assert artifact_dirs(cache_dir) == before  # nothing compiled
    assert again["winner"] == expected["label"]
    won = next(p for p in again["points"] if p["label"] == again["winner"])
    assert won["bytes"] == expected["bytes"] and won["logits_sqnr_db"] == expected["logits_sqnr_db"]
    # the TOML reproduces the winner's figures (through vlmrun eval on the same store)
    text = out.read_text()
    assert "layer_precision" in text and 'precision = "w4a16"' in text
    got = eval_figures(cache_dir, out)
    assert got["sqnr"] == pytest.approx(won["logits_sqnr_db"], abs=1e-6)
    assert got["answers"] == won["answers_as_reference"] and got["accuracy"] == won["accuracy"]
    page = (report / "index.html").read_text()
    assert "<img alt=\"bytes against logits SQNR\" src=\"data:image/png;base64," in page and "<table>" in page
    assert json.loads((report / "tune.json").read_text())["winner"] == expected["label"]


@pytest.mark.parametrize("args, message", [
    (["--max-accuracy-drop", "1.5"], "--max-accuracy-drop '1.5' is outside 0..1"),
    (["--min-answers-as-reference", "most"], "--min-answers-as-reference 'most' is not a number"),
    (["--min-logits-sqnr", "loud"], "--min-logits-sqnr 'loud' is not a number of dB"),
    # a limit no build can miss would take every build
    (["--max-accuracy-drop", "100%"], "--max-accuracy-drop '100%' takes every build"),
    (["--min-answers-as-reference", "0"], "--min-answers-as-reference '0' takes every build"),
    (["--min-logits-sqnr", "-100"], "--min-logits-sqnr '-100' dB is not a usable floor: give more than 0 dB"),
    (["--layers", "decoder.layer99"], "'decoder.layer99' is not a layer of stage 'decoder'; its layers are"
                                      " decoder.layer0, decoder.layer1, decoder.layer2, decoder.norm, decoder.lm_head"),
    (["--stages", "decoder", "--layers", "vision.stem"], "--layers vision.stem: its stage 'vision' is not tuned"),
    (["--layout", "all-npu", "--stages", "decoder"], "stage 'decoder' (qnn_htp, precision fp16) has no quantized"
                                                     " precision to tune"),
    (["--layout", "reference"], "has no stage with a quantized precision to tune"),
    (["--stages", "splice"], "unknown stage 'splice' in --stages"),
    # compared with itself, the reference would be a point of 0 bytes and every answer the reference's: the winner
    (["--layers", "decoder.layer0", "--anchor", "reference"], "reference is the reference layout itself"),
])
def test_bad_arguments_one_line_before_work(cache_dir, ref_pipe, args, message):
    before = artifact_dirs(cache_dir)
    res = run_cli(["tune", *args], cache_dir)
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.startswith("vlmrun")]
    assert len(lines) == 1 and message in lines[0], res.stderr
    assert "Traceback" not in res.stderr
    assert {d for d in artifact_dirs(cache_dir) - before if "qnn_htp" in d} == set()  # nothing compiled


# -- Ray ------------------------------------------------------------------------------------------------------------


def test_ray_gives_the_single_process_results(first_tune, cache_dir, ray_cluster, tmp_path_factory):
    address, env = ray_cluster
    result, _ = first_tune
    copy = fresh_copy(cache_dir, tmp_path_factory.mktemp("tune-ray") / "cache")
    res = run_cli([*SMALL, *UNREACHABLE, "--ray", address], copy, env_extra=env, timeout=1800)
    assert res.returncode == 1, res.stderr
    on_ray = json.loads(res.stdout)
    assert on_ray["built"] == 4
    assert [(p["label"], p["layers"], p["bytes"], p["accuracy"], p["answers_as_reference"])
            for p in on_ray["points"]] == [(p["label"], p["layers"], p["bytes"], p["accuracy"],
                                            p["answers_as_reference"]) for p in result["points"]]
    for a, b in zip(on_ray["points"], result["points"]):
        assert a["logits_sqnr_db"] == pytest.approx(b["logits_sqnr_db"], abs=1e-6)
    assert on_ray["front"] == result["front"]
    # vlmrun eval --ray: the items on Ray actors, the same figures as in one process
    from vlmrun.tune.front import layout_text
    from vlmrun.tune.search import Point

    last = result["points"][-1]
    toml = copy.parent / "last.toml"
    toml.write_text(layout_text(Point.from_json(last), "test"))
    shutil.rmtree(copy / "eval")
    got = eval_figures(copy, toml, ["--ray", address], env)
    assert got["sqnr"] == pytest.approx(last["logits_sqnr_db"], abs=1e-6)
    assert got["answers"] == last["answers_as_reference"] and got["accuracy"] == last["accuracy"]


def test_ray_unreachable_is_one_line(cache_dir, ref_pipe):
    res = run_cli(["tune", "--layers", "decoder.layer0", "--ray", f"127.0.0.1:{free_port()}"], cache_dir,
                  env_extra={"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}, timeout=300)
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.startswith("vlmrun")]
    assert len(lines) == 1 and "cannot join the Ray cluster at 127.0.0.1:" in lines[0], res.stderr


def test_a_budget_without_limits_is_the_default_not_anything_goes():
    """`tune.Budget()` through the API set no limit, and every build was within it (the smallest, whatever its
    answers, would have won); it is `Budget.of()`'s default now: every answer as the reference's."""
    from vlmrun.tune.climb import Point
    from vlmrun.tune.search import Budget

    def point(answers):
        return Point("p", {}, {}, 1, 0.5, 0.9, answers, 10.0, 0.0, 4, "k")

    assert Budget() == Budget.of() == Budget(min_answers_as_reference=1.0)
    assert Budget().misses(point(0.25)) == ["answers as reference 25.0% < 100.0%"]
    assert Budget().misses(point(1.0)) == [] and Budget().describe() == "answers as reference >= 100.0%"
    assert Budget(min_logits_sqnr=5.0).misses(point(0.25)) == []  # a limit that is set is the only one checked


def test_a_point_is_kept_per_items_and_reference_not_per_path(cache_dir, store, ref_pipe, tmp_path):
    """A tuned point's figures depend on the items measured and the reference: the same data set path with other
    expected answers, or another reference, measures the build again instead of reading back the old figures."""
    from vlmrun.eval import heldout_dataset
    from vlmrun.tune import tune

    heldout = heldout_dataset(store)
    lines = [json.loads(line) for line in heldout.read_text().splitlines()[:2]]
    (tmp_path / "images").mkdir()
    for rec in lines:
        shutil.copy(heldout.parent / rec["image"], tmp_path / rec["image"])
    data = tmp_path / "set.jsonl"

    def write(answers):
        data.write_text("".join(json.dumps({**rec, "answer": a}) + "\n" for rec, a in zip(lines, answers)))

    # a token budget no other tune uses (docs/tune.md measures these same two items): this test's points its own
    kw = dict(store=store, registry=ref_pipe.registry, stages=["decoder"], layers=LAYERS.split(","), limit=2,
              max_candidates=1, max_new_tokens=43)
    write([rec["answer"] for rec in lines])
    first = tune(None, data, **kw)
    assert first.built == 1 and tune(None, data, **kw).built == 0  # the same items: read back
    write(["no such answer", "nor this"])  # the same path, other expected answers
    changed = tune(None, data, **kw)
    assert changed.built == 1 and changed.points[0].accuracy == 0.0 < first.points[0].accuracy
    other = tune(None, data, reference="ref2=reference,decoder.context_length=600", **kw)
    assert other.built == 1  # compared with another reference: measured again


def test_a_nan_figure_misses_every_limit_it_is_held_to():
    """A device whose logits went non-finite has NaN figures: every comparison with NaN is false, so "x < floor"
    never fired and a NaN SQNR met --min-logits-sqnr; and eval's medians left NaN items out."""
    import attrs

    from vlmrun.eval.report import distribution
    from vlmrun.tune.climb import Point
    from vlmrun.tune.search import Budget

    p = Point("p", {}, {}, 1, 0.5, 0.5, 1.0, 10.0, 0.0, 4, "k")
    nan = float("nan")
    assert Budget(min_logits_sqnr=5.0).misses(attrs.evolve(p, logits_sqnr_db=nan)) == ["logits SQNR nan dB < 5.0 dB"]
    assert Budget(min_answers_as_reference=0.5).misses(attrs.evolve(p, answers_as_reference=nan))
    assert Budget(max_accuracy_drop=0.1).misses(attrs.evolve(p, accuracy=nan))
    assert distribution([40.0, nan, 30.0]) == {"n": 3, "median": None, "p5": None, "min": None, "max": None,
                                               "mean": None, "non_finite": 1}
    assert distribution([40.0, None, 30.0])["median"] == 35.0  # not measured (None) is not a figure
