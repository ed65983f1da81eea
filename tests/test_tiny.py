"""Tests for vlmrun.tiny: the random-weight FastVLM checkpoint the rest of the suite runs on."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")

from vlmrun import tiny  # noqa: E402
from vlmrun.errors import BackendError, UsageError  # noqa: E402

pytestmark = pytest.mark.slow

IMAGE_SIZE = 256
QUESTION = "What is in the picture?"
EXPECTED_PROMPT = (
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
    "<|im_start|>user\n<image>\nWhat is in the picture?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return tiny.make_tiny(tmp_path_factory.mktemp("tiny") / "model", image_size=IMAGE_SIZE, seed=0)


@pytest.fixture(scope="module")
def loaded(ckpt):
    model = transformers.FastVlmForConditionalGeneration.from_pretrained(ckpt).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(ckpt)
    processor = transformers.AutoProcessor.from_pretrained(ckpt)
    return model, tokenizer, processor


def _random_pixels(seed: int = 0, size: int = IMAGE_SIZE):
    return torch.rand((1, 3, size, size), generator=torch.Generator().manual_seed(seed))


def test_module_import_does_not_import_torch():
    code = "import sys, vlmrun.tiny; assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_format_and_config(ckpt, loaded):
    model, tokenizer, processor = loaded
    assert ckpt.is_absolute() and ckpt.name == "model"
    assert (ckpt / "model.safetensors").is_file()
    raw = json.loads((ckpt / "config.json").read_text())
    assert raw["model_type"] == "fast_vlm"
    assert raw["vision_config"]["model_type"] == "timm_wrapper"
    assert raw["vision_config"]["architecture"] == "fastvit_mci3"
    assert raw["text_config"]["model_type"] == "qwen2"

    cfg = model.config
    assert type(model).__name__ == "FastVlmForConditionalGeneration"
    assert cfg.image_token_id == tokenizer.convert_tokens_to_ids("<image>")
    assert cfg.image_seq_length == (IMAGE_SIZE // 64) ** 2 == 16
    assert cfg.vision_config.hidden_size == 256
    tc = cfg.text_config
    assert (tc.hidden_size, tc.intermediate_size, tc.num_hidden_layers) == (64, 128, 2)
    assert (tc.num_attention_heads, tc.num_key_value_heads) == (4, 2)
    assert tc.tie_word_embeddings and cfg.tie_word_embeddings
    assert tc.rope_parameters["rope_theta"] == 1e6 and tc.rms_norm_eps == 1e-6
    assert tc.vocab_size % 64 == 0 and tc.vocab_size - 64 < len(tokenizer) <= tc.vocab_size
    lm = model.model.language_model
    assert model.lm_head.weight.data_ptr() == lm.embed_tokens.weight.data_ptr()

    gen = json.loads((ckpt / "generation_config.json").read_text())
    assert gen["eos_token_id"] == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert gen["pad_token_id"] == gen["bos_token_id"] == tokenizer.convert_tokens_to_ids("<|endoftext|>")

    # the tiny FastViTHD: 5 stages of one block each, widths 8..128, attention in the last two stages
    timm_model = model.model.vision_tower.timm_model
    assert [len(s.blocks) for s in timm_model.stages] == [1, 1, 1, 1, 1]
    assert [s.blocks[0].mlp.fc2.out_channels for s in timm_model.stages] == [8, 16, 32, 64, 128]
    assert [type(s.blocks[0]).__name__ for s in timm_model.stages] == ["RepMixerBlock"] * 3 + ["AttentionBlock"] * 2
    n_params = sum(p.numel() for p in model.parameters())
    assert 300_000 < n_params < 700_000


def test_tokenizer_ids_and_chat_template(loaded):
    _, tokenizer, processor = loaded
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    # Qwen2Tokenizer rebuilds its pre-tokenizer on load: the BPE must have been trained with the same split
    from transformers.models.qwen2 import tokenization_qwen2

    assert tiny._QWEN2_PRETOKENIZE_REGEX == tokenization_qwen2.PRETOKENIZE_REGEX
    ids = tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"])
    n = len(tokenizer)
    assert 300 <= n <= 600
    assert ids == [n - 4, n - 3, n - 2, n - 1]  # appended after the BPE vocabulary, in Qwen's order
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.eos_token_id == ids[2]
    assert tokenizer.pad_token == tokenizer.bos_token == "<|endoftext|>"

    text = "The cat is sitting on a red chair."
    enc = tokenizer(text).input_ids
    assert ids[0] not in enc and len(enc) < len(text)  # merges were learned; no BOS is prepended
    assert tokenizer.decode(enc) == text
    assert tokenizer("<image>\nHi", add_special_tokens=False).input_ids[0] == ids[3]

    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == EXPECTED_PROMPT
    assert processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False) == EXPECTED_PROMPT
    as_string = [{"role": "user", "content": "<image>\n" + QUESTION}]
    assert tokenizer.apply_chat_template(as_string, add_generation_prompt=True, tokenize=False) == EXPECTED_PROMPT
    with_system = [{"role": "system", "content": "Be brief."}, *as_string]
    assert tokenizer.apply_chat_template(with_system, add_generation_prompt=True, tokenize=False) == (
        EXPECTED_PROMPT.replace("You are a helpful assistant.", "Be brief.")
    )
    no_gen = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert no_gen == EXPECTED_PROMPT[: -len("<|im_start|>assistant\n")]


def test_processor(loaded):
    from PIL import Image

    model, tokenizer, processor = loaded
    assert type(processor).__name__ == "LlavaProcessor"
    assert type(processor.image_processor).__name__.startswith("CLIPImageProcessor")
    assert processor.patch_size == 64
    ip = processor.image_processor
    assert list(ip.image_mean) == [0.0, 0.0, 0.0] and list(ip.image_std) == [1.0, 1.0, 1.0]
    assert ip.size["shortest_edge"] == IMAGE_SIZE and ip.do_center_crop and ip.do_convert_rgb
    assert int(ip.resample) == 3
    gray = Image.new("L", (400, 300), color=255)
    inputs = processor(images=gray, text=EXPECTED_PROMPT, return_tensors="pt")
    assert list(inputs["pixel_values"].shape) == [1, 3, IMAGE_SIZE, IMAGE_SIZE]
    assert torch.allclose(inputs["pixel_values"], torch.ones(()))  # x/255 with mean 0, std 1
    n_image = int((inputs["input_ids"] == model.config.image_token_id).sum())
    assert n_image == model.config.image_seq_length == 16


def test_features_carry_signal(loaded):
    model, _, _ = loaded
    pixels = _random_pixels()
    with torch.no_grad():
        features = model.model.vision_tower(pixels).last_hidden_state
        embeds = model.model.get_image_features(pixel_values=pixels).pooler_output
    assert list(features.shape) == [1, 256, IMAGE_SIZE // 64, IMAGE_SIZE // 64]
    assert 0.05 < float(features.std()) < 2.0
    assert list(embeds.shape) == [1, 16, 64]
    vocab = len(loaded[1])
    token_std = float(model.model.language_model.embed_tokens.weight.detach()[:vocab].std())
    ratio = float(embeds.std()) / token_std
    assert 0.3 < ratio < 3.0
    # the features depend on the image
    with torch.no_grad():
        other = model.model.vision_tower(_random_pixels(1)).last_hidden_state
    assert float((other - features).abs().max()) > 1e-3


def test_save_and_reload_give_identical_outputs(loaded, tmp_path):
    model, tokenizer, _ = loaded
    model.save_pretrained(tmp_path / "again")
    again = transformers.FastVlmForConditionalGeneration.from_pretrained(tmp_path / "again").eval()
    assert again.config.vision_config.model_args == model.config.vision_config.model_args
    ids = torch.tensor([[1, 2, 3] + [model.config.image_token_id] * 16 + [4, 5]])
    pixels = _random_pixels(2)
    with torch.no_grad():
        a = model(input_ids=ids, pixel_values=pixels).logits
        b = again(input_ids=ids, pixel_values=pixels).logits
    assert torch.equal(a, b)
    assert float(a.std()) > 1e-2


def _greedy(model, input_ids, pixels, n):
    with torch.no_grad():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            pixel_values=pixels,
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            eos_token_id=None,
        )
    return out[0, input_ids.shape[1] :].tolist()


def test_greedy_generation_is_not_constant(loaded):
    model, tokenizer, _ = loaded
    seq = model.config.image_seq_length
    prompt = EXPECTED_PROMPT.replace("<image>", "<image>" * seq)  # what the processor does
    input_ids = tokenizer(prompt, return_tensors="pt").input_ids
    assert int((input_ids == model.config.image_token_id).sum()) == seq
    new = _greedy(model, input_ids, _random_pixels(), 20)
    assert len(new) == 20
    assert len(set(new)) > 1, new
    assert max(new) < len(tokenizer)  # padded vocabulary rows never win
    # the image matters for what is generated
    assert _greedy(model, input_ids, _random_pixels(5), 20) != new


def test_deterministic_and_atomic_overwrite(ckpt, tmp_path):
    first = tiny.make_tiny(tmp_path / "a", image_size=IMAGE_SIZE, seed=0)
    assert (first / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()
    other = tiny.make_tiny(tmp_path / "b", image_size=IMAGE_SIZE, seed=1)
    assert (other / "model.safetensors").read_bytes() != (ckpt / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (ckpt / "tokenizer.json").read_bytes()

    # overwriting an existing checkpoint goes through the rename and leaves no temporary siblings
    stale = other / "stale.txt"
    stale.write_text("old")
    again = tiny.make_tiny(other, image_size=IMAGE_SIZE, seed=0)
    assert again == other and not stale.exists()
    assert (again / "model.safetensors").read_bytes() == (ckpt / "model.safetensors").read_bytes()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]


def test_interrupted_build_leaves_nothing(tmp_path, monkeypatch):
    def boom(tmp, **kwargs):
        (tmp / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(tiny, "_build", boom)
    with pytest.raises(KeyboardInterrupt):
        tiny.make_tiny(tmp_path / "m", image_size=IMAGE_SIZE)
    assert list(tmp_path.iterdir()) == []


def test_refuses_bad_arguments(tmp_path):
    with pytest.raises(UsageError, match="multiple of 64"):
        tiny.make_tiny(tmp_path / "m", image_size=100)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    with pytest.raises(UsageError, match="not a FastVLM checkpoint"):
        tiny.make_tiny(precious, image_size=IMAGE_SIZE)
    assert (precious / "notes.txt").read_text() == "keep me"


def test_missing_torch_is_a_backend_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "timm", None)
    with pytest.raises(BackendError) as info:
        tiny.make_tiny(tmp_path / "m", image_size=IMAGE_SIZE)
    assert str(info.value) == "building the tiny model needs torch and timm: pip install 'vlmrun[export]'"
    assert not (tmp_path / "m").exists()
