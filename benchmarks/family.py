"""Streamed export of a FastVLM family size: peak memory and wall time per step, each step in its own process.

    .venv/bin/python benchmarks/family.py --size 1.5b --parts 4 --work /tmp/family [--keep]
    .venv/bin/python benchmarks/family.py --size 7b --layers 3,3,3,3,3,3,3,3,3,1 --make-parts 1,10 --work /tmp/f7

Steps (issue 32): ``make-tiny --size SIZE --format apple-sharded`` (random weights, bf16 shards in Apple's
layout), opening it (the checkpoint conversion, tensor by tensor, one shard per source shard), the LUT (the
embedding rows alone), the image encoder (``vision/encoder``: the vision tower and projector alone) and each
decoder part of ``decoder/parts`` alone (its layers, + the final norm and lm_head in the last part). Each step
runs in a child process: its peak RSS is its own (``os.wait4``). Prints one JSON object; ``--keep`` keeps what
was written under ``--work`` (removed by default: each part's graphs once the part is measured, so that a 7B run
needs the checkpoint, its conversion and one part on disk, about 40 GB; the rest at the end). ``peak_disk_gb`` is
the work folder's largest size after a step.

``--make-parts K,..`` also makes those parts as a phone bundle makes each part (qnn_htp's ``make_part``, in a child
of its own right after the part's export): the prompt and token graphs quantized at ``--precision`` on
seeded random feeds of the graphs' own shapes (a causal mask clipped as the real calibration clips it), as many
as the real calibration keeps (``--calibration-feeds PROMPT,TOKEN``, default 33,64: at 1024 px, three prompts of
256 image tokens and their text through the AR-128 graph, 3 prefill calls and 8 greedy steps each, and 64 of the
token graph's ~850 calls), then compiled for the SM8750 into one weight-shared binary. Random feeds, because the
real calibration of part k runs the float parts before it (calibration in sequence), which for 7B is the bundle's
hours and is not measured here; a binary's bytes, the quantizer's memory and its time per feed do not depend on
the values. The checkpoint is then written with every vocabulary row random (``dense_vocab``): zero rows compile
smaller than real ones. With a first and the last part made, ``projection`` estimates the whole decoder: the
first part's bytes, export and make time per layer over every layer outside the last part, plus the last part's.
The parts are made without the follow-up graph (``followup_ar``) a bundle also compiles: it shares the part's
weights in the same binary, so it adds graph bytes and one more quantization per part, not weights.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import children  # benchmarks/children.py: a measured child process

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

        # with parts to make, every vocabulary row is random: a binary of zero rows compiles smaller than a real one
        write_random_apple(work / "apple", args.size, image_size=args.image_size, dense_vocab=bool(args.make_parts))
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
        form = ExportForm.of("decoder", "decoder/parts", ar=args.ar, ctx=args.ctx, layers=_layers(model, args),
                             rmsnorm="safe")
        export_parts(model, form, out, only=k)
    elif step.startswith("bundle_part"):
        return make_part_step(model, work, int(step[len("bundle_part"):]), args)
    return {"bytes": _bytes(out)}


def _layers(model, args) -> str:
    if args.layers:
        return args.layers
    n, parts = model.num_layers, args.parts
    return ",".join(str(n // parts + (1 if i < n % parts else 0)) for i in range(parts))


def random_feeds(graph: Path, n: int, seed: int) -> list[dict]:
    """``n`` seeded random calibration feeds for a part graph in Genie's I/O layout (its inputs' own shapes): the
    residual stream or embeddings N(0, 1), past keys and values N(0, 1), a causal mask over a random past length
    (masked entries at the real calibration's clip), the rotary table rows of those positions (theta 1e6)."""
    import numpy as np
    import onnx
    from vlmrun_qnn_htp.calibration import MASK_CLIP

    rng = np.random.default_rng(seed)
    inputs = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim]
              for i in onnx.load(str(graph), load_external_data=False).graph.input}
    T, C = inputs["attention_mask"][1:]
    feeds = []
    for _ in range(n):
        past = int(rng.integers(0, C - T + 1))
        mask = np.full((1, T, C), MASK_CLIP, np.float32)
        mask[:, :, :past] = 0.0
        mask[0, :, C - T:] = np.where(np.tril(np.ones((T, T), bool)), 0.0, MASK_CLIP)
        half = inputs["position_ids_cos"][-1]
        angles = np.arange(past, past + T)[:, None] * (1e6 ** (-np.arange(half) / half))[None]
        f = {"attention_mask": mask, "position_ids_cos": np.cos(angles)[None, None].astype(np.float32),
             "position_ids_sin": np.sin(angles)[None, None].astype(np.float32)}
        for name, shape in inputs.items():
            if name not in f:
                f[name] = rng.standard_normal(shape, dtype=np.float32)
        feeds.append(f)
    return feeds


