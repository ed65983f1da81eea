"""``--compiler qaihub`` for the decoder parts form (qnn_htp ``decoder_form = "parts"``), against the local fake AI
Hub (tests/fake_hub.py) driven by the real, unmodified qai_hub client: one compile job per graph (QNN DLC), one
link job per part giving ONE weight-shared context binary holding the part's prompt and token graphs.

The x86_64 HTP emulator cannot load weight-shared binaries, so the shared artifacts are checked by what can be
checked here (the jobs the hub saw, the manifest, the graph names inside each binary, the emulator's clear
refusal); ``weight_sharing = "off"`` (one binary per graph, compile jobs only) runs on the emulator.
Tiny model, 2 parts, AR-16, context 128 (as tests/test_npu_decoder.py).
"""

from __future__ import annotations

import json
import re
import secrets
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import cosine

pytest.importorskip("onnxruntime_qnn")
pytest.importorskip("qai_hub")

from fake_hub import serving  # noqa: E402
from qai_hub.public_api_pb2 import JOB_STATE_DONE as DONE  # noqa: E402
from vlmrun import Pipeline  # noqa: E402
from vlmrun.errors import BackendError, UsageError  # noqa: E402
from vlmrun.layouts import Layout, StageAssignment  # noqa: E402
from vlmrun.stages import STAGES  # noqa: E402

TOKEN = "hubtok-" + secrets.token_hex(12)
ELITE = "Snapdragon 8 Elite QRD"
AR, CTX, P = 16, 128, 2
PROMPT = "Hi?"



@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    with serving(TOKEN, tmp_path_factory.mktemp("qaihub-parts")) as server:
        yield server


@pytest.fixture(scope="module")
def registry():
    from vlmrun import plugins

    return plugins.load()


def opts(tag: str, **over) -> dict:
    """qnn_htp parts options compiled on the hub; ``tag`` (hub_options) gives each test an artifact of its own."""
    return {"decoder_form": "parts", "context_length": CTX, "prefill_ar": AR, "parts": P, "compiler": "qaihub",
            "hub_options": f"--vlmrun_test_tag {tag}", **over}


def build(tiny_model, store, registry, o: dict, **kw) -> Pipeline:
    stages = {s: StageAssignment("ort_reference", {}) for s in STAGES}
    stages["decoder"] = StageAssignment("qnn_htp", o)
    t0 = time.perf_counter()
    pipe = Pipeline.build(tiny_model, Layout("test-qaihub-parts", stages), store=store, registry=registry,
                          stages=("decoder",), **kw)
    print(f"\n[qaihub parts] {o.get('hub_options')} build {time.perf_counter() - t0:.1f} s")
    return pipe


def new_jobs(hub, before: set) -> list[dict]:
    return [j for jid, j in hub.jobs.items() if jid not in before]


def ledger(store) -> list[dict]:
    out = []
    for f in Path(store.root, "state").glob("*/qaihub-jobs.json"):
        out.extend(json.loads(f.read_text()).values())
    return out


def no_artifact_for(store, tag: str) -> None:
    root = Path(store.root) / "artifacts"
    assert not list(root.glob(".tmp-*"))
    for mf in root.glob("*/manifest.json"):
        assert tag not in mf.read_text(), mf


def part_export(tiny_model, store, registry):
    from vlmrun.pipeline import export_artifact
    from vlmrun.stages import ExportForm

    L = tiny_model.num_layers
    from vlmrun_qualcomm.parts import plan

    p = plan(tiny_model, {"precision": "fp16", "parts": P, "part_limit_mb": 1000, "prefill_ar": AR,
                          "context_length": CTX})
    assert sum(p["layers"]) == L
    return export_artifact(registry, store, tiny_model, ExportForm.of(
        "decoder", "decoder/parts", ar=p["ar"], ctx=p["ctx"], layers=",".join(map(str, p["layers"])), rmsnorm="safe"))


