"""The artifact store's hygiene and the ``vlmrun store`` command: atomic directories, stale temporary directories
of killed builds (and never those of live ones), list / verify / prune."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import run_cli
from vlmrun import atomic
from vlmrun.errors import UsageError
from vlmrun.store import MANIFEST, ArtifactStore

DAY = 86400


def writer(files: dict, **extra):
    def build(d):
        for name, data in files.items():
            (d / name).write_bytes(data)
        return {"files": list(files), **extra}

    return build


def temps(root):
    return sorted(p.name for p in (root / "artifacts").glob(".tmp-*"))


def dir_bytes(path):
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


# -- atomic_directory ---------------------------------------------------------------------------------------------
def test_atomic_directory_renames_into_place_without_its_owner_file(tmp_path):
    dest = tmp_path / "out"
    with atomic.atomic_directory(dest) as tmp:
        assert tmp.parent.parent == tmp_path and tmp.parent.name.startswith(".tmp-out-")
        owner = json.loads((tmp.parent / atomic.OWNER_FILE).read_text())
        assert owner["pid"] == os.getpid() and owner["start_time"] == atomic.process_start_time(os.getpid())
        assert atomic.is_stale(tmp.parent) is False  # this process builds it
        (tmp / "a.txt").write_text("a")
    assert sorted(p.name for p in dest.iterdir()) == ["a.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_atomic_directory_removes_everything_on_keyboard_interrupt(tmp_path):
    dest = tmp_path / "out"
    with pytest.raises(KeyboardInterrupt):
        with atomic.atomic_directory(dest) as tmp:
            (tmp / "half").write_text("x")
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


def test_atomic_directory_replace(tmp_path):
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):  # a failed rebuild keeps the old directory
        with atomic.atomic_directory(dest, replace=True) as tmp:
            (tmp / "new.txt").write_text("new")
            raise RuntimeError("boom")
    assert sorted(p.name for p in dest.iterdir()) == ["old.txt"]
    with atomic.atomic_directory(dest, replace=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert sorted(p.name for p in dest.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    # without replace, a non-empty destination is an error and stays as it was
    with pytest.raises(Exception, match="already exists"):
        with atomic.atomic_directory(dest) as tmp:
            (tmp / "other.txt").write_text("x")
    assert sorted(p.name for p in dest.iterdir()) == ["new.txt"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


# -- stale temporary directories ----------------------------------------------------------------------------------
SLOW_BUILD = textwrap.dedent('''
    import sys, time
    from vlmrun.store import ArtifactStore
    store = ArtifactStore(sys.argv[1])
    def build(tmp):
        (tmp / "vision.onnx").write_bytes(b"half an onnx file")
        print("building", flush=True)
        time.sleep(120)
        return {"files": ["vision.onnx"]}
    store.get_or_build({"stage": "vision", "backend": "onnx", "kind": "slow"}, build)
''')


def test_killed_build_is_cleaned_and_live_build_is_not(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", SLOW_BUILD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "building"
        [name] = temps(tmp_path)
        tmp = tmp_path / "artifacts" / name
        assert (tmp / atomic.BUILD_DIR / "vision.onnx").read_bytes() == b"half an onnx file"
        assert atomic.read_owner(tmp)["pid"] == proc.pid
        # a live builder's directory survives, however old it looks
        two_days_ago = time.time() - 2 * DAY
        os.utime(tmp, (two_days_ago, two_days_ago))
        assert ArtifactStore(tmp_path).clean_stale(older_than_s=0) == []
        assert temps(tmp_path) == [name]
        res = run_cli(["store", "prune", "--all", "--json"], tmp_path)
        assert res.returncode == 0, res.stderr
        assert json.loads(res.stdout)["temp_dirs"] == []
        assert temps(tmp_path) == [name]

        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert temps(tmp_path) == [name]  # SIGKILL leaves it behind ...
    store = ArtifactStore(tmp_path)
    assert store.clean_stale() == [tmp]  # ... and the next open of the store removes it, young as it is
    assert temps(tmp_path) == [] and list((tmp_path / "artifacts").iterdir()) == []
    assert store.lookup({"stage": "vision", "backend": "onnx", "kind": "slow"}) is None


def _fake_temp(root, name, owner=None, age_s=0.0):
    d = root / "artifacts" / name
    (d / atomic.BUILD_DIR).mkdir(parents=True)
    (d / atomic.BUILD_DIR / "part").write_bytes(b"12345")
    if owner is not None:
        (d / atomic.OWNER_FILE).write_text(json.dumps(owner))
    t = time.time() - age_s
    os.utime(d, (t, t))
    return d


def test_stale_rules(tmp_path):
    me = atomic.owner_record()
    live = _fake_temp(tmp_path, ".tmp-live-1", me, age_s=30 * DAY)
    reused = _fake_temp(tmp_path, ".tmp-reused-1", {**me, "start_time": me["start_time"] + 1})  # pid reuse
    gone = _fake_temp(tmp_path, ".tmp-gone-1", {**me, "pid": 2**22 + 12345})  # above any pid_max
    young = _fake_temp(tmp_path, ".tmp-young-1", age_s=600)  # an older vlmrun's, no owner file
    old = _fake_temp(tmp_path, ".tmp-old-1", age_s=2 * 3600)
    legacy = _fake_temp(tmp_path, ".model.building-abc", age_s=2 * 3600)  # older make_tiny's name
    foreign = _fake_temp(tmp_path, ".tmp-foreign-1", {**me, "host": "elsewhere", "pid": 1}, age_s=3600)
    store = ArtifactStore(tmp_path)
    assert sorted(store.temp_dirs()) == sorted([live, reused, gone, young, old, legacy, foreign])
    assert sorted(store.clean_stale()) == sorted([reused, gone, old, legacy])
    assert sorted(store.temp_dirs()) == sorted([live, young, foreign])


def test_exception_in_build_leaves_no_temp_dir(tmp_path):
    store = ArtifactStore(tmp_path)

    def fail(d):
        (d / "partial.onnx").write_bytes(b"x")
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        store.get_or_build({"stage": "decoder", "kind": "x"}, fail)
    assert list((tmp_path / "artifacts").iterdir()) == []


# -- entries / verify / prune (API) -------------------------------------------------------------------------------
def _fill(root):
    store = ArtifactStore(root)
    exp = store.get_or_build({"stage": "vision", "backend": "onnx", "kind": "vision", "weights": "w1"},
                             writer({"vision.onnx": b"v" * 1000}, form="vision"))
    comp = store.get_or_build(
        {"stage": "vision", "backend": "qnn_htp", "compiler": "qnn_htp", "kind": "vision-int8-sm8650",
         "source": exp.path.name, "options": {"precision": "int8", "soc": "sm8650"}},
        writer({"vision.bin": b"b" * 300}, precision="int8"))
    dec = store.get_or_build({"stage": "decoder", "backend": "onnx", "kind": "decoder", "weights": "w2"},
                             writer({"decoder.onnx": b"d" * 2000, "decoder.onnx.data": b"x" * 50}))
    tiny = store.get_or_build({"stage": "model", "kind": "tiny-v1", "image_size": 256},
                              writer({"config.json": b"{}"}))
    return store, {"exp": exp, "comp": comp, "dec": dec, "tiny": tiny}


def _age(art, created_days=None, used_days=None):
    """Pretend ``art`` was created / last used that many days ago."""
    m = json.loads((art.path / MANIFEST).read_text())
    if created_days is not None:
        m["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - created_days * DAY))
        (art.path / MANIFEST).write_text(json.dumps(m))
    if used_days is not None:
        t = time.time() - used_days * DAY
        os.utime(art.path / MANIFEST, (t, t))


def test_entries(tmp_path):
    store, arts = _fill(tmp_path)
    by = {e.name: e for e in store.entries()}
    assert sorted(by) == sorted(a.path.name for a in arts.values())
    exp, comp = by[arts["exp"].path.name], by[arts["comp"].path.name]
    assert (exp.model, exp.stage, exp.backend, exp.kind, exp.form, exp.precision) == \
        ("w1", "vision", "onnx", "vision", "vision", None)
    assert exp.size == dir_bytes(arts["exp"].path) and exp.size > 1000
    # the compiled artifact names its source export; its model is the export's
    assert (comp.model, comp.backend, comp.compiler, comp.precision) == ("w1", "qnn_htp", "qnn_htp", "int8")
    tiny = by[arts["tiny"].path.name]
    assert (tiny.model, tiny.model_name, tiny.stage) == (None, "tiny-v1 256px", "model")
    assert abs(exp.created - time.time()) < 120


def test_lookup_records_last_use_without_breaking_verification(tmp_path):
    store, arts = _fill(tmp_path)
    key = arts["dec"].manifest["key"]
    _age(arts["dec"], used_days=40)
    before = {e.name: e.last_used for e in store.entries()}[arts["dec"].path.name]
    assert time.time() - before > 39 * DAY
    assert ArtifactStore(tmp_path).lookup(key) is not None  # a fresh instance: re-verified, then touched
    after = {e.name: e.last_used for e in store.entries()}[arts["dec"].path.name]
    assert time.time() - after < 120
    assert ArtifactStore(tmp_path).lookup(key) is not None
    assert all(v.ok for v in store.verify())


def test_verify_finds_corrupt_and_missing_files(tmp_path):
    store, arts = _fill(tmp_path)
    (arts["exp"].path / "vision.onnx").write_bytes(b"V" * 1000)  # same size, other bytes
    (arts["dec"].path / "decoder.onnx.data").unlink()
    verdicts = {v.entry.name: v for v in store.verify()}
    assert verdicts[arts["exp"].path.name].problems == ("vision.onnx: sha256 differs from the manifest",)
    assert verdicts[arts["dec"].path.name].problems == ("decoder.onnx.data: missing",)
    assert verdicts[arts["comp"].path.name].ok and verdicts[arts["tiny"].path.name].ok


def test_prune_api(tmp_path):
    store, arts = _fill(tmp_path)
    with pytest.raises(UsageError):
        store.prune()
    _age(arts["dec"], created_days=10, used_days=10)
    res = store.prune(older_than_s=7 * DAY, dry_run=True)
    assert [e.name for e in res.removed] == [arts["dec"].path.name] and arts["dec"].path.exists()
    res = store.prune(backends=["onnx"], unused_for_s=7 * DAY)
    assert [e.name for e in res.removed] == [arts["dec"].path.name]
    assert not arts["dec"].path.exists() and arts["exp"].path.exists()
    assert temps(tmp_path) == []


# -- the command --------------------------------------------------------------------------------------------------
def test_cli_list_json(tmp_path):
    store, arts = _fill(tmp_path)
    res = run_cli(["store", "list", "--json"], tmp_path)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["store"] == str(tmp_path) and out["temp_dirs"] == []
    by = {a["name"]: a for a in out["artifacts"]}
    assert len(by) == 4
    comp = by[arts["comp"].path.name]
    assert {k: comp[k] for k in ("model", "stage", "backend", "kind", "precision", "complete")} == {
        "model": "w1", "stage": "vision", "backend": "qnn_htp", "kind": "vision-int8-sm8650", "precision": "int8",
        "complete": True}
    assert comp["size"] == dir_bytes(arts["comp"].path)
    dec = by[arts["dec"].path.name]
    assert dec["model"] == "w2" and dec["size"] == dir_bytes(arts["dec"].path) and dec["size"] > 2050
    assert dec["created"].endswith("Z") and dec["last_used"].endswith("Z")
    text = run_cli(["store", "list"], tmp_path)
    assert text.returncode == 0 and arts["comp"].path.name in text.stdout and "int8" in text.stdout
    assert "4 artifacts" in text.stdout


def test_cli_list_respects_cache_dir_option(tmp_path):
    _fill(tmp_path / "a")
    res = run_cli(["store", "list", "--json", "--cache-dir", str(tmp_path / "a")], tmp_path / "b")
    assert res.returncode == 0 and len(json.loads(res.stdout)["artifacts"]) == 4
    res = run_cli(["store", "list", "--json"], tmp_path / "b")
    assert res.returncode == 0 and json.loads(res.stdout)["artifacts"] == []


def test_cli_verify(tmp_path):
    store, arts = _fill(tmp_path)
    res = run_cli(["store", "verify"], tmp_path)
    assert res.returncode == 0 and "4 ok, 0 corrupt" in res.stdout
    data = arts["comp"].path / "vision.bin"
    data.write_bytes(b"c" * 300)
    res = run_cli(["store", "verify"], tmp_path)
    assert res.returncode == 1
    assert f"CORRUPT  {arts['comp'].path.name}: vision.bin: sha256 differs from the manifest" in res.stdout
    assert "3 ok, 1 corrupt" in res.stdout
    res = run_cli(["store", "verify", "--json"], tmp_path)
    assert res.returncode == 1
    status = {a["name"]: (a["status"], a["problems"]) for a in json.loads(res.stdout)["artifacts"]}
    assert status[arts["comp"].path.name] == ("corrupt", ["vision.bin: sha256 differs from the manifest"])
    assert status[arts["exp"].path.name] == ("ok", [])


def test_cli_prune(tmp_path):
    store, arts = _fill(tmp_path)
    sizes = {k: dir_bytes(a.path) for k, a in arts.items()}
    stale = _fake_temp(tmp_path, ".tmp-killed-1", {**atomic.owner_record(), "pid": 2**22 + 12345})
    stale_size = dir_bytes(stale)  # its part file and owner file
    assert stale_size > 5

    res = run_cli(["store", "prune"], tmp_path)  # no filter: refused
    assert res.returncode == 2 and res.stderr.startswith("vlmrun: error: prune needs a filter")
    res = run_cli(["store", "prune", "--unused-for", "soon"], tmp_path)
    assert res.returncode == 2 and "--unused-for 'soon' is not a duration" in res.stderr

    res = run_cli(["store", "prune", "--stage", "vision", "--dry-run", "--json"], tmp_path)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["dry_run"] is True
    assert sorted(e["name"] for e in out["removed"]) == sorted([arts["exp"].path.name, arts["comp"].path.name])
    assert out["temp_dirs"] == [{"path": str(stale), "size": stale_size}]
    assert out["freed"] == sizes["exp"] + sizes["comp"] + stale_size
    assert all(a.path.exists() for a in arts.values()) and stale.exists()

    res = run_cli(["store", "prune", "--stage", "vision", "--backend", "qnn_htp"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert f"removed {arts['comp'].path.name}" in res.stdout
    freed = sizes["comp"] + stale_size
    assert f"freed {freed} B ({freed} bytes): 1 artifact, 1 temporary directory" in res.stdout
    assert not arts["comp"].path.exists() and not stale.exists() and arts["exp"].path.exists()

    _age(arts["dec"], created_days=8)
    sizes["dec"] = dir_bytes(arts["dec"].path)  # the rewritten manifest
    res = run_cli(["store", "prune", "--older-than", "7d", "--json"], tmp_path)
    out = json.loads(res.stdout)
    assert [e["name"] for e in out["removed"]] == [arts["dec"].path.name] and out["freed"] == sizes["dec"]

    _age(arts["tiny"], used_days=31)
    res = run_cli(["store", "prune", "--unused-for", "30d", "--json"], tmp_path)
    assert [e["name"] for e in json.loads(res.stdout)["removed"]] == [arts["tiny"].path.name]

    res = run_cli(["store", "prune", "--all", "--json"], tmp_path)
    out = json.loads(res.stdout)
    assert [e["name"] for e in out["removed"]] == [arts["exp"].path.name] and out["freed"] == sizes["exp"]
    assert list((tmp_path / "artifacts").iterdir()) == []


def test_a_rebuild_clears_what_a_killed_build_of_the_same_folder_left(tmp_path):
    """make-tiny / bundle killed mid-build leave .tmp-<name>-* beside the folder; the next build of it removes it
    (its builder is gone), and never one whose builder still runs."""
    dead = tmp_path / ".tmp-model-abc"
    (dead / atomic.BUILD_DIR).mkdir(parents=True)
    (dead / atomic.OWNER_FILE).write_text(json.dumps({**atomic.owner_record(), "pid": 2**22 + 12345}))
    live = tmp_path / ".tmp-model-def"
    (live / atomic.BUILD_DIR).mkdir(parents=True)
    (live / atomic.OWNER_FILE).write_text(json.dumps(atomic.owner_record()))  # this very process
    with atomic.atomic_directory(tmp_path / "model") as out:
        (out / "config.json").write_text("{}")
    assert (tmp_path / "model" / "config.json").is_file()
    assert not dead.exists() and live.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [".tmp-model-def", "model"]


def test_two_processes_that_need_one_artifact_build_it_once(tmp_path):
    """A second process that needs a key another is building waits for it (and says so) and reuses it."""
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import pathlib, time
        from vlmrun.store import ArtifactStore
        def build(d):
            pathlib.Path({str(tmp_path / "started")!r}).touch()
            time.sleep(3)
            (d / "a.bin").write_bytes(b"child")
            return {{"files": ["a.bin"]}}
        ArtifactStore({str(tmp_path / "cache")!r}).get_or_build({{"stage": "vision", "kind": "x"}}, build)
        """)])
    try:
        for _ in range(300):
            if (tmp_path / "started").exists():
                break
            time.sleep(0.05)
        store = ArtifactStore(tmp_path / "cache")
        calls = []
        art = store.get_or_build({"stage": "vision", "kind": "x"}, lambda d: calls.append(1) or writer({"a.bin": b"me"})(d))
        assert child.wait(60) == 0
    finally:
        child.kill()
    assert calls == [] and store.builds == [] and art.file().read_bytes() == b"child"


