"""qaihub plugin against a local fake AI Hub (tests/fake_hub.py) driven by the real, unmodified qai_hub client.

The client is pointed at 127.0.0.1 through its own configuration (QAIHUB_CLIENT_INI); nothing reaches the
internet. Compile "on the hub" -> qnn_htp loads the downloaded context binary; hosted inference + profile;
faults: FAILED job, HTTP 500, dropped connection, a job that never finishes, a malicious download name, a
closed port, an unresolvable host, slow answers, a hub killed mid-wait, a hub that forgot its jobs, a wrong
token, a broken configuration, unknown and mismatched devices.
"""

from __future__ import annotations

import io
import json
import re
import secrets
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from conftest import cosine

pytest.importorskip("onnxruntime_qnn")
pytest.importorskip("qai_hub")

from fake_hub import FakeHub, serving, closed_port_url, write_client_ini  # noqa: E402
from vlmrun import Pipeline  # noqa: E402
from vlmrun.errors import BackendError, UsageError, VlmrunError  # noqa: E402
from vlmrun.layouts import Layout, StageAssignment  # noqa: E402
from vlmrun.stages import STAGES  # noqa: E402

TOKEN = "hubtok-" + secrets.token_hex(12)
ELITE, GEN3, S25 = "Snapdragon 8 Elite QRD", "Snapdragon 8 Gen 3 QRD", "Samsung Galaxy S25 (Family)"


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with serving(TOKEN, tmp_path_factory.mktemp("qaihub")) as server:
        yield server


@pytest.fixture
def use_ini(hub, monkeypatch, tmp_path):
    """Point the client at another configuration for one test: use_ini(url, token) or use_ini(text=...)."""

    def use(url=None, token=TOKEN, text=None):
        ini = tmp_path / f"client-{secrets.token_hex(3)}.ini"
        if text is not None:
            ini.write_text(text)
        else:
            write_client_ini(ini, token, url)
        monkeypatch.setenv("QAIHUB_CLIENT_INI", str(ini))
        return ini

    return use


@pytest.fixture
def fresh_hub(use_ini):
    """A second fake hub of this test's own (it may be killed or restarted)."""
    server = FakeHub(TOKEN).start()
    use_ini(server.url)
    yield server
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


def on_hub(tag: str, **opts) -> dict:
    """qnn_htp options compiling on the hub, with a compile key of this test's own (hub_options keys it)."""
    return {"compiler": "qaihub", "hub_options": f"--vlmrun_test_tag {tag}", **opts}


def no_token(*texts):
    for t in texts:
        assert TOKEN not in str(t)


def store_has_no_token(store):
    for f in Path(store.root).rglob("*"):
        if f.is_file() and f.suffix in (".json", ".onnx", ".lock", ""):
            assert TOKEN.encode() not in f.read_bytes(), f


class Entries(list):
    def values(self):
        return self


def ledger(store) -> Entries:
    """Every job ledger entry in the store (the ledgers live in the artifacts' state directories)."""
    out = Entries()
    for f in Path(store.root, "state").glob("*/qaihub-jobs.json"):
        out.extend(json.loads(f.read_text()).values())
    return out


def projector_input(model):
    feats = np.random.default_rng(0).standard_normal((1, model.image_tokens, model.feature_dim))
    return {"image_features": feats.astype(np.float32)}


@pytest.fixture(scope="module")
def pixel_values(ref_pipe, image_path):
    return ref_pipe.prepare(image_path, "What is in the picture?").pixel_values


@pytest.fixture(scope="module")
def ref_features(ref_pipe, pixel_values):
    return ref_pipe.run_stage("vision", {"pixel_values": pixel_values})["image_features"]


