"""Build a random-weight FastVLM checkpoint with the real architecture (transformers' native ``fast_vlm`` format).

No model hub is reachable on the machines this project runs on, so the loading and export code is tested on a
checkpoint built here: timm ``fastvit_mci3`` (FastViTHD) wrapped in ``TimmWrapperModel``, the ``mlp2x_gelu``
projector, a Qwen2 decoder, a byte-level BPE tokenizer trained locally on a small embedded corpus, and a
``LlavaProcessor`` with the FastVLM image preprocessing and chat template (`vlmrun.fastvlm_files`, which the
conversion of Apple's checkpoints writes too).

``make_tiny(dir)`` gives a ~0.5M-parameter model in a few seconds; ``make_tiny(dir, full_size=True)`` gives the
FastVLM-0.5B dimensions (random weights, ~2 GB of float32).

This module builds and saves; the parts are in their own modules: the tokenizer in `vlmrun.tiny_tokenizer`, the
weight init (re-initialised on purpose, so every stage carries signal) in `vlmrun.tiny_weights`, and the planted
massive activations of ``massive_activations=True`` in `vlmrun.massive_activations`.

torch, timm and transformers' modeling code are imported inside `make_tiny` only: this module is imported
by the CLI at start-up.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
from typing import Any

from vlmrun.atomic import atomic_directory
from vlmrun.errors import BackendError, UsageError
from vlmrun.fastvlm_files import (
    CHAT_TEMPLATE,
    PATCH_SIZE,
    SYSTEM_PROMPT,
    fastvlm_config,
    fastvlm_processor,
)
from vlmrun.massive_activations import (  # noqa: F401  (MASSIVE_*: re-exported for tests/test_fp16_safety.py)
    MASSIVE_DELIMITER,
    MASSIVE_FIRST,
    plant_massive_activations,
)
from vlmrun.tiny_tokenizer import (  # noqa: F401  (the regex: re-exported for tests/test_tiny.py)
    _QWEN2_PRETOKENIZE_REGEX,
    SPECIAL_TOKENS,
    make_tokenizer,
)
from vlmrun.tiny_weights import init_projector, _init_text, init_vision

__all__ = ["make_tiny", "build_model", "SPECIAL_TOKENS", "SYSTEM_PROMPT", "CHAT_TEMPLATE", "PATCH_SIZE"]


def make_tiny(
    out_dir: str | os.PathLike,
    *,
    image_size: int = 1024,
    full_size: bool = False,
    seed: int = 0,
    massive_activations: bool = False,
) -> pathlib.Path:
    """Build a random-weight FastVLM checkpoint with the real architecture in transformers' native format.

    The directory loads offline with ``FastVlmForConditionalGeneration``, ``AutoTokenizer`` and
    ``AutoProcessor`` (``LlavaProcessor``, ``CLIPImageProcessor``, patch size 64). ``image_size`` (a multiple of
    64) sets the processor's resize/crop and ``image_seq_length`` = (image_size / 64) ** 2. ``full_size`` gives
    the FastVLM-0.5B dimensions (FastViTHD with 3072-wide features, Qwen2-0.5B with 152000 vocabulary rows);
    otherwise a tiny model of the same architecture. The same arguments give a byte-identical
    ``model.safetensors``. ``massive_activations`` plants the residual-stream outliers of real LLMs (see
    `vlmrun.massive_activations.plant_massive_activations`).

    The checkpoint is built in a temporary sibling directory and renamed onto ``out_dir`` at the end, so an
    interrupted build never leaves a complete-looking directory. An existing ``out_dir`` is replaced only if it
    is empty or holds a FastVLM checkpoint; anything else is refused.

    Returns the absolute path of ``out_dir``.
    """
    valid = isinstance(image_size, int) and not isinstance(image_size, bool)
    if not valid or image_size < PATCH_SIZE or image_size % PATCH_SIZE:
        raise UsageError(f"image size must be a positive multiple of {PATCH_SIZE}, got {image_size!r}")
    out = pathlib.Path(out_dir).expanduser().absolute()
    _check_replaceable(out)

    try:
        import timm  # noqa: F401  (imports torchvision)
        import torch  # noqa: F401
    except ImportError:
        raise BackendError("building the tiny model needs torch and timm: pip install 'vlmrun[export]'") from None
    except Exception as err:  # e.g. a torchvision that does not match torch
        raise BackendError(
            f"building the tiny model needs torch and timm, and importing them failed ({type(err).__name__}: {err});"
            " pip install 'vlmrun[export]'"
        ) from err

    with atomic_directory(out, replace=True) as tmp:
        _build(tmp, image_size=image_size, full_size=full_size, seed=seed, massive_activations=massive_activations)
        _set_default_permissions(tmp)
        _check_replaceable(out)  # it may have appeared while building
    return out


# --------------------------------------------------------------------------------------------------------------
# directory handling


def _check_replaceable(out: pathlib.Path) -> None:
    if not os.path.lexists(out):
        return
    if not out.is_dir() or out.is_symlink():
        raise UsageError(f"{out} exists and is not a directory; remove it or choose another output directory")
    if not any(out.iterdir()):
        return
    try:
        model_type = json.loads((out / "config.json").read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        model_type = None
    if model_type != "fast_vlm":
        raise UsageError(
            f"{out} exists and is not a FastVLM checkpoint; remove it or choose another output directory"
        )


def _set_default_permissions(directory: pathlib.Path) -> None:
    """Some writers make files 0600: give the checkpoint the usual umask modes."""
    mask = os.umask(0)
    os.umask(mask)
    for path in directory.iterdir():
        if path.is_file():
            path.chmod(0o666 & ~mask)
    directory.chmod(0o777 & ~mask)


# --------------------------------------------------------------------------------------------------------------
# configs


def _tiny_vision_kwargs() -> dict[str, Any]:
    return {
        "hidden_size": 256,  # final conv doubles the last stage's 128 channels
        "model_args": {"inference_mode": True, "layers": [1, 1, 1, 1, 1], "embed_dims": [8, 16, 32, 64, 128]},
    }


def _full_vision_kwargs() -> dict[str, Any]:
    return {"hidden_size": 3072, "model_args": {"inference_mode": True}}


def _text_kwargs(full_size: bool, vocab_rows: int) -> dict[str, Any]:
    common = {
        "vocab_size": vocab_rows,
        "hidden_act": "silu",
        "rope_theta": 1_000_000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "use_sliding_window": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
    }
    if full_size:
        return {
            **common,
            "hidden_size": 896,
            "intermediate_size": 4864,
            "num_hidden_layers": 24,
            "num_attention_heads": 14,
            "num_key_value_heads": 2,
            "max_position_embeddings": 32768,
            "max_window_layers": 24,
        }
    return {
        **common,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 2048,
        "max_window_layers": 2,
    }


# --------------------------------------------------------------------------------------------------------------
# build


def _build(tmp: pathlib.Path, *, image_size: int, full_size: bool, seed: int, massive_activations: bool) -> None:
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        _build_quietly(tmp, image_size=image_size, full_size=full_size, seed=seed,
                       massive_activations=massive_activations)
    finally:
        if bars:
            hf_logging.enable_progress_bar()


def _build_quietly(tmp: pathlib.Path, *, image_size: int, full_size: bool, seed: int,
                   massive_activations: bool = False) -> None:
    model, tokenizer = build_model(image_size=image_size, full_size=full_size, seed=seed)
    if massive_activations:
        plant_massive_activations(model, tokenizer, seed)
    model.save_pretrained(tmp)
    fastvlm_processor(tokenizer, image_size).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)


def build_model(
    *,
    image_size: int,
    full_size: bool = False,
    seed: int = 0,
    text: dict[str, Any] | None = None,
    vision: dict[str, Any] | None = None,
):
    """The random-weight FastVLM in memory (eval mode, float32) and its tokenizer: what `make_tiny` saves.

    ``text`` / ``vision`` override the tiny model's Qwen2 config and timm ``model_args`` (e.g. ``{"hidden_size":
    128, "num_hidden_layers": 3}``, ``{"embed_dims": [16, 32, 64, 128, 256]}``; ``vision`` may also set
    ``hidden_size``, the tower's feature width, which must be twice the last embed dim). The trained shapes model
    (``scripts/train_tiny.py``) starts from here. Needs torch, timm and transformers.
    """
    import torch
    from transformers import (
        FastVlmForConditionalGeneration,
        GenerationConfig,
        Qwen2Config,
        TimmWrapperConfig,
    )

    tokenizer = make_tokenizer()
    n_tokens = len(tokenizer)
    endoftext_id, _, im_end_id, image_id = tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    vocab_rows = 152000 if full_size else -(-n_tokens // 64) * 64

    vision_kwargs = _full_vision_kwargs() if full_size else _tiny_vision_kwargs()
    if vision:
        vision = dict(vision)
        if "hidden_size" in vision:
            vision_kwargs["hidden_size"] = int(vision.pop("hidden_size"))
        vision_kwargs["model_args"] = {**vision_kwargs["model_args"], **vision}
    vision_config = TimmWrapperConfig(
        architecture="fastvit_mci3",
        do_pooling=True,
        global_pool="avg",
        initializer_range=0.02,
        **vision_kwargs,
    )
    text_kwargs = _text_kwargs(full_size, vocab_rows)
    text_kwargs.update(text or {})
    text_config = Qwen2Config(
        bos_token_id=endoftext_id,
        eos_token_id=im_end_id,
        pad_token_id=endoftext_id,
        **text_kwargs,
    )
    config = fastvlm_config(vision_config, text_config, image_id, image_size, tie=True)

    try:  # skip transformers' own init (20 s at full size): every weight is written below from `gen`
        from transformers.initialization import no_init_weights
    except ImportError:  # pragma: no cover - older transformers 5.x
        no_init_weights = contextlib.nullcontext
    with no_init_weights():
        model = FastVlmForConditionalGeneration(config)
    model.eval()
    model.tie_weights()
    inner = model.model
    if model.lm_head.weight is not inner.language_model.embed_tokens.weight:
        raise AssertionError("lm_head is not tied to embed_tokens")
    with torch.no_grad():  # poison everything that is saved, so a weight the init below misses cannot go unnoticed
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.fill_(float("nan"))

    gen = torch.Generator().manual_seed(int(seed))

    embed_std = 0.02
    init_vision(inner.vision_tower.timm_model, gen)
    _init_text(inner.language_model, gen, n_tokens, embed_std)
    init_projector(model, gen, image_size, embed_std)
    for name, t in model.state_dict().items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise AssertionError(f"{name} was not initialised")

    model.generation_config = GenerationConfig(
        bos_token_id=endoftext_id, eos_token_id=im_end_id, pad_token_id=endoftext_id
    )
    return model, tokenizer
