"""Genie (issue 4): generated configs against the real libGenie, Genie on QnnHtp (emulator) vs qnn_htp's host loop
over the same binaries, and the genie_cpu plugin end to end through stand-ins of genie-t2t-run and the composer."""

from __future__ import annotations

import copy
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from vlmrun import GenerationSettings, Pipeline
from vlmrun_qualcomm import genie, genie_binding, genie_config, genie_t2t
from vlmrun.errors import BackendError, InputError, UsageError
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

    return genie_binding.GenieLibrary(libgenie_path())


@pytest.fixture(scope="session")
def ref_gen(ref_pipe, image_path):
    return ref_pipe.generate(image_path, PROMPT, GenerationSettings(max_new_tokens=N_STEPS, ignore_eos=True)).run()


# -- configs ----------------------------------------------------------------------------------------------------
def _facts_list(tiny_model):
    return [genie_config.GenieModel.from_model(tiny_model), genie_config.GenieModel.from_config(FULL_CONFIG),
            genie_config.GenieModel.from_config(MID_CONFIG)]


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
    cfg = genie_config.dialog_config(full, "QnnHtp", tokenizer="tokenizer.json", context_size=1024, ctx_bins=["a.bin"])
    d = cfg["dialog"]
    assert d["context"]["n-vocab"] == 152000 and d["context"]["n-embd"] == 896
    assert d["engine"]["backend"]["QnnHtp"]["kv-dim"] == 64
    assert d["engine"]["model"]["positional-encoding"] == {"type": "rope", "rope-dim": 32, "rope-theta": 1e6}
    cpu = genie_config.dialog_config(full, "QnnGenAiTransformer", tokenizer="t.json", context_size=512,
                                     model_bin="m.bin",
                                     sampling=SamplingSettings(temperature=0.7, top_k=40, top_p=0.9, seed=5))["dialog"]
    be = cpu["engine"]["backend"]["QnnGenAiTransformer"]
    assert (be["n-layer"], be["n-embd"], be["n-heads"], be["n-kv-heads"], be["model-input"]) == (24, 896, 14, 2, "embeddings")
    assert cpu["sampler"] == {"version": 1, "seed": 5, "temp": 0.7, "top-k": 40, "top-p": 0.9, "greedy": False}
    with pytest.raises(UsageError, match="context size"):
        genie_config.dialog_config(full, "QnnHtp", tokenizer="t", context_size=10**6, ctx_bins=["a"])


def test_every_generated_config_is_accepted_by_libgenie(libgenie, tiny_model):
    n = 0
    for facts in _facts_list(tiny_model):
        for sampling in (SamplingSettings(), SamplingSettings(temperature=0.8, top_k=20, top_p=0.95, seed=3)):
            for ctx in (128, 1024):
                libgenie.validate_config(genie_config.dialog_config(
                    facts, "QnnHtp", tokenizer="tokenizer.json", context_size=ctx, sampling=sampling,
                    ctx_bins=["decoder_ar16_ctx_qnn.bin", "decoder_ar1_ctx_qnn.bin"]))
                libgenie.validate_config(genie_config.dialog_config(
                    facts, "QnnGenAiTransformer", tokenizer="tokenizer.json", context_size=ctx, sampling=sampling,
                    model_bin="model.bin"))
                n += 2
    assert n == 24


