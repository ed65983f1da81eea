"""Weight names in the two FastVLM checkpoint formats, and the renames between them.

Apple's format (``llava_qwen2``) keeps the MobileCLIP ``MCi`` tower under ``model.vision_tower.vision_tower.model.*``,
the projector at ``model.mm_projector.0/2`` and the Qwen2 keys at ``model.*``; the native format (``fast_vlm``) has
a ``TimmWrapperModel`` around timm's ``fastvit_mci3`` (``model.vision_tower.timm_model.*``),
``model.multi_modal_projector.linear_1/2`` and ``model.language_model.*``. `apple_key_to_native` applies the
renames of transformers' conversion script (huggingface/transformers
``src/transformers/models/fast_vlm/convert_fastvlm_weights_to_hf.py``) in the script's order;
`native_key_to_apple` inverts it, checked key by key.
"""

from __future__ import annotations

import re

from .errors import InputError

__all__ = [
    "apple_key_to_native",
    "native_key_to_apple",
    "APPLE_VISION_PREFIX",
    "APPLE_STAGE_BLOCKS",
    "APPLE_HEAD_PROJ",
    "APPLE_EMBED",
    "APPLE_LM_HEAD",
    "NATIVE_EMBED",
    "NATIVE_LM_HEAD",
]

# Apple: LlavaQwen2ForCausalLM.model.vision_tower (MobileCLIPVisionTower).vision_tower (MCi).model (FastViT).
APPLE_VISION_PREFIX = "model.vision_tower.vision_tower.model."
NATIVE_VISION_PREFIX = "model.vision_tower.timm_model."
APPLE_HEAD_PROJ = APPLE_VISION_PREFIX + "head.proj"  # MCi's CLIP projection (GlobalPool2D); not used by FastVLM
APPLE_EMBED = "model.embed_tokens.weight"
APPLE_LM_HEAD = "lm_head.weight"
NATIVE_EMBED = "model.language_model.embed_tokens.weight"
NATIVE_LM_HEAD = "lm_head.weight"

# --------------------------------------------------------------------------------------------------------------
# key renames: transformers' convert_fastvlm_weights_to_hf.py (KEYS_TO_MODIFY_MAPPING, map_to_stage,
# convert_state_dict_to_hf), applied in the script's order.

_KEYS_TO_MODIFY = (
    ("model.vision_tower.vision_tower.model", "model.vision_tower.timm_model"),
    ("patch_embed", "stem"),
    ("layers", "language_model.layers"),
    ("embed_tokens", "language_model.embed_tokens"),
    ("layer_scale_1", "layer_scale_1.gamma"),
    ("layer_scale_2", "layer_scale_2.gamma"),
    ("mm_projector.0", "multi_modal_projector.linear_1"),
    ("mm_projector.2", "multi_modal_projector.linear_2"),
    ("conv_exp", "final_conv"),
    ("se.reduce", "se.fc1"),
    ("se.expand", "se.fc2"),
    ("convffn", "mlp"),
    ("lkb_reparam", "reparam_conv"),
)

# Apple's FastViT keeps one flat ``network`` list: stage blocks, PatchEmbed downsamplers and RepCPE positional
# encodings (stages 3 and 4). The script's map_to_stage: 0 -> 0, 1-2 -> 1, 3-4 -> 2, 5-7 -> 3, 8-10 -> 4.
_NETWORK_TO_STAGE = {0: 0, 1: 1, 2: 1, 3: 2, 4: 2, 5: 3, 6: 3, 7: 3, 8: 4, 9: 4, 10: 4}
# Inverse, stage -> index in the flat list, from Apple's mci.py FastViT.__init__ order (blocks, [PatchEmbed],
# [RepCPE], blocks, ...): each stage's blocks, its downsampler and its positional encoding.
APPLE_STAGE_BLOCKS = {0: 0, 1: 2, 2: 4, 3: 7, 4: 10}
_STAGE_DOWNSAMPLE = {1: 1, 2: 3, 3: 5, 4: 8}
_STAGE_POS_EMB = {3: 6, 4: 9}

_DOUBLE = re.compile(r"network\.(\d{1,2})\.(\d{1,2})")
_SINGLE = re.compile(r"network\.(\d{1,2})")
_POS_EMB = re.compile(r"stages\.(\d{1,2})\.reparam_conv")


