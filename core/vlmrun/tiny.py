"""Build a random-weight FastVLM checkpoint with the real architecture (transformers' native ``fast_vlm`` format).

No model hub is reachable on the machines this project runs on, so the loading and export code is tested on a
checkpoint built here: timm ``fastvit_mci3`` (FastViTHD) wrapped in ``TimmWrapperModel``, the ``mlp2x_gelu``
projector, a Qwen2 decoder, a byte-level BPE tokenizer trained locally on a small embedded corpus, and a
``LlavaProcessor`` with the FastVLM image preprocessing and chat template (`vlmrun.fastvlm_files`, which the
conversion of Apple's checkpoints writes too).

``make_tiny(dir)`` gives a ~0.5M-parameter model in a few seconds; ``make_tiny(dir, full_size=True)`` gives the
FastVLM-0.5B dimensions (random weights, ~2 GB of float32).

The weights are re-initialised on purpose: timm's default init (layer scales of 1e-5) makes the tower's output
about 1e-26, so every numeric comparison would pass trivially. Here every stage carries signal: the vision
features have a std of O(0.1..1), the projector is scaled so image embeddings have the std of the text token
embeddings, and greedy generation does not collapse into one repeated token.

torch, timm and transformers' modeling code are imported inside `make_tiny` only: this module is imported
by the CLI at start-up.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pathlib
from typing import Any

from vlmrun.atomic import atomic_directory
from vlmrun.errors import BackendError, UsageError
from vlmrun.fastvlm_files import (
    CHAT_TEMPLATE,
    IMAGE_TOKEN,
    PATCH_SIZE,
    SYSTEM_PROMPT,
    fastvlm_config,
    fastvlm_processor,
)

__all__ = ["make_tiny", "build_model", "SPECIAL_TOKENS", "SYSTEM_PROMPT", "CHAT_TEMPLATE", "PATCH_SIZE"]

#: Qwen2 special tokens in Qwen's order (appended after the BPE vocabulary, like ids 151643.. of the real model),
#: plus the ``<image>`` placeholder the native conversion adds.
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>", IMAGE_TOKEN)

# Qwen2's pre-tokenizer split (transformers.models.qwen2.tokenization_qwen2.PRETOKENIZE_REGEX). The tokenizer is
# trained with exactly Qwen2Tokenizer's pipeline because Qwen2Tokenizer rebuilds that pipeline on load and only
# takes the vocabulary and merges from tokenizer.json.
_QWEN2_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

#: BPE vocabulary size before the special tokens are appended (256 byte symbols + merges).
_BPE_VOCAB_SIZE = 400

_CORPUS = """\
A photo of a cat sitting on a red chair next to the window.
The image shows a small dog running across a green field on a sunny day.
There are two people walking along the beach while the sun sets behind the clouds.
Describe the image in one sentence. What is the man holding in his left hand?
The picture shows a busy street in a city, with cars, buses, bicycles and tall buildings.
A bowl of fresh fruit stands on the kitchen table: apples, oranges, bananas and grapes.
How many birds are sitting on the wire? There are three birds sitting on the wire.
The woman in the blue dress is reading a book under a large tree in the park.
Is there a stop sign in this picture? Yes, there is a stop sign at the corner of the road.
The train is waiting at the station and a few passengers are getting on board.
What color is the car? The car is white, and it is parked in front of a brown house.
A group of children are playing football in the school yard after the rain.
This is a chart that shows the number of visitors for each month of the year.
The text on the sign says that the shop opens at nine in the morning and closes at six.
A mountain lake reflects the snow on the peaks and the dark green forest around it.
The plate holds a sandwich, some chips and a glass of orange juice.
You are a helpful assistant. Answer the question about the image briefly and clearly.
Please read the text in the image and tell me what it says.
The kitchen is clean and bright, with white walls and a wooden floor.
An old man is sitting on a bench and feeding the pigeons in the square.
The boat is sailing on the calm water near the harbour, and the sky is blue.
Two cats are sleeping on the sofa, and a lamp is standing on the table beside them.
What is written on the board? The board shows the menu of the day and the prices.
The phone on the desk shows the time, the date and the weather for today.
The horse is standing in the field next to a wooden fence and a small barn.
In the background there is a bridge over the river and a castle on the hill.
The screen shows a document with a title, three paragraphs and a table of numbers.
She is wearing a yellow jacket and holding an umbrella because it is raining.
The room has a bed, a desk with a computer, a chair and a shelf full of books.
The answer is yes. The answer is no. There is one. There are many of them.
"""


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
    `plant_massive_activations`).

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
# tokenizer


def _train_bpe() -> tuple[dict[str, int], list[tuple[str, str]]]:
    """Train the byte-level BPE on the embedded corpus with exactly Qwen2Tokenizer's pipeline. Deterministic."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN2_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        special_tokens=[],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    return dict(model["vocab"]), merges


