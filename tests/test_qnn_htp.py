"""qnn_htp plugin on the tiny model (256x256, 16 image tokens): compile for SM8750/v79 once per session, run on
the onnxruntime-qnn HTP emulator, the adb + qnn-net-run path through stand-ins, and the faults of issue 3."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import cosine

pytest.importorskip("onnxruntime_qnn")

from vlmrun import GenerationSettings, Pipeline  # noqa: E402
from vlmrun.errors import BackendError  # noqa: E402
from vlmrun.layouts import Layout, StageAssignment  # noqa: E402
from vlmrun.stages import STAGES, QuantizedTensor  # noqa: E402
from vlmrun.store import ArtifactStore, sha256_file  # noqa: E402

STANDINS = Path(__file__).parent / "standins"
PROMPT = "What is in the picture?"
N_STEPS = 10
DECODER = {"context_length": 256, "prefill_ar": 32, "decoder_form": "fixed"}  # the single-graph form's tests


def layout(**per_stage) -> Layout:
    """qnn_htp on every stage (decoder: ctx 256, AR-32 + AR-1) with per-stage option overrides."""
    stages = {}
    for s in STAGES:
        opts = dict(DECODER) if s == "decoder" else {}
        opts.update(per_stage.get(s, {}))
        stages[s] = StageAssignment(opts.pop("backend", "qnn_htp"), opts)
    return Layout("test-qnn", stages)


@pytest.fixture(scope="session")
def registry():
    from vlmrun import plugins

    return plugins.load()


def build(model, lay, store, registry, **kw):
    return Pipeline.build(model, lay, store=store, registry=registry, **kw)


@pytest.fixture(scope="session")
def htp_pipe(tiny_model, store, registry):
    t0 = time.perf_counter()
    pipe = build(tiny_model, layout(), store, registry)
    print(f"\n[qnn_htp] all-npu build (export + compile) {time.perf_counter() - t0:.1f} s")
    return pipe


@pytest.fixture(scope="session")
def prepared(ref_pipe, image_path):
    return ref_pipe.prepare(image_path, PROMPT)


@pytest.fixture(scope="session")
def ref_tokens(ref_pipe, image_path):
    return ref_pipe.generate(image_path, PROMPT, GenerationSettings(max_new_tokens=N_STEPS, ignore_eos=True)).run().token_ids


@pytest.fixture(scope="session")
def calib_dir(tmp_path_factory, image_path):
    from PIL import Image, ImageOps

    d = tmp_path_factory.mktemp("calib")
    img = Image.open(image_path).convert("RGB")
    img.save(d / "a.jpg")
    ImageOps.mirror(img).save(d / "b.png")
    img.rotate(90).save(d / "c.png")
    return d


@pytest.fixture(scope="session")
def int8_pipe(tiny_model, store, calib_dir, registry):
    return build(tiny_model, layout(vision={"precision": "int8", "calibration_images": str(calib_dir)}),
                 store, registry, stages=("vision",))


# -- compile, manifest, store ------------------------------------------------------------------------------
def test_every_stage_compiles_for_sm8750_with_manifest(htp_pipe):
    arts = [htp_pipe.handles[s].artifact for s in ("vision", "projector", "embed")] + list(
        htp_pipe.handles["decoder"].artifacts)
    assert len(arts) == 5  # decoder: AR-32 and AR-1
    for art in arts:
        m = art.manifest
        assert m["qnn_version"] == "2.51.0" and m["ep_sdk_version"].startswith("v2.51")
        assert "toolchain" not in m  # onnxruntime-qnn compiles by default, never the SDK's tools
        assert (m["soc"], m["soc_model"], m["arch"], m["precision"], m["fallback"]) == ("SM8750", 69, "v79", "fp16", "disabled")
        assert m["graphs"] and all(g for g in m["graphs"])
        bins = [f for f in m["files"] if f.endswith(".bin")]
        assert len(bins) == 1 and (art.path / bins[0]).stat().st_size > 1000
        assert m["checksums"][bins[0]]["sha256"] == sha256_file(art.path / bins[0])
        for t in (*m["inputs"], *m["outputs"]):
            assert t["name"] and t["dtype"] and all(isinstance(d, int) and d > 0 for d in t["shape"]), t
    dec = {tuple(a.manifest["inputs"][0]["shape"]) for a in htp_pipe.handles["decoder"].artifacts}
    assert dec == {(1, 32, htp_pipe.model.hidden_size), (1, 1, htp_pipe.model.hidden_size)}


def test_second_run_loads_from_store_without_compiling(htp_pipe, tiny_model, cache_dir, registry, monkeypatch):
    import vlmrun_qnn_htp.ep as ep

    def boom(*a, **k):
        raise AssertionError("compile ran")

    monkeypatch.setattr(ep, "compile_onnx", boom)
    fresh = ArtifactStore(cache_dir)  # a new process's view: hashes are checked again
    t0 = time.perf_counter()
    build(tiny_model, layout(), fresh, registry)
    warm = time.perf_counter() - t0
    assert fresh.builds == []
    print(f"\n[qnn_htp] warm all-npu load from the store {warm:.2f} s")


def test_corrupted_bin_is_detected_and_rebuilt(htp_pipe, tiny_model, cache_dir, registry, tmp_path):
    import os
    import shutil

    art = htp_pipe.handles["projector"].artifact
    # a store of its own (the session's artifacts hard-linked, the projector's copied): the session store stays
    # intact for the tests that run beside this one
    own = tmp_path / "cache"
    shutil.copytree(cache_dir / "artifacts", own / "artifacts", copy_function=os.link,
                    ignore=lambda d, names: [n for n in names if n.startswith(".tmp-") or n == art.path.name])
    shutil.copytree(art.path, own / "artifacts" / art.path.name)
    art_path = own / "artifacts" / art.path.name
    bin_path = next(art_path / f for f in art.manifest["files"] if f.endswith(".bin"))
    data = bytearray(bin_path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bin_path.write_bytes(bytes(data))
    fresh = ArtifactStore(own)
    pipe = build(tiny_model, layout(), fresh, registry, stages=("projector",))
    assert fresh.builds == [art.path.name]
    assert sha256_file(bin_path) == pipe.handles["projector"].artifact.manifest["checksums"][bin_path.name]["sha256"]
    assert not list((cache_dir / "artifacts").glob(".tmp-*"))


# -- accuracy vs the reference -----------------------------------------------------------------------------
def test_fp16_vision_and_projector_match_reference(htp_pipe, ref_pipe, prepared):
    pv = {"pixel_values": prepared.pixel_values}
    t0 = time.perf_counter()
    f_htp = htp_pipe.run_stage("vision", pv)["image_features"]
    t_vis = time.perf_counter() - t0
    f_ref = ref_pipe.run_stage("vision", pv)["image_features"]
    p_htp = htp_pipe.run_stage("projector", {"image_features": f_ref})["image_embeds"]
    p_ref = ref_pipe.run_stage("projector", {"image_features": f_ref})["image_embeds"]
    e_htp = htp_pipe.run_stage("embed", {"input_ids": prepared.input_ids})["inputs_embeds"]
    e_ref = ref_pipe.run_stage("embed", {"input_ids": prepared.input_ids})["inputs_embeds"]
    cv, cp, ce = cosine(f_htp, f_ref), cosine(p_htp, p_ref), cosine(e_htp, e_ref)
    print(f"\n[qnn_htp] fp16 cosine vision {cv:.6f} projector {cp:.6f} embed {ce:.6f}; vision on emulator {t_vis:.2f} s")
    assert cv >= 0.999 and cp >= 0.999 and ce >= 0.999
    assert 0.05 < float(f_ref.std()) < 10  # the comparison carries signal


def test_fp16_decoder_teacher_forced_and_free_running(htp_pipe, ref_pipe, prepared, ref_tokens, image_path):
    embeds = ref_pipe.embed_prompt(prepared)
    full = np.concatenate([embeds, ref_pipe.embed_tokens(np.asarray(ref_tokens))], axis=1)
    T = embeds.shape[1]
    t0 = time.perf_counter()
    l_htp = htp_pipe.run_stage("decoder", {"inputs_embeds": full})["logits"][0, T - 1 : T - 1 + N_STEPS]
    t_tf = time.perf_counter() - t0
    l_ref = ref_pipe.run_stage("decoder", {"inputs_embeds": full})["logits"][0, T - 1 : T - 1 + N_STEPS]
    agree = float((l_htp.argmax(-1) == np.asarray(ref_tokens)).mean())
    cos = cosine(l_htp, l_ref)
    steps = dict(htp_pipe.handles["decoder"].decoder.steps)
    gen = htp_pipe.generate(image_path, PROMPT, GenerationSettings(max_new_tokens=N_STEPS, ignore_eos=True)).run()
    free = float(np.mean([a == b for a, b in zip(gen.token_ids, ref_tokens)]))
    print(f"\n[qnn_htp] decoder teacher-forced top-1 agreement {agree:.2f}, logits cosine {cos:.6f}"
          f" ({T + N_STEPS} tokens in {t_tf:.2f} s, graph calls {steps}); free-running agreement {free:.2f};"
          f" timings {json.dumps({k: round(v, 1) for k, v in gen.timings.items()})}")
    assert agree >= 0.8 and cos >= 0.99
    assert len(gen.token_ids) == N_STEPS


def test_int8_vision_a8w8_16bit_softmax(int8_pipe, ref_pipe, prepared):
    pv = {"pixel_values": prepared.pixel_values}
    f8 = int8_pipe.run_stage("vision", pv)["image_features"]
    c = cosine(f8, ref_pipe.run_stage("vision", pv)["image_features"])
    m = int8_pipe.handles["vision"].artifact.manifest
    print(f"\n[qnn_htp] int8 vision cosine {c:.5f} (calibration {m['quantization']['calibration']})")
    assert c >= 0.99
    assert m["precision"] == "int8" and m["quantization"]["softmax"] == "QUInt16"
    assert m["quantization"]["calibration"] == "images:3"
    q = m["io_quant"]["image_features"]
    assert q["dtype"] == "uint8" and q["scale"] > 0


@pytest.fixture(scope="session")
def a16w8_decoder_pipe(tiny_model, store, registry):
    """The decoder alone at a16w8 (ctx 128, AR-32 + AR-1), calibrated on the demo image's reference embeddings."""
    t0 = time.perf_counter()
    pipe = build(tiny_model, layout(decoder={"context_length": 128, "precision": "a16w8"}), store, registry,
                 stages=("decoder",))
    print(f"\n[qnn_htp] a16w8 decoder build (export + calibrate + quantize + compile) {time.perf_counter() - t0:.1f} s")
    return pipe