# -- the weight-shared form: compile jobs, link jobs, the manifest -----------------------------------------------------
@pytest.fixture(scope="module")
def linked(hub, tiny_model, store, registry):
    before = set(hub.jobs)
    models0 = hub.count("POST", "models")
    pipe = build(tiny_model, store, registry, opts("linked", engine="genie"))
    return SimpleNamespace(pipe=pipe, jobs=new_jobs(hub, before), uploads=hub.count("POST", "models") - models0)


def test_compile_jobs_then_one_link_job_per_part(linked, hub, tiny_model, store, registry):
    jobs = linked.jobs
    compiles = [j for j in jobs if j["kind"] == "compile"]
    links = [j for j in jobs if j["kind"] == "link"]
    assert len(compiles) == 2 * P and len(links) == P and len(jobs) == 3 * P and linked.uploads == 2 * P
    names = {}
    for j in compiles:
        assert "--target_runtime qnn_dlc" in j["options"] and "--vlmrun_test_tag linked" in j["options"]
        assert j["device"] == ELITE and j["result_state"] == DONE
        names[j["target"]] = re.search(r"--qnn_graph_name (\S+)", j["options"]).group(1)
    for k, j in enumerate(links, start=1):
        # the part's two compiled models, prompt then token, each a QNN DLC from a compile job
        want = [f"prompt_ar{AR}_cl{CTX}_{k}_of_{P}", f"token_ar1_cl{CTX}_{k}_of_{P}"]
        assert [names[m] for m in j["model_ids"]] == want
        assert j["device"] == ELITE and j["result_state"] == DONE
    print(f"\n[qaihub parts] hub jobs: {len(compiles)} compile (qnn_dlc), {len(links)} link")


def test_manifest_is_qnn_htps_parts_manifest_with_the_jobs(linked, hub, tiny_model, store, registry):
    from vlmrun_qualcomm.parts import graph_digest
    from vlmrun_qualcomm.manifest import describe_ctx_onnx

    art = linked.pipe.handles["decoder"].artifact
    m = art.manifest
    d = m["decoder_parts"]
    assert m["compiler"] == "qaihub" and m["target"] == "qnn_htp" and m["stage"] == "decoder"
    assert m["precision"] == "fp16" and m["soc"] == "SM8750" and m["arch"] == "v79" and m["qnn_version"]
    assert (d["count"], d["graphs_per_binary"], d["weight_sharing"], d["ar"], d["ctx"]) == (P, 2, True, AR, CTX)
    assert d["binaries_in_order"] == [f"part{k}_of_{P}_qnn.bin" for k in range(1, P + 1)]
    assert not d["loads_on_emulator"] and len(m["graphs"]) == 2 * P
    assert [f for f in m["files"] if f.endswith(".bin")] == d["binaries_in_order"]
    src = part_export(tiny_model, store, registry)
    desc = json.loads((src.path / "parts.json").read_text())
    links = {j["id"]: j for j in linked.jobs if j["kind"] == "link"}
    compiles = {j["id"]: j for j in linked.jobs if j["kind"] == "compile"}
    assert m["hub_link_jobs"].split(",") == list(links) and sorted(m["hub_compile_jobs"].split(",")) == sorted(compiles)
    assert m["hub_device"] == ELITE and "/web/jobs/" in m["hub_url"]
    for p, sp in zip(d["parts"], desc["parts"]):
        k = p["index"]
        binary = art.path / p["binaries"][0]
        assert p["binaries"] == [f"part{k}_of_{P}_qnn.bin"] and p["bytes"] == binary.stat().st_size
        assert binary.read_bytes() == hub.models[links[p["hub_link_job"]]["target"]]["data"]
        data = binary.read_bytes()
        assert b"QNNExecutionProvider_" not in data  # the graphs carry the names the compile jobs asked for
        assert p["layers"] == sp["layers"]
        for kind, rows in (("prompt", AR), ("token", 1)):
            g = p["graphs"][kind]
            assert re.fullmatch(rf"{kind}_ar{rows}_cl{CTX}_0*_?{k}_of_{P}", g["name"]), g["name"]
            assert g["name"].encode() in data  # both graphs live in this one binary
            assert g["ar"] == rows and g["binary"] == p["binaries"][0]
            assert g["hub_compile_job"] == p["hub_compile_jobs"][kind] in compiles
            assert compiles[g["hub_compile_job"]]["target"] in links[p["hub_link_job"]]["model_ids"]
            info = describe_ctx_onnx(art.path / g["wrapper"])
            assert info["graphs"] == [g["name"]] and info["binaries"] == p["binaries"] and not info["non_qnn_nodes"]
            assert [t["name"] for t in g["inputs"]] == [t["name"] for t in sp["graphs"][kind]["inputs"]]
            assert [t["shape"] for t in g["outputs"]] == [t["shape"] for t in sp["graphs"][kind]["outputs"]]
            assert p["source_sha256"][kind] == graph_digest(src.path / sp["graphs"][kind]["file"])
    # Genie's configuration comes from the same manifest, unchanged: the part binaries in order
    h = linked.pipe.handles["decoder"]
    assert h.ctx_bins == [str(art.path / b) for b in d["binaries_in_order"]]
    cfg = json.dumps(h.config(SimpleNamespace(stop_ids=frozenset({1}), sampler=None, max_new_tokens=4)))
    assert all(str(art.path / b) in cfg for b in d["binaries_in_order"])


