"""qnn_htp's calibration feeds on disk (vlmrun_qnn_htp.feed_files): each array as the box around its nonzero bytes,
read back to the bit."""

from __future__ import annotations

import numpy as np
import pytest

from vlmrun_qnn_htp.feed_files import box, load_arrays, save_arrays, unbox


def past(filled: int, length: int = 64, heads: int = 2, dim: int = 8, seed: int = 0) -> np.ndarray:
    """A past of keys as the host loop feeds it: ``filled`` positions written, the rest zeros."""
    out = np.zeros((1, heads, length, dim), np.float32)
    out[:, :, :filled] = np.random.default_rng(seed).standard_normal((1, heads, filled, dim), dtype=np.float32)
    return out


def test_a_past_is_stored_as_its_filled_positions():
    content, where = box(past(10))
    assert content.shape == (1, 2, 10, 8)
    assert where.tolist() == [1, 2, 64, 8, 0, 0, 0, 0]
    assert np.array_equal(unbox(content, where), past(10))


@pytest.mark.parametrize("value", [
    np.zeros((3, 4), np.float32),  # nothing nonzero: an empty box
    np.float32(2.5) * np.ones((), np.float32),  # a scalar
    np.zeros((0, 5), np.int64),  # no elements
    np.array([[0.0, -0.0, 0.0], [0.0, 0.0, np.nan]], np.float32),  # -0.0 and NaN are bytes, kept
    np.array([[0, 0, 0], [0, 7, 0], [0, 0, 0]], np.int32),  # a box in the middle
    np.array([[False, True], [False, False]]),
    np.arange(12, dtype=np.float16).reshape(3, 4) - 5,
], ids=["zeros", "scalar", "empty", "negative-zero-nan", "middle", "bool", "float16"])
def test_every_array_reads_back_to_the_bit(value, tmp_path):
    path = save_arrays(tmp_path / "f.npz", {"x": value, "nested/name": value})
    back = load_arrays(path)
    assert list(back) == ["x", "nested/name"]
    for got in back.values():
        assert got.dtype == value.dtype and got.shape == value.shape and got.tobytes() == value.tobytes()


def test_the_file_holds_the_boxes_not_the_zeros(tmp_path):
    arrays = {f"{i}/past_key_0": past(8 * i, length=512, seed=i) for i in range(4)}  # 0, 8, 16, 24 of 512 filled
    path = save_arrays(tmp_path / "feeds.npz", arrays)
    raw = sum(a.nbytes for a in arrays.values())
    filled = sum(a[:, :, : 8 * i].nbytes for i, a in enumerate(arrays.values()))
    assert path.stat().st_size < filled + 4096 < raw / 10
    assert {k: v.tobytes() for k, v in load_arrays(path).items()} == {k: v.tobytes() for k, v in arrays.items()}
    assert list(load_arrays(path, {"2/past_key_0"})) == ["2/past_key_0"]


def test_a_file_numpy_wrote_reads_as_it_is(tmp_path):
    value = past(5)
    np.savez(tmp_path / "old.npz", **{"0/past_key_0": value})
    assert load_arrays(tmp_path / "old.npz")["0/past_key_0"].tobytes() == value.tobytes()
