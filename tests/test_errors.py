"""Bad inputs give one clear line, a non-zero exit and no traceback; killed builds leave nothing trusted."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from conftest import run_cli

BASE = ["--image-size", "256", "--max-new-tokens", "3"]


def one_error_line(res, code=1):
    assert res.returncode == code, (res.returncode, res.stderr)
    assert "Traceback" not in res.stderr
    lines = [l for l in res.stderr.splitlines() if l.startswith("vlmrun: error:")]
    assert len(lines) == 1, res.stderr
    return lines[0]


@pytest.fixture(scope="module")
def warm(cache_dir, tiny_model, ref_pipe):
    """The tiny model and its exports already in the shared store."""
    return cache_dir


def test_missing_image(warm, tmp_path):
    line = one_error_line(run_cli(["--image", str(tmp_path / "nope.jpg"), "--prompt", "x", *BASE], warm))
    assert f"image not found: {tmp_path / 'nope.jpg'}" in line


def test_text_file_named_jpg(warm, tmp_path):
    f = tmp_path / "notes.jpg"
    f.write_text("this is not a picture\n")
    line = one_error_line(run_cli(["--image", str(f), "--prompt", "x", *BASE], warm))
    assert "is not an image file" in line and "notes.jpg" in line


def test_truncated_jpeg(warm, tmp_path, image_path):
    f = tmp_path / "cut.jpg"
    f.write_bytes(image_path.read_bytes()[:2000])
    line = one_error_line(run_cli(["--image", str(f), "--prompt", "x", *BASE], warm))
    assert "truncated or corrupt" in line


def test_prompt_longer_than_context(warm, image_path):
    line = one_error_line(run_cli(["--image", str(image_path), "--prompt", "tell me " * 40, "--context-length", "64",
                                   *BASE], warm))
    assert "holds 64" in line and "shorten the prompt" in line
    # the model's own context (max_position_embeddings) applies without the option
    line = one_error_line(run_cli(["--image", str(image_path), "--prompt", "hello there " * 2500, *BASE], warm))
    assert "shorten the prompt" in line


def test_model_dir_that_is_not_fastvlm(warm, tmp_path, image_path):
    d = tmp_path / "qwen"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    line = one_error_line(run_cli(["--image", str(image_path), "--prompt", "x", "--model", str(d), *BASE], warm))
    assert "qwen2" in line and "FastVLM" in line
    line = one_error_line(run_cli(["--image", str(image_path), "--prompt", "x", "--model", str(tmp_path / "none"),
                                   *BASE], warm))
    assert "none" in line


def test_usage_errors_exit_2(warm, image_path):
    res = run_cli(["--image", str(image_path)], warm)
    assert res.returncode == 2 and "give both --image and --prompt" in res.stderr
    res = run_cli(["--image", str(image_path), "--prompt", "x", "--layout", "fastest"], warm)
    assert res.returncode == 2 and "unknown layout 'fastest'" in res.stderr
    res = run_cli(["--image", str(image_path), "--prompt", " "], warm)  # was answered, as if asked something
    assert res.returncode == 2 and "--prompt is empty" in res.stderr


def test_sampling_values_out_of_range_and_a_typed_placeholder(warm, image_path):
    for flag, value, why in (("--seed", "-1", "-1 is not in the range 0<=x<=2147483647"),  # was an internal error
                             ("--temperature", "nan", "'nan' is not a finite number"),  # was taken
                             ("--top-p", "inf", "is not in the range")):
        res = run_cli(["--image", str(image_path), "--prompt", "x", flag, value, *BASE], warm)
        assert res.returncode == 2 and why in res.stderr and "Traceback" not in res.stderr, (flag, res.stderr)
    line = one_error_line(run_cli(["--image", str(image_path), "--prompt", "What is <image>?", *BASE], warm))
    assert "text holds <image>, the model's picture placeholder" in line  # it blamed the model's chat template


def test_debug_shows_traceback(warm, tmp_path):
    res = run_cli(["--image", str(tmp_path / "nope.jpg"), "--prompt", "x", "--debug", *BASE], warm)
    assert res.returncode != 0 and "Traceback" in res.stderr


KILLED_BUILD = textwrap.dedent('''
    import os, signal, sys
    from vlmrun.store import ArtifactStore
    store = ArtifactStore(sys.argv[1])
    def build(tmp):
        (tmp / "vision.onnx").write_bytes(b"half an onnx file")
        os.kill(os.getpid(), signal.SIGKILL)
    store.get_or_build({"stage": "vision", "backend": "onnx", "kind": "vision"}, build)
''')


def writer(name, data):
    def build(d):
        (d / name).write_bytes(data)
        return {"files": [name]}

    return build


def test_killed_export_leaves_no_trusted_artifact(tmp_path):
    from vlmrun.store import ArtifactStore

    res = subprocess.run([sys.executable, "-c", KILLED_BUILD, str(tmp_path)], capture_output=True)
    assert res.returncode == -9
    key = {"stage": "vision", "backend": "onnx", "kind": "vision"}
    store = ArtifactStore(tmp_path)
    assert store.lookup(key) is None
    assert not store.path_for(key).exists()
    leftovers = list((tmp_path / "artifacts").glob(".tmp-*"))
    assert leftovers, "the killed build's temp dir is where the half file went"
    art = store.get_or_build(key, writer("vision.onnx", b"whole"))
    assert art.file().read_bytes() == b"whole"
    store.clean_stale(older_than_s=0)
    assert not list((tmp_path / "artifacts").glob(".tmp-*"))


def test_exception_during_export_cleans_up(tmp_path):
    from vlmrun.store import ArtifactStore

    store = ArtifactStore(tmp_path)
    key = {"stage": "decoder", "kind": "x"}

    def fail(d):
        (d / "partial.onnx").write_bytes(b"x")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        store.get_or_build(key, fail)
    assert store.lookup(key) is None and not list((tmp_path / "artifacts").iterdir())


def test_corrupted_artifact_is_rebuilt(tmp_path):
    from vlmrun.store import ArtifactStore

    store = ArtifactStore(tmp_path)
    key = {"stage": "vision", "kind": "y"}
    art = store.get_or_build(key, writer("a.bin", b"1234"))
    art.file().write_bytes(b"4321")  # same size, different bytes
    fresh = ArtifactStore(tmp_path)
    assert fresh.lookup(key) is None
    calls = []
    build = writer("a.bin", b"1234")
    fresh.get_or_build(key, lambda d: calls.append(1) or build(d))
    assert calls == [1] and fresh.lookup(key).file().read_bytes() == b"1234"


def test_large_files_are_rehashed_only_when_touched(tmp_path, monkeypatch):
    import os

    from vlmrun import store as store_mod

    monkeypatch.setattr(store_mod, "FULL_HASH_LIMIT", 3)  # "large" = more than 3 bytes
    store = store_mod.ArtifactStore(tmp_path)
    key = {"stage": "decoder", "kind": "big"}
    art = store.get_or_build(key, writer("w.data", b"123456"))
    hashed = []
    real = store_mod.sha256_file
    monkeypatch.setattr(store_mod, "sha256_file", lambda f: hashed.append(f.name) or real(f))
    assert store_mod.ArtifactStore(tmp_path).lookup(key) is not None and hashed == []
    st = art.file().stat()
    art.file().write_bytes(b"654321")  # same size, new mtime: hashed again, and caught
    os.utime(art.file(), ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    assert store_mod.ArtifactStore(tmp_path).lookup(key) is None and hashed == ["w.data"]


def _png_header(width, height):
    """A PNG whose header claims width x height (Pillow checks the pixel count when it opens the file)."""
    import struct
    import zlib

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"")) + chunk(b"IEND", b"")


def test_decompression_bomb_is_a_usage_error(warm, tmp_path):
    f = tmp_path / "huge.png"
    f.write_bytes(_png_header(20000, 20000))
    res = run_cli(["--image", str(f), "--prompt", "x", *BASE], warm)
    line = one_error_line(res, code=2)
    assert line == (f"vlmrun: error: image {f} has 400,000,000 pixels, over Pillow's decompression-bomb limit of"
                    " 178,956,970 pixels; downscale it first (the model resizes it to its own input size anyway)")
    assert "internal error" not in res.stderr and len(res.stderr.strip().splitlines()) == 1


def test_a_full_disk_is_one_line_naming_the_file(monkeypatch, capsys):
    """ENOSPC anywhere under a command (an export, the calibration's spilled feeds) is one line, exit 1; other
    OS errors stay internal errors."""
    import errno

    from vlmrun import cli

    def full(**kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "/big/feeds/part3/000012/past_key_0_in.npy")

    monkeypatch.setattr(cli.cli, "main", full)
    assert cli.main(["plugins"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("vlmrun: error: no space left on the disk writing /big/feeds/part3/000012/past_key_0_in.npy; free"
                   " space there, or move the artifact store (--cache-dir, VLMRUN_CACHE_DIR) or the temporary files"
                   " (TMPDIR) to a larger disk")

    def denied(**kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", "/root/x")

    monkeypatch.setattr(cli.cli, "main", denied)
    assert cli.main(["plugins"]) == 1
    assert capsys.readouterr().err.startswith("vlmrun: internal error: PermissionError")


def test_an_output_path_that_cannot_be_written_is_a_usage_error_before_any_work(tmp_path, cache_dir):
    """They were internal errors, some after the whole run (eval --report FILE, tune --out FILE/x.toml)."""
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    cases = [
        (["eval", "--report", str(a_file), "--limit", "1"], "'--report'", "is a file, not a folder"),
        (["tune", "--out", str(a_file / "best.toml")], "'--out'", f"cannot be created: {a_file} is a file"),
        (["tune", "--out", str(tmp_path)], "'--out'", "is a folder; give a file name"),
        (["bundle", str(a_file)], "'OUT'", "is a file, not a folder"),
        (["bundle", "/proc/vlmrun-bundle"], "'OUT'", "cannot be created in /proc"),
        (["make-tiny", "/proc/vlmrun-tiny"], "'OUT_DIR'", "cannot be created in /proc"),
        (["diff", "--save", str(a_file)], "'--save'", "is a file, not a folder"),
        (["store", "list", "--cache-dir", str(a_file)], "'--cache-dir'", "is a file"),  # said the store was ok
        (["store", "verify", "--cache-dir", str(a_file)], "'--cache-dir'", "is a file"),
        (["--cache-dir", "/proc/vlmrun-store", "--image", "x.png", "--prompt", "x"], "'--cache-dir'",
         "cannot be created in /proc"),
    ]
    for args, option, why in cases:
        res = run_cli(args, cache_dir, timeout=120)
        assert res.returncode == 2 and "Traceback" not in res.stderr, (args, res.stderr)
        line = res.stderr.strip().splitlines()[-1]
        assert line.startswith(f"Error: Invalid value for {option}:") and why in line, (args, line)
    assert a_file.read_text() == "x" and sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_layout_file_or_prompt_that_cannot_be_read_is_one_line(warm, tmp_path, image_path):
    cases = [(b'vision = "qnn_htp"\n', "vision = 'qnn_htp' is not a table; write it as [vision]"),
             (b'[vision]\nbackend = "\xff"\n', "is not UTF-8 text"),
             (b"[decoder]\nbackend = 3\n", "[decoder] backend must be a plugin's name")]
    for text, why in cases:
        f = tmp_path / "layout.toml"
        f.write_bytes(text)
        res = run_cli(["--layout-file", str(f), "--image", str(image_path), "--prompt", "x", *BASE], warm)
        assert why in one_error_line(res, 2), res.stderr
    bad = "What is this \udcff?"  # a byte the shell could not decode: a lone surrogate
    from vlmrun.errors import InputError
    from vlmrun.preprocess import tokenize_conversation, tokenize_prompt

    for tokenize in (tokenize_prompt, tokenize_conversation):
        with pytest.raises(InputError, match="the prompt is not valid UTF-8 text"):
            tokenize(None, bad, 1, 4)


def test_layout_and_a_layout_files_other_base_disagree_in_one_line(warm, tmp_path, image_path):
    f = tmp_path / "on-reference.toml"
    f.write_text('base = "reference"\n\n[decoder]\ncontext_length = 512\n')
    res = run_cli(["--layout", "all-npu", "--layout-file", str(f), "--image", str(image_path), "--prompt", "x", *BASE],
                  warm)  # --layout won, silently
    assert f"--layout all-npu and the layout file {f}'s base = \"reference\" disagree" in one_error_line(res, 2)


def test_non_finite_logits_are_an_error_not_a_token():
    """A decoder whose numbers overflowed: greedy picked the NaN's id, sampling drew index 0 whatever the seed."""
    import numpy as np

    from vlmrun.errors import BackendError
    from vlmrun.sampling import Sampler, SamplingSettings

    logits = np.linspace(-1.0, 1.0, 64)
    logits[50] = np.nan
    for settings in (SamplingSettings(), SamplingSettings(0.8, 0, 0.9, 3)):
        with pytest.raises(BackendError, match="the decoder gave 1 non-finite logits"):
            Sampler(settings)(logits)
    assert Sampler()(np.nan_to_num(logits)) == 63  # finite: as before
