"""The FastVLM family's sizes, and random-weight checkpoints at those sizes written as Apple ships them.

`SIZES` holds the dimensions of each size ``vlmrun make-tiny --size`` builds. The three real ones are Apple's
FastVLM-0.5B / 1.5B / 7B: the same FastViTHD tower (1024 x 1024, 3072-wide features) in front of Qwen2-0.5B /
1.5B / 7B (Qwen2 dimensions from the models' ``config.json``: see `FamilySize.source`). ``tiny`` is the model
`vlmrun.tiny.make_tiny` builds.

`write_random_apple` writes a random-weight checkpoint at a size in Apple's ``llava_qwen2`` layout (the key
names and ``config.json`` that `vlmrun.checkpoint_convert` reads), bf16, sharded, tensor by tensor
(`vlmrun.checkpoint_shards.write_shards`): the decoder's tensors are drawn one at a time when their turn comes,
so memory stays at the largest tensor (the 7B embedding, 1.1 GB) plus the vision tower (125M parameters, built and
initialised whole because its projector is calibrated on its output). The weights carry signal as the tiny
model's do (`vlmrun.tiny`): the same init rules, drawn per tensor from a generator seeded by the tensor's name.

torch, timm and transformers are imported inside the functions only.
"""

from __future__ import annotations

import hashlib
import math
import os
import pathlib
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .atomic import check_free_space
from .errors import UsageError

__all__ = [
    "FORMATS",
    "SIZES",
    "FamilySize",
    "check_target",
    "checkpoint_bytes",
    "size_named",
    "write_random_apple",
    "write_tiny_apple",
]

#: Checkpoint formats ``make-tiny`` writes: transformers' native one (one float32 ``model.safetensors``) and
#: Apple's ``llava_qwen2`` layout in bf16 shards with an index.
FORMATS = ("native", "apple-sharded")


#: The vision tower of every real size: FastViTHD (timm ``fastvit_mci3`` defaults), 3072-wide features.
_FASTVITHD = {"hidden_size": 3072, "model_args": {"inference_mode": True}}


@dataclass(frozen=True)
class FamilySize:
    """One size of the family: the Qwen2 decoder's dimensions, Apple's vocabulary rows, the vision tower."""

    name: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab_rows: int  #: rows of Apple's embedding (and lm_head) matrix: Apple's ``vocab_size``
    tie: bool
    vision: dict[str, Any] = field(default_factory=lambda: dict(_FASTVITHD))
    max_positions: int = 32768
    source: str = ""

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    def text_config(self) -> dict[str, Any]:
        """The Qwen2 ``text_config`` entries of this size (ids are the tokenizer's, set by the writer)."""
        return {
            "hidden_size": self.hidden, "intermediate_size": self.intermediate, "num_hidden_layers": self.layers,
            "num_attention_heads": self.heads, "num_key_value_heads": self.kv_heads,
            "max_position_embeddings": self.max_positions, "max_window_layers": self.layers,
            "hidden_act": "silu", "rope_theta": 1_000_000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": self.tie,
            "use_sliding_window": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        }  # fmt: skip


_QWEN2 = "Qwen/{0} config.json (Qwen2 family); FastViTHD at 1024 as in apple/FastVLM-0.5B (docs: reference fastvlm.md)"

#: The sizes of ``vlmrun make-tiny --size``. ``tiny`` is today's make-tiny model (`vlmrun.tiny`), listed for its
#: decoder dimensions; its vision tower is the tiny one and its vocabulary the tokenizer's rows padded to 64.
SIZES: dict[str, FamilySize] = {
    "tiny": FamilySize("tiny", 64, 128, 2, 4, 2, 448, True,
                       vision={"hidden_size": 256, "model_args": {"inference_mode": True, "layers": [1, 1, 1, 1, 1],
                                                                  "embed_dims": [8, 16, 32, 64, 128]}},
                       max_positions=2048, source="vlmrun.tiny (random weights, the project's own)"),
    "0.5b": FamilySize("0.5b", 896, 4864, 24, 14, 2, 151936, True,
                       source="apple/FastVLM-0.5B config.json (" + _QWEN2.format("Qwen2-0.5B") + ")"),
    "1.5b": FamilySize("1.5b", 1536, 8960, 28, 12, 2, 151936, True, source=_QWEN2.format("Qwen2-1.5B")),
    "7b": FamilySize("7b", 3584, 18944, 28, 28, 4, 152064, False, source=_QWEN2.format("Qwen2-7B")),
}


