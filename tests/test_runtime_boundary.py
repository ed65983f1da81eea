"""``vlmrun diff`` across the runtime boundary: Genie's own logits (its custom sampler, teacher-forced through it)
against the reference and against vlmrun's host engine over the same binaries.

* a good bundle: both runtimes reported, PASS; Genie's rows checked against an independent teacher-forced
  computation of the reference decoder, and the diff's figures recomputed from the captured arrays;
* faults a bundle can carry that the host engine over the same binaries does not see (a wrong rope-theta, 100 and
  a subtle 1e4 that still answers right; a token table read in an encoding it is not written in): each fails, named
  at the runtime boundary, from its first departing step, exit 1;
* the Genie dialog engine (``engine = "genie"``) gets the same boundary;
* the core's rule on every layout: a free-running token the checked logits did not give is a failure, whatever
  the teacher-forced checkpoints say (no PASS over a broken answer), while a near-tie flip is not.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli

pytest.importorskip("onnxruntime_qnn")

from vlmrun import diff  # noqa: E402
from vlmrun.diff.capture import Capture  # noqa: E402

N = 12


def sqnr(ref, dev) -> float:
    ref, dev = np.asarray(ref, np.float64), np.asarray(dev, np.float64)
    return float(10 * np.log10((ref ** 2).sum() / ((ref - dev) ** 2).sum()))


def spoil(bundle: Path, dst: Path, fn) -> Path:
    """A copy of ``bundle`` whose text-generator.json ``fn`` changes (its sha256 recorded: the fault under test,
    not the hash check, is what a run meets)."""
    shutil.copytree(bundle, dst)
    cfg = json.loads((dst / "text-generator.json").read_text())
    fn(cfg["text-generator"])
    (dst / "text-generator.json").write_text(json.dumps(cfg))
    mf = dst / "vlmrun-bundle.json"
    m = json.loads(mf.read_text())
    data = (dst / "text-generator.json").read_bytes()
    m["files"]["text-generator.json"] = {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}
    mf.write_text(json.dumps(m))
    return dst


def rope_theta(value):
    return lambda g: g["engine"]["model"]["positional-encoding"].update({"rope-theta": value})


def lut_as_float32(g):  # the uint16 table declared float32: Genie reads it in an encoding it is not written in
    g["embedding"].pop("quant-param")
    g["embedding"]["datatype"] = "float32"


def lut_offset(g):  # the table's zero point declared 2000 codes off
    g["embedding"]["quant-param"]["offset"] -= 2000


@pytest.fixture(scope="module")
def good_run(bundle_dir, tiny_model, store, ref_pipe):
    return diff.run("reference", f"bundle:{bundle_dir}", model=tiny_model, store=store, registry=ref_pipe.registry,
                    max_new_tokens=N)


def test_a_good_bundle_reports_both_runtimes_and_passes(good_run, ref_pipe):
    result, dev, ref = good_run.result, good_run.device, good_run.reference
    assert result.passed, diff.format_table(result)
    assert result.precision == "fp16"  # from the bundle's manifest
    rt = result.entry("runtime")
    assert rt.metrics["runtime"] == "Genie's pipeline (libGenie)" and rt.metrics["first_departing_step"] is None
    genie_rows, engine_rows = dev.tensors["runtime_logits"], dev.tensors["logits"]
    n = len(ref.tokens)
    assert genie_rows.shape == engine_rows.shape == (1, n, ref_pipe.model.vocab_size)
    # teacher forcing through Genie: it was handed the reference's tokens, and took them
    assert dev.tensors["runtime_tokens"].tolist() == ref.tokens
    # an independent teacher-forced computation: the reference decoder over the reference's own spliced prompt and
    # tokens, in one forward (not the diff's capture)
    embeds = ref.tensors["inputs_embeds"]
    full = np.concatenate([embeds, ref_pipe.embed_tokens(np.asarray(ref.tokens))], axis=1)
    indep = ref_pipe.run_stage("decoder", {"inputs_embeds": full})["logits"][:, embeds.shape[1] - 1:][:, :n]
    assert sqnr(indep, genie_rows) > 45  # measured 56-58 dB (fp16 binaries on the emulator)
    assert (indep.argmax(-1) == genie_rows.argmax(-1)).all()
    # the diff's figures are those of the arrays
    m = rt.metrics
    assert m["sqnr_db"] == pytest.approx(sqnr(ref.tensors["logits"][:, :n], genie_rows), rel=1e-9)
    if np.array_equal(engine_rows, genie_rows):  # Genie gives the engine's rows bit for bit (measured on 16 items)
        assert m["engine_sqnr_db"] == diff.SQNR_CAP_DB
    else:
        assert m["engine_sqnr_db"] == pytest.approx(sqnr(engine_rows, genie_rows), rel=1e-9)
    assert m["engine_top1_agreement"] == 1.0
    # Genie's logits as close to the reference as the host engine's over the same binaries: measured 52.5 and 54.4 dB
    # with today's model (0.3 dB apart with the model before its conversation training); the two 54 dB apart
    assert abs(m["sqnr_db"] - result.entry("decoder").metrics["sqnr_db"]) < 2.5
    table = diff.format_table(result)
    assert "runtime (Genie's pipeline (libGenie)), teacher-forced through it" in table
    assert table.splitlines()[-1] == "PASS: every checkpoint is within its thresholds"


FAULTS = {
    "rope-theta 100": (rope_theta(100.0), 0),
    "rope-theta 3e5 (answers right)": (rope_theta(3e5), None),  # 1e4 answered right before the conversation training
    "LUT read as float32": (lut_as_float32, 1),
    "LUT zero point off": (lut_offset, 1),
}


def _verdict(table: str) -> list[str]:
    lines = table.splitlines()
    at = next(i for i, ln in enumerate(lines) if ln.startswith("FAIL:"))
    return lines[at:at + 2]


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_fault_is_named_at_the_runtime_boundary(fault, bundle_dir, tmp_path, tiny_model, store, ref_pipe):
    fn, first = FAULTS[fault]
    bad = spoil(bundle_dir, tmp_path / "bad", fn)
    run = diff.run("reference", f"bundle:{bad}", model=tiny_model, store=store, registry=ref_pipe.registry,
                   max_new_tokens=N)
    data = run.result.to_json()
    assert data["culprit"] == "runtime" and data["failed_stages"][0] == "runtime"
    assert data["boundary"]["departs"] == "runtime"
    checkpoints = {c["stage"]: c for c in data["checkpoints"]}
    assert checkpoints["decoder"]["passed"]  # the host engine over the same binaries passes
    rt = checkpoints["runtime"]["metrics"]
    assert rt["engine_sqnr_db"] < 30 and not checkpoints["runtime"]["passed"]
    if first is not None:
        assert rt["first_departing_step"] == first
    else:  # the subtle one: free-running answers like the reference, the logits do not
        assert data["checkpoints"][-1]["metrics"]["match_fraction"] == 1.0
        assert rt["first_departing_step"] is not None
    verdict = _verdict(diff.format_table(run.result))
    assert verdict[0] == ("FAIL: the runtime departs, not the binary: Genie's pipeline (libGenie) leaves the engine"
                          f" over the same binaries from step {rt['first_departing_step']}")
    assert "engine_sqnr_db" in verdict[1] and "the binaries pass under the engine" in verdict[1]


def test_the_cli_fails_a_broken_bundle_and_replays_it(bundle_dir, tmp_path, cache_dir):
    bad = spoil(bundle_dir, tmp_path / "bad", rope_theta(100.0))
    saved = tmp_path / "saved"
    r = run_cli(["diff", "--device", f"bundle:{bad}", "--max-new-tokens", str(N), "--json", "--save", str(saved)],
                cache_dir, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert json.loads(r.stdout)["boundary"] == {"departs": "runtime", "first_step": 0,
                                                "runtime": "Genie's pipeline (libGenie)"}
    # replayed from its captures (the runtime's logits are saved with them): the same verdict, nothing run
    r = run_cli(["diff", "--from", str(saved)], cache_dir, timeout=300)
    assert r.returncode == 1
    assert _verdict(r.stdout)[0] == ("FAIL: the runtime departs, not the binary: Genie's pipeline (libGenie) leaves the"
                                     " engine over the same binaries from step 0")


def test_the_genie_dialog_engine_has_the_same_boundary(tiny_model, store, ref_pipe):
    from vlmrun import layouts

    lay = layouts.resolve("all-npu", options={"decoder": {"engine": "genie"}})
    run = diff.run("reference", _pipe(tiny_model, store, lay), model=tiny_model, store=store,
                   registry=ref_pipe.registry, max_new_tokens=N)
    rt = run.result.entry("runtime")
    assert rt.metrics["runtime"] == "Genie (libGenie dialog)"
    assert run.result.passed, diff.format_table(run.result)
    assert rt.metrics["engine_sqnr_db"] > 40 and rt.metrics["engine_top1_agreement"] == 1.0


def _pipe(model, store, layout):
    from vlmrun import Pipeline

    return Pipeline.build(model, layout, store=store)


# -- the core's rule, on synthetic captures -------------------------------------------------------------------
def _caps(dev_tokens, dev_rows, ref_tokens=(5, 6, 7, 2)):
    vocab = 10
    ref_rows = np.full((1, len(ref_tokens), vocab), -4.0, np.float32)
    for k, t in enumerate(ref_tokens):
        ref_rows[0, k, t] = 4.0
    base = {"pixel_values": np.ones((1, 3, 2, 2), np.float32), "input_ids": np.ones((1, 3), np.int64)}
    ref = Capture({**base, "logits": ref_rows, "tokens": np.asarray(ref_tokens)}, {"teacher_tokens": None})
    dev = Capture({**base, "logits": dev_rows, "tokens": np.asarray(dev_tokens)},
                  {"teacher_tokens": list(ref_tokens)})
    return ref, dev


def test_a_free_running_token_the_checked_logits_did_not_give_fails_at_every_precision():
    ref, dev = _caps((9, 9, 9, 9), None)
    dev.tensors["logits"] = ref.tensors["logits"].copy()  # teacher-forced logits exactly the reference's
    for precision in diff.PRECISIONS:
        result = diff.compare(ref, dev, precision=precision)
        assert result.entry("decoder").passed
        g = result.entry("generation")
        assert g.metrics["unexplained_divergence"] == 1 and not g.passed, precision
        assert g.metrics["divergence"]["step"] == 0 and g.metrics["divergence"]["row_argmax"] == 5
        assert not result.passed and result.culprit == "generation"
    assert "the answer was not made by the logits checked" in diff.format_table(result)


def test_a_near_tie_the_logits_show_is_an_explained_divergence():
    ref, dev = _caps((5, 6, 3, 2), None)
    rows = ref.tensors["logits"].copy()
    rows[0, 2, 3] = 3.9  # step 2: the device's token a near-tie of the reference's (probability ratio 0.9)
    dev.tensors["logits"] = rows
    result = diff.compare(ref, dev, precision="w4a16")
    g = result.entry("generation")
    assert g.metrics["first_divergent_step"] == 2 and g.metrics["unexplained_divergence"] == 0
    assert g.metrics["divergence"]["prob_ratio"] == pytest.approx(np.exp(-0.1), rel=1e-6)
    assert g.passed


def test_a_device_short_of_logits_rows_fails_whatever_its_tokens():
    ref, _ = _caps((), None)
    full = ref.tensors["logits"]
    for rows, tokens in (((1, 0, 10), (9, 9, 9, 9)), ((1, 1, 10), (5, 9, 9, 2))):
        _, dev = _caps(tokens, full[:, : rows[1]].copy())
        for precision in diff.PRECISIONS:
            result = diff.compare(ref, dev, precision=precision)
            dec = result.entry("decoder", "logits")
            assert [c.metric for c in dec.failures] == ["logits_steps"], precision
            assert dec.note == f"the device gave {rows[1]} of the 4 teacher-forced logits rows due"
            # the token the device chose where no row of its own was measured is not explained by anything checked
            g = result.entry("generation")
            assert g.metrics["unexplained_divergence"] == 1 and not g.passed
            assert not result.passed and result.culprit == "decoder"
        table = diff.format_table(result)
        assert f"FAIL: likely culprit: decoder (first stage to cross its thresholds: logits: the device gave" \
               f" {rows[1]} of the 4 teacher-forced logits rows due)" in table


def test_a_reference_short_of_logits_rows_fails_instead_of_shrinking_the_check():
    """A reference capture with only its first row kept: the rows compared were min(reference rows, tokens), so a
    device three tokens of four wrong, its own rows agreeing with its answer, passed."""
    ref, dev = _caps((5, 9, 9, 2), None)
    rows = np.full((1, 4, 10), -4.0, np.float32)
    for k, t in enumerate((5, 9, 9, 2)):
        rows[0, k, t] = 4.0
    dev.tensors["logits"] = rows
    ref.tensors["logits"] = ref.tensors["logits"][:, :1].copy()
    for precision in diff.PRECISIONS:
        result = diff.compare(ref, dev, precision=precision)
        dec = result.entry("decoder", "logits")
        assert dec.note == "the reference gave 1 of the 4 teacher-forced logits rows due" and not result.passed


def test_an_empty_tensor_scores_nothing():
    m = diff.tensor_metrics(np.zeros((1, 0, 10)), np.zeros((1, 0, 10)))
    assert all(np.isnan(v) for v in m.values()), m


@pytest.mark.parametrize("tokens,budget,unexplained", [
    ((), None, 1),  # no answer at all
    ((5, 6, 7), None, 1),  # cut off without its stop token where the reference went on
    ((5, 6, 7), 3, 0),  # the budget of 3 tokens both sides had, used up: what the budget asked for
    ((5, 6, 7), -3, 1),  # a budget of 3 on the device only (captures made apart): cut short all the same
    ((5, 6, 7, 2, 8), None, 1),  # on past the reference's stop token
])
def test_an_answer_cut_short_or_run_on_is_an_unexplained_divergence(tokens, budget, unexplained):
    ref, dev = _caps(tokens, None)
    dev.tensors["logits"] = ref.tensors["logits"].copy()
    if budget is not None:
        dev.meta["max_new_tokens"] = abs(budget)
        ref.meta["max_new_tokens"] = budget if budget > 0 else 8
    for precision in diff.PRECISIONS:
        result = diff.compare(ref, dev, precision=precision)
        assert result.entry("decoder").passed
        g = result.entry("generation")
        assert g.metrics["unexplained_divergence"] == unexplained, (precision, g.metrics)
        assert [c.ok for c in g.checks if c.metric == "unexplained_divergence"] == [not unexplained]
        if unexplained:
            assert not result.passed and result.culprit == "generation"
    if unexplained:
        who = "went on" if len(tokens) > 4 else "stopped"
        assert f"the device {who} after {min(len(tokens), 4)} tokens where the reference made 4" in \
            diff.format_table(result)


def test_eval_reports_genies_logits_and_the_bundles_bytes(bundle_dir, tiny_model, store):
    from vlmrun import eval as ev

    # eval's own settings: the items come from the bundle's verification (the same eval, run before it was handed out)
    run = ev.evaluate([f"bundle:{bundle_dir}"], model=tiny_model, store=store, limit=2)
    lay = next(x for x in run.report["layouts"] if x["label"] == f"bundle:{bundle_dir}")
    manifest = json.loads((bundle_dir / "vlmrun-bundle.json").read_text())
    # every file the device holds, as the manifest lists them (binaries, token table, configs, tokenizer)
    assert lay["device_bytes"] == sum(f["bytes"] for f in manifest["files"].values())
    assert lay["device_bytes"] == sum((bundle_dir / name).stat().st_size for name in manifest["files"])
    genie = lay["drift"]["runtime/runtime_logits"]["sqnr_db"]
    engine = lay["drift"]["decoder/logits"]["sqnr_db"]
    assert genie["n"] == engine["n"] == 2
    assert genie["median"] > 45 and abs(genie["median"] - engine["median"]) < 1.0  # measured 57.8 vs 58.9 (3 items)
    assert lay["diff_pass_rate"] == 1.0


# -- faults on the other side of the boundary: vlmrun's host engine -------------------------------------------
# A position-id offset and a KV cache in the wrong encoding cannot be written into a bundle's files: Genie numbers
# positions from its own counter (no configuration key shifts it), and the part binaries take and give keys and
# values in float32 (onnxruntime-qnn's graph I/O), which Genie copies byte for byte. They are faults of a runtime's
# own code, so they are injected into the other runtime on the boundary, vlmrun's host engine; the diff must name
# that side (Genie over the same binaries holds to the reference).
def _positions_off_by_one(orig):
    def step(self, embeds, ar):  # the generated tokens one position further than the prompt left off
        if ar != 1:
            return orig(self, embeds, ar)
        cos, sin = self.cos, self.sin
        self.cos, self.sin = np.roll(cos, -1, axis=0), np.roll(sin, -1, axis=0)
        try:
            return orig(self, embeds, ar)
        finally:
            self.cos, self.sin = cos, sin
    return step


def _kv_in_the_wrong_encoding(orig):
    def step(self, embeds, ar):  # keys written in one scale, read back in one twice as wide
        start = self.n_past
        out = orig(self, embeds, ar)
        for k in self.k:
            k[..., start:self.n_past] *= 2.0
        return out
    return step


@pytest.mark.parametrize("fault", [_positions_off_by_one, _kv_in_the_wrong_encoding])
def test_an_engine_fault_is_named_on_the_engine_side(fault, bundle_dir, tiny_model, store, ref_pipe, monkeypatch):
    from vlmrun import Pipeline
    from vlmrun_qnn_htp.genie_engine import GenieLayoutDecoder

    monkeypatch.setattr(GenieLayoutDecoder, "_step", fault(GenieLayoutDecoder._step))
    pipe = Pipeline.build(tiny_model, f"bundle:{bundle_dir}", store=store)
    run = diff.run("reference", pipe, model=tiny_model, store=store, registry=ref_pipe.registry, max_new_tokens=N)
    result = run.result
    assert not result.passed
    rt = result.entry("runtime")
    assert all(c.ok for c in rt.checks if not c.metric.startswith("engine_"))  # Genie holds to the reference
    # step 0 comes from the prompt graph, before either fault acts. Measured (model before the conversation
    # training): positions, step 1 at 21.7 dB between the two (the logits as a whole 34.2 dB: the decoder row alone
    # passes fp16's 30 dB); KV, step 1 at 30.4 dB, step 2 at 21.5 dB (the decoder row fails: 15.7 dB); today's
    # model: positions from step 3
    first = rt.metrics["first_departing_step"]
    assert first in (1, 2, 3)
    assert result.boundary == {"departs": "engine", "first_step": first, "runtime": "Genie's pipeline (libGenie)"}
    table = diff.format_table(result)
    assert ("FAIL: the engine departs, not the binary: vlmrun's host engine leaves Genie's pipeline (libGenie) over"
            f" the same binaries from step {first}") in table.splitlines()


def test_a_bundle_missing_or_truncating_its_token_table_is_one_line(bundle_dir, tmp_path, cache_dir, image_path):
    for name, spoil_file in (("missing", lambda f: f.unlink()),
                             ("truncated", lambda f: f.write_bytes(f.read_bytes()[:1000]))):
        bad = tmp_path / name
        shutil.copytree(bundle_dir, bad)
        spoil_file(bad / "embedding_weights.raw")
        r = run_cli(["--bundle", str(bad), "--image", str(image_path), "--prompt", "Describe the image."], cache_dir,
                    timeout=300)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip() and "LIBNATIVE" not in ln]
        assert r.returncode == 1 and "Traceback" not in r.stderr and len(lines) == 1, r.stderr
        want = ("embedding_weights.raw is missing" if name == "missing" else
                "embedding_weights.raw is 1000 bytes, the manifest records 114688")
        assert want in lines[0] and "kpis" not in lines[0]
