"""Apple <-> native FastVLM checkpoint formats (vlmrun.checkpoints)."""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

torch = pytest.importorskip("torch")
pytest.importorskip("timm")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from vlmrun import checkpoints  # noqa: E402
from vlmrun.checkpoints import APPLE, NATIVE  # noqa: E402
from vlmrun.errors import InputError  # noqa: E402

IMAGE_SIZE = 256
VP = "model.vision_tower.vision_tower.model."  # Apple's vision tower prefix
NP = "model.vision_tower.timm_model."  # native vision tower prefix


# --------------------------------------------------------------------------------------------------------------
# fixtures: a tiny native checkpoint, its Apple-format copy and the converted-back native copy


def _build_native_fallback(out):
    """A tiny native FastVLM checkpoint, used only when vlmrun.tiny is not available."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (
        AddedToken,
        CLIPImageProcessor,
        FastVlmConfig,
        FastVlmForConditionalGeneration,
        LlavaProcessor,
        Qwen2Config,
        Qwen2Tokenizer,
        TimmWrapperConfig,
    )

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, show_progress=False, special_tokens=[], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = ["What is in this image? A cat sits on a red mat.", "You are a helpful assistant.", "Describe it."]
    bpe.train_from_iterator(corpus * 4, trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab = dict(model["vocab"])
    n = len(vocab)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<image>"]  # appended, like Qwen2's, <image> last
    for i, tok in enumerate(specials):
        vocab[tok] = n + i
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges, unk_token=None, bos_token=specials[0],
                               eos_token=specials[2], pad_token=specials[0])  # fmt: skip
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True, normalized=False) for t in specials[1::2]]}
    )
    image_id = n + 3
    assert tokenizer.convert_tokens_to_ids("<image>") == image_id
    config = FastVlmConfig(
        vision_config=TimmWrapperConfig(
            architecture="fastvit_mci3",
            hidden_size=256,
            model_args={"inference_mode": True, "layers": [1, 1, 1, 1, 1], "embed_dims": [8, 16, 32, 64, 128]},
        ),
        text_config=Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                num_key_value_heads=2, vocab_size=-(-(n + 4) // 64) * 64, tie_word_embeddings=True,
                                bos_token_id=n, eos_token_id=n + 2, rope_theta=1e6),  # fmt: skip
        image_token_id=image_id,
        image_seq_length=(IMAGE_SIZE // 64) ** 2,
    )
    torch.manual_seed(0)
    vlm = FastVlmForConditionalGeneration(config).eval()
    with torch.no_grad():  # timm's init makes the tower output ~1e-26: give every stage signal
        for name, p in vlm.model.vision_tower.named_parameters():
            if name.endswith("gamma"):
                p.fill_(0.5)
            elif p.ndim > 1:
                p.normal_(0.0, 1.0 / math.sqrt(p[0].numel()))
        for name, p in vlm.model.language_model.layers.named_parameters():  # default init echoes one token
            if p.ndim == 2:
                p.normal_(0.0, 2.0 / math.sqrt(p.shape[1]))
    vlm.save_pretrained(out)
    processor = LlavaProcessor(
        tokenizer=tokenizer,
        image_processor=CLIPImageProcessor(size={"shortest_edge": IMAGE_SIZE},
                                           crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
                                           image_mean=[0.0] * 3, image_std=[1.0] * 3),  # fmt: skip
        patch_size=64,
        chat_template="{% for m in messages %}{{ m['role'] }}{% endfor %}",
    )
    processor.save_pretrained(out)
    tokenizer.save_pretrained(out)


@pytest.fixture(scope="module")
def native_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("native") / "fastvlm"
    try:
        from vlmrun.tiny import make_tiny
    except ImportError:
        _build_native_fallback(out)
    else:
        make_tiny(out, image_size=IMAGE_SIZE)
    return out


@pytest.fixture(scope="module")
def apple_dir(native_dir, tmp_path_factory):
    return checkpoints.save_as_apple(native_dir, tmp_path_factory.mktemp("apple") / "FastVLM-apple")


@pytest.fixture(scope="module")
def roundtrip_dir(apple_dir, tmp_path_factory):
    return checkpoints.convert_apple_to_native(apple_dir, tmp_path_factory.mktemp("roundtrip") / "fastvlm")


def _config(path):
    return json.loads((path / "config.json").read_text())


def _keys(path):
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


# --------------------------------------------------------------------------------------------------------------
# detect_format


def test_detect_format_native_and_apple(native_dir, apple_dir, roundtrip_dir):
    assert checkpoints.detect_format(native_dir) == NATIVE == "fast_vlm"
    assert checkpoints.detect_format(str(apple_dir)) == APPLE == "llava_qwen2"
    assert checkpoints.detect_format(roundtrip_dir) == NATIVE
    assert checkpoints.detect_layout is checkpoints.detect_format  # the former name, still importable


@pytest.mark.parametrize(
    "config, found",
    [
        ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, "'qwen2'"),
        ({"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"]}, "'llava'"),
        ({"architectures": ["Qwen2ForCausalLM"]}, "None"),
    ],
)
def test_detect_format_rejects_other_models(tmp_path, config, found):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError) as err:
        checkpoints.detect_format(tmp_path)
    msg = str(err.value)
    assert "\n" not in msg
    assert found in msg and "not FastVLM" in msg
    assert "'fast_vlm'" in msg and "'llava_qwen2'" in msg  # what is expected


def test_detect_format_rejects_llava_qwen2_without_mobileclip(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llava_qwen2", "mm_vision_tower": "openai/clip-vit-large-patch14-336"})
    )
    with pytest.raises(InputError, match=r"clip-vit-large.*not FastVLM's MobileCLIP.*mobileclip_l"):
        checkpoints.detect_format(tmp_path)


def test_detect_format_missing_dir_and_config(tmp_path):
    with pytest.raises(InputError) as err:
        checkpoints.detect_format(tmp_path / "nope")
    assert "does not exist" in str(err.value) and "nope" in str(err.value) and "expected" in str(err.value)
    with pytest.raises(InputError, match="has no config.json; expected"):
        checkpoints.detect_format(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InputError, match="cannot read"):
        checkpoints.detect_format(tmp_path)


# --------------------------------------------------------------------------------------------------------------
# key renames (transformers' convert_fastvlm_weights_to_hf.py)


@pytest.mark.parametrize(
    "apple, native",
    [
        (VP + "patch_embed.0.reparam_conv.weight", NP + "stem.0.reparam_conv.weight"),
        (VP + "network.0.1.token_mixer.reparam_conv.bias", NP + "stages.0.blocks.1.token_mixer.reparam_conv.bias"),
        (VP + "network.2.11.layer_scale", NP + "stages.1.blocks.11.layer_scale.gamma"),
        (VP + "network.4.23.convffn.conv.bn.running_var", NP + "stages.2.blocks.23.mlp.conv.bn.running_var"),
        (VP + "network.1.proj.0.lkb_reparam.weight", NP + "stages.1.downsample.proj.0.reparam_conv.weight"),
        (VP + "network.8.proj.1.reparam_conv.bias", NP + "stages.4.downsample.proj.1.reparam_conv.bias"),
        (VP + "network.6.reparam_conv.weight", NP + "stages.3.pos_emb.reparam_conv.weight"),
        (VP + "network.9.reparam_conv.bias", NP + "stages.4.pos_emb.reparam_conv.bias"),
        (VP + "network.7.3.layer_scale_2", NP + "stages.3.blocks.3.layer_scale_2.gamma"),
        (VP + "network.10.1.token_mixer.proj.weight", NP + "stages.4.blocks.1.token_mixer.proj.weight"),
        (VP + "network.10.0.norm.weight", NP + "stages.4.blocks.0.norm.weight"),
        (VP + "conv_exp.se.reduce.weight", NP + "final_conv.se.fc1.weight"),
        (VP + "conv_exp.se.expand.bias", NP + "final_conv.se.fc2.bias"),
        (VP + "conv_exp.reparam_conv.weight", NP + "final_conv.reparam_conv.weight"),
        ("model.mm_projector.0.weight", "model.multi_modal_projector.linear_1.weight"),
        ("model.mm_projector.2.bias", "model.multi_modal_projector.linear_2.bias"),
        ("model.layers.23.self_attn.q_proj.bias", "model.language_model.layers.23.self_attn.q_proj.bias"),
        ("model.layers.0.mlp.down_proj.weight", "model.language_model.layers.0.mlp.down_proj.weight"),
        ("model.embed_tokens.weight", "model.language_model.embed_tokens.weight"),
        ("model.norm.weight", "model.language_model.norm.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ],
)
def test_key_rename_table(apple, native):
    assert checkpoints.apple_key_to_native(apple) == native
    assert checkpoints.native_key_to_apple(native) == apple


def test_every_full_size_key_has_an_apple_name():
    """FastVLM-0.5B's real dims (stages of 2/12/24/4/2 blocks, 24 decoder layers), built on the meta device."""
    from transformers import FastVlmConfig, FastVlmForConditionalGeneration

    config = FastVlmConfig(
        text_config={"model_type": "qwen2", "hidden_size": 896, "intermediate_size": 4864, "num_hidden_layers": 24,
                     "num_attention_heads": 14, "num_key_value_heads": 2, "vocab_size": 152000,
                     "tie_word_embeddings": True},  # fmt: skip
        image_seq_length=256,
    )
    with torch.device("meta"):
        keys = list(FastVlmForConditionalGeneration(config).state_dict())
    apple = [checkpoints.native_key_to_apple(k) for k in keys]  # raises if the script would not map it back
    assert len(set(apple)) == len(keys)
    assert VP + "network.10.1.layer_scale_2" in apple and VP + "network.4.23.layer_scale" in apple
    assert "model.layers.23.self_attn.o_proj.weight" in apple


