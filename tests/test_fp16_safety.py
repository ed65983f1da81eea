"""fp16 safety of the NPU decoder forms on a tiny model with planted massive activations.

Real Qwen2 checkpoints carry "massive activations": a few residual channels in the hundreds to thousands on the
first token and on delimiters. RMSNorm squares them, and fp16 (how the HTP runs the exported fp32 casts)
overflows once |x| > 256. ``vlmrun make-tiny --massive-activations`` plants such activations; the decoder forms
qnn_htp compiles use the fp16-safe RMSNorm by default (``rmsnorm = "safe"``) and ``rmsnorm = "plain"`` rebuilds
the unsafe graph, so this file shows both the failure and the fix on the v79 emulator.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from conftest import IMAGE_SIZE, run_cli

pytest.importorskip("onnxruntime_qnn")

from vlmrun import GenerationSettings, Pipeline  # noqa: E402
from vlmrun.diff.metrics import logits_steps, tensor_metrics  # noqa: E402
from vlmrun.diff.thresholds import thresholds_for  # noqa: E402
from vlmrun.layouts import Layout, StageAssignment  # noqa: E402
from vlmrun.stages import STAGES, ExportForm  # noqa: E402

PROMPT = "What is in the picture?"
N_STEPS = 10
DECODER = {"context_length": 128, "prefill_ar": 32}
FP16 = thresholds_for("fp16")["decoder"]  # the diff's fp16 tolerances: SQNR >= 30 dB, top-1 >= 0.9, ...


@pytest.fixture(scope="module")
def registry():
    from vlmrun import plugins

    return plugins.load()


@pytest.fixture(scope="module")
def massive_model(tmp_path_factory, store, cache_dir):
    """The tiny model (256x256) with planted massive activations, built through the CLI flag."""
    from vlmrun.model import FastVLMModel

    out = tmp_path_factory.mktemp("massive") / "model"
    t0 = time.perf_counter()
    res = run_cli(["make-tiny", str(out), "--image-size", str(IMAGE_SIZE), "--massive-activations"], cache_dir)
    assert res.returncode == 0, res.stderr[-2000:]
    print(f"\n[fp16] make-tiny --massive-activations {time.perf_counter() - t0:.1f} s")
    return FastVLMModel.open(out, store)


@pytest.fixture(scope="module")
def massive_ref(massive_model, store, registry):
    return Pipeline.build(massive_model, "reference", store=store, registry=registry)


@pytest.fixture(scope="module")
def teacher(massive_ref, image_path):
    """The demo prompt's spliced embeddings plus the reference's 10 greedy tokens, and the reference logits."""
    prepared = massive_ref.prepare(image_path, PROMPT)
    tokens = massive_ref.generate(image_path, PROMPT,
                                  GenerationSettings(max_new_tokens=N_STEPS, ignore_eos=True)).run().token_ids
    embeds = massive_ref.embed_prompt(prepared)
    full = np.concatenate([embeds, massive_ref.embed_tokens(np.asarray(tokens))], axis=1)
    logits = massive_ref.run_stage("decoder", {"inputs_embeds": full})["logits"]
    return {"prepared": prepared, "embeds": full, "logits": logits, "tokens": tokens}


def _residuals(model, embeds):
    """The residual stream after each decoder layer (torch, fp32): [layers, T, H]."""
    import torch

    lm = model.load_torch().model.language_model
    seen = []
    hooks = [layer.register_forward_hook(lambda m, i, o: seen.append(o[0] if isinstance(o, tuple) else o))
             for layer in lm.layers]
    try:
        with torch.no_grad():
            lm(inputs_embeds=torch.from_numpy(np.ascontiguousarray(embeds)))
    finally:
        for h in hooks:
            h.remove()
    return np.stack([s[0].numpy() for s in seen])


def test_planted_activations_are_massive_where_real_llms_have_them(massive_model, teacher):
    from vlmrun.tiny import MASSIVE_FIRST

    res = _residuals(massive_model, teacher["embeds"])
    ids = teacher["prepared"].input_ids[0]
    toks = massive_model.tokenizer.decode_batch([[int(i)] for i in ids], skip_special_tokens=False)
    row_max = np.abs(res).max(-1)[:, : len(ids)]  # [layers, T] over the prompt rows
    big = row_max > 256
    print("\n[fp16] max |x| of the residual stream per layer: "
          + ", ".join(f"layer {i} {m:.0f}" for i, m in enumerate(np.abs(res).max(axis=(1, 2)))))
    print("[fp16] rows above 256 after layer 0: "
          + ", ".join(f"{toks[i]!r}@{i} {row_max[0, i]:.0f}" for i in np.flatnonzero(big[0])))
    assert ids.shape[0] > 0 and big[0, 0], "the first token carries massive activations"
    marked = [i for i in np.flatnonzero(big[0])]
    assert all(toks[i] in ("<|im_start|>", "<|im_end|>", "\n", ".", ".\n", "<|endoftext|>") for i in marked), marked
    assert len(marked) >= 5 and (big == big[0]).all()  # set in layer 0, carried through every later layer
    assert 500 < row_max.max() < 1.5 * max(abs(v) for v in MASSIVE_FIRST)
    assert np.median(row_max[:, ~big[0]]) < 20  # every other row is ordinary
    assert (np.sort(np.abs(res[0, marked]), -1)[:, -4] < 20).all()  # "a few channels": at most 3 per row
    # the fp32 model stays sane: finite logits that depend on the context
    logits = teacher["logits"][0]
    assert np.isfinite(logits).all() and len(set(teacher["tokens"])) >= 5


def test_safe_rms_norm_equals_plain_in_fp32_and_avoids_fp16_overflow(massive_model, teacher):
    import torch

    from vlmrun_ort_reference.onnx_export import safe_rms_norm

    norm = massive_model.load_torch().model.language_model.layers[1].input_layernorm
    x = torch.from_numpy(_residuals(massive_model, teacher["embeds"])[0])  # layer 1's input: massive rows
    with torch.no_grad():
        plain, safe = norm(x), safe_rms_norm(x, norm.weight, norm.variance_epsilon)
        fp16_plain = x.half().pow(2).mean(-1)  # what an fp16 device computes first in the plain form
        fp16_safe = safe_rms_norm(x.half(), norm.weight.half(), norm.variance_epsilon).float()
    rel = float((safe - plain).abs().max() / plain.abs().max())
    err16 = float((fp16_safe - plain).abs().max())
    print(f"\n[fp16] safe vs plain RMSNorm in fp32: max rel diff {rel:.1e}; fp16 mean(x^2) overflows on"
          f" {int(torch.isinf(fp16_plain).sum())} rows, the safe form in fp16: max abs err {err16:.3f}")
    assert rel < 1e-6
    assert torch.isinf(fp16_plain).any()
    assert torch.isfinite(fp16_safe).all() and err16 < 0.05 * float(plain.abs().max())
    zero = safe_rms_norm(torch.zeros(1, 3, x.shape[-1]), norm.weight, norm.variance_epsilon)
    assert torch.equal(zero, torch.zeros_like(zero))  # padding rows: 0, not NaN


def test_safe_export_equals_reference_in_fp32(massive_model, teacher, store, registry):
    """The fixed-KV graph with the safe RMSNorm, run on ONNX Runtime's CPU (fp32), gives the reference logits."""
    import onnxruntime as ort

    from vlmrun.pipeline import export_artifact
    from vlmrun_qnn_htp.decoder import FixedKVDecoder

    class Cpu:
        def __init__(self, path):
            self.s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
            self.names = [o.name for o in self.s.get_outputs()]

        def run(self, feeds):
            return dict(zip(self.names, self.s.run(None, feeds)))

    graphs = {ar: Cpu(export_artifact(registry, store, massive_model, ExportForm.of(
        "decoder", "decoder/fixed", ar=ar, ctx=DECODER["context_length"], rmsnorm="safe")).file())
        for ar in (DECODER["prefill_ar"], 1)}
    logits = FixedKVDecoder(graphs, DECODER["context_length"], massive_model).forward_all(teacher["embeds"])
    m = tensor_metrics(teacher["logits"], logits)
    print(f"\n[fp16] safe decoder/fixed on ORT CPU fp32 vs reference: SQNR {m['sqnr_db']:.1f} dB,"
          f" max abs {m['max_abs']:.1e}")
    assert m["sqnr_db"] >= 100 and m["max_abs"] < 1e-4


