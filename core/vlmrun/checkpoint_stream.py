"""A checkpoint's weights read one tensor at a time, and the torch model with only the tensors one export needs.

A sharded checkpoint (one with a `SAFETENSORS_INDEX`) is exported part by part (issue 32, "streaming export"):

* `ShardedWeights` maps each weight name to its shard through the index and opens a shard (``safe_open``, lazy:
  only the header is parsed and the asked tensor copied out) only when one of its tensors is read. A shard no
  asked tensor lives in is never opened; one that is missing or unreadable is named in a one-line `InputError`.
* `load_part` builds the native FastVLM on torch's meta device (names and shapes, no memory) and materialises
  only the weights under the given name prefixes, in float32 (``load_state_dict(..., assign=True)``); the rest
  stays on the meta device. Peak memory follows the part: a decoder part's layers (+ the final norm and the
  lm_head for the last one), the vision tower and projector, or the embedding rows.
* `check_budget`: with ``VLMRUN_MEMORY_BUDGET_GB`` set (`MEMORY_BUDGET_ENV`), an export whose estimated peak
  (`export_peak_bytes`) is above it stops before anything is written, with a `UsageError` (exit 2) naming the
  size needed.

The prefixes of each stage are `STAGE_WEIGHTS` and `decoder_weights`. torch and transformers are imported inside
the functions only.
"""

from __future__ import annotations

import os
import pathlib
from collections.abc import Callable, Iterable, Sequence

from .checkpoint_formats import EXTRA_ROWS_FILE, SAFETENSORS_INDEX, SOURCE_WEIGHTS_FILE, VOCAB_FILE, read_json
from .checkpoint_keys import NATIVE_EMBED, NATIVE_LM_HEAD
from .errors import InputError, UsageError

__all__ = [
    "MEMORY_BUDGET_ENV",
    "STAGE_WEIGHTS",
    "DECODER_WEIGHTS",
    "ShardedWeights",
    "decoder_weights",
    "is_sharded",
    "read_source_weights",
    "load_part",
    "meta_model",
    "part_bytes",
    "export_peak_bytes",
    "memory_budget",
    "check_budget",
]

#: The environment variable holding the memory budget of one export, in GB (unset: no budget).
MEMORY_BUDGET_ENV = "VLMRUN_MEMORY_BUDGET_GB"

_TEXT = "model.language_model."
#: Native weight-name prefixes of the stages exported from part of the model.
STAGE_WEIGHTS = {
    "vision": ("model.vision_tower.",),
    "projector": ("model.multi_modal_projector.",),
    "embed": (NATIVE_EMBED,),
}
#: The whole decoder (every layer, the final norm, the lm_head and the embedding the wrappers hold).
DECODER_WEIGHTS = (_TEXT, NATIVE_LM_HEAD)

#: The legacy ONNX exporter's peak over the float32 weights it traces (the module, the traced graph's constants,
#: the serialised proto and its copy when the weights move to a ``.data`` file), plus what torch and transformers
#: take once imported: at 1.5B a 7-layer part (1.31 GB of float32 weights) peaked at 6.07 GB (docs/models.md).
EXPORT_WEIGHT_COPIES = 4
EXPORT_BASE_BYTES = 1 << 30


def decoder_weights(lo: int, hi: int, last: bool, embed: bool = False) -> tuple[str, ...]:
    """The prefixes of decoder layers ``lo..hi-1`` (+ the final norm and the lm_head when ``last``, + the
    embedding when ``embed``)."""
    prefixes = [f"{_TEXT}layers.{i}." for i in range(lo, hi)]
    if last:
        prefixes += [f"{_TEXT}norm.", NATIVE_LM_HEAD]
    if embed:
        prefixes.append(NATIVE_EMBED)
    return tuple(prefixes)


def is_sharded(path: str | os.PathLike) -> bool:
    """Whether the checkpoint directory has a `SAFETENSORS_INDEX`, or reads its weights from its source's shards
    (`SOURCE_WEIGHTS_FILE`): its export streams, part by part."""
    path = pathlib.Path(path)
    return (path / SAFETENSORS_INDEX).is_file() or (path / SOURCE_WEIGHTS_FILE).is_file()


def read_source_weights(path: str | os.PathLike) -> dict | None:
    """`SOURCE_WEIGHTS_FILE` of the checkpoint at ``path``, checked (``None``: the checkpoint holds its weights)."""
    file = pathlib.Path(path) / SOURCE_WEIGHTS_FILE
    if not file.is_file():
        return None
    data = read_json(file, "a map of the converted weights to their source")
    weight_map = data.get("weight_map")
    ok = isinstance(data.get("source"), str) and isinstance(weight_map, dict) and all(
        isinstance(v, list) and len(v) == 2 and all(isinstance(x, str) for x in v) for v in weight_map.values())
    if not ok or any(pathlib.PurePath(f).name != f or f in (".", "..") for f, _ in weight_map.values()):
        raise InputError(f"{file} is not a map of weight name -> [shard file, stored name]; convert the model again"
                         " (vlmrun store rm, or --rebuild)")
    return data