def test_unknown_native_key_is_refused():
    with pytest.raises(InputError, match="no Apple llava_qwen2 counterpart"):
        checkpoints.native_key_to_apple("model.vision_tower.timm_model.head.fc.weight")


# --------------------------------------------------------------------------------------------------------------
# the Apple format


def test_apple_dir_looks_like_apple(native_dir, apple_dir):
    cfg, native_cfg = _config(apple_dir), _config(native_dir)
    assert cfg["model_type"] == "llava_qwen2"
    assert cfg["architectures"] == ["LlavaQwen2ForCausalLM"]
    assert cfg["mm_projector_type"] == "mlp2x_gelu"
    assert cfg["mm_vision_tower"] == f"mobileclip_l_{IMAGE_SIZE}"
    assert cfg["image_aspect_ratio"] == "pad"
    assert cfg["mm_hidden_size"] == native_cfg["vision_config"]["hidden_size"] == 256
    text = native_cfg["text_config"]
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "rms_norm_eps", "tie_word_embeddings"):  # fmt: skip
        assert cfg[key] == text[key], key
    assert cfg["rope_theta"] == text["rope_parameters"]["rope_theta"]
    assert "text_config" not in cfg and "image_token_index" not in cfg

    keys = _keys(apple_dir)
    for key in (
        "model.embed_tokens.weight",
        "model.layers.0.self_attn.q_proj.weight",
        "model.norm.weight",
        "model.mm_projector.0.weight",
        "model.mm_projector.2.bias",
        VP + "patch_embed.0.reparam_conv.weight",
        VP + "network.0.0.layer_scale",
        VP + "network.0.0.convffn.fc1.weight",
        VP + "network.1.proj.0.lkb_reparam.weight",
        VP + "network.6.reparam_conv.weight",
        VP + "network.7.0.layer_scale_1",
        VP + "network.10.0.token_mixer.qkv.weight",
        VP + "conv_exp.se.reduce.weight",
        VP + "head.proj",
    ):
        assert key in keys, key
    native_only = ("timm_model", "multi_modal_projector", "language_model", "stages.", "stem.", "final_conv", ".gamma")
    for fragment in native_only:
        assert not any(fragment in k for k in keys), fragment
    assert "lm_head.weight" not in keys  # tied, like the native checkpoint

    native = load_file(str(native_dir / "model.safetensors"))
    apple = load_file(str(apple_dir / "model.safetensors"))
    assert apple["model.mm_projector.0.weight"].shape == (cfg["hidden_size"], cfg["mm_hidden_size"])
    assert torch.equal(apple["model.mm_projector.0.weight"], native["model.multi_modal_projector.linear_1.weight"])
    assert torch.equal(apple[VP + "network.7.0.layer_scale_1"], native[NP + "stages.3.blocks.0.layer_scale_1.gamma"])
    assert apple["model.embed_tokens.weight"].shape[0] == cfg["vocab_size"] == native_cfg["image_token_index"]

    pre = json.loads((apple_dir / "preprocessor_config.json").read_text())
    assert pre["image_processor_type"] == "CLIPImageProcessor"
    assert pre["crop_size"] == {"height": IMAGE_SIZE, "width": IMAGE_SIZE} and pre["image_std"] == [1.0] * 3