def test_a16w8_decoder_teacher_forced(a16w8_decoder_pipe, ref_pipe, prepared, ref_tokens):
    embeds = ref_pipe.embed_prompt(prepared)
    full = np.concatenate([embeds, ref_pipe.embed_tokens(np.asarray(ref_tokens))], axis=1)
    T = embeds.shape[1]
    l_q = a16w8_decoder_pipe.run_stage("decoder", {"inputs_embeds": full})["logits"][0, T - 1 : T - 1 + N_STEPS]
    l_ref = ref_pipe.run_stage("decoder", {"inputs_embeds": full})["logits"][0, T - 1 : T - 1 + N_STEPS]
    agree = float((l_q.argmax(-1) == np.asarray(ref_tokens)).mean())
    cos = cosine(l_q, l_ref)
    arts = a16w8_decoder_pipe.handles["decoder"].artifacts
    print(f"\n[qnn_htp] a16w8 decoder teacher-forced top-1 agreement {agree:.2f}, logits cosine {cos:.5f}"
          f" (calibration: {arts[-1].manifest['quantization']['calibration']})")
    assert agree >= 0.8 and cos >= 0.98
    for art in arts:
        m = art.manifest
        assert m["precision"] == "a16w8" and m["quantization"]["activation"] == "QUInt16"
        assert "demo image" in m["quantization"]["calibration"]
        assert "reference (ort_reference) prompt embeddings" in m["quantization"]["calibration"]
        assert m["io_quant"]["logits"]["dtype"] == "uint16"


