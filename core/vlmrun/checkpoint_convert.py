"""Convert Apple's FastVLM checkpoint (``llava_qwen2`` format) to transformers' native ``fast_vlm`` format.

`convert_apple_to_native` follows transformers' conversion script
(huggingface/transformers ``src/transformers/models/fast_vlm/convert_fastvlm_weights_to_hf.py``): the same key
renames (`vlmrun.checkpoint_keys`), ``head.proj`` dropped, an ``<image>`` token appended to the tokenizer (it takes
the place of Apple's -200 placeholder and its id becomes ``image_token_id``), the vocabulary grown by one row and
padded to a multiple of 64, ``image_seq_length = (image_size / 64) ** 2``, ``LlavaProcessor`` +
``CLIPImageProcessor`` (mean 0, std 1, bicubic, shortest edge = crop = image size) with ``patch_size`` 64. It
never runs remote code. Differences from the script: the new vocabulary rows are set to the mean embedding row
(the script samples them from N(mean, 1e-5 * cov), i.e. the same up to noise), or taken from `EXTRA_ROWS_FILE`
when the source has one (`vlmrun.checkpoint_to_apple.save_as_apple` writes it); and the chat template is the
project's rendering of Apple's ``qwen_2`` conversation (`vlmrun.fastvlm_files.CHAT_TEMPLATE`; the script's
template renders the same prompt for an image + text user turn but drops string contents such as a system
prompt).

The conversion also writes `CONVERSION_FILE` (Apple's ``vocab_size`` among others: the sampler never picks the
rows past it, which Apple's model does not have).

torch and transformers' model classes are imported inside the functions only.
"""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

from .checkpoint_formats import (
    APPLE,
    APPLE_QWEN2_CONFIG_KEYS,
    EXTRA_ROWS_FILE,
    detect_format,
    first_few,
    image_size_from_processor,
    load_qwen2_tokenizer,
    read_config,
    read_json,
    weight_files,
    write_checkpoint_dir,
)
from .checkpoint_formats import SAFETENSORS_INDEX, SOURCE_WEIGHTS_FILE, VOCAB_FILE
from .checkpoint_keys import (
    APPLE_EMBED,
    APPLE_HEAD_PROJ,
    APPLE_LM_HEAD,
    APPLE_STAGE_BLOCKS,
    APPLE_VISION_PREFIX,
    NATIVE_LM_HEAD,
    apple_key_to_native,
)
from .checkpoint_shards import TensorSpec, torch_dtype, write_shard_groups, write_single
from .checkpoint_stream import ShardedWeights
from .errors import InputError
from .fastvlm_files import (
    CHAT_TEMPLATE,
    IMAGE_TOKEN,
    PATCH_SIZE,
    fastvlm_config,
    fastvlm_processor,
)

__all__ = ["CONVERSION_FILE", "convert_apple_to_native"]

#: Written by `convert_apple_to_native` beside the converted checkpoint: what the source model was
#: (``source_vocab_size``: the rows Apple's model has; the rows past it exist only for ``<image>`` and padding).
CONVERSION_FILE = "vlmrun_conversion.json"
#: `CONVERSION_FILE`'s key for the source checkpoint's format. Its name predates the word "format"; it stays,
#: so that converted checkpoints keep their bytes.
_SOURCE_FORMAT_KEY = "source_layout"

_NATIVE_ARCH = "FastVlmForConditionalGeneration"

# timm fastvit_mci3 defaults (timm/models/fastvit.py)
_MCI3_DEFAULTS = {
    "layers": [2, 12, 24, 4, 2],
    "embed_dims": [96, 192, 384, 768, 1536],
    "mlp_ratios": [4, 4, 4, 4, 4],
}


