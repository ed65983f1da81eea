"""The two FastVLM checkpoint formats: which one a directory holds, and reading the files both have.

* `NATIVE` (``model_type: fast_vlm``): transformers' ``FastVlmForConditionalGeneration``.
* `APPLE` (``model_type: llava_qwen2``): Apple's ``LlavaQwen2ForCausalLM`` (github apple/ml-fastvlm).

`detect_format` tells them apart from ``config.json``. The readers here serve both directions of the conversion
(`vlmrun.checkpoint_convert`, `vlmrun.checkpoint_to_apple`) and its key (`vlmrun.checkpoint_digest`): the config,
the weights (every ``*.safetensors``, or the shards a ``model.safetensors.index.json`` names: a listed shard the
directory lacks is named), the Qwen2 tokenizer and the image size of the processor config; `write_checkpoint_dir`
gives a checkpoint directory that appears complete or not at all.

safetensors' torch API and transformers are imported inside the functions only.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Callable
from typing import Literal

from .atomic import atomic_directory
from .errors import InputError

__all__ = [
    "CheckpointFormat",
    "NATIVE",
    "APPLE",
    "APPLE_ARCH",
    "APPLE_IMAGE_TOKEN_INDEX",
    "APPLE_QWEN2_CONFIG_KEYS",
    "EXTRA_ROWS_FILE",
    "SAFETENSORS_INDEX",
    "SOURCE_WEIGHTS_FILE",
    "VOCAB_FILE",
    "detect_format",
    "check_shards",
    "read_json",
    "read_config",
    "weight_files",
    "load_tensors",
    "save_tensors",
    "load_qwen2_tokenizer",
    "image_size_from_processor",
    "write_checkpoint_dir",
    "first_few",
]

#: A checkpoint format: its ``config.json`` ``model_type``.
CheckpointFormat = Literal["fast_vlm", "llava_qwen2"]

NATIVE: CheckpointFormat = "fast_vlm"
APPLE: CheckpointFormat = "llava_qwen2"

#: Apple's ``architectures`` entry (a config without ``model_type`` is recognised by it).
APPLE_ARCH = "LlavaQwen2ForCausalLM"
#: Apple's placeholder id in prompts (llava.constants.IMAGE_TOKEN_INDEX); it becomes the native <image> token.
APPLE_IMAGE_TOKEN_INDEX = -200

#: Side file written by `vlmrun.checkpoint_to_apple.save_as_apple`: native vocabulary rows beyond Apple's
#: ``vocab_size``. Not a weight file of the checkpoint.
EXTRA_ROWS_FILE = "vlmrun_extra_vocab_rows.safetensors"
#: A sharded checkpoint's map of weight name -> shard file (transformers' name).
SAFETENSORS_INDEX = "model.safetensors.index.json"
#: In a checkpoint converted without copying its weights (the store's conversion of a sharded Apple checkpoint,
#: `vlmrun.checkpoint_convert`): where each native weight is read, ``{"source": DIR, "inputs": DIGEST,
#: "weight_map": {native name: [file, stored name]}}``, a file name under ``source`` or, for `VOCAB_FILE`, beside it.
SOURCE_WEIGHTS_FILE = "vlmrun_source_weights.json"
#: Beside `SOURCE_WEIGHTS_FILE`: the weights the conversion changes (the embedding and an untied lm_head, grown
#: by the vocabulary rows the native model adds), stored whole under their native names.
VOCAB_FILE = "vlmrun_vocab.safetensors"

#: Qwen2 keys that Apple's llava_qwen2 config.json holds at its top level.
APPLE_QWEN2_CONFIG_KEYS = (
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
    "use_cache", "tie_word_embeddings", "rope_theta", "rope_scaling", "use_sliding_window", "sliding_window",
    "max_window_layers", "attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id",
)  # fmt: skip


# --------------------------------------------------------------------------------------------------------------
# format detection


def read_json(path: pathlib.Path, what: str) -> dict:
    """The JSON object in ``path``; `InputError` saying it should be ``what`` when it is missing or not one."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path} is missing; expected {what}") from None
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {path} ({exc}); expected {what}") from None
    if not isinstance(data, dict):
        raise InputError(f"{path} is not a JSON object; expected {what}")
    return data


def read_config(model_dir: str | os.PathLike) -> tuple[pathlib.Path, dict]:
    """The checkpoint directory's path and its ``config.json``; `InputError` when either is missing."""
    path = pathlib.Path(model_dir).expanduser()
    expected = "a FastVLM checkpoint directory (config.json with model_type 'fast_vlm' or 'llava_qwen2')"
    if not path.exists():
        raise InputError(f"checkpoint directory {path} does not exist; expected {expected}")
    if not path.is_dir():
        raise InputError(f"{path} is not a directory; expected {expected}")
    if not (path / "config.json").is_file():
        raise InputError(f"{path} has no config.json; expected {expected}")
    return path, read_json(path / "config.json", "a FastVLM config.json")