def _make_tokenizer():
    from tokenizers import AddedToken
    from transformers import Qwen2Tokenizer

    vocab, merges = _train_bpe()
    n = len(vocab)
    if sorted(vocab.values()) != list(range(n)):
        raise AssertionError("BPE vocabulary ids are not contiguous")
    for i, tok in enumerate(SPECIAL_TOKENS):
        vocab[tok] = n + i
    endoftext, im_start, im_end, image = SPECIAL_TOKENS
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=endoftext,
        eos_token=im_end,
        pad_token=endoftext,
        model_max_length=32768,
        errors="replace",
        add_bos_token=False,
        add_eos_token=False,
        clean_up_tokenization_spaces=False,
    )
    tokenizer.add_special_tokens(
        {"additional_special_tokens": [AddedToken(t, special=True, normalized=False) for t in (im_start, image)]}
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    ids = tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    if ids != [n + i for i in range(len(SPECIAL_TOKENS))] or len(tokenizer) != n + len(SPECIAL_TOKENS):
        raise AssertionError(f"unexpected special token ids {ids} (vocabulary {n}, tokenizer {len(tokenizer)})")
    return tokenizer


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
# weights


def _init_projector(model, gen, image_size: int, embed_std: float) -> None:
    """Initialise the projector, then scale ``linear_2`` so image embeddings have the token embeddings' std
    (``embed_std``), measured on one random picture through the (already initialised) vision tower."""
    import torch

    projector = model.model.multi_modal_projector
    with torch.no_grad():
        _init_linear(projector.linear_1, gen, 1.0 / math.sqrt(projector.linear_1.in_features))
        _init_linear(projector.linear_2, gen, 1.0 / math.sqrt(projector.linear_2.in_features))
        pixels = torch.rand((1, 3, image_size, image_size), generator=gen)
        embeds = model.get_image_features(pixel_values=pixels).pooler_output
        scale = _quantize_scale(embed_std / float(embeds.std()))
        projector.linear_2.weight.mul_(scale)
        projector.linear_2.bias.mul_(scale)


def _init_vision(timm_model, gen) -> None:
    """Variance-preserving re-init of the FastViTHD tower (timm's init scales every residual branch by 1e-5)."""
    import torch
    from torch import nn

    def normal_(t, std):
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32) * std)

    def uniform_(t, lo, hi):
        t.copy_(lo + (hi - lo) * torch.rand(t.shape, generator=gen, dtype=torch.float32))

    # residual branches are scaled by 1/sqrt(blocks in the stage) so deep stages (24 blocks) do not blow up
    depth_of = {}
    for si, stage in enumerate(timm_model.stages):
        for name, _ in stage.named_modules():
            depth_of[f"stages.{si}.{name}" if name else f"stages.{si}"] = len(stage.blocks)

    with torch.no_grad():
        for name, mod in timm_model.named_modules():
            if isinstance(mod, nn.Conv2d):
                w = mod.weight
                fan_in = w[0].numel()
                k_h, k_w = w.shape[-2:]
                identity_like = (
                    name.endswith("token_mixer.reparam_conv") or name.endswith("pos_emb.reparam_conv")
                ) and mod.groups == mod.in_channels == mod.out_channels
                if identity_like:
                    # RepMixer / conditional positional encoding fold "x + f(x)" into one depthwise conv
                    normal_(w, 0.5 / math.sqrt(fan_in))
                    w[:, 0, k_h // 2, k_w // 2] += 1.0
                else:
                    normal_(w, 1.0 / math.sqrt(fan_in))
                if mod.bias is not None:
                    normal_(mod.bias, 0.02)
            elif isinstance(mod, nn.Linear):
                normal_(mod.weight, 1.0 / math.sqrt(mod.in_features))
                if mod.bias is not None:
                    normal_(mod.bias, 0.02)
            elif isinstance(mod, nn.modules.batchnorm._BatchNorm):
                uniform_(mod.weight, 0.8, 1.2)
                normal_(mod.bias, 0.05)
                normal_(mod.running_mean, 0.05)
                uniform_(mod.running_var, 0.8, 1.2)
            elif isinstance(mod, nn.LayerNorm):  # LayerNorm2d
                mod.weight.copy_(1.0 + 0.05 * torch.randn(mod.weight.shape, generator=gen))
                normal_(mod.bias, 0.05)
            elif hasattr(mod, "gamma") and isinstance(mod.gamma, nn.Parameter):  # LayerScale2d
                stage_name = name.rsplit(".blocks.", 1)[0]
                scale = 1.0 / math.sqrt(depth_of.get(stage_name, 1))
                uniform_(mod.gamma, 0.5 * scale, 1.0 * scale)


def _init_linear(linear, gen, std: float, bias_std: float = 0.02) -> None:
    import torch

    linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen) * std)
    if linear.bias is not None:
        linear.bias.copy_(torch.randn(linear.bias.shape, generator=gen) * bias_std)