def test_emulator_refuses_the_linked_binaries_in_one_line(linked, ref_pipe, image_path):
    emb = ref_pipe.embed_prompt(ref_pipe.prepare(image_path, PROMPT))
    with pytest.raises(BackendError) as err:
        linked.pipe.run_stage("decoder", {"inputs_embeds": emb})
    msg = str(err.value)
    assert "Shared weights buffer isn't supported on this platform" in msg and "\n" not in msg


def test_stored_artifact_is_reused_and_no_token_anywhere(linked, hub, tiny_model, store, registry, capfd):
    jobs0 = hub.count("POST", "jobs")
    again = build(tiny_model, store, registry, opts("linked", engine="genie"))
    assert again.handles["decoder"].artifact.path == linked.pipe.handles["decoder"].artifact.path
    assert hub.count("POST", "jobs") == jobs0
    out = capfd.readouterr()
    for f in Path(store.root).rglob("*"):
        if f.is_file() and f.suffix in (".json", ".onnx", ".lock", ""):
            assert TOKEN.encode() not in f.read_bytes(), f
    assert TOKEN not in out.out + out.err and TOKEN in hub.seen_tokens


def test_vlmrun_compile_json_names_the_jobs(linked, hub, store, tiny_model):
    """`vlmrun compile --compiler qaihub --backend qnn_htp --stage decoder --decoder-form parts ... --json`."""
    from click.testing import CliRunner

    from vlmrun.cli import cli

    jobs0 = hub.count("POST", "jobs")
    res = CliRunner().invoke(cli, [
        "compile", "--compiler", "qaihub", "--backend", "qnn_htp", "--stage", "decoder", "--decoder-form", "parts",
        "--context-length", str(CTX), "-o", f"decoder.prefill_ar={AR}", "-o", f"decoder.parts={P}",
        "-o", "decoder.hub_options=--vlmrun_test_tag linked", "--image-size", "256", "--cache-dir", str(store.root),
        "--json"])
    assert res.exit_code == 0, res.output
    art = json.loads(res.output[res.output.index("{"):])["artifacts"][0]
    m = linked.pipe.handles["decoder"].artifact.manifest
    assert not art["built"] and art["path"] == str(linked.pipe.handles["decoder"].artifact.path), res.output
    assert art["hub_link_jobs"] == m["hub_link_jobs"] and art["hub_compile_jobs"] == m["hub_compile_jobs"]
    assert art["hub_device"] == ELITE and hub.count("POST", "jobs") == jobs0 and TOKEN not in res.output