def test_plugins_find_open_and_keep_state_through_the_store_api(tmp_path):
    """What a plugin asks of the store (`ArtifactStore.artifact`, `find`, `state_dir`) instead of building its
    paths: an artifact by the name a key's source or a bundle records, verified; artifacts whose key matches; a
    state directory that survives a rebuild."""
    store = ArtifactStore(tmp_path)
    a = store.get_or_build({"stage": "vision", "backend": "acme", "kind": "k1", "options": {"precision": "q8"}},
                           writer({"a.bin": b"one"}))
    b = store.get_or_build({"stage": "decoder", "backend": "acme", "kind": "k2", "options": {"precision": "q4"}},
                           writer({"b.bin": b"two"}))
    got = store.artifact(a.path.name)
    assert got.path == a.path and got.manifest["key"]["kind"] == "k1" and got.file().read_bytes() == b"one"
    for bad in ("", "..", "../artifacts", "nope", f"{a.path.name}/x"):
        assert store.artifact(bad) is None, bad
    assert [x.path.name for x in store.find(lambda k: k["options"]["precision"] == "q4")] == [b.path.name]
    assert [x.path.name for x in store.find()] == sorted([a.path.name, b.path.name])
    (b.path / "b.bin").write_bytes(b"TWO")  # a changed file: not handed out
    assert store.find(lambda k: k["stage"] == "decoder") and ArtifactStore(tmp_path).artifact(b.path.name) is None
    state = store.state_dir(a.path.name)
    (state / "ledger.json").write_text("{}")
    store.get_or_build(a.manifest["key"], writer({"a.bin": b"again"}), rebuild=True)
    assert store.state_dir(a.path.name) == state == tmp_path / "state" / a.path.name
    assert (state / "ledger.json").read_text() == "{}"


