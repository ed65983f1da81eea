"""Default diff / eval thresholds for the decoder's quantized parts form (w8a16, w4a16), on the tiny default model.

The values come from measurement (core/vlmrun/diff/thresholds.py says which): a w4a16 build that answers like the
reference passes them, and the same build with 10x its noise power on the logits fails them.
"""

from __future__ import annotations

import json

import attrs
import numpy as np
import pytest

from conftest import run_cli

pytest.importorskip("onnxruntime_qnn")

from vlmrun import Pipeline, diff  # noqa: E402
from vlmrun.diff.compare import compare  # noqa: E402
from vlmrun.diff.thresholds import infer_precision, thresholds_for  # noqa: E402
from vlmrun.layouts import Layout, StageAssignment  # noqa: E402
from vlmrun.stages import STAGES  # noqa: E402

PARTS = {"decoder_form": "parts", "context_length": 128, "prefill_ar": 16, "parts": 1, "weight_sharing": "off"}
SPEC = ",".join(f"decoder.{k}={v}" for k, v in PARTS.items())


def test_infer_precision_names_the_parts_precisions():
    assert infer_precision({"decoder": {"precision": "w4a16"}}) == "w4a16"
    assert infer_precision({"decoder": {"precision": "w8a16"}}) == "w8a16"
    assert infer_precision({"vision": {"precision": "fp16"}, "decoder": {"precision": "w8a16"}}) == "w8a16"
    assert infer_precision({"vision": {"precision": "int8"}, "decoder": {"precision": "w4a16"}}) == "w4a16"
    assert infer_precision({"vision": {"precision": "a16w8"}, "decoder": {"precision": "w8a16"}}) == "int8"
    # the most lenient precision is at least as lenient as every stricter one on every tensor metric
    t4, t8, t16 = (thresholds_for(p)["decoder"] for p in ("w4a16", "w8a16", "fp16"))
    assert t4["sqnr_db"] < t8["sqnr_db"] < t16["sqnr_db"] and t4["cosine"] <= t8["cosine"] <= t16["cosine"]


def test_eval_of_a_w4a16_layout_that_answers_like_the_reference_passes(cache_dir, tiny_model, store):
    res = run_cli(["eval", "--limit", "4", "-L", f"w4a16=reference,decoder=qnn_htp,decoder.precision=w4a16,{SPEC}",
                   "--json"], cache_dir, timeout=900)
    assert res.returncode == 0, res.stderr
    rep = json.loads(res.stdout)
    lay = next(x for x in rep["layouts"] if x["label"] == "w4a16")
    assert lay["precision"] == "w4a16"
    assert lay["accuracy"]["all"]["correct"] == 4
    assert lay["diff_pass_rate"] == 1.0, lay


def test_the_w4a16_thresholds_fail_a_real_capture_with_its_noise_power_raised(tiny_model, store, ref_pipe, tmp_path):
    """A real w4a16 comparison passes; its device logits with the error scaled up fail at the decoder. The
    thresholds were set so that 10x the noise power (10 dB less SQNR) fails the median item of the model they were
    measured on (21.8 dB all-npu); the retrained model's w4a16 logits are cleaner (all-npu median 26.1 dB, this
    decoder-only describe item 27.7 dB): 10x its noise power (17.7 dB) still passes the 14 dB floor, 100x (7.7 dB)
    fails it."""
    from vlmrun.shapes import HELDOUT_SEED, items, render

    stages = {s: StageAssignment("ort_reference", {}) for s in STAGES}
    stages["decoder"] = StageAssignment("qnn_htp", {"precision": "w4a16", **PARTS})
    dev = Pipeline.build(tiny_model, Layout("w4a16", stages), store=store)
    item = next(i for i in items(HELDOUT_SEED) if i.kind == "describe")
    image = tmp_path / "item.png"
    render(item.scene).save(image)
    run = diff.run(ref_pipe, dev, image=str(image), prompt=item.question, model=tiny_model, store=store,
                   max_new_tokens=8)
    before = compare(run.reference, run.device, thresholds_for("w4a16"), "w4a16")
    sqnr = before.entry("decoder", "logits").metrics["sqnr_db"]
    assert before.passed, before
    ref_l, dev_l = run.reference.tensors["logits"], run.device.tensors["logits"]
    floor = thresholds_for("w4a16")["decoder"]["sqnr_db"]
    for power in (10.0, 100.0):
        worse = attrs.evolve(run.device, tensors={**run.device.tensors,
                                                  "logits": ref_l + np.sqrt(power) * (dev_l - ref_l)})
        after = compare(run.reference, worse, thresholds_for("w4a16"), "w4a16")
        got = after.entry("decoder", "logits").metrics["sqnr_db"]
        print(f"\n[thresholds] w4a16 decoder logits {sqnr:.2f} dB passes; with {power:g}x the noise power {got:.2f} dB")
        assert got == pytest.approx(sqnr - 10.0 * np.log10(power), abs=1e-6)
        # whatever the noise, the verdict follows the floor: a capture below it fails, at the decoder
        assert after.passed == (got >= floor) and (after.passed or after.culprit == "decoder")
    assert not after.passed  # 100x the noise power of a real capture is below the floor