# -- resuming, failures --------------------------------------------------------------------------------------------
def test_interrupted_compile_resumes_without_resubmitting_finished_jobs(hub, tiny_model, store, registry, capfd):
    hub.hold_links = True
    jobs0, models0 = hub.count("POST", "jobs"), hub.count("POST", "models")
    try:
        with pytest.raises(BackendError) as err:
            build(tiny_model, store, registry, opts("resume", job_timeout=0.5))
    finally:
        hub.hold_links = False
    msg = str(err.value)
    first_link = hub.link_jobs[-P]["id"]
    assert "did not finish" in msg and first_link in msg and "\n" not in msg
    assert hub.count("POST", "jobs") == jobs0 + 3 * P  # every compile job and every link job went out
    mine = [e for e in ledger(store) if "--vlmrun_test_tag resume" in e.get("options", "")]
    assert len(mine) == 2 * P and all(e["state"] == "done" and e["kind"] == "compile" for e in mine)
    assert {e["job_id"] for e in ledger(store) if e.get("kind") == "link" and e["state"] == "submitted"} >= {
        j["id"] for j in hub.link_jobs[-P:]}
    no_artifact_for(store, "--vlmrun_test_tag resume")
    pipe = build(tiny_model, store, registry, opts("resume"))
    err_text = capfd.readouterr().err
    assert hub.count("POST", "jobs") == jobs0 + 3 * P and hub.count("POST", "models") == models0 + 2 * P
    assert f"re-attaching to link job {first_link}" in err_text and "reusing compile job" in err_text
    m = pipe.handles["decoder"].artifact.manifest
    assert m["hub_link_jobs"].split(",") == [j["id"] for j in hub.link_jobs[-P:]]


def test_failed_link_job_is_one_line_and_leaves_no_artifact(hub, tiny_model, store, registry, capfd):
    reason = "QNN link error: graph prompt_ar16_cl128_1_of_2 exceeds the HTP's VTCM budget"
    hub.fail_link = reason
    jobs0 = hub.count("POST", "jobs")
    with pytest.raises(BackendError) as err:
        build(tiny_model, store, registry, opts("link-fails"))
    msg = str(err.value)
    failed = hub.link_jobs[-P]["id"]
    with capfd.disabled():
        print(f"\n[qaihub parts] failed link job: {msg}")
    assert f"link job {failed} failed" in msg and "decoder part 1/2" in msg and reason in msg and "\n" not in msg
    assert TOKEN not in msg
    no_artifact_for(store, "--vlmrun_test_tag link-fails")
    # the rerun resubmits the failed link job only: compile jobs and the other part's link job are kept
    pipe = build(tiny_model, store, registry, opts("link-fails"))
    assert hub.count("POST", "jobs") == jobs0 + 3 * P + 1
    m = pipe.handles["decoder"].artifact.manifest
    assert m["hub_link_jobs"].split(",") == [hub.link_jobs[-1]["id"], hub.link_jobs[-2]["id"]]
    assert failed not in m["hub_link_jobs"]
    capfd.readouterr()


def test_failed_compile_job_names_part_and_graph(hub, tiny_model, store, registry, capfd):
    hub.fail_compile = "Op 'Softmax' (node /layers.0/Softmax) is not supported on hexagon v79"
    before = set(hub.jobs)
    with pytest.raises(BackendError) as err:
        build(tiny_model, store, registry, opts("compile-fails"))
    msg = str(err.value)
    failed = next(j["id"] for j in new_jobs(hub, before) if j.get("reason"))
    assert f"compile job {failed} failed" in msg and "decoder part 1/2 prompt graph" in msg
    assert "is not supported on hexagon v79" in msg and "\n" not in msg
    assert not any(j["kind"] == "link" for j in new_jobs(hub, before))  # no link job submitted
    no_artifact_for(store, "--vlmrun_test_tag compile-fails")
    capfd.readouterr()


def test_quantized_parts_are_refused_before_any_upload(hub, tiny_model, store, registry):
    models0, jobs0 = hub.count("POST", "models"), hub.count("POST", "jobs")
    with pytest.raises(UsageError) as err:
        build(tiny_model, store, registry, opts("w8a16", precision="w8a16"))
    msg = str(err.value)
    assert "fp16 only" in msg and "w8a16" in msg and "\n" not in msg
    assert (hub.count("POST", "models"), hub.count("POST", "jobs")) == (models0, jobs0)