def size_named(name: str) -> FamilySize:
    """The size called ``name`` (case-insensitive); `UsageError` naming the sizes otherwise."""
    size = SIZES.get(str(name).strip().lower())
    if size is None:
        raise UsageError(f"unknown model size {name!r}; expected one of {', '.join(SIZES)}")
    return size


# --------------------------------------------------------------------------------------------------------------
# what gets written


def _native_model_on_meta(size: FamilySize, image_size: int, ids: dict[str, int]):
    """The native FastVLM of ``size`` on torch's meta device (names and shapes, no memory)."""
    import torch
    from transformers import (
        FastVlmForConditionalGeneration,
        Qwen2Config,
        TimmWrapperConfig,
    )

    from .fastvlm_files import fastvlm_config

    vision = TimmWrapperConfig(architecture="fastvit_mci3", do_pooling=True, global_pool="avg",
                               initializer_range=0.02, **size.vision)
    text = Qwen2Config(vocab_size=size.vocab_rows, bos_token_id=ids["bos"], eos_token_id=ids["eos"],
                       pad_token_id=ids["bos"], **size.text_config())
    config = fastvlm_config(vision, text, ids["image"], image_size, tie=size.tie)
    with torch.device("meta"):
        return FastVlmForConditionalGeneration(config).eval()


def checkpoint_bytes(size: FamilySize) -> int:
    """Bytes of the bf16 weights of ``size`` in Apple's layout (what `write_random_apple` writes, to 0.1%)."""
    h, i, kv = size.hidden, size.intermediate, size.kv_heads * size.head_dim
    layer = h * h * 2 + h * kv * 2 + (h + 2 * kv) + 3 * h * i + 2 * h
    text = size.layers * layer + h + size.vocab_rows * h * (1 if size.tie else 2)
    feat = int(size.vision["hidden_size"])
    vision_params = 126_000_000 if feat == 3072 else 500_000  # FastViTHD (mobileclip_l) / the tiny tower
    projector = feat * h + h * h + 2 * h + feat * 768  # + MCi's unused head.proj
    return 2 * (text + vision_params + projector)


def check_target(out_dir: str | os.PathLike, size: FamilySize) -> pathlib.Path:
    """The absolute path of ``out_dir`` once it is known to be writable for ``size``: `UsageError` when it
    exists and is not an empty directory, or its disk has too little room (`vlmrun.atomic.check_free_space`)."""
    target = pathlib.Path(out_dir).expanduser().absolute()
    if os.path.lexists(target) and (not target.is_dir() or target.is_symlink() or any(target.iterdir())):
        raise UsageError(f"{target} exists and is not empty; remove it or choose another output directory")
    check_free_space(target, checkpoint_bytes(size))
    return target


# --------------------------------------------------------------------------------------------------------------
# random weights, tensor by tensor


def _generator(seed: int, name: str):
    import torch

    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


#: float32 bytes of vocabulary rows drawn at once (`_text_maker`)
ROWS_DRAWN_BYTES = 64 << 20


