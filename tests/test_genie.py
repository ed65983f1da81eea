"""Genie (issue 4): generated configs against the real libGenie, Genie on QnnHtp (emulator) vs qnn_htp's host loop
over the same binaries, and the genie_cpu plugin end to end through stand-ins of genie-t2t-run and the composer."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

from vlmrun import GenerationSettings, Pipeline, genie
from vlmrun.errors import BackendError, UsageError
from vlmrun.layouts import Layout, StageAssignment
from vlmrun.sampling import Sampler, SamplingSettings
from vlmrun.stages import STAGES, DecodeRequest

STANDINS = Path(__file__).parent / "standins"
PROMPT = "Hi?"
N_STEPS = 10

#: FastVLM-0.5B's text dimensions as its config.json states them (apple/FastVLM-0.5B, Qwen2-0.5B)
FULL_CONFIG = {
    "model_type": "fast_vlm", "image_token_id": 151646,
    "text_config": {"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                    "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 152000,
                    "rope_theta": 1000000.0, "max_position_embeddings": 32768, "bos_token_id": 151643,
                    "eos_token_id": 151645},
}
MID_CONFIG = {"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "vocab_size": 128256, "rope_parameters": {"rope_theta": 500000.0},
              "bos_token_id": 128000, "eos_token_id": [128001, 128009], "max_position_embeddings": 8192}


def layout(decoder_backend: str, **opts) -> Layout:
    stages = {s: StageAssignment("ort_reference", {}) for s in STAGES}
    stages["decoder"] = StageAssignment(decoder_backend, opts)
    return Layout("test-genie", stages)


@pytest.fixture(scope="session")
def libgenie():
    pytest.importorskip("onnxruntime_qnn")
    from vlmrun_qnn_htp.genie_engine import libgenie_path

    return genie.GenieLibrary(libgenie_path())


@pytest.fixture(scope="session")
def ref_gen(ref_pipe, image_path):
    return ref_pipe.generate(image_path, PROMPT, GenerationSettings(max_new_tokens=N_STEPS, ignore_eos=True)).run()


# -- configs ----------------------------------------------------------------------------------------------------
def _facts_list(tiny_model):
    return [genie.GenieModel.from_model(tiny_model), genie.GenieModel.from_config(FULL_CONFIG),
            genie.GenieModel.from_config(MID_CONFIG)]


def test_config_values_come_from_the_model(tiny_model):
    tiny, full, mid = _facts_list(tiny_model)
    tc = tiny_model.text_config
    assert (tiny.vocab, tiny.hidden, tiny.layers, tiny.heads, tiny.kv_heads) == (
        tc["vocab_size"], tc["hidden_size"], tc["num_hidden_layers"], tc["num_attention_heads"],
        tc["num_key_value_heads"])
    assert tiny.eos[0] == tc["eos_token_id"] and tiny.bos == tc["bos_token_id"] and tiny.pad == tc["pad_token_id"]
    assert (full.vocab, full.hidden, full.layers, full.heads, full.kv_heads, full.head_dim) == (152000, 896, 24, 14, 2, 64)
    assert (full.bos, full.eos, full.rope_theta) == (151643, (151645,), 1e6)
    assert (mid.head_dim, mid.eos, mid.rope_theta) == (128, (128001, 128009), 500000.0)
    cfg = genie.dialog_config(full, "QnnHtp", tokenizer="tokenizer.json", context_size=1024, ctx_bins=["a.bin"])
    d = cfg["dialog"]
    assert d["context"]["n-vocab"] == 152000 and d["context"]["n-embd"] == 896
    assert d["engine"]["backend"]["QnnHtp"]["kv-dim"] == 64
    assert d["engine"]["model"]["positional-encoding"] == {"type": "rope", "rope-dim": 32, "rope-theta": 1e6}
    cpu = genie.dialog_config(full, "QnnGenAiTransformer", tokenizer="t.json", context_size=512, model_bin="m.bin",
                              sampling=SamplingSettings(temperature=0.7, top_k=40, top_p=0.9, seed=5))["dialog"]
    be = cpu["engine"]["backend"]["QnnGenAiTransformer"]
    assert (be["n-layer"], be["n-embd"], be["n-heads"], be["n-kv-heads"], be["model-input"]) == (24, 896, 14, 2, "embeddings")
    assert cpu["sampler"] == {"version": 1, "seed": 5, "temp": 0.7, "top-k": 40, "top-p": 0.9, "greedy": False}
    with pytest.raises(UsageError, match="context size"):
        genie.dialog_config(full, "QnnHtp", tokenizer="t", context_size=10**6, ctx_bins=["a"])


def test_every_generated_config_is_accepted_by_libgenie(libgenie, tiny_model):
    n = 0
    for facts in _facts_list(tiny_model):
        for sampling in (SamplingSettings(), SamplingSettings(temperature=0.8, top_k=20, top_p=0.95, seed=3)):
            for ctx in (128, 1024):
                libgenie.validate_config(genie.dialog_config(
                    facts, "QnnHtp", tokenizer="tokenizer.json", context_size=ctx, sampling=sampling,
                    ctx_bins=["decoder_ar16_ctx_qnn.bin", "decoder_ar1_ctx_qnn.bin"]))
                libgenie.validate_config(genie.dialog_config(
                    facts, "QnnGenAiTransformer", tokenizer="tokenizer.json", context_size=ctx, sampling=sampling,
                    model_bin="model.bin"))
                n += 2
    assert n == 24


def test_broken_configs_are_rejected_by_libgenie(libgenie, tiny_model):
    good = genie.dialog_config(genie.GenieModel.from_model(tiny_model), "QnnHtp", tokenizer="t.json",
                               context_size=128, ctx_bins=["a.bin"])
    bad_type = copy.deepcopy(good)
    bad_type["dialog"]["context"]["size"] = "lots"
    no_engine = copy.deepcopy(good)
    del no_engine["dialog"]["engine"]
    unknown = copy.deepcopy(good)
    unknown["dialog"]["engine"]["backend"]["QnnHtp"]["warp-drive"] = True
    for broken in (bad_type, no_engine, unknown, "{not json"):
        with pytest.raises(BackendError, match=r"GenieDialogConfig_createFromJson failed: GENIE_STATUS_ERROR"):
            libgenie.validate_config(broken)


# -- files -----------------------------------------------------------------------------------------------------
def test_embedding_file_is_the_reference_inputs_embeds(ref_gen, tmp_path):
    emb = ref_gen.tensors["inputs_embeds"]
    path = genie.write_embeddings(tmp_path / "e.raw", emb)
    raw = np.fromfile(path, dtype=np.float32)
    n, h = emb.shape[1], emb.shape[2]
    assert path.stat().st_size == n * h * 4
    assert np.array_equal(raw.reshape(n, h), emb[0])


# -- Genie on QnnHtp (emulator) --------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def genie_htp_pipe(tiny_model, store):
    pytest.importorskip("onnxruntime_qnn")
    t0 = time.perf_counter()
    pipe = Pipeline.build(tiny_model, layout("qnn_htp", engine="genie", context_length=128, prefill_ar=16), store=store)
    print(f"\n[genie] decoder/genie AR-16 + AR-1 export + compile {time.perf_counter() - t0:.1f} s")
    return pipe


def test_genie_on_htp_equals_host_loop_over_same_binaries(genie_htp_pipe, ref_gen, image_path):
    pipe = genie_htp_pipe
    handle = pipe.handles["decoder"]
    assert len(handle.ctx_bins) == 2 and all(Path(b).name.endswith("_qnn.bin") for b in handle.ctx_bins)
    t0 = time.perf_counter()
    gen = pipe.generate(image_path, PROMPT, GenerationSettings(max_new_tokens=N_STEPS, ignore_eos=True))
    pieces = list(gen)
    genie_s = time.perf_counter() - t0
    assert len(gen.token_ids) == N_STEPS and "".join(pieces) == gen.text
    req = DecodeRequest(gen.tensors["inputs_embeds"], N_STEPS, Sampler(), frozenset(), pipe.embed_tokens, 128)
    host = list(handle.decoder.generate(req))
    assert handle.decoder.steps[16] > 0  # the host loop used the AR-16 graph for the prompt too
    assert gen.token_ids == host
    agree = sum(a == b for a, b in zip(gen.token_ids, ref_gen.token_ids))
    first = next((i for i, (a, b) in enumerate(zip(gen.token_ids, ref_gen.token_ids)) if a != b), N_STEPS)
    t = handle.last_timings
    print(f"\n[genie] QnnHtp tokens {gen.token_ids}\n[genie] reference    {ref_gen.token_ids}\n"
          f"[genie] agreement with reference {agree}/{N_STEPS} (first {first} equal); {genie_s:.2f} s; Genie profile"
          f" init {t.get('genie_init_ms', 0):.0f} ms, TTFT {t.get('ttft_ms', 0):.0f} ms,"
          f" prompt {t.get('prompt_tokens_per_s', 0):.0f} tok/s, decode {t.get('tokens_per_s', 0):.1f} tok/s")
    assert t["prompt_tokens"] == gen.timings["prompt_tokens"] and t["new_tokens"] == N_STEPS


# -- genie-t2t-run runner ----------------------------------------------------------------------------------------
def test_t2t_flag_rules(tmp_path):
    with pytest.raises(UsageError, match="-t .* needs -e"):
        genie.t2t_argv("g", "c.json", prompt="hi", lut="l.raw")
    with pytest.raises(UsageError, match="excludes"):
        genie.t2t_argv("g", "c.json", prompt="hi", embedding_file="e.raw")
    (tmp_path / "p.json").write_text("{}")
    with pytest.raises(UsageError, match="already exists"):
        genie.t2t_argv("g", "c.json", embedding_file="e.raw", profile=str(tmp_path / "p.json"))
    assert genie.t2t_argv("g", "c.json", embedding_file="e.raw", lut="l.raw", output_type="text",
                          profile="x.json") == ["g", "-c", "c.json", "-e", "e.raw", "-t", "l.raw",
                                                "--embedding_query_output_type", "text", "--profile", "x.json"]


@pytest.fixture()
def t2t_files(tmp_path, tiny_model):
    facts = genie.GenieModel.from_model(tiny_model)
    cfg = genie.dialog_config(facts, "QnnGenAiTransformer", tokenizer="t.json", context_size=128, model_bin="m.bin")
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    genie.write_embeddings(tmp_path / "e.raw", np.ones((1, 3, facts.hidden), np.float32))
    genie.write_lut(tmp_path / "l.raw", np.zeros((facts.vocab, facts.hidden), np.float32))
    return tmp_path


def _argv(d: Path):
    return genie.t2t_argv(str(STANDINS / "genie-t2t-run"), str(d / "c.json"), embedding_file=str(d / "e.raw"),
                          lut=str(d / "l.raw"), output_type="text", profile=str(d / "prof.json"))


def test_t2t_parses_text_and_profile(t2t_files, monkeypatch):
    monkeypatch.setenv("STANDIN_GENIE_TEXT", "two cats on a mat")
    res = genie.run_t2t(_argv(t2t_files), timeout=30, profile=t2t_files / "prof.json")
    assert res.text == "two cats on a mat"
    assert res.timings == {"genie_init_ms": 120.0, "genie_query_ms": 900.0, "prompt_tokens": 3.0,
                           "prompt_tokens_per_s": 250.5, "ttft_ms": 345.678, "new_tokens": 5.0, "tokens_per_s": 12.25}


@pytest.mark.parametrize("mode, match", [
    ("exit", r"exited with status 1: ERROR: Failed to create the dialog"),
    ("errline", r"reported an error: ERROR: QnnGenAiTransformer: failed to read model bin"),
    ("noend", r"without \[END\]"),
    ("hang", r"timed out after 2 s"),
])
def test_t2t_faults_are_clear_errors(t2t_files, monkeypatch, mode, match):
    monkeypatch.setenv("STANDIN_GENIE_MODE", mode)
    t0 = time.perf_counter()
    with pytest.raises(BackendError, match=match) as err:
        genie.run_t2t(_argv(t2t_files), timeout=2, profile=t2t_files / "prof.json")
    assert "\n" not in str(err.value) and time.perf_counter() - t0 < 20


def test_t2t_tool_refuses_existing_profile_and_bad_embedding_size(t2t_files):
    argv = _argv(t2t_files)
    (t2t_files / "prof.json").write_text("{}")  # the tool itself refuses it too
    with pytest.raises(BackendError, match="already exists"):
        genie.run_t2t(argv, timeout=30)
    (t2t_files / "e.raw").write_bytes(b"\0" * 12)
    with pytest.raises(BackendError, match="not a multiple"):
        genie.run_t2t(argv[:-2], timeout=30)


# -- genie_cpu ---------------------------------------------------------------------------------------------------
def fake_sdk(root: Path, *, composer=True, t2t=True, android=False) -> Path:
    for arch in ["x86_64-linux-clang"] + (["aarch64-android"] if android else []):
        (root / "bin" / arch).mkdir(parents=True, exist_ok=True)
        (root / "lib" / arch).mkdir(parents=True, exist_ok=True)
        if t2t:
            (root / "bin" / arch / "genie-t2t-run").symlink_to(STANDINS / "genie-t2t-run")
        if android:
            for lib in ("libGenie.so", "libQnnGenAiTransformer.so"):
                (root / "lib" / arch / lib).write_bytes(b"\x7fELF stand-in")
    if composer:
        (root / "bin" / "x86_64-linux-clang" / "qnn-genai-transformer-composer").symlink_to(
            STANDINS / "qnn-genai-transformer-composer")
    return root


def test_genie_cpu_missing_sdk_fails_before_any_work(tiny_model, tmp_path, monkeypatch):
    from vlmrun.store import ArtifactStore

    monkeypatch.delenv("QAIRT_SDK_ROOT", raising=False)
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    store = ArtifactStore(tmp_path / "cache")
    with pytest.raises(BackendError) as err:
        Pipeline.build(tiny_model, layout("genie_cpu"), store=store)
    msg = str(err.value)
    assert "qnn-genai-transformer-composer" in msg and "genie-t2t-run" in msg and "libQnnGenAiTransformer.so" in msg
    assert "QAIRT_SDK_ROOT / QNN_SDK_ROOT not set" in msg
    sdk = fake_sdk(tmp_path / "sdk", composer=False, t2t=False)
    monkeypatch.setenv("QAIRT_SDK_ROOT", str(sdk))
    with pytest.raises(BackendError, match=rf"looked in {sdk} \(\$QAIRT_SDK_ROOT\)"):
        Pipeline.build(tiny_model, layout("genie_cpu"), store=store)
    assert store.builds == []  # preflight stopped it before any export or compile


@pytest.fixture()
def cpu_env(tmp_path, monkeypatch):
    sdk = fake_sdk(tmp_path / "sdk")
    monkeypatch.setenv("QAIRT_SDK_ROOT", str(sdk))
    monkeypatch.setenv("STANDIN_GENIE_LOG", str(tmp_path / "t2t.json"))
    monkeypatch.setenv("STANDIN_COMPOSER_LOG", str(tmp_path / "composer.json"))
    return tmp_path


def test_genie_cpu_end_to_end_through_standins(cpu_env, tiny_model, store, ref_gen, image_path, monkeypatch):
    text = "a red square"
    monkeypatch.setenv("STANDIN_GENIE_TEXT", text)
    pipe = Pipeline.build(tiny_model, layout("genie_cpu", quantize="z8", context_length=256), store=store, rebuild=True)
    handle = pipe.handles["decoder"]
    assert handle.mode == "t2t" and handle.context_length == 256
    composer = json.loads((cpu_env / "composer.json").read_text())
    assert composer["argv"][-2:] == ["--quantize", "Z8"] and composer["config"]["model_type"] == "qwen2"
    assert handle.artifact.manifest["quantize"] == "z8"
    # LUT row t == the model's embedding row t
    from safetensors import safe_open

    lut = np.fromfile(handle.artifact.file("embed_lut_f32.raw"), dtype=np.float32).reshape(tiny_model.vocab_size, -1)
    for f in tiny_model.path.glob("*.safetensors"):
        with safe_open(str(f), framework="numpy") as st:
            key = next((k for k in st.keys() if k.endswith("language_model.embed_tokens.weight")), None)
            if key:
                table = st.get_tensor(key)
    for t in (0, 1, 57, tiny_model.vocab_size - 1):
        assert np.array_equal(lut[t], table[t])
    gen = pipe.generate(image_path, PROMPT, GenerationSettings(max_new_tokens=8))
    out = "".join(gen)
    assert out == text and gen.text == text
    seen = json.loads((cpu_env / "t2t.json").read_text())
    emb = np.asarray(seen["embeddings"], np.float32).reshape(-1, tiny_model.hidden_size)
    assert np.array_equal(emb, ref_gen.tensors["inputs_embeds"][0])
    argv = seen["argv"]
    assert argv[argv.index("--embedding_query_output_type") + 1] == "text" and "-t" in argv and "-p" not in argv
    cfg = seen["config"]
    assert cfg["engine"]["backend"]["type"] == "QnnGenAiTransformer" and cfg["max-num-tokens"] == 8
    assert cfg["context"]["size"] == 256 and cfg["context"]["n-embd"] == tiny_model.hidden_size
    assert handle.last_timings["ttft_ms"] == 345.678 and handle.last_timings["tokens_per_s"] == 12.25
    assert handle.last_timings["prompt_tokens"] == emb.shape[0]


def test_genie_cpu_t2t_fault_reaches_the_user(cpu_env, tiny_model, store, image_path, monkeypatch):
    pipe = Pipeline.build(tiny_model, layout("genie_cpu", context_length=256, timeout=3), store=store)
    monkeypatch.setenv("STANDIN_GENIE_MODE", "hang")
    with pytest.raises(BackendError, match="timed out after 3 s"):
        pipe.generate(image_path, PROMPT, GenerationSettings(max_new_tokens=4)).run()


def test_genie_cpu_composer_failure(cpu_env, tiny_model, store, monkeypatch):
    monkeypatch.setenv("STANDIN_COMPOSER_MODE", "fail")
    with pytest.raises(BackendError, match=r"composer failed \(exit 1\): ERROR: unsupported architecture"):
        Pipeline.build(tiny_model, layout("genie_cpu", quantize="q4"), store=store)


def test_genie_cpu_over_adb(tmp_path, tiny_model, store, image_path, monkeypatch):
    sdk = fake_sdk(tmp_path / "sdk", android=True)
    monkeypatch.setenv("QAIRT_SDK_ROOT", str(sdk))
    monkeypatch.setenv("VLMRUN_ADB", str(STANDINS / "adb"))
    monkeypatch.setenv("STANDIN_ADB_ROOT", str(tmp_path / "device"))
    monkeypatch.setenv("STANDIN_GENIE_TEXT", "on the phone")
    pipe = Pipeline.build(tiny_model, layout("genie_cpu", target="android", context_length=256), store=store)
    gen = pipe.generate(image_path, PROMPT, GenerationSettings(max_new_tokens=6)).run()
    assert gen.text == "on the phone"
    remote = tmp_path / "device" / "data/local/tmp/vlmrun/genie"
    assert (remote / "model.bin").is_file() and (remote / "embed_lut_f32.raw").is_file()
    assert pipe.handles["decoder"].last_timings["ttft_ms"] == 345.678


def test_compile_cli_quantize(cpu_env):
    from conftest import run_cli

    res = run_cli(["compile", "--backend", "genie_cpu", "--stage", "decoder", "--quantize", "q4", "--image-size",
                   "256", "--json"], cpu_env / "cache",
                  {"QAIRT_SDK_ROOT": os.environ["QAIRT_SDK_ROOT"], "STANDIN_COMPOSER_LOG": str(cpu_env / "c.json")})
    assert res.returncode == 0, res.stderr
    arts = json.loads(res.stdout)["artifacts"]
    assert arts[0]["quantize"] == "q4" and "model.bin" in arts[0]["files"]
    assert json.loads((cpu_env / "c.json").read_text())["argv"][-2:] == ["--quantize", "Q4"]