def test_what_a_stopped_build_kept_is_listed_and_only_prune_all_removes_it(tmp_path):
    """A state folder holding a stopped build's parts, for an artifact the store does not have: `vlmrun store list`
    names it with its size, filtered prunes keep it, `prune --all` removes it; an artifact's own state, an empty
    state folder and the state of a build that holds its lock are left alone."""
    from filelock import FileLock

    store, arts = _fill(tmp_path)
    stopped = store.state_dir("decoder-stopped-0123")
    (stopped / "made-parts" / "part1").mkdir(parents=True)
    (stopped / "made-parts" / "part1" / "part1_of_2.bin").write_bytes(b"x" * 1000)
    own = store.state_dir(arts["dec"].path.name)  # the state of an artifact in the store (a ledger)
    (own / "ledger.json").write_text("{}")
    store.state_dir("decoder-empty")
    running = store.state_dir("decoder-running")
    (running / "feeds.partial").mkdir()
    (running / "feeds.partial" / "f.npz").write_bytes(b"y" * 10)
    (tmp_path / "locks").mkdir(exist_ok=True)
    with FileLock(str(tmp_path / "locks" / "decoder-running.lock")):
        assert store.unfinished_states() == [stopped]
    assert store.unfinished_states() == [running, stopped] or store.unfinished_states() == [stopped, running]

    res = run_cli(["store", "list"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert "2 stopped builds kept 1010 B to resume from" in res.stdout and "decoder-stopped-0123" in res.stdout
    res = run_cli(["store", "prune", "--stage", "vision", "--json"], tmp_path)
    assert json.loads(res.stdout)["unfinished"] == [] and stopped.exists()
    res = run_cli(["store", "prune", "--all", "--dry-run", "--json"], tmp_path)
    assert {(u["path"], u["size"]) for u in json.loads(res.stdout)["unfinished"]} == {
        (str(stopped), 1000), (str(running), 10)} and stopped.exists()
    res = run_cli(["store", "prune", "--all"], tmp_path)
    assert res.returncode == 0, res.stderr
    assert "removed state/decoder-stopped-0123 (1000 B, kept by a stopped build to resume from)" in res.stdout
    assert not stopped.exists() and not running.exists()
    assert (tmp_path / "state" / "decoder-empty").is_dir()  # nothing in it: not listed, not removed
