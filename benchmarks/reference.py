"""Benchmark the reference layout against a bare onnxruntime loop and torch eager ``generate``.

    .venv/bin/python benchmarks/reference.py [--full-size] [--tokens 32] [--image-size 1024]

Each engine runs in its own subprocess (so peak RSS is its own) on the same model, image, prompt and ONNX
files, greedy, EOS ignored, after ``--warmup`` untimed runs (the first run pages in weights and grows arenas). Prints one JSON object: per-engine time to first token, tokens/s, per-stage
latency (median of --repeats runs) and peak RSS, plus the ratios the README reports.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROMPT = "Describe the image in detail."


def _pipe(args):
    from vlmrun import Pipeline
    from vlmrun.model import FastVLMModel
    from vlmrun.store import ArtifactStore

    store = ArtifactStore(args.cache_dir)
    model = FastVLMModel.open(args.model) if args.model else None
    return Pipeline.build(model, "reference", store=store, image_size=args.image_size)


def _image(args):
    from vlmrun.demo_image import demo_image

    return demo_image()


def run_vlmrun(args) -> dict:
    from vlmrun import GenerationSettings

    pipe = _pipe(args)
    image = _image(args)
    runs = []
    for i in range(args.warmup + args.repeats):
        gen = pipe.generate(image, PROMPT, GenerationSettings(max_new_tokens=args.tokens, ignore_eos=True)).run()
        if i >= args.warmup:
            runs.append(gen.timings)
    return _summarise(runs, gen.token_ids)


def run_bare(args) -> dict:
    """The same ONNX files driven by a plain onnxruntime loop (no vlmrun runtime in the timed path)."""
    import numpy as np
    import onnxruntime as ort

    pipe = _pipe(args)  # only to locate the exported files and prepare identical inputs
    prepared = pipe.prepare(_image(args), PROMPT)
    files = {s: pipe.store.lookup(_key(pipe, s)).file() for s in ("vision", "projector", "embed", "decoder")}
    lut = np.load(pipe.store.lookup(_key(pipe, "embed", "embed/lut")).file("embed_lut_f32.npy"))
    del pipe
    opts = ort.SessionOptions()
    sess = {s: ort.InferenceSession(str(f), opts, providers=["CPUExecutionProvider"]) for s, f in files.items()}
    dec = sess["decoder"]
    past_names = [i.name for i in dec.get_inputs() if i.name.startswith("past_")]
    kv = dec.get_inputs()[3].shape[1]
    hd = dec.get_inputs()[3].shape[3]
    runs = []
    for rep in range(args.warmup + args.repeats):
        t = {}
        t0 = time.perf_counter()
        (feats,) = sess["vision"].run(None, {"pixel_values": prepared.pixel_values})
        t1 = time.perf_counter()
        (img,) = sess["projector"].run(None, {"image_features": feats})
        t2 = time.perf_counter()
        (txt,) = sess["embed"].run(None, {"input_ids": prepared.input_ids})
        t3 = time.perf_counter()
        t.update(vision_ms=(t1 - t0) * 1e3, projector_ms=(t2 - t1) * 1e3, embed_ms=(t3 - t2) * 1e3)
        emb = txt.copy()
        emb[:, prepared.image_start : prepared.image_start + img.shape[1]] = img
        past = {n: np.zeros((1, kv, 0, hd), np.float32) for n in past_names}
        n_past, tokens = 0, []
        start = time.perf_counter()
        x = emb
        for i in range(args.tokens):
            T = x.shape[1]
            outs = dec.run(None, {"inputs_embeds": x, "attention_mask": np.ones((1, n_past + T), np.int64),
                                  "position_ids": np.arange(n_past, n_past + T, dtype=np.int64)[None], **past})
            tok = int(np.argmax(outs[0][0, -1]))
            tokens.append(tok)
            now = time.perf_counter()
            if i == 0:
                first = now
            past = dict(zip(past_names, outs[1:]))
            n_past += T
            x = lut[[tok]][None]
        last = now
        t.update(ttft_ms=(first - start) * 1e3, tokens_per_s=(len(tokens) - 1) / (last - first),
                 prompt_tokens=emb.shape[1], new_tokens=len(tokens))
        if rep >= args.warmup:
            runs.append(t)
    return _summarise(runs, tokens)


def _key(pipe, stage, kind=None):
    from vlmrun.stages import ExportForm

    forms = {"vision": "vision", "projector": "projector", "embed": "embed", "decoder": "decoder/kv"}
    form = ExportForm.of(stage, kind or forms[stage])
    versions = {p.name: p.version for p in pipe.registry.plugins.values() if "export" in p.hooks}
    return {"stage": stage, "backend": "onnx", "kind": form.label(), "weights": pipe.model.weights_hash(pipe.store),
            "versions": versions}


def run_torch(args) -> dict:
    import torch
    from transformers.generation.streamers import BaseStreamer

    from vlmrun.torch_stages import project, vision_features

    pipe = _pipe(args)
    prepared = pipe.prepare(_image(args), PROMPT)
    model = pipe.model.load_torch()
    torch.set_num_threads(os.cpu_count() or 1)

    class Clock(BaseStreamer):
        def __init__(self):
            self.times = []

        def put(self, value):
            self.times.append(time.perf_counter())

        def end(self):
            pass

    ids = torch.from_numpy(prepared.input_ids)
    pv = torch.from_numpy(prepared.pixel_values)
    runs = []
    for rep in range(args.warmup + args.repeats):
        with torch.no_grad():
            t0 = time.perf_counter()
            feats = vision_features(model, pv)
            t1 = time.perf_counter()
            project(model, feats)
            t2 = time.perf_counter()
            clock = Clock()
            start = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), pixel_values=pv,
                                 max_new_tokens=args.tokens, min_new_tokens=args.tokens, do_sample=False,
                                 eos_token_id=None, pad_token_id=0, streamer=clock)
        ts = clock.times[1:]  # the first put() is the prompt
        if rep < args.warmup:
            continue
        runs.append({"vision_ms": (t1 - t0) * 1e3, "projector_ms": (t2 - t1) * 1e3,
                     "ttft_ms": (ts[0] - start) * 1e3, "tokens_per_s": (len(ts) - 1) / (ts[-1] - ts[0]),
                     "prompt_tokens": ids.shape[1], "new_tokens": len(ts)})
    return _summarise(runs, out[0, ids.shape[1]:].tolist())


def _summarise(runs, tokens) -> dict:
    keys = [k for k in runs[0] if isinstance(runs[0][k], (int, float))]
    out = {k: round(statistics.median(r[k] for r in runs), 3) for k in keys}
    out["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)
    out["tokens"] = list(tokens)
    return out


ENGINES = {"vlmrun": run_vlmrun, "bare_ort": run_bare, "torch_eager": run_torch}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full-size", action="store_true", help="FastVLM-0.5B dimensions, random weights")
    ap.add_argument("--model", help="a FastVLM checkpoint directory instead of the generated one")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1, help="untimed runs first (page-in, arena growth)")
    ap.add_argument("--image-size", type=int, default=1024)
    ap.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "vlmrun-bench"))
    ap.add_argument("--engine", choices=sorted(ENGINES), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        print(json.dumps(ENGINES[args.engine](args)))
        return
    if args.full_size and not args.model:
        from vlmrun.tiny import make_tiny

        args.model = os.path.join(args.cache_dir, "full-size-fastvlm")
        if not os.path.isfile(os.path.join(args.model, "config.json")):
            print("building the full-size random FastVLM (once) ...", file=sys.stderr)
            make_tiny(args.model, image_size=args.image_size, full_size=True)
    base = [sys.executable, __file__, "--tokens", str(args.tokens), "--repeats", str(args.repeats),
            "--warmup", str(args.warmup),
            "--image-size", str(args.image_size), "--cache-dir", args.cache_dir]
    if args.model:
        base += ["--model", args.model]
    # export once (vlmrun run), so the other engines find the files
    results = {}
    for engine in ("vlmrun", "bare_ort", "torch_eager"):
        print(f"running {engine} ...", file=sys.stderr)
        res = subprocess.run([*base, "--engine", engine], capture_output=True, text=True)
        if res.returncode != 0:
            results[engine] = {"error": res.stderr.strip().splitlines()[-1:]}
            continue
        results[engine] = json.loads(res.stdout.strip().splitlines()[-1])
    v, b, t = (results.get(k, {}) for k in ("vlmrun", "bare_ort", "torch_eager"))
    report = {
        "model": "full-size (FastVLM-0.5B dims, random)" if args.full_size else (args.model or "tiny"),
        "image_size": args.image_size,
        "new_tokens": args.tokens,
        "engines": {k: {kk: vv for kk, vv in r.items() if kk != "tokens"} for k, r in results.items()},
        "same_tokens": {"vlmrun_vs_bare": v.get("tokens") == b.get("tokens"),
                        "vlmrun_vs_torch": v.get("tokens") == t.get("tokens")},
    }
    if "tokens_per_s" in v and "tokens_per_s" in b:
        report["vlmrun_overhead_tokens_per_s_pct"] = round(100 * (1 - v["tokens_per_s"] / b["tokens_per_s"]), 2)
    if "tokens_per_s" in v and "tokens_per_s" in t:
        report["reference_vs_torch_tokens_per_s"] = round(v["tokens_per_s"] / t["tokens_per_s"], 2)
        report["reference_vs_torch_ttft"] = round(t["ttft_ms"] / v["ttft_ms"], 2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
