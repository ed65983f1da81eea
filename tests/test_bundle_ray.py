"""``vlmrun bundle --ray ADDRESS``: on a real local Ray cluster (loopback only) the decoder's parts are quantized and
compiled as Ray tasks (one per part, each declaring its memory) and the bundle is the one a single process writes: the
same quantized graphs, binaries, graphs and per-part layers, the same answer and logits; without ``--ray`` every part
is made in the compiling process; an unreachable address and a failing task are one line each."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import attrs
import numpy as np
import pytest

from conftest import free_port, run_cli

#: two parts (two tasks), quantized (the calibration on the driver, the quantization in the tasks); 0 verify items
OPTS = ["-o", "decoder.parts=2", "-o", "decoder.precision=w8a16", "--verify-items", "0", "--json"]
PROMPT = "Describe the image."



def _link_or_copy(src, dst):
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)


def store_copy(cache: Path, dest: Path, drop: str) -> Path:
    """The store (hard links: artifacts are never changed in place) without the artifact ``drop``, eval results or
    tuned points."""
    shutil.copytree(cache, dest, copy_function=_link_or_copy,
                    ignore=lambda d, names: [n for n in names if n == drop or (Path(d) == cache and n in ("eval", "tune"))])
    return dest


def decoder_manifest(cache: Path, bundle: dict) -> dict:
    return json.loads((cache / "artifacts" / bundle["decoder"]["source"] / "manifest.json").read_text())


def unpadded(name: str) -> str:
    """A Genie graph name without its zero padding (padded to onnxruntime's graph name, which each compile names
    anew)."""
    return re.sub(r"_0+_(\d+_of_\d+)$", r"_\1", name)


@pytest.fixture(scope="module")
def one_node(tiny_model, cache_dir, tmp_path_factory):
    """The bundle written in one process (no --ray): (folder, manifest, decoder artifact manifest)."""
    out = tmp_path_factory.mktemp("bundle-one-node") / "b"
    t0 = time.perf_counter()
    res = run_cli(["bundle", str(out), *OPTS], cache_dir, timeout=1200)
    assert res.returncode == 0, res.stderr
    manifest = json.loads(res.stdout)
    print(f"one-node bundle: {time.perf_counter() - t0:.1f} s")
    return out, manifest, decoder_manifest(cache_dir, manifest)


@pytest.fixture(scope="module")
def on_ray(one_node, cache_dir, ray_cluster, tmp_path_factory):
    """The same bundle with --ray, on a copy of the store without the compiled decoder (so that it is compiled
    again, on Ray): (folder, manifest, decoder artifact manifest, store copy)."""
    address, env = ray_cluster
    _, manifest, _ = one_node
    copy = store_copy(cache_dir, tmp_path_factory.mktemp("bundle-ray") / "cache", manifest["decoder"]["source"])
    out = copy.parent / "b"
    t0 = time.perf_counter()
    res = run_cli(["bundle", str(out), *OPTS, "--ray", address], copy, env_extra=env, timeout=1200)
    assert res.returncode == 0, res.stderr
    ray_manifest = json.loads(res.stdout)
    print(f"--ray bundle (decoder compiled again): {time.perf_counter() - t0:.1f} s")
    return out, ray_manifest, decoder_manifest(copy, ray_manifest), copy


def test_without_ray_every_part_is_made_in_the_compiling_process(one_node):
    _, manifest, dec = one_node
    assert manifest["decoder"]["parts"] == 2 and len(dec["decoder_parts"]["parts"]) == 2
    assert "part_processes" not in dec  # named only when a part was made in another process


def test_the_parts_are_ray_tasks_and_the_bundle_is_the_one_node_bundle(one_node, on_ray):
    one_out, one_manifest, one_dec = one_node
    ray_out, ray_manifest, ray_dec, copy = on_ray
    # the decoder was compiled again, each part in a Ray task (a worker process on the cluster's node)
    where = ray_dec["part_processes"]
    assert sorted(where) == ["decoder part 1/2", "decoder part 2/2"]
    assert all(w.get("ray_node") for w in where.values()), where
    # the same artifact key, the same manifest keys, the same quantized graphs and binaries
    assert ray_manifest["decoder"] == one_manifest["decoder"]
    assert set(ray_dec) - {"part_processes"} == set(one_dec)
    a, b = one_dec["decoder_parts"], ray_dec["decoder_parts"]
    assert b["binaries_in_order"] == a["binaries_in_order"] and b["count"] == a["count"] == 2
    for pa, pb in zip(a["parts"], b["parts"], strict=True):
        assert (pb["index"], pb["layers"], pb["binaries"]) == (pa["index"], pa["layers"], pa["binaries"])
        assert pb["source_sha256"] == pa["source_sha256"]  # the QDQ graphs (their encodings) byte for byte
        assert list(pb["graphs"]) == list(pa["graphs"])
        for kind, ga in pa["graphs"].items():
            gb = pb["graphs"][kind]
            assert (gb["binary"], gb["ar"], gb["inputs"], gb["outputs"]) == (ga["binary"], ga["ar"], ga["inputs"],
                                                                             ga["outputs"])
            assert unpadded(gb["name"]) == unpadded(ga["name"])
    assert [unpadded(g) for g in ray_dec["graphs"]] == [unpadded(g) for g in one_dec["graphs"]]
    assert ray_dec["files"] == one_dec["files"]
    timeless = ("quantize_s", "times")
    assert ({k: v for k, v in ray_dec["quantization"].items() if k not in timeless}
            == {k: v for k, v in one_dec["quantization"].items() if k not in timeless})
    assert set(ray_manifest) == set(one_manifest) and set(ray_manifest["files"]) == set(one_manifest["files"])
    # the work dir (in the store: every node sees it) is gone
    state = copy / "state" / one_manifest["decoder"]["source"]
    assert not state.exists() or not any(state.iterdir())


def test_a_bundle_killed_after_its_first_part_resumes_from_it_with_the_same_bytes(one_node, cache_dir,
                                                                                  tmp_path_factory):
    """A long decoder compile killed part-way (SIGKILL to its process group once part 1 is kept in the store's
    state folder) starts again from the feeds and the part it made: part 1 is taken, not made again, and the
    decoder's binaries, graphs and quantization facts are the one-node bundle's; the kept folder is gone after."""
    from vlmrun.procs import kill_group

    _, manifest, one_dec = one_node
    name = manifest["decoder"]["source"]
    copy = store_copy(cache_dir, tmp_path_factory.mktemp("bundle-resume") / "cache", name)
    kept = copy / "state" / name / "made-parts"
    env = dict(os.environ, VLMRUN_CACHE_DIR=str(copy), HF_HUB_OFFLINE="1")
    proc = subprocess.Popen([sys.executable, "-m", "vlmrun.cli", "bundle", str(copy.parent / "killed"), *OPTS],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not (kept / "part1" / "made.json").is_file():
            assert proc.poll() is None, f"the bundle ended (exit {proc.returncode}) before part 1 was kept"
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        kill_group(proc)
    assert not (kept / "part2" / "made.json").exists() and (kept / "feeds.json").is_file()
    assert not (copy / "artifacts" / name).exists()
    made_before = {f.name: f.read_bytes() for f in (kept / "part1").iterdir() if f.suffix == ".bin"}

    out = copy.parent / "b"
    res = run_cli(["bundle", str(out), *OPTS], copy, timeout=1200)
    assert res.returncode == 0, res.stderr
    assert "decoder part 1/2: made by an earlier compile, taken" in res.stderr, res.stderr
    assert "decoder part 2/2: made by an earlier compile" not in res.stderr
    assert "recorded by an earlier compile, taken" in res.stderr
    again = json.loads(res.stdout)
    assert again["decoder"] == manifest["decoder"]
    dec = decoder_manifest(copy, again)
    assert dec["resumed_parts"] == [1] and set(dec) - {"resumed_parts"} == set(one_dec)
    assert made_before and all((copy / "artifacts" / name / b).read_bytes() == data  # taken, not made again
                               for b, data in made_before.items())
    a, b = one_dec["decoder_parts"], dec["decoder_parts"]
    assert b["binaries_in_order"] == a["binaries_in_order"]
    for pa, pb in zip(a["parts"], b["parts"], strict=True):
        assert (pb["index"], pb["layers"], pb["binaries"]) == (pa["index"], pa["layers"], pa["binaries"])
        assert pb["source_sha256"] == pa["source_sha256"]  # the QDQ graphs (their encodings) byte for byte
        assert {k: (g["ar"], g["inputs"], g["outputs"]) for k, g in pb["graphs"].items()} == {
            k: (g["ar"], g["inputs"], g["outputs"]) for k, g in pa["graphs"].items()}
    assert [unpadded(g) for g in dec["graphs"]] == [unpadded(g) for g in one_dec["graphs"]]
    assert dec["files"] == one_dec["files"]
    timeless = ("quantize_s", "times")
    assert ({k: v for k, v in dec["quantization"].items() if k not in timeless}
            == {k: v for k, v in one_dec["quantization"].items() if k not in timeless})
    assert not kept.exists()


CAPTURE = """
import sys
import numpy as np
from vlmrun import GenerationSettings, Pipeline
from vlmrun.model import default_model
from vlmrun.store import ArtifactStore
folder, cache, image, prompt, out = sys.argv[1:]
store = ArtifactStore(cache)
pipe = Pipeline.build(default_model(store, 256), f"bundle:{folder}", store=store)
got = pipe.capture(image, prompt, GenerationSettings(max_new_tokens=4))
np.savez(out, tokens=got["tokens"], logits=got["logits"])
"""


def capture(folder: Path, cache: Path, image: Path, out: Path) -> dict:
    """The bundle's tokens and teacher-forced logits, in a process of its own (one bundle's QNN sessions a
    process), over the store it was written from (the decoder's logits come from its compile there)."""
    env = dict(os.environ, VLMRUN_CACHE_DIR=str(cache), HF_HUB_OFFLINE="1")
    res = subprocess.run([sys.executable, "-c", CAPTURE, str(folder), str(cache), str(image), PROMPT, str(out)],
                         capture_output=True, text=True, env=env, timeout=900)
    assert res.returncode == 0, res.stderr
    with np.load(out) as z:
        return {k: z[k] for k in z.files}


def test_the_ray_bundle_answers_like_the_one_node_bundle(one_node, on_ray, cache_dir, image_path, tmp_path):
    one = capture(one_node[0], cache_dir, image_path, tmp_path / "one.npz")
    ray = capture(on_ray[0], on_ray[3], image_path, tmp_path / "ray.npz")
    assert list(ray["tokens"]) == list(one["tokens"]) and len(one["tokens"])
    a, b = one["logits"].astype(np.float64), ray["logits"].astype(np.float64)
    assert a.shape == b.shape and a.size
    np.testing.assert_allclose(b, a, rtol=0, atol=1e-3 * np.abs(a).max())


# -- the executor under a compile context ---------------------------------------------------------------------------

def _where(job):
    return os.getpid(), job


def _fails(job):
    raise ValueError(f"job {job} broke\nsecond line")


def test_a_compile_context_runs_its_jobs_where_asked(ray_cluster, tiny_model, store, monkeypatch):
    from vlmrun import cluster, plugins
    from vlmrun.errors import BackendError
    from vlmrun.pipeline import StageCompileContext, StageContext

    ctx = StageContext("qnn_htp", "decoder", tiny_model, {}, store, plugins.load())
    local = StageCompileContext(ctx, "some-artifact")
    assert local.map(_where, [1, 2, 3]) == [(os.getpid(), 1), (os.getpid(), 2), (os.getpid(), 3)]
    work = local.work_dir("vlmrun-test-")
    assert work.is_dir() and Path(tempfile.gettempdir()) in work.parents
    work.rmdir()

    address, env = ray_cluster
    monkeypatch.setenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", env["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"])
    executor = cluster.executor(address, store.root)  # joins: Ray is imported only now (it reads the env then)
    import ray.cloudpickle

    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the tasks' functions are this module's
    try:
        remote = StageCompileContext(attrs.evolve(ctx, executor=executor), "some-artifact")
        done = remote.map(_where, [1, 2], [1 << 30, 2 << 30], ["part a", "part b"])
        assert [j for _, j in done] == [1, 2] and all(pid != os.getpid() for pid, _ in done)
        work = remote.work_dir("vlmrun-test-")
        assert store.root in work.parents  # every node sees the store
        work.rmdir()
        with pytest.raises(BackendError) as err:
            remote.map(_fails, [1, 2], names=["decoder part 1/2", "decoder part 2/2"])
        assert str(err.value) == "decoder part 1/2 failed: job 1 broke"
    finally:
        ray.cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        ray.shutdown()


def test_an_unreachable_cluster_is_one_line_and_writes_nothing(cache_dir, tiny_model, tmp_path):
    out = tmp_path / "b"
    res = run_cli(["bundle", str(out), *OPTS, "--ray", f"127.0.0.1:{free_port()}"], cache_dir,
                  env_extra={"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}, timeout=300)
    assert res.returncode == 2, res.stderr
    lines = [line for line in res.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "cannot join the Ray cluster at 127.0.0.1:" in lines[0], res.stderr
    assert not out.exists() and not list(tmp_path.iterdir())


def test_a_kept_part_with_a_short_file_is_made_again_and_rebuild_starts_from_nothing(tmp_path):
    from vlmrun_qnn_htp.parts_resume import MadeParts, keep

    class Context:
        def state_dir(self):
            return tmp_path / "state"

    out = tmp_path / "out1"
    out.mkdir()
    (out / "part1_of_2.bin").write_bytes(b"binary" * 100)
    (out / "part1_of_2_prompt_ctx.onnx").write_bytes(b"wrapper")
    result = {"entry": {"binaries": ["part1_of_2.bin"]}, "wrappers": ["part1_of_2_prompt_ctx.onnx"], "q_times": {}}
    made = MadeParts.for_compile(Context())
    keep(made.part_dir(1), result, out)
    again = tmp_path / "out2"
    again.mkdir()
    assert made.made(1, again) == result and (again / "part1_of_2.bin").read_bytes() == b"binary" * 100
    assert made.made(2, again) is None
    with open(Path(made.part_dir(1)) / "part1_of_2.bin", "r+b") as f:  # a file cut short
        f.truncate(10)
    assert MadeParts.for_compile(Context()).made(1, tmp_path) is None
    keep(made.part_dir(1), result, out)
    assert MadeParts.for_compile(Context()).made(1, again) == result
    assert MadeParts.for_compile(Context(), rebuild=True).made(1, again) is None
    assert MadeParts(None).made(1, again) is None and MadeParts(None).part_dir(1) is None