def apple_key_to_native(key: str) -> str:
    """Rename one Apple (``llava_qwen2``) state-dict key to the native (``fast_vlm``) key, as the script does."""
    if key.endswith("layer_scale"):
        key = key.replace("layer_scale", "layer_scale.gamma")
    if key.startswith("model.norm"):
        key = key.replace("model.norm", "model.language_model.norm")
    if "token_mixer" not in key:
        key = key.replace(".proj.", ".downsample.proj.")
    matches = _DOUBLE.findall(key)
    if len(matches) == 1:
        a, b = matches[0]
        key = key.replace(f"network.{a}.{b}", f"stages.{_NETWORK_TO_STAGE[int(a)]}.blocks.{b}")
    matches = _SINGLE.findall(key)
    if len(matches) == 1:
        (a,) = matches
        key = key.replace(f"network.{a}", f"stages.{_NETWORK_TO_STAGE[int(a)]}")
    matches = _POS_EMB.findall(key)
    if len(matches) == 1:
        (s,) = matches
        key = key.replace(f"stages.{s}", f"stages.{s}.pos_emb")
    for old, new in _KEYS_TO_MODIFY:
        if old in key:
            key = key.replace(old, new)
    return key


def _native_vision_to_apple(rel: str) -> str:
    """Inverse rename of a key relative to ``timm_model.`` (FastViT in timm) to Apple's MCi FastViT."""
    m = re.fullmatch(r"stem\.(\d+)\.(.+)", rel)
    if m:
        return f"patch_embed.{m[1]}.{m[2]}"
    if rel.startswith("final_conv."):
        rest = rel[len("final_conv."):].replace("se.fc1.", "se.reduce.").replace("se.fc2.", "se.expand.")
        return "conv_exp." + rest
    m = re.fullmatch(r"stages\.(\d+)\.downsample\.proj\.(\d+)\.(.+)", rel)
    if m and int(m[1]) in _STAGE_DOWNSAMPLE:
        rest = m[3]
        if m[2] == "0":  # PatchEmbed.proj[0] is a ReparamLargeKernelConv: its fused conv is `lkb_reparam`
            rest = rest.replace("reparam_conv", "lkb_reparam")
        return f"network.{_STAGE_DOWNSAMPLE[int(m[1])]}.proj.{m[2]}.{rest}"
    m = re.fullmatch(r"stages\.(\d+)\.pos_emb\.(.+)", rel)
    if m and int(m[1]) in _STAGE_POS_EMB:
        return f"network.{_STAGE_POS_EMB[int(m[1])]}.{m[2]}"
    m = re.fullmatch(r"stages\.(\d+)\.blocks\.(\d+)\.(.+)", rel)
    if m and int(m[1]) in APPLE_STAGE_BLOCKS:
        rest = m[3]
        if rest.startswith("mlp."):
            rest = "convffn." + rest[len("mlp."):]
        rest = re.sub(r"^(layer_scale(?:_1|_2)?)\.gamma$", r"\1", rest)
        return f"network.{APPLE_STAGE_BLOCKS[int(m[1])]}.{m[2]}.{rest}"
    raise ValueError(rel)


def native_key_to_apple(key: str) -> str:
    """Rename one native (``fast_vlm``) key to Apple's; checked to invert `apple_key_to_native` exactly."""
    if key.startswith(NATIVE_VISION_PREFIX):
        try:
            apple = APPLE_VISION_PREFIX + _native_vision_to_apple(key[len(NATIVE_VISION_PREFIX):])
        except ValueError:
            apple = None
    elif key.startswith("model.multi_modal_projector.linear_1."):
        apple = "model.mm_projector.0." + key[len("model.multi_modal_projector.linear_1."):]
    elif key.startswith("model.multi_modal_projector.linear_2."):
        apple = "model.mm_projector.2." + key[len("model.multi_modal_projector.linear_2."):]
    elif key.startswith("model.language_model."):
        apple = "model." + key[len("model.language_model."):]
    elif key.startswith("lm_head."):
        apple = key
    else:
        apple = None
    if apple is None or apple_key_to_native(apple) != key:
        raise InputError(
            f"weight {key!r} has no Apple llava_qwen2 counterpart; expected a FastVLM (fastvit_mci3) checkpoint"
        )
    return apple
