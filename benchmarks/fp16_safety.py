"""fp16 safety of the qnn_htp decoder with planted massive activations: the fp16-safe RMSNorm against the plain one.

    .venv/bin/python benchmarks/fp16_safety.py [--full-size] [--image-size 256] [--no-massive-activations]
        [--context-length N] [--prefill-ar N] [--engine host|genie] [--rmsnorm safe,plain] [--tokens 10]

Builds (once, into the cache directory) a random FastVLM with ``make-tiny --massive-activations`` (tiny, or the
FastVLM-0.5B dimensions with ``--full-size``), measures the residual stream of the torch model (max |x| per layer,
the rows above fp16's squaring limit of 256), then compiles the decoder for qnn_htp at fp16 with each RMSNorm
and runs it under teacher forcing (the demo prompt plus the reference's greedy tokens) on the local HTP (the
v79 emulator here). Per RMSNorm: inf/NaN counts in the logits and in every KV output, logits SQNR / cosine / max
|error| against the reference (ort_reference, fp32), top-1 agreement and KL. Prints one JSON object. Goal at full
size: no inf/NaN anywhere and logits SQNR >= 30 dB with the safe RMSNorm.

Measured on the v79 emulator (onnxruntime-qnn 2.7.0, 256x256, "Describe the image." + 10 tokens = 78 rows):

============================ ====== ============ ===================== ======== ========= ============
model                        norm   inf/NaN      logits SQNR / cosine  max err  top-1     residual
============================ ====== ============ ===================== ======== ========= ============
tiny, planted                safe   0            46.7 dB / 0.99999     0.0045   78/78     559-2651 on
tiny, planted                plain  0            -0.7 dB / 0.678       2.27     30/78     13 rows
full size, planted           safe   0 (+ KV 0)   24.9 dB / 0.9984      0.19     70/78     624-2781 on
full size, planted           plain  0 (+ KV 0)   -2.0 dB / 0.385       5.29     15/78     13 rows
full size, no outliers       safe   0 (+ KV 0)   23.3 dB / 0.9976      0.23     68/78     max 9.1
============================ ====== ============ ===================== ======== ========= ============

Full size = FastVLM-0.5B dimensions with random weights (max |logit| 2.6). With the safe RMSNorm the planted
outliers cost nothing: the model without them sits at the same fp16 level (23-25 dB), below the 30 dB goal for
reasons that have nothing to do with RMSNorm (random weights; a trained checkpoint was not available here).

How far 16 bits can get on that model at all (``torch_16bit_cpu``, full size, planted, the same 78 rows;
``--rmsnorm ""`` runs only this part):

=================================================================== ===================== ========
the same rows through                                               logits SQNR / cosine  top-1
=================================================================== ===================== ========
transformers fp32, input times (1 + 1e-3 N(0,1)) (a 60 dB error)    28.4 dB / 0.99927     -
transformers fp16 on the CPU (RMSNorm and softmax upcast to fp32)   30.3 dB / 0.99954     76/78
transformers bf16 on the CPU                                        13.5 dB / 0.9777      56/78
qnn_htp fp16, safe RMSNorm (the table above; everything in fp16)    24.9 dB / 0.9984      70/78
=================================================================== ===================== ========

The random full-size decoder amplifies an input error by about 32 dB over its 24 layers, so transformers' own
fp16 lands right at 30 dB, with fp32 norms and softmax the HTP does not have. On the emulator single fp16 ops
are accurate (MatMul with K up to 4864: 68.9 dB; SiLU 66.3 dB; softmax over 1024: 54.4 dB; RMSNorm 65.5 dB),
so the 24.9 dB is that amplification applied to fp16 everywhere, not a broken op. The trained tiny model, which
does not amplify like this, gets 46-55 dB.
The emulator saturates at 65504 instead of producing inf, so the plain form fails by value, not by inf/NaN.
Full-size figures take about 15 minutes per RMSNorm on a 2-core x86_64 host (export, 2 compiles, emulator run).
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROMPT = "Describe the image."


def residual_stream(model, embeds, tokenizer, ids) -> dict:
    """Max |x| of the residual stream after each decoder layer (torch, fp32) and the rows above 256."""
    import numpy as np
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
    rows = np.stack([s[0].abs().amax(-1).numpy() for s in seen])[:, : len(ids)]  # [layers, prompt rows]
    big = np.flatnonzero(rows[0] > 256)
    toks = tokenizer.decode_batch([[int(i)] for i in ids], skip_special_tokens=False)
    return {
        "max_abs_per_layer": [round(float(v), 1) for v in rows.max(-1)],
        "rows_above_256_after_layer_0": [{"row": int(i), "token": toks[i], "max_abs": round(float(rows[0, i]), 1)}
                                         for i in big],
        "other_rows_max_abs": round(float(np.delete(rows, big, axis=1).max()), 2),
    }


def torch_floor(model, embeds, l_ref, dtypes=("float16", "bfloat16")) -> dict:
    """The same teacher-forced rows through transformers' own decoder in fp16 / bf16 on the CPU (weights and
    matmuls in that type; RMSNorm and softmax upcast to fp32, as transformers computes them): how far the model
    itself is from its fp32 logits when stored and multiplied in 16 bits, whatever the runtime."""
    import copy

    import numpy as np
    import torch

    from vlmrun.diff.metrics import logits_steps, tensor_metrics

    fvlm = model.load_torch()
    out = {}
    # how much the model itself amplifies a small error: the fp32 decoder on the rows times (1 + 1e-3 * N(0,1)),
    # a 60 dB perturbation of the input, measured at the logits
    g = torch.Generator().manual_seed(0)
    x = torch.from_numpy(np.ascontiguousarray(embeds))
    with torch.no_grad():
        lm = fvlm.model.language_model
        noisy = fvlm.lm_head(lm(inputs_embeds=x * (1 + 1e-3 * torch.randn(x.shape, generator=g))).last_hidden_state)
        clean = fvlm.lm_head(lm(inputs_embeds=x).last_hidden_state)
    m = tensor_metrics(clean.numpy(), noisy.numpy())
    out["fp32_input_perturbed_60dB"] = {"sqnr_db": round(m["sqnr_db"], 2), "cosine": round(m["cosine"], 6)}
    for name in dtypes:
        dt = getattr(torch, name)
        lm, head = copy.deepcopy(fvlm.model.language_model).to(dt), copy.deepcopy(fvlm.lm_head).to(dt)
        t0 = time.perf_counter()
        with torch.no_grad():
            hidden = lm(inputs_embeds=torch.from_numpy(np.ascontiguousarray(embeds)).to(dt)).last_hidden_state
            logits = head(hidden).float().numpy()
        m, steps = tensor_metrics(l_ref, logits), logits_steps(l_ref, logits)
        out[name] = {"sqnr_db": round(m["sqnr_db"], 2), "cosine": round(m["cosine"], 6),
                     "max_abs_err": round(m["max_abs"], 4), "top1_agreement": round(float(np.mean(steps["top1"])), 4),
                     "run_s": round(time.perf_counter() - t0, 1)}
        del lm, head
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--full-size", action="store_true", help="FastVLM-0.5B dimensions (random weights, ~2 GB)")
    ap.add_argument("--no-massive-activations", action="store_true", help="the model without planted outliers")
    ap.add_argument("--image-size", type=int, default=256)
    ap.add_argument("--context-length", type=int, default=None, help="default: the prompt + tokens, rounded up")
    ap.add_argument("--prefill-ar", type=int, default=32)
    ap.add_argument("--engine", choices=("host", "genie"), default="host", help="decoder/fixed or decoder/genie")
    ap.add_argument("--rmsnorm", default="safe,plain", help="comma-separated RMSNorm forms to compare")
    ap.add_argument("--tokens", type=int, default=10, help="reference greedy tokens appended (teacher forcing)")
    ap.add_argument("--no-torch-floor", action="store_true",
                    help="skip the same rows through transformers in fp16/bf16 on the CPU (the model's own 16-bit floor)")
    ap.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "vlmrun-bench"))
    args = ap.parse_args()

    import numpy as np

    from vlmrun import GenerationSettings, Pipeline, plugins
    from vlmrun.demo_image import demo_image
    from vlmrun.diff.metrics import logits_steps, tensor_metrics
    from vlmrun.layouts import Layout, StageAssignment
    from vlmrun.model import FastVLMModel
    from vlmrun.stages import STAGES
    from vlmrun.store import ArtifactStore
    from vlmrun.tiny import make_tiny

    massive = not args.no_massive_activations
    name = f"fp16-{'full' if args.full_size else 'tiny'}-{args.image_size}-{'massive' if massive else 'plain'}"
    model_dir = os.path.join(args.cache_dir, name)
    t0 = time.perf_counter()
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        make_tiny(model_dir, image_size=args.image_size, full_size=args.full_size, massive_activations=massive)
    build_s = time.perf_counter() - t0
    store = ArtifactStore(args.cache_dir)
    registry = plugins.load()
    model = FastVLMModel.open(model_dir, store)
    ref = Pipeline.build(model, "reference", store=store, registry=registry)
    image = demo_image()
    prepared = ref.prepare(image, PROMPT)
    settings = GenerationSettings(max_new_tokens=args.tokens, ignore_eos=True)
    tokens = ref.generate(image, PROMPT, settings).run().token_ids
    embeds = np.concatenate([ref.embed_prompt(prepared), ref.embed_tokens(np.asarray(tokens))], axis=1)
    l_ref = ref.run_stage("decoder", {"inputs_embeds": embeds})["logits"]
    ctx = args.context_length or -(-(embeds.shape[1] + 1) // 64) * 64
    result = {"model": name, "model_build_s": round(build_s, 1), "teacher_forced_rows": int(embeds.shape[1]),
              "context_length": ctx, "prefill_ar": args.prefill_ar, "engine": args.engine,
              "residual_stream": residual_stream(model, embeds, model.tokenizer, prepared.input_ids[0]),
              "max_abs_reference_logit": round(float(np.abs(l_ref).max()), 4), "decoder_fp16": {}}
    if not args.no_torch_floor:
        result["torch_16bit_cpu"] = torch_floor(model, embeds, l_ref)
    for norm in [n.strip() for n in args.rmsnorm.split(",") if n.strip()]:
        stages = {s: StageAssignment("ort_reference") for s in STAGES}
        stages["decoder"] = StageAssignment("qnn_htp", {"context_length": ctx, "prefill_ar": args.prefill_ar,
                                                        "engine": args.engine, "rmsnorm": norm})
        t0 = time.perf_counter()
        pipe = Pipeline.build(model, Layout("fp16-safety", stages), store=store, registry=registry,
                              stages=("decoder",))
        build = time.perf_counter() - t0
        t0 = time.perf_counter()
        logits = pipe.run_stage("decoder", {"inputs_embeds": embeds})["logits"]
        run = time.perf_counter() - t0
        host = pipe.handles["decoder"].decoder  # the host loop's KV buffers after the teacher-forced pass
        kv_bad = int(sum((~np.isfinite(t)).sum() for t in (*host.k, *host.v)))
        m = tensor_metrics(l_ref, logits)
        steps = logits_steps(l_ref, logits)
        result["decoder_fp16"][norm] = {
            "logits_nonfinite": int((~np.isfinite(logits)).sum()), "kv_nonfinite": kv_bad,
            "sqnr_db": round(m["sqnr_db"], 2), "cosine": round(m["cosine"], 6), "max_abs_err": round(m["max_abs"], 4),
            "top1_agreement": round(float(np.mean(steps["top1"])), 4), "kl_mean": float(np.mean(steps["kl"])),
            "build_s": round(build, 1), "run_s": round(run, 1),
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
