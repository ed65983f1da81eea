"""Where a decoder part's graphs keep their weights: one file per part, every tensor in it once.

A part of the ``decoder/parts`` form is traced once per graph (prompt and token, `.decoder_parts.graph_kinds`) and
each trace holds the part's weights again: at FastVLM-7B a part of 3 layers is 2.8 GB of float32 weights per
graph, 28 GB per graph kind. `SharedWeights` writes the part's graphs' tensors to one file, ``part{k}_of_{P}.onnx.data``
(each graph's tensors name it as their ``location``), and stores a tensor only when the file does not hold the same
bytes yet (length and sha256): the token graph adds only its own zeros of another past length. Readers find the
file through the graphs (`vlmrun.onnx_files.graph_files`); onnx refuses a data file with several names (a hard
link), so the graphs name the one file.

`place_graph` moves a traced graph into the export folder: whole when small, else with its tensors in a weights
file (the part's, or ``<graph>.onnx.data``), whether torch wrote them inside the graph or (above 2 GiB) one file
per tensor beside it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from vlmrun.onnx_files import tensors

from .torch_common import EXTERNAL_DATA_THRESHOLD

#: initializers smaller than this stay inside the graph (onnx's own threshold when it saves external data)
INLINE_BYTES = 1024
_CHUNK = 64 << 20


class SharedWeights:
    """One weights file (``path``, created on first use) that several graphs in its folder point into."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.stored: dict[tuple[int, str], int] = {}  # (length, sha256) -> offset

    def store(self, proto, source_dir: Path) -> None:
        """Put every tensor of ``proto`` that torch wrote outside it (files under ``source_dir``) and every
        initializer of at least `INLINE_BYTES` it holds inside into the file, and point the tensors there (in
        place). External tensors are streamed: memory stays at a chunk, whatever the size of the weights."""
        import onnx

        if not self.path.exists():
            self.path.write_bytes(b"")
        with open(self.path, "r+b") as dst:
            for tensor, initializer in tensors(proto.graph):
                if tensor.data_location == onnx.TensorProto.EXTERNAL:
                    offset, length = self._copy_file(dst, tensor, source_dir)
                elif initializer and tensor.HasField("raw_data"):  # what onnx.save_model moves out, likewise
                    raw = tensor.raw_data
                    if len(raw) < INLINE_BYTES:
                        continue
                    offset, length = self._copy_bytes(dst, raw)
                    del raw
                    tensor.ClearField("raw_data")
                    tensor.data_location = onnx.TensorProto.EXTERNAL
                else:
                    continue
                del tensor.external_data[:]
                for key, value in (("location", self.path.name), ("offset", offset), ("length", length)):
                    entry = tensor.external_data.add()
                    entry.key, entry.value = key, str(value)

    def _copy_bytes(self, dst, data: bytes) -> tuple[int, int]:
        key = (len(data), hashlib.sha256(data).hexdigest())
        if key not in self.stored:
            self.stored[key] = dst.seek(0, os.SEEK_END)
            dst.write(data)
        return self.stored[key], len(data)

    def _copy_file(self, dst, tensor, source_dir: Path) -> tuple[int, int]:
        """Copy an external tensor's bytes to the end of the file while hashing them; when the file held them
        already, cut the copy off again and point at the stored bytes."""
        from onnx.external_data_helper import ExternalDataInfo

        info = ExternalDataInfo(tensor)
        src_path = source_dir / info.location
        length = info.length if info.length is not None else src_path.stat().st_size - (info.offset or 0)
        offset = dst.seek(0, os.SEEK_END)
        digest = hashlib.sha256()
        with open(src_path, "rb") as src:
            src.seek(info.offset or 0)
            left = length
            while left:
                block = src.read(min(_CHUNK, left))
                if not block:
                    raise OSError(f"{src_path} ends before the {length} bytes of tensor {tensor.name!r}")
                digest.update(block)
                dst.write(block)
                left -= len(block)
        key = (length, digest.hexdigest())
        if key in self.stored:
            dst.truncate(offset)
        else:
            self.stored[key] = offset
        return self.stored[key], length


def place_graph(staged: Path, path: Path, weights: SharedWeights | None = None) -> list[str]:
    """Move the traced graph ``staged`` to ``path``, its weights in ``weights`` (the part's file; by default
    ``<graph>.onnx.data``) when torch wrote them to files of their own (above 2 GiB) or the graph is big
    (`EXTERNAL_DATA_THRESHOLD`); the files the graph is made of."""
    import onnx

    if any(f != staged for f in staged.parent.iterdir()) or staged.stat().st_size > EXTERNAL_DATA_THRESHOLD:
        weights = weights or SharedWeights(path.parent / (path.name + ".data"))
        proto = onnx.load(str(staged), load_external_data=False)
        weights.store(proto, staged.parent)
        onnx.save_model(proto, str(path))
        return [path.name, weights.path.name]
    os.replace(staged, path)
    return [path.name]
