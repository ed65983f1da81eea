"""FastVLM checkpoint formats: detect them, and convert Apple's original format to transformers' native one.

Two checkpoint formats exist (see ``/work/shared/reference/fastvlm.md``):

* `NATIVE` (``model_type: fast_vlm``): ``FastVlmForConditionalGeneration`` -- a ``TimmWrapperModel`` around
  timm's ``fastvit_mci3``, ``multi_modal_projector.linear_1/2`` and a Qwen2 decoder; an ``<image>`` token that the
  processor repeats ``image_seq_length`` times; ``LlavaProcessor`` (patch size 64) + ``CLIPImageProcessor``.
* `APPLE` (``model_type: llava_qwen2``): Apple's ``LlavaQwen2ForCausalLM`` (github apple/ml-fastvlm) -- the
  MobileCLIP ``MCi`` tower under ``model.vision_tower.vision_tower.model.*``, ``model.mm_projector.0/2``, the Qwen2
  keys at ``model.*``; no ``<image>`` token (Apple's code splices an ``IMAGE_TOKEN_INDEX = -200`` placeholder).

This module is the one place to import them from; each job lives in its own module:

* `vlmrun.checkpoint_formats`: the formats' names, `detect_format`, `check_shards`, and reading a checkpoint
  directory's config, weights (sharded ones through ``model.safetensors.index.json``) and tokenizer;
* `vlmrun.checkpoint_keys`: the weight renames, `apple_key_to_native` and its inverse `native_key_to_apple`;
* `vlmrun.checkpoint_convert`: `convert_apple_to_native`, after transformers' ``convert_fastvlm_weights_to_hf.py``,
  which also writes `CONVERSION_FILE`;
* `vlmrun.checkpoint_to_apple`: `save_as_apple`, the inverse, used by the tests (with `EXTRA_ROWS_FILE`, so that
  the round trip is lossless);
* `vlmrun.checkpoint_digest`: `conversion_inputs` and `conversion_digest`, the artifact store's key for a
  converted checkpoint;
* `vlmrun.fastvlm_files` (shared with the tiny-model builder): the chat template, processor and config a native
  checkpoint holds.

`detect_layout` is the former name of `detect_format`, kept for callers of the old name.

torch, transformers' model classes and safetensors' torch API are imported inside the functions only.
"""

from __future__ import annotations

from .checkpoint_convert import CONVERSION_FILE, convert_apple_to_native
from .checkpoint_digest import FILE_HASHES, conversion_digest, conversion_inputs
from .checkpoint_formats import (
    APPLE,
    APPLE_IMAGE_TOKEN_INDEX,
    EXTRA_ROWS_FILE,
    NATIVE,
    SAFETENSORS_INDEX,
    CheckpointFormat,
    check_shards,
    detect_format,
)
from .checkpoint_keys import apple_key_to_native, native_key_to_apple
from .checkpoint_to_apple import QWEN2_CHAT_TEMPLATE, save_as_apple
from .fastvlm_files import IMAGE_TOKEN, PATCH_SIZE

__all__ = [
    "CheckpointFormat",
    "NATIVE",
    "APPLE",
    "EXTRA_ROWS_FILE",
    "CONVERSION_FILE",
    "SAFETENSORS_INDEX",
    "FILE_HASHES",
    "PATCH_SIZE",
    "IMAGE_TOKEN",
    "APPLE_IMAGE_TOKEN_INDEX",
    "QWEN2_CHAT_TEMPLATE",
    "detect_format",
    "check_shards",
    "conversion_inputs",
    "conversion_digest",
    "convert_apple_to_native",
    "save_as_apple",
    "apple_key_to_native",
    "native_key_to_apple",
]

#: The former name of `detect_format` (when "layout" also meant a checkpoint's format).
detect_layout = detect_format
