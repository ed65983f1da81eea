"""The memory of quantizing a decoder's lm_head alone, per family size, as JSON: what bounds the last part at 7B.

    .venv/bin/python benchmarks/lm_head.py [--size 1.5b] [--precision w4a16] [--feeds 8] [--rows 128] [--work DIR]

A graph holding only the size's lm_head (`vlmrun.family.SIZES`: hidden x vocabulary rows, one MatMul of random
float32 weights, stored as external data as a full-size part is) is quantized the way qnn_htp quantizes a decoder
part (`vlmrun_qnn_htp.quantizer.quantize`: onnxruntime's engine, the graph big, so in a child process of its own)
over ``--feeds`` random calibration inputs of ``--rows`` rows. Printed: the weights' bytes, the child's peak RSS
after each step (preprocessing, calibration and quantization) and those peaks in copies of the weights, the step
times, the QDQ graph's bytes, and the parts plan's estimate for the same weights (`vlmrun_qnn_htp.memory`:
``QUANTIZE_COPIES``). The graph is written by a child process of its own (its peak is printed apart); ``--work`` (default a
temporary folder, removed after) holds the graph, its QDQ form and the feeds: about 2.2 x the weights on disk.

At ``7b`` (untied lm_head, 152064 x 3584, 2.18 GB) the child needs about 14 GB: run it on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import children  # benchmarks/children.py: a measured child process

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def write_graph(path: Path, hidden: int, vocab: int, rows: int, seed: int = 0) -> int:
    """The lm_head as one MatMul ``x [1, rows, hidden] @ W [hidden, vocab] -> logits``; the weights' bytes."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = np.random.default_rng(seed).standard_normal((hidden, vocab), dtype=np.float32)
    w *= np.float32(0.02)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "lm_head.weight"], ["logits"], name="lm_head")], "lm_head",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows, hidden])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, rows, vocab])],
        [numpy_helper.from_array(w, "lm_head.weight")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
              location=path.name + ".data")
    return int(w.nbytes)


def main(args) -> dict:
    import numpy as np

    from vlmrun.family import size_named
    from vlmrun_qnn_htp.memory import QUANTIZE_COPIES
    from vlmrun_qnn_htp.quantizer import quantize
    from vlmrun_qnn_htp.recipe import Recipe

    size = size_named(args.size)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="vlmrun-lm-head-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        src = work / "lm_head.onnx"
        # written in a child of its own: a process forked from this one starts with this one's peak RSS as its own
        # (Linux keeps the high-water mark across fork and exec), which would hide the quantization child's peak
        with open(work / "writer.log", "w") as log:
            writer = children.run_child([__file__, "--write", str(src), "--size", size.name, "--rows",
                                         str(args.rows)], log, rss_key="peak_mb")
        if writer.get("failed"):
            raise SystemExit(f"benchmarks/lm_head.py: writing the graph failed: {(work / 'writer.log').read_text()[-600:]}")
        weights = writer["weights_bytes"]
        rng = np.random.default_rng(1)
        feeds = [{"x": rng.standard_normal((1, args.rows, size.hidden), dtype=np.float32)} for _ in range(args.feeds)]
        t0 = time.perf_counter()
        facts = quantize(src, work / "lm_head.qdq.onnx", feeds, Recipe(args.precision), work)
        wall = time.perf_counter() - t0
        peaks = {k: v for k, v in facts.get("peak_rss_mb_after", {}).items() if v is not None}
        qdq = sum(f.stat().st_size for f in work.glob("lm_head.qdq.onnx*"))
        return {
            "size": size.name, "lm_head": [size.vocab_rows, size.hidden], "precision": args.precision,
            "weights_bytes": weights, "feeds": args.feeds, "rows": args.rows,
            "child_peak_mb": peaks, "child_peak_copies": {k: round(v * 2**20 / weights, 2) for k, v in peaks.items()},
            "times_s": facts.get("times"), "quantize_wall_s": round(wall, 1), "process": facts.get("process"),
            "qdq_bytes": qdq, "estimate_copies": QUANTIZE_COPIES["onnxruntime"],
            "estimate_bytes": QUANTIZE_COPIES["onnxruntime"] * weights,
            "writer": {"wall_s": writer["child_wall_s"], "peak_mb": writer["peak_mb"]},
            "this_process_peak_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024,
        }
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


def cli() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="1.5b", help="a family size: tiny, 0.5b, 1.5b or 7b (default 1.5b)")
    p.add_argument("--precision", default="w4a16", choices=("w4a16", "w8a16"))
    p.add_argument("--feeds", type=int, default=8, help="calibration inputs (default 8)")
    p.add_argument("--rows", type=int, default=128, help="rows of each input: the prompt graph's AR (default 128)")
    p.add_argument("--work", help="keep the graph, its QDQ form and the feeds here")
    p.add_argument("--write", metavar="PATH", help=argparse.SUPPRESS)  # the writer child
    args = p.parse_args()
    if args.write:
        from vlmrun.family import size_named

        size = size_named(args.size)
        print(json.dumps({"weights_bytes": write_graph(Path(args.write), size.hidden, size.vocab_rows, args.rows)}))
        return
    if args.feeds < 1 or args.rows < 1:
        p.error("--feeds and --rows must be at least 1")
    print(json.dumps(main(args), indent=1))


if __name__ == "__main__":
    sys.exit(cli())