def detect_format(model_dir: str | os.PathLike) -> CheckpointFormat:
    """`NATIVE` or `APPLE`, from ``config.json``; `InputError` for anything that is not FastVLM."""
    path, cfg = read_config(model_dir)
    model_type = cfg.get("model_type")
    archs = cfg.get("architectures") or []
    if model_type == NATIVE:
        return NATIVE
    if model_type == APPLE or APPLE_ARCH in archs:
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
# weights


def _indexed_weight_files(path: pathlib.Path) -> list[pathlib.Path] | None:
    """The shards `SAFETENSORS_INDEX` names (``None`` without an index); a missing shard is named."""
    index = path / SAFETENSORS_INDEX
    if not index.is_file():
        return None
    weight_map = read_json(index, "a safetensors index with a weight_map").get("weight_map")
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


def weight_files(path: pathlib.Path) -> list[pathlib.Path]:
    """The checkpoint's weight files: the shards its index names, else every ``*.safetensors`` but
    `EXTRA_ROWS_FILE`; `InputError` when there are none."""
    indexed = _indexed_weight_files(path)
    if indexed is not None:
        return indexed  # as transformers does: with an index, only the shards it names are weights
    files = sorted(p for p in path.glob("*.safetensors") if p.name != EXTRA_ROWS_FILE)
    if not files:
        bins = sorted(p.name for p in path.glob("*.bin"))
        hint = f" (found {', '.join(bins)}; only safetensors are read)" if bins else ""
        raise InputError(f"{path} has no *.safetensors weights{hint}; expected model.safetensors")
    return files


def load_tensors(path: pathlib.Path) -> dict:
    """Every weight of the checkpoint (torch tensors on the CPU, stored dtype), checked against its index."""
    from safetensors import safe_open

    tensors: dict = {}
    for file in weight_files(path):
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
        weight_map = read_json(index, "a safetensors index")["weight_map"]
        absent = sorted(k for k in weight_map if k not in tensors)
        if absent:
            raise InputError(
                f"{path}: {SAFETENSORS_INDEX} puts {first_few(absent)} in {weight_map[absent[0]]}, which does not"
                " hold them; expected the shards the index was written for"
            )
    return tensors


def save_tensors(tensors: dict, file: pathlib.Path) -> None:
    """Write ``tensors`` to one safetensors file (contiguous, ``format: pt`` metadata, as transformers does)."""
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, str(file), metadata={"format": "pt"})


def first_few(keys: list[str]) -> str:
    """The first three of ``keys`` for an error message, ``...`` marking more."""
    return str(keys[:3])[:-1] + (", ...]" if len(keys) > 3 else "]")


# --------------------------------------------------------------------------------------------------------------
# tokenizer, processor, output directory


def load_qwen2_tokenizer(path: pathlib.Path):
    """The Qwen2 tokenizer of a checkpoint dir (Qwen2Tokenizer directly: AutoTokenizer would need the config class)."""
    from transformers import Qwen2Tokenizer

    if not (path / "tokenizer.json").is_file() and not (path / "vocab.json").is_file():
        raise InputError(f"{path} has no tokenizer (tokenizer.json or vocab.json + merges.txt); expected Qwen2's")
    try:
        return Qwen2Tokenizer.from_pretrained(str(path))
    except Exception as exc:
        raise InputError(f"cannot load the Qwen2 tokenizer in {path} ({type(exc).__name__}: {exc})") from None


def image_size_from_processor(path: pathlib.Path) -> int | None:
    """The crop size of the checkpoint's image processor config, if it has one."""
    for name in ("preprocessor_config.json", "processor_config.json"):
        file = path / name
        if not file.is_file():
            continue
        cfg = read_json(file, "an image processor config")
        cfg = cfg.get("image_processor", cfg)
        crop = cfg.get("crop_size") or cfg.get("size")
        if isinstance(crop, dict):
            crop = crop.get("height") or crop.get("shortest_edge")
        if isinstance(crop, int):
            return crop
    return None


def write_checkpoint_dir(out_dir: str | os.PathLike, build: Callable[[pathlib.Path], None]) -> pathlib.Path:
    """Run ``build(tmp)`` in a temporary sibling of ``out_dir`` and rename it onto ``out_dir``.

    ``out_dir`` must not exist or be empty; it appears complete or not at all. Returns its absolute path.
    """
    out = pathlib.Path(out_dir).expanduser().absolute()
    if os.path.lexists(out) and (not out.is_dir() or out.is_symlink() or any(out.iterdir())):
        raise InputError(f"output directory {out} already exists and is not empty; remove it or choose another one")
    with atomic_directory(out) as tmp:  # an empty existing out_dir is replaced
        build(tmp)
    return out