def test_broken_configs_are_rejected_by_libgenie(libgenie, tiny_model):
    good = genie_config.dialog_config(genie_config.GenieModel.from_model(tiny_model), "QnnHtp", tokenizer="t.json",
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
def fake_libs(d: Path, skip=()) -> Path:
    """A directory with the four Genie CPU libraries (dummies the stand-in looks up in LD_LIBRARY_PATH)."""
    from vlmrun_qualcomm.sdk import GENIE_CPU_LIBS

    d.mkdir(parents=True, exist_ok=True)
    for lib in GENIE_CPU_LIBS:
        if lib not in skip:
            (d / lib).write_bytes(b"\x7fELF stand-in")
    return d


def test_the_error_line_is_never_the_encoders_kpis_noise():
    """Genie's pipeline logs "<encoder> does not support kpis method" as an [ ERROR ] on every run; the line that
    says why a call failed is another one, or none (then the last line)."""
    noise = ("[ ERROR ]  ImageEncoder-Encoder does not support kpis method\n[ INFO ]  pipeline ready\n"
             "[ ERROR ]  lut-Encoder does not support kpis method\n")
    assert genie.last_error_line(noise) == "[ INFO ]  pipeline ready"
    missing = "Failed to open embedding_weights.raw"
    assert genie.last_error_line(noise + missing + "\n") == missing
    assert genie.last_error_line("Failed to open x.bin\n" + noise) == "Failed to open x.bin"


def test_t2t_flag_rules(tmp_path):
    with pytest.raises(UsageError, match="-t .* needs -e"):
        genie_t2t.t2t_argv("g", "c.json", prompt="hi", lut="l.raw")
    with pytest.raises(UsageError, match="excludes"):
        genie_t2t.t2t_argv("g", "c.json", prompt="hi", embedding_file="e.raw")
    (tmp_path / "p.json").write_text("{}")
    with pytest.raises(UsageError, match="already exists"):
        genie_t2t.t2t_argv("g", "c.json", embedding_file="e.raw", profile=str(tmp_path / "p.json"))
    assert genie_t2t.t2t_argv("g", "c.json", embedding_file="e.raw", lut="l.raw", output_type="text",
                              profile="x.json") == ["g", "-c", "c.json", "-e", "e.raw", "-t", "l.raw",
                                                    "--embedding_query_output_type", "text", "--profile", "x.json"]


@pytest.fixture()
def t2t_files(tmp_path, tiny_model):
    facts = genie_config.GenieModel.from_model(tiny_model)
    cfg = genie_config.dialog_config(facts, "QnnGenAiTransformer", tokenizer="t.json", context_size=128,
                                     model_bin="m.bin")
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    genie.write_embeddings(tmp_path / "e.raw", np.ones((1, 3, facts.hidden), np.float32))
    genie.write_lut(tmp_path / "l.raw", np.zeros((facts.vocab, facts.hidden), np.float32))
    fake_libs(tmp_path / "lib")
    return tmp_path


def _argv(d: Path):
    return genie_t2t.t2t_argv(str(STANDINS / "genie-t2t-run"), str(d / "c.json"), embedding_file=str(d / "e.raw"),
                              lut=str(d / "l.raw"), output_type="text", profile=str(d / "prof.json"))


def _run(d: Path, argv=None, **kw):
    kw.setdefault("timeout", 30)
    return genie_t2t.run_t2t(argv or _argv(d), env={"LD_LIBRARY_PATH": str(d / "lib")}, **kw)


def test_t2t_parses_text_and_profile(t2t_files, monkeypatch):
    monkeypatch.setenv("STANDIN_GENIE_TEXT", "two cats on a mat")
    res = _run(t2t_files, profile=t2t_files / "prof.json")
    assert res.text == "two cats on a mat"
    assert res.timings == {"genie_init_ms": 120.0, "genie_query_ms": 900.0, "prompt_tokens": 3.0,
                           "prompt_tokens_per_s": 250.5, "ttft_ms": 345.678, "new_tokens": 5.0, "tokens_per_s": 12.25}


@pytest.mark.parametrize("mode, match", [
    ("exit", r"exited with status 1: Failed to create the dialog\.$"),
    ("errline", r"reported an error: ERROR: QnnGenAiTransformer: failed to read model bin"),
    ("noend", r"without \[END\]"),
    ("hang", r"timed out after 2 s"),
])
def test_t2t_faults_are_clear_errors(t2t_files, monkeypatch, mode, match):
    monkeypatch.setenv("STANDIN_GENIE_MODE", mode)
    t0 = time.perf_counter()
    with pytest.raises(BackendError, match=match) as err:
        _run(t2t_files, timeout=2, profile=t2t_files / "prof.json")
    assert "\n" not in str(err.value) and time.perf_counter() - t0 < 20


def test_t2t_tool_refuses_existing_profile_and_bad_embedding_size(t2t_files):
    argv = _argv(t2t_files)
    (t2t_files / "prof.json").write_text("{}")  # the tool itself refuses it too
    with pytest.raises(BackendError, match="already exists"):
        _run(t2t_files, argv)
    (t2t_files / "e.raw").write_bytes(b"\0" * 12)
    with pytest.raises(BackendError, match="not a multiple"):
        _run(t2t_files, argv[:-2])


# -- issue 11: what a real genie-t2t-run does ---------------------------------------------------------------------
@pytest.mark.parametrize("text", [
    "Error: the image shows a warning sign",
    "Failed to find a cat. Exception handling is hard.\nERROR 404 is a page",
])
def test_generated_text_that_looks_like_an_error_is_text(t2t_files, monkeypatch, text):
    """Errors come from stderr and the exit status; the model's own words are never scanned."""
    monkeypatch.setenv("STANDIN_GENIE_TEXT", text)
    assert _run(t2t_files).text == text
    out = f"Using libGenie.so version 1.21.0\n\n[BEGIN]: {text}[END]\n\n"
    assert genie_t2t.parse_t2t_output(out, "", 0) == text
    with pytest.raises(BackendError, match=r"exited with status 1: Failed to create the dialog\.$"):
        genie_t2t.parse_t2t_output(out, "Failed to create the dialog.\n", 1)
    assert genie_t2t.parse_t2t_output(out, "Failed to free the dialog.\n", 0) == text  # clean-up noise is not a fault


def test_t2t_missing_genie_cpu_library_fails_like_the_real_tool(t2t_files):
    for missing in ("libQnnGenAiTransformerModel.so", "libQnnGenAiTransformerCpuOpPkg.so"):
        fake_libs(t2t_files / f"lib-{missing}", skip=(missing,))
        with pytest.raises(BackendError, match=r"exited with status 1: Failed to create the dialog\.$"):
            genie_t2t.run_t2t(_argv(t2t_files), timeout=30, env={"LD_LIBRARY_PATH": str(t2t_files / f"lib-{missing}")})
    # on a phone genie-t2t-run and libGenie.so also link the NDK's libc++_shared.so
    with pytest.raises(BackendError, match=r'CANNOT LINK EXECUTABLE .*"libc\+\+_shared\.so" not found'):
        genie_t2t.run_t2t(_argv(t2t_files), timeout=30, env={"LD_LIBRARY_PATH": str(t2t_files / "lib"),
                                                             "STANDIN_ON_DEVICE": "1"})


def test_context_limit_is_checked_first_and_its_exit_is_one_line(t2t_files, tiny_model, monkeypatch):
    with pytest.raises(InputError) as err:
        genie.check_context(120, 16, 128)
    assert str(err.value) == ("the prompt (120 tokens) plus 16 new tokens do not fit the Genie context of 128 tokens;"
                              " lower --max-new-tokens to 8 or raise the decoder's context_length")
    genie.check_context(120, 8, 128)
    # the real tool: prompt 126 rows, context 128: token 3 needs 126 + 2 positions > 128 -> exit 1
    facts = genie_config.GenieModel.from_model(tiny_model)
    genie.write_embeddings(t2t_files / "e.raw", np.ones((1, 126, facts.hidden), np.float32))
    monkeypatch.setenv("STANDIN_GENIE_TEXT", "one two three four")
    with pytest.raises(genie.ContextLimitError) as err:
        _run(t2t_files)
    assert "\n" not in str(err.value) and "context limit" in str(err.value)
    monkeypatch.setenv("STANDIN_GENIE_TEXT", "one two")  # 126 + 2 - 1 <= 128: fits
    assert _run(t2t_files).text == "one two"
    # libGenie reports the same condition as a status; both paths raise ContextLimitError
    with pytest.raises(genie.ContextLimitError, match="GENIE_STATUS_WARNING_CONTEXT_EXCEEDED"):
        genie_binding.check_query_status(None, 3, "GenieDialog_embeddingTokenQuery")


# -- genie_cpu ---------------------------------------------------------------------------------------------------
NDK_ENVS = ("ANDROID_NDK_ROOT", "ANDROID_NDK_HOME", "ANDROID_NDK")


def fake_sdk(root: Path, *, composer=True, t2t=True, android=False, libs=True, skip=(),
             version="2.42.0.251225") -> Path:
    """A QAIRT SDK layout whose tools are the stand-ins: sdk.yaml, lib/python/qti/aisw (what the Python tools
    import), genie-t2t-run and the four Genie CPU libraries per architecture, the composer."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "sdk.yaml").write_text(f"name: qairt\nversion: {version}\n")
    for pkg in ("qti", "qti/aisw", "qti/aisw/genai", "qti/aisw/converters"):
        (root / "lib" / "python" / pkg).mkdir(parents=True, exist_ok=True)
        (root / "lib" / "python" / pkg / "__init__.py").write_text("")
    for arch in ["x86_64-linux-clang"] + (["aarch64-android"] if android else []):
        (root / "bin" / arch).mkdir(parents=True, exist_ok=True)
        (root / "lib" / arch).mkdir(parents=True, exist_ok=True)
        if t2t:
            (root / "bin" / arch / "genie-t2t-run").symlink_to(STANDINS / "genie-t2t-run")
        if libs:
            fake_libs(root / "lib" / arch, skip)
    if composer:
        (root / "bin" / "x86_64-linux-clang" / "qnn-genai-transformer-composer").symlink_to(
            STANDINS / "qnn-genai-transformer-composer")
    return root


def fake_ndk(root: Path) -> Path:
    from vlmrun_qualcomm.sdk import NDK_LIBCXX

    (root / NDK_LIBCXX).parent.mkdir(parents=True, exist_ok=True)
    (root / NDK_LIBCXX).write_bytes(b"\x7fELF stand-in libc++_shared")
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
    # Genie opens the model library and the op package too: a missing one is named before any work
    sdk2 = fake_sdk(tmp_path / "sdk2", skip=("libQnnGenAiTransformerModel.so",))
    monkeypatch.setenv("QAIRT_SDK_ROOT", str(sdk2))
    with pytest.raises(BackendError, match=r"needs the QAIRT SDK's libQnnGenAiTransformerModel\.so \(x86_64"):
        Pipeline.build(tiny_model, layout("genie_cpu", runner="t2t"), store=store)
    assert store.builds == []  # preflight stopped it before any export or compile


@pytest.fixture()
def cpu_env(tmp_path, monkeypatch):
    sdk = fake_sdk(tmp_path / "sdk")
    monkeypatch.setenv("QAIRT_SDK_ROOT", str(sdk))
    monkeypatch.delenv("QNN_SDK_ROOT", raising=False)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setenv("STANDIN_GENIE_LOG", str(tmp_path / "t2t.json"))
    monkeypatch.setenv("STANDIN_COMPOSER_LOG", str(tmp_path / "composer.json"))
    return tmp_path


def test_genie_cpu_end_to_end_through_standins(cpu_env, tiny_model, store, ref_gen, image_path, monkeypatch):
    text = "a red square"
    monkeypatch.setenv("STANDIN_GENIE_TEXT", text)
    pipe = Pipeline.build(tiny_model, layout("genie_cpu", quantize="z8", context_length=256, runner="t2t"),
                          store=store, rebuild=True)
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
    assert seen["ld_library_path"].split(os.pathsep)[0] == str(cpu_env / "sdk" / "lib" / "x86_64-linux-clang")
    cfg = seen["config"]
    assert cfg["engine"]["backend"]["type"] == "QnnGenAiTransformer" and cfg["max-num-tokens"] == 8
    assert cfg["context"]["size"] == 256 and cfg["context"]["n-embd"] == tiny_model.hidden_size
    assert handle.last_timings["ttft_ms"] == 345.678 and handle.last_timings["tokens_per_s"] == 12.25
    assert handle.last_timings["prompt_tokens"] == emb.shape[0]


def test_composer_gets_config_file_and_sdk_environment(cpu_env, tiny_model, store):
    pipe = Pipeline.build(tiny_model, layout("genie_cpu", context_length=192, runner="t2t"), store=store,
                          rebuild=True)
    log = json.loads((cpu_env / "composer.json").read_text())
    argv, sdk = log["argv"], cpu_env / "sdk"
    assert argv[argv.index("--config_file") + 1].endswith("composer_config.json")
    assert "--dump_lut" in argv and "--export_tokenizer_json" in argv and "--quantize" not in argv
    assert log["env"]["QNN_SDK_ROOT"] == str(sdk)
    assert log["env"]["PYTHONPATH"].split(os.pathsep)[0] == str(sdk / "lib" / "python")
    arch, tc = log["config_file"], tiny_model.text_config
    assert (arch["size.vocabulary"], arch["size.embedding"], arch["size.feedforward"], arch["size.context"]) == (
        tc["vocab_size"], tc["hidden_size"], tc["intermediate_size"], 192)
    assert (arch["architecture.num_decoders"], arch["architecture.num_heads"], arch["architecture.num_kv_heads"]) == (
        tc["num_hidden_layers"], tc["num_attention_heads"], tc["num_key_value_heads"])
    assert arch["operation.rope_scaling"] == tiny_model.rope_theta
    assert arch["operation.rope_num_rotations"] == tiny_model.head_dim
    assert arch["tensor.attention_q_bias"] == {"name": "self_attn.q_proj.bias"}  # Qwen2's q/k/v biases
    art = pipe.handles["decoder"].artifact
    assert art.manifest["lut"]["from"] == "--dump_lut" and art.manifest["composer_argv"][0] == (
        "qnn-genai-transformer-composer")
    assert (art.path / "tokenizer.json").read_bytes() == (tiny_model.path / "tokenizer.json").read_bytes()


def test_composer_standin_enforces_the_sdk_environment_and_config_file(cpu_env, tiny_model, tmp_path):
    import subprocess

    from vlmrun_genie_cpu.compose import write_qwen2_dir
    from vlmrun_qualcomm.sdk import Sdk

    qwen, _ = write_qwen2_dir(tiny_model, tmp_path / "qwen2")
    exe = STANDINS / "qnn-genai-transformer-composer"
    base = ["--model", str(qwen), "--outfile", str(tmp_path / "m.bin")]
    bare = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "QNN_SDK_ROOT")}
    res = subprocess.run([str(exe), *base], env=bare, capture_output=True, text=True)
    assert res.returncode == 1 and "No module named 'qti'" in res.stderr
    sdk_env = Sdk.find(cpu_env / "sdk").env()
    res = subprocess.run([str(exe), *base], env=sdk_env, capture_output=True, text=True)
    assert res.returncode == 1 and "describe it with --config_file" in res.stderr


def test_genie_cpu_context_limit_before_start_and_after(cpu_env, tiny_model, store, image_path, monkeypatch):
    pipe = Pipeline.build(tiny_model, layout("genie_cpu", context_length=256, runner="t2t"), store=store)
    handle = pipe.handles["decoder"]
    prepared = pipe.generate(image_path, PROMPT, GenerationSettings(max_new_tokens=2)).run()
    emb = prepared.tensors["inputs_embeds"]
    P = emb.shape[1]
    (cpu_env / "t2t.json").unlink()
    too_many = DecodeRequest(emb, 256 - P + 1, Sampler(), frozenset(), pipe.embed_tokens, 256)
    with pytest.raises(InputError, match=rf"the prompt \({P} tokens\) plus {257 - P} new tokens do not fit the Genie"
                                         r" context of 256 tokens; lower --max-new-tokens to"):
        list(handle.generate(too_many))
    assert not (cpu_env / "t2t.json").exists()  # genie-t2t-run never started
    # Genie reaching the context anyway (its count is its own): genie-t2t-run exits 1, the user gets one line
    real_config = handle.config
    monkeypatch.setattr(handle, "config", lambda req, mb, tok: {
        "dialog": {**real_config(req, mb, tok)["dialog"],
                   "context": {**real_config(req, mb, tok)["dialog"]["context"], "size": P + 1}}})
    monkeypatch.setenv("STANDIN_GENIE_TEXT", "one two three four five")
    with pytest.raises(genie.ContextLimitError) as err:
        pipe.generate(image_path, PROMPT, GenerationSettings(max_new_tokens=5)).run()
    assert str(err.value) == (f"Genie (t2t) stopped at its context limit of 256 tokens (prompt {P} tokens, up to 5"
                              " new): raise the decoder's context_length or lower --max-new-tokens")


def test_genie_cpu_generated_error_text_reaches_the_user_as_text(cpu_env, tiny_model, store, image_path,
                                                                 monkeypatch):
    text = "Error: Failed to see anything. Exception: it is dark"
    monkeypatch.setenv("STANDIN_GENIE_TEXT", text)
    pipe = Pipeline.build(tiny_model, layout("genie_cpu", context_length=256, runner="t2t"), store=store)
    gen = pipe.generate(image_path, PROMPT, GenerationSettings(max_new_tokens=100)).run()
    assert gen.text == text and gen.stopped_by == "max_new_tokens"


def test_genie_cpu_t2t_fault_reaches_the_user(cpu_env, tiny_model, store, image_path, monkeypatch):
    pipe = Pipeline.build(tiny_model, layout("genie_cpu", context_length=256, timeout=3, runner="t2t"), store=store)
    monkeypatch.setenv("STANDIN_GENIE_MODE", "hang")
    with pytest.raises(BackendError, match="timed out after 3 s"):
        pipe.generate(image_path, PROMPT, GenerationSettings(max_new_tokens=4)).run()


def _pids_running(fragment: str) -> list[int]:
    """Processes (not zombies) whose command line holds ``fragment``."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and fragment in (d / "cmdline").read_bytes().decode(errors="replace") \
                    and ") Z " not in (d / "stat").read_text():
                pids.append(int(d.name))
        except OSError:
            pass
    return pids