def make_part_step(model, work: Path, k: int, args) -> dict:
    """Part ``k`` of the exported ``out/part{k}`` made as a bundle makes it (`vlmrun_qnn_htp.parts_compile.make_part`,
    weight-shared, for the SM8750) from random feeds; its bytes against its weights at ``--precision``."""
    from vlmrun_qnn_htp.calibration import spill_feeds
    from vlmrun_qnn_htp.parts_compile import PartJob, graph_sources, make_part
    from vlmrun_qualcomm.parts import WEIGHT_BITS, weight_counts

    src = work / "out" / f"part{k}"
    desc = json.loads((src / "parts.json").read_text())
    p = next(e for e in desc["parts"] if e["index"] == k)
    sources = {kind: g for kind, g in graph_sources(src, p).items() if kind in ("prompt", "token")}
    out, scratch = _fresh(work, f"bundle_part{k}"), _fresh(work, f"scratch{k}")
    counts = dict(zip(("prompt", "token"), _feed_counts(args.calibration_feeds)))
    feeds = {kind: str(spill_feeds(random_feeds(path, counts[kind], seed=k), scratch / f"{kind}.npz"))
             for kind, (path, _, _) in sources.items()}
    options = {"soc": "SM8750", "precision": args.precision, "weight_sharing": "on", "part_limit_mb": 1000}
    res = make_part(PartJob(part=p, count=args.parts, sources=sources, feeds=feeds, options=options,
                            work=str(scratch), out_dir=str(out)))
    shutil.rmtree(scratch, ignore_errors=True)
    lo, hi = p["layers"]
    mm, other, head = weight_counts(model)
    last = hi == model.num_layers
    weights = ((hi - lo) * mm + (head if last else 0)) * WEIGHT_BITS[args.precision] / 8
    entry = res["entry"]
    return {"layers": [lo, hi], "last": last, "bytes": entry["bytes"], "binaries": entry["binaries"],
            "weight_bytes": int(weights), "bytes_over_weights": round(entry["bytes"] / weights, 3),
            "quantize_s": round(res["quant_s"], 1), "compile_s": round(res["compile_s"], 1),
            "graph_compile_s": {g: round(v, 1) for g, v in res["graph_s"].items()},
            "quantize_steps_s": {step: round(v, 1) for step, v in res["q_times"].items()},
            "calibration_feeds": counts, "calibration": "random (seeded)"}


def _feed_counts(value: str) -> tuple[int, int]:
    """``--calibration-feeds``: N (both graphs) or PROMPT,TOKEN."""
    n = [int(x) for x in str(value).split(",")]
    return (n[0], n[-1])


def projection(report: dict, model_layers: int) -> dict | None:
    """The whole decoder from its first and last parts made (`make_part_step`): bytes and make time."""
    made = {int(s[len("bundle_part"):]): v for s, v in report["steps"].items() if s.startswith("bundle_part")}
    last = [v for v in made.values() if v["last"]]
    first = [v for v in made.values() if not v["last"]]
    if not last or not first:
        return None
    f, l = first[0], last[0]
    per_layer = f["layers"][1] - f["layers"][0]
    rest = model_layers - (l["layers"][1] - l["layers"][0])
    scale = rest / per_layer
    export = report["steps"].get(f"part{min(made)}", {}).get("wall_s")
    return {"decoder_bytes": int(f["bytes"] * scale + l["bytes"]),
            "decoder_weight_bytes": int(f["weight_bytes"] * scale + l["weight_bytes"]),
            "make_s": round((f["quantize_s"] + f["compile_s"]) * scale + l["quantize_s"] + l["compile_s"]),
            "export_s": round(export * scale + report["steps"][f"part{max(made)}"]["wall_s"]) if export else None,
            "from": {"first": f["layers"], "last": l["layers"], "layers_outside_the_last_part": rest}}


