"""qnn_htp on the tiny model: compile time per stage and precision, cold vs warm load, emulator latency vs ORT
CPU, context binary sizes. Prints one JSON object.

    python benchmarks/qnn_htp.py [--image-size 256] [--context-length 256] [--prefill-ar 32] [--cache-dir DIR]

Cold = compile into an empty store and open the sessions; warm = a new store object on the same directory (the
manifest hashes are checked again) opening the stored binaries. Timings are on the x86_64 HTP emulator inside
onnxruntime-qnn (not a phone) and are noisy on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def timed(fn, repeat=3):
    out, times = None, []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return out, round(statistics.median(times), 2)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--image-size", type=int, default=256)
    ap.add_argument("--context-length", type=int, default=256)
    ap.add_argument("--prefill-ar", type=int, default=32)
    ap.add_argument("--cache-dir", default=None, help="default: a new temporary directory (cold compile)")
    args = ap.parse_args()

    import numpy as np

    from vlmrun import Pipeline, plugins
    from vlmrun.demo_image import demo_image
    from vlmrun.layouts import Layout, StageAssignment
    from vlmrun.model import default_model
    from vlmrun.stages import STAGES
    from vlmrun.store import ArtifactStore
    from vlmrun_qnn_htp import ep

    root = args.cache_dir or tempfile.mkdtemp(prefix="vlmrun-bench-qnn-")
    store = ArtifactStore(root)
    registry = plugins.load()
    model = default_model(store, args.image_size)

    def lay(**per):
        st = {}
        for s in STAGES:
            o = {"context_length": args.context_length, "prefill_ar": args.prefill_ar} if s == "decoder" else {}
            o.update(per.get(s, {}))
            st[s] = StageAssignment("qnn_htp", o)
        return Layout("bench", st)

    ref = Pipeline.build(model, "reference", store=store, registry=registry)  # exports the reference forms
    result = {"image_size": args.image_size, "context_length": args.context_length, "prefill_ar": args.prefill_ar,
              "versions": ep.versions(), "store": root, "stages": {}}

    # cold: ONNX export (vision/projector already exported by the reference) + compile + load, per stage
    cold = {}
    for s in STAGES:
        t0 = time.perf_counter()
        pipe_s = Pipeline.build(model, lay(), store=store, registry=registry, stages=(s,))
        cold[s] = (time.perf_counter() - t0) * 1e3
    pipe = Pipeline.build(model, lay(), store=ArtifactStore(root), registry=registry)
    warm = {}
    for s in STAGES:
        fresh = ArtifactStore(root)
        t0 = time.perf_counter()
        Pipeline.build(model, lay(), store=fresh, registry=registry, stages=(s,))
        warm[s] = (time.perf_counter() - t0) * 1e3
        assert not fresh.builds, fresh.builds
    del pipe_s

    prepared = ref.prepare(demo_image(), "Describe the image.")
    embeds = ref.embed_prompt(prepared)
    feats = ref.run_stage("vision", {"pixel_values": prepared.pixel_values})["image_features"]
    inputs = {
        "vision": {"pixel_values": prepared.pixel_values},
        "projector": {"image_features": feats},
        "embed": {"input_ids": prepared.input_ids},
        "decoder": {"inputs_embeds": embeds},
    }
    for s in STAGES:
        handle = pipe.handles[s]
        arts = getattr(handle, "artifacts", None) or [handle.artifact]
        _, htp_ms = timed(lambda: pipe.run_stage(s, inputs[s]), 3 if s != "decoder" else 2)
        _, cpu_ms = timed(lambda: ref.run_stage(s, inputs[s]), 5)
        result["stages"][s] = {
            "compile_s": {a.manifest["source_form"]: a.manifest["compile_s"] for a in arts},
            "binary_bytes": {k: v for a in arts for k, v in a.manifest["binary_bytes"].items()},
            "cold_build_load_ms": round(cold[s], 1),
            "warm_load_ms": round(warm[s], 1),
            "warm_over_cold": round(warm[s] / cold[s], 3),
            "emulator_ms": htp_ms,
            "ort_cpu_ms": cpu_ms,
        }
    result["stages"]["decoder"]["prefill_tokens"] = int(embeds.shape[1])
    # one AR-1 step on the emulator
    dec = pipe.handles["decoder"].decoder
    dec.reset()
    dec.prefill(embeds)
    step = embeds[:, :1]
    _, ar1 = timed(lambda: dec._step(step, 1), 5)
    result["stages"]["decoder"]["ar1_step_ms"] = ar1

    # int8 (a8w8, 16-bit softmax; random calibration) and a16w8 vision: compile and latency
    for prec in ("int8", "a16w8"):
        t0 = time.perf_counter()
        p8 = Pipeline.build(model, lay(vision={"precision": prec}), store=store, registry=registry, stages=("vision",))
        build_s = time.perf_counter() - t0
        m = p8.handles["vision"].artifact.manifest
        out, ms = timed(lambda: p8.run_stage("vision", inputs["vision"]), 3)
        a, b = out["image_features"].ravel().astype(np.float64), feats.ravel().astype(np.float64)
        result["stages"]["vision"][prec] = {
            "quantize_s": m["quantization"]["quantize_s"], "compile_s": m["compile_s"],
            "build_s": round(build_s, 2), "binary_bytes": sum(m["binary_bytes"].values()),
            "emulator_ms": ms, "cosine_vs_cpu": round(float(a @ b / np.linalg.norm(a) / np.linalg.norm(b)), 5),
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
