"""Streamed export of a FastVLM family size: peak memory and wall time per step, each step in its own process.

    .venv/bin/python benchmarks/family.py --size 1.5b --parts 4 --work /tmp/family [--keep]

Steps (issue 32): ``make-tiny --size SIZE --format apple-sharded`` (random weights, bf16 shards in Apple's
layout), opening it (the checkpoint conversion, tensor by tensor, one shard per source shard), the LUT (the
embedding rows alone), the image encoder (``vision/encoder``: the vision tower and projector alone) and each
decoder part of ``decoder/parts`` alone (its layers, + the final norm and lm_head in the last part). Each step
runs in a child process: its peak RSS is its own (``os.wait4``). Prints one JSON object; ``--keep`` keeps what
was written under ``--work`` (removed by default: each part's graphs once the part is measured, so that a 7B run
needs the checkpoint, its conversion and one part on disk, about 40 GB; the rest at the end). ``peak_disk_gb`` is
the work folder's largest size after a step.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _model(work: Path):
    from vlmrun.model import FastVLMModel
    from vlmrun.store import ArtifactStore

    return FastVLMModel.open(work / "apple", ArtifactStore(work / "store"))


def _fresh(work: Path, name: str) -> Path:
    out = work / "out" / name
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    return out


def run_step(step: str, work: Path, args) -> dict:
    """One step, in this process; what it wrote."""
    from vlmrun.stages import ExportForm
    from vlmrun_ort_reference.decoder_parts import export_parts
    from vlmrun_ort_reference.exporters import export_stage
    from vlmrun_ort_reference.onnx_export import export_lut

    if step == "make-tiny":
        from vlmrun.family import write_random_apple

        write_random_apple(work / "apple", args.size, image_size=args.image_size)
        return {"bytes": _bytes(work / "apple")}
    model = _model(work)
    if step == "open":
        return {"bytes": _bytes(model.path), "streams": model.streams}
    out = _fresh(work, step)
    if step == "lut":
        export_lut(model, out)
    elif step == "image_encoder":
        export_stage(model, ExportForm.of("vision", "vision/encoder"), out)
    elif step.startswith("part"):
        k = int(step[len("part"):])
        form = ExportForm.of("decoder", "decoder/parts", ar=args.ar, ctx=args.ctx, layers=_layers(model, args.parts),
                             rmsnorm="safe")
        export_parts(model, form, out, only=k)
    return {"bytes": _bytes(out)}


def _layers(model, parts: int) -> str:
    n = model.num_layers
    return ",".join(str(n // parts + (1 if i < n % parts else 0)) for i in range(parts))


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _child(step: str, args) -> dict:
    """Run ``step`` in a child process; its wall time, peak RSS and what it reports."""
    cmd = [sys.executable, __file__, "--child", step, "--size", args.size, "--work", str(args.work),
           "--parts", str(args.parts), "--ar", str(args.ar), "--ctx", str(args.ctx),
           "--image-size", str(args.image_size)]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"step {step} failed (exit {os.waitstatus_to_exitcode(status)})")
    return {"wall_s": round(wall, 1), "peak_rss_gb": round(usage.ru_maxrss / 1e6, 2), **json.loads(out)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="1.5b")
    ap.add_argument("--parts", type=int, default=4)
    ap.add_argument("--ar", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--image-size", type=int, default=1024)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run_step(args.child, args.work, args)))
        return 0
    args.work.mkdir(parents=True, exist_ok=True)
    steps = ["make-tiny", "open", "lut", "image_encoder", *[f"part{k}" for k in range(1, args.parts + 1)]]
    report = {"size": args.size, "parts": args.parts, "ar": args.ar, "ctx": args.ctx, "steps": {}}
    peak_disk = 0
    try:
        for step in steps:
            report["steps"][step] = _child(step, args)
            print(f"{step}: {report['steps'][step]}", file=sys.stderr, flush=True)
            peak_disk = max(peak_disk, _bytes(args.work))
            if step.startswith("part") and not args.keep:  # measured: its graphs go, so 7B's parts fit the disk
                shutil.rmtree(args.work / "out" / step, ignore_errors=True)
        report["peak_disk_gb"] = round(peak_disk / 1e9, 2)
    finally:
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
