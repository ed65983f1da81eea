"""qaihub's ``run_stage_batch``: ``vlmrun eval`` sends a data set to the hosted device in ONE inference job per
stage (a multi-sample dataset: input name -> list of N arrays), not one job per item; against tests/fake_hub.py
driven by the real, unmodified qai_hub client.

What is asserted: one job per batched stage (vision, projector, embed) with N samples; the per-item outputs equal
per-item ``run_stage`` (one job each) within tolerance; embed's token ids of different lengths in one job; a rerun
submits nothing, also after an interruption left some items unfinished (finished batch jobs are found in the
ledger and their outputs downloaded again); a failed batch job is one line naming the job, the stage and the
hub's reason; batches above ``batch_mb`` or refused by the hub with HTTP 413 are split into as few jobs as fit.
Nothing here depends on the (placeholder) model answering correctly: only on equalities.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime_qnn")
pytest.importorskip("qai_hub")

from fake_hub import serving  # noqa: E402
from vlmrun import Pipeline  # noqa: E402
from vlmrun.errors import BackendError  # noqa: E402
from vlmrun.layouts import Layout, StageAssignment  # noqa: E402
from vlmrun.stages import STAGES  # noqa: E402

TOKEN = "hubtok-" + secrets.token_hex(12)
N = 6  # items of the held-out set
BATCHED = ("vision", "projector", "embed")
HOSTED = "hosted=reference,vision=qaihub,projector=qaihub,embed=qaihub"
MAX_NEW = 8


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with serving(TOKEN, tmp_path_factory.mktemp("qaihub-batch")) as server:
        yield server


@pytest.fixture(scope="module")
def hub_store(cache_dir, tmp_path_factory):
    """This module's own store: the session's exports, without the hub binaries other tests' fake hubs compiled
    (this module's fake hub does not know them; a real hub would not either once it forgot them)."""
    import shutil

    from vlmrun.store import ArtifactStore

    root = tmp_path_factory.mktemp("qaihub-batch-store")
    if (cache_dir / "artifacts").exists():
        shutil.copytree(cache_dir / "artifacts", root / "artifacts",
                        ignore=shutil.ignore_patterns("*qnn*", "*htp*", "*qaihub*", ".tmp-*"))
    return ArtifactStore(root)


@pytest.fixture(scope="module")
def registry():
    from vlmrun import plugins

    return plugins.load()


def heldout_items(out: Path, first: int, n: int) -> Path:
    """Items ``first`` .. ``first + n - 1`` of the generated held-out set, as a JSONL data set in ``out``."""
    from vlmrun import shapes

    shapes.write_dataset(out, first + n, seed=shapes.HELDOUT_SEED)
    path = out / "data.jsonl"
    path.write_text("\n".join(path.read_text().splitlines()[first:]) + "\n")
    return path


class Spy:
    """Wraps ``vlmrun.eval.engine.precompute``: what each batched side computed, and its handles' profiles."""

    def __init__(self):
        self.calls: list[dict] = []

    def install(self, mp):
        from vlmrun.eval import engine

        original = engine.precompute

        def precompute(side, records, stages, progress):
            original(side, records, stages, progress)
            self.calls.append({"side": side, "records": list(records), "stages": list(stages),
                               "profiles": {s: dict(side.pipe.handles[s].last_profile) for s in stages}})

        mp.setattr(engine, "precompute", precompute)


def evaluate(data, store, model, registry, spy=None):
    from vlmrun import eval as ev

    with pytest.MonkeyPatch.context() as mp:
        if spy is not None:
            spy.install(mp)
        return ev.evaluate(["reference", HOSTED], data, model=model, store=store, registry=registry,
                           max_new_tokens=MAX_NEW)


def hosted_results(run) -> dict:
    """The hosted layout's result per item (the reference's come first)."""
    return run.results[list(run.results)[1]]


@pytest.fixture(scope="module")
def first_run(hub, tiny_model, hub_store, registry, tmp_path_factory):
    data = heldout_items(tmp_path_factory.mktemp("heldout"), 0, N)
    jobs0, compiles0 = len(hub.inference_jobs), len(hub.compile_options)
    spy = Spy()
    run = evaluate(data, hub_store, tiny_model, registry, spy)
    return {"data": data, "run": run, "spy": spy, "jobs": hub.inference_jobs[jobs0:],
            "compiles": len(hub.compile_options) - compiles0}


def test_eval_sends_one_inference_job_per_stage(first_run):
    run, jobs = first_run["run"], first_run["jobs"]
    assert first_run["compiles"] == 3  # vision, projector, embed compiled once on the hub
    hosted = run.report["layouts"][1]
    assert hosted["batched_stages"] == list(BATCHED)
    # exactly one inference job per batched stage, not one per item
    assert [j["name"] for j in jobs] == [f"vlmrun {s} batch of {j['samples']}" for s, j in zip(BATCHED, jobs)]
    by_stage = dict(zip(BATCHED, jobs))
    assert by_stage["vision"]["samples"] == N and by_stage["projector"]["samples"] == N
    assert by_stage["vision"]["shapes"]["pixel_values"] == (1, 3, 256, 256)
    # embed: token ids of different lengths, cut into the compiled length's chunks: still one job
    call = first_run["spy"].calls[0]
    pipe = call["side"].pipe
    seq = pipe.handles["embed"].embed_seq
    lengths, chunks = set(), set()
    for r in call["records"]:
        ids = pipe.prepare(r.image, r.question).input_ids
        lengths.add(ids.shape[1])
        padded = np.zeros((1, -(-ids.shape[1] // seq) * seq), np.int64)
        padded[:, : ids.shape[1]] = ids
        chunks.update(padded[:, i : i + seq].tobytes() for i in range(0, padded.shape[1], seq))
    assert len(lengths) > 1, lengths
    assert by_stage["embed"]["shapes"]["input_ids"] == (1, seq)
    assert by_stage["embed"]["samples"] == len(chunks)  # every distinct chunk once
    # the handle's profile describes the batch job
    prof = call["profiles"]["vision"]
    assert prof["job_id"] == by_stage["vision"]["id"] and prof["job_id"] in prof["url"]
    assert prof["inferences"] == N and prof["items"] == N and "job_ids" not in prof
    assert prof["inference_ms"] == pytest.approx(prof["inference_each_ms"] * N, rel=1e-3)
    assert call["profiles"]["embed"]["inferences"] == by_stage["embed"]["samples"]
    assert len(run.records) == N and all(r is not None for r in hosted_results(run).values())


def test_batch_outputs_equal_per_item_run_stage(first_run, hub):
    """The batch's outputs, split per item, equal ``run_stage`` per item (one inference job per item)."""
    call = first_run["spy"].calls[0]
    side, pipe = call["side"], call["side"].pipe
    from vlmrun.eval.engine import _digest

    jobs0 = len(hub.inference_jobs)
    for r in call["records"]:
        p = pipe.prepare(r.image, r.question)
        feeds = {"vision": {"pixel_values": p.pixel_values}, "embed": {"input_ids": p.input_ids}}
        feeds["projector"] = {"image_features": side.precomputed[("vision", _digest(feeds["vision"]))]
                              ["image_features"]}
        for stage in BATCHED:
            batch = side.precomputed[(stage, _digest(feeds[stage]))]
            single = pipe.registry.hook.run_stage(backend="qaihub", stage=stage, handle=pipe.handles[stage],
                                                  inputs=feeds[stage])
            assert set(batch) == set(single)
            for name in single:
                a, b = np.asarray(batch[name]), np.asarray(single[name])
                assert a.shape == b.shape and a.dtype == b.dtype, (stage, name)
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.abs(b).max() or 1.0),
                                           err_msg=f"{stage}/{name} item {r.key}")
    assert len(hub.inference_jobs) - jobs0 == 3 * N  # per-item: one job each (the comparison's side)


def results_of(run, key):
    """Each item's result without its timing and run id."""
    return {ikey: {k: v for k, v in res.items() if k not in ("seconds", "run")}
            for ikey, res in run.results[key].items()}


def test_rerun_resubmits_nothing(first_run, hub, tiny_model, hub_store, registry, capfd):
    run0 = first_run["run"]
    hosted_key = list(run0.results)[1]
    capfd.readouterr()
    posts0 = hub.count("POST", "jobs")
    again = evaluate(first_run["data"], hub_store, tiny_model, registry)
    assert hub.count("POST", "jobs") == posts0  # everything cached: not even a lookup of the batch jobs
    assert results_of(again, hosted_key) == results_of(run0, hosted_key)
    # an eval interrupted after the batch jobs finished, with half of the items unfinished: the rerun batches
    # those again and the ledger serves them from the finished jobs (downloaded again), submitting nothing
    cache = Path(hub_store.root) / "eval" / hosted_key
    dropped = [r.key for r in run0.records[: N // 2]]
    for ikey in dropped:
        (cache / f"{ikey}.json").unlink()
    spy = Spy()
    resumed = evaluate(first_run["data"], hub_store, tiny_model, registry, spy)
    err = capfd.readouterr().err
    assert hub.count("POST", "jobs") == posts0, err
    assert [len(c["records"]) for c in spy.calls] == [len(dropped)]
    assert err.count("downloading the outputs of") == 3 and "submitted on" not in err, err
    prof = spy.calls[0]["profiles"]["vision"]
    assert prof["job_id"] == first_run["jobs"][0]["id"] and prof["items"] == len(dropped)
    assert results_of(resumed, hosted_key) == results_of(run0, hosted_key)
    assert TOKEN not in err


def test_failed_batch_job_is_one_line(hub, tiny_model, hub_store, registry, tmp_path, capfd):
    from vlmrun.cli import main

    data = heldout_items(tmp_path / "other", N, 2)  # items no batch job has run yet
    reason = "QNN graph execute failed: HTP DMA error (code 1002)"
    hub.fail_inference = reason
    jobs0 = len(hub.inference_jobs)
    capfd.readouterr()
    try:
        code = main(["eval", str(data), "-L", HOSTED, "--cache-dir", str(hub_store.root), "--image-size", "256",
                     "--max-new-tokens", str(MAX_NEW)])
    finally:
        hub.fail_inference = None
    err = capfd.readouterr().err
    failed = hub.inference_jobs[jobs0]
    errors = [ln for ln in err.splitlines() if ln.startswith("vlmrun: error:")]
    assert code != 0 and len(errors) == 1 and "Traceback" not in err, err
    assert f"AI Hub vision inference job {failed['id']} failed: {reason}" in errors[0]
    assert failed["samples"] == 2 and len(hub.inference_jobs) == jobs0 + 1  # one job for the batch, then stop
    # the failed job is not re-attached: the rerun submits new jobs and finishes (embed's chunks may all be in
    # the first run's embed job already: the prompts' shared chunks are sent once)
    run = evaluate(data, hub_store, tiny_model, registry)
    new = [(j["name"], j["samples"]) for j in hub.inference_jobs[jobs0 + 1:]]
    assert new[:2] == [("vlmrun vision batch of 2", 2), ("vlmrun projector batch of 2", 2)], new
    assert len(new) <= 3 and all(name.startswith("vlmrun embed batch") for name, _ in new[2:])
    assert all(r is not None for r in hosted_results(run).values())
    assert TOKEN not in err


def hosted_vision(model, store, registry, **opts) -> Pipeline:
    stages = {s: StageAssignment("ort_reference", {}) for s in STAGES}
    stages["vision"] = StageAssignment("qaihub", {"device": "Snapdragon 8 Elite QRD", **opts})
    return Pipeline.build(model, Layout("batch-split", stages), store=store, registry=registry, stages=("vision",))


def pixel_batch(model, n, seed):
    rng = np.random.default_rng(seed)
    s = model.image_size
    return [{"pixel_values": rng.standard_normal((1, 3, s, s)).astype(np.float32)} for _ in range(n)]


def test_large_batches_split_into_as_few_jobs_as_fit(hub, tiny_model, hub_store, registry, first_run, capfd):
    items = pixel_batch(tiny_model, 3, seed=11)
    each_mb = items[0]["pixel_values"].nbytes / 1e6
    pipe = hosted_vision(tiny_model, hub_store, registry, batch_mb=2.5 * each_mb)  # 2 samples per job
    hook = pipe.registry.hook
    jobs0 = len(hub.inference_jobs)
    outs = hook.run_stage_batch(backend="qaihub", stage="vision", handle=pipe.handles["vision"], inputs=items)
    jobs = hub.inference_jobs[jobs0:]
    assert [j["samples"] for j in jobs] == [2, 1]
    prof = pipe.handles["vision"].last_profile
    assert prof["job_ids"] == [j["id"] for j in jobs] and prof["inferences"] == 3 and prof["items"] == 3
    assert "exceed batch_mb" in capfd.readouterr().err
    # the hub refuses a dataset above its limit (HTTP 413): halved until it fits
    more = pixel_batch(tiny_model, 4, seed=12)
    hub.max_dataset_bytes = int(2.5 * each_mb * 1e6)
    jobs0 = len(hub.inference_jobs)
    try:
        big = hosted_vision(tiny_model, hub_store, registry)  # default batch_mb: one job of 4 asked for
        refused = hook.run_stage_batch(backend="qaihub", stage="vision", handle=big.handles["vision"], inputs=more)
        with pytest.raises(BackendError) as exc:  # one sample above the limit: one line
            hub.max_dataset_bytes = 1000
            hook.run_stage_batch(backend="qaihub", stage="vision", handle=big.handles["vision"],
                                 inputs=pixel_batch(tiny_model, 1, seed=13))
    finally:
        hub.max_dataset_bytes = None
    assert [j["samples"] for j in hub.inference_jobs[jobs0:]] == [2, 2]
    err = capfd.readouterr().err
    assert "(HTTP 413): splitting it into two jobs of 2 and 2" in err, err
    msg = str(exc.value)
    assert "too large (HTTP 413)" in msg and "vision sample" in msg and "\n" not in msg
    # each item's output is its own sample's, in order
    for inp, out in [*zip(items, outs)][-1:] + [*zip(more, refused)][-1:]:
        single = pipe.handles["vision"].run(inp)
        np.testing.assert_allclose(out["image_features"], single["image_features"], rtol=1e-5, atol=1e-5)
    ledger = json.loads(next(Path(hub_store.root, "state").glob(
        f"{pipe.handles['vision'].artifact.path.name}/qaihub-jobs.json")).read_text())
    done = [e for k, e in ledger.items() if k.startswith("inference-batch|") and e["state"] == "done"]
    assert {j["id"] for j in jobs} <= {e["job_id"] for e in done}


def test_interrupted_batch_job_is_reattached(hub, tiny_model, hub_store, registry, first_run, capfd, monkeypatch):
    from vlmrun_qaihub import hub as hubmod

    pipe = hosted_vision(tiny_model, hub_store, registry)
    items = pixel_batch(tiny_model, 2, seed=21)

    def interrupt(_s):
        raise KeyboardInterrupt

    hub.never_finish = True
    posts0 = hub.count("POST", "jobs")
    monkeypatch.setattr(hubmod.time, "sleep", interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            pipe.registry.hook.run_stage_batch(backend="qaihub", stage="vision", handle=pipe.handles["vision"],
                                               inputs=items)
    finally:
        hub.never_finish = False
        monkeypatch.undo()
    err = capfd.readouterr().err
    job_id = err.split("interrupted: AI Hub vision inference job ")[1].split()[0]
    assert "rerun the same command to re-attach" in err and hub.count("POST", "jobs") == posts0 + 1
    again = hosted_vision(tiny_model, hub_store, registry)  # "the rerun"
    outs = again.registry.hook.run_stage_batch(backend="qaihub", stage="vision", handle=again.handles["vision"],
                                               inputs=items)
    assert f"re-attaching to vision inference job {job_id}" in capfd.readouterr().err
    assert hub.count("POST", "jobs") == posts0 + 1 and again.handles["vision"].last_profile["job_id"] == job_id
    assert len(outs) == 2 and all(np.isfinite(o["image_features"]).all() for o in outs)