def _decoder_pipe(model, store, registry, **opts):
    stages = {s: StageAssignment("ort_reference") for s in STAGES}
    stages["decoder"] = StageAssignment("qnn_htp", {**DECODER, **opts})
    return Pipeline.build(model, Layout("fp16-safety", stages), store=store, registry=registry, stages=("decoder",))


@pytest.mark.parametrize("engine", ["host", "genie"])  # decoder/fixed and decoder/genie (its host loop)
def test_fp16_htp_decoder_needs_the_safe_rmsnorm(engine, massive_model, teacher, store, registry):
    ref = teacher["logits"]
    found = {}
    for norm in ("safe", "plain"):
        t0 = time.perf_counter()
        pipe = _decoder_pipe(massive_model, store, registry, rmsnorm=norm, engine=engine)
        forms = {a.manifest["source_form"] for a in pipe.handles["decoder"].artifacts}
        assert all(f"rmsnorm={norm}" in f for f in forms), forms
        logits = pipe.run_stage("decoder", {"inputs_embeds": teacher["embeds"]})["logits"]
        m = tensor_metrics(ref, logits)
        steps = logits_steps(ref, logits)
        m.update(nonfinite=int((~np.isfinite(logits)).sum()), top1=float(np.mean(steps["top1"])),
                 kl=float(np.mean(steps["kl"])), s=time.perf_counter() - t0)
        found[norm] = m
        print(f"\n[fp16] {engine} rmsnorm={norm}: inf/NaN {m['nonfinite']}, logits SQNR {m['sqnr_db']:.1f} dB,"
              f" cosine {m['cosine']:.4f}, max |err| {m['max_abs']:.3f} (max |ref| {np.abs(ref).max():.3f}),"
              f" top-1 {m['top1']:.3f}, KL {m['kl']:.1e} over {ref.shape[1]} teacher-forced rows ({m['s']:.1f} s)")
    safe, plain = found["safe"], found["plain"]
    assert safe["nonfinite"] == 0
    assert safe["sqnr_db"] >= FP16["sqnr_db"] and safe["cosine"] >= FP16["cosine"]
    assert safe["top1"] >= FP16["top1_agreement"] and safe["kl"] <= FP16["kl_mean"]
    # without the fix: inf/NaN, or far outside the tolerance
    far_off = plain["sqnr_db"] < FP16["sqnr_db"] - 20 and plain["top1"] < FP16["top1_agreement"]
    assert plain["nonfinite"] > 0 or far_off