# -- the happy path ----------------------------------------------------------------------------------------------
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
    assert m["inputs"][0]["name"] == "pixel_values"
    # where it came from (#16.7): scalar fields, which `vlmrun compile` reports
    assert m["hub_device"] == ELITE and m["hub_compile_job"] in m["hub_url"] and "/web/jobs/" in m["hub_url"]
    assert m["hub_target_model"] in hub.models
    hub_feats = pipe.run_stage("vision", {"pixel_values": pixel_values})["image_features"]
    local = build(tiny_model, store, registry, "vision", "qnn_htp", {})
    hint = capfd.readouterr().err
    # #16.5: a local compile says which binary it runs and that the hub's is there for the asking
    assert "--compiler qaihub" in hint and art.path.name in hint and local.handles["vision"].artifact.path.name in hint
    local_feats = local.run_stage("vision", {"pixel_values": pixel_values})["image_features"]
    print(f"\n[qaihub] hub-compiled vs local qnn_htp cosine {cosine(hub_feats, local_feats):.6f},"
          f" vs reference {cosine(hub_feats, ref_features):.6f}")
    assert cosine(hub_feats, local_feats) > 0.99999
    assert cosine(hub_feats, ref_features) > 0.999
    # a second build reuses the stored artifact: no new upload or job; naming the device the SoC picks is the same
    # compile (issue 25: it was keyed twice)
    again = build(tiny_model, store, registry, "vision", "qnn_htp", {"compiler": "qaihub"})
    assert again.handles["vision"].artifact.path == art.path
    named = build(tiny_model, store, registry, "vision", "qnn_htp", {"compiler": "qaihub", "device": ELITE})
    assert named.handles["vision"].artifact.path == art.path
    assert hub.count("POST", "jobs") == jobs0 + 1
    no_token(out.out, out.err, json.dumps(m))
    assert TOKEN in hub.seen_tokens  # the client did authenticate with it


def test_vlmrun_compile_json_says_where_the_binary_came_from(hub, store, tiny_model, tmp_path):
    """`vlmrun compile --compiler qaihub --backend qnn_htp --stage vision --device ... --json` (#16.7)."""
    from click.testing import CliRunner

    from vlmrun.cli import cli

    cache = tmp_path / "fresh-store"
    args = ["compile", "--compiler", "qaihub", "--backend", "qnn_htp", "--stage", "vision", "--device",
            ELITE, "--image-size", "256", "--cache-dir", str(cache), "--json"]
    jobs0 = hub.count("POST", "jobs")
    res = CliRunner().invoke(cli, args)
    assert res.exit_code == 0, res.output
    art = json.loads(res.output[res.output.index("{"):])["artifacts"][0]
    assert art["built"] and art["soc"] == "SM8750" and hub.count("POST", "jobs") == jobs0 + 1
    assert art["hub_compile_job"].startswith("j") and art["hub_compile_job"] in art["hub_url"]
    assert art["hub_target_model"] and art["hub_device"] == ELITE
    manifest = json.loads((Path(art["path"]) / "manifest.json").read_text())
    assert manifest["key"]["compiler"] == "qaihub" and manifest["key"]["compiler_options"]["device"] == ELITE
    again = CliRunner().invoke(cli, args)
    assert again.exit_code == 0 and hub.count("POST", "jobs") == jobs0 + 1  # reused, nothing resubmitted
    no_token(res.output, again.output)


def test_hosted_inference_reports_device_figures_with_units(hub, tiny_model, store, registry, pixel_values,
                                                            ref_features, capfd):
    pipe = build(tiny_model, store, registry, "vision", "qaihub", {"device": ELITE})
    feats = pipe.run_stage("vision", {"pixel_values": pixel_values})["image_features"]
    prof = dict(pipe.handles["vision"].last_profile)
    with capfd.disabled():
        print(f"\n[qaihub] hosted vision: cosine vs reference {cosine(feats, ref_features):.6f}, device inference"
              f" {prof['inference_ms']:.1f} ms (fake hub: HTP emulator), job {prof['job_wall_ms']:.0f} ms")
    assert cosine(feats, ref_features) > 0.999
    assert prof["job_id"] in prof["url"] and prof["device"] == ELITE and prof["target_model"]
    assert prof["inference_ms"] > 0 and prof["inference_ms"] == prof["inference_each_ms"] * prof["inferences"]
    assert prof["inference_peak_memory_bytes"] > 0 and prof["load_cold_ms"] >= 0
    assert prof["inference_runs_ms"] and prof["job_wall_ms"] >= prof["inference_ms"]
    # every figure names its unit (#16.6): no unit-less microseconds next to milliseconds
    figures = {k: v for k, v in prof.items() if k not in ("job_id", "url", "device", "target_model", "inferences")}
    assert all(re.search(r"_(ms|bytes)$", k) for k in figures), figures
    err = capfd.readouterr().err
    assert "inference job" in err
    no_token(err, json.dumps(prof))


