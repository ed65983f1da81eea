"""``vlmrun diff``: exact on identical sides, torch eager vs the reference within fp32 thresholds, a perturbed
projector named as the culprit, the HTML report, saved captures."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import textwrap
import types
from html.parser import HTMLParser

import numpy as np
import pytest

from conftest import IMAGE_SIZE, cosine
from vlmrun import diff

N = 8  # generated tokens per side
PROMPT = "What is in the picture?"

# A test backend: ort_reference for every stage, plus Gaussian noise (10% of the signal's std, about 20 dB SQNR)
# on the projector's output. It delegates through the registry, so it imports no other plugin.
NOISY_SRC = textwrap.dedent('''
    import numpy as np
    from vlmrun import hookimpl
    from vlmrun.plugins import BackendInfo
    from vlmrun.stages import STAGES

    NAME = "noisy"
    SCALE = 0.1


    @hookimpl
    def describe():
        return BackendInfo(NAME, STAGES, "test: ort_reference with noise on the projector output")


    @hookimpl
    def load_stage(backend, stage, ctx):
        if backend != NAME:
            return None
        return ctx.registry, ctx.registry.hook.load_stage(backend="ort_reference", stage=stage, ctx=ctx)


    @hookimpl
    def run_stage(backend, stage, handle, inputs):
        if backend != NAME:
            return None
        registry, inner = handle
        out = registry.hook.run_stage(backend="ort_reference", stage=stage, handle=inner, inputs=inputs)
        if stage == "projector":
            x = out["image_embeds"]
            noise = np.random.default_rng(0).normal(0.0, SCALE * float(x.std()), x.shape)
            out = {"image_embeds": (x + noise).astype(np.float32)}
        return out


    @hookimpl
    def decode(backend, handle, request):
        if backend != NAME:
            return None
        registry, inner = handle
        return registry.hook.decode(backend="ort_reference", handle=inner, request=request)
''')

CLI = [sys.executable, "-m", "vlmrun.cli"]


def fresh_registry(extra=()):
    """A new plugin registry in this process (plus ``extra`` plugin objects)."""
    from vlmrun import plugins

    return plugins.load(extra=list(extra))


def noisy_module():
    module = types.ModuleType("vlmrun_noisy_test")
    exec(compile(NOISY_SRC, "vlmrun_noisy_test.py", "exec"), module.__dict__)
    return module


def run_diff(args, cache_dir, env_extra=None):
    env = dict(os.environ, VLMRUN_CACHE_DIR=str(cache_dir), HF_HUB_OFFLINE="1")
    env.update(env_extra or {})
    return subprocess.run([*CLI, "diff", "--image-size", str(IMAGE_SIZE), *args], capture_output=True, text=True,
                          env=env, timeout=300)


@pytest.fixture(scope="module")
def ref_vs_ref(ref_pipe, tiny_model, store, image_path):
    return diff.run(ref_pipe, ref_pipe, image=image_path, prompt=PROMPT, model=tiny_model, store=store,
                    registry=ref_pipe.registry, max_new_tokens=N, ignore_eos=True)


@pytest.fixture(scope="module")
def noisy_run(ref_pipe, tiny_model, store, image_path):
    registry = fresh_registry([noisy_module()])
    return diff.run("reference", diff.Side("reference", {"projector": "noisy"}), image=image_path, prompt=PROMPT,
                    model=tiny_model, store=store, registry=registry, max_new_tokens=N, ignore_eos=True)


def test_reference_vs_reference_is_exact(ref_vs_ref):
    result = ref_vs_ref.result
    assert result.passed and result.culprit is None
    for e in result.entries:
        m = e.metrics
        if "sqnr_db" in m:
            assert m["sqnr_db"] == diff.SQNR_CAP_DB, e.tensor
            assert m["cosine"] == 1.0 and m["max_abs"] == 0.0 and m["rel_l2"] == 0.0, e.tensor
    dec = result.entry("decoder").metrics
    assert dec["steps"] == N
    assert dec["top1_agreement"] == 1.0 and dec["top5_overlap"] == 1.0 and dec["kl_max"] == 0.0
    gen = result.entry("generation").metrics
    assert gen["matching_tokens"] == N and gen["first_divergent_step"] is None
    assert result.entry("preprocess", "input_ids").metrics["mismatches"] == 0
    # the device decoder was teacher-forced on the reference tokens
    assert ref_vs_ref.device.meta["teacher_tokens"] == ref_vs_ref.reference.tokens


def test_torch_vs_reference_passes_fp32(ref_pipe, tiny_model, store, image_path):
    run = diff.run("torch", "reference", image=image_path, prompt=PROMPT, model=tiny_model, store=store,
                   registry=ref_pipe.registry, max_new_tokens=N, ignore_eos=True)
    result = run.result
    assert result.precision == "fp32"
    assert result.passed, diff.format_table(result)
    # the figures are what an independent computation gives
    for stage, name in diff.CHECKPOINTS:
        if name in ("input_ids", "tokens", "runtime_logits"):  # no runtime apart from the engine here
            continue
        ref, dev = run.reference.tensors[name], run.device.tensors[name]
        if name == "logits":
            ref, dev = ref[:, :N], dev[:, :N]
        m = result.entry(stage, name).metrics
        assert m["cosine"] == pytest.approx(cosine(ref, dev), abs=1e-12)
        err = dev.astype(np.float64) - ref
        if err.any():
            expected = 10 * np.log10((ref.astype(np.float64) ** 2).sum() / (err**2).sum())
            assert m["sqnr_db"] == pytest.approx(expected, rel=1e-9)
            assert m["sqnr_db"] > 90  # torch fp32 and ONNX Runtime fp32 agree to ~1e-6 relative
        assert m["max_abs"] == pytest.approx(np.abs(err).max(), abs=1e-12)
    assert result.entry("decoder").metrics["top1_agreement"] == 1.0
    assert run.reference.tokens == ref_pipe.generate(image_path, PROMPT, diff_settings()).run().token_ids
    assert run.reference.meta["source"].startswith("torch")


def diff_settings():
    from vlmrun import GenerationSettings

    return GenerationSettings(max_new_tokens=N, ignore_eos=True)


def test_perturbed_projector_is_named_first(noisy_run):
    result = noisy_run.result
    assert not result.passed
    assert result.culprit == "projector", diff.format_table(result)
    assert result.entry("vision").passed and result.entry("vision").metrics["sqnr_db"] == diff.SQNR_CAP_DB
    assert result.entry("embed").passed
    proj = result.entry("projector").metrics
    ref, dev = noisy_run.reference.tensors["image_embeds"], noisy_run.device.tensors["image_embeds"]
    err = dev.astype(np.float64) - ref
    assert proj["sqnr_db"] == pytest.approx(10 * np.log10((ref.astype(np.float64) ** 2).sum() / (err**2).sum()))
    assert 10 < proj["sqnr_db"] < 30  # ~20 dB for 10% noise
    assert "splice" in result.failed_stages  # downstream of the projector
    table = diff.format_table(result)
    assert "likely culprit: projector" in table
    assert result.to_json()["culprit"] == "projector"


def test_thresholds_override_and_toml(noisy_run, tmp_path):
    lenient = diff.thresholds_for("fp32", {"projector": {"sqnr_db": 10.0, "cosine": None}})
    again = diff.compare(noisy_run.reference, noisy_run.device, lenient)
    assert again.entry("projector").passed
    assert again.culprit == "splice"
    toml = tmp_path / "t.toml"
    toml.write_text('precision = "int8"\n[projector]\nsqnr_db = 25\ncosine = false\n')
    precision, table = diff.read_thresholds_file(toml)
    assert precision == "int8" and table == {"projector": {"sqnr_db": 25.0, "cosine": None}}
    merged = diff.thresholds_for(precision, table, {"decoder": {"kl_mean": 0.25}})
    assert merged["projector"] == {"sqnr_db": 25.0}
    assert merged["vision"]["sqnr_db"] == diff.DEFAULT_THRESHOLDS["int8"]["vision"]["sqnr_db"]
    assert merged["decoder"]["kl_mean"] == 0.25
    assert diff.compare(noisy_run.reference, noisy_run.device, merged).culprit == "projector"
    assert diff.parse_threshold("decoder.top1_agreement=0.5") == ("decoder", "top1_agreement", 0.5)
    with pytest.raises(diff.UsageError):
        diff.parse_threshold("projector.top1_agreement=0.5")


def test_save_and_load_round_trip(noisy_run, ref_pipe, tiny_model, store, tmp_path):
    diff.save_run(noisy_run, tmp_path / "saved")
    ref, dev = diff.load_from([tmp_path / "saved"])
    for name in diff.CAPTURE_KEYS:
        np.testing.assert_array_equal(ref.tensors[name], noisy_run.reference.tensors[name])
        np.testing.assert_array_equal(dev.tensors[name], noisy_run.device.tensors[name])
    assert dev.meta["teacher_tokens"] == ref.tokens
    replay = diff.run(from_dirs=[tmp_path / "saved" / "reference", tmp_path / "saved" / "device"])
    assert replay.result.to_json()["checkpoints"] == noisy_run.result.to_json()["checkpoints"]
    # two --save folders (a host run, a phone run): their device sides against each other
    diff.save_run(noisy_run, tmp_path / "saved2")
    a, b = diff.load_from([tmp_path / "saved", tmp_path / "saved2"])
    np.testing.assert_array_equal(a.tensors["logits"], noisy_run.device.tensors["logits"])
    np.testing.assert_array_equal(b.tensors["logits"], noisy_run.device.tensors["logits"])
    # one --from: the saved reference against a live device (teacher-forced on the saved tokens)
    live = diff.run(device="reference", from_dirs=[tmp_path / "saved" / "reference"], model=tiny_model,
                    store=store, registry=ref_pipe.registry)
    assert live.result.passed
    assert live.device.meta["prompt"] == PROMPT and live.device.meta["teacher_tokens"] == ref.tokens
    with pytest.raises(diff.UsageError):
        diff.load_from([tmp_path / "nothing-here"])


class _Images(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images: list[str] = []
        self.title = ""
        self._in_title = False

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs).get("src", ""))
        self._in_title = tag == "title"

    def handle_data(self, data):
        if self._in_title:
            self.title += data


def test_cli_perturbed_report_and_exit_1(tiny_model, ref_pipe, cache_dir, image_path, tmp_path):
    dist = tmp_path / "dist"
    info = dist / "vlmrun_noisy_test-0.1.dist-info"
    info.mkdir(parents=True)
    (dist / "vlmrun_noisy_test.py").write_text(NOISY_SRC)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vlmrun-noisy-test\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text("[vlmrun]\nnoisy = vlmrun_noisy_test\n")
    pythonpath = os.pathsep.join(p for p in [str(dist), os.environ.get("PYTHONPATH", "")] if p)
    report = tmp_path / "report"
    proc = run_diff(["--device-projector", "noisy", "--image", str(image_path), "--prompt", PROMPT,
                     "--max-new-tokens", str(N), "--ignore-eos", "--json", "--report", str(report)],
                    cache_dir, {"PYTHONPATH": pythonpath})
    assert proc.returncode == 1, proc.stderr
    data = json.loads(proc.stdout)
    assert data["culprit"] == "projector" and not data["passed"]
    parser = _Images()
    parser.feed((report / "index.html").read_text())
    assert "vlmrun diff" in parser.title
    assert len(parser.images) == 3
    for src in parser.images:
        assert src.startswith("data:image/png;base64,")
        png = base64.b64decode(src.split(",", 1)[1])
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 2000
    assert json.loads((report / "metrics.json").read_text())["culprit"] == "projector"


def test_cli_reference_exit_0_save_and_from(tiny_model, ref_pipe, cache_dir, image_path, tmp_path):
    saved = tmp_path / "saved"
    args = ["--image", str(image_path), "--prompt", PROMPT, "--max-new-tokens", "4", "--ignore-eos"]
    # the reference against itself is refused (it passes whatever it answers); torch eager is another side
    proc = run_diff(args, cache_dir)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1] == (
        "vlmrun: error: the device side (reference) is the reference side (reference): the diff would compare it"
        " with itself; name the layout under test, e.g. --device all-npu, --device L.toml or --device-STAGE PLUGIN")
    args = ["--reference", "torch", *args]
    proc = run_diff([*args, "--save", str(saved)], cache_dir)
    assert proc.returncode == 0, proc.stderr
    assert "PASS" in proc.stdout and "likely culprit" not in proc.stdout
    assert (saved / "reference" / "capture.npz").is_file() and (saved / "device" / "capture.npz").is_file()
    proc = run_diff(["--from", str(saved / "reference"), "--from", str(saved / "device"), "--json",
                     "--threshold", "decoder.top1_agreement=1.0"], cache_dir)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["passed"] and data["checkpoints"][-1]["metrics"]["matching_tokens"] == 4
    # one capture named twice would pass against itself
    proc = run_diff(["--from", str(saved / "device"), "--from", str(saved / "device" / ".")], cache_dir)
    assert proc.returncode == 2 and "both --from name the same capture" in proc.stderr, proc.stderr


@pytest.mark.parametrize("args, message", [
    (["--threshold", "nosuch.sqnr_db=3"], "unknown stage"),
    (["--threshold", "projector.sqnr_db"], "STAGE.METRIC=VALUE"),
    (["--from", "/nonexistent/capture"], "not a vlmrun capture"),
    (["--device-vision", "nosuchplugin"], "unknown backend plugin"),
    (["--precision", "fp8"], "fp8"),
])
def test_usage_errors_exit_2(args, message, tiny_model, cache_dir, capsys, monkeypatch):
    from vlmrun.cli import cli, main
    from vlmrun.cli_diff import diff_command

    if "diff" not in cli.commands:
        monkeypatch.setitem(cli.commands, "diff", diff_command)
    monkeypatch.setenv("VLMRUN_CACHE_DIR", str(cache_dir))
    code = main(["diff", "--image-size", str(IMAGE_SIZE), *args])
    assert code == 2
    err = capsys.readouterr().err
    assert message in err


def _synthetic(tokens, teacher=None, vocab=11, seed=0):
    rng = np.random.default_rng(seed)
    t = {
        "pixel_values": rng.normal(size=(1, 3, 8, 8)).astype(np.float32),
        "input_ids": np.arange(6, dtype=np.int64)[None],
        "image_features": rng.normal(size=(1, 2, 4)).astype(np.float32),
        "image_embeds": rng.normal(size=(1, 2, 3)).astype(np.float32),
        "text_embeds": rng.normal(size=(1, 6, 3)).astype(np.float32),
        "inputs_embeds": rng.normal(size=(1, 6, 3)).astype(np.float32),
        "logits": rng.normal(size=(1, len(teacher if teacher is not None else tokens) + 1, vocab)).astype(np.float32),
        "tokens": np.asarray(tokens, dtype=np.int64),
    }
    return diff.Capture(t, {"teacher_tokens": teacher})


def test_compare_edge_cases():
    ref = _synthetic([1, 2, 3, 4])
    # a device capture teacher-forced on other tokens: only the steps with equal context are compared
    dev = _synthetic([1, 2, 9, 9], seed=0)
    result = diff.compare(ref, dev)
    assert result.entry("decoder").metrics["steps"] == 3 and result.notes
    assert result.entry("generation").metrics["first_divergent_step"] == 2
    assert result.culprit == "generation"
    # NaN and shape mismatches fail (and are named), and the JSON stays valid JSON
    bad = _synthetic([1, 2, 3, 4], teacher=[1, 2, 3, 4])
    bad.tensors["image_features"] = bad.tensors["image_features"] * np.nan
    bad.tensors["image_embeds"] = np.zeros((1, 3, 3), np.float32)
    result = diff.compare(ref, bad)
    assert result.culprit == "vision"
    assert not result.entry("projector").passed and "shape" in result.entry("projector").note
    json.loads(json.dumps(result.to_json(), allow_nan=False))
    assert "FAIL" in diff.format_table(result)


@pytest.mark.parametrize("drop", [("tokens",), ("logits",), ("logits", "tokens"), tuple(diff.CAPTURE_KEYS)])
def test_a_device_without_its_answer_or_logits_never_passes(drop):
    """A device capture (a third-party backend's, one built through the API) that lacks the answer or the logits
    that explain it fails at w4a16 too, where free-running tokens alone are not checked: before, one without any
    tensor passed on no checkpoint at all, and one with tokens but no logits passed on 0/4 tokens matched."""
    ref = _synthetic([1, 2, 3, 4])
    dev = _synthetic([7, 7, 7, 7], seed=0)
    for name in drop:
        dev.tensors.pop(name, None)
    result = diff.compare(ref, dev, precision="w4a16")
    assert not result.passed
    for name in drop:
        if name in ("logits", "tokens"):
            entry = result.entry("decoder" if name == "logits" else "generation", name)
            assert [c.metric for c in entry.failures] == [f"{name}_captured"]
            assert entry.note == "not captured on the device side"
    verdicts = [line for line in diff.format_table(result).splitlines() if line.startswith(("PASS", "FAIL"))]
    assert len(verdicts) == 1 and verdicts[0].startswith("FAIL: likely culprit: ")
    assert json.loads(json.dumps(result.to_json(), allow_nan=False))["passed"] is False
    assert diff.compare(ref, _synthetic([1, 2, 3, 4]), precision="w4a16").passed  # the same capture, whole: passes


@pytest.mark.parametrize("rows, vocab, note", [(0, None, "the runtime gave 0 of the 4 teacher-forced logits rows due"),
                                             (None, 7, "shape 1x4x")])
def test_a_runtime_without_comparable_logits_fails_in_one_verdict(rows, vocab, note):
    """A device runtime (a bundle's Genie) whose teacher-forced logits have no row, or rows of another width, fails
    at the runtime checkpoint with the reason: it raised (a reshape of no rows; the verdict's missing SQNR)."""
    ref = _synthetic([1, 2, 3, 4])
    dev = _synthetic([1, 2, 3, 4])
    n = dev.tensors["logits"].shape[1] if rows is None else rows
    dev.tensors["runtime_logits"] = np.zeros((1, n, vocab or dev.tensors["logits"].shape[2]), np.float32)
    result = diff.compare(ref, dev, precision="w4a16")
    assert not result.passed and result.culprit == "runtime" and result.boundary is None
    assert note in result.entry("runtime").note
    verdict = diff.format_table(result).splitlines()[-1]
    assert verdict.startswith("FAIL: likely culprit: runtime (") and note in verdict


@pytest.mark.parametrize("precision", ["fp16", "int8"])
def test_qnn_htp_vs_reference_figures_are_what_we_measure(precision, ref_pipe, tiny_model, store, image_path,
                                                          tmp_path):
    """The diff of the HTP emulator against the reference reports what the test measures on its own."""
    from vlmrun import Pipeline
    from vlmrun.layouts import Layout, StageAssignment
    from vlmrun.stages import STAGES

    opts = {"decoder": {"context_length": 256, "prefill_ar": 32}}  # the graphs test_qnn_htp compiles too
    if precision == "int8":
        opts["vision"] = {"precision": "int8"}  # random calibration, labelled so in the manifest
    lay = Layout(f"npu-{precision}", {s: StageAssignment("qnn_htp", opts.get(s, {})) for s in STAGES})
    htp = Pipeline.build(tiny_model, lay, store=store, registry=ref_pipe.registry)
    run = diff.run(ref_pipe, htp, image=image_path, prompt=PROMPT, model=tiny_model, store=store,
                   max_new_tokens=N, ignore_eos=True)
    result = run.result
    assert result.precision == precision  # inferred: qnn_htp runs fp16 unless a stage says int8
    assert result.passed, diff.format_table(result)  # the emulator is within that precision's thresholds

    # vision, measured independently on the same pixels
    p = ref_pipe.prepare(image_path, PROMPT)
    ref_f = ref_pipe.run_stage("vision", {"pixel_values": p.pixel_values})["image_features"]
    dev_f = htp.run_stage("vision", {"pixel_values": p.pixel_values})["image_features"]
    m = result.entry("vision", "image_features").metrics
    assert m["cosine"] == pytest.approx(cosine(ref_f, dev_f), abs=1e-9)
    assert m["max_abs"] == pytest.approx(float(np.abs(dev_f.astype(np.float64) - ref_f).max()), rel=1e-6)
    assert m["cosine"] >= (0.999 if precision == "fp16" else 0.98)  # int8: random calibration (0.989 measured)

    # decoder under teacher forcing: both decoders fed the reference tokens, top-1 per step
    forced = np.asarray(run.reference.tokens[:N], dtype=np.int64)

    def step_logits(pipe):
        q = pipe.prepare(image_path, PROMPT)
        emb = pipe.embed_prompt(q)
        full = np.concatenate([emb, pipe.embed_tokens(forced)], axis=1)
        return pipe.run_stage("decoder", {"inputs_embeds": full})["logits"][0, emb.shape[1] - 1:][:N]

    agree = float((step_logits(ref_pipe).argmax(-1) == step_logits(htp).argmax(-1)).mean())
    assert result.entry("decoder").metrics["top1_agreement"] == pytest.approx(agree)
    assert agree >= 0.8

    page = diff.write_report(run, tmp_path / "report").read_text()
    assert f"{m['cosine']:.6f}"[:6] in page and page.count("data:image/png;base64,") >= 3