def _text_maker(name: str, shape: tuple[int, ...], size: FamilySize, n_tokens: int, seed: int) -> Callable[[], Any]:
    """``make()`` for one decoder tensor (native name), bf16: `vlmrun.tiny`'s Qwen2 init (q/k gain 2, residual
    branches 2 * sqrt(2 / layers), norms 1 + 0.05 N(0, 1), token rows 0.02 N(0, 1), padding rows 0)."""
    import torch

    resid = 2.0 * math.sqrt(2.0 / size.layers)
    gains = {"q_proj": 2.0, "k_proj": 2.0, "v_proj": resid, "o_proj": resid, "gate_proj": 1.0, "up_proj": 1.0,
             "down_proj": resid}

    def make():
        gen = _generator(seed, name)
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            t = torch.zeros(shape, dtype=torch.bfloat16)
            # in blocks of rows: the float32 draws of a 7B vocabulary at once were 2 x 2.2 GB beside the bf16 rows.
            # torch draws normals 16 at a time, so blocks of a multiple of 16 values give the same values as one draw
            rows = max(1, ROWS_DRAWN_BYTES // (4 * shape[1])) if shape[1] % 16 == 0 else n_tokens
            for lo in range(0, n_tokens, rows):
                hi = min(n_tokens, lo + rows)
                t[lo:hi] = torch.randn((hi - lo, shape[1]), generator=gen).mul_(0.02).to(torch.bfloat16)
            return t
        if name.endswith("norm.weight"):
            return (1.0 + 0.05 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
        if name.endswith(".bias"):
            return (0.02 * torch.randn(shape, generator=gen)).to(torch.bfloat16)
        proj = name.split(".")[-2]
        return (torch.randn(shape, generator=gen) * (gains[proj] / math.sqrt(shape[1]))).to(torch.bfloat16)

    return make


def _vision_and_projector(model, image_size: int, seed: int) -> dict[str, Any]:
    """Materialise and initialise the vision tower and projector of the meta ``model`` as `vlmrun.tiny` does
    (projector scaled so image embeddings have the token embeddings' std); their bf16 tensors by native name."""
    import torch

    from .tiny_weights import init_projector, init_vision

    inner = model.model
    inner.vision_tower.to_empty(device="cpu")
    inner.multi_modal_projector.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(int(seed))
    init_vision(inner.vision_tower.timm_model, gen)
    init_projector(model, gen, image_size, 0.02)
    proj = inner.multi_modal_projector
    out = {}
    for prefix, module in (("model.vision_tower.", inner.vision_tower), ("model.multi_modal_projector.", proj)):
        for key, t in module.state_dict().items():
            out[prefix + key] = t.to(torch.bfloat16) if t.is_floating_point() else t
    return out


def _specs(size: FamilySize, image_size: int, seed: int, tokenizer, dense_vocab: bool = False) -> tuple[list, Any]:
    """The `TensorSpec` list of the Apple checkpoint (Apple's names, bf16) and the native meta model."""
    import torch

    from .checkpoint_keys import APPLE_HEAD_PROJ, native_key_to_apple
    from .checkpoint_shards import TensorSpec
    from .tiny_tokenizer import SPECIAL_TOKENS

    bos, _, eos, image = tokenizer.convert_tokens_to_ids(list(SPECIAL_TOKENS))
    model = _native_model_on_meta(size, image_size, {"bos": bos, "eos": eos, "image": image})
    n_tokens = size.vocab_rows if dense_vocab else image  # Apple's tokenizer has no <image>: the rows past it stay 0
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if size.tie:
        shapes.pop("lm_head.weight", None)
    vision = _vision_and_projector(model, image_size, seed)
    specs = []
    for name, shape in shapes.items():
        make = (lambda t=vision[name]: t) if name in vision else _text_maker(name, shape, size, n_tokens, seed)
        dtype = vision[name].dtype if name in vision else torch.bfloat16
        specs.append(TensorSpec(native_key_to_apple(name), shape, dtype, make))
    feat = int(size.vision["hidden_size"])
    specs.append(TensorSpec(APPLE_HEAD_PROJ, (feat, 768), torch.bfloat16,
                            lambda: torch.zeros((feat, 768), dtype=torch.bfloat16)))  # MCi's CLIP projection; unused
    return specs, model


def write_random_apple(out_dir: str | os.PathLike, size: FamilySize | str, *, image_size: int = 1024, seed: int = 0,
                       shard_bytes: int | None = None, on_bytes: Callable[[int], None] | None = None,
                       on_total: Callable[[int], None] | None = None, dense_vocab: bool = False) -> pathlib.Path:
    """Write a random-weight FastVLM of ``size`` in Apple's ``llava_qwen2`` layout, bf16, sharded, into
    ``out_dir`` (which must not exist or be empty; it appears complete or not at all). ``on_total(bytes)`` is
    called once the tensors are planned, ``on_bytes(n)`` after each tensor (progress). `UsageError` when the
    disk has too little room (the bytes needed are named). Returns the absolute path.

    The embedding rows past the tokenizer's are 0 (Apple's vocabulary has rows this tokenizer never reads), unless
    ``dense_vocab``: then every row is random, as in a real checkpoint, whose tied lm_head is dense. Measure a
    bundle's bytes on a dense one: a compiled mostly-zero lm_head is a fraction of its 4-bit size (the 1.5B's last
    part: 26 MB for a 152000 x 1536 lm_head and one layer)."""
    from .checkpoint_formats import write_checkpoint_dir
    from .checkpoint_shards import DEFAULT_SHARD_BYTES

    size = size_named(size) if isinstance(size, str) else size
    target = check_target(out_dir, size)

    def build(tmp: pathlib.Path) -> None:
        _write_random(tmp, size, image_size, seed, shard_bytes or DEFAULT_SHARD_BYTES, on_bytes, on_total,
                      dense_vocab)

    return write_checkpoint_dir(target, build)


def _write_random(tmp: pathlib.Path, size: FamilySize, image_size: int, seed: int, shard_bytes: int,
                  on_bytes, on_total, dense_vocab: bool) -> None:
    import json

    from transformers import GenerationConfig

    from .checkpoint_shards import write_shards
    from .checkpoint_to_apple import apple_config, write_apple_tokenizer
    from .fastvlm_files import fastvlm_image_processor
    from .tiny_tokenizer import make_tokenizer

    tokenizer = make_tokenizer()
    native_tok = tmp / ".native-tokenizer"
    tokenizer.save_pretrained(native_tok)
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    write_apple_tokenizer(native_tok, tmp, image_id)
    shutil.rmtree(native_tok)
    specs, model = _specs(size, image_size, seed, tokenizer, dense_vocab)
    if on_total:
        on_total(sum(s.nbytes for s in specs))
    write_shards(tmp, specs, shard_bytes, on_bytes)
    text = model.config.text_config.to_dict()
    config = apple_config(text, dict(size.vision), image_size=image_size, vocab_rows=size.vocab_rows, tie=size.tie,
                          dtype="bfloat16")
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    bos, eos = text["bos_token_id"], text["eos_token_id"]
    GenerationConfig(bos_token_id=bos, eos_token_id=eos, pad_token_id=bos).save_pretrained(str(tmp))
    fastvlm_image_processor(image_size).save_pretrained(str(tmp))


def write_tiny_apple(out_dir: str | os.PathLike, *, image_size: int = 1024, seed: int = 0,
                     shard_bytes: int | None = None) -> pathlib.Path:
    """Today's tiny model (`vlmrun.tiny.make_tiny`, the same weights) written in Apple's layout, bf16, sharded, by
    the writer the real sizes use (`vlmrun.checkpoint_to_apple.save_as_apple` with ``shard_bytes``)."""
    import tempfile

    import torch

    from .checkpoint_shards import DEFAULT_SHARD_BYTES
    from .checkpoint_to_apple import save_as_apple
    from .tiny import make_tiny

    target = check_target(out_dir, SIZES["tiny"])
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{target.name}.native-", dir=target.parent) as tmp:
        native = make_tiny(pathlib.Path(tmp) / "native", image_size=image_size, seed=seed)
        return save_as_apple(native, target, dtype=torch.bfloat16, shard_bytes=shard_bytes or DEFAULT_SHARD_BYTES)
