"""The reference decoder part by part at a FastVLM family size: memory and time per step, each step in its own process.

    .venv/bin/python benchmarks/reference_parts.py --size 0.5b --parts 3 --diff --work /tmp/rp05
    VLMRUN_MEMORY_BUDGET_GB=14 .venv/bin/python benchmarks/reference_parts.py --size 7b --parts 0 --work /tmp/rp7

Steps (issue 32, "reference at size"): ``make-tiny`` (random weights, every vocabulary row drawn, Apple's sharded
bf16 layout), ``open`` (its conversion into the store, shard for shard; the Apple folder is then removed, so that a
7B run holds the converted checkpoint and the part graphs on disk, not a third copy), ``export`` (every stage the
reference layout with ``-o decoder.parts=PARTS`` runs: the vision tower, the projector, the embedding table and the
decoder's part graphs of any rows, each part from its own weights only), ``answer`` (the demo image and prompt, from
the store: ``--tokens`` greedy tokens, end of sequence ignored; the decoder opens one part's session at a time unless
they all fit the memory allowed) and, with ``--diff``, ``diff`` (the whole reference against the reference in parts,
teacher-forced logits and free-running tokens: only where the whole float32 decoder fits in memory, 0.5B here).
Each step's peak RSS is its own (``os.wait4``). Prints one JSON object; ``--keep`` keeps ``--work``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

import children  # benchmarks/children.py: a measured child process

os.environ.setdefault("HF_HUB_OFFLINE", "1")
PROMPT = "Describe the image."


def _native(work: Path) -> Path:
    return Path((work / "native.txt").read_text().strip())


def _layout(args) -> str:
    return f"reference,decoder.parts={args.parts}"


def run_step(step: str, work: Path, args) -> dict:
    """One step, in this process; what it measured."""
    from vlmrun import GenerationSettings, Pipeline
    from vlmrun.model import FastVLMModel
    from vlmrun.store import ArtifactStore

    store = ArtifactStore(work / "store")
    if step == "make-tiny":
        from vlmrun.family import write_random_apple

        write_random_apple(work / "apple", args.size, image_size=args.image_size, dense_vocab=True)
        return {"bytes": _bytes(work / "apple")}
    if step == "open":
        model = FastVLMModel.open(work / "apple", store)
        (work / "native.txt").write_text(str(model.path))
        return {"bytes": _bytes(model.path), "streams": model.streams}
    model = FastVLMModel.open(_native(work), store)
    if step == "export":
        t0 = time.perf_counter()
        pipe = Pipeline.build(model, _layout(args), store=store)
        dec = pipe.handles["decoder"]
        return {"build_s": round(time.perf_counter() - t0, 1), "layers": [list(x) for x in dec.layers],
                "context_length": dec.context_length, "store_bytes": _bytes(work / "store" / "artifacts")}
    if step == "answer":
        from vlmrun.demo_image import demo_image

        t0 = time.perf_counter()
        pipe = Pipeline.build(model, _layout(args), store=store)
        load_s = time.perf_counter() - t0
        dec = pipe.handles["decoder"]
        g = pipe.generate(demo_image(), PROMPT, GenerationSettings(max_new_tokens=args.tokens, ignore_eos=True)).run()
        t, n = g.timings, len(g.token_ids)
        return {"load_s": round(load_s, 1), "prompt_tokens": int(g.prepared.input_ids.shape[1]),
                "ttft_s": round(t["ttft_ms"] / 1e3, 1),
                "s_per_token": round(t["decode_ms"] / 1e3 / (n - 1), 2) if n > 1 else None,
                "token_ids": g.token_ids, "sessions_opened": dec.graphs.opened, "sessions_kept": dec.graphs.keep,
                "kv_bytes": dec.new_state().nbytes}
    if step == "diff":
        from vlmrun import diff

        run = diff.run("reference", _layout(args), model=model, store=store, max_new_tokens=args.tokens,
                       ignore_eos=True)
        data = run.result.to_json()
        logits = next(c for c in data["checkpoints"] if c["tensor"] == "logits")
        return {"passed": data["passed"], "logits": {k: logits["metrics"].get(k) for k in
                                                       ("max_abs", "cosine", "sqnr_db")},
                "teacher_forced_top1": min(data["steps"]["top1"]), "kl_max": max(data["steps"]["kl"]),
                "same_tokens": data["steps"]["ref_argmax"] == data["steps"]["dev_argmax"], "notes": data["notes"]}
    raise SystemExit(f"unknown step {step}")


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _child(step: str, args) -> dict:
    """Run ``step`` in a child process (`children.run_step`); its wall time, peak RSS and what it reports."""
    return children.run_step([__file__, "--child", step, "--size", args.size, "--work", str(args.work), "--parts",
                              str(args.parts), "--tokens", str(args.tokens), "--image-size", str(args.image_size)],
                             step)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="0.5b")
    ap.add_argument("--parts", type=int, default=0, help="-o decoder.parts (0: planned from the memory budget)")
    ap.add_argument("--tokens", type=int, default=4)
    ap.add_argument("--image-size", type=int, default=1024)
    ap.add_argument("--diff", action="store_true", help="also diff the whole reference against the one in parts")
    ap.add_argument("--only", default="", help="comma-separated steps over a --keep work folder")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run_step(args.child, args.work, args)))
        return 0
    steps = ["make-tiny", "open", "export", "answer", *(["diff"] if args.diff else [])]
    if args.only:
        steps = [s for s in steps if s in args.only.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)
    report = {"size": args.size, "parts": args.parts, "tokens": args.tokens,
              "memory_budget_gb": os.environ.get("VLMRUN_MEMORY_BUDGET_GB"), "steps": {}}
    peak_disk = 0
    try:
        for step in steps:
            report["steps"][step] = _child(step, args)
            print(f"{step}: {report['steps'][step]}", file=sys.stderr, flush=True)
            peak_disk = max(peak_disk, _bytes(args.work))
            if step == "open" and not args.keep:  # the conversion is what the rest reads
                shutil.rmtree(args.work / "apple", ignore_errors=True)
        report["peak_disk_gb"] = round(peak_disk / 1e9, 2)
    finally:
        if not args.keep and not args.only:
            shutil.rmtree(args.work, ignore_errors=True)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