def _init_text(lm, gen, n_tokens: int, embed_std: float) -> None:
    """Qwen2 init that makes greedy decoding depend on the context (not just echo the last token)."""
    import torch

    with torch.no_grad():
        emb = lm.embed_tokens.weight
        emb.zero_()  # rows past the tokenizer (vocabulary padding) stay 0, so they never win the argmax
        emb[:n_tokens].copy_(torch.randn((n_tokens, emb.shape[1]), generator=gen) * embed_std)
        # q/k gain 2: sharp, content-dependent attention. Residual branches (v, o, down) gain 2 * sqrt(2 / layers)
        # (2 for the tiny model, 0.58 for 24 layers): the layers dominate the tied token embedding in the residual
        # stream without swamping each other. With gain 1 everywhere greedy decoding just echoes one token.
        resid = 2.0 * math.sqrt(2.0 / len(lm.layers))
        for layer in lm.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for lin, gain in (
                (attn.q_proj, 2.0), (attn.k_proj, 2.0), (attn.v_proj, resid), (attn.o_proj, resid),
                (mlp.gate_proj, 1.0), (mlp.up_proj, 1.0), (mlp.down_proj, resid),
            ):  # fmt: skip
                _init_linear(lin, gen, gain / math.sqrt(lin.in_features))
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(1.0 + 0.05 * torch.randn(norm.weight.shape, generator=gen))
        lm.norm.weight.copy_(1.0 + 0.05 * torch.randn(lm.norm.weight.shape, generator=gen))


def _quantize_scale(x: float) -> float:
    """Round a calibration factor to a 1/16-octave grid so float noise cannot change the saved bytes."""
    return 2.0 ** (round(16.0 * math.log2(x)) / 16.0)


# --------------------------------------------------------------------------------------------------------------
# massive activations

#: Planted residual-stream values (3 channels) on the first token (``<|im_start|>``, ``<|endoftext|>``) and on
#: delimiters (newline and period tokens, ``<|im_end|>``), each scaled by a seeded factor in [0.9, 1.1]. Real
#: LLMs carry such outliers (Sun et al. 2024, "Massive Activations in Large Language Models"); fp16 squares
#: overflow above 256.
MASSIVE_FIRST = (2600.0, -1500.0, 700.0)
MASSIVE_DELIMITER = (900.0, -550.0, 250.0)
_FIRST_TOKENS = ("<|endoftext|>", "<|im_start|>")
_DELIMITER_SYMBOLS = frozenset("Ċč.")  # byte-level BPE spells "\n" as "Ċ" and "\r" as "č"