def test_apple_tokenizer_has_no_image_token(native_dir, apple_dir):
    from transformers import Qwen2Tokenizer

    apple_tok = Qwen2Tokenizer.from_pretrained(str(apple_dir))
    native_tok = Qwen2Tokenizer.from_pretrained(str(native_dir))
    image_id = _config(native_dir)["image_token_index"]
    assert "<image>" not in apple_tok.get_vocab()
    assert len(apple_tok) == image_id == len(native_tok) - 1
    tj = json.loads((apple_dir / "tokenizer.json").read_text())
    assert all(t["content"] != "<image>" for t in tj["added_tokens"])
    text = "<|im_start|>user\nWhat is in this image?<|im_end|>\n<|im_start|>assistant\n"
    assert apple_tok(text)["input_ids"] == native_tok(text)["input_ids"]
    assert native_tok("<image>")["input_ids"] == [image_id]
    assert len(apple_tok("<image>")["input_ids"]) > 1  # just text to Apple's tokenizer (its code inserts -200)
    template = json.loads((apple_dir / "tokenizer_config.json").read_text())["chat_template"]
    prompt = apple_tok.apply_chat_template([{"role": "user", "content": "<image>\nHi"}], tokenize=False,
                                           add_generation_prompt=True)  # fmt: skip
    assert "<|im_start|>" in template
    assert prompt == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                      "<|im_start|>user\n<image>\nHi<|im_end|>\n<|im_start|>assistant\n")  # fmt: skip


# --------------------------------------------------------------------------------------------------------------
# round trip native -> Apple -> native


def test_round_trip_weights_are_identical(native_dir, roundtrip_dir):
    before = load_file(str(native_dir / "model.safetensors"))
    after = load_file(str(roundtrip_dir / "model.safetensors"))
    assert set(before) == set(after)
    for key, value in before.items():
        assert after[key].dtype == value.dtype, key
        assert torch.equal(after[key], value), key
    assert len(before) > 100


def test_round_trip_config_tokenizer_processor(native_dir, roundtrip_dir):
    from transformers import AutoProcessor, AutoTokenizer

    a, b = _config(native_dir), _config(roundtrip_dir)
    assert b["model_type"] == "fast_vlm" and b["architectures"] == ["FastVlmForConditionalGeneration"]
    for key in ("image_token_index", "image_seq_length", "tie_word_embeddings", "vision_feature_select_strategy"):
        assert b[key] == a[key], key
    assert b["image_seq_length"] == (IMAGE_SIZE // 64) ** 2
    assert b["vision_config"]["architecture"] == "fastvit_mci3"
    assert b["vision_config"]["hidden_size"] == a["vision_config"]["hidden_size"]
    assert b["vision_config"]["model_args"] == a["vision_config"]["model_args"]
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_key_value_heads", "rope_parameters",
                "bos_token_id", "eos_token_id"):  # fmt: skip
        assert b["text_config"][key] == a["text_config"][key], key
    assert b["text_config"]["vocab_size"] % 64 == 0

    tok_a, tok_b = AutoTokenizer.from_pretrained(native_dir), AutoTokenizer.from_pretrained(roundtrip_dir)
    text = "<|im_start|>user\n<image>\nWhat is in this image?<|im_end|>\n<|im_start|>assistant\n"
    assert tok_b(text)["input_ids"] == tok_a(text)["input_ids"]
    assert tok_b.convert_tokens_to_ids("<image>") == b["image_token_index"]

    proc = AutoProcessor.from_pretrained(roundtrip_dir)
    assert type(proc).__name__ == "LlavaProcessor" and proc.patch_size == 64
    assert type(proc.image_processor).__name__.startswith("CLIPImageProcessor")
    assert proc.image_processor.crop_size["height"] == IMAGE_SIZE
    assert list(proc.image_processor.image_mean) == [0.0] * 3 and list(proc.image_processor.image_std) == [1.0] * 3
    prompt = proc.apply_chat_template(
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}],
        add_generation_prompt=True,
    )
    assert prompt.endswith("<|im_start|>user\n<image>\nWhat is this?<|im_end|>\n<|im_start|>assistant\n")
    with_system = proc.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}],
        add_generation_prompt=True,
    )
    assert with_system.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")


