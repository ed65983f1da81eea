"""qaihub plugin against a local fake AI Hub (tests/fake_hub.py) driven by the real, unmodified qai_hub client.

The client is pointed at 127.0.0.1 through its own configuration (QAIHUB_CLIENT_INI); nothing reaches the
internet. Compile "on the hub" -> qnn_htp loads the downloaded context binary; hosted inference + profile;
faults: FAILED job, HTTP 500, dropped connection, a job that never finishes, a malicious download name.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path

import numpy as np
import pytest

from conftest import cosine

pytest.importorskip("onnxruntime_qnn")
pytest.importorskip("qai_hub")

from fake_hub import FakeHub  # noqa: E402
from vlmrun import Pipeline  # noqa: E402
from vlmrun.errors import BackendError  # noqa: E402
from vlmrun.layouts import Layout, StageAssignment  # noqa: E402
from vlmrun.stages import STAGES  # noqa: E402

TOKEN = "hubtok-" + secrets.token_hex(12)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    import qai_hub.client

    server = FakeHub(TOKEN).start()
    ini = tmp_path_factory.mktemp("qaihub") / "client.ini"
    ini.write_text(f"[api]\napi_token = {TOKEN}\napi_url = {server.url}\nweb_url = {server.url}/web/\nverbose = False\n")
    saved = {k: os.environ.get(k) for k in ("QAIHUB_CLIENT_INI", "NO_PROXY", "no_proxy", "VLMRUN_QAIHUB_TIMEOUT")}
    os.environ.update(QAIHUB_CLIENT_INI=str(ini), NO_PROXY="127.0.0.1", no_proxy="127.0.0.1")
    interval = qai_hub.client.Job._polling_interval
    qai_hub.client.Job._polling_interval = 0.05  # tests only: poll fast
    yield server
    qai_hub.client.Job._polling_interval = interval
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


@pytest.fixture(scope="module")
def registry():
    from vlmrun import plugins

    return plugins.load()


def layout(**stage_backends) -> Layout:
    """ort_reference everywhere except the given stages: {stage: (backend, options)}."""
    stages = {s: StageAssignment("ort_reference", {}) for s in STAGES}
    for s, (backend, opts) in stage_backends.items():
        stages[s] = StageAssignment(backend, opts)
    return Layout("test-qaihub", stages)


def build(model, store, registry, stage, backend, opts, **kw):
    return Pipeline.build(model, layout(**{stage: (backend, opts)}), store=store, registry=registry,
                          stages=(stage,), **kw)


def no_token(*texts):
    for t in texts:
        assert TOKEN not in str(t)


def store_has_no_token(store):
    for f in Path(store.root).rglob("*"):
        if f.is_file() and f.suffix in (".json", ".onnx", ".lock", ""):
            assert TOKEN.encode() not in f.read_bytes(), f


@pytest.fixture(scope="module")
def pixel_values(ref_pipe, image_path):
    return ref_pipe.prepare(image_path, "What is in the picture?").pixel_values


@pytest.fixture(scope="module")
def ref_features(ref_pipe, pixel_values):
    return ref_pipe.run_stage("vision", {"pixel_values": pixel_values})["image_features"]


def test_compile_on_hub_then_qnn_htp_runs_it(hub, tiny_model, store, registry, pixel_values, ref_features, capfd):
    jobs0 = hub.count("POST", "jobs")
    pipe = build(tiny_model, store, registry, "vision", "qnn_htp", {"compiler": "qaihub"})
    out = capfd.readouterr()
    assert hub.count("POST", "jobs") == jobs0 + 1
    assert "compile job" in out.err and "/web/jobs/" in out.err  # state + web link shown
    art = pipe.handles["vision"].artifact
    m = art.manifest
    assert m["compiler"] == "qaihub" and m["target"] == "qnn_htp"
    assert m["soc"] == "SM8750" and m["arch"] == "v79" and m["qnn_version"].startswith("2.")
    assert m["files"][0].endswith("_ctx.onnx") and m["files"][1].endswith("_ctx_qnn.bin")
    assert m["inputs"][0]["name"] == "pixel_values" and m["hub"]["device"] == "Snapdragon 8 Elite QRD"
    hub_feats = pipe.run_stage("vision", {"pixel_values": pixel_values})["image_features"]
    local = build(tiny_model, store, registry, "vision", "qnn_htp", {})
    local_feats = local.run_stage("vision", {"pixel_values": pixel_values})["image_features"]
    print(f"\n[qaihub] hub-compiled vs local qnn_htp cosine {cosine(hub_feats, local_feats):.6f},"
          f" vs reference {cosine(hub_feats, ref_features):.6f}")
    assert cosine(hub_feats, local_feats) > 0.99999
    assert cosine(hub_feats, ref_features) > 0.999
    # a second build reuses the stored artifact: no new upload or job
    again = build(tiny_model, store, registry, "vision", "qnn_htp", {"compiler": "qaihub"})
    assert again.handles["vision"].artifact.path == art.path
    assert hub.count("POST", "jobs") == jobs0 + 1
    no_token(out.out, out.err, json.dumps(m))
    assert TOKEN in hub.seen_tokens  # the client did authenticate with it


def test_timeout_then_rerun_reattaches(hub, tiny_model, store, registry, capfd, monkeypatch):
    monkeypatch.setenv("VLMRUN_QAIHUB_TIMEOUT", "0.5")
    hub.never_finish = True
    models0, jobs0 = hub.count("POST", "models"), hub.count("POST", "jobs")
    try:
        with pytest.raises(BackendError) as err:
            build(tiny_model, store, registry, "projector", "qnn_htp", {"compiler": "qaihub"})
    finally:
        hub.never_finish = False
    msg = str(err.value)
    assert "did not finish" in msg and "still running" in msg and "\n" not in msg
    ledger = json.loads((Path(store.root) / "qaihub-jobs.json").read_text())
    entry = next(e for e in ledger.values() if e.get("stage") == "projector")
    assert entry["state"] == "submitted" and entry["job_id"] in msg
    assert not list((Path(store.root) / "artifacts").glob(".tmp-*"))  # the store stays consistent
    monkeypatch.delenv("VLMRUN_QAIHUB_TIMEOUT")
    pipe = build(tiny_model, store, registry, "projector", "qnn_htp", {"compiler": "qaihub"})
    out = capfd.readouterr()
    assert "re-attaching" in out.err
    assert hub.count("POST", "jobs") == jobs0 + 1 and hub.count("POST", "models") == models0 + 1
    assert pipe.handles["projector"].artifact.manifest["hub"]["compile_job"] == entry["job_id"]
    no_token(out.out, out.err)


def test_failed_job_reports_reason(hub, tiny_model, store, registry, capfd):
    hub.fail_compile = "Op 'Erf' (node /blocks.0/Erf) is not supported on hexagon v79"
    jobs0 = hub.count("POST", "jobs")
    with pytest.raises(BackendError) as err:  # --rebuild: a new job even though the artifact exists
        build(tiny_model, store, registry, "projector", "qnn_htp", {"compiler": "qaihub"}, rebuild=True)
    msg = str(err.value)
    assert "failed" in msg and "is not supported on hexagon v79" in msg and "\n" not in msg
    assert hub.count("POST", "jobs") == jobs0 + 1
    no_token(msg, *capfd.readouterr())


def test_http_500_and_dropped_connection_are_retried(hub, tiny_model, store, registry, capfd):
    hub.errors = {"GET jobs/": 2}
    hub.drops = {"GET jobs/": 1, "GET models/": 1}
    pipe = build(tiny_model, store, registry, "projector", "qnn_htp", {"compiler": "qaihub"}, rebuild=True)
    assert hub.errors["GET jobs/"] == 0 and hub.drops["GET jobs/"] == 0
    feats = np.random.default_rng(0).standard_normal((1, tiny_model.image_tokens, tiny_model.feature_dim))
    out = pipe.run_stage("projector", {"image_features": feats.astype(np.float32)})
    assert np.isfinite(out["image_embeds"]).all()
    no_token(*capfd.readouterr())


def test_malicious_download_name_stays_inside(hub, tiny_model, store, registry, tmp_path, capfd):
    hub.download_name = "../../x"
    try:
        pipe = build(tiny_model, store, registry, "projector", "qnn_htp", {"compiler": "qaihub"}, rebuild=True)
    finally:
        hub.download_name = None
    art = pipe.handles["projector"].artifact
    assert sorted(p.name for p in art.path.iterdir()) == sorted([*art.manifest["files"], "manifest.json"])
    root = Path(store.root)
    assert not (root / "x").exists() and not (root / "artifacts" / "x").exists() and not (root.parent / "x").exists()
    assert not list(root.rglob("x"))


def test_download_guard_refuses_escape(tmp_path):
    from vlmrun_qaihub import hub as hubmod

    class Evil:
        model_id = "m-evil"

        def download(self, path):
            p = Path(path).parent.parent / "x"
            p.write_bytes(b"evil")
            return str(p)

    h = hubmod.Hub(retries=0)
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(BackendError, match="outside"):
        hubmod.download_model_into(h, Evil(), out, "a_ctx_qnn.bin")
    assert hubmod.safe_name("../../x") == "x" and hubmod.safe_name("..") == "download"


def test_hosted_inference_with_profile(hub, tiny_model, store, registry, pixel_values, ref_features, capfd):
    pipe = build(tiny_model, store, registry, "vision", "qaihub", {"device": "Snapdragon 8 Elite QRD"})
    feats = pipe.run_stage("vision", {"pixel_values": pixel_values})["image_features"]
    handle = pipe.handles["vision"]
    prof = handle.last_profile
    print(f"\n[qaihub] hosted vision: cosine vs reference {cosine(feats, ref_features):.6f},"
          f" device inference {prof['estimated_inference_time'] / 1000:.1f} ms (fake hub: HTP emulator)")
    assert cosine(feats, ref_features) > 0.999
    assert prof["estimated_inference_time"] > 0 and prof["job_id"].startswith("j")
    out = capfd.readouterr()
    assert "inference job" in out.err
    no_token(out.out, out.err, json.dumps(prof))


def test_unknown_device_is_one_line(hub, tiny_model, store, registry):
    with pytest.raises(BackendError) as err:
        build(tiny_model, store, registry, "projector", "qaihub", {"device": "Pixel 9"})
    assert "Pixel 9" in str(err.value) and "\n" not in str(err.value)


def test_profile_command(hub, store, tiny_model):
    from click.testing import CliRunner

    from vlmrun.cli_profile import profile_command

    res = CliRunner().invoke(profile_command, ["--backend", "qaihub", "--stage", "projector", "--device",
                                               "Snapdragon 8 Elite QRD", "--image-size", "256", "--cache-dir",
                                               str(store.root), "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output[res.output.index("{"):])
    assert rep["figures"]["estimated_inference_time"] > 0 and rep["outputs"]["image_embeds"][0] == 1
    no_token(res.output)


def test_vlmrun_compile_with_qaihub_compiler(hub, store, tiny_model, tmp_path):
    """`vlmrun compile --compiler qaihub --backend qnn_htp --stage vision --device ...` through the real CLI group."""
    from click.testing import CliRunner

    from vlmrun.cli import cli

    cache = tmp_path / "fresh-store"
    args = ["compile", "--compiler", "qaihub", "--backend", "qnn_htp", "--stage", "vision", "--device",
            "Snapdragon 8 Elite QRD", "--image-size", "256", "--cache-dir", str(cache), "--json"]
    jobs0 = hub.count("POST", "jobs")
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    art = json.loads(res.output[res.output.index("{"):])["artifacts"][0]
    assert art["built"] and art["soc"] == "SM8750" and hub.count("POST", "jobs") == jobs0 + 1
    manifest = json.loads((Path(art["path"]) / "manifest.json").read_text())
    assert manifest["key"]["compiler"] == "qaihub" and manifest["hub"]["compile_job"]
    again = CliRunner().invoke(cli, args)
    assert again.exit_code == 0 and hub.count("POST", "jobs") == jobs0 + 1  # reused, nothing resubmitted
    no_token(res.output, again.output)


def test_doctor_and_no_token_anywhere(hub, store, caplog):
    import vlmrun_qaihub

    checks = vlmrun_qaihub.doctor()
    text = " ".join(f"{c.name} {c.ok} {c.detail}" for c in checks)
    assert all(c.ok for c in checks), text
    no_token(text, caplog.text)
    store_has_no_token(store)


def test_ctrl_c_leaves_store_consistent_and_names_the_job(hub, tiny_model, store, registry, capfd, monkeypatch):
    from vlmrun_qaihub import hub as hubmod

    def interrupt(_s):
        raise KeyboardInterrupt

    hub.never_finish = True
    monkeypatch.setattr(hubmod.time, "sleep", interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            build(tiny_model, store, registry, "projector", "qnn_htp", {"compiler": "qaihub"}, rebuild=True)
    finally:
        hub.never_finish = False
        monkeypatch.undo()
    err = capfd.readouterr().err
    job_id = err.split("interrupted: AI Hub compile job ")[1].split()[0]
    assert "still running" in err and "re-attach" in err
    assert not list((Path(store.root) / "artifacts").glob(".tmp-*"))
    jobs0 = hub.count("POST", "jobs")
    pipe = build(tiny_model, store, registry, "projector", "qnn_htp", {"compiler": "qaihub"}, rebuild=True)
    assert hub.count("POST", "jobs") == jobs0  # re-attached, not resubmitted
    assert pipe.handles["projector"].artifact.manifest["hub"]["compile_job"] == job_id
