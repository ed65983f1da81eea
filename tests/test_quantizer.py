"""qnn_htp's one quantizer (recipe.Recipe, quantizer.quantize) and its AIMET engine, on the tiny default model.

* AIMET's w4a16 LPBQ parts decoder and AIMET's int8 vision stage compile and run on the emulator; the emulator's
  outputs agree with AIMET's own simulation of the same recipe on the same calibration data (>= 40 dB);
* the binary's weights are blockwise (what the QDQ model stores, recorded in the manifest) and the recipe keys the
  binary (another block size builds another one);
* on held-out pictures (not the calibration image), LPBQ's teacher-forced logits are closer to the reference than
  onnxruntime's per-channel min-max ones: both SQNRs computed here from the logits;
* bad recipes are one line, exit 2, before any export.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import run_cli

pytest.importorskip("onnxruntime_qnn")
pytest.importorskip("aimet_onnx")

from vlmrun import Pipeline  # noqa: E402
from vlmrun.layouts import Layout, StageAssignment  # noqa: E402
from vlmrun.stages import STAGES  # noqa: E402

AR, CTX = 16, 128
PARTS = {"decoder_form": "parts", "context_length": CTX, "prefill_ar": AR, "parts": 1, "weight_sharing": "off"}


def sqnr(ref, dev) -> float:
    ref, dev = np.asarray(ref, np.float64), np.asarray(dev, np.float64)
    return float(10 * np.log10((ref ** 2).sum() / ((ref - dev) ** 2).sum()))


def layout(stage: str, **opts) -> Layout:
    stages = {s: StageAssignment("ort_reference", {}) for s in STAGES}
    stages[stage] = StageAssignment("qnn_htp", opts)
    return Layout(f"test-quantizer-{stage}", stages)


def compile_context(pipe, stage: str):
    """The core's CompileContext for ``stage`` of ``pipe`` (what the compile hook got: the same calibration data)."""
    from vlmrun.pipeline import StageCompileContext, StageContext

    sc = StageContext(backend="qnn_htp", stage=stage, model=pipe.model, options={}, store=pipe.store,
                      registry=pipe.registry)
    return StageCompileContext(sc, "test")


def preprocessed(src: Path, work: Path) -> Path:
    from onnxruntime.quantization.execution_providers.qnn import qnn_preprocess_model

    pre = work / "pre.onnx"
    return pre if qnn_preprocess_model(str(src), str(pre), fuse_layernorm=True) else src


def source_dir(store, artifact) -> Path:
    return store.artifacts_dir / artifact.manifest["key"]["source"]


@pytest.fixture(scope="module")
def lpbq(tiny_model, store):
    return Pipeline.build(tiny_model, layout("decoder", precision="w4a16", quantizer="aimet", **PARTS), store=store)


@pytest.fixture(scope="module")
def minmax(tiny_model, store):
    return Pipeline.build(tiny_model, layout("decoder", precision="w4a16", **PARTS), store=store)


