"""The runtime boundary of a bundle: Genie's own logits against vlmrun's host engine over the same binaries.

    .venv/bin/python benchmarks/runtime_boundary.py [--precisions fp16,w8a16] [--items 16] [--cache-dir DIR]

Per decoder precision it writes the all-npu bundle of the tiny model (the image encoder at fp16) and runs
``vlmrun eval`` over N held-out items with the bundle layout: every item is diffed across the runtime boundary
(Genie teacher-forced through its custom sampler, the engine step by step over the same part binaries). It prints,
as JSON, the median (and 5th percentile, min) over the items of: Genie's logits SQNR against the reference, the
engine's, their difference (the goal: within 1 dB), Genie against the engine, and the share of items whose diff
passes; plus the bundle's bytes on the device. Informational: an x86_64 HTP emulator, not a phone.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def measure(precision: str, items: int, cache_dir: str, work: Path) -> dict:
    from vlmrun import eval as ev
    from vlmrun import layouts
    from vlmrun.bundle import write
    from vlmrun.model import default_model
    from vlmrun.store import ArtifactStore

    store = ArtifactStore(cache_dir)
    model = default_model(store, 256)
    out = work / f"bundle-{precision}"
    t0 = time.perf_counter()
    write(layouts.resolve("all-npu", options={"decoder": {"precision": precision}}), out, model=model, store=store)
    write_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    run = ev.evaluate([f"bundle:{out}"], model=model, store=store, limit=items)
    eval_s = time.perf_counter() - t0
    label = f"bundle:{out}"
    lay = next(x for x in run.report["layouts"] if x["label"] == label)
    genie, engine, between = [], [], []
    for item in run.results[lay["key"]].values():  # per item, from the cached results
        drift = item.get("drift") or {}
        g = drift.get("runtime/runtime_logits", {})
        e = drift.get("decoder/logits", {})
        if g.get("sqnr_db") is None or e.get("sqnr_db") is None:
            continue
        genie.append(float(g["sqnr_db"]))
        engine.append(float(e["sqnr_db"]))
        between.append(float(g.get("engine_sqnr_db", np.nan)))
    gap = np.asarray(genie) - np.asarray(engine)

    def dist(v):
        v = np.asarray(v, np.float64)
        return {"median": round(float(np.median(v)), 2), "p5": round(float(np.percentile(v, 5)), 2),
                "min": round(float(v.min()), 2), "max": round(float(v.max()), 2)}

    return {
        "precision": precision, "items": len(genie), "write_s": round(write_s, 1), "eval_s": round(eval_s, 1),
        "device_bytes": lay["device_bytes"],
        "genie_logits_sqnr_db": dist(genie), "engine_logits_sqnr_db": dist(engine),
        "genie_minus_engine_db": dist(gap), "genie_against_engine_sqnr_db": dist(between),
        "within_1_db": bool(abs(float(np.median(gap))) <= 1.0),
        "diff_pass_rate": lay["diff_pass_rate"], "accuracy": lay["accuracy"]["all"],
        "same_answer_as_reference": lay["same_answer_as_reference"],
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--precisions", default="fp16,w8a16")
    ap.add_argument("--items", type=int, default=16)
    ap.add_argument("--cache-dir", default=None, help="artifact store (default: a fresh temporary one)")
    a = ap.parse_args(argv)
    cache = a.cache_dir or tempfile.mkdtemp(prefix="vlmrun-bench-boundary-")
    work = Path(tempfile.mkdtemp(prefix="vlmrun-bench-bundles-"))
    out = {"benchmark": "runtime_boundary", "model": "tiny (default)", "items": a.items,
           "results": [measure(p, a.items, cache, work) for p in a.precisions.split(",") if p]}
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
