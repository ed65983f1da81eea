"""The reference layout (ONNX Runtime) reproduces torch eager FastVLM exactly enough to be the yardstick."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import cosine, run_cli
from vlmrun import GenerationSettings

N_TOKENS = 20


@pytest.fixture(scope="module")
def torch_model(tiny_model):
    return tiny_model.load_torch()


@pytest.fixture(scope="module")
def prepared(ref_pipe, image_path):
    return ref_pipe.prepare(image_path, "What is in the picture?")


def torch_greedy(torch_model, prepared, n=N_TOKENS):
    import torch

    ids = torch.from_numpy(prepared.input_ids)
    with torch.no_grad():
        out = torch_model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            pixel_values=torch.from_numpy(prepared.pixel_values),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
    return out[0, ids.shape[1] :].tolist()


def test_greedy_tokens_equal_torch_eager(ref_pipe, torch_model, prepared, image_path):
    expected = torch_greedy(torch_model, prepared)
    gen = ref_pipe.generate(image_path, "What is in the picture?",
                            GenerationSettings(max_new_tokens=N_TOKENS, ignore_eos=True)).run()
    assert len(expected) == N_TOKENS
    assert gen.token_ids == expected
    assert len(set(expected)) > 1, "the tiny model should not emit one token over and over"
    assert gen.timings["new_tokens"] == N_TOKENS and gen.timings["ttft_ms"] > 0


def test_each_stage_matches_torch(ref_pipe, torch_model, prepared):
    import torch

    from vlmrun.torch_stages import embed_tokens, project, vision_features

    with torch.no_grad():
        pv = torch.from_numpy(prepared.pixel_values)
        feats_t = vision_features(torch_model, pv)
        embeds_img_t = project(torch_model, feats_t)
        text_t = embed_tokens(torch_model, torch.from_numpy(prepared.input_ids))
        full_t = torch_model(input_ids=torch.from_numpy(prepared.input_ids),
                             pixel_values=pv).logits
    feats = ref_pipe.run_stage("vision", {"pixel_values": prepared.pixel_values})["image_features"]
    img = ref_pipe.run_stage("projector", {"image_features": feats})["image_embeds"]
    txt = ref_pipe.run_stage("embed", {"input_ids": prepared.input_ids})["inputs_embeds"]
    spliced = ref_pipe.embed_prompt(prepared)
    logits = ref_pipe.run_stage("decoder", {"inputs_embeds": spliced})["logits"]
    pairs = {
        "image_features": (feats, feats_t),
        "image_embeds": (img, embeds_img_t),
        "text_embeds": (txt, text_t),
        "logits": (logits, full_t),
    }
    for name, (ours, theirs) in pairs.items():
        theirs = theirs.numpy()
        assert ours.shape == theirs.shape, name
        assert cosine(ours, theirs) >= 0.9999, name
        assert np.abs(ours - theirs).max() < 1e-3 * max(1.0, np.abs(theirs).max()), name
    # the diff is meaningful only if the features carry signal (timm's default init gives ~1e-26)
    assert 0.05 < float(feats.std()) < 10
    assert np.isfinite(img).all() and float(img.std(axis=1).mean()) > 0.05  # image tokens differ from each other


def test_image_is_spliced_at_the_placeholder(ref_pipe, prepared, tiny_model):
    ids = prepared.input_ids[0]
    n = tiny_model.image_tokens
    assert (ids[prepared.image_start : prepared.image_start + n] == tiny_model.image_token_id).all()
    assert prepared.image_start > 0  # after the system turn and "user\n", not at position 0
    assert prepared.prompt_text.startswith("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n")
    assert prepared.prompt_text.endswith("What is in the picture?<|im_end|>\n<|im_start|>assistant\n")


def test_seeded_sampling_is_reproducible(ref_pipe, image_path):
    from vlmrun.sampling import SamplingSettings

    def sample(seed):
        s = GenerationSettings(max_new_tokens=12, ignore_eos=True,
                               sampling=SamplingSettings(temperature=3.0, top_k=50, top_p=0.95, seed=seed))
        # (the trained model is sure of its answers: at 1.5 every seed samples the same tokens)
        return ref_pipe.generate(image_path, "Hi", s).run().token_ids

    a, b, c = sample(1), sample(1), sample(2)
    assert a == b and len(a) == 12
    assert a != c


def test_apple_llava_qwen2_layout_gives_the_same_tokens(ref_pipe, tiny_model, store, image_path, tmp_path):
    from vlmrun import Pipeline
    from vlmrun.checkpoints import save_as_apple

    apple = save_as_apple(tiny_model.path, tmp_path / "apple-fastvlm")
    cfg = (apple / "config.json").read_text()
    assert '"llava_qwen2"' in cfg and "mm_projector" in (apple / "model.safetensors").read_bytes()[:20000].decode(
        "latin1")
    pipe = Pipeline.build(apple, "reference", store=store)
    assert pipe.model.source_layout == "llava_qwen2"
    settings = GenerationSettings(max_new_tokens=N_TOKENS, ignore_eos=True)
    ours = pipe.generate(image_path, "What is in the picture?", settings).run().token_ids
    ref = ref_pipe.generate(image_path, "What is in the picture?", settings).run().token_ids
    assert ours == ref and len(ours) == N_TOKENS


def test_embedding_luts(ref_pipe, tiny_model, store):
    from safetensors.numpy import load_file

    from vlmrun.pipeline import export_artifact
    from vlmrun.stages import ExportForm

    art = export_artifact(ref_pipe.registry, store, tiny_model, ExportForm.of("embed", "embed/lut"))
    weights = load_file(str(tiny_model.path / "model.safetensors"))
    table = next(v for k, v in weights.items() if k.endswith("language_model.embed_tokens.weight"))
    f32 = np.load(art.file("embed_lut_f32.npy"))
    q = np.load(art.file("embed_lut_int8.npy"))
    scale = art.manifest["int8_scale"]
    assert f32.shape == table.shape == (tiny_model.vocab_size, tiny_model.hidden_size)
    assert np.array_equal(f32, table)  # row t is token t's embedding
    assert q.dtype == np.int8 and np.abs(q).max() == 127
    assert np.isclose(scale, np.abs(table).max() / 127)
    assert np.abs(q.astype(np.float32) * scale - table).max() <= scale / 2 + 1e-7
    assert np.count_nonzero(q) > 0.9 * np.count_nonzero(table)  # not rounded to zero (the seed notes' bug)


def test_cpu_threads_reach_the_sessions_and_a_bad_value_is_one_line(ref_pipe, image_path, cache_dir, tmp_path,
                                                                    monkeypatch):
    """``VLMRUN_CPU_THREADS`` sets the intra-op threads of the CPU sessions both plugins open (unset: onnxruntime's
    own default, 0); the answer is the same at 1 and 2 threads; a value that is not a number of threads is a usage
    error, exit 2."""
    import onnx
    from onnx import TensorProto, helper
    from vlmrun_ort_reference.engine import Session
    from vlmrun_qnn_htp.calibration import cpu_session

    graph = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])]), opset_imports=[helper.make_opsetid("", 17)]),
        str(graph))

    def threads() -> tuple[int, int]:  # what the reference's session and the calibration's session were given
        return (Session(graph).sess.get_session_options().intra_op_num_threads,
                cpu_session(graph).get_session_options().intra_op_num_threads)

    monkeypatch.delenv("VLMRUN_CPU_THREADS", raising=False)
    assert threads() == (0, 0)
    answers = {}
    for n in ("1", "2"):
        monkeypatch.setenv("VLMRUN_CPU_THREADS", n)
        assert threads() == (int(n), int(n))
        res = run_cli(["--image", str(image_path), "--prompt", "Describe the image."], cache_dir,
                      {"VLMRUN_CPU_THREADS": n})
        assert res.returncode == 0, res.stderr[-2000:]
        answers[n] = res.stdout
    assert answers["1"] == answers["2"] and answers["1"].strip()
    res = run_cli(["--image", str(image_path), "--prompt", "Hi."], cache_dir, {"VLMRUN_CPU_THREADS": "two"})
    assert res.returncode == 2 and res.stderr.strip() == ("vlmrun: error: VLMRUN_CPU_THREADS='two' is not a number of"
                                                          " threads (1, 2, ...); unset it for the runtime's default")
