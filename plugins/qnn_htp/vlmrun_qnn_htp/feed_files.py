"""Calibration feeds on disk, each array stored as the box around its nonzero bytes.

A decoder part's calibration feed is mostly its layers' past keys and values at the graph's whole past length,
of which a call has filled only the positions before it: the rest are zeros (at 1024 px a calibration prompt fills
about 290 of the 896 past positions of an AR-128 call, and the token graph's kept calls fewer on average). The parts
decoder keeps every part's feeds on disk until each part is quantized (`.calibration.parts_calibration_feeds`,
`.calibration_sequence`), so those zeros were most of the disk a large model's calibration took (FastVLM-7B: about
117 MB per feed over its 28 layers).

`save_arrays` writes an ``.npz`` (uncompressed, as `numpy.savez`) holding, per array, the smallest box that holds
every element whose bytes are not all zero, and where the box sits (``NAME#box``: the array's shape, then the box's
start on each axis); `load_arrays` puts each box back into zeros of the array's shape. Bytes, not values, are
compared, so a ``-0.0`` or a NaN is kept as it was: the arrays read back are the arrays written, to the bit, and a
part quantized from them is the same part. A file without boxes (written by `numpy.savez`) reads as it is.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["box", "unbox", "save_arrays", "load_arrays"]

BOX = "#box"  # the suffix of an array's box entry in the .npz


def _nonzero(value: np.ndarray) -> np.ndarray:
    """Per element: are any of its bytes not zero (a -0.0 counts as nonzero)."""
    if value.dtype.itemsize in (1, 2, 4, 8) and value.dtype.kind not in "OUSV":
        return value.view(f"u{value.dtype.itemsize}") != 0
    raw = value.reshape(-1).view(np.uint8).reshape(value.size, value.dtype.itemsize)
    return raw.any(axis=1).reshape(value.shape)


def box(value: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the contents of the smallest box holding every nonzero element of ``value``, [shape..., start...])."""
    value = np.asarray(value)
    shape = np.asarray(value.shape, dtype=np.int64)
    if value.ndim == 0 or value.size == 0:
        return value, np.concatenate([shape, np.zeros(value.ndim, np.int64)])
    value = np.ascontiguousarray(value)  # (it would make a 0-d array 1-d)
    nz = _nonzero(value)
    start, stop = [], []
    for axis in range(value.ndim):
        hits = np.flatnonzero(nz.any(axis=tuple(a for a in range(value.ndim) if a != axis)))
        start.append(int(hits[0]) if hits.size else 0)
        stop.append(int(hits[-1]) + 1 if hits.size else 0)
    content = value[tuple(slice(a, b) for a, b in zip(start, stop))]
    return content, np.concatenate([shape, np.asarray(start, dtype=np.int64)])


def unbox(content: np.ndarray, where: np.ndarray) -> np.ndarray:
    """The array `box` was given: zeros of its shape with ``content`` at its start."""
    n = len(where) // 2
    shape, start = [int(x) for x in where[:n]], [int(x) for x in where[n:]]
    if n == 0 or tuple(shape) == content.shape:
        return content
    out = np.zeros(shape, dtype=content.dtype)
    out[tuple(slice(a, a + s) for a, s in zip(start, content.shape))] = content
    return out


def save_arrays(path: Path, arrays: dict[str, np.ndarray]) -> Path:
    """Write ``arrays`` to the ``.npz`` at ``path``, each as its `box`."""
    entries = {}
    for name, value in arrays.items():
        entries[name], entries[name + BOX] = box(np.asarray(value))
    with open(path, "wb") as f:  # a file object: numpy adds no .npz suffix of its own
        np.savez(f, **entries)
    return Path(path)


def load_arrays(path: Path, names=None) -> dict[str, np.ndarray]:
    """The arrays `save_arrays` wrote to ``path`` (only ``names`` when given), in the order written."""
    with np.load(path) as z:
        files = set(z.files)
        wanted = [n for n in z.files if not n.endswith(BOX) and (names is None or n in names)]
        return {n: unbox(z[n], z[n + BOX]) if n + BOX in files else z[n] for n in wanted}
