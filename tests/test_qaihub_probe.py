"""``vlmrun diff --locate`` / ``--what-if`` on a stage compiled on Qualcomm AI Hub (``--compiler qaihub``), against the
local fake hub (tests/fake_hub.py) driven by the real ``qai_hub`` client.

qnn_htp builds the stage's probe form (the stage's ONNX plus one output per layer) through the same compile hook
as the stage, so with ``compiler = "qaihub"`` the probe is one more compile job on the hub, with the stage's
options; its binary runs on the local HTP emulator like the stage's. What is checked:

* fp16: locating vision submits exactly one compile job, for the probe graph (not the stage's), with the
  stage's hub options; the probe artifact is its own (another upload, job, target model and binary); the
  probe's ``image_features`` equal the hub-compiled stage's bit for bit; the per-layer points are vision's
  layers with fp16-sized errors; locating again reuses the stored probe (no upload, no job).
* int8: the probe's compile job asks the hub for the same quantization as the stage's
  (``--quantize_full_type int8``) with the same calibration samples. The fake hub does not quantize (it compiles
  the float graph whatever the options say), so the int8 numbers here are fp16's: what is proven at int8 is
  what the hub is asked to do, not how the real hub's quantizer treats a probe graph.
* ``--what-if`` on the hub-quantized stage: qnn_htp's per-layer options (``layer_precision``, which ``--what-if``
  sets, and ``keep_fp``, ``keep_a16w16``) are declared for qnn_htp, so the core accepted them, rebuilt the stage with a new hub job with identical hub
  options (the hub quantizes the whole stage and vlmrun sends it no per-layer precision) and reported that
  keeping the layer recovered 0% of the error. The qaihub plugin now refuses them before any export or upload,
  with one line saying why and what to do; checked through the API, a layout, a hand-made compile and the CLI.
"""

from __future__ import annotations

import json
import secrets
import time

import numpy as np
import pytest

pytest.importorskip("onnxruntime_qnn")
pytest.importorskip("qai_hub")

from fake_hub import serving  # noqa: E402
from vlmrun import Pipeline, diff  # noqa: E402
from vlmrun import what_if as wi  # noqa: E402
from vlmrun.diff import locate as loc  # noqa: E402
from vlmrun.errors import UsageError  # noqa: E402
from vlmrun.layouts import Layout, StageAssignment  # noqa: E402
from vlmrun.stages import STAGES  # noqa: E402

TOKEN = "hubtok-" + secrets.token_hex(12)
PROMPT = "What is in the picture?"
N = 3  # generated tokens per side (vision is located; the decoder only has to run)
VISION_LAYERS = ["vision.stem", *[f"vision.stage{i}" for i in range(5)], "vision.final_conv"]
# a compile key of this module's own (hub_options keys the artifact): the session store may hold vision binaries
# that other qaihub test modules compiled on their own fake hubs
TAG = "--vlmrun_test_tag locate-probe"
WHY = "AI Hub quantizes the stage itself, as a whole"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with serving(TOKEN, tmp_path_factory.mktemp("qaihub-probe")) as server:
        yield server


@pytest.fixture(scope="module")
def registry():
    from vlmrun import plugins

    return plugins.load()


def on_hub(**vision_opts) -> Layout:
    """vision on qnn_htp compiled on the hub, the rest on ort_reference."""
    opts = {"compiler": "qaihub", "hub_options": TAG, **vision_opts}
    return Layout("qaihub-vision", {s: StageAssignment("qnn_htp", opts) if s == "vision"
                                    else StageAssignment("ort_reference", {}) for s in STAGES})