def test_vision_tower_norms_are_fp16_safe_on_the_htp(massive_model, massive_ref, store, registry, tmp_path):
    """FastViTHD's norms: BatchNorms fold into the convs (no squares) and LayerNorm2d exports as one
    LayerNormalization node, which the HTP computes without overflow at |x| up to 60000; no hand-written square
    (Pow) is left in the vision graph. So the vision tower needs no change."""
    import onnx
    import timm.layers
    import torch

    from vlmrun.pipeline import export_artifact
    from vlmrun_qnn_htp import ep
    from vlmrun_qualcomm import socs

    ops = [n.op_type for n in onnx.load(str(export_artifact(registry, store, massive_model,
                                                              ExportForm.of("vision")).file())).graph.node]
    assert "LayerNormalization" in ops and "Pow" not in ops and "BatchNormalization" not in ops
    torch.manual_seed(0)
    C = 128
    norm = timm.layers.LayerNorm2d(C).eval()
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(C))
        norm.bias.copy_(0.1 * torch.randn(C))
    x = torch.randn(1, C, 4, 4)
    for i, v in enumerate((1000.0, -3000.0, 20000.0, 60000.0)):  # one massive channel per position
        x[0, 3 + i, i, i] = v
    src = tmp_path / "ln.onnx"
    torch.onnx.export(norm, (x,), str(src), input_names=["x"], output_names=["y"], opset_version=17, dynamo=False)
    (tmp_path / "bin").mkdir()
    info = ep.compile_onnx(src, tmp_path / "bin", "ln", socs.soc(None), "LayerNorm2d")
    session = ep.HtpSession(next(tmp_path / "bin" / f for f in info["files"] if f.endswith(".onnx")),
                            socs.soc(None), "LayerNorm2d")
    got = session.run({"x": x.numpy()})["y"]
    with torch.no_grad():
        want = norm(x).numpy()
    err = float(np.abs(got - want).max())
    print(f"\n[fp16] HTP LayerNorm2d with channels at 1e3..6e4: max abs err {err:.4f} (max |y| {np.abs(want).max():.2f})")
    assert np.isfinite(got).all() and err < 0.02