def test_run_json_carries_job_and_device_time(hub, store, tiny_model, image_path):
    """`vlmrun --vision qaihub ... --json`: the stage's job id, link and device time; its wall time apart (#16.7)."""
    from click.testing import CliRunner

    from vlmrun.cli import cli

    res = CliRunner().invoke(cli, ["--vision", "qaihub", "--device", ELITE, "--image", str(image_path), "--prompt",
                                   "Describe it.", "--max-new-tokens", "2", "--image-size", "256", "--cache-dir",
                                   str(store.root), "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output[res.output.index("{"):])
    vision = rep["profiles"]["vision"]
    assert vision["job_id"] in vision["url"] and vision["device"] == ELITE
    assert rep["timings"]["vision_ms"] == pytest.approx(vision["inference_ms"])
    assert rep["timings"]["vision_wall_ms"] > rep["timings"]["vision_ms"]
    no_token(res.output)


def test_profile_command(hub, store, tiny_model):
    from click.testing import CliRunner

    from vlmrun.cli_profile import profile_command

    res = CliRunner().invoke(profile_command, ["--backend", "qaihub", "--stage", "projector", "--device", ELITE,
                                               "--image-size", "256", "--cache-dir", str(store.root), "--json"])
    assert res.exit_code == 0, res.output
    rep = json.loads(res.output[res.output.index("{"):])
    assert rep["figures"]["inference_ms"] > 0 and rep["figures"]["inference_peak_memory_bytes"] > 0
    assert rep["figures"]["job_id"] and rep["outputs"]["image_embeds"][0] == 1
    no_token(res.output)


# -- #16.1: an unreachable hub fails within a minute ---------------------------------------------------------------
def test_closed_port_fails_within_a_minute(hub, tiny_model, store, registry, use_ini, capfd):
    """A closed port is retried with backoff until ``network_timeout`` has passed without an answer, then one line.
    Run with a 4 s budget (the default, 30 s, gives the same schedule longer: 1, 2, 4, 8, 8, 7 s)."""
    from vlmrun_qaihub import hub as hubmod

    assert hubmod.Hub().network_timeout == hubmod.DEFAULT_NETWORK_TIMEOUT_S == 30  # a user's closed port: 30 s < 60
    url = closed_port_url()
    use_ini(url)
    t0 = time.monotonic()
    with pytest.raises(BackendError) as err:
        build(tiny_model, store, registry, "projector", "qnn_htp", on_hub("closed-port", network_timeout=4))
    took = time.monotonic() - t0
    msg, err_text = str(err.value), capfd.readouterr().err
    with capfd.disabled():
        print(f"\n[qaihub] closed port: failed after {took:.1f} s: {msg}")
    assert took >= 4
    assert "did not answer" in msg and "connection refused" in msg and url.split("//")[1] in msg and "\n" not in msg
    assert "gave up after 4 s (network_timeout 4 s)" in msg
    # the retry messages give the real delays (1, 2, then what is left of the budget), adding up to the budget
    delays = [float(d) for d in re.findall(r"retry \d+ in ([\d.]+) s", err_text)]
    assert delays[:2] == [1.0, 2.0] and abs(sum(delays) - 4) < 0.5, err_text


def test_unresolvable_host_fails_fast(hub, tiny_model, store, registry, use_ini):
    use_ini("http://vlmrun-fake-hub.invalid:8080")
    t0 = time.monotonic()
    with pytest.raises(BackendError, match="cannot resolve host vlmrun-fake-hub.invalid"):
        build(tiny_model, store, registry, "projector", "qnn_htp", on_hub("dns", network_timeout=3))
    assert time.monotonic() - t0 < 15


def test_slow_hub_is_given_up_on(hub, tiny_model, store, registry, capfd):
    hub.slow = {"GET devices": 5.0}
    t0 = time.monotonic()
    try:
        with pytest.raises(BackendError, match="no answer from 127.0.0.1:[0-9]+ in time"):
            build(tiny_model, store, registry, "projector", "qnn_htp", on_hub("slow", network_timeout=2))
    finally:
        hub.slow = {}
    assert time.monotonic() - t0 < 10
    capfd.readouterr()


def test_hub_killed_mid_wait_names_the_job_and_rerun_reattaches(fresh_hub, tiny_model, store, registry, capfd):
    fresh_hub.never_finish = True

    def kill_when_submitted():
        while not fresh_hub.jobs:
            time.sleep(0.02)
        time.sleep(0.2)
        fresh_hub.stop_serving()

    killer = threading.Thread(target=kill_when_submitted, daemon=True)
    killer.start()
    t0 = time.monotonic()
    with pytest.raises(BackendError) as err:
        build(tiny_model, store, registry, "projector", "qnn_htp", on_hub("killed", network_timeout=2))
    took = time.monotonic() - t0
    killer.join(5)
    msg = str(err.value)
    job_id = next(iter(fresh_hub.jobs))
    assert took < 20
    assert "lost contact" in msg and job_id in msg and "may still be running" in msg and "re-attach" in msg
    assert any(e.get("job_id") == job_id and e["state"] == "submitted" for e in ledger(store).values())
    fresh_hub.never_finish = False
    fresh_hub.restart(forget=False)  # the hub comes back with its jobs
    jobs0 = fresh_hub.count("POST", "jobs")
    pipe = build(tiny_model, store, registry, "projector", "qnn_htp", on_hub("killed", network_timeout=2))
    assert "re-attaching" in capfd.readouterr().err
    assert fresh_hub.count("POST", "jobs") == jobs0
    assert pipe.handles["projector"].artifact.manifest["hub_compile_job"] == job_id


# -- #16.2: jobs the hub no longer knows, --rebuild ----------------------------------------------------------------
def test_timeout_then_rerun_reattaches(hub, tiny_model, store, registry, capfd):
    hub.never_finish = True
    models0, jobs0 = hub.count("POST", "models"), hub.count("POST", "jobs")
    try:
        with pytest.raises(BackendError) as err:
            build(tiny_model, store, registry, "projector", "qnn_htp", {"compiler": "qaihub", "job_timeout": 0.5})
    finally:
        hub.never_finish = False
    msg = str(err.value)
    assert "did not finish" in msg and "still running" in msg and "--job-timeout" in msg and "\n" not in msg
    entry = next(e for e in ledger(store).values() if e.get("stage") == "projector" and e["state"] == "submitted")
    assert entry["job_id"] in msg and entry["api_url"] == hub.url and entry["device"] == ELITE
    assert not list((Path(store.root) / "artifacts").glob(".tmp-*"))  # the store stays consistent
    pipe = build(tiny_model, store, registry, "projector", "qnn_htp", {"compiler": "qaihub"})
    out = capfd.readouterr()
    assert "re-attaching" in out.err
    assert hub.count("POST", "jobs") == jobs0 + 1 and hub.count("POST", "models") == models0 + 1
    assert pipe.handles["projector"].artifact.manifest["hub_compile_job"] == entry["job_id"]
    no_token(out.out, out.err)


def test_forgotten_job_is_resubmitted_once(fresh_hub, tiny_model, store, registry, capfd):
    fresh_hub.never_finish = True
    with pytest.raises(BackendError, match="did not finish"):
        build(tiny_model, store, registry, "projector", "qnn_htp", on_hub("forgotten", job_timeout=0.3))
    old = next(iter(fresh_hub.jobs))
    fresh_hub.never_finish = False
    fresh_hub.restart(forget=True)  # the hub forgets every job and model (as after deletion or expiry)
    jobs0, models0 = fresh_hub.count("POST", "jobs"), fresh_hub.count("POST", "models")
    pipe = build(tiny_model, store, registry, "projector", "qnn_htp", on_hub("forgotten"))
    err = capfd.readouterr().err
    assert f"no longer knows compile job {old}" in err and "submitting a new job" in err
    assert fresh_hub.count("POST", "jobs") == jobs0 + 1 and fresh_hub.count("POST", "models") == models0 + 1
    new = pipe.handles["projector"].artifact.manifest["hub_compile_job"]
    assert new != old and new in fresh_hub.jobs
    assert all(e.get("job_id") != old for e in ledger(store).values())


def test_rebuild_never_reattaches(hub, tiny_model, store, registry, capfd):
    hub.never_finish = True
    try:
        with pytest.raises(BackendError, match="did not finish"):
            build(tiny_model, store, registry, "projector", "qnn_htp", on_hub("rebuild", job_timeout=0.3))
    finally:
        hub.never_finish = False
    left = next(e for e in ledger(store).values() if "rebuild" in e.get("options", "") and e["state"] == "submitted")
    jobs0 = hub.count("POST", "jobs")
    pipe = build(tiny_model, store, registry, "projector", "qnn_htp", on_hub("rebuild"), rebuild=True)
    err = capfd.readouterr().err
    assert f"--rebuild: not re-attaching to compile job {left['job_id']}" in err and "AI Hub: re-attaching" not in err
    assert hub.count("POST", "jobs") == jobs0 + 1
    assert pipe.handles["projector"].artifact.manifest["hub_compile_job"] != left["job_id"]


def test_failed_job_reports_reason_and_is_not_reattached(hub, tiny_model, store, registry, capfd):
    hub.fail_compile = "Op 'Erf' (node /blocks.0/Erf) is not supported on hexagon v79"
    jobs0 = hub.count("POST", "jobs")
    with pytest.raises(BackendError) as err:
        build(tiny_model, store, registry, "projector", "qnn_htp", on_hub("failed"))
    msg = str(err.value)
    assert "failed" in msg and "is not supported on hexagon v79" in msg and "\n" not in msg
    assert hub.count("POST", "jobs") == jobs0 + 1
    assert not any("failed" in e.get("options", "") for e in ledger(store).values())
    build(tiny_model, store, registry, "projector", "qnn_htp", on_hub("failed"))  # the rerun submits anew
    assert hub.count("POST", "jobs") == jobs0 + 2
    no_token(msg, *capfd.readouterr())


def test_ctrl_c_names_the_job_and_rerun_reattaches(hub, tiny_model, store, registry, capfd, monkeypatch):
    from vlmrun_qaihub import hub as hubmod

    def interrupt(_s):
        raise KeyboardInterrupt

    hub.never_finish = True
    monkeypatch.setattr(hubmod.time, "sleep", interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            build(tiny_model, store, registry, "projector", "qnn_htp", on_hub("ctrl-c"))
    finally:
        hub.never_finish = False
        monkeypatch.undo()
    err = capfd.readouterr().err
    job_id = err.split("interrupted: AI Hub compile job ")[1].split()[0]
    assert "still running" in err and "rerun the same command to re-attach" in err
    assert not list((Path(store.root) / "artifacts").glob(".tmp-*"))
    jobs0 = hub.count("POST", "jobs")
    pipe = build(tiny_model, store, registry, "projector", "qnn_htp", on_hub("ctrl-c"))
    assert hub.count("POST", "jobs") == jobs0  # re-attached, not resubmitted
    assert pipe.handles["projector"].artifact.manifest["hub_compile_job"] == job_id


# -- #16.3: the device is resolved and checked before any upload, and keys the binary ------------------------------
def test_unknown_device_fails_before_any_upload(hub, tiny_model, store, registry):
    build(tiny_model, store, registry, "projector", "qnn_htp", {"compiler": "qaihub"})  # cached SM8750 binary
    models0 = hub.count("POST", "models")
    for backend, opts in (("qnn_htp", {"compiler": "qaihub", "device": "Pixel 9"}), ("qaihub", {"device": "Pixel 9"})):
        with pytest.raises(UsageError) as err:
            build(tiny_model, store, registry, "projector", backend, opts)
        assert "no device 'Pixel 9'" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(UsageError, match="did you mean 'Snapdragon 8 Elite QRD'"):
        build(tiny_model, store, registry, "projector", "qaihub", {"device": "Snapdragon 8 Elite"})
    assert hub.count("POST", "models") == models0


def test_device_change_rebuilds_and_soc_is_checked_first(hub, tiny_model, store, registry, capfd):
    base = build(tiny_model, store, registry, "projector", "qnn_htp", {"compiler": "qaihub"})
    models0, jobs0 = hub.count("POST", "models"), hub.count("POST", "jobs")
    # an SM8650 device for an SM8750 binary: refused before any upload, and not "reused"
    with pytest.raises(UsageError) as err:
        build(tiny_model, store, registry, "projector", "qnn_htp", {"compiler": "qaihub", "device": GEN3})
    assert "SM8650" in str(err.value) and "--soc SM8650" in str(err.value)
    assert hub.count("POST", "models") == models0
    # another SM8750 device: a binary of its own
    s25 = build(tiny_model, store, registry, "projector", "qnn_htp", {"compiler": "qaihub", "device": S25})
    assert hub.count("POST", "jobs") == jobs0 + 1
    m = s25.handles["projector"].artifact.manifest
    assert m["hub_device"] == S25 and s25.handles["projector"].artifact.path != base.handles["projector"].artifact.path
    # the SM8650 device with --soc SM8650: compiled for it
    gen3 = build(tiny_model, store, registry, "projector", "qnn_htp",
                 {"compiler": "qaihub", "device": GEN3, "soc": "SM8650"})
    m = gen3.handles["projector"].artifact.manifest
    assert m["soc"] == "SM8650" and m["arch"] == "v75" and m["hub_device"] == GEN3
    assert np.isfinite(gen3.run_stage("projector", projector_input(tiny_model))["image_embeds"]).all()
    capfd.readouterr()


# -- #16.4: an interrupted inference job is re-attached ------------------------------------------------------------
def test_interrupted_inference_job_is_reattached(hub, tiny_model, store, registry, capfd, monkeypatch):
    from vlmrun_qaihub import hub as hubmod

    pipe = build(tiny_model, store, registry, "projector", "qaihub", {"device": ELITE})
    inputs = projector_input(tiny_model)

    def interrupt(_s):
        raise KeyboardInterrupt

    hub.never_finish = True
    jobs0 = hub.count("POST", "jobs")
    monkeypatch.setattr(hubmod.time, "sleep", interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            pipe.run_stage("projector", inputs)
    finally:
        hub.never_finish = False
        monkeypatch.undo()
    err = capfd.readouterr().err
    job_id = err.split("interrupted: AI Hub inference job ")[1].split()[0]
    assert "rerun the same command to re-attach" in err and hub.count("POST", "jobs") == jobs0 + 1
    again = build(tiny_model, store, registry, "projector", "qaihub", {"device": ELITE})  # "the rerun"
    out = again.run_stage("projector", inputs)
    assert f"re-attaching to inference job {job_id}" in capfd.readouterr().err
    assert hub.count("POST", "jobs") == jobs0 + 1 and again.handles["projector"].last_profile["job_id"] == job_id
    assert np.isfinite(out["image_embeds"]).all()
    assert not any(e.get("job_id") == job_id for e in ledger(store).values())  # done: dropped from the ledger


# -- #16.6 --------------------------------------------------------------------------------------------------------
def test_wrong_token_is_named_not_hidden_behind_an_upload(hub, tiny_model, store, registry, use_ini):
    pipe = build(tiny_model, store, registry, "projector", "qaihub", {"device": ELITE})
    use_ini(hub.url, token="wrong-" + secrets.token_hex(8))
    pipe = build(tiny_model, store, registry, "projector", "qaihub", {"device": ELITE})  # cached: no request yet
    t0 = time.monotonic()
    with pytest.raises(BackendError) as err:
        pipe.run_stage("projector", projector_input(tiny_model))
    msg = str(err.value)
    assert "rejected the API token" in msg and "upload" not in msg and time.monotonic() - t0 < 5
    no_token(msg)


def test_broken_configuration_keeps_urls_whole(hub, tiny_model, store, registry, use_ini):
    use_ini(text=f"[api]\napi_url = {hub.url}\n")  # no api_token
    with pytest.raises(BackendError) as err:
        build(tiny_model, store, registry, "projector", "qnn_htp", on_hub("broken-config"))
    msg = str(err.value)
    assert "token is missing" in msg and "\n" not in msg
    urls = re.findall(r"https?://\S+", msg)
    assert urls and not re.search(r"https?:/ /|\.com /|\.ai hub", msg), msg


def test_one_line_joins_urls_the_client_wrapped():
    from qai_hub.client import _visible_textbox
    from vlmrun_qaihub.hub import one_line

    url = "https://workbench.aihub.qualcomm.com/docs/hub/getting_started.html"
    account = "https://workbench.aihub.qualcomm.com/account/"
    text = "Failed.\n" + _visible_textbox(f"See your token: {account}. Docs: {url}.")
    assert one_line(text) == f"Failed. See your token: {account}. Docs: {url}."


def test_status_updates_in_place_on_a_terminal(hub):
    from types import SimpleNamespace

    from vlmrun_qaihub import hub as hubmod

    class Tty(io.StringIO):
        def isatty(self):
            return True

    class Spinner(Tty):  # what a rich live display puts in sys.stderr
        rich_proxied_file = object()

    def job():
        states = iter(["QUEUED"] * 3 + ["RUNNING"] * 3 + ["DONE"])

        def status():
            code = next(states)
            return SimpleNamespace(code=code, finished=code == "DONE", success=True, message="")

        return SimpleNamespace(job_id="jtest0001", url=f"{hub.url}/web/jobs/jtest0001/" + "x" * 200,
                               get_status=status)

    tty = Tty()
    hubmod.Hub(poll=0.01, out=tty).wait(job(), "compile")
    text = tty.getvalue()
    assert text.count("\n") == 1 and text.endswith("\n") and text.count("\r") == 7 and "\x1b[K" in text
    import shutil

    width = shutil.get_terminal_size((100, 20)).columns
    assert all(len(seg.replace("\x1b[K", "").rstrip("\n")) < width for seg in text.split("\r"))
    spinner = Spinner()
    hubmod.Hub(poll=0.01, out=spinner).wait(job(), "compile")
    lines = spinner.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in spinner.getvalue()  # under a spinner: one line per state


def test_doctor_checks_the_hub_answers_and_accepts_the_token(hub, store, use_ini, caplog):
    import vlmrun_qaihub

    def run():
        checks = vlmrun_qaihub.doctor()
        text = " | ".join(f"{c.name} {c.ok} {c.detail}" for c in checks)
        no_token(text, caplog.text)
        return {c.name: c for c in checks}, text

    checks, text = run()
    assert all(c.ok for c in checks.values()) and "token accepted" in checks["AI Hub connection"].detail, text
    use_ini(hub.url, token="wrong-" + secrets.token_hex(8))
    checks, text = run()
    assert not checks["AI Hub token"].ok and "rejected" in checks["AI Hub token"].detail, text
    use_ini(closed_port_url())
    t0 = time.monotonic()
    checks, text = run()
    assert not checks["AI Hub connection"].ok and "connection refused" in checks["AI Hub connection"].detail, text
    assert time.monotonic() - t0 < 15
    store_has_no_token(store)


# -- the QAIRT version (#11) ---------------------------------------------------------------------------------------
def test_qairt_version_is_pinned_keyed_and_recorded(hub, tiny_model, store, registry, capfd):
    plain = build(tiny_model, store, registry, "projector", "qnn_htp", {"compiler": "qaihub"})
    jobs0 = hub.count("POST", "jobs")
    pinned = build(tiny_model, store, registry, "projector", "qnn_htp", {"compiler": "qaihub", "qairt_version": "2.45"})
    assert hub.count("POST", "jobs") == jobs0 + 1  # part of the compile key: a new job
    assert "--qairt_version 2.45" in hub.compile_options[-1]
    art = pinned.handles["projector"].artifact
    assert art.path != plain.handles["projector"].artifact.path
    assert art.manifest["qnn_version"] == "2.45.0" and art.manifest["hub"]["qairt_version"] == "2.45"
    assert art.manifest["key"]["compiler_options"]["qairt_version"] == "2.45"
    hosted = build(tiny_model, store, registry, "projector", "qaihub", {"device": ELITE, "qairt_version": "2.45"})
    hosted.run_stage("projector", projector_input(tiny_model))
    assert "--qairt_version 2.45" in hub.compile_options[-1] and "--qairt_version 2.45" in hub.inference_options[-1]
    with pytest.raises(UsageError, match="not a QAIRT version"):
        build(tiny_model, store, registry, "projector", "qaihub", {"device": ELITE, "qairt_version": "2.45; rm"})
    capfd.readouterr()


def test_options_and_flags_are_declared(registry):
    from click.testing import CliRunner

    from vlmrun.cli import cli

    declared = registry.options.by_backend["qaihub"]
    for name in ("job_timeout", "network_timeout", "qairt_version", "device"):
        assert name in declared and declared[name].help
    res = CliRunner().invoke(cli, ["compile", "--help"])
    for flag in ("--job-timeout", "--network-timeout", "--qairt-version"):
        assert flag in res.output


# -- downloads -----------------------------------------------------------------------------------------------------
def test_http_500_and_dropped_connection_are_retried(hub, tiny_model, store, registry, capfd):
    hub.errors = {"GET jobs/": 2}
    hub.drops = {"GET jobs/": 1, "GET models/": 1}
    pipe = build(tiny_model, store, registry, "projector", "qnn_htp", on_hub("flaky"))
    assert hub.errors["GET jobs/"] == 0 and hub.drops["GET jobs/"] == 0
    out = pipe.run_stage("projector", projector_input(tiny_model))
    assert np.isfinite(out["image_embeds"]).all()
    err = capfd.readouterr().err
    assert "HTTP 500" in err and "closed the connection" in err and "retry 1 in" in err
    no_token(err)


def test_unanswered_job_submission_is_not_sent_twice(hub, tiny_model, store, registry, capfd):
    hub.drops = {"POST jobs": 1}  # the connection closes after the submission was sent
    jobs0 = hub.count("POST", "jobs")
    try:
        with pytest.raises(BackendError, match="may have created the job") as err:
            build(tiny_model, store, registry, "projector", "qnn_htp", on_hub("unsure"))
    finally:
        hub.drops = {}
    assert hub.count("POST", "jobs") == jobs0 + 1 and f"{hub.url}/web/jobs/" in str(err.value)
    capfd.readouterr()


def test_malicious_download_name_stays_inside(hub, tiny_model, store, registry, tmp_path, capfd):
    hub.download_name = "../../x"
    try:
        pipe = build(tiny_model, store, registry, "projector", "qnn_htp", on_hub("evil-name"))
    finally:
        hub.download_name = None
    art = pipe.handles["projector"].artifact
    assert sorted(p.name for p in art.path.iterdir()) == sorted([*art.manifest["files"], "manifest.json"])
    root = Path(store.root)
    assert not (root / "x").exists() and not (root / "artifacts" / "x").exists() and not (root.parent / "x").exists()
    assert not list(root.rglob("x"))


def test_download_guard_refuses_escape(hub, tmp_path):
    from vlmrun_qaihub import hub as hubmod

    class Evil:
        model_id = "m-evil"

        def download(self, path):
            p = Path(path).parent.parent / "x"
            p.write_bytes(b"evil")
            return str(p)

    h = hubmod.Hub()
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(BackendError, match="outside"):
        hubmod.download_model_into(h, Evil(), out, "a_ctx_qnn.bin")
    assert hubmod.safe_name("../../x") == "x" and hubmod.safe_name("..") == "download"


def test_no_token_anywhere(hub, store, caplog):
    no_token(caplog.text)
    store_has_no_token(store)


def test_errors_are_vlmrun_errors():
    from vlmrun_qaihub import hub as hubmod

    for cls in (hubmod.HubUnreachable, hubmod.HubNotFound, hubmod.HubAuthError, hubmod.HubJobFailed,
                hubmod.HubJobTimeout):
        assert issubclass(cls, BackendError) and issubclass(cls, VlmrunError)