def hub_run(hub, model, store, registry, ref_pipe, **vision_opts):
    """(the diff run of vision compiled on the hub against the reference, the stage's compile job id)."""
    before = set(hub.jobs)
    dev = Pipeline.build(model, on_hub(**vision_opts), store=store, registry=registry)
    new = [j for j in hub.jobs if j not in before]
    assert [hub.jobs[j]["kind"] for j in new] == ["compile"]  # the stage: one compile job, nothing else
    art = dev.handles["vision"].artifact
    assert art.manifest["compiler"] == "qaihub" and art.manifest["hub_compile_job"] == new[0]
    run = diff.run(ref_pipe, dev, prompt=PROMPT, model=model, store=store, registry=registry, max_new_tokens=N,
                   ignore_eos=True)
    return run, new[0]


def locate_on_hub(hub, run):
    """Locate vision; returns (location, the compile jobs it submitted)."""
    before = set(hub.jobs)
    found = loc.locate(run.pipelines["reference"], run.pipelines["device"], "vision", run.reference,
                       run.result.thresholds)
    return found, [j for j in hub.jobs if j not in before]


def uploads_and_jobs(hub) -> tuple[int, int]:
    return hub.count("POST", "models"), hub.count("POST", "jobs")


@pytest.fixture(scope="module")
def fp16(hub, tiny_model, store, registry, ref_pipe):
    return hub_run(hub, tiny_model, store, registry, ref_pipe)


@pytest.fixture(scope="module")
def int8(hub, tiny_model, store, registry, ref_pipe):
    run, stage_job = hub_run(hub, tiny_model, store, registry, ref_pipe, precision="int8")
    found, probe_jobs = locate_on_hub(hub, run)
    return run, stage_job, found, probe_jobs


# -- locate: the probe is compiled on the hub ----------------------------------------------------------------------
def test_fp16_probe_is_compiled_on_the_hub_and_equals_the_stage(hub, fp16, capsys):
    run, stage_job = fp16
    dev = run.pipelines["device"]
    assert run.result.precision == "fp16" and run.result.passed
    found, new = locate_on_hub(hub, run)

    # one compile job, for the probe graph, with the stage's hub options
    assert len(new) == 1, [hub.jobs[j] for j in new]
    job, stage = hub.jobs[new[0]], hub.jobs[stage_job]
    assert job["kind"] == "compile" and job["name"] == "vlmrun vision vision[probe=True] fp16"
    assert stage["name"] == "vlmrun vision vision fp16"
    assert job["options"] == stage["options"] and TAG in job["options"]
    assert "--quantize_full_type" not in job["options"] and job["calibration"] is None
    # another upload: the probe ONNX is not the stage's
    assert job["model_id"] != stage["model_id"]
    assert hub.models[job["model_id"]]["data"] != hub.models[stage["model_id"]]["data"]

    # the probe artifact is its own, and records the job it came from
    handle = loc.load_probe(dev, "vision")
    probe_art, stage_art = handle.artifact, dev.handles["vision"].artifact
    pm, sm = probe_art.manifest, stage_art.manifest
    assert pm["hub_compile_job"] == new[0] and sm["hub_compile_job"] == stage_job
    assert pm["compiler"] == "qaihub" and pm["target"] == "qnn_htp" and pm["precision"] == "fp16"
    assert pm["source_form"] == "vision[probe=True]" and sm["source_form"] == "vision"
    assert pm["hub_target_model"] == job["target"] != sm["hub_target_model"]
    assert probe_art.path != stage_art.path
    probe_bin = (probe_art.path / pm["files"][1]).read_bytes()
    assert probe_bin != (stage_art.path / sm["files"][1]).read_bytes()
    assert probe_bin == hub.models[job["target"]]["data"]  # the binary the hub compiled, as downloaded
    assert [o["name"] for o in sm["outputs"]] == ["image_features"]
    assert [o["name"] for o in pm["outputs"]] == ["image_features", *[
        "probe_" + n.replace(".", "_") for n in VISION_LAYERS[:-1]]]

    # the probe's own output is the hub-compiled stage's, bit for bit
    inputs = loc.probe_inputs("vision", run.reference, None)
    probe = loc.run_probe(dev, "vision", handle, inputs)
    assert list(probe) == ["image_features", *VISION_LAYERS]
    stage_out = dev.run_stage("vision", inputs)["image_features"]
    np.testing.assert_array_equal(probe["image_features"], stage_out)
    np.testing.assert_array_equal(probe["vision.final_conv"], stage_out)
    # ... and what the diff captured on the device side (its own preprocessing gave the same pixel values)
    np.testing.assert_array_equal(run.device.tensors["pixel_values"], inputs["pixel_values"])
    np.testing.assert_array_equal(run.device.tensors["image_features"], stage_out)

    # the per-layer curve: vision's layers, fp16-sized errors (not exact: the device side is the HTP)
    assert [p.name for p in found.points] == VISION_LAYERS
    sqnr = {p.name: round(p.metrics["sqnr_db"], 2) for p in found.points}
    with capsys.disabled():
        print(f"\n[qaihub probe] fp16 vision, hub-compiled probe vs reference, SQNR dB: {json.dumps(sqnr)}")
    assert all(35 < v < 80 for v in sqnr.values()), sqnr  # measured 43.8 .. 50.6
    assert all(p.metrics["cosine"] > 0.9999 for p in found.points)
    assert found.located is None and found.isolated
    assert found.points[-1].metrics["sqnr_db"] == pytest.approx(
        run.result.entry("vision", "image_features").metrics["sqnr_db"])

    # located again: the stored probe binary, no upload and no job
    counts = uploads_and_jobs(hub)
    jobs = set(hub.jobs)
    again, more = locate_on_hub(hub, run)
    assert more == [] and set(hub.jobs) == jobs and uploads_and_jobs(hub) == counts
    assert loc.load_probe(dev, "vision").artifact.path == probe_art.path
    assert [p.metrics["sqnr_db"] for p in again.points] == [p.metrics["sqnr_db"] for p in found.points]