def test_int8_embed(tiny_model, store, registry, ref_pipe, prepared):
    pipe = build(tiny_model, layout(embed={"precision": "int8"}), store, registry, stages=("embed",))
    ids = {"input_ids": prepared.input_ids}
    c = cosine(pipe.run_stage("embed", ids)["inputs_embeds"], ref_pipe.run_stage("embed", ids)["inputs_embeds"])
    m = pipe.handles["embed"].artifact.manifest
    print(f"\n[qnn_htp] int8 embed cosine {c:.6f} (calibration {m['quantization']['calibration']})")
    assert c >= 0.99
    assert m["precision"] == "int8" and m["quantization"]["calibration"].startswith("token-ids:")
    assert m["io_quant"]["inputs_embeds"]["dtype"] == "uint8"


# -- CLI ----------------------------------------------------------------------------------------------------
def test_cli_compile_reuses_and_records_random_calibration(htp_pipe, cache_dir):
    """`vlmrun compile` in a fresh process."""
    from conftest import run_cli

    def run(*args):
        return run_cli(["compile", "--backend", "qnn_htp", "--image-size", "256", *args], cache_dir, timeout=300)

    res = run("--stage", "vision")
    assert res.returncode == 0, res.stderr[-2000:]
    assert "reused vision" in res.stdout and "SM8750" in res.stdout
    # a key no other test (or docs example) of the session compiles: built once, then reused
    res = run("--stage", "projector", "--precision", "int8", "--soc", "sm8650", "--json")
    assert res.returncode == 0, res.stderr[-2000:]
    art = json.loads(res.stdout)["artifacts"][0]  # stdout is pure JSON: the QNN banner goes to stderr
    m = json.loads((Path(art["path"]) / "manifest.json").read_text())
    assert art["built"] and m["quantization"]["calibration"] == "random" and m["precision"] == "int8"
    res = run("--stage", "projector", "--precision", "int8", "--soc", "sm8650", "--json")
    assert res.returncode == 0 and not json.loads(res.stdout)["artifacts"][0]["built"]
    res = run("--stage", "vision", "--soc", "sm9999")
    assert res.returncode == 2 and res.stderr.strip() == (
        "vlmrun: error: stage 'vision' (qnn_htp): option 'soc' must be one of SM8750, SM8650, SM8550, SM8475,"
        " SM8450, SC8380XP, got 'sm9999'")