def test_a_terminated_vlmrun_takes_its_hung_tool_with_it(cpu_env, cache_dir, image_path, monkeypatch):
    """SIGTERM (a supervisor, `timeout`, a CI runner) to a vlmrun whose tool hangs: one line, exit 143, and the
    tool's process group goes too. Before, the tool, in a session of its own, outlived vlmrun."""
    import signal
    import subprocess

    from conftest import VLMRUN

    monkeypatch.setenv("STANDIN_GENIE_MODE", "hang")
    env = dict(os.environ, VLMRUN_CACHE_DIR=str(cache_dir))
    proc = subprocess.Popen([*VLMRUN, "--decoder", "genie_cpu", "-o", "decoder.context_length=256",
                             "-o", "decoder.runner=t2t", "--image", str(image_path), "--prompt", PROMPT,
                             "--max-new-tokens", "4"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    tool = str(cpu_env / "sdk")  # the stand-in genie-t2t-run runs from this SDK folder
    deadline = time.monotonic() + 300
    while not _pids_running(tool):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1]
        time.sleep(0.2)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and err.strip().splitlines()[-1] == "vlmrun: terminated (SIGTERM)", err
    assert "Traceback" not in err
    deadline = time.monotonic() + 10
    while _pids_running(tool) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _pids_running(tool) == []


def test_genie_cpu_composer_failure(cpu_env, tiny_model, store, monkeypatch):
    monkeypatch.setenv("STANDIN_COMPOSER_MODE", "fail")
    with pytest.raises(BackendError, match=r"composer failed \(exit 1\): ERROR: unsupported architecture"):
        Pipeline.build(tiny_model, layout("genie_cpu", quantize="q4"), store=store)


def test_genie_cpu_over_adb(tmp_path, tiny_model, store, image_path, monkeypatch):
    from vlmrun_genie_cpu.runner import DEVICE_FILES

    sdk = fake_sdk(tmp_path / "sdk", android=True)
    for env in NDK_ENVS:
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("QAIRT_SDK_ROOT", str(sdk))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    monkeypatch.setenv("VLMRUN_ADB", str(STANDINS / "adb"))
    monkeypatch.setenv("STANDIN_ADB_ROOT", str(tmp_path / "device"))
    monkeypatch.setenv("STANDIN_ADB_LOG", str(tmp_path / "adb.log"))
    monkeypatch.setenv("STANDIN_GENIE_TEXT", "on the phone")
    lay = layout("genie_cpu", target="android", context_length=256)
    # without the NDK's libc++_shared.so genie-t2t-run cannot start on a phone: named before any work
    with pytest.raises(BackendError, match=r"libc\+\+_shared\.so \(from the Android NDK: set ANDROID_NDK_ROOT\)"
                                           r" \(aarch64-android\)"):
        Pipeline.build(tiny_model, lay, store=store)
    assert not (tmp_path / "adb.log").exists()
    monkeypatch.setenv("ANDROID_NDK_ROOT", str(fake_ndk(tmp_path / "ndk")))
    pipe = Pipeline.build(tiny_model, lay, store=store)
    gen = pipe.generate(image_path, PROMPT, GenerationSettings(max_new_tokens=6)).run()
    assert gen.text == "on the phone"
    remote = tmp_path / "device" / "data/local/tmp/vlmrun/genie"
    assert (remote / "model.bin").is_file() and (remote / "embed_lut_f32.raw").is_file()
    assert DEVICE_FILES == ("genie-t2t-run", "libGenie.so", "libQnnGenAiTransformer.so",
                            "libQnnGenAiTransformerModel.so", "libQnnGenAiTransformerCpuOpPkg.so", "libc++_shared.so")
    pushed = {Path(p).name for p in pipe.handles["decoder"].adb.pushed}
    assert set(DEVICE_FILES) <= pushed and all((remote / n).is_file() for n in DEVICE_FILES)
    assert pipe.handles["decoder"].last_timings["ttft_ms"] == 345.678
    # a missing Genie CPU library of the phone's SDK is named before any work
    sdk2 = fake_sdk(tmp_path / "sdk2", android=True, skip=("libQnnGenAiTransformerCpuOpPkg.so",))
    monkeypatch.setenv("QAIRT_SDK_ROOT", str(sdk2))
    with pytest.raises(BackendError, match=r"libQnnGenAiTransformerCpuOpPkg\.so \(aarch64-android\)"):
        Pipeline.build(tiny_model, lay, store=store)


def test_compile_cli_quantize(cpu_env):
    from conftest import run_cli

    res = run_cli(["compile", "--backend", "genie_cpu", "--stage", "decoder", "--quantize", "q4", "--image-size",
                   "256", "--json"], cpu_env / "cache",
                  {"QAIRT_SDK_ROOT": os.environ["QAIRT_SDK_ROOT"], "STANDIN_COMPOSER_LOG": str(cpu_env / "c.json")})
    assert res.returncode == 0, res.stderr
    arts = json.loads(res.stdout)["artifacts"]
    assert arts[0]["quantize"] == "q4" and "model.bin" in arts[0]["files"]
    assert json.loads((cpu_env / "c.json").read_text())["argv"][-2:] == ["--quantize", "Q4"]


# -- a hung libGenie worker says where it was ---------------------------------------------------------------------
HUNG_WORKER = """
import sys, time
from vlmrun_qualcomm.worker_protocol import Replies

def stuck_in_the_sampler_callback():
    time.sleep(120)

out = Replies()
out.write("READY")
for line in ({session} and sys.stdin or [None]):
    stuck_in_the_sampler_callback()
"""


def _stacks_file(message: str) -> str:
    path = message.rsplit("; its threads' stacks when it was killed: ", 1)[1]
    text = Path(path).read_text()
    Path(path).unlink()
    return text


def test_a_hung_worker_is_killed_with_its_stacks_saved(tmp_path):
    """Before the host kills a worker past its timeout it asks it (SIGUSR1, faulthandler) for every thread's stack;
    the timeout's one line names the file they went to: the CI hang of the Genie pipeline said only "timed out"."""
    from vlmrun_qualcomm.genie_session import WorkerSession
    from vlmrun_qualcomm.genie_worker import WorkerLines
    from vlmrun_qualcomm.worker_protocol import hung_worker_stacks

    one_shot = tmp_path / "one_shot.py"
    one_shot.write_text(HUNG_WORKER.format(session=False))
    # the deadline runs from the start: room for the worker's imports on a loaded machine before it can dump
    run = WorkerLines([sys.executable, str(one_shot)], timeout=8, what="the Genie pipeline worker",
                      env=dict(os.environ))
    t0 = time.monotonic()
    assert list(run) == [("READY", "")]
    assert run.timed_out and time.monotonic() - t0 < 20
    stacks = _stacks_file(run.hang_detail)
    assert stacks.startswith("the Genie pipeline worker: every thread's Python stack when it was killed")
    assert "in stuck_in_the_sampler_callback" in stacks and "in <module>" in stacks

    session_py = tmp_path / "session.py"
    session_py.write_text(HUNG_WORKER.format(session=True))
    session = WorkerSession([sys.executable, str(session_py)], timeout=60)  # READY within a loaded machine's start
    session.timeout = 2  # then each command's deadline
    session.send("TURN {}")
    with pytest.raises(BackendError) as err:
        list(session.events())
    message = str(err.value)
    assert message.startswith("the Genie worker timed out after 2 s (worker killed); raise --option timeout; its"
                              " threads' stacks when it was killed: ") and "\n" not in message
    assert "in stuck_in_the_sampler_callback" in _stacks_file(message) and not session.alive
    assert hung_worker_stacks("Segmentation fault\n", "w") == ""  # nothing dumped: nothing named