def test_int8_probe_asks_the_hub_for_the_stage_quantization(hub, int8):
    run, stage_job, found, new = int8
    dev = run.pipelines["device"]
    assert run.result.precision == "int8"
    assert len(new) == 1, [hub.jobs[j] for j in new]
    job, stage = hub.jobs[new[0]], hub.jobs[stage_job]
    assert job["name"] == "vlmrun vision vision[probe=True] int8"
    assert "--quantize_full_type int8" in stage["options"] and job["options"] == stage["options"]
    # the same calibration samples (8 seeded random pixel_values): what the hub calibrates each graph on
    assert job["calibration"] and stage["calibration"] and job["calibration"] != stage["calibration"]
    assert hub.dataset_digest(job["calibration"]) == hub.dataset_digest(stage["calibration"])
    cal = hub.dataset_summary(job["calibration"])
    assert cal["samples"] == 8 and cal["shapes"] == {"pixel_values": tuple(run.reference.tensors[
        "pixel_values"].shape)}
    handle = loc.load_probe(dev, "vision")
    pm = handle.artifact.manifest
    assert pm["hub_compile_job"] == new[0] and pm["precision"] == "int8"
    assert pm["key"]["options"]["precision"] == "int8"
    assert handle.artifact.path != dev.handles["vision"].artifact.path
    inputs = loc.probe_inputs("vision", run.reference, None)
    probe = loc.run_probe(dev, "vision", handle, inputs)
    # equal here because the fake hub compiles both graphs in float (see the module docstring)
    np.testing.assert_array_equal(probe["image_features"], dev.run_stage("vision", inputs)["image_features"])
    assert [p.name for p in found.points] == VISION_LAYERS
    assert found.thresholds == {"sqnr_db": 15.0, "cosine": 0.97}  # int8 thresholds apply