def test_all_npu_layout_from_the_cli(htp_pipe, cache_dir, image_path, tmp_path):
    from conftest import run_cli

    lay = tmp_path / "npu.toml"
    lay.write_text('base = "all-npu"\n[decoder]\ncontext_length = 256\nprefill_ar = 32\ndecoder_form = "fixed"\n')
    res = run_cli(["--layout-file", str(lay), "--image-size", "256", "--image", str(image_path), "--prompt", "Hi",
                   "--max-new-tokens", "4", "--ignore-eos", "--json"], cache_dir)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert set(out["layout"].values()) == {"qnn_htp"} and len(out["token_ids"]) == 4
    assert {"vision_ms", "projector_ms", "embed_ms", "ttft_ms", "tokens_per_s"} <= set(out["timings"])
    assert "compiling" not in res.stderr  # compiled once per test session, by the fixture


def test_cli_compile_all_npu_int8(htp_pipe, cache_dir):
    """Every stage at int8 (decoder: a8w8 with 16-bit Softmax, fixed-KV AR-64 + AR-1 at ctx 128)."""
    from conftest import run_cli

    t0 = time.perf_counter()
    res = run_cli(["compile", "--layout", "all-npu", "--precision", "int8", "--image-size", "256",
                   "--context-length", "128", "--json"], cache_dir, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    arts = json.loads(res.stdout)["artifacts"]
    print(f"\n[qnn_htp] vlmrun compile --layout all-npu --precision int8: {time.perf_counter() - t0:.1f} s")
    assert [a["stage"] for a in arts] == ["vision", "projector", "embed", "decoder", "decoder"]
    for a in arts:
        m = json.loads((Path(a["path"]) / "manifest.json").read_text())
        assert m["precision"] == "int8" and m["quantization"]["softmax"] == "QUInt16", a["stage"]
        assert m["quantization"]["calibration"]
    dec = [json.loads((Path(a["path"]) / "manifest.json").read_text()) for a in arts if a["stage"] == "decoder"]
    assert {tuple(m["inputs"][0]["shape"]) for m in dec} == {(1, 64, htp_pipe.model.hidden_size), (1, 1, htp_pipe.model.hidden_size)}
    assert all("demo image" in m["quantization"]["calibration"] for m in dec)


EMULATOR_RUN = """
import hashlib, json, sys
from pathlib import Path
import numpy as np
from vlmrun_qnn_htp import ep
from vlmrun_qualcomm import emulator, socs
digests = {}
for path in sys.argv[1:]:
    session = ep.HtpSession(Path(path), socs.soc("sm8750"), "test")
    rng = np.random.default_rng(7)
    feeds = {k: (rng.standard_normal(shape) * 0.5).astype(dtype) for k, (shape, dtype) in session.inputs.items()}
    outs = session.run(feeds)
    digests[Path(path).name] = hashlib.sha256(b"".join(np.ascontiguousarray(outs[k]).tobytes()
                                                       for k in session.outputs)).hexdigest()
print(json.dumps({"status": emulator.status(), "digests": digests}))
"""


def test_the_emulators_pow_fast_path_changes_no_output_byte(htp_pipe, cache_dir):
    """libQnnHtp.so's pow routed to ldexp for pow(2, n) (vlmrun_qualcomm.emulator): the session's vision, projector
    and decoder graphs (fp16) give the same bytes as with libm's pow, in processes of their own."""
    import subprocess

    from vlmrun_qualcomm import _emulator_pow

    # the fast path itself, against libm over every whole exponent it takes and arguments it hands on
    for n in range(-1100, 1101):
        assert _emulator_pow.value(2.0, float(n)) == (2.0 ** n if -1075 < n < 1024 else (0.0 if n < 0 else np.inf))
    for x, y in [(2.0, 0.5), (2.0, -0.0), (3.0, 2.0), (2.0, 1e9), (0.5, 3.0), (-2.0, 3.0), (2.0, 1100.5)]:
        with np.errstate(over="ignore"):
            assert _emulator_pow.value(x, y) == float(np.power(np.float64(x), np.float64(y))), (x, y)
    graphs = sorted(str(p) for pattern in ("vision-qnn_htp-vision", "projector-qnn_htp-projector",
                                            "decoder-qnn_htp-decoder_fixed_ar_*_ctx_256_*")  # htp_pipe's binaries
                    for p in cache_dir.glob(f"artifacts/{pattern}-fp16-SM8750-*/*_ctx.onnx"))
    assert len(graphs) >= 4, graphs
    runs = {}
    for flag in ("1", "0"):
        env = dict(os.environ, VLMRUN_EMULATOR_FAST_POW=flag)
        res = subprocess.run([sys.executable, "-c", EMULATOR_RUN, *graphs], capture_output=True, text=True, env=env,
                             timeout=300)
        assert res.returncode == 0, res.stderr[-2000:]
        runs[flag] = json.loads(res.stdout.strip().splitlines()[-1])
    assert runs["1"]["status"] == "on (libQnnHtp.so: 1 pow slot routed to ldexp for pow(2, n))"
    assert runs["0"]["status"] == "off (VLMRUN_EMULATOR_FAST_POW=0)"
    assert runs["1"]["digests"] == runs["0"]["digests"] and len(runs["1"]["digests"]) == len(graphs)
    # Genie's workers (a dialog, a bundle's pipeline) route it before libGenie loads the HTP backend
    for binding in ("genie_binding import GenieLibrary as Lib", "genie_pipeline import PipelineLibrary as Lib"):
        code = (f"import os, onnxruntime_qnn\nfrom vlmrun_qualcomm.{binding}\nfrom vlmrun_qualcomm import emulator\n"
                "Lib(os.path.join(os.path.dirname(onnxruntime_qnn.__file__), 'libGenie.so'))\nprint(emulator.status())")
        res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert res.stdout.strip() == runs["1"]["status"], (binding, res.stdout, res.stderr[-1000:])


# -- adb + qnn-net-run (stand-ins) --------------------------------------------------------------------------
MATCHING_QAIRT = "2.51.0.251216"  # the QNN of onnxruntime-qnn 2.7.0, whose binaries qnn_htp makes by default
OLD_QAIRT = "2.42.0.251225"  # the SDK of the FastVLM hand-off


def standin_tool(path: Path, tool: str) -> None:
    """``path`` runs the stand-in ``tool`` with this interpreter (onnxruntime-qnn), the host's loader kept away from
    the fake SDK's dummy libraries (the real libs come with onnxruntime-qnn)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\nexec env -u LD_LIBRARY_PATH -u ADSP_LIBRARY_PATH {sys.executable}"
                    f" {STANDINS / tool} \"$@\"\n")
    path.chmod(0o755)


def fake_qairt(sdk: Path, version: str | None = MATCHING_QAIRT, compile_tools: bool = False, skip=()) -> Path:
    """A QAIRT SDK layout: sdk.yaml, the phone runtime (qnn-net-run = the stand-in, dummy libraries whose
    libQnnHtp.so carries the version as the real one carries its build id), optionally the host compile tools."""
    standin_tool(sdk / "bin" / "aarch64-android" / "qnn-net-run", "qnn-net-run")
    if version:
        (sdk / "sdk.yaml").write_text(f"name: qairt\nversion: {version}\n")
    for lib in ("lib/aarch64-android/libQnnHtp.so", "lib/aarch64-android/libQnnHtpV79Stub.so",
                "lib/aarch64-android/libQnnSystem.so", "lib/hexagon-v79/unsigned/libQnnHtpV79Skel.so"):
        (sdk / lib).parent.mkdir(parents=True, exist_ok=True)
        (sdk / lib).write_bytes(b"\x7fELF stand-in " + lib.encode() + f" QNN v{version or ''}".encode())
    if compile_tools:
        for tool in ("qnn-onnx-converter", "qnn-model-lib-generator", "qnn-context-binary-generator",
                     "qnn-context-binary-utility"):
            if tool not in skip:
                standin_tool(sdk / "bin" / "x86_64-linux-clang" / tool, tool)
        for lib in ("libQnnHtp.so", "libQnnHtpNetRunExtensions.so"):
            (sdk / "lib" / "x86_64-linux-clang").mkdir(parents=True, exist_ok=True)
            (sdk / "lib" / "x86_64-linux-clang" / lib).write_bytes(b"\x7fELF stand-in " + f"v{version}".encode())
        for pkg in ("qti", "qti/aisw", "qti/aisw/converters"):
            (sdk / "lib" / "python" / pkg).mkdir(parents=True, exist_ok=True)
            (sdk / "lib" / "python" / pkg / "__init__.py").write_text("")
    return sdk


@pytest.fixture
def device(tmp_path, monkeypatch):
    """A fake SDK matching onnxruntime-qnn's QNN (qnn-net-run = the stand-in) and a fake phone behind the adb
    stand-in."""
    sdk = fake_qairt(tmp_path / "qairt")
    monkeypatch.setenv("STANDIN_ADB_ROOT", str(tmp_path / "phone"))
    monkeypatch.setenv("STANDIN_ADB_LOG", str(tmp_path / "adb.log"))
    monkeypatch.delenv("STANDIN_QNN_NET_RUN_MODE", raising=False)
    monkeypatch.delenv("QAIRT_SDK_ROOT", raising=False)
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    return {"target": "android", "sdk_root": str(sdk), "adb": str(STANDINS / "adb"), "log": tmp_path / "adb.log"}


def android_pipe(tiny_model, store, device, registry, **extra):
    opts = {k: v for k, v in device.items() if k != "log"}
    opts.update(extra)
    return build(tiny_model, layout(vision=opts), store, registry, stages=("vision",))


def test_android_path_matches_local_and_skips_same_push(htp_pipe, tiny_model, store, device, prepared, registry):
    pipe = android_pipe(tiny_model, store, device, registry)
    pv = {"pixel_values": prepared.pixel_values}
    remote = pipe.run_stage("vision", pv)["image_features"]
    local = htp_pipe.run_stage("vision", pv)["image_features"]
    np.testing.assert_allclose(remote, local, rtol=0, atol=1e-5)
    log = device["log"].read_text()
    assert "push" in log and "qnn-net-run --retrieve_context" in log and ":=" not in log  # list is a file
    first = pipe.handles["vision"].adb
    assert any(p.endswith(".bin") for p in first.pushed)
    again = android_pipe(tiny_model, store, device, registry).handles["vision"].adb
    assert not any(p.endswith(".bin") for p in again.pushed) and any(p.endswith(".bin") for p in again.skipped)


def test_native_uint8_output_is_dequantized(int8_pipe, tiny_model, store, device, prepared, calib_dir, registry,
                                           monkeypatch):
    art = int8_pipe.handles["vision"].artifact
    q = art.manifest["io_quant"]["image_features"]
    monkeypatch.setenv("STANDIN_NATIVE_QUANT", json.dumps({"image_features": q}))
    pipe = android_pipe(tiny_model, store, device, registry, precision="int8", calibration_images=str(calib_dir),
                        native_outputs=True)
    pv = {"pixel_values": prepared.pixel_values}
    raw = pipe.handles["vision"].run(pv)["image_features"]
    assert isinstance(raw, QuantizedTensor) and raw.data.dtype == np.uint8
    assert (raw.scale, raw.offset) == (q["scale"], q["offset"])
    local = int8_pipe.run_stage("vision", pv)["image_features"]
    expect = (raw.data.astype(np.float32) + q["offset"]) * q["scale"]
    deq = pipe.run_stage("vision", pv)["image_features"]  # the core dequantizes at the boundary
    assert deq.dtype == np.float32
    np.testing.assert_allclose(deq, expect, atol=1e-6)
    assert np.abs(deq - local).max() <= q["scale"] * 0.51 + 1e-6


# -- faults ---------------------------------------------------------------------------------------------
def test_binary_for_another_soc_or_newer_qnn_is_refused(htp_pipe, tiny_model, store, registry, tmp_path):
    import onnx

    from vlmrun_qnn_htp import ep
    from vlmrun_qualcomm import socs

    other = build(tiny_model, layout(projector={"soc": "sm8650"}), store, registry, stages=("projector",))
    art = other.handles["projector"].artifact
    assert (art.manifest["soc"], art.manifest["arch"], art.manifest["soc_model"]) == ("SM8650", "v75", 57)
    with pytest.raises(BackendError, match="built for SM8650/v75 but the target is SM8750/v79"):
        ep.check_binary(art.manifest, art.file(), socs.soc("SM8750"), "projector")
    mine = htp_pipe.handles["projector"].artifact
    copy = tmp_path / "newer"
    shutil.copytree(mine.path, copy)
    m = onnx.load(str(copy / mine.manifest["files"][0]))
    for n in m.graph.node:
        for a in n.attribute:
            if a.name == "ep_sdk_version":
                a.s = b"v2.60.0.999"
    onnx.save(m, str(copy / mine.manifest["files"][0]))
    with pytest.raises(BackendError, match=r"built with QNN 2\.60\.0\.999 but this runtime is QNN 2\.51"):
        ep.check_binary(mine.manifest, copy / mine.manifest["files"][0], socs.soc("SM8750"), "projector")


def test_op_rejected_by_htp_is_named_and_nothing_half_written(store, tmp_path):
    import onnx
    from onnx import TensorProto, helper

    from vlmrun_qnn_htp import ep
    from vlmrun_qualcomm import socs

    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Det", ["r"], ["y"], name="the_det")], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    src = tmp_path / "det.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9), str(src))
    key = {"stage": "faulty", "backend": "qnn_htp", "kind": "det"}
    with pytest.raises(BackendError, match=r"unsupported op\(s\) Det \(node the_det\)"):
        store.get_or_build(key, lambda tmp: ep.compile_onnx(src, tmp, "det", socs.soc(None), "test graph"))
    assert not store.path_for(key).exists()
    assert not list((store.root / "artifacts").glob(".tmp-*"))


def test_qnn_net_run_failure_hang_and_short_output(htp_pipe, tiny_model, store, device, prepared, registry,
                                                   monkeypatch):
    pipe = android_pipe(tiny_model, store, device, registry)
    handle = pipe.handles["vision"]
    pv = {"pixel_values": prepared.pixel_values}
    monkeypatch.setenv("STANDIN_QNN_NET_RUN_MODE", "fail")
    with pytest.raises(BackendError, match=r"qnn-net-run \(vision\) exited with code 1 .*err 5005"):
        handle.run(pv)
    monkeypatch.setenv("STANDIN_QNN_NET_RUN_MODE", "short")
    with pytest.raises(BackendError, match=r"output 'image_features' is 8192 bytes, expected 16384"):
        handle.run(pv)
    monkeypatch.setenv("STANDIN_QNN_NET_RUN_MODE", "hang")
    handle.timeout = 2.0
    t0 = time.perf_counter()
    with pytest.raises(BackendError, match=r"qnn-net-run \(vision\) timed out after 2 s"):
        handle.run(pv)
    assert time.perf_counter() - t0 < 15


def test_adb_device_selection_and_sdk_errors(device, monkeypatch):
    from vlmrun_qualcomm.adb import Adb
    from vlmrun_qnn_htp.netrun import sdk_root

    adb = device["adb"]
    monkeypatch.setenv("STANDIN_ADB_DEVICES", "")
    with pytest.raises(BackendError, match="no Android device connected"):
        Adb.connect(None, adb)
    monkeypatch.setenv("STANDIN_ADB_DEVICES", "A1:device,B2:device")
    with pytest.raises(BackendError, match=r"several Android devices connected \(A1 \(device\), B2 \(device\)\)"):
        Adb.connect(None, adb)
    assert Adb.connect("B2", adb).serial == "B2"
    monkeypatch.setenv("STANDIN_ADB_DEVICES", "C3:unauthorized")
    with pytest.raises(BackendError, match="device C3 is unauthorized"):
        Adb.connect(None, adb)
    with pytest.raises(BackendError, match="set QAIRT_SDK_ROOT"):
        sdk_root(None)
    line = Adb.command_line(["ls", "/data/local/tmp/my dir"], cwd="/data/x y", env={"A": "b c"})
    assert line == "cd '/data/x y' && env A='b c' ls '/data/local/tmp/my dir'"


# -- issue 11: the phone's QNN version, the SDK's own compile tools, qnn-net-run's real output names --------------
def test_sdk_version_is_read_from_sdk_yaml_dir_name_or_library(tmp_path):
    from vlmrun_qualcomm.sdk import Sdk, newer_than

    a = fake_qairt(tmp_path / "a", OLD_QAIRT)
    assert Sdk.find(a).version_info() == (OLD_QAIRT, str(a / "sdk.yaml"))
    b = fake_qairt(tmp_path / "qairt" / "2.45.0.250101", version=None)
    assert Sdk.find(b).version() == "2.45.0.250101"  # the SDK unpacks as qairt/<version>
    c = fake_qairt(tmp_path / "c", version=None)
    (c / "lib/aarch64-android/libQnnHtp.so").write_bytes(b"\x7fELF\0\0build v2.47.0.250903123456_1 \0")
    assert Sdk.find(c).version_info() == ("2.47.0.250903123456", str(c / "lib/aarch64-android/libQnnHtp.so"))
    assert Sdk.find(tmp_path / "none").version() is None
    assert newer_than("2.51.0", OLD_QAIRT) and not newer_than("2.51.0", MATCHING_QAIRT)
    assert not newer_than("2.42.0", "2.51.0.1") and not newer_than(None, OLD_QAIRT)


def test_binary_newer_than_the_phone_sdk_is_refused_before_any_push(htp_pipe, tiny_model, store, device, registry,
                                                                    prepared, tmp_path, monkeypatch):
    from vlmrun_qualcomm.adb import Adb
    from vlmrun_qnn_htp import netrun

    old = fake_qairt(tmp_path / "old", OLD_QAIRT)
    with pytest.raises(BackendError) as err:  # preflight: known before compiling (onnxruntime-qnn makes QNN 2.51)
        android_pipe(tiny_model, store, dict(device, sdk_root=str(old)), registry)
    msg = str(err.value)
    assert "\n" not in msg and "built with QNN 2.51.0 (compiled by onnxruntime-qnn)" in msg
    assert f"QAIRT {OLD_QAIRT}" in msg and 'qairt_version = "2.42"' in msg and "--toolchain sdk" in msg
    assert not device["log"].exists()  # adb was not even asked for a device
    art = htp_pipe.handles["vision"].artifact
    adb = Adb.connect(None, device["adb"])
    with pytest.raises(BackendError, match=r"vision .*: the context binary was built with QNN 2\.51\.0"):
        netrun.NetRunStage(art, "vision", sdk=netrun.phone_sdk(old), adb=adb)
    assert adb.pushed == [] and "push" not in device["log"].read_text()
    # the stand-in is the real contract: with vlmrun's check out of the way the phone refuses the binary itself
    monkeypatch.setattr(netrun, "check_runtime", lambda *a, **k: None)
    stage = netrun.NetRunStage(art, "vision", sdk=netrun.phone_sdk(old), adb=adb)
    with pytest.raises(BackendError, match=r"exited with code 1 .*QNN_CONTEXT_ERROR_INVALID_ARGUMENT, 5000"):
        stage.run({"pixel_values": prepared.pixel_values})
    # a matching SDK (the fixture's) is accepted and runs
    pipe = android_pipe(tiny_model, store, device, registry)
    assert pipe.run_stage("vision", {"pixel_values": prepared.pixel_values})["image_features"].shape[0] == 1


def test_sdk_toolchain_makes_binaries_for_an_older_phone(htp_pipe, tiny_model, store, device, registry, prepared,
                                                       tmp_path):
    old = fake_qairt(tmp_path / "old", OLD_QAIRT, compile_tools=True)
    pipe = android_pipe(tiny_model, store, dict(device, sdk_root=str(old)), registry, toolchain="sdk")
    art = pipe.handles["vision"].artifact
    m = art.manifest
    assert m["qnn_version"] == OLD_QAIRT and m["ep_sdk_version"] == f"v{OLD_QAIRT}" and m["compiler"] == "qnn_htp"
    tools = [argv[0] for argv in m["toolchain"]["argv"]]
    assert tools == ["qnn-onnx-converter", "qnn-model-lib-generator", "qnn-context-binary-generator",
                     "qnn-context-binary-utility"]
    conv, libgen, ctxgen, _ = m["toolchain"]["argv"]
    assert "--preserve_io" in conv and conv[conv.index("--float_bitwidth") + 1] == "16"
    assert libgen[libgen.index("-t") + 1] == "x86_64-linux-clang"
    assert ctxgen[ctxgen.index("--backend") + 1] == "libQnnHtp.so" and "--config_file" in ctxgen
    pv = {"pixel_values": prepared.pixel_values}
    remote = pipe.run_stage("vision", pv)["image_features"]  # QAIRT 2.42 runtime on the phone accepts it
    local = htp_pipe.run_stage("vision", pv)["image_features"]
    np.testing.assert_allclose(remote, local, rtol=0, atol=1e-5)
    # the same binary also loads locally (onnxruntime-qnn's QNN 2.51 is newer than 2.42)
    from vlmrun_qnn_htp import ep
    from vlmrun_qualcomm import socs

    ep.check_binary(m, art.file(), socs.soc("SM8750"), "vision")


def test_sdk_toolchain_missing_tool_is_named_before_any_work(tiny_model, store, device, registry, tmp_path):
    old = fake_qairt(tmp_path / "old", OLD_QAIRT, compile_tools=True, skip=("qnn-model-lib-generator",))
    before = len(store.builds)
    with pytest.raises(BackendError) as err:
        android_pipe(tiny_model, store, dict(device, sdk_root=str(old)), registry, toolchain="sdk")
    assert str(err.value) == (f"the QNN SDK lacks qnn-model-lib-generator (x86_64-linux-clang), needed for toolchain ="
                              f" \"sdk\"; looked in {old} (the sdk_root option)")
    assert len(store.builds) == before and not device["log"].exists()


def test_native_outputs_are_found_under_their_real_names(int8_pipe, htp_pipe, tiny_model, store, device, prepared,
                                                         calib_dir, registry, monkeypatch):
    """qnn-net-run writes a quantized native output as <name>_native.raw, a float32 one as <name>.raw, and puts each
    graph's results in <graph>/Result_0 when the context holds several graphs."""
    import types

    from vlmrun_qualcomm.adb import Adb
    from vlmrun_qnn_htp import netrun

    q = int8_pipe.handles["vision"].artifact.manifest["io_quant"]["image_features"]
    monkeypatch.setenv("STANDIN_NATIVE_QUANT", json.dumps({"image_features": q}))
    pipe = android_pipe(tiny_model, store, device, registry, precision="int8", calibration_images=str(calib_dir),
                        native_outputs=True)
    handle = pipe.handles["vision"]
    raw = handle.run({"pixel_values": prepared.pixel_values})["image_features"]
    assert isinstance(raw, QuantizedTensor) and raw.data.dtype == np.uint8
    outs = sorted(p.name for p in (Path(device["log"]).parent / "phone").rglob("Result_0/*.raw"))
    assert outs == ["image_features_native.raw"]
    # a float32 output stays <name>.raw with native files asked for; several graphs -> one folder per graph
    monkeypatch.delenv("STANDIN_NATIVE_QUANT")
    art = htp_pipe.handles["projector"].artifact
    graph = art.manifest["graphs"][0]
    monkeypatch.setenv("STANDIN_QNN_GRAPHS", f"{graph},prompt_ar128_cl512")
    two = types.SimpleNamespace(manifest={**art.manifest, "graphs": [graph, "prompt_ar128_cl512"]}, path=art.path,
                                file=art.file)
    stage = netrun.NetRunStage(two, "projector", sdk=netrun.phone_sdk(device["sdk_root"]),
                               adb=Adb.connect(None, device["adb"]), native_outputs=True)
    feats = htp_pipe.run_stage("vision", {"pixel_values": prepared.pixel_values})["image_features"]
    out = stage.run({"image_features": feats})["image_embeds"]
    np.testing.assert_allclose(out, htp_pipe.run_stage("projector", {"image_features": feats})["image_embeds"],
                               rtol=0, atol=1e-5)
    out_dir = Path(device["log"]).parent / "phone" / "data/local/tmp/vlmrun" / art.path.name / "run" / "out"
    assert {p.relative_to(out_dir).as_posix() for p in out_dir.rglob("*.raw")} == {
        f"{graph}/Result_0/image_embeds.raw", "prompt_ar128_cl512/Result_0/image_embeds.raw"}