# -- the fake's link contract, on the wire ----------------------------------------------------------------------------
def test_link_job_takes_only_dlc_models_from_compile_jobs(hub, tmp_path):
    """The client refuses non-DLC inputs itself; sent anyway (raw REST call), the hub fails the job."""
    import onnx
    from onnx import TensorProto, helper
    from qai_hub import public_api_pb2 as pb
    from qai_hub import public_rest_api as api
    from qai_hub.client import Client, UserError

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4])
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    path = tmp_path / "relu.onnx"
    onnx.save(helper.make_model(g, ir_version=10, opset_imports=[helper.make_opsetid("", 17)]), str(path))
    client = Client()
    onnx_model = client.upload_model(str(path))
    with pytest.raises(UserError, match="must be a QNN DLC model"):
        client.submit_link_job([onnx_model], device=client.get_devices(name=ELITE)[0])

    def raw_link(ids):
        lj = pb.LinkJob(device=pb.Device(name=ELITE), name="raw", options="")
        lj.models.models.extend(pb.Model(model_id=i) for i in ids)
        job = client.get_job(api.create_link_job(client.config, lj).id)
        st = job.wait()
        return job, st

    job, st = raw_link([onnx_model.model_id])
    assert st.failure and "is a ONNX model; link jobs take QNN DLC models" in st.message and job.job_id
    dlc_job = client.submit_compile_job(onnx_model, device=client.get_devices(name=ELITE)[0],
                                        options="--target_runtime qnn_dlc --qnn_graph_name relu_1_of_1")
    assert dlc_job.wait().success
    dlc = dlc_job.get_target_model()
    assert dlc.model_type.name == "QNN_DLC"
    _, st = raw_link([dlc.model_id, dlc.model_id])
    assert st.failure and "must be distinct" in st.message
    gen3 = client.submit_compile_job(onnx_model, device=client.get_devices(name="Snapdragon 8 Gen 3 QRD")[0],
                                     options="--target_runtime qnn_dlc --qnn_graph_name relu2_1_of_1")
    assert gen3.wait().success
    _, st = raw_link([dlc.model_id, gen3.get_target_model().model_id])
    assert st.failure and "must target the same device" in st.message
    ok = client.submit_link_job([dlc], device=client.get_devices(name=ELITE)[0])
    assert ok.wait().success and ok.get_target_model().model_type.name == "QNN_CONTEXT_BINARY"


# -- one binary per graph: what the emulator can load ---------------------------------------------------------------
def test_unshared_parts_from_the_hub_run_on_the_emulator(hub, tiny_model, store, registry, ref_pipe, image_path):
    before = set(hub.jobs)
    pipe = build(tiny_model, store, registry, opts("unshared", weight_sharing="off"))
    jobs = new_jobs(hub, before)
    assert len(jobs) == 2 * P and all(j["kind"] == "compile" and "qnn_context_binary" in j["options"] for j in jobs)
    m = pipe.handles["decoder"].artifact.manifest
    d = m["decoder_parts"]
    assert (d["graphs_per_binary"], d["weight_sharing"], len(d["binaries_in_order"])) == (1, False, 2 * P)
    assert m["hub_link_jobs"] == "" and len(m["hub_compile_jobs"].split(",")) == 2 * P
    emb = ref_pipe.embed_prompt(ref_pipe.prepare(image_path, PROMPT))
    got = pipe.run_stage("decoder", {"inputs_embeds": emb})["logits"]
    want = ref_pipe.run_stage("decoder", {"inputs_embeds": emb})["logits"]
    c = cosine(got[0, -1], want[0, -1])
    print(f"\n[qaihub parts] unshared hub binaries on the emulator: last-row logits cosine vs reference {c:.5f}")
    assert c > 0.99 and int(np.argmax(got[0, -1])) == int(np.argmax(want[0, -1]))