def plant_massive_activations(model, tokenizer, seed: int = 0) -> dict[str, Any]:
    """Plant "massive activations" in a built model's weights (in place) and return where they are.

    As in real LLMs, layer 0's MLP writes a few residual channels in the hundreds to thousands (see
    `MASSIVE_FIRST`, `MASSIVE_DELIMITER`) on the first token and on delimiter tokens, and they ride the
    residual stream through every later layer; other tokens are untouched. How: two hidden channels are reserved
    as token-class markers (1.0 in the embedding rows of the first-token / delimiter tokens, 0 elsewhere, and
    nothing else writes them before layer 0's MLP: layer 0's o_proj and the projector's output rows are zeroed;
    the final norm ignores them, so they do not leak into the tied lm_head). One layer-0 MLP neuron per class
    reads its marker (silu(g z) * g z) and writes the planted values through down_proj. ``g`` is calibrated on a
    chat prompt so the median marker row reaches the nominal values (the others land within a factor of ~2).
    Deterministic from ``seed`` (which channels, markers and neurons come from its own generator; the
    calibration gain is rounded to a 1/16-octave grid). The fp32 model stays sane: these rows act as attention
    sinks, as in real models.
    """
    import torch

    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + 17)
    lm = model.model.language_model
    hidden, inter = lm.config.hidden_size, lm.config.intermediate_size
    vocab = tokenizer.get_vocab()
    first_ids = sorted(vocab[t] for t in _FIRST_TOKENS if t in vocab)
    delim_ids = sorted({i for t, i in vocab.items() if t and set(t) <= _DELIMITER_SYMBOLS} | {vocab["<|im_end|>"]})
    n = len(MASSIVE_FIRST)
    perm = torch.randperm(hidden, generator=gen).tolist()
    markers, channels = perm[:2], perm[2 : 2 + n]
    neurons = torch.randperm(inter, generator=gen)[:2].tolist()
    jitter = (0.9 + 0.2 * torch.rand((2, n), generator=gen)).tolist()
    layer, proj = lm.layers[0], model.model.multi_modal_projector.linear_2
    emb, mlp = lm.embed_tokens.weight, layer.mlp
    classes = list(zip(("first", "delimiter"), markers, neurons, (first_ids, delim_ids),
                       (MASSIVE_FIRST, MASSIVE_DELIMITER), jitter))
    with torch.no_grad():
        for _, t, _, ids, _, _ in classes:
            emb[:, t] = 0.0
            emb[ids, t] = 1.0
            layer.self_attn.o_proj.weight[t, :] = 0.0
            proj.weight[t, :] = 0.0
            proj.bias[t] = 0.0
            lm.norm.weight[t] = 0.0
        # what each marker reads at layer 0's MLP input on a chat prompt
        text = tokenizer.apply_chat_template([{"role": "user", "content": _CORPUS.splitlines()[0]}], tokenize=False,
                                             add_generation_prompt=True)
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        seen = {}
        hook = layer.post_attention_layernorm.register_forward_hook(lambda m, i, o: seen.update(x=o[0]))
        try:
            lm(input_ids=ids)
        finally:
            hook.remove()
        act = float(torch.nn.functional.silu(torch.tensor(10.0))) * 10.0  # silu(g z) * g z at the median z
        for _, t, j, tids, values, jit in classes:
            z = float(seen["x"][torch.isin(ids[0], torch.tensor(tids)), t].median())
            g = _quantize_scale(10.0 / z)
            for w in (mlp.gate_proj.weight, mlp.up_proj.weight):
                w[j, :] = 0.0
                w[j, t] = g
            mlp.down_proj.weight[:, j] = 0.0
            for c, v, f in zip(channels, values, jit):
                mlp.down_proj.weight[c, j] = v * f / act
    return {"channels": channels, "markers": markers, "first_token_ids": first_ids, "delimiter_ids": delim_ids}


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

    tokenizer = _make_tokenizer()
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
    _init_vision(inner.vision_tower.timm_model, gen)
    _init_text(inner.language_model, gen, n_tokens, embed_std)
    _init_projector(model, gen, image_size, embed_std)
    for name, t in model.state_dict().items():
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise AssertionError(f"{name} was not initialised")

    model.generation_config = GenerationConfig(
        bos_token_id=endoftext_id, eos_token_id=im_end_id, pad_token_id=endoftext_id
    )
    return model, tokenizer