def test_aimet_lpbq_decoder_matches_aimets_simulation_on_the_emulator(lpbq, tiny_model, store, tmp_path):
    from vlmrun_qnn_htp import aimet_engine, calibration, ep
    from vlmrun_qnn_htp.recipe import from_key
    from vlmrun_qualcomm import socs

    art = lpbq.handles["decoder"].artifact
    m = art.manifest
    q = m["quantization"]
    assert q["quantizer"] == "aimet" and q["recipe"] == "aimet w4a16 lpbq(block 64) minmax"
    assert q["stored"]["weights"] == {"int4 blockwise (block 64)": 22}  # 3 layers x 7 + lm_head
    assert q["stored"]["block_scales"]["uint8"] == 22 and q["lpbq"] == {"block_size": 64, "weights": 22}
    # the same calibration feeds the compile used, AIMET's simulation of the same recipe on the float graph
    src = source_dir(store, art)
    desc = json.loads((src / "parts.json").read_text())
    feeds, _ = calibration.parts_calibration_feeds(tiny_model, src, desc, [], compile_context(lpbq, "decoder"),
                                                   kinds=("prompt",))
    prompt = feeds[(1, "prompt")]
    sim, _ = aimet_engine.build_sim(preprocessed(src / desc["parts"][0]["graphs"]["prompt"]["file"], tmp_path),
                                    prompt, from_key(art.manifest["key"]["options"]), tmp_path)
    names = [o.name for o in sim.session.get_outputs()]
    g = m["decoder_parts"]["parts"][0]["graphs"]["prompt"]
    htp = ep.HtpSession(art.path / g["wrapper"], socs.soc("SM8750"), "decoder prompt graph")
    worst = np.inf
    for f in prompt[:: max(1, len(prompt) // 6)]:
        simulated = dict(zip(names, sim.session.run(names, f)))
        logits_sim = simulated.get("logits_updated", simulated.get("logits"))
        worst = min(worst, sqnr(logits_sim, htp.run(f)["logits"]))
    print(f"\n[aimet] w4a16 LPBQ decoder: emulator vs AIMET simulation, worst feed {worst:.1f} dB")
    assert worst >= 40.0


#: emulator vs simulation floors measured on this vision tower (seeded random calibration feeds): with 16-bit
#: activations 53 dB for both engines; with 8-bit activations 28.6 dB (AIMET) / 29.2 dB (onnxruntime): the HTP's
#: a8 execution departs from every float fake-quant simulation by as much, whichever engine made the QDQ model
VISION_FLOOR_DB = {"a16w8": 40.0, "int8": 26.0}


@pytest.mark.parametrize("precision", ["int8", "a16w8"])
def test_aimet_vision_matches_aimets_simulation_on_the_emulator(precision, tiny_model, store, tmp_path):
    from vlmrun_qnn_htp import aimet_engine, calibration
    from vlmrun_qnn_htp.recipe import from_key

    pipe = Pipeline.build(tiny_model, layout("vision", precision=precision, quantizer="aimet"), store=store,
                          stages=("vision",))
    art = pipe.handles["vision"].artifact
    q = art.manifest["quantization"]
    assert q["quantizer"] == "aimet" and q["quantizer_version"] == "2.42.0"
    assert set(q["stored"]["weights"]) == {"int8"} and q["stored"]["weights"]["int8"] > 30
    assert set(q["stored"]["activations"]) == ({"uint8", "uint16"} if precision == "int8" else {"uint16"})
    feeds, label = calibration.calibration_samples("vision", tiny_model, None)
    assert label == "random" and q["calibration"] == "random"
    src = source_dir(store, art)
    sim, _ = aimet_engine.build_sim(preprocessed(next(src.glob("*.onnx")), tmp_path), feeds,
                                    from_key(art.manifest["key"]["options"]), tmp_path)
    names = [o.name for o in sim.session.get_outputs()]
    for f in feeds[:2]:
        simulated = dict(zip(names, sim.session.run(names, f)))
        s = simulated.get("image_features_updated", simulated.get("image_features"))
        dev = pipe.run_stage("vision", f)["image_features"]
        print(f"\n[aimet] {precision} vision: emulator vs AIMET simulation {sqnr(s, dev):.1f} dB")
        assert sqnr(s, dev) >= VISION_FLOOR_DB[precision]


def test_the_recipe_keys_the_binary(lpbq, tiny_model, store):
    other = Pipeline.build(tiny_model, layout("decoder", precision="w4a16", quantizer="aimet", block_size=32,
                                              **PARTS), store=store)
    a, b = lpbq.handles["decoder"].artifact, other.handles["decoder"].artifact
    assert a.path != b.path
    assert a.manifest["key"]["options"]["block_size"] == 64 and b.manifest["key"]["options"]["block_size"] == 32
    assert b.manifest["quantization"]["stored"]["weights"] == {"int4 blockwise (block 32)": 22}


def heldout_rows(pipes: dict, ref, n_items: int = 4, steps: int = 6) -> dict:
    """Teacher-forced logits rows of each pipe and the reference over generated held-out pictures (seed 4242, not
    the calibration's demo image and prompts): {name: [rows, V]}."""
    from vlmrun import GenerationSettings
    from vlmrun.shapes import items, render

    out = {name: [] for name in (*pipes, "reference")}
    it = items(4242)
    for _ in range(n_items):
        item = next(it)
        image = render(item.scene)
        gen = ref.generate(image, item.question, GenerationSettings(max_new_tokens=steps, ignore_eos=True)).run()
        emb = ref.embed_prompt(ref.prepare(image, item.question))
        full = np.concatenate([emb, ref.embed_tokens(np.asarray(gen.token_ids))], axis=1)
        T = emb.shape[1]
        for name, p in (*pipes.items(), ("reference", ref)):
            out[name].append(p.run_stage("decoder", {"inputs_embeds": full})["logits"][0, T - 1: T - 1 + steps])
    return {k: np.concatenate(v) for k, v in out.items()}


def test_lpbq_beats_minmax_on_heldout_rows(lpbq, minmax, ref_pipe):
    rows = heldout_rows({"lpbq": lpbq, "minmax": minmax}, ref_pipe)
    ref = rows["reference"]
    s_lpbq, s_mm = sqnr(ref, rows["lpbq"]), sqnr(ref, rows["minmax"])
    print(f"\n[aimet] held-out logits SQNR ({len(ref)} rows): LPBQ block 64 {s_lpbq:.2f} dB, onnxruntime min-max"
          f" {s_mm:.2f} dB")
    assert s_lpbq > s_mm
    # and the manifests: onnxruntime's per-channel int4, AIMET's blockwise int4
    assert minmax.handles["decoder"].artifact.manifest["quantization"]["stored"]["weights"] == {"int4": 22}


def test_onnxruntime_manifest_says_what_the_qdq_model_stores(minmax):
    q = minmax.handles["decoder"].artifact.manifest["quantization"]
    stored = q["stored"]
    # RMSNorm gains and the q/k/v biases are stored as 16-bit activations-style constants, not int8 / int32
    assert stored["norm_gains"] == {"uint16": 7} and stored["biases"] == {"uint16": 9}
    assert set(stored["activations"]) == {"uint16"} and q["recipe"] == "onnxruntime w4a16 per-channel minmax"


@pytest.mark.parametrize("args, message", [
    (["-o", "decoder.quantizer=aimet", "-o", "decoder.algorithm=foo"], "algorithm"),
    (["-o", "decoder.quantizer=aimet", "-o", "decoder.block_size=256"],
     "block_size 256 does not divide the 128 input channels"),
    (["-o", "decoder.algorithm=adaround"], "algorithm adaround is AIMET's"),
    (["-o", "decoder.weight_scheme=lpbq"], "weight_scheme lpbq is built by AIMET"),
])
def test_bad_recipes_are_one_line_before_any_export(args, message, tmp_path):
    cache = tmp_path / "cache"
    r = run_cli(["compile", "--backend", "qnn_htp", "--stage", "decoder", "--decoder-form", "parts",
                 "--precision", "w4a16", *args], cache, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and message in lines[0], r.stderr
    assert "Traceback" not in r.stderr
    assert not list((cache / "artifacts").glob("*")) if (cache / "artifacts").exists() else True


def test_missing_aimet_extra_is_one_line_naming_it(tmp_path):
    """Without aimet-onnx importable, quantizer = "aimet" says which extra to install, exit 2, nothing exported."""
    blocker = tmp_path / "block"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(
        "import importlib.abc, sys\n"
        "class _Block(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'aimet_onnx' or name.startswith('aimet_onnx.'):\n"
        "            raise ModuleNotFoundError(name)\n"
        "        return None\n"
        "sys.meta_path.insert(0, _Block())\n")
    cache = tmp_path / "cache"
    r = run_cli(["compile", "--backend", "qnn_htp", "--stage", "vision", "--precision", "int8", "--quantizer",
                 "aimet"], cache, env_extra={"PYTHONPATH": str(blocker)}, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "pip install 'vlmrun-qnn-htp[aimet]'" in lines[0], r.stderr
    assert not (cache / "artifacts").exists() or not list((cache / "artifacts").iterdir())


def test_qaihub_refuses_qnn_htps_recipe_before_any_work(tmp_path):
    """The hub quantizes a stage itself: a qnn_htp recipe with --compiler qaihub would be ignored, so it is refused."""
    cache = tmp_path / "cache"
    r = run_cli(["compile", "--compiler", "qaihub", "--backend", "qnn_htp", "--stage", "vision", "--precision",
                 "int8", "--quantizer", "aimet"], cache, env_extra={"QAIHUB_API_TOKEN": ""}, timeout=300)
    assert r.returncode == 2
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "quantizer = 'aimet' chooses qnn_htp's own quantizer" in lines[0], r.stderr
    assert not cache.exists() or not (cache / "artifacts").exists()


def test_an_encoding_the_htp_refuses_is_named_in_one_line(tiny_model, tmp_path, monkeypatch):
    """A QDQ model whose LayerNorm gamma is per-channel (AIMET's config with per-channel quantization on every op)
    is refused by the HTP while composing the graph: the error names the node and what to do."""
    import json as _json

    from vlmrun.errors import BackendError
    from vlmrun.store import ArtifactStore
    from vlmrun_qnn_htp import aimet_engine

    real = aimet_engine.htp_config

    def per_channel_everywhere(work):
        path = real(work)
        cfg = _json.loads(path.read_text())
        cfg["defaults"]["per_channel_quantization"] = "True"
        path.write_text(_json.dumps(cfg))
        return path

    monkeypatch.setattr(aimet_engine, "htp_config", per_channel_everywhere)
    with pytest.raises(BackendError) as err:
        Pipeline.build(tiny_model, layout("vision", precision="int8", quantizer="aimet"),
                       store=ArtifactStore(tmp_path / "store"), stages=("vision",))
    msg = str(err.value)
    assert "\n" not in msg and "refused node /tower/" in msg and "LayerNormalization (QNN LayerNorm" in msg
    assert "keep_fp" in msg and not list((tmp_path / "store" / "artifacts").glob("vision-qnn_htp-*"))


def test_a_big_graph_is_quantized_in_a_child_with_the_same_bytes(lpbq, store, tmp_path, monkeypatch):
    """A full-size part graph is quantized in a spawned child (its memory freed before the compile): the QDQ model
    is byte-identical to the in-process one's, for each engine."""
    from vlmrun_qnn_htp import calibration, quantizer
    from vlmrun_qnn_htp.recipe import Recipe

    art = lpbq.handles["decoder"].artifact
    src_dir = source_dir(store, art)
    desc = json.loads((src_dir / "parts.json").read_text())
    src = src_dir / desc["parts"][0]["graphs"]["token"]["file"]
    rng = np.random.default_rng(0)
    import onnx

    g = onnx.load(str(src), load_external_data=False).graph
    dims = {i.name: [d.dim_value or 1 for d in i.type.tensor_type.shape.dim] for i in g.input}
    feeds = [{n: (rng.standard_normal(s).astype(np.float32) if n != "attention_mask" else np.zeros(s, np.float32))
              for n, s in dims.items()} for _ in range(4)]
    for engine in ("onnxruntime", "aimet"):
        recipe = Recipe(precision="w4a16", quantizer=engine)
        here, there = tmp_path / f"{engine}-here", tmp_path / f"{engine}-child"
        here.mkdir(), there.mkdir()
        facts_here = quantizer.quantize(src, here / "q.onnx", feeds, recipe, here)
        monkeypatch.setattr(quantizer, "is_big", lambda path: True)
        facts_child = quantizer.quantize(src, there / "q.onnx", calibration.spill_feeds(feeds, there / "f.npz"),
                                         recipe, there)
        monkeypatch.undo()
        assert facts_child["process"].startswith("child") and "process" not in facts_here
        assert facts_child["stored"] == facts_here["stored"]
        assert (here / "q.onnx").read_bytes() == (there / "q.onnx").read_bytes(), engine


def test_the_quantizers_renames_in_c_give_the_same_bytes(lpbq, store, tmp_path, monkeypatch):
    """onnxruntime's per-tensor renames over every node (quadratic, in Python) are done through a C membership test
    while vlmrun quantizes (`vlmrun_qnn_htp.quantizer_edits`): the QDQ model is byte-identical to onnxruntime's own
    renames' for a part's prompt and token graphs, and onnxruntime's methods are back after."""
    import contextlib

    import onnx
    from onnxruntime.quantization.onnx_model import ONNXModel

    from vlmrun_qnn_htp import quantizer
    from vlmrun_qnn_htp.recipe import Recipe

    from onnxruntime.quantization.calibrate import MinMaxCalibrater

    own = ONNXModel.replace_input_of_all_nodes, ONNXModel.replace_output_of_all_nodes, MinMaxCalibrater.augment_graph
    art = lpbq.handles["decoder"].artifact
    src_dir = source_dir(store, art)
    desc = json.loads((src_dir / "parts.json").read_text())
    rng = np.random.default_rng(0)
    for kind in ("prompt", "token"):
        src = src_dir / desc["parts"][0]["graphs"][kind]["file"]
        g = onnx.load(str(src), load_external_data=False).graph
        dims = {i.name: [d.dim_value or 1 for d in i.type.tensor_type.shape.dim] for i in g.input}
        feeds = [{n: (rng.standard_normal(s).astype(np.float32) if n != "attention_mask" else np.zeros(s, np.float32))
                  for n, s in dims.items()} for _ in range(2)]
        recipe = Recipe(precision="w4a16", quantizer="onnxruntime")
        fast, slow = tmp_path / f"{kind}-fast", tmp_path / f"{kind}-slow"
        fast.mkdir(), slow.mkdir()
        quantizer.quantize(src, fast / "q.onnx", feeds, recipe, fast)
        assert (ONNXModel.replace_input_of_all_nodes, ONNXModel.replace_output_of_all_nodes,
                MinMaxCalibrater.augment_graph) == own
        monkeypatch.setattr(quantizer, "graph_edits_in_c", contextlib.nullcontext)
        quantizer.quantize(src, slow / "q.onnx", feeds, recipe, slow)
        monkeypatch.undo()
        assert (fast / "q.onnx").read_bytes() == (slow / "q.onnx").read_bytes(), kind


def test_the_calibrators_graph_is_onnxruntimes_node_for_node(lpbq, store, tmp_path):
    """`quantizer_edits._augment_graph` (onnxruntime's min-max augmentation from one pass over the nodes) makes
    onnxruntime's augmented graph: the same nodes in the same order, the same outputs and initializers, up to the
    uuid names onnxruntime draws anew each run; per channel (the reduce axes as inputs) too."""
    import re

    import onnx
    from onnxruntime.quantization.calibrate import MinMaxCalibrater

    from vlmrun_qnn_htp.quantizer_edits import _augment_graph

    uuid = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")

    def canonical(path):
        model = onnx.load(str(path), load_external_data=False)
        names: dict[str, str] = {}
        text = str(model.graph)  # the graph as text, in order: nodes, initializers, inputs, outputs
        return uuid.sub(lambda m: names.setdefault(m.group(0), f"uuid{len(names)}"), text)

    desc = json.loads((source_dir(store, lpbq.handles["decoder"].artifact) / "parts.json").read_text())
    src = source_dir(store, lpbq.handles["decoder"].artifact) / desc["parts"][0]["graphs"]["prompt"]["file"]
    for per_channel in (False, True):
        made = []
        for augment in (MinMaxCalibrater.augment_graph, _augment_graph):
            out = tmp_path / f"augmented-{per_channel}-{len(made)}.onnx"
            cal = MinMaxCalibrater(str(src), augmented_model_path=str(out), per_channel=per_channel)
            augment(cal)
            made.append(canonical(out))
        assert made[0].count("ReduceMin") > 100 and made[0] == made[1], per_channel


def test_aimets_default_plan_keeps_each_part_graph_quantizable():
    """With AIMET and parts = 0 the full-size decoder goes in two parts (its simulation of the whole 2 GB graph was
    killed at 21.7 GB; 17 + 7 layers peaked at 12.9 GB); onnxruntime's min-max keeps the one part the size limit
    allows; a tiny model stays in one part either way."""
    from types import SimpleNamespace

    from vlmrun_qnn_htp.options import parts_plan, stage_options

    full = SimpleNamespace(hidden_size=896, num_heads=14, num_kv_heads=2, head_dim=64, vocab_size=151936,
                           num_layers=24, text_config={"intermediate_size": 4864})
    tiny = SimpleNamespace(hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=32, vocab_size=448, num_layers=3,
                           text_config={"intermediate_size": 512})
    for model, engine, want in ((full, "onnxruntime", [24]), (full, "aimet", [17, 7]), (tiny, "aimet", [3])):
        opts = stage_options("decoder", {"precision": "w4a16", "quantizer": engine, "context_length": 1024})
        assert parts_plan(model, opts)["layers"] == want, engine
    opts = stage_options("decoder", {"precision": "w4a16", "quantizer": "aimet", "parts": 3, "context_length": 1024})
    assert len(parts_plan(full, opts)["layers"]) == 3  # an explicit parts count is the user's


def test_quantizing_does_not_import_torch(tmp_path):
    """onnxruntime.tools' __init__ imports torch when it is installed (5.5 s of an 11.6 s quantization of the tiny
    model's part graph, profiled); a process that quantizes from stored exports never needs it (the QDQ bytes of
    that part graph were the same either way, checked by hand)."""
    import subprocess
    import sys

    script = """
import sys
from pathlib import Path
import numpy as np, onnx
from onnx import TensorProto, helper, numpy_helper
from vlmrun_qnn_htp import quantizer
from vlmrun_qnn_htp.recipe import Recipe
rng = np.random.default_rng(0)
w = numpy_helper.from_array(rng.standard_normal((16, 8)).astype(np.float32), "w")
graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])], [w])
out = Path(sys.argv[1])
onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), out / "g.onnx")
feeds = [{"x": rng.standard_normal((1, 16)).astype(np.float32)} for _ in range(2)]
facts = quantizer.quantize(out / "g.onnx", out / "q.onnx", feeds, Recipe(precision="int8"), out)
print("torch" in sys.modules, "QuantizeLinear" in {n.op_type for n in onnx.load(out / "q.onnx").graph.node})
"""
    res = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split()[-2:] == ["False", "True"]  # quantized, and torch never imported