def _num_layers(size: str) -> int:
    from vlmrun.family import size_named

    return size_named(size).layers


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _child(step: str, args) -> dict:
    """Run ``step`` in a child process (`children.run_step`); its wall time, peak RSS and what it reports."""
    return children.run_step([__file__, "--child", step, "--size", args.size, "--work", str(args.work),
                              "--parts", str(args.parts), "--ar", str(args.ar), "--ctx", str(args.ctx),
                              "--image-size", str(args.image_size), "--precision", args.precision,
                              "--calibration-feeds", str(args.calibration_feeds), "--make-parts", args.make_parts,
                              *(["--layers", args.layers] if args.layers else [])], step)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", default="1.5b")
    ap.add_argument("--parts", type=int, default=4)
    ap.add_argument("--ar", type=int, default=128)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--image-size", type=int, default=1024)
    ap.add_argument("--layers", help="layers per part, comma-separated (default: --parts parts of even size); e.g."
                                     " the planner's 7B split at 15 GB, 3,3,3,3,3,3,3,3,3,1")
    ap.add_argument("--make-parts", default="", help="parts (from 1) to make as a bundle makes them after their"
                                                      " export (quantized, compiled, weight-shared), e.g. 1,10")
    ap.add_argument("--precision", default="w4a16", choices=("w4a16", "w8a16"))
    ap.add_argument("--calibration-feeds", default="33,64", help="random calibration feeds of the prompt and the"
                                                                   " token graph (N for both); default: what the"
                                                                   " real calibration keeps at 1024 px")
    ap.add_argument("--only", default="", help="comma-separated steps to run, e.g. part1,bundle_part1 over"
                                              " a --keep work folder whose make-tiny and open were run (the"
                                              " folder is kept)")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(run_step(args.child, args.work, args)))
        return 0
    if args.layers:
        args.parts = len(args.layers.split(","))
    try:
        made = {int(k) for k in args.make_parts.split(",") if k.strip()}
        _feed_counts(args.calibration_feeds)
    except ValueError:
        ap.error("--make-parts and --calibration-feeds take comma-separated whole numbers")
    if any(k < 1 or k > args.parts for k in made):
        ap.error(f"--make-parts {args.make_parts}: parts are numbered 1..{args.parts}")
    steps = ["make-tiny", "open", "lut", "image_encoder"]
    for k in range(1, args.parts + 1):
        steps += [f"part{k}", *([f"bundle_part{k}"] if k in made else [])]
    if args.only:
        unknown = set(args.only.split(",")) - set(steps)
        if unknown:
            ap.error(f"--only: unknown steps {', '.join(sorted(unknown))}; the steps are {', '.join(steps)}")
        steps = [s for s in steps if s in args.only.split(",")]
    args.work.mkdir(parents=True, exist_ok=True)
    report = {"size": args.size, "parts": args.parts, "layers": args.layers, "ar": args.ar, "ctx": args.ctx,
              "precision": args.precision if made else None, "steps": {}}
    peak_disk = 0
    try:
        for step in steps:
            report["steps"][step] = _child(step, args)
            print(f"{step}: {report['steps'][step]}", file=sys.stderr, flush=True)
            peak_disk = max(peak_disk, _bytes(args.work))
            done_with = step if step.startswith("part") and int(step[4:]) not in made else (
                f"part{step[len('bundle_part'):]}" if step.startswith("bundle_part") else None)
            if done_with and not args.keep:  # measured (and made): its graphs go, so 7B's parts fit the disk
                shutil.rmtree(args.work / "out" / done_with, ignore_errors=True)
        report["peak_disk_gb"] = round(peak_disk / 1e9, 2)
        if made:
            report["projection"] = projection(report, _num_layers(args.size))
    finally:
        if not args.keep and not args.only:  # --only runs over a folder earlier runs wrote: not this run's to remove
            shutil.rmtree(args.work, ignore_errors=True)
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
