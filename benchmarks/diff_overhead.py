"""Overhead of ``vlmrun diff`` (capture both sides + compare) over two plain generations; prints JSON.

    python benchmarks/diff_overhead.py [--image-size 1024] [--max-new-tokens 32] [--repeats 3]

Pipelines are built (and exported) before timing; the minimum over repeats is reported.
"""

from __future__ import annotations

import argparse
import json
import os
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--image-size", type=int, default=1024)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--model", default=None, help="a FastVLM checkpoint directory (default: the tiny model)")
    args = ap.parse_args()

    from vlmrun import GenerationSettings, Pipeline, diff, plugins
    from vlmrun.demo_image import demo_image
    from vlmrun.model import FastVLMModel, default_model
    from vlmrun.store import ArtifactStore

    store = ArtifactStore(args.cache_dir)
    model = FastVLMModel.open(args.model, store) if args.model else default_model(store, args.image_size)
    registry = plugins.load()
    pipe = Pipeline.build(model, "reference", store=store, registry=registry)
    image, prompt = demo_image(), diff.DEFAULT_PROMPT
    settings = GenerationSettings(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    pipe.generate(image, prompt, settings).run()  # warm up

    plain, full = [], []
    for _ in range(args.repeats):
        t = time.perf_counter()
        for _ in range(2):
            pipe.generate(image, prompt, settings).run()
        plain.append(time.perf_counter() - t)
        t = time.perf_counter()
        run = diff.run(pipe, pipe, image=image, prompt=prompt, model=model, store=store,
                       registry=registry, max_new_tokens=args.max_new_tokens, ignore_eos=True)
        full.append(time.perf_counter() - t)
    print(json.dumps({
        "image_size": args.image_size,
        "max_new_tokens": args.max_new_tokens,
        "two_plain_runs_s": min(plain),
        "diff_s": min(full),
        "overhead_pct": 100.0 * (min(full) / min(plain) - 1.0),
        "diff_breakdown_s": run.timings,
    }, indent=2))


if __name__ == "__main__":
    main()
