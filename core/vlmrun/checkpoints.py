"""FastVLM checkpoint layouts: detect them, and convert Apple's original layout to transformers' native one.

Two layouts exist (see ``/work/shared/reference/fastvlm.md``):

* `NATIVE` (``model_type: fast_vlm``): ``FastVlmForConditionalGeneration`` -- a ``TimmWrapperModel`` around
  timm's ``fastvit_mci3``, ``multi_modal_projector.linear_1/2`` and a Qwen2 decoder; an ``<image>`` token that the
  processor repeats ``image_seq_length`` times; ``LlavaProcessor`` (patch size 64) + ``CLIPImageProcessor``.
* `APPLE` (``model_type: llava_qwen2``): Apple's ``LlavaQwen2ForCausalLM`` (github apple/ml-fastvlm) -- the
  MobileCLIP ``MCi`` tower under ``model.vision_tower.vision_tower.model.*``, ``model.mm_projector.0/2``, the Qwen2
  keys at ``model.*``; no ``<image>`` token (Apple's code splices an ``IMAGE_TOKEN_INDEX = -200`` placeholder).

`convert_apple_to_native` follows transformers' conversion script
(huggingface/transformers ``src/transformers/models/fast_vlm/convert_fastvlm_weights_to_hf.py``): the same key
renames, ``head.proj`` dropped, an ``<image>`` token appended to the tokenizer (it takes the place of Apple's -200
placeholder and its id becomes ``image_token_id``), the vocabulary grown by one row and padded to a multiple of 64,
``image_seq_length = (image_size / 64) ** 2``, ``LlavaProcessor`` + ``CLIPImageProcessor`` (mean 0, std 1, bicubic,
shortest edge = crop = image size) with ``patch_size`` 64. It never runs remote code. Differences from the script:
the new vocabulary rows are set to the mean embedding row (the script samples them from N(mean, 1e-5 * cov), i.e.
the same up to noise), and the chat template is the project's rendering of Apple's ``qwen_2`` conversation
(``vlmrun.tiny.CHAT_TEMPLATE``; the script's template renders the same prompt for an image + text user turn but
drops string contents such as a system prompt).

`save_as_apple` is the inverse, used by the tests to make an Apple-layout checkpoint from a native one. Apple's
layout has no room for the native vocabulary rows past Apple's ``vocab_size`` (the ``<image>`` row and the padding);
so that the round trip is lossless it stores them in a side file, `EXTRA_ROWS_FILE`, which
`convert_apple_to_native` uses instead of the mean rows when present. Real Apple checkpoints have no such file.

The conversion also writes `CONVERSION_FILE` (Apple's ``vocab_size`` among others: the sampler never picks
the rows past it, which Apple's model does not have). `conversion_digest` hashes every file that shapes a
conversion (weights, config, generation config, tokenizer files, chat template, processor config); the
artifact store keys converted checkpoints by it. A sharded checkpoint is read through its
``model.safetensors.index.json``, and a shard it lists but the directory lacks is named.

torch, transformers' model classes and safetensors' torch API are imported inside the functions only.
"""

from __future__ import annotations

import json
import os
import pathlib
import re
import shutil
from typing import Any

from .atomic import atomic_directory
from .errors import InputError

__all__ = [
    "NATIVE",
    "APPLE",
    "EXTRA_ROWS_FILE",
    "CONVERSION_FILE",
    "detect_layout",
    "check_shards",
    "conversion_inputs",
    "conversion_digest",
    "convert_apple_to_native",
    "save_as_apple",
    "apple_key_to_native",
    "native_key_to_apple",
]

NATIVE = "fast_vlm"
APPLE = "llava_qwen2"

#: Side file written by `save_as_apple`: native vocabulary rows beyond Apple's ``vocab_size``.
EXTRA_ROWS_FILE = "vlmrun_extra_vocab_rows.safetensors"
#: Written by `convert_apple_to_native` beside the converted checkpoint: what the source model was
#: (``source_vocab_size``: the rows Apple's model has; the rows past it exist only for ``<image>`` and padding).
CONVERSION_FILE = "vlmrun_conversion.json"
#: A sharded checkpoint's map of weight name -> shard file (transformers' name).
SAFETENSORS_INDEX = "model.safetensors.index.json"

#: FastViTHD's total stride: one image token per 64 x 64 pixels.
PATCH_SIZE = 64
IMAGE_TOKEN = "<image>"
#: Apple's placeholder id in prompts (llava.constants.IMAGE_TOKEN_INDEX); it becomes the native <image> token.
APPLE_IMAGE_TOKEN_INDEX = -200