def _greedy(model_dir, input_ids, pixel_values, steps=20):
    from transformers import FastVlmForConditionalGeneration

    model = FastVlmForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = input_ids.clone()
    out, first_logits = [], None
    with torch.no_grad():
        for step in range(steps):  # plain greedy, EOS ignored
            logits = model(input_ids=ids, pixel_values=pixel_values).logits[:, -1]
            if step == 0:
                first_logits = logits
            nxt = int(logits.argmax(-1))
            out.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
    return out, first_logits


def test_round_trip_generates_identical_tokens(native_dir, roundtrip_dir):
    from transformers import AutoTokenizer

    cfg = _config(native_dir)
    tok = AutoTokenizer.from_pretrained(native_dir)
    head = tok("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n")["input_ids"]
    tail = tok("\nWhat is in this image?<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    ids = torch.tensor([head + [cfg["image_token_index"]] * cfg["image_seq_length"] + tail])
    gen = torch.Generator().manual_seed(0)
    pixels = torch.rand((1, 3, IMAGE_SIZE, IMAGE_SIZE), generator=gen)

    tokens_a, logits_a = _greedy(native_dir, ids, pixels)
    tokens_b, logits_b = _greedy(roundtrip_dir, ids, pixels)
    assert tokens_a == tokens_b
    assert len(tokens_a) == 20 and len(set(tokens_a)) > 1
    # the weights are bitwise equal (test_round_trip_weights_are_identical); the float sums are not always: a
    # tensor's alignment can pick another SIMD path (exact equality failed once, under load, with equal tokens)
    torch.testing.assert_close(logits_b, logits_a, rtol=0, atol=1e-5)
    # the image must matter, or the comparison would be vacuous
    _, logits_other = _greedy(native_dir, ids, torch.rand((1, 3, IMAGE_SIZE, IMAGE_SIZE), generator=gen), steps=1)
    assert float((logits_other - logits_a).abs().max()) > 1e-4


# --------------------------------------------------------------------------------------------------------------
# a real-looking Apple checkpoint: no vision_config block, no extra vocabulary rows, bf16


def test_convert_real_like_apple_checkpoint(native_dir, apple_dir, tmp_path):
    src = tmp_path / "apple"
    shutil.copytree(apple_dir, src)
    os.remove(src / checkpoints.EXTRA_ROWS_FILE)
    cfg = _config(src)
    del cfg["vision_config"]
    (src / "config.json").write_text(json.dumps(cfg))
    weights = load_file(str(src / "model.safetensors"))
    bf16 = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in weights.items()}
    save_file(bf16, str(src / "model.safetensors"), metadata={"format": "pt"})

    out = checkpoints.convert_apple_to_native(src, tmp_path / "native")
    conv = load_file(str(out / "model.safetensors"))
    native = load_file(str(native_dir / "model.safetensors"))
    v_apple = cfg["vocab_size"]
    v_new = -(-(v_apple + 1) // 64) * 64  # the script: one more row, padded to a multiple of 64
    ocfg = _config(out)
    assert ocfg["text_config"]["vocab_size"] == v_new
    assert ocfg["dtype"] == "bfloat16"
    assert ocfg["image_token_index"] == v_apple  # <image> appended after Apple's tokens
    assert ocfg["vision_config"]["model_args"] == _config(native_dir)["vision_config"]["model_args"]  # from shapes
    emb = conv["model.language_model.embed_tokens.weight"]
    assert emb.shape == (v_new, cfg["hidden_size"]) and emb.dtype == torch.bfloat16
    src_emb = bf16["model.embed_tokens.weight"]
    assert torch.equal(emb[:v_apple], src_emb)
    mean = src_emb.float().mean(dim=0).to(torch.bfloat16)
    assert torch.equal(emb[v_apple:], mean.expand(v_new - v_apple, -1))
    assert set(conv) == set(native)
    for key, value in conv.items():
        if key != "model.language_model.embed_tokens.weight":
            assert value.dtype == (torch.bfloat16 if value.is_floating_point() else value.dtype), key
            assert torch.equal(value, native[key].to(value.dtype)), key

    from transformers import FastVlmForConditionalGeneration

    model = FastVlmForConditionalGeneration.from_pretrained(out)  # loads offline, no remote code
    assert model.config.image_token_id == v_apple


# --------------------------------------------------------------------------------------------------------------
# refusals


def test_refuses_wrong_direction_and_existing_output(native_dir, apple_dir, tmp_path):
    with pytest.raises(InputError, match="already a transformers-native"):
        checkpoints.convert_apple_to_native(native_dir, tmp_path / "x")
    with pytest.raises(InputError, match="expected a transformers-native 'fast_vlm'"):
        checkpoints.save_as_apple(apple_dir, tmp_path / "y")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    with pytest.raises(InputError, match="already exists and is not empty"):
        checkpoints.convert_apple_to_native(apple_dir, busy)
    assert (busy / "keep.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["busy"]


def test_broken_apple_checkpoint_leaves_nothing_behind(apple_dir, tmp_path):
    src = tmp_path / "apple"
    shutil.copytree(apple_dir, src)
    weights = load_file(str(src / "model.safetensors"))
    del weights["model.mm_projector.2.weight"]
    save_file(weights, str(src / "model.safetensors"))
    out_parent = tmp_path / "out"
    with pytest.raises(InputError, match=r"missing \['model.multi_modal_projector.linear_2.weight'\]"):
        checkpoints.convert_apple_to_native(src, out_parent / "native")
    assert list(out_parent.iterdir()) == []  # the temporary directory is gone, no partial output
    os.remove(src / "model.safetensors")
    with pytest.raises(InputError, match=r"no \*\.safetensors weights"):
        checkpoints.convert_apple_to_native(src, out_parent / "native")


# --------------------------------------------------------------------------------------------------------------
# the conversion cache: keyed by every file that shapes the converted model

PROMPT = "What is in this image?"
HEAD = "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n"  # Apple's qwen_2 turn
TAIL = f"\n{PROMPT}<|im_end|>\n<|im_start|>assistant\n"


def _as_vocab_and_merges(src):
    """Store the tokenizer as apple/FastVLM-0.5B does: vocab.json + merges.txt + added_tokens.json."""
    tj = json.loads((src / "tokenizer.json").read_text())
    merges = [" ".join(m) if isinstance(m, list) else m for m in tj["model"]["merges"]]
    (src / "vocab.json").write_text(json.dumps(tj["model"]["vocab"], ensure_ascii=False))
    (src / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")
    (src / "added_tokens.json").write_text(json.dumps({t["content"]: t["id"] for t in tj["added_tokens"]}))
    os.remove(src / "tokenizer.json")


@pytest.fixture(scope="module")
def apple_vm_dir(apple_dir, tmp_path_factory):
    src = tmp_path_factory.mktemp("apple-vm") / "FastVLM-apple"
    shutil.copytree(apple_dir, src)
    _as_vocab_and_merges(src)
    return src


def _apple_prompt_ids(src):
    """What Apple's predict feeds its model, with the -200 placeholder expanded as the conversion does."""
    from transformers import Qwen2Tokenizer

    tok = Qwen2Tokenizer.from_pretrained(str(src))
    image_id = _config(src)["vocab_size"]  # <image> is appended after Apple's tokens
    return tok(HEAD)["input_ids"] + [image_id] * (IMAGE_SIZE // 64) ** 2 + tok(TAIL)["input_ids"]


def _vlmrun_prompt_ids(src, store, rebuild=False):
    from PIL import Image

    from vlmrun import Pipeline

    pipe = Pipeline.build(src, "reference", store=store, stages=(), rebuild=rebuild)
    prepared = pipe.prepare(Image.new("RGB", (320, 200), (200, 30, 30)), PROMPT)
    return prepared.input_ids[0].tolist(), pipe.model


def _drop_merge_of(src):
    """Remove the merge that forms the prompt's longest token from merges.txt: BPE then splits it in two."""
    from transformers import Qwen2Tokenizer

    tok = Qwen2Tokenizer.from_pretrained(str(src))
    longest = max(tok.convert_ids_to_tokens(tok(PROMPT)["input_ids"]), key=len)
    lines = (src / "merges.txt").read_text().splitlines()
    kept = [line for line in lines if line.startswith("#") or line.replace(" ", "") != longest]
    assert len(kept) == len(lines) - 1, longest
    (src / "merges.txt").write_text("\n".join(kept) + "\n")
    return longest


def test_editing_merges_txt_reaches_the_next_run(apple_vm_dir, tmp_path):
    from vlmrun.store import ArtifactStore

    src = tmp_path / "apple"
    shutil.copytree(apple_vm_dir, src)
    store = ArtifactStore(tmp_path / "cache")
    before, model = _vlmrun_prompt_ids(src, store)
    assert before == _apple_prompt_ids(src)
    image_id, n_image = _config(src)["vocab_size"], (IMAGE_SIZE // 64) ** 2
    start = before.index(image_id)
    assert before[start : start + n_image] == [image_id] * n_image and before.count(image_id) == n_image
    # the tiny tokenizer's ids for "\nWhat is in this image?<|im_end|>\n<|im_start|>assistant\n"
    assert before[start + n_image :] == [198, 341, 270, 285, 258, 367, 338, 30, 402, 198, 401, 300, 82, 387, 83,
                                         287, 83, 198]  # fmt: skip
    assert len([p for p in (tmp_path / "cache" / "artifacts").iterdir() if p.name.startswith("checkpoint-")]) == 1

    token = _drop_merge_of(src)
    after, model2 = _vlmrun_prompt_ids(src, ArtifactStore(tmp_path / "cache"))  # a new run, no --rebuild
    assert after == _apple_prompt_ids(src) != before
    assert len(after) == len(before) + 1, token  # the token is now two
    assert model2.path != model.path and model2.source == src
    # the first conversion is still there, for the first tokenizer
    assert len([p for p in (tmp_path / "cache" / "artifacts").iterdir() if p.name.startswith("checkpoint-")]) == 2


def test_rebuild_converts_again(apple_dir, tmp_path):
    from vlmrun.store import ArtifactStore

    store = ArtifactStore(tmp_path / "cache")
    ids, model = _vlmrun_prompt_ids(apple_dir, store)
    assert [b for b in store.builds if b.startswith("checkpoint-")] == [model.path.name]
    store = ArtifactStore(tmp_path / "cache")
    _vlmrun_prompt_ids(apple_dir, store)
    assert store.builds == []  # reused
    stamp = (model.path / "model.safetensors").stat().st_mtime_ns
    store = ArtifactStore(tmp_path / "cache")
    again, model2 = _vlmrun_prompt_ids(apple_dir, store, rebuild=True)
    assert store.builds == [model.path.name] and model2.path == model.path and again == ids
    assert (model.path / "model.safetensors").stat().st_mtime_ns != stamp


def test_two_dirs_with_the_same_weights_keep_their_own_tokenizers(apple_dir, tmp_path):
    from vlmrun.store import ArtifactStore

    a, b = tmp_path / "a", tmp_path / "b"
    for d in (a, b):
        d.mkdir()
        for f in apple_dir.iterdir():
            if f.suffix == ".safetensors":
                os.link(f, d / f.name)  # the very same weight files
            else:
                shutil.copyfile(f, d / f.name)
    tj = json.loads((b / "tokenizer.json").read_text())  # b: a tokenizer.json without the prompt's longest merge
    from transformers import Qwen2Tokenizer

    tok = Qwen2Tokenizer.from_pretrained(str(b))
    longest = max(tok.convert_ids_to_tokens(tok(PROMPT)["input_ids"]), key=len)
    merges = tj["model"]["merges"]
    tj["model"]["merges"] = [m for m in merges if "".join(m.split(" ") if isinstance(m, str) else m) != longest]
    assert len(tj["model"]["merges"]) == len(merges) - 1
    (b / "tokenizer.json").write_text(json.dumps(tj, ensure_ascii=False))

    store = ArtifactStore(tmp_path / "cache")
    ids_a, model_a = _vlmrun_prompt_ids(a, store)
    ids_b, model_b = _vlmrun_prompt_ids(b, store)
    assert ids_a == _apple_prompt_ids(a) and ids_b == _apple_prompt_ids(b)
    assert ids_a != ids_b and len(ids_b) == len(ids_a) + 1
    assert model_a.path != model_b.path
    assert _vlmrun_prompt_ids(a, store)[0] == ids_a  # and back: each directory keeps its own conversion


def test_conversion_inputs_are_every_file_that_shapes_the_model(apple_vm_dir, tmp_path):
    src = tmp_path / "apple"
    shutil.copytree(apple_vm_dir, src)
    (src / "README.md").write_text("# FastVLM\n")
    (src / "LICENSE").write_text("licence\n")
    (src / ".gitattributes").write_text("*.safetensors filter=lfs\n")
    (src / "chat_template.jinja").write_text("{{ messages }}")
    (src / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    assert [p.name for p in checkpoints.conversion_inputs(src)] == [
        "added_tokens.json", "chat_template.jinja", "config.json", "generation_config.json", "merges.txt",
        "model.safetensors", "preprocessor_config.json", "special_tokens_map.json", "tokenizer_config.json",
        checkpoints.EXTRA_ROWS_FILE, "vocab.json",
    ]  # fmt: skip
    base = checkpoints.conversion_digest(src)
    for name in ("README.md", "LICENSE", ".gitattributes"):
        with open(src / name, "a") as f:
            f.write("more\n")
        assert checkpoints.conversion_digest(src) == base, name  # documentation does not count
    for p in checkpoints.conversion_inputs(src):
        data = p.read_bytes()
        p.write_bytes(data + b"\n")
        assert checkpoints.conversion_digest(src) != base, p.name  # each of them does
        p.write_bytes(data)
        assert checkpoints.conversion_digest(src) == base


def test_large_weight_hashes_are_cached_by_stamp(apple_dir, tmp_path, monkeypatch):
    from vlmrun import store as store_mod

    src = tmp_path / "apple"
    shutil.copytree(apple_dir, src)
    monkeypatch.setattr(store_mod, "FULL_HASH_LIMIT", 10_000)  # the weights are "large", the JSON files small
    hashed = []
    real = store_mod.sha256_file
    monkeypatch.setattr(store_mod, "sha256_file", lambda f: hashed.append(f.name) or real(f))
    first = checkpoints.conversion_digest(src, tmp_path / "cache")
    assert "model.safetensors" in hashed and (tmp_path / "cache" / checkpoints.FILE_HASHES).is_file()
    hashed.clear()
    assert checkpoints.conversion_digest(src, tmp_path / "cache") == first
    assert "model.safetensors" not in hashed and "config.json" in hashed  # small files: always
    data = bytearray((src / "model.safetensors").read_bytes())
    data[-1] ^= 1  # same size, new contents
    (src / "model.safetensors").write_bytes(bytes(data))
    hashed.clear()
    assert checkpoints.conversion_digest(src, tmp_path / "cache") != first and "model.safetensors" in hashed


# --------------------------------------------------------------------------------------------------------------
# sharded checkpoints


def _shard(src, n=2):
    """Split model.safetensors into n shards plus model.safetensors.index.json, as save_pretrained does."""
    weights = load_file(str(src / "model.safetensors"))
    os.remove(src / "model.safetensors")
    keys = sorted(weights)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    weight_map = {}
    for i, name in enumerate(names):
        part = keys[i * len(keys) // n : (i + 1) * len(keys) // n]
        save_file({k: weights[k] for k in part}, str(src / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, name))
    total = sum(v.numel() * v.element_size() for v in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (src / checkpoints.SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2))
    return names


def test_sharded_apple_checkpoint_converts(apple_dir, roundtrip_dir, tmp_path):
    src = tmp_path / "apple"
    shutil.copytree(apple_dir, src)
    names = _shard(src)
    assert [p.name for p in checkpoints.conversion_inputs(src) if p.suffix == ".safetensors"] == [
        *names, checkpoints.EXTRA_ROWS_FILE]
    out = checkpoints.convert_apple_to_native(src, tmp_path / "native")
    from vlmrun.checkpoint_formats import load_tensors

    # converted shard for shard (a streamed export reads the shards of its part only), the same tensors
    index = json.loads((out / checkpoints.SAFETENSORS_INDEX).read_text())
    assert sorted(set(index["weight_map"].values())) == names and not (out / "model.safetensors").exists()
    conv, ref = load_tensors(out), load_file(str(roundtrip_dir / "model.safetensors"))
    assert set(conv) == set(ref) and all(torch.equal(conv[k], ref[k]) for k in ref)


def test_store_reads_a_sharded_apple_checkpoint_where_it_is(apple_dir, tmp_path):
    """Opened into the store, a sharded Apple checkpoint is not copied: the store holds the grown vocabulary
    weights and a map, every weight reads back equal to the copying conversion's, the whole model loads, and the
    checkpoint moved elsewhere is read from there (a new store entry, the same weights hash); a missing shard is one
    line naming it."""
    from vlmrun.checkpoint_formats import SOURCE_WEIGHTS_FILE, VOCAB_FILE, load_tensors
    from vlmrun.checkpoint_stream import ShardedWeights
    from vlmrun.model import FastVLMModel
    from vlmrun.store import ArtifactStore

    src = tmp_path / "apple"
    shutil.copytree(apple_dir, src)
    names = _shard(src, 3)
    copied = load_tensors(checkpoints.convert_apple_to_native(src, tmp_path / "copy"))
    store = ArtifactStore(tmp_path / "store")
    model = FastVLMModel.open(src, store)
    written = sorted(p.name for p in model.path.glob("*.safetensors"))
    assert written == [VOCAB_FILE] and (model.path / SOURCE_WEIGHTS_FILE).is_file() and model.streams
    assert sorted(load_file(str(model.path / VOCAB_FILE))) == ["model.language_model.embed_tokens.weight"]
    weights = ShardedWeights(model.path)
    assert {Path(f).name for f in weights.files.values()} == {*names, VOCAB_FILE}
    assert set(weights.files) == set(copied)
    assert all(torch.equal(weights.read(k), copied[k]) for k in copied)
    whole = model.load_torch().state_dict()
    assert all(torch.equal(whole[k], copied[k].float()) for k in copied)
    assert model.weight_file_bytes == sum((src / n).stat().st_size for n in names)
    digest = model.weights_hash(store)

    moved = tmp_path / "moved"
    shutil.move(src, moved)
    again = FastVLMModel.open(moved, store)  # a new entry (its vocabulary weights), the same weights hash
    assert again.path != model.path and again.weights_hash(store) == digest
    assert store.verify() and all(v.ok for v in store.verify())
    assert all(torch.equal(ShardedWeights(again.path).read(k), copied[k]) for k in copied)
    os.remove(moved / names[0])
    key = next(k for k, f in ShardedWeights(again.path).files.items() if Path(f).name == names[0])
    with pytest.raises(InputError) as err:
        ShardedWeights(again.path).read(key)
    assert str(err.value) == (f"shard {moved / names[0]} is missing; the converted model {again.path} reads {key}"
                              " from the checkpoint it was converted from: put it back, or open the model from"
                              " where it is now")


def test_missing_shard_is_named(apple_dir, tmp_path, image_path):
    from conftest import run_cli

    from vlmrun.model import FastVLMModel

    src = tmp_path / "apple"
    shutil.copytree(apple_dir, src)
    names = _shard(src, 3)
    os.remove(src / names[1])
    want = (f"{src}: shard model-00002-of-00003.safetensors is missing; model.safetensors.index.json lists 3"
            " shard files and 2 are present; copy or download the missing shard")
    with pytest.raises(InputError) as err:
        checkpoints.convert_apple_to_native(src, tmp_path / "out")
    assert str(err.value) == want
    with pytest.raises(InputError) as err:
        FastVLMModel.open(src)  # before any hashing or conversion
    assert str(err.value) == want
    res = run_cli(["--image", str(image_path), "--prompt", "x", "--model", str(src), "--image-size", "256"],
                  tmp_path / "cache")
    assert res.returncode == 1 and "Traceback" not in res.stderr
    assert res.stderr.strip() == f"vlmrun: error: {want}"
    os.remove(src / names[2])
    with pytest.raises(InputError, match=r"shard model-00002-of-00003.safetensors \(and 1 more\) is missing"):
        checkpoints.convert_apple_to_native(src, tmp_path / "out")


def test_index_naming_a_shard_without_the_weight(apple_dir, tmp_path):
    src = tmp_path / "apple"
    shutil.copytree(apple_dir, src)
    names = _shard(src)
    index = json.loads((src / checkpoints.SAFETENSORS_INDEX).read_text())
    index["weight_map"]["model.norm.bias"] = names[0]
    (src / checkpoints.SAFETENSORS_INDEX).write_text(json.dumps(index))
    with pytest.raises(InputError, match=r"puts \['model.norm.bias'\] in model-00001-of-00002.safetensors, which"
                                         r" does not hold them"):
        checkpoints.convert_apple_to_native(src, tmp_path / "out")


# --------------------------------------------------------------------------------------------------------------
# stop ids: the checkpoint's generation config, else the tokenizer's eos, else the model config's


def _ids(path, *tokens):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    return [tok.token_to_id(t) for t in tokens]


def _stop_ids(path):
    from vlmrun.model import FastVLMModel

    return set(FastVLMModel(path, path, "fast_vlm").stop_ids)


def test_stop_ids_follow_the_generation_config(native_dir, tmp_path):
    src = tmp_path / "native"
    shutil.copytree(native_dir, src)
    endoftext, im_end = _ids(src, "<|endoftext|>", "<|im_end|>")
    gen_file, tcfg_file = src / "generation_config.json", src / "tokenizer_config.json"
    gen = json.loads(gen_file.read_text())
    assert gen["eos_token_id"] == im_end
    assert _stop_ids(src) == {im_end}  # not <|endoftext|> too: Apple's predict stops on <|im_end|> only

    gen_file.write_text(json.dumps({**gen, "eos_token_id": [im_end, endoftext]}))  # a list
    assert _stop_ids(src) == {im_end, endoftext}
    gen_file.write_text(json.dumps({**gen, "eos_token_id": endoftext}))  # an int
    assert _stop_ids(src) == {endoftext}

    os.remove(gen_file)  # no generation config: the tokenizer's eos
    tcfg = json.loads(tcfg_file.read_text())
    assert tcfg["eos_token"] == "<|im_end|>" and _stop_ids(src) == {im_end}
    tcfg_file.write_text(json.dumps({**tcfg, "eos_token": {"content": "<|endoftext|>", "special": True}}))
    assert _stop_ids(src) == {endoftext}

    del tcfg["eos_token"]  # nor a tokenizer eos: the model config's eos_token_id
    tcfg_file.write_text(json.dumps(tcfg))
    assert _config(src)["text_config"]["eos_token_id"] == im_end and _stop_ids(src) == {im_end}


def test_converted_apple_checkpoint_stops_on_its_generation_config(apple_dir, tmp_path):
    from vlmrun.model import FastVLMModel
    from vlmrun.store import ArtifactStore

    src = tmp_path / "apple"
    shutil.copytree(apple_dir, src)
    endoftext, im_end = _ids(src, "<|endoftext|>", "<|im_end|>")
    store = ArtifactStore(tmp_path / "cache")
    assert FastVLMModel.open(src, store).stop_ids == {im_end}
    gen = json.loads((src / "generation_config.json").read_text())
    (src / "generation_config.json").write_text(json.dumps({**gen, "eos_token_id": [endoftext, im_end]}))
    assert FastVLMModel.open(src, store).stop_ids == {endoftext, im_end}  # a new conversion, no --rebuild


def test_json_output_carries_the_stop_ids(cache_dir, ref_pipe, image_path):
    from conftest import run_cli

    im_end = _ids(ref_pipe.model.path, "<|im_end|>")[0]
    args = ["--image", str(image_path), "--prompt", "x", "--image-size", "256", "--max-new-tokens", "2", "--json"]
    res = run_cli(args, cache_dir)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["stop_ids"] == [im_end] == sorted(ref_pipe.model.stop_ids)
    res = run_cli([*args, "--ignore-eos"], cache_dir)
    assert res.returncode == 0 and json.loads(res.stdout)["stop_ids"] == []


# --------------------------------------------------------------------------------------------------------------
# the rows the conversion adds (<image>, padding to a multiple of 64) are never sampled


@pytest.mark.parametrize(
    "settings",
    [
        dict(),  # greedy
        dict(temperature=1.0),
        dict(temperature=0.7, top_k=5),
        dict(temperature=1.5, top_p=0.9),
        dict(temperature=2.0, top_k=40, top_p=0.95, seed=3),
    ],
)
def test_sampler_never_picks_rows_past_the_vocab_limit(settings):
    import numpy as np

    from vlmrun.sampling import Sampler, SamplingSettings

    v_apple, v_padded = 1936, 2000  # as FastVLM-0.5B's 151936 -> 152000, on a shorter vector
    rng = np.random.default_rng(0)
    logits = rng.normal(size=v_padded).astype(np.float32)
    logits[v_apple:] += 50.0  # the padded rows would win every draw
    s = SamplingSettings(**settings)
    masked, unmasked = Sampler(s, vocab_limit=v_apple), Sampler(s)
    picks = [masked(logits) for _ in range(200)]
    assert max(picks) < v_apple
    assert min(unmasked(logits) for _ in range(20)) >= v_apple  # without the limit they are all that is picked
    if not settings:
        assert picks[0] == int(np.argmax(logits[:v_apple]))
    else:
        assert len(set(picks)) > 1  # really sampled


def test_vocab_limit_is_apples_vocab_size(native_dir, apple_dir, tmp_path):
    from vlmrun.model import FastVLMModel
    from vlmrun.store import ArtifactStore

    converted = FastVLMModel.open(apple_dir, ArtifactStore(tmp_path / "cache"))
    v_apple = _config(apple_dir)["vocab_size"]
    assert converted.vocab_limit == v_apple == 403 and converted.vocab_size == 448
    info = json.loads((converted.path / checkpoints.CONVERSION_FILE).read_text())
    # "source_layout": the stored key keeps its name (the source's format), so converted checkpoints keep their bytes
    assert info == {"source_layout": "llava_qwen2", "source_vocab_size": 403, "vocab_size": 448,
                    "image_token_id": 403}
    assert FastVLMModel.open(native_dir).vocab_limit is None  # a native checkpoint: every row is the model's


def test_padded_rows_are_never_generated(apple_dir, tmp_path, image_path):
    """End to end on the reference layout: rows past Apple's vocabulary made to win every step are not picked."""
    from vlmrun import GenerationSettings, Pipeline, SamplingSettings
    from vlmrun.store import ArtifactStore

    src = tmp_path / "apple"
    shutil.copytree(apple_dir, src)
    v_apple = _config(src)["vocab_size"]
    rows = load_file(str(src / checkpoints.EXTRA_ROWS_FILE))
    gen = torch.Generator().manual_seed(0)
    rows["embed"] = (torch.randn(rows["embed"].shape, generator=gen) * 10).to(rows["embed"].dtype)
    save_file(rows, str(src / checkpoints.EXTRA_ROWS_FILE))  # large rows: their logits dominate

    pipe = Pipeline.build(src, "reference", store=ArtifactStore(tmp_path / "cache"))
    assert pipe.model.vocab_limit == v_apple
    for sampling in (SamplingSettings(), SamplingSettings(temperature=1.0, top_k=10, top_p=0.9, seed=1)):
        g = pipe.generate(image_path, PROMPT, GenerationSettings(max_new_tokens=8, sampling=sampling,
                                                                 ignore_eos=True), keep_logits=True).run()
        assert len(g.token_ids) == 8 and max(g.token_ids) < v_apple, g.token_ids
        assert all(int(row.argmax()) >= v_apple for row in g.step_logits)  # the mask is what kept them out