# -- what-if on a stage the hub quantizes ------------------------------------------------------------------------
def check_refusal(msg: str, option: str) -> None:
    assert "\n" not in msg
    assert msg.startswith(f"vision: {option} (") and "is not available with --compiler qaihub" in msg
    assert WHY in msg and "--quantize_full_type int8" in msg  # why
    assert "compile vision locally with qnn_htp's quantizer (drop --compiler qaihub" in msg  # what to do
    assert 'precision = "a16w8"' in msg


@pytest.mark.parametrize("precision", ["fp", "a16w16"])
def test_what_if_is_refused_before_any_upload(hub, int8, precision):
    run, _, found, _ = int8
    counts, jobs = uploads_and_jobs(hub), set(hub.jobs)
    t0 = time.monotonic()
    with pytest.raises(UsageError) as err:
        wi.what_if(run, found, ["vision.stage2"], precision=precision)
    took = time.monotonic() - t0
    check_refusal(str(err.value), "layer_precision")  # what --what-if sets
    assert uploads_and_jobs(hub) == counts and set(hub.jobs) == jobs  # nothing uploaded, no job
    assert took < 10  # refused in preflight, before any export or compile


def test_per_layer_options_are_refused_in_a_layout_and_in_a_compile(hub, tiny_model, store, registry):
    from vlmrun.pipeline import StageContext

    counts = uploads_and_jobs(hub)
    with pytest.raises(UsageError) as err:
        Pipeline.build(tiny_model, on_hub(precision="int8", keep_fp="vision.stage1"), store=store,
                       registry=registry, stages=("vision",))
    check_refusal(str(err.value), "keep_fp")
    # at fp16 it is a usage error too (qnn_htp's preflight says it first: fp16 quantizes nothing)
    with pytest.raises(UsageError) as err:
        Pipeline.build(tiny_model, on_hub(keep_a16w16="vision.stage1"), store=store, registry=registry,
                       stages=("vision",))
    assert str(err.value).startswith("vision: keep_a16w16 ") and "\n" not in str(err.value)
    # a StageContext made by hand skips preflight: the compile hook refuses it before any upload
    opts = {"compiler": "qaihub", "hub_options": TAG, "precision": "int8", "keep_fp": "vision.stage1"}
    ctx = StageContext("qnn_htp", "vision", tiny_model, opts, store, registry)
    with pytest.raises(UsageError) as err:
        registry.hook.load_stage(backend="qnn_htp", stage="vision", ctx=ctx)
    check_refusal(str(err.value), "keep_fp")
    assert uploads_and_jobs(hub) == counts
    # compiled locally, the same option is qnn_htp's to apply (not refused by qaihub)
    registry.hook.preflight(backend="qnn_htp", stage="vision", model=tiny_model,
                            options={"precision": "int8", "keep_fp": "vision.stage1"})


def test_cli_what_if_on_a_hub_compiled_stage(hub, int8, store, tmp_path, capsys):
    """`vlmrun diff --device L.toml --locate vision --what-if vision.stage2` with vision compiled on the hub: exit
    status 2 and the one line, after the diff and the location (the probe comes from the store)."""
    from vlmrun.cli import main

    layout = tmp_path / "hub-int8.toml"
    layout.write_text(f'[vision]\nbackend = "qnn_htp"\ncompiler = "qaihub"\nprecision = "int8"\n'
                      f'hub_options = "{TAG}"\n')
    counts = uploads_and_jobs(hub)
    capsys.readouterr()
    code = main(["diff", "--device", str(layout), "--locate", "vision", "--what-if", "vision.stage2",
                 "--max-new-tokens", str(N), "--ignore-eos", "--prompt", PROMPT, "--image-size", "256",
                 "--cache-dir", str(store.root)])
    out = capsys.readouterr()
    lines = [x for x in out.err.splitlines() if x.startswith("vlmrun: error:")]
    assert code == 2, out.err[-2000:]
    assert len(lines) == 1, out.err[-2000:]
    check_refusal(lines[0][len("vlmrun: error: "):], "layer_precision")
    assert uploads_and_jobs(hub) == counts  # the stage and its probe came from the store