def convert_apple_to_native(src_dir: str | os.PathLike, out_dir: str | os.PathLike, *,
                            weights_in_source: str | None = None) -> pathlib.Path:
    """Convert Apple's ``llava_qwen2`` FastVLM checkpoint into a transformers-native ``fast_vlm`` one at ``out_dir``.

    Follows transformers' ``convert_fastvlm_weights_to_hf.py`` (see the module docstring). Tensors keep their
    stored dtype. ``out_dir`` must not exist or be empty; it appears complete or not at all.

    ``weights_in_source`` (the source's digest, `vlmrun.checkpoint_digest.conversion_digest`), for a sharded
    source: the weights are not copied. ``out_dir`` gets `SOURCE_WEIGHTS_FILE` (each native weight's shard and
    stored name in the source) and `VOCAB_FILE` (the embedding and an untied lm_head, grown by the new rows), read
    by `vlmrun.checkpoint_stream.ShardedWeights`: at 7B 2.2 GB written instead of 15.5. Such a checkpoint is read
    through vlmrun only (transformers' ``from_pretrained`` finds no weights in it) and needs its source where it
    was.
    """
    src, cfg = read_config(src_dir)
    fmt = detect_format(src)
    if fmt != APPLE:
        raise InputError(f"{src} is already a transformers-native ({fmt}) checkpoint; expected Apple's llava_qwen2")
    if pathlib.Path(out_dir).expanduser().absolute() == src.absolute():
        raise InputError(f"output directory {out_dir} is the source directory; choose another one")

    if weights_in_source is not None and not (src / SAFETENSORS_INDEX).is_file():
        raise InputError(f"{src} is not sharded ({SAFETENSORS_INDEX} is missing): its weights are converted into"
                         " a copy")

    def build(tmp: pathlib.Path) -> None:
        _convert_apple(src, cfg, tmp, weights_in_source)

    return write_checkpoint_dir(out_dir, build)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _image_size_from_tower(name: Any) -> int | None:
    # Apple's MobileCLIPVisionTower: input_image_size = int(vision_tower.split("_")[-1])
    try:
        return int(str(name).split("_")[-1])
    except ValueError:
        return None


def _infer_tower(shapes: dict) -> dict:
    """layers / embed_dims / mlp_ratios / hidden size of Apple's FastViT from the weight shapes (name -> shape)."""
    layers, dims, ratios = [], [], []
    for stage, net in sorted(APPLE_STAGE_BLOCKS.items()):
        prefix = f"{APPLE_VISION_PREFIX}network.{net}."
        blocks = {int(k[len(prefix):].split(".", 1)[0]) for k in shapes if k.startswith(prefix)}
        fc1 = shapes.get(f"{prefix}0.convffn.fc1.weight")
        if not blocks or fc1 is None:
            raise InputError(
                f"the vision tower has no FastViTHD blocks for stage {stage} ({prefix}0.convffn.fc1.weight);"
                " expected Apple's MobileCLIP (mobileclip_l) tower in inference (reparameterized) form"
            )
        layers.append(len(blocks))
        dims.append(int(fc1[1]))
        ratio = fc1[0] / fc1[1]
        ratios.append(int(ratio) if float(ratio).is_integer() else float(ratio))
    conv_exp = shapes.get(APPLE_VISION_PREFIX + "conv_exp.reparam_conv.weight")
    if conv_exp is None:
        raise InputError(
            "the vision tower has no conv_exp.reparam_conv.weight; expected Apple's MobileCLIP tower in"
            " inference (reparameterized) form"
        )
    return {"layers": layers, "embed_dims": dims, "mlp_ratios": ratios, "hidden_size": int(conv_exp[0])}


