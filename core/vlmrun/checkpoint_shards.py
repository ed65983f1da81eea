"""Write a sharded safetensors checkpoint tensor by tensor, as transformers and Apple lay it out.

`write_shards` takes the list of tensors to write (`TensorSpec`: name, shape, dtype and a function that makes the
tensor), plans shards of at most ``shard_bytes`` (in the given order; a tensor larger than that gets a shard of
its own), and writes each shard's header and then its tensors one at a time, each made only when its turn comes
and dropped after. Memory stays at one tensor, whatever the size of the model. Files:
``model-00001-of-0000N.safetensors`` ... and `SAFETENSORS_INDEX` (``metadata.total_size``, ``weight_map``), as
``save_pretrained`` writes them; the safetensors format itself (an 8-byte little-endian header length, a JSON
header padded to 8 bytes, the tensors' bytes in header order) is what ``safetensors.safe_open`` reads.

torch is imported inside the functions only.
"""

from __future__ import annotations

import json
import pathlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .checkpoint_formats import SAFETENSORS_INDEX

__all__ = ["DEFAULT_SHARD_BYTES", "TensorSpec", "plan_shards", "shard_name", "write_shards", "write_shard_groups",
           "write_single", "torch_dtype"]

#: Shard size of `write_shards` by default: 2 GB (Apple's and transformers' older default).
DEFAULT_SHARD_BYTES = 2_000_000_000

#: safetensors' dtype names for torch dtypes (by ``str(dtype)``) and their sizes in bytes.
_DTYPES = {"torch.bfloat16": ("BF16", 2), "torch.float16": ("F16", 2), "torch.float32": ("F32", 4),
           "torch.int64": ("I64", 8), "torch.int32": ("I32", 4), "torch.bool": ("BOOL", 1)}


@dataclass(frozen=True)
class TensorSpec:
    """One tensor to write: its name, shape, torch dtype, and ``make()`` giving it (called once, when written)."""

    name: str
    shape: tuple[int, ...]
    dtype: Any
    make: Callable[[], Any]

    @property
    def nbytes(self) -> int:
        size = _DTYPES[str(self.dtype)][1]
        for d in self.shape:
            size *= int(d)
        return size


def shard_name(k: int, count: int) -> str:
    """transformers' shard file name, ``model-0000k-of-0000N.safetensors`` (k from 1)."""
    return f"model-{k:05d}-of-{count:05d}.safetensors"


def plan_shards(specs: Sequence[TensorSpec], shard_bytes: int) -> list[list[TensorSpec]]:
    """``specs`` in order, cut into shards of at most ``shard_bytes`` (a larger tensor alone in its shard)."""
    shards: list[list[TensorSpec]] = [[]]
    used = 0
    for spec in specs:
        if shards[-1] and used + spec.nbytes > shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(spec)
        used += spec.nbytes
    return shards if shards[0] else []


def write_shards(out_dir: pathlib.Path, specs: Sequence[TensorSpec], shard_bytes: int = DEFAULT_SHARD_BYTES,
                 on_bytes: Callable[[int], None] | None = None) -> dict:
    """Write ``specs`` as sharded safetensors plus `SAFETENSORS_INDEX` into ``out_dir``; the index written.

    ``on_bytes(n)`` is called after each tensor with the bytes just written (a progress bar's advance)."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("a tensor name appears twice")
    return write_shard_groups(out_dir, plan_shards(specs, shard_bytes), on_bytes)


def write_shard_groups(out_dir: pathlib.Path, shards: Sequence[Sequence[TensorSpec]],
                       on_bytes: Callable[[int], None] | None = None) -> dict:
    """Write each group of ``shards`` as one shard file, in order, plus `SAFETENSORS_INDEX`; the index written."""
    specs = [s for shard in shards for s in shard]
    weight_map: dict[str, str] = {}
    for k, shard in enumerate(shards, start=1):
        file = shard_name(k, len(shards))
        _write_one_shard(out_dir / file, shard, on_bytes)
        weight_map.update((s.name, file) for s in shard)
    index = {"metadata": {"total_size": sum(s.nbytes for s in specs)}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return index


def write_single(file: pathlib.Path, specs: Sequence[TensorSpec],
                 on_bytes: Callable[[int], None] | None = None) -> None:
    """Write ``specs`` into the one safetensors file ``file`` (no index), tensor by tensor."""
    _write_one_shard(file, specs, on_bytes)


def torch_dtype(name: str):
    """The torch dtype of safetensors' dtype ``name`` (``BF16``, ``F32``, ...)."""
    import torch

    for key, (st_name, _) in _DTYPES.items():
        if st_name == name:
            return getattr(torch, key.split(".", 1)[1])
    raise ValueError(f"unsupported safetensors dtype {name}")


def _header(shard: Sequence[TensorSpec]) -> bytes:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for s in shard:
        header[s.name] = {"dtype": _DTYPES[str(s.dtype)][0], "shape": list(s.shape),
                          "data_offsets": [offset, offset + s.nbytes]}
        offset += s.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    return raw + b" " * (-len(raw) % 8)


def _write_one_shard(path: pathlib.Path, shard: Sequence[TensorSpec], on_bytes: Callable[[int], None] | None) -> None:
    header = _header(shard)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(header)))
        f.write(header)
        for spec in shard:
            f.write(_tensor_bytes(spec))
            if on_bytes:
                on_bytes(spec.nbytes)


def _tensor_bytes(spec: TensorSpec) -> memoryview:
    """The made tensor's bytes (checked against the spec: a wrong shape or dtype would corrupt the shard)."""
    import torch

    t = spec.make()
    if tuple(t.shape) != tuple(spec.shape) or t.dtype != spec.dtype:
        raise ValueError(f"{spec.name}: made {tuple(t.shape)} {t.dtype}, expected {tuple(spec.shape)} {spec.dtype}")
    flat = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
    return memoryview(flat.numpy())
