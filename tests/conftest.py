"""Shared fixtures: one tiny FastVLM (256x256, 16 image tokens) built and exported once per test session."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# numpy's OpenBLAS starts a thread per core in every process, and after each call those threads spin waiting for
# the next: with two workers on two cores and every CLI call, engine worker and compile child a process of its own,
# the spinning only takes CPU from the other worker (a `vlmrun --layout all-npu` answer: 2.8 CPU-s, 2.4 with one
# BLAS thread). Set before numpy is imported here; every process the suite starts inherits it.
os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# The stand-ins (tests/standins/: adb, genie-app, qnn-net-run ...) are `#!/usr/bin/env python3` scripts, run many
# times per test (every adb push and shell). They run on the suite's own interpreter, not on whatever python3 comes
# first on PATH: on a machine whose python3 is a pyenv shim (a bash script that runs `pyenv exec`, then an
# interpreter whose site .pth files import more), tests/test_phone_chat.py took 131 s instead of 67 s.
os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
# Each CLI call, engine worker and compile child imports vlmrun and its plugins from source. With
# PYTHONDONTWRITEBYTECODE set (some sandboxes set it) every one of those processes compiled them again (`vlmrun
# --help`: 0.50-0.68 CPU-s instead of 0.35-0.42); their bytecode is written once, into __pycache__ folders git ignores.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
# Two workers share two cores: onnxruntime's CPU sessions (a thread per core, spinning between ops) took 7-8% of the
# suite's CPU spinning against the other worker (perf of a whole run). One thread per session (vlmrun.cpu; the tiny
# model's diffs print the same figures at 1 and 2 threads; test_reference checks the answers): 14:29 -> 11:57.
os.environ.setdefault("VLMRUN_CPU_THREADS", "1")
# torch's OpenMP threads (export, the torch reference) spun between parallel regions: 1.5% of the suite's CPU in
# torch's libgomp (the same perf run). Passive waiting changes no result, only what an idle thread does.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

IMAGE_SIZE = 256
VLMRUN = [sys.executable, "-m", "vlmrun.cli"]


def run_cli(args, cache_dir, env_extra=None, timeout=600):
    """Run the vlmrun CLI in a subprocess; returns CompletedProcess (text)."""
    env = dict(os.environ, VLMRUN_CACHE_DIR=str(cache_dir), HF_HUB_OFFLINE="1")
    env.update(env_extra or {})
    return subprocess.run([*VLMRUN, *args], capture_output=True, text=True, env=env, timeout=timeout)


def cosine(a, b) -> float:
    a = np.asarray(a, dtype=np.float64).ravel()
    b = np.asarray(b, dtype=np.float64).ravel()
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """The session's artifact store (one per pytest-xdist worker: several tests assert what a store holds)."""
    return tmp_path_factory.mktemp("vlmrun-cache")


@pytest.fixture(scope="session")
def store(cache_dir):
    from vlmrun.store import ArtifactStore

    return ArtifactStore(cache_dir)


@pytest.fixture(scope="session")
def tiny_model(store):
    from vlmrun.model import default_model

    return default_model(store, IMAGE_SIZE)


@pytest.fixture(scope="session")
def ref_pipe(tiny_model, store):
    from vlmrun import Pipeline

    return Pipeline.build(tiny_model, "reference", store=store)


@pytest.fixture(scope="session")
def image_path(tmp_path_factory) -> Path:
    from vlmrun.demo_image import demo_image

    path = tmp_path_factory.mktemp("images") / "scene.jpg"
    demo_image().save(path, quality=95)
    return path


