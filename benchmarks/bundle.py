"""What ``vlmrun bundle`` ships, per precision: files and bytes, build cost, and (tiny model) the emulator's pipeline.

    .venv/bin/python benchmarks/bundle.py [--full-size | --size 1.5b|7b] [--precisions fp16,w8a16,w4a16]
        [--vision-precision a16w8] [--target local|android] [--items 8] [--decoder-option KEY=VALUE] [--cache-dir DIR]

Per decoder precision it writes a bundle of the all-npu layout (the image encoder at ``--vision-precision``, the
decoder's parts at the precision) in a child process and prints, as JSON: the bundle's bytes (image encoder, decoder
parts, LUT, total), the largest binary against the 1000 MB part limit, the child's wall seconds and peak RSS (export,
quantization and compile included: what a first ``vlmrun bundle`` costs; the store makes a second one instant), the
disk it took (``disk``, 10^9 bytes allocated: the store before, the store and the bundle at their peak, sampled
every 5 s, and after; the model's checkpoint is in the store folder when the benchmark built it), and,
on the tiny model with ``--items N``, the emulator's pipeline over N held-out items (informational: an x86_64
emulator, not a phone): answers equal to the reference's, seconds per answer.

``--full-size`` builds FastVLM-0.5B dimensions with random weights (dense vocabulary rows, as a real checkpoint's tied
lm_head) and writes the phone form (``--target android``: weight-shared parts), which this machine cannot run.
``--size 1.5b`` / ``7b``: the same at Apple's larger dimensions (`vlmrun.family.write_random_apple`: random bf16
weights in Apple's sharded layout, every vocabulary row dense, written once into ``<cache-dir>/family-<size>-dense``,
converted tensor by tensor when opened); run it with ``VLMRUN_MEMORY_BUDGET_GB`` set so that the decoder's parts
are planned from the budget.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import children  # benchmarks/children.py: a measured child process

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def child_write(spec: dict) -> dict:
    from vlmrun import layouts
    from vlmrun.bundle import write
    from vlmrun.errors import BackendError
    from vlmrun.model import FastVLMModel, default_model
    from vlmrun.store import ArtifactStore

    store = ArtifactStore(spec["cache_dir"])
    model = FastVLMModel.open(spec["model"], store) if spec.get("model") else default_model(store, 256)
    opts = {"vision": {"precision": spec["vision_precision"]}, "projector": {}, "embed": {},
            "decoder": {"precision": spec["precision"], "context_length": spec["ctx"], **spec["decoder_options"]}}
    if spec["target"] == "android":
        opts["decoder"]["weight_sharing"] = "on"
    t0 = time.perf_counter()
    try:
        m = write(layouts.resolve("all-npu", options=opts), spec["out"], model=model, store=store,
                  target=spec["target"])
    except BackendError as exc:  # written whole, but its verification failed: reported, not a crash
        m = json.loads((Path(spec["out"]) / "vlmrun-bundle.json").read_text())
        m["verified"]["error"] = str(exc)
    return {"write_s": round(time.perf_counter() - t0, 1), "bytes": m["bytes"], "verified": m.get("verified"),
            "largest_binary": max((v["bytes"], k) for k, v in m["files"].items() if k.endswith(".bin")),
            "files": len(m["files"]), "decoder": {k: m["decoder"][k] for k in ("parts", "precision", "ar")},
            "image_encoder": {"precision": m["image_encoder"]["precision"]}, "weight_sharing": m["weight_sharing"]}


def child_run(spec: dict) -> dict:
    from vlmrun import GenerationSettings, Pipeline
    from vlmrun.eval.dataset import heldout_dataset, read_dataset
    from vlmrun.model import default_model
    from vlmrun.store import ArtifactStore

    store = ArtifactStore(spec["cache_dir"])
    model = default_model(store, 256)
    bundle = Pipeline.build(model, f"bundle:{spec['out']}", store=store)
    ref = Pipeline.build(model, "reference", store=store)
    records, _ = read_dataset(heldout_dataset(store), limit=spec["items"])
    same, seconds = 0, []
    for r in records:
        t0 = time.perf_counter()
        b = bundle.generate(r.image, r.question, GenerationSettings(max_new_tokens=48)).run()
        seconds.append(time.perf_counter() - t0)
        same += b.text == ref.generate(r.image, r.question, GenerationSettings(max_new_tokens=48)).run().text
    return {"items": len(records), "answers_as_reference": same, "seconds_per_answer_median": round(
        sorted(seconds)[len(seconds) // 2], 2)}


CHILDREN = {"write": child_write, "run": child_run}


def run_child(kind: str, spec: dict, log) -> dict:
    return children.run_child([__file__, "--child", kind, "--spec", json.dumps(spec)], log)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--full-size", action="store_true", help="FastVLM-0.5B dimensions, random weights")
    ap.add_argument("--size", choices=("1.5b", "7b"), default=None,
                    help="Apple's larger dimensions (random weights, Apple's sharded bf16 layout); implies --full-size")
    ap.add_argument("--precisions", default=None, help="decoder precisions (default: fp16,w8a16,w4a16; full size:"
                                                      " w4a16)")
    ap.add_argument("--vision-precision", default="a16w8")
    ap.add_argument("--target", choices=("local", "android"), default=None,
                    help="default: local (tiny), android (full size)")
    ap.add_argument("--items", type=int, default=8, help="tiny model: held-out items run through the bundle")
    ap.add_argument("--context-length", type=int, default=None, help="default 1024 (full size) or 256")
    ap.add_argument("--decoder-option", action="append", default=[], metavar="KEY=VALUE")
    ap.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/vlmrun-bench"))
    ap.add_argument("--log", default=None, help="children's stderr (default: a temporary file)")
    ap.add_argument("--child", choices=sorted(CHILDREN), help=argparse.SUPPRESS)
    ap.add_argument("--spec", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        real_out = os.fdopen(os.dup(1), "w")
        os.dup2(2, 1)
        real_out.write(json.dumps(CHILDREN[args.child](json.loads(args.spec))) + "\n")
        real_out.flush()
        return
    model = None
    if args.size:
        from vlmrun.family import write_random_apple

        # every vocabulary row random (a real checkpoint's dense lm_head): with the tokenizer's rows only, the
        # 1.5B's last part compiled to 26 MB instead of about 150 (docs/models.md)
        model = os.path.join(args.cache_dir, f"family-{args.size}-dense")
        if not os.path.isfile(os.path.join(model, "config.json")):
            print(f"writing the random FastVLM at {args.size} dimensions (once) ...", file=sys.stderr)
            write_random_apple(model, args.size, image_size=1024, dense_vocab=True)
        args.full_size = True
    elif args.full_size:
        from npu_decoder import dense_vocab  # (benchmarks/ is on sys.path: this script runs from there)

        from vlmrun.tiny import make_tiny

        model = os.path.join(args.cache_dir, "full-size-fastvlm")
        if not os.path.isfile(os.path.join(model, "config.json")):
            print("building the full-size random FastVLM (once) ...", file=sys.stderr)
            make_tiny(model, image_size=1024, full_size=True)
        model = dense_vocab(model)
    precisions = (args.precisions or ("w4a16" if args.full_size else "fp16,w8a16,w4a16")).split(",")
    target = args.target or ("android" if args.full_size else "local")
    work = Path(tempfile.mkdtemp(prefix="vlmrun-bench-bundle-"))
    log = open(args.log or work / "children.log", "a")
    results = []
    for precision in precisions:
        out = work / f"bundle-{precision}"
        spec = {"cache_dir": args.cache_dir, "model": model, "precision": precision, "target": target,
                "vision_precision": args.vision_precision, "out": str(out),
                "ctx": args.context_length or (1024 if args.full_size else 256),
                "decoder_options": dict(o.split("=", 1) for o in args.decoder_option), "items": args.items}
        with children.DiskPeak([args.cache_dir, str(out)]) as disk:
            res = {"precision": precision, "vision_precision": args.vision_precision, "target": target,
                   **run_child("write", spec, log)}
        res["disk"] = {"store_gb_before": round(disk.start / 1e9, 2), "peak_gb": round(disk.peak / 1e9, 2),
                       "store_and_bundle_gb_after": round(disk.bytes_now() / 1e9, 2)}
        if not args.full_size and target == "local" and args.items and not res.get("failed"):
            res["emulator"] = run_child("run", spec, log)
        print(f"[bundle] {json.dumps(res)}", file=sys.stderr)
        results.append(res)
    name = (f"FastVLM-{args.size.upper()} dims (random weights, dense vocabulary rows, Apple's sharded bf16 layout)"
            if args.size else "FastVLM-0.5B dims (random weights, dense vocabulary rows)" if args.full_size else "tiny default model")
    print(json.dumps({"model": name, "memory_budget_gb": os.environ.get("VLMRUN_MEMORY_BUDGET_GB"),
                      "bundles": results}, indent=1))


if __name__ == "__main__":
    main()