def _convert_apple(src: pathlib.Path, cfg: dict, tmp: pathlib.Path, weights_in_source: str | None) -> None:
    import torch
    from tokenizers import AddedToken
    from transformers import (
        FastVlmForConditionalGeneration,
        GenerationConfig,
        Qwen2Config,
        TimmWrapperConfig,
    )

    weight_files(src)  # names a missing shard, or the lack of any weights
    weights = ShardedWeights(src)  # tensor by tensor: never the whole model in memory
    headers = weights.headers()
    headers.pop(APPLE_HEAD_PROJ, None)  # the script deletes MCi's CLIP head projection
    if APPLE_EMBED not in headers:
        raise InputError(f"{src} has no {APPLE_EMBED}; expected Apple's llava_qwen2 weights")
    shapes = {key: shape for key, (_, shape) in headers.items()}
    embed_dtype = torch_dtype(headers[APPLE_EMBED][0])
    v_apple, hidden = shapes[APPLE_EMBED]
    if int(cfg.get("vocab_size", v_apple)) != v_apple:
        raise InputError(f"{src}: config vocab_size {cfg.get('vocab_size')} but {APPLE_EMBED} has {v_apple} rows")
    tie = bool(cfg.get("tie_word_embeddings", False))
    if tie:
        headers.pop(APPLE_LM_HEAD, None)  # tied: the decoder reads the embedding matrix
    elif APPLE_LM_HEAD not in headers:
        raise InputError(f"{src} has no {APPLE_LM_HEAD} but tie_word_embeddings is false; expected an untied lm_head")

    # -- vision tower: timm fastvit_mci3 with the dims found in the weights
    tower = _infer_tower(shapes)
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
    tokenizer = load_qwen2_tokenizer(src)
    if IMAGE_TOKEN not in tokenizer.get_vocab():
        tokenizer.add_tokens(AddedToken(IMAGE_TOKEN, special=True, normalized=False), special_tokens=True)
    image_token_id = int(tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
    tokenizer.chat_template = CHAT_TEMPLATE

    # -- vocabulary: one more row for <image>, padded to a multiple of 64 (the script's resize_token_embeddings)
    extra = _load_extra_rows(src, hidden, embed_dtype, untied=not tie)
    if extra is None:
        v_native = _round_up(v_apple + 1, 64)
        mean = weights.read(APPLE_EMBED).float().mean(dim=0, keepdim=True)  # the embedding alone
        extra = {name: mean.to(embed_dtype).expand(v_native - v_apple, hidden) for name in ("embed", "lm_head")}
    v_native = v_apple + int(extra["embed"].shape[0])
    if not (0 <= image_token_id < v_native) or len(tokenizer) > v_native:
        raise InputError(
            f"{src}: the tokenizer has {len(tokenizer)} tokens (<image> = {image_token_id}) but the vocabulary has"
            f" {v_native} rows; expected the tokenizer to fit the embedding matrix"
        )
    shapes[APPLE_EMBED] = (v_native, hidden)
    if not tie:
        shapes[APPLE_LM_HEAD] = (v_native, shapes[APPLE_LM_HEAD][1])

    # -- text config: Apple's top-level Qwen2 keys
    text_kwargs = {
        k: cfg[k] for k in APPLE_QWEN2_CONFIG_KEYS if k in cfg and not (k == "rope_scaling" and cfg[k] is None)
    }
    text_kwargs["vocab_size"] = v_native
    text_kwargs["tie_word_embeddings"] = tie
    if int(text_kwargs.get("hidden_size", hidden)) != hidden:
        raise InputError(f"{src}: config hidden_size {text_kwargs['hidden_size']} but the embeddings are {hidden} wide")
    text_config = Qwen2Config(**text_kwargs)

    image_size = _image_size_from_tower(cfg.get("mm_vision_tower")) or image_size_from_processor(src) or 1024
    if image_size % PATCH_SIZE:
        raise InputError(f"{src}: image size {image_size} is not a multiple of {PATCH_SIZE}; expected e.g. 1024")
    config = fastvlm_config(vision_config, text_config, image_token_id, image_size, tie)
    config.architectures = [_NATIVE_ARCH]
    config.dtype = embed_dtype

    # -- weights: rename, then check names and shapes against the native model (built on the meta device)
    native, renamed = {}, {}
    for key in headers:
        new = apple_key_to_native(key)
        if new in native:
            raise InputError(f"{src}: two weights map to {new!r}; expected Apple's llava_qwen2 key names")
        native[new], renamed[key] = shapes[key], new
    with torch.device("meta"):
        reference = FastVlmForConditionalGeneration(config).state_dict()
    if tie:
        reference.pop(NATIVE_LM_HEAD, None)
    missing = sorted(set(reference) - set(native))
    unexpected = sorted(set(native) - set(reference))
    if missing or unexpected:
        raise InputError(
            f"{src}: weights do not match FastVLM after renaming (missing {first_few(missing)}, unexpected"
            f" {first_few(unexpected)}); expected Apple's FastVLM keys"
        )
    for key, ref in reference.items():
        if tuple(native[key]) != tuple(ref.shape):
            raise InputError(
                f"{src}: weight {key} has shape {tuple(native[key])}, the model needs {tuple(ref.shape)};"
                " expected a consistent FastVLM checkpoint"
            )

    # -- write
    config.save_pretrained(str(tmp))
    if weights_in_source is None:
        _write_native(weights, headers, renamed, extra, tmp)
    else:
        _write_vocab_and_map(weights, headers, renamed, extra, tmp, weights_in_source)
    gen = {}
    if (src / "generation_config.json").is_file():
        gen = read_json(src / "generation_config.json", "a generation config")
        gen.pop("transformers_version", None)
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if gen.get(key) is None and getattr(text_config, key, None) is not None:
            gen[key] = getattr(text_config, key)
    GenerationConfig(**gen).save_pretrained(str(tmp))
    fastvlm_processor(tokenizer, image_size).save_pretrained(str(tmp))
    tokenizer.save_pretrained(str(tmp))
    # from_pretrained's loading flags leak into the saved init kwargs; they describe the source, not the tokenizer
    tcfg_file = tmp / "tokenizer_config.json"
    tcfg = read_json(tcfg_file, "the tokenizer_config.json just written")
    for key in ("is_local", "local_files_only"):
        tcfg.pop(key, None)
    tcfg_file.write_text(json.dumps(tcfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    # Apple's model has v_apple logit rows; the rows past them exist only for <image> and the padding, so the
    # original model can never produce them (vlmrun's sampler masks them: FastVLMModel.vocab_limit)
    info = {_SOURCE_FORMAT_KEY: APPLE, "source_vocab_size": v_apple, "vocab_size": v_native,
            "image_token_id": image_token_id}
    (tmp / CONVERSION_FILE).write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")


def _load_extra_rows(src: pathlib.Path, hidden: int, dtype, untied: bool) -> dict | None:
    file = src / EXTRA_ROWS_FILE
    if not file.is_file():
        return None
    from safetensors.torch import load_file

    rows = load_file(str(file))
    ok = "embed" in rows and rows["embed"].ndim == 2 and rows["embed"].shape[1] == hidden
    ok = ok and rows["embed"].dtype == dtype
    if untied:
        ok = ok and "lm_head" in rows and rows["lm_head"].shape == rows["embed"].shape
    if not ok:
        raise InputError(f"{file} does not fit the checkpoint's embeddings; remove it (it is optional)")
    return {"embed": rows["embed"], "lm_head": rows.get("lm_head")}


def _write_native(weights: ShardedWeights, headers: dict, renamed: dict, extra: dict, out: pathlib.Path) -> None:
    """Write the renamed weights tensor by tensor (each read from its source shard when its turn comes), the
    embedding and an untied lm_head grown by the ``extra`` rows: one ``model.safetensors`` from a one-file
    source, else one shard per source shard with the same tensors (so that an export part reads the shards of
    its layers only: `vlmrun.checkpoint_stream`)."""
    groups: dict[str, list[TensorSpec]] = {}
    for key, (dtype_name, shape) in headers.items():
        dtype = torch_dtype(dtype_name)
        grown = {APPLE_EMBED: "embed", APPLE_LM_HEAD: "lm_head"}.get(key)
        if grown:
            shape = (shape[0] + int(extra[grown].shape[0]), shape[1])
        make = _grown_maker(weights, key, extra[grown]) if grown else (lambda k=key: weights.read(k))
        groups.setdefault(weights.files[key], []).append(TensorSpec(renamed[key], tuple(shape), dtype, make))
    shards = [sorted(groups[name], key=lambda s: s.name) for name in sorted(groups)]
    if (weights.path / SAFETENSORS_INDEX).is_file():
        write_shard_groups(out, shards)
    else:
        write_single(out / "model.safetensors", sorted((s for g in shards for s in g), key=lambda s: s.name))


def _write_vocab_and_map(weights: ShardedWeights, headers: dict, renamed: dict, extra: dict, out: pathlib.Path,
                         inputs: str) -> None:
    """The grown weights into `VOCAB_FILE`, and `SOURCE_WEIGHTS_FILE` mapping every other native weight to its
    shard and Apple name in the source (``convert_apple_to_native(weights_in_source=...)``)."""
    grown, weight_map = [], {}
    for key, (dtype_name, shape) in headers.items():
        which = {APPLE_EMBED: "embed", APPLE_LM_HEAD: "lm_head"}.get(key)
        if which:
            shape = (shape[0] + int(extra[which].shape[0]), shape[1])
            grown.append(TensorSpec(renamed[key], tuple(shape), torch_dtype(dtype_name),
                                    _grown_maker(weights, key, extra[which])))
            weight_map[renamed[key]] = [VOCAB_FILE, renamed[key]]
        else:
            weight_map[renamed[key]] = [weights.files[key], key]
    write_single(out / VOCAB_FILE, sorted(grown, key=lambda s: s.name))
    data = {"source": str(weights.path.resolve()), "inputs": inputs, "weight_map": dict(sorted(weight_map.items()))}
    (out / SOURCE_WEIGHTS_FILE).write_text(json.dumps(data, indent=1) + "\n", encoding="utf-8")


def _grown_maker(weights: ShardedWeights, key: str, rows):
    """``make()`` of the embedding (or lm_head) ``key`` with ``rows`` appended, in the stored dtype."""
    import torch

    def make():
        stored = weights.read(key)
        return torch.cat([stored, rows.to(stored.dtype)], dim=0)

    return make