_APPLE_ARCH = "LlavaQwen2ForCausalLM"
_NATIVE_ARCH = "FastVlmForConditionalGeneration"

# Apple: LlavaQwen2ForCausalLM.model.vision_tower (MobileCLIPVisionTower).vision_tower (MCi).model (FastViT).
_APPLE_VISION_PREFIX = "model.vision_tower.vision_tower.model."
_NATIVE_VISION_PREFIX = "model.vision_tower.timm_model."
_APPLE_HEAD_PROJ = _APPLE_VISION_PREFIX + "head.proj"  # MCi's CLIP projection (GlobalPool2D); not used by FastVLM
_APPLE_EMBED = "model.embed_tokens.weight"
_APPLE_LM_HEAD = "lm_head.weight"
_NATIVE_EMBED = "model.language_model.embed_tokens.weight"
_NATIVE_LM_HEAD = "lm_head.weight"

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
# Inverse, from Apple's mci.py FastViT.__init__ order (blocks, [PatchEmbed], [RepCPE], blocks, ...):
_STAGE_BLOCKS = {0: 0, 1: 2, 2: 4, 3: 7, 4: 10}
_STAGE_DOWNSAMPLE = {1: 1, 2: 3, 3: 5, 4: 8}
_STAGE_POS_EMB = {3: 6, 4: 9}

# timm fastvit_mci3 defaults (timm/models/fastvit.py)
_MCI3_DEFAULTS = {
    "layers": [2, 12, 24, 4, 2],
    "embed_dims": [96, 192, 384, 768, 1536],
    "mlp_ratios": [4, 4, 4, 4, 4],
}

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
    if m and int(m[1]) in _STAGE_BLOCKS:
        rest = m[3]
        if rest.startswith("mlp."):
            rest = "convffn." + rest[len("mlp."):]
        rest = re.sub(r"^(layer_scale(?:_1|_2)?)\.gamma$", r"\1", rest)
        return f"network.{_STAGE_BLOCKS[int(m[1])]}.{m[2]}.{rest}"
    raise ValueError(rel)


def native_key_to_apple(key: str) -> str:
    """Rename one native (``fast_vlm``) key to Apple's; checked to invert `apple_key_to_native` exactly."""
    if key.startswith(_NATIVE_VISION_PREFIX):
        try:
            apple = _APPLE_VISION_PREFIX + _native_vision_to_apple(key[len(_NATIVE_VISION_PREFIX):])
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


# --------------------------------------------------------------------------------------------------------------
# layout detection


def _read_json(path: pathlib.Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path} is missing; expected {what}") from None
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {path} ({exc}); expected {what}") from None
    if not isinstance(data, dict):
        raise InputError(f"{path} is not a JSON object; expected {what}")
    return data


def _read_config(model_dir: str | os.PathLike) -> tuple[pathlib.Path, dict]:
    path = pathlib.Path(model_dir).expanduser()
    expected = "a FastVLM checkpoint directory (config.json with model_type 'fast_vlm' or 'llava_qwen2')"
    if not path.exists():
        raise InputError(f"checkpoint directory {path} does not exist; expected {expected}")
    if not path.is_dir():
        raise InputError(f"{path} is not a directory; expected {expected}")
    if not (path / "config.json").is_file():
        raise InputError(f"{path} has no config.json; expected {expected}")
    return path, _read_json(path / "config.json", "a FastVLM config.json")


def detect_layout(model_dir: str | os.PathLike) -> str:
    """`NATIVE` or `APPLE`, from ``config.json``; `InputError` for anything that is not FastVLM."""
    path, cfg = _read_config(model_dir)
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if model_type == NATIVE:
        return NATIVE
    if model_type == APPLE or _APPLE_ARCH in archs:
        tower = cfg.get("mm_vision_tower")
        if not (isinstance(tower, str) and tower.startswith("mobileclip")):
            raise InputError(
                f"{path} is a llava_qwen2 checkpoint whose vision tower is {tower!r}, not FastVLM's MobileCLIP;"
                " expected mm_vision_tower 'mobileclip_l_<size>' (Apple FastVLM) or a 'fast_vlm' checkpoint"
            )
        return APPLE
    found = f"model_type {model_type!r}" + (f" ({', '.join(map(str, archs))})" if archs else "")
    raise InputError(
        f"{path} holds a {found} checkpoint, not FastVLM; expected model_type 'fast_vlm'"
        " (transformers-native) or 'llava_qwen2' (Apple's FastVLM)"
    )


