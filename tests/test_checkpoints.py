"""Apple <-> native FastVLM checkpoint layouts (vlmrun.checkpoints)."""

from __future__ import annotations

import json
import math
import os
import shutil

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
# fixtures: a tiny native checkpoint, its Apple-layout copy and the converted-back native copy


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
# detect_layout


def test_detect_layout_native_and_apple(native_dir, apple_dir, roundtrip_dir):
    assert checkpoints.detect_layout(native_dir) == NATIVE == "fast_vlm"
    assert checkpoints.detect_layout(str(apple_dir)) == APPLE == "llava_qwen2"
    assert checkpoints.detect_layout(roundtrip_dir) == NATIVE


@pytest.mark.parametrize(
    "config, found",
    [
        ({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}, "'qwen2'"),
        ({"model_type": "llava", "architectures": ["LlavaForConditionalGeneration"]}, "'llava'"),
        ({"architectures": ["Qwen2ForCausalLM"]}, "None"),
    ],
)
def test_detect_layout_rejects_other_models(tmp_path, config, found):
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(InputError) as err:
        checkpoints.detect_layout(tmp_path)
    msg = str(err.value)
    assert "\n" not in msg
    assert found in msg and "not FastVLM" in msg
    assert "'fast_vlm'" in msg and "'llava_qwen2'" in msg  # what is expected


def test_detect_layout_rejects_llava_qwen2_without_mobileclip(tmp_path):
    (tmp_path / "config.json").write_text(
        json.dumps({"model_type": "llava_qwen2", "mm_vision_tower": "openai/clip-vit-large-patch14-336"})
    )
    with pytest.raises(InputError, match=r"clip-vit-large.*not FastVLM's MobileCLIP.*mobileclip_l"):
        checkpoints.detect_layout(tmp_path)


def test_detect_layout_missing_dir_and_config(tmp_path):
    with pytest.raises(InputError) as err:
        checkpoints.detect_layout(tmp_path / "nope")
    assert "does not exist" in str(err.value) and "nope" in str(err.value) and "expected" in str(err.value)
    with pytest.raises(InputError, match="has no config.json; expected"):
        checkpoints.detect_layout(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(InputError, match="cannot read"):
        checkpoints.detect_layout(tmp_path)


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
# the Apple layout


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
    assert torch.equal(logits_a, logits_b)
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
