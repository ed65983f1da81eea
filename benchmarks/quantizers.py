"""qnn_htp's quantization recipes side by side: accuracy against the reference, bytes on the device, cost.

    .venv/bin/python benchmarks/quantizers.py [--items 12] [--steps 6] [--recipes NAME,...] [--adaround-iterations 500]
        [--full-size] [--cache-dir DIR] [--table]

Recipes (``--recipes``, default all): the decoder in the parts form (one part, ``weight_sharing = "off"`` so the
emulator runs it; context 256, AR-32), ``ort-w8a16``, ``ort-w4a16`` (onnxruntime per-channel min-max: vlmrun's
default), ``aimet-w8a16``, ``aimet-w4a16`` (AIMET per-channel min-max), ``aimet-seqmse-w4a16``,
``aimet-adaround-w4a16``, ``aimet-lpbq64-w4a16``, ``aimet-lpbq32-w4a16``, ``aimet-lpbq16-w4a16``; the vision stage,
``ort-vision-int8``, ``ort-vision-a16w8``, ``aimet-vision-int8``, ``aimet-vision-a16w8`` (calibrated on
``--calibration-pictures`` generated training pictures; 0: vlmrun's default, seeded random pixels).

Per recipe, over ``--items`` held-out generated pictures (``vlmrun.shapes`` held-out seed: not the calibration's demo
image and prompts), each the reference's prompt plus ``--steps`` teacher-forced reference tokens, rows pooled:
logits SQNR, top-1 agreement, top-5 overlap and mean KL(reference || device) of the decoder; image_features SQNR of
the vision stage; eval accuracy (greedy answers equal to the picture's answer, as ``vlmrun eval`` scores them) of
the layout and of the reference; bytes on the device (the ``.bin`` files), quantize seconds and the compile's peak
RSS (each recipe compiles and measures in its own child process).

``--full-size``: FastVLM-0.5B dimensions with random weights (``benchmarks/npu_decoder.py --full-size`` builds it);
per decoder recipe (default ``ort-w4a16,aimet-lpbq64-w4a16``) bytes on the device, bytes over one copy of the
weights, compile wall seconds and peak RSS, through ``npu_decoder.py --sizes-only`` (weight-shared parts: the phone
form). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import children  # benchmarks/children.py: a measured child process

os.environ.setdefault("HF_HUB_OFFLINE", "1")
HERE = Path(__file__).resolve().parent
CTX, AR = 256, 32

DECODER = {
    "ort-w8a16": {"precision": "w8a16"},
    "ort-w4a16": {"precision": "w4a16"},
    "aimet-w8a16": {"precision": "w8a16", "quantizer": "aimet"},
    "aimet-w4a16": {"precision": "w4a16", "quantizer": "aimet", "weight_scheme": "per_channel"},
    "aimet-seqmse-w4a16": {"precision": "w4a16", "quantizer": "aimet", "weight_scheme": "per_channel",
                           "algorithm": "seq_mse"},
    "aimet-adaround-w4a16": {"precision": "w4a16", "quantizer": "aimet", "weight_scheme": "per_channel",
                             "algorithm": "adaround"},
    "aimet-lpbq64-w4a16": {"precision": "w4a16", "quantizer": "aimet", "block_size": 64},
    "aimet-lpbq32-w4a16": {"precision": "w4a16", "quantizer": "aimet", "block_size": 32},
    "aimet-lpbq16-w4a16": {"precision": "w4a16", "quantizer": "aimet", "block_size": 16},
}
VISION = {
    "ort-vision-int8": {"precision": "int8"},
    "ort-vision-a16w8": {"precision": "a16w8"},
    "aimet-vision-int8": {"precision": "int8", "quantizer": "aimet"},
    "aimet-vision-a16w8": {"precision": "a16w8", "quantizer": "aimet"},
}


def sqnr(ref, dev) -> float:
    import numpy as np

    ref, dev = np.asarray(ref, np.float64), np.asarray(dev, np.float64)
    return round(float(10 * np.log10((ref ** 2).sum() / max(((ref - dev) ** 2).sum(), 1e-30))), 2)


def logit_metrics(ref, dev) -> dict:
    import numpy as np

    ref, dev = np.asarray(ref, np.float64), np.asarray(dev, np.float64)

    def log_softmax(x):
        x = x - x.max(-1, keepdims=True)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    lp, lq = log_softmax(ref), log_softmax(dev)
    top5 = [len(set(np.argsort(-r)[:5]) & set(np.argsort(-d)[:5])) / 5 for r, d in zip(ref, dev)]
    return {"logits_sqnr_db": sqnr(ref, dev), "top1": round(float((ref.argmax(-1) == dev.argmax(-1)).mean()), 4),
            "top5_overlap": round(float(np.mean(top5)), 4),
            "kl_mean": round(float((np.exp(lp) * (lp - lq)).sum(-1).mean()), 5), "rows": int(len(ref))}


# -- child: one recipe -------------------------------------------------------------------------------------------
def child(spec: dict) -> dict:
    import numpy as np

    from vlmrun import GenerationSettings, Pipeline
    from vlmrun.eval.answers import is_correct
    from vlmrun.layouts import Layout, StageAssignment
    from vlmrun.model import default_model
    from vlmrun.shapes import HELDOUT_SEED, items, render
    from vlmrun.stages import STAGES
    from vlmrun.store import ArtifactStore

    store = ArtifactStore(spec["cache_dir"])
    model = default_model(store, 256)
    stage = "vision" if spec["name"] in VISION else "decoder"
    opts = dict(spec["options"])
    if stage == "vision" and spec.get("calibration_images"):
        opts["calibration_images"] = spec["calibration_images"]
    if stage == "decoder":
        opts.update(decoder_form="parts", parts=1, weight_sharing="off", context_length=CTX, prefill_ar=AR)
        if opts.get("algorithm") == "adaround":
            opts["adaround_iterations"] = spec["adaround_iterations"]
    stages = {s: StageAssignment("ort_reference", {}) for s in STAGES}
    stages[stage] = StageAssignment("qnn_htp", opts)
    ref = Pipeline.build(model, "reference", store=store)
    t0 = time.perf_counter()
    dev = Pipeline.build(model, Layout(spec["name"], stages), store=store)
    build_s = time.perf_counter() - t0
    art = dev.handles[stage].artifacts[0]
    m = art.manifest
    q = m.get("quantization") or {}
    out = {"stage": stage, "options": spec["options"], "build_s": round(build_s, 1),
           "bytes_on_device": sum((m.get("binary_bytes") or {}).values()),
           "quantize_s": q.get("quantize_s"), "recipe": q.get("recipe"), "stored_weights": (q.get("stored") or {}
                                                                                             ).get("weights")}
    it = items(HELDOUT_SEED)
    refs, devs, feats_r, feats_d, correct, ref_correct = [], [], [], [], 0, 0
    settings = GenerationSettings(max_new_tokens=24)
    for _ in range(spec["items"]):
        item = next(it)
        image = render(item.scene)
        prepared = ref.prepare(image, item.question)
        if stage == "vision":
            feats_r.append(ref.run_stage("vision", {"pixel_values": prepared.pixel_values})["image_features"])
            feats_d.append(dev.run_stage("vision", {"pixel_values": prepared.pixel_values})["image_features"])
        else:
            gen = ref.generate(image, item.question, GenerationSettings(max_new_tokens=spec["steps"],
                                                                         ignore_eos=True)).run()
            emb = ref.embed_prompt(prepared)
            full = np.concatenate([emb, ref.embed_tokens(np.asarray(gen.token_ids))], axis=1)
            T, n = emb.shape[1], spec["steps"]
            refs.append(ref.run_stage("decoder", {"inputs_embeds": full})["logits"][0, T - 1: T - 1 + n])
            devs.append(dev.run_stage("decoder", {"inputs_embeds": full})["logits"][0, T - 1: T - 1 + n])
        correct += is_correct(dev.generate(image, item.question, settings).run().text, item.answer)
        ref_correct += is_correct(ref.generate(image, item.question, settings).run().text, item.answer)
    if stage == "vision":
        out["image_features_sqnr_db"] = sqnr(np.concatenate(feats_r), np.concatenate(feats_d))
    else:
        out.update(logit_metrics(np.concatenate(refs), np.concatenate(devs)))
    out.update(items=spec["items"], eval_accuracy=round(correct / spec["items"], 4),
               reference_accuracy=round(ref_correct / spec["items"], 4))
    return out


def run_child(spec: dict, log) -> dict:
    return children.run_child([__file__, "--child", json.dumps(spec)], log, rss_key="peak_rss_mb")


def full_size(names: list[str], args) -> dict:
    """Bytes and compile cost at FastVLM-0.5B dimensions, one recipe at a time (npu_decoder.py --sizes-only)."""
    out = {}
    for name in names:
        if name not in DECODER:
            raise SystemExit(f"--full-size measures decoder recipes; {name} is not one")
        opts = [f"--decoder-option={k}={v}" for k, v in DECODER[name].items() if k != "precision"]
        cmd = [sys.executable, str(HERE / "npu_decoder.py"), "--full-size", "--sizes-only", "--no-fixed",
               "--precisions", DECODER[name]["precision"], "--cache-dir", args.cache_dir, *opts]
        print(f"[quantizers] full size {name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            out[name] = {"failed": True, "stderr": r.stderr[-2000:]}
            continue
        res = json.loads(r.stdout)
        c = res["forms"][f"parts-{DECODER[name]['precision']}"]["compile"]
        out[name] = {k: c.get(k) for k in ("parts", "total_bytes", "weight_bytes", "bytes_over_weights",
                                           "compile_wall_s", "quantize_s", "child_wall_s", "child_peak_rss_mb",
                                           "failed")}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=12, help="held-out pictures")
    ap.add_argument("--steps", type=int, default=6, help="teacher-forced reference tokens per picture")
    ap.add_argument("--recipes", default=None, help="comma-separated recipe names (default: all; --full-size:"
                                                    " ort-w4a16,aimet-lpbq64-w4a16)")
    ap.add_argument("--adaround-iterations", type=int, default=500,
                    help="AdaRound steps per layer (AIMET recommends 10-15k; 500 keeps this benchmark affordable)")
    ap.add_argument("--calibration-pictures", type=int, default=16,
                    help="vision recipes calibrate on this many generated training pictures (0: vlmrun's default,"
                         " seeded random pixels)")
    ap.add_argument("--full-size", action="store_true", help="FastVLM-0.5B dimensions: bytes and compile cost")
    ap.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "vlmrun-bench"))
    ap.add_argument("--table", action="store_true", help="also print a markdown table on stderr")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        real_out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)  # native banners go to stderr; the result line has its own fd
        real_out.write(json.dumps(child(json.loads(args.child))) + "\n")
        real_out.flush()
        return
    if args.full_size:
        names = (args.recipes or "ort-w4a16,aimet-lpbq64-w4a16").split(",")
        print(json.dumps({"model": "FastVLM-0.5B dims (random weights)", "recipes": full_size(names, args)},
                         indent=1))
        return
    names = args.recipes.split(",") if args.recipes else [*DECODER, *VISION]
    unknown = [n for n in names if n not in DECODER and n not in VISION]
    if unknown:
        raise SystemExit(f"unknown recipe(s) {', '.join(unknown)}; known: {', '.join([*DECODER, *VISION])}")
    from vlmrun_qnn_htp import ep

    calib = None
    if args.calibration_pictures:
        from vlmrun.shapes import TRAIN_SEED, write_dataset

        calib = Path(args.cache_dir) / f"calibration-pictures-{args.calibration_pictures}"
        if not (calib / "data.jsonl").exists():
            write_dataset(calib, args.calibration_pictures, seed=TRAIN_SEED)
        calib = str(calib / "images")
    result = {"model": "tiny default (shapes-tiny)", "items": args.items, "steps": args.steps,
              "vision_calibration": f"{args.calibration_pictures} generated training pictures" if calib else "random",
              "versions": ep.versions(), "recipes": {}}
    log_path = Path(args.cache_dir) / "quantizers-children.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as log:
        for name in names:
            spec = {"name": name, "options": {**DECODER, **VISION}[name], "cache_dir": args.cache_dir,
                    "items": args.items, "steps": args.steps, "adaround_iterations": args.adaround_iterations,
                    "calibration_images": calib}
            r = run_child(spec, log)
            print(f"[quantizers] {name}: {json.dumps(r)}", file=sys.stderr, flush=True)
            result["recipes"][name] = r
    result["log"] = str(log_path)
    print(json.dumps(result, indent=1))
    if args.table:
        print(table(result), file=sys.stderr)


def table(result: dict) -> str:
    rows = ["| recipe | logits / features SQNR | top-1 | top-5 | KL | eval acc (ref) | bytes | quantize s | peak RSS MB |",
            "|---|---|---|---|---|---|---|---|---|"]
    for name, r in result["recipes"].items():
        if r.get("failed"):
            rows.append(f"| {name} | failed | | | | | | | |")
            continue
        s = r.get("logits_sqnr_db", r.get("image_features_sqnr_db"))
        rows.append(f"| {name} | {s} dB | {r.get('top1', '')} | {r.get('top5_overlap', '')} | {r.get('kl_mean', '')}"
                    f" | {r['eval_accuracy']} ({r['reference_accuracy']}) | {r['bytes_on_device']} |"
                    f" {r['quantize_s']} | {r['peak_rss_mb']} |")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