# --------------------------------------------------------------------------------------------------------------
# helpers


def _atomic_dir(out_dir: str | os.PathLike, build) -> pathlib.Path:
    """Run ``build(tmp)`` in a temporary sibling of ``out_dir`` and rename it onto ``out_dir``."""
    out = pathlib.Path(out_dir).expanduser().absolute()
    if os.path.lexists(out) and (not out.is_dir() or out.is_symlink() or any(out.iterdir())):
        raise InputError(f"output directory {out} already exists and is not empty; remove it or choose another one")
    with atomic_directory(out) as tmp:  # an empty existing out_dir is replaced
        build(tmp)
    return out


def _indexed_weight_files(path: pathlib.Path) -> list[pathlib.Path] | None:
    """The shards `SAFETENSORS_INDEX` names (``None`` without an index); a missing shard is named."""
    index = path / SAFETENSORS_INDEX
    if not index.is_file():
        return None
    weight_map = _read_json(index, "a safetensors index with a weight_map").get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map or not all(isinstance(f, str) for f in weight_map.values()):
        raise InputError(f"{index} has no weight_map of weight name -> shard file; expected a safetensors index")
    names = sorted(set(weight_map.values()))
    if any(pathlib.PurePath(n).name != n or n in (".", "..") for n in names):
        raise InputError(f"{index} names shard files outside {path}; expected plain file names")
    missing = [n for n in names if not (path / n).is_file()]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise InputError(
            f"{path}: shard {missing[0]}{more} is missing; {SAFETENSORS_INDEX} lists {len(names)} shard files and"
            f" {len(names) - len(missing)} are present; copy or download the missing shard"
        )
    return [path / n for n in names]


def check_shards(model_dir: str | os.PathLike) -> None:
    """Raise `InputError` naming a shard that ``model.safetensors.index.json`` lists but is missing."""
    _indexed_weight_files(pathlib.Path(model_dir).expanduser())


def _weight_files(path: pathlib.Path) -> list[pathlib.Path]:
    indexed = _indexed_weight_files(path)
    if indexed is not None:
        return indexed  # as transformers does: with an index, only the shards it names are weights
    files = sorted(p for p in path.glob("*.safetensors") if p.name != EXTRA_ROWS_FILE)
    if not files:
        bins = sorted(p.name for p in path.glob("*.bin"))
        hint = f" (found {', '.join(bins)}; only safetensors are read)" if bins else ""
        raise InputError(f"{path} has no *.safetensors weights{hint}; expected model.safetensors")
    return files


def _load_tensors(path: pathlib.Path) -> dict:
    from safetensors import safe_open

    tensors: dict = {}
    for file in _weight_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for key in f.keys():
                    if key in tensors:
                        raise InputError(f"weight {key!r} appears in more than one file in {path}; expected each once")
                    tensors[key] = f.get_tensor(key)
        except InputError:
            raise
        except Exception as exc:  # safetensors raises its own error types
            raise InputError(f"cannot read {file} ({exc}); expected a safetensors file") from None
    index = path / SAFETENSORS_INDEX
    if index.is_file():
        weight_map = _read_json(index, "a safetensors index")["weight_map"]
        absent = sorted(k for k in weight_map if k not in tensors)
        if absent:
            raise InputError(
                f"{path}: {SAFETENSORS_INDEX} puts {_some(absent)} in {weight_map[absent[0]]}, which does not hold"
                " them; expected the shards the index was written for"
            )
    return tensors


def _save_tensors(tensors: dict, file: pathlib.Path) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(file), metadata={"format": "pt"})


def _some(keys: list[str]) -> str:
    return str(keys[:3])[:-1] + (", ...]" if len(keys) > 3 else "]")


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _image_size_from_tower(name: Any) -> int | None:
    # Apple's MobileCLIPVisionTower: input_image_size = int(vision_tower.split("_")[-1])
    try:
        return int(str(name).split("_")[-1])
    except ValueError:
        return None


def _image_size_from_processor(path: pathlib.Path) -> int | None:
    for name in ("preprocessor_config.json", "processor_config.json"):
        file = path / name
        if not file.is_file():
            continue
        cfg = _read_json(file, "an image processor config")
        cfg = cfg.get("image_processor", cfg)
        crop = cfg.get("crop_size") or cfg.get("size")
        if isinstance(crop, dict):
            crop = crop.get("height") or crop.get("shortest_edge")
        if isinstance(crop, int):
            return crop
    return None