@pytest.fixture(scope="session")
def npu_pipe(tiny_model, store):
    """The all-npu layout on the HTP emulator (the parts decoder, vlmrun's host engine), built once per session."""
    from vlmrun import Pipeline

    return Pipeline.build(tiny_model, "all-npu", store=store)


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ray_cluster():
    """A real local Ray cluster listening on 127.0.0.1 only, in a process group of its own (``ray start --block``;
    stopped by that group, not by ``ray stop``, which would stop every Ray of this machine) and a temp dir of its
    own."""
    ray_cli = Path(sys.executable).with_name("ray")
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    port = free_port()
    from vlmrun.procs import kill_group

    temp = Path(tempfile.mkdtemp(prefix="vr-", dir="/tmp"))  # short: Ray's socket paths live under it
    log = open(temp / "start.log", "w")
    proc = subprocess.Popen([str(ray_cli), "start", "--head", "--block", "--num-cpus", "2",
                             "--node-ip-address=127.0.0.1", "--include-dashboard=false", "--disable-usage-stats",
                             "--port", str(port), "--temp-dir", str(temp)],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 180
        while "will now block" not in (temp / "start.log").read_text():
            assert proc.poll() is None and time.monotonic() < deadline, (temp / "start.log").read_text()
            time.sleep(0.5)
        yield f"127.0.0.1:{port}", env
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        kill_group(proc)  # whatever of this cluster is left (its group only)
        log.close()
        shutil.rmtree(temp, ignore_errors=True)


@pytest.fixture(scope="session")
def bundle_dir(tiny_model, store, tmp_path_factory) -> Path:
    """The all-npu bundle (``vlmrun bundle``), written once per session; tests that spoil it work on a copy."""
    from vlmrun import layouts
    from vlmrun.bundle import write

    out = tmp_path_factory.mktemp("bundles") / "fastvlm"
    manifest = write(layouts.resolve("all-npu"), out, model=tiny_model, store=store)
    assert manifest["backend"] == "qnn_htp" and (out / "vlmrun-bundle.json").is_file()
    return out


def pytest_configure(config):
    """Each pytest-xdist worker (and every process it starts) on a core of its own, when there are as many workers as
    cores: the HTP emulator runs eleven threads a process that spin on ``sched_yield`` between ops, which took the
    other worker's core as much as their own."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    cpus = sorted(os.sched_getaffinity(0))
    if worker.startswith("gw") and int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0")) == len(cpus) > 1:
        os.sched_setaffinity(0, {cpus[int(worker[2:])]})


#: The groups that take longest (measured on a 2-core machine, longest first): started first, so that under
#: pytest-xdist the two workers finish together instead of one running a long module alone at the end. A stale
#: list only costs balance; every other group keeps its collection order after these.
LONG_FIRST = ("bundle", "docs-tour", "locate", "test_phone_chat",
              "test_quantizer", "test_qnn_htp", "test_calibration_sequence", "test_examples_run[npu.md]",
              "test_eval", "test_bundle_ray", "test_npu_decoder", "test_examples_run[eval.md]")

#: Modules and docs pages that build the same binaries, as one scheduling group each: one worker builds them once,
#: in collection order (as two groups, both workers built both):
#:
#: * ``bundle``: the modules that use the session's all-npu bundle (`bundle_dir`: written and verified on 4 held-out
#:   items) and all-npu pipeline (`npu_pipe`), and bundles.md, which writes the same bundle after test_bundle and
#:   test_chat and finds its binaries in the worker's store;
#: * ``docs-tour``: the docs pages that run README's tour (the tuned build, the w4a16 eval, the bundle), README
#:   first, so that the later pages find its builds and tune in the worker's store (apart, tune.md took 174 s
#:   instead of 11 s, index.md 98 s instead of 44 s); then test_tune, whose tunes compile the same w4a16 base and
#:   candidates (decoder.layer0, decoder.lm_head) (alone, its first tune compiled them all: 434 s);
#: * ``locate``: diff.md and test_locate, which locate drift in the same int8 and w4a16 layouts (16 of test_locate's
#:   27 store artifacts are diff.md's too; diff.md after test_locate: 93 s instead of 112 s).
SHARED_BUILDS = {
    "bundle": ("test_bundle", "test_chat", "test_followup", "test_runtime_boundary", "test_serve", "bundles.md"),
    "docs-tour": ("README.md", "api.md", "getting-started.md", "index.md", "tune.md", "test_tune"),
    "locate": ("diff.md", "test_locate"),
}
GROUP_OF_NAME = {name: group for group, names in SHARED_BUILDS.items() for name in names}


DOCS_PAGE = "tests/test_docs.py::test_examples_run["


def group_of(nodeid: str) -> str:
    """The scheduling group of a test: its module (its tests run on one worker, in order: module fixtures such as a
    fake hub keep their state between them, and the session fixtures it needs are built once) or its docs page, or
    the `SHARED_BUILDS` group that module or page belongs to."""
    if nodeid.startswith(DOCS_PAGE):
        name = nodeid[len(DOCS_PAGE):].split("@")[0].rstrip("]")
        return GROUP_OF_NAME.get(name, f"test_examples_run[{name}]")
    name = Path(nodeid.split("::")[0]).stem
    return GROUP_OF_NAME.get(name, name)


def pytest_collection_modifyitems(config, items):
    """The longest groups go first (pytest-xdist hands out groups in collection order)."""
    rank = {name: i for i, name in enumerate(LONG_FIRST)}
    items.sort(key=lambda item: rank.get(group_of(item.nodeid), len(rank)))  # stable: the rest keep their order


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """``--dist loadgroup`` (pyproject's addopts, ``-n 2``; ``-n 0`` runs the suite in one process) by `group_of`.
    xdist's own loadgroup reads ``xdist_group`` marks into node ids (``item._nodeid``), which pytest 9 no longer
    reads (a node's id is ``_id`` there): every test was scheduled alone, each worker building the module and
    session fixtures of the tests it drew. This scheduler groups by node id instead."""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    # xdist orders scopes by their number of tests unless told not to (--no-loadscope-reorder): the one-test docs
    # pages, among the longest groups, then started last (diff.md at minute 43 of 58). Keep `LONG_FIRST`'s order.
    config.option.loadscopereorder = False

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return group_of(nodeid)

    return ByGroup(config, log)