class ShardedWeights:
    """The tensors of a safetensors checkpoint directory by name, each read from its shard only when asked.

    A checkpoint converted without copying its weights (`SOURCE_WEIGHTS_FILE`) reads each from its source's shard
    under its stored name (Apple's), the grown vocabulary weights from its own `VOCAB_FILE`."""

    def __init__(self, path: str | os.PathLike):
        self.path = pathlib.Path(path)
        self.source: pathlib.Path | None = None  #: where a converted checkpoint's weights are read
        self.stored: dict[str, str] = {}  #: weight name -> its name in the file, where they differ
        self.files = self._file_map()  #: weight name -> shard file name

    def _file_map(self) -> dict[str, str]:
        linked = read_source_weights(self.path)
        if linked is not None:
            self.source = pathlib.Path(linked["source"])
            files = {}
            for key, (name, stored) in linked["weight_map"].items():
                files[key] = name if name == VOCAB_FILE else str(self.source / name)
                if stored != key:
                    self.stored[key] = stored
            return files
        index = self.path / SAFETENSORS_INDEX
        if index.is_file():
            weight_map = read_json(index, "a safetensors index with a weight_map").get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
                raise InputError(f"{index} has no weight_map of weight name -> shard file; expected a safetensors index")
            if any(pathlib.PurePath(f).name != f or f in (".", "..") for f in weight_map.values()):
                raise InputError(f"{index} names shard files outside {self.path}; expected plain file names")
            return dict(weight_map)
        files = {}
        for file in sorted(p for p in self.path.glob("*.safetensors") if p.name != EXTRA_ROWS_FILE):
            with self._open(file.name, "its weight names") as f:
                for key in f.keys():
                    if key in files:
                        raise InputError(f"weight {key!r} appears in more than one file in {self.path}")
                    files[key] = file.name
        return files

    def __contains__(self, key: str) -> bool:
        return key in self.files

    def shard_of(self, key: str) -> pathlib.Path:
        if key not in self.files:
            raise InputError(f"{self.path} has no weight {key!r}; expected a FastVLM checkpoint")
        return self.path / self.files[key]

    def _open(self, name: str, wanted: str):
        from safetensors import safe_open

        file = self.path / name
        if not file.is_file():
            if self.source is not None and file.parent == self.source:
                raise InputError(f"shard {file} is missing; the converted model {self.path} reads {wanted} from"
                                 f" the checkpoint it was converted from: put it back, or open the model from"
                                 " where it is now")
            raise InputError(f"shard {file} is missing; it holds {wanted}: copy it back or convert the model again")
        try:
            return safe_open(str(file), framework="pt", device="cpu")
        except Exception as exc:  # safetensors raises its own error types
            reason = " ".join(str(exc).split()) or type(exc).__name__
            raise InputError(f"cannot read shard {file} ({reason}); it holds {wanted}: copy it back or convert"
                             " the model again") from None

    def header(self, key: str) -> tuple[str, tuple[int, ...]]:
        """The stored dtype (safetensors' name, e.g. ``BF16``) and shape of ``key`` (the shard's header only)."""
        self.shard_of(key)
        with self._open(self.files[key], key) as f:
            part = f.get_slice(self.stored.get(key, key))
            return part.get_dtype(), tuple(part.get_shape())

    def headers(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """`header` of every weight, one shard open at a time; `InputError` when a shard lacks a weight its
        index puts there."""
        by_file: dict[str, list[str]] = {}
        for key, name in self.files.items():
            by_file.setdefault(name, []).append(key)
        out = {}
        for name, keys in sorted(by_file.items()):
            with self._open(name, f"{len(keys)} weights") as f:
                present = set(f.keys())
                absent = sorted(k for k in keys if self.stored.get(k, k) not in present)
                if absent:
                    raise InputError(f"{self.path}: {SAFETENSORS_INDEX} puts {absent[:3]} in {name}, which does not"
                                     " hold them; expected the shards the index was written for")
                for key in keys:
                    part = f.get_slice(self.stored.get(key, key))
                    out[key] = (part.get_dtype(), tuple(part.get_shape()))
        return out

    def read(self, key: str, dtype=None):
        """The tensor ``key`` (torch, CPU), converted to ``dtype`` when given."""
        self.shard_of(key)
        with self._open(self.files[key], key) as f:
            try:
                tensor = f.get_tensor(self.stored.get(key, key))
            except Exception as exc:
                raise InputError(f"cannot read {key} from {self.shard_of(key)} ({exc}); convert the model again") from None
        return tensor if dtype is None else tensor.to(dtype)


# --------------------------------------------------------------------------------------------------------------
# the model with some weights


def meta_model(path: pathlib.Path):
    """The native FastVLM of the checkpoint at ``path`` on torch's meta device, in eval mode."""
    import torch
    from transformers import AutoConfig, FastVlmForConditionalGeneration

    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        return FastVlmForConditionalGeneration(config).eval()


def _keys_under(state: Iterable[str], prefixes: Sequence[str]) -> list[str]:
    prefixes = tuple(prefixes)
    return [k for k in state if k.startswith(prefixes)]


def part_bytes(fvlm, prefixes: Sequence[str]) -> int:
    """Bytes of the float32 weights under ``prefixes`` of the (meta) model ``fvlm`` (a tied lm_head counted once)."""
    state = fvlm.state_dict()
    seen, total = set(), 0
    for key in _keys_under(state, prefixes):
        t = state[key]
        if id(t) not in seen:
            seen.add(id(t))
            total += 4 * t.numel()
    return total


def export_peak_bytes(weight_bytes: int) -> int:
    """The estimated peak memory of exporting a module holding ``weight_bytes`` of float32 weights."""
    return EXPORT_WEIGHT_COPIES * weight_bytes + EXPORT_BASE_BYTES


def memory_budget() -> int | None:
    """The memory budget of one export in bytes, from `MEMORY_BUDGET_ENV` (``None``: unset)."""
    raw = os.environ.get(MEMORY_BUDGET_ENV, "").strip()
    if not raw:
        return None
    try:
        gb = float(raw)
    except ValueError:
        gb = -1.0
    if not gb > 0:
        raise UsageError(f"{MEMORY_BUDGET_ENV}={raw!r} is not a positive number of GB (e.g. 12)")
    return int(gb * 1e9)


def physical_memory() -> int:
    """This machine's memory in bytes."""
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def memory_allowed() -> int:
    """The memory one step may take, in bytes: the budget (`MEMORY_BUDGET_ENV`), else half of this machine's (the
    reference's parts, a parts decoder's calibration)."""
    budget = memory_budget()
    return budget if budget is not None else physical_memory() // 2


def check_budget(what: str, needed: int, smallest: int | None = None) -> None:
    """`UsageError` (exit 2) when ``needed`` bytes are above the memory budget; ``smallest``: the need of the
    smallest unit it can be split into (one decoder layer), named too."""
    budget = memory_budget()
    if budget is None or needed <= budget:
        return
    hint = "raise the budget"
    if smallest is not None:
        hint = (f"one decoder layer alone needs {smallest / 1e9:.2f} GB: raise the budget to at least that and"
                " split the decoder into more parts (param layers)") if smallest > budget else \
               "split the decoder into more parts (param layers) or raise the budget"
    raise UsageError(f"{what} needs about {needed / 1e9:.2f} GB of memory, more than the budget"
                     f" {MEMORY_BUDGET_ENV}={budget / 1e9:g} GB; {hint}")


def load_part(path: str | os.PathLike, prefixes: Sequence[str], what: str,
              on_tensor: Callable[[str], None] | None = None):
    """The native FastVLM of the sharded checkpoint at ``path`` with only the weights under ``prefixes``
    materialised, float32, read shard by shard (`ShardedWeights`); the other weights stay on the meta device.

    ``what`` names the export in the budget's error (`check_budget`); ``on_tensor(name)`` is called after each
    tensor read (progress)."""
    import torch

    path = pathlib.Path(path)
    fvlm = meta_model(path)
    state = fvlm.state_dict()
    keys = _keys_under(state, prefixes)
    check_budget(what, export_peak_bytes(part_bytes(fvlm, prefixes)), _one_layer(fvlm, keys))
    weights = ShardedWeights(path)
    tensors = {}
    for key in keys:
        source = NATIVE_EMBED if key == NATIVE_LM_HEAD and key not in weights else key  # a tied lm_head
        tensors[key] = weights.read(source, torch.float32)
        if on_tensor:
            on_tensor(key)
    fvlm.load_state_dict(tensors, strict=False, assign=True)
    _retie(fvlm, keys)
    if any(p.startswith(_TEXT) or _TEXT.startswith(p) for p in prefixes):  # some or all of the language model
        _real_rotary(fvlm)
    return fvlm.eval()


def _one_layer(fvlm, keys: list[str]) -> int | None:
    """Bytes needed to export one decoder layer, when ``keys`` hold layers (else ``None``)."""
    if not any(k.startswith(f"{_TEXT}layers.") for k in keys):
        return None
    return export_peak_bytes(part_bytes(fvlm, (f"{_TEXT}layers.0.",)))


def _retie(fvlm, keys: list[str]) -> None:
    """A tied lm_head and embedding loaded together share one parameter again (as ``from_pretrained`` leaves them)."""
    if fvlm.config.tie_word_embeddings and NATIVE_EMBED in keys and NATIVE_LM_HEAD in keys:
        fvlm.lm_head.weight = fvlm.model.language_model.embed_tokens.weight


def _real_rotary(fvlm) -> None:
    """The rotary embedding's tables are buffers no checkpoint holds: built on the CPU from the config."""
    lm = fvlm.model.language_model
    lm.rotary_emb = type(lm.rotary_emb)(config=fvlm.config.text_config)
