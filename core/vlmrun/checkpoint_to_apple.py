"""Write a native FastVLM checkpoint in Apple's ``llava_qwen2`` format: the inverse of the conversion.

The tests use `save_as_apple` to make an Apple-format checkpoint from a native one (no Apple checkpoint can be
downloaded here). Apple's format has no room for the native vocabulary rows past Apple's ``vocab_size`` (the
``<image>`` row and the padding); so that the round trip is lossless they go to a side file, `EXTRA_ROWS_FILE`,
which `vlmrun.checkpoint_convert.convert_apple_to_native` uses instead of the mean rows when present. Real Apple
checkpoints have no such file.

torch is imported inside the functions only.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
from typing import Any

from .checkpoint_formats import (
    APPLE,
    APPLE_ARCH,
    APPLE_QWEN2_CONFIG_KEYS,
    EXTRA_ROWS_FILE,
    NATIVE,
    detect_format,
    image_size_from_processor,
    load_qwen2_tokenizer,
    load_tensors,
    read_config,
    read_json,
    save_tensors,
    write_checkpoint_dir,
)
from .checkpoint_keys import (
    APPLE_HEAD_PROJ,
    NATIVE_EMBED,
    NATIVE_LM_HEAD,
    native_key_to_apple,
)
from .errors import InputError
from .fastvlm_files import IMAGE_TOKEN, PATCH_SIZE, fastvlm_image_processor

__all__ = ["QWEN2_CHAT_TEMPLATE", "apple_config", "save_as_apple", "write_apple_tokenizer"]

# Llava keys of the real apple/FastVLM-0.5B config.json (values as published).
_APPLE_LLAVA_KEYS = {
    "freeze_mm_mlp_adapter": False,
    "image_aspect_ratio": "pad",
    "image_grid_pinpoints": None,
    "mm_patch_merge_type": "flat",
    "mm_projector_lr": None,
    "mm_projector_type": "mlp2x_gelu",
    "mm_use_im_patch_token": False,
    "mm_use_im_start_end": False,
    "mm_vision_select_feature": "patch",
    "mm_vision_select_layer": -2,
    "tokenizer_model_max_length": 8192,
    "tokenizer_padding_side": "right",
    "tune_mm_mlp_adapter": False,
    "unfreeze_mm_vision_tower": True,
    "use_mm_proj": True,
}

#: Qwen2's ChatML template (as in Qwen2 tokenizer_config.json files): what Apple's tokenizer carries.
QWEN2_CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def save_as_apple(native_dir: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: Any = None,
                  shard_bytes: int | None = None) -> pathlib.Path:
    """Write a native ``fast_vlm`` checkpoint in Apple's ``llava_qwen2`` format (the inverse of the conversion).

    config.json as apple/FastVLM-0.5B's (Qwen2 keys at the top level plus Apple's llava keys), with a
    ``vision_config`` block recording the timm tower's ``model_args``; Apple's key names in model.safetensors (plus
    a zero ``head.proj`` as MCi carries); the tokenizer without ``<image>``; Qwen2's chat template; a
    CLIPImageProcessor ``preprocessor_config.json``; and `EXTRA_ROWS_FILE` with the vocabulary rows Apple's
    format has no room for. Tensors keep their dtype unless ``dtype`` (a torch dtype, e.g. ``torch.bfloat16``)
    is given. ``shard_bytes``: sharded as Apple ships its checkpoints (``model-0000k-of-0000N.safetensors`` of at
    most that many bytes and ``model.safetensors.index.json``, written tensor by tensor by
    `vlmrun.checkpoint_shards.write_shards`) instead of one ``model.safetensors``.
    """
    src, cfg = read_config(native_dir)
    fmt = detect_format(src)
    if fmt != NATIVE:
        raise InputError(f"{src} is a {fmt} checkpoint; expected a transformers-native 'fast_vlm' one")

    def build(tmp: pathlib.Path) -> None:
        _save_apple(src, cfg, tmp, dtype, shard_bytes)

    return write_checkpoint_dir(out_dir, build)


def _save_apple(src: pathlib.Path, cfg: dict, tmp: pathlib.Path, dtype: Any = None,
                shard_bytes: int | None = None) -> None:
    import torch

    text = dict(cfg.get("text_config") or {})
    vision = dict(cfg.get("vision_config") or {})
    if vision.get("architecture", "fastvit_mci3") != "fastvit_mci3":
        raise InputError(f"{src}: vision tower {vision.get('architecture')!r}; expected timm 'fastvit_mci3'")
    image_token_id = cfg.get("image_token_id", cfg.get("image_token_index"))
    if not isinstance(image_token_id, int):
        raise InputError(f"{src}/config.json has no image_token_id; expected a FastVLM config")

    tensors = load_tensors(src)
    if NATIVE_EMBED not in tensors:
        raise InputError(f"{src} has no {NATIVE_EMBED}; expected FastVLM weights")
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    embed = tensors[NATIVE_EMBED]
    v_native = int(embed.shape[0])
    tie = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    if tie:
        tensors.pop(NATIVE_LM_HEAD, None)

    # -- tokenizer without <image>
    n_apple = write_apple_tokenizer(src, tmp, image_token_id)
    v_apple = min(v_native, max(n_apple, v_native - 64))  # 152000 -> 151936 for FastVLM-0.5B
    extra = {"embed": embed[v_apple:]}
    tensors[NATIVE_EMBED] = embed[:v_apple]
    if not tie:
        lm_head = tensors[NATIVE_LM_HEAD]
        extra["lm_head"] = lm_head[v_apple:]
        tensors[NATIVE_LM_HEAD] = lm_head[:v_apple]
    if v_apple < v_native:
        save_tensors(extra, tmp / EXTRA_ROWS_FILE)

    # -- weights under Apple's names
    apple = {native_key_to_apple(k): v for k, v in tensors.items()}
    hidden = int(vision.get("hidden_size") or 3072)
    apple[APPLE_HEAD_PROJ] = torch.zeros((hidden, 768), dtype=embed.dtype)  # MCi's CLIP projection; unused
    if shard_bytes:
        from .checkpoint_shards import TensorSpec, write_shards

        write_shards(tmp, [TensorSpec(k, tuple(v.shape), v.dtype, lambda v=v: v) for k, v in apple.items()],
                     shard_bytes)
    else:
        save_tensors(apple, tmp / "model.safetensors")

    # -- config.json as Apple's
    image_size = image_size_from_processor(src) or int(round(cfg.get("image_seq_length", 256) ** 0.5)) * PATCH_SIZE
    out = apple_config(text, vision, image_size=image_size, vocab_rows=v_apple, tie=tie, dtype=embed.dtype)
    (tmp / "config.json").write_text(json.dumps(out, indent=2) + "\n", encoding="utf-8")
    if (src / "generation_config.json").is_file():
        shutil.copyfile(src / "generation_config.json", tmp / "generation_config.json")
    fastvlm_image_processor(image_size).save_pretrained(str(tmp))


def apple_config(text: dict, vision: dict, *, image_size: int, vocab_rows: int, tie: bool, dtype: Any) -> dict:
    """Apple's ``config.json`` (as apple/FastVLM-0.5B's, keys sorted) from a native ``text_config`` /
    ``vision_config`` (dicts): Qwen2 keys at the top level, Apple's llava keys, ``mm_vision_tower``
    ``mobileclip_l_<image_size>``, and a ``vision_config`` block (not in Apple's config) recording the timm
    tower's build arguments, so the conversion rebuilds the same architecture."""
    hidden = int(vision.get("hidden_size") or 3072)
    out: dict[str, Any] = {"architectures": [APPLE_ARCH], "model_type": APPLE}
    for key in APPLE_QWEN2_CONFIG_KEYS:
        if key in text:
            out[key] = text[key]
    rope = text.get("rope_parameters") or {}
    if "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    out["vocab_size"] = vocab_rows
    out["tie_word_embeddings"] = tie
    out.update(_APPLE_LLAVA_KEYS)
    out["mm_hidden_size"] = hidden
    out["mm_vision_tower"] = f"mobileclip_l_{image_size}"
    out["torch_dtype"] = str(dtype).replace("torch.", "")
    out["vision_config"] = {
        "architecture": "fastvit_mci3",
        "hidden_size": hidden,
        "model_args": vision.get("model_args") or {"inference_mode": True},
    }
    return dict(sorted(out.items()))


def write_apple_tokenizer(src: pathlib.Path, tmp: pathlib.Path, image_token_id: int) -> int:
    """Copy the tokenizer of the native checkpoint ``src`` into ``tmp`` without the <image> token (it must be
    the last id); returns the number of token ids Apple's tokenizer uses."""
    tok = read_json(src / "tokenizer.json", "a tokenizers tokenizer.json")
    vocab = tok.get("model", {}).get("vocab")
    added = tok.get("added_tokens") or []
    if not isinstance(vocab, dict):
        raise InputError(f"{src}/tokenizer.json has no BPE vocabulary; expected Qwen2's byte-level BPE")
    ids = set(vocab.values()) | {t["id"] for t in added}
    if max(ids) != image_token_id:
        raise InputError(
            f"{src}: <image> has id {image_token_id}, not the last id {max(ids)}; Apple's format appends it,"
            " so it must be the tokenizer's last token"
        )
    tok["added_tokens"] = [t for t in added if t["content"] != IMAGE_TOKEN]
    if vocab.get(IMAGE_TOKEN) == image_token_id:
        del vocab[IMAGE_TOKEN]
    (tmp / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")

    tcfg = {}
    if (src / "tokenizer_config.json").is_file():
        tcfg = read_json(src / "tokenizer_config.json", "a tokenizer_config.json")
    for key in ("extra_special_tokens", "additional_special_tokens"):
        value = tcfg.get(key)
        if isinstance(value, list):
            tcfg[key] = [t for t in value if (t.get("content") if isinstance(t, dict) else t) != IMAGE_TOKEN]
        elif isinstance(value, dict):
            tcfg[key] = {k: v for k, v in value.items() if v != IMAGE_TOKEN}
    decoder = tcfg.get("added_tokens_decoder")
    if isinstance(decoder, dict):
        decoder.pop(str(image_token_id), None)
    for key in ("processor_class", "image_token", "chat_template"):
        tcfg.pop(key, None)
    tcfg["tokenizer_class"] = "Qwen2Tokenizer"
    tcfg["chat_template"] = QWEN2_CHAT_TEMPLATE
    (tmp / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n", encoding="utf-8")

    n_apple = len(load_qwen2_tokenizer(tmp))
    if n_apple != image_token_id:
        raise InputError(f"{src}: the tokenizer without <image> has {n_apple} tokens, expected {image_token_id}")
    return n_apple