def _infer_tower(tensors: dict) -> dict:
    """layers / embed_dims / mlp_ratios / hidden size of Apple's FastViT from the weight shapes."""
    layers, dims, ratios = [], [], []
    for stage, net in sorted(_STAGE_BLOCKS.items()):
        prefix = f"{_APPLE_VISION_PREFIX}network.{net}."
        blocks = {int(k[len(prefix):].split(".", 1)[0]) for k in tensors if k.startswith(prefix)}
        fc1 = tensors.get(f"{prefix}0.convffn.fc1.weight")
        if not blocks or fc1 is None:
            raise InputError(
                f"the vision tower has no FastViTHD blocks for stage {stage} ({prefix}0.convffn.fc1.weight);"
                " expected Apple's MobileCLIP (mobileclip_l) tower in inference (reparameterized) form"
            )
        layers.append(len(blocks))
        dims.append(int(fc1.shape[1]))
        ratio = fc1.shape[0] / fc1.shape[1]
        ratios.append(int(ratio) if float(ratio).is_integer() else float(ratio))
    conv_exp = tensors.get(_APPLE_VISION_PREFIX + "conv_exp.reparam_conv.weight")
    if conv_exp is None:
        raise InputError(
            "the vision tower has no conv_exp.reparam_conv.weight; expected Apple's MobileCLIP tower in"
            " inference (reparameterized) form"
        )
    return {"layers": layers, "embed_dims": dims, "mlp_ratios": ratios, "hidden_size": int(conv_exp.shape[0])}


# Qwen2 keys that Apple's llava_qwen2 config.json holds at its top level.
_QWEN2_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
    "use_cache", "tie_word_embeddings", "rope_theta", "rope_scaling", "use_sliding_window", "sliding_window",
    "max_window_layers", "attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id",
)  # fmt: skip

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


def _load_qwen2_tokenizer(path: pathlib.Path):
    """The Qwen2 tokenizer of a checkpoint dir (Qwen2Tokenizer directly: AutoTokenizer would need the config class)."""
    from transformers import Qwen2Tokenizer

    if not (path / "tokenizer.json").is_file() and not (path / "vocab.json").is_file():
        raise InputError(f"{path} has no tokenizer (tokenizer.json or vocab.json + merges.txt); expected Qwen2's")
    try:
        return Qwen2Tokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise InputError(f"cannot load the Qwen2 tokenizer in {path} ({type(exc).__name__}: {exc})") from None


# --------------------------------------------------------------------------------------------------------------
# what a conversion depends on

#: Suffixes of the configuration and tokenizer files a conversion reads (config.json, generation_config.json,
#: preprocessor_config.json, tokenizer.json, tokenizer_config.json, vocab.json, merges.txt, added_tokens.json,
#: special_tokens_map.json, chat_template.jinja / .json, ...).
_INPUT_SUFFIXES = frozenset({".json", ".txt", ".jinja", ".model", ".tiktoken"})
#: Files that describe the checkpoint to people, not to the conversion.
_NOT_INPUTS = re.compile(r"(readme|licen[cs]e|notice|copying|citation)([._-].*)?", re.IGNORECASE)
#: Per-file hash cache in the artifact store's root (for weight files over the store's full-hash limit).
FILE_HASHES = "file-hashes.json"


def conversion_inputs(model_dir: str | os.PathLike) -> list[pathlib.Path]:
    """Every file of a checkpoint directory that shapes its conversion, sorted by name.

    The weights the conversion reads (the shards ``model.safetensors.index.json`` names, else every
    ``*.safetensors``, plus `EXTRA_ROWS_FILE`) and every configuration, tokenizer, chat-template and
    processor file (``*.json``, ``*.txt``, ``*.jinja``, ...), whatever its name, so that a tokenizer stored as
    vocab.json + merges.txt + added_tokens.json counts as much as a tokenizer.json. READMEs, licences and hidden
    files do not count. A shard the index lists but the directory lacks raises `InputError` naming it.
    """
    path = pathlib.Path(model_dir).expanduser()
    files = {p.name: p for p in _weight_files(path)}
    for p in path.iterdir():
        if p.name.startswith(".") or _NOT_INPUTS.fullmatch(p.name):
            continue
        if (p.suffix.lower() in _INPUT_SUFFIXES or p.name == EXTRA_ROWS_FILE) and p.is_file():
            files[p.name] = p
    return [files[name] for name in sorted(files)]


def conversion_digest(model_dir: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> str:
    """sha256 (16 hex digits) over the names and contents of `conversion_inputs`: the conversion's key.

    Files up to the store's full-hash limit (every tokenizer and config file) are hashed on every call; a larger
    weight file's hash is kept in ``cache_dir/```FILE_HASHES` and reused while its size, mtime, ctime and
    inode are unchanged (as the store does for its own multi-GB files).
    """
    import hashlib

    from . import store as store_mod

    cache_file = pathlib.Path(cache_dir) / FILE_HASHES if cache_dir is not None else None
    cache: dict = {}
    if cache_file is not None and cache_file.is_file():
        try:
            cache = json.loads(cache_file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            cache = {}
        if not isinstance(cache, dict):
            cache = {}
    changed = False
    h = hashlib.sha256()
    for file in conversion_inputs(model_dir):
        st = file.stat()
        stamp = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino]
        where = str(file.resolve())
        entry = cache.get(where) if st.st_size > store_mod.FULL_HASH_LIMIT else None
        if isinstance(entry, dict) and entry.get("stamp") == stamp and isinstance(entry.get("sha256"), str):
            digest = entry["sha256"]
        else:
            digest = store_mod.sha256_file(file)
            if st.st_size > store_mod.FULL_HASH_LIMIT:
                cache[where] = {"stamp": stamp, "sha256": digest}
                changed = True
        h.update(f"{file.name}\0{digest}\n".encode())
    if changed and cache_file is not None:
        cache_file.parent.mkdir(parents=True, exist_ok=True)
        part = cache_file.with_name(f"{cache_file.name}.{os.getpid()}.tmp")
        part.write_text(json.dumps(cache), encoding="utf-8")
        os.replace(part, cache_file)
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------------------------------------------
# Apple -> native


def convert_apple_to_native(src_dir: str | os.PathLike, out_dir: str | os.PathLike) -> pathlib.Path:
    """Convert Apple's ``llava_qwen2`` FastVLM checkpoint into a transformers-native ``fast_vlm`` one at ``out_dir``.

    Follows transformers' ``convert_fastvlm_weights_to_hf.py`` (see the module docstring). Tensors keep their
    stored dtype. ``out_dir`` must not exist or be empty; it appears complete or not at all.
    """
    src, cfg = _read_config(src_dir)
    layout = detect_layout(src)
    if layout != APPLE:
        raise InputError(f"{src} is already a transformers-native ({layout}) checkpoint; expected Apple's llava_qwen2")
    if pathlib.Path(out_dir).expanduser().absolute() == src.absolute():
        raise InputError(f"output directory {out_dir} is the source directory; choose another one")

    def build(tmp: pathlib.Path) -> None:
        _convert_apple(src, cfg, tmp)

    return _atomic_dir(out_dir, build)


def _convert_apple(src: pathlib.Path, cfg: dict, tmp: pathlib.Path) -> None:
    import torch
    from tokenizers import AddedToken
    from transformers import (
        FastVlmForConditionalGeneration,
        GenerationConfig,
        Qwen2Config,
        TimmWrapperConfig,
    )

    from .tiny import CHAT_TEMPLATE, fastvlm_config, fastvlm_processor

    tensors = _load_tensors(src)
    tensors.pop(_APPLE_HEAD_PROJ, None)  # the script deletes MCi's CLIP head projection
    if _APPLE_EMBED not in tensors:
        raise InputError(f"{src} has no {_APPLE_EMBED}; expected Apple's llava_qwen2 weights")
    embed = tensors[_APPLE_EMBED]
    v_apple, hidden = int(embed.shape[0]), int(embed.shape[1])
    if int(cfg.get("vocab_size", v_apple)) != v_apple:
        raise InputError(f"{src}: config vocab_size {cfg.get('vocab_size')} but {_APPLE_EMBED} has {v_apple} rows")
    tie = bool(cfg.get("tie_word_embeddings", False))
    if tie:
        tensors.pop(_APPLE_LM_HEAD, None)  # tied: the decoder reads the embedding matrix
    elif _APPLE_LM_HEAD not in tensors:
        raise InputError(f"{src} has no {_APPLE_LM_HEAD} but tie_word_embeddings is false; expected an untied lm_head")

    # -- vision tower: timm fastvit_mci3 with the dims found in the weights
    tower = _infer_tower(tensors)
    mm_hidden = cfg.get("mm_hidden_size")
    if mm_hidden is not None and int(mm_hidden) != tower["hidden_size"]:
        raise InputError(
            f"{src}: mm_hidden_size {mm_hidden} but the vision tower outputs {tower['hidden_size']} channels;"
            " expected them to match"
        )
    if cfg.get("mm_projector_type", "mlp2x_gelu") != "mlp2x_gelu":
        raise InputError(f"{src}: mm_projector_type {cfg.get('mm_projector_type')!r}; expected 'mlp2x_gelu'")
    block = cfg.get("vision_config") if isinstance(cfg.get("vision_config"), dict) else {}
    arch = block.get("architecture", "fastvit_mci3")
    if arch != "fastvit_mci3":
        raise InputError(f"{src}: vision_config architecture {arch!r}; expected 'fastvit_mci3'")
    model_args = dict(block.get("model_args") or {})
    model_args["inference_mode"] = True
    for name in ("layers", "embed_dims", "mlp_ratios"):
        found = tower[name]
        if name in model_args:
            if [float(x) for x in model_args[name]] != [float(x) for x in found]:
                raise InputError(
                    f"{src}: vision_config {name} {list(model_args[name])} but the weights have {found};"
                    " expected them to match"
                )
        elif found != _MCI3_DEFAULTS[name]:
            model_args[name] = found
    vision_config = TimmWrapperConfig(
        architecture="fastvit_mci3",
        hidden_size=tower["hidden_size"],
        do_pooling=block.get("do_pooling", True),
        global_pool=block.get("global_pool", "avg"),
        initializer_range=block.get("initializer_range", 0.02),
        model_args=model_args,
    )
    vision_config.label2id = {}
    vision_config.id2label = {}

    # -- tokenizer: append <image> (Apple's -200 placeholder becomes a real token)
    tokenizer = _load_qwen2_tokenizer(src)
    if IMAGE_TOKEN not in tokenizer.get_vocab():
        tokenizer.add_tokens(AddedToken(IMAGE_TOKEN, special=True, normalized=False), special_tokens=True)
    image_token_id = int(tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
    tokenizer.chat_template = CHAT_TEMPLATE

    # -- vocabulary: one more row for <image>, padded to a multiple of 64 (the script's resize_token_embeddings)
    extra = _load_extra_rows(src, embed, None if tie else tensors[_APPLE_LM_HEAD])
    if extra is None:
        v_native = _round_up(v_apple + 1, 64)
        mean = embed.float().mean(dim=0, keepdim=True)
        extra = {name: mean.to(embed.dtype).expand(v_native - v_apple, hidden) for name in ("embed", "lm_head")}
    v_native = v_apple + int(extra["embed"].shape[0])
    if not (0 <= image_token_id < v_native) or len(tokenizer) > v_native:
        raise InputError(
            f"{src}: the tokenizer has {len(tokenizer)} tokens (<image> = {image_token_id}) but the vocabulary has"
            f" {v_native} rows; expected the tokenizer to fit the embedding matrix"
        )
    tensors[_APPLE_EMBED] = torch.cat([embed, extra["embed"]], dim=0)
    if not tie:
        lm_head = tensors[_APPLE_LM_HEAD]
        tensors[_APPLE_LM_HEAD] = torch.cat([lm_head, extra["lm_head"].to(lm_head.dtype)], dim=0)

    # -- text config: Apple's top-level Qwen2 keys
    text_kwargs = {k: cfg[k] for k in _QWEN2_KEYS if k in cfg and not (k == "rope_scaling" and cfg[k] is None)}
    text_kwargs["vocab_size"] = v_native
    text_kwargs["tie_word_embeddings"] = tie
    if int(text_kwargs.get("hidden_size", hidden)) != hidden:
        raise InputError(f"{src}: config hidden_size {text_kwargs['hidden_size']} but the embeddings are {hidden} wide")
    text_config = Qwen2Config(**text_kwargs)

    image_size = _image_size_from_tower(cfg.get("mm_vision_tower")) or _image_size_from_processor(src) or 1024
    if image_size % PATCH_SIZE:
        raise InputError(f"{src}: image size {image_size} is not a multiple of {PATCH_SIZE}; expected e.g. 1024")
    config = fastvlm_config(vision_config, text_config, image_token_id, image_size, tie)
    config.architectures = [_NATIVE_ARCH]
    config.dtype = embed.dtype

    # -- weights: rename, then check names and shapes against the native model (built on the meta device)
    native = {}
    for key, value in tensors.items():
        new = apple_key_to_native(key)
        if new in native:
            raise InputError(f"{src}: two weights map to {new!r}; expected Apple's llava_qwen2 key names")
        native[new] = value
    with torch.device("meta"):
        reference = FastVlmForConditionalGeneration(config).state_dict()
    if tie:
        reference.pop(_NATIVE_LM_HEAD, None)
    missing = sorted(set(reference) - set(native))
    unexpected = sorted(set(native) - set(reference))
    if missing or unexpected:
        raise InputError(
            f"{src}: weights do not match FastVLM after renaming (missing {_some(missing)}, unexpected"
            f" {_some(unexpected)}); expected Apple's FastVLM keys"
        )
    for key, ref in reference.items():
        if tuple(native[key].shape) != tuple(ref.shape):
            raise InputError(
                f"{src}: weight {key} has shape {tuple(native[key].shape)}, the model needs {tuple(ref.shape)};"
                " expected a consistent FastVLM checkpoint"
            )

    # -- write
    config.save_pretrained(str(tmp))
    _save_tensors(native, tmp / "model.safetensors")
    gen = {}
    if (src / "generation_config.json").is_file():
        gen = _read_json(src / "generation_config.json", "a generation config")
        gen.pop("transformers_version", None)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if gen.get(key) is None and getattr(text_config, key, None) is not None:
            gen[key] = getattr(text_config, key)
    GenerationConfig(**gen).save_pretrained(str(tmp))
    fastvlm_processor(tokenizer, image_size).save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    # from_pretrained's loading flags leak into the saved init kwargs; they describe the source, not the tokenizer
    tcfg_file = tmp / "tokenizer_config.json"
    tcfg = _read_json(tcfg_file, "the tokenizer_config.json just written")
    for key in ("is_local", "local_files_only"):
        tcfg.pop(key, None)
    tcfg_file.write_text(json.dumps(tcfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    # Apple's model has v_apple logit rows; the rows past them exist only for <image> and the padding, so the
    # original model can never produce them (vlmrun's sampler masks them: FastVLMModel.vocab_limit)
    info = {"source_layout": APPLE, "source_vocab_size": v_apple, "vocab_size": v_native,
            "image_token_id": image_token_id}
    (tmp / CONVERSION_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


def _load_extra_rows(src: pathlib.Path, embed, lm_head) -> dict | None:
    file = src / EXTRA_ROWS_FILE
    if not file.is_file():
        return None
    from safetensors.torch import load_file

    rows = load_file(str(file))
    ok = "embed" in rows and rows["embed"].ndim == 2 and rows["embed"].shape[1] == embed.shape[1]
    ok = ok and rows["embed"].dtype == embed.dtype
    if lm_head is not None:
        ok = ok and "lm_head" in rows and rows["lm_head"].shape == rows["embed"].shape
    if not ok:
        raise InputError(f"{file} does not fit the checkpoint's embeddings; remove it (it is optional)")
    return {"embed": rows["embed"], "lm_head": rows.get("lm_head")}


# --------------------------------------------------------------------------------------------------------------
# native -> Apple (test helper)


def save_as_apple(native_dir: str | os.PathLike, out_dir: str | os.PathLike) -> pathlib.Path:
    """Write a native ``fast_vlm`` checkpoint in Apple's ``llava_qwen2`` layout (the inverse of the conversion).

    config.json as apple/FastVLM-0.5B's (Qwen2 keys at the top level plus Apple's llava keys), with a
    ``vision_config`` block recording the timm tower's ``model_args``; Apple's key names in model.safetensors (plus
    a zero ``head.proj`` as MCi carries); the tokenizer without ``<image>``; Qwen2's chat template; a
    CLIPImageProcessor ``preprocessor_config.json``; and `EXTRA_ROWS_FILE` with the vocabulary rows Apple's
    layout has no room for. Tensors keep their dtype.
    """
    src, cfg = _read_config(native_dir)
    layout = detect_layout(src)
    if layout != NATIVE:
        raise InputError(f"{src} is a {layout} checkpoint; expected a transformers-native 'fast_vlm' one")

    def build(tmp: pathlib.Path) -> None:
        _save_apple(src, cfg, tmp)

    return _atomic_dir(out_dir, build)


def _save_apple(src: pathlib.Path, cfg: dict, tmp: pathlib.Path) -> None:
    import torch

    from .tiny import fastvlm_image_processor

    text = dict(cfg.get("text_config") or {})
    vision = dict(cfg.get("vision_config") or {})
    if vision.get("architecture", "fastvit_mci3") != "fastvit_mci3":
        raise InputError(f"{src}: vision tower {vision.get('architecture')!r}; expected timm 'fastvit_mci3'")
    image_token_id = cfg.get("image_token_id", cfg.get("image_token_index"))
    if not isinstance(image_token_id, int):
        raise InputError(f"{src}/config.json has no image_token_id; expected a FastVLM config")

    tensors = _load_tensors(src)
    if _NATIVE_EMBED not in tensors:
        raise InputError(f"{src} has no {_NATIVE_EMBED}; expected FastVLM weights")
    embed = tensors[_NATIVE_EMBED]
    v_native = int(embed.shape[0])
    tie = bool(cfg.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    if tie:
        tensors.pop(_NATIVE_LM_HEAD, None)

    # -- tokenizer without <image>
    n_apple = _write_apple_tokenizer(src, tmp, image_token_id)
    v_apple = min(v_native, max(n_apple, v_native - 64))  # 152000 -> 151936 for FastVLM-0.5B
    extra = {"embed": embed[v_apple:]}
    tensors[_NATIVE_EMBED] = embed[:v_apple]
    if not tie:
        lm_head = tensors[_NATIVE_LM_HEAD]
        extra["lm_head"] = lm_head[v_apple:]
        tensors[_NATIVE_LM_HEAD] = lm_head[:v_apple]
    if v_apple < v_native:
        _save_tensors(extra, tmp / EXTRA_ROWS_FILE)

    # -- weights under Apple's names
    apple = {native_key_to_apple(k): v for k, v in tensors.items()}
    hidden = int(vision.get("hidden_size") or 3072)
    apple[_APPLE_HEAD_PROJ] = torch.zeros((hidden, 768), dtype=embed.dtype)  # MCi's CLIP projection; unused
    _save_tensors(apple, tmp / "model.safetensors")

    # -- config.json as Apple's
    image_size = _image_size_from_processor(src) or int(round(cfg.get("image_seq_length", 256) ** 0.5)) * PATCH_SIZE
    out: dict[str, Any] = {"architectures": [_APPLE_ARCH], "model_type": APPLE}
    for key in _QWEN2_KEYS:
        if key in text:
            out[key] = text[key]
    rope = text.get("rope_parameters") or {}
    if "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    out["vocab_size"] = v_apple
    out["tie_word_embeddings"] = tie
    out.update(_APPLE_LLAVA_KEYS)
    out["mm_hidden_size"] = hidden
    out["mm_vision_tower"] = f"mobileclip_l_{image_size}"
    out["torch_dtype"] = str(embed.dtype).replace("torch.", "")
    # not in Apple's config: the timm tower's build arguments, so the conversion rebuilds the same architecture
    out["vision_config"] = {
        "architecture": "fastvit_mci3",
        "hidden_size": hidden,
        "model_args": vision.get("model_args") or {"inference_mode": True},
    }
    (tmp / "config.json").write_text(json.dumps(dict(sorted(out.items())), indent=2) + "\n", encoding="utf-8")
    if (src / "generation_config.json").is_file():
        shutil.copyfile(src / "generation_config.json", tmp / "generation_config.json")
    fastvlm_image_processor(image_size).save_pretrained(str(tmp))


def _write_apple_tokenizer(src: pathlib.Path, tmp: pathlib.Path, image_token_id: int) -> int:
    """Copy the tokenizer without the <image> token; returns the number of token ids Apple's tokenizer uses."""
    tok = _read_json(src / "tokenizer.json", "a tokenizers tokenizer.json")
    vocab = tok.get("model", {}).get("vocab")
    added = tok.get("added_tokens") or []
    if not isinstance(vocab, dict):
        raise InputError(f"{src}/tokenizer.json has no BPE vocabulary; expected Qwen2's byte-level BPE")
    ids = set(vocab.values()) | {t["id"] for t in added}
    if max(ids) != image_token_id:
        raise InputError(
            f"{src}: <image> has id {image_token_id}, not the last id {max(ids)}; Apple's layout appends it,"
            " so it must be the tokenizer's last token"
        )
    tok["added_tokens"] = [t for t in added if t["content"] != IMAGE_TOKEN]
    if vocab.get(IMAGE_TOKEN) == image_token_id:
        del vocab[IMAGE_TOKEN]
    (tmp / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")

    tcfg = {}
    if (src / "tokenizer_config.json").is_file():
        tcfg = _read_json(src / "tokenizer_config.json", "a tokenizer_config.json")
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

    n_apple = len(_load_qwen2_tokenizer(tmp))
    if n_apple != image_token_id:
        raise InputError(f"{src}: the tokenizer without <image> has {n_apple} tokens, expected {image_token_id}")
    return n_apple
