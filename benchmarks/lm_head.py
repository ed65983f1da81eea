"""The memory of quantizing a decoder's lm_head alone, per family size, as JSON: what bounds the last part at 7B.

    .venv/bin/python benchmarks/lm_head.py [--size 1.5b] [--precision w4a16] [--feeds 8] [--rows 128] [--work DIR]
        [--soc SM8750] [--no-compile]

A graph holding only the size's lm_head (`vlmrun.family.SIZES`: hidden x vocabulary rows, one MatMul of random
float32 weights, stored as external data as a full-size part is) is quantized the way qnn_htp quantizes a decoder
part (`vlmrun_qnn_htp.quantizer.quantize`: onnxruntime's engine, the graph big, so in a child process of its own)
over ``--feeds`` random calibration inputs of ``--rows`` rows. Printed: the weights' bytes, the child's peak RSS
after each step (preprocessing, calibration and quantization) and those peaks in copies of the weights, the step
times, the QDQ graph's bytes, the parts plan's estimate for the same weights (`vlmrun_qnn_htp.memory`:
``HEAD_QUANTIZE_COPIES``), then the QDQ graph's compile for ``--soc`` (onnxruntime-qnn's context binary, as a part's):
its peak, seconds and bytes. The graph is written, and compiled, by child processes of their own (their peaks are
printed apart); ``--work`` (default a temporary folder, removed after) holds the graph, its QDQ form, the binary and
the feeds: about 2.4 x the weights on disk.

At ``7b`` (untied lm_head, 152064 x 3584, 2.18 GB) the quantization child needs about 8.5 GB and the writer 4.2 GB.
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
    """The lm_head as one MatMul ``x [1, rows, hidden] @ W [hidden, vocab] -> logits``; the weights' bytes.

    The weights go straight to the external-data file and the graph only references them: at 7B (2.18 GB) they are
    more than one protobuf message can hold (2 GiB), so ``numpy_helper.from_array`` into a graph fails there
    ("Error parsing message with type 'onnx.TensorProto'")."""
    import numpy as np
    from onnx import TensorProto, helper

    w = np.random.default_rng(seed).standard_normal((hidden, vocab), dtype=np.float32)
    w *= np.float32(0.02)
    data = path.with_name(path.name + ".data")
    w.tofile(data)
    weight = TensorProto(name="lm_head.weight", data_type=TensorProto.FLOAT, dims=[hidden, vocab],
                         data_location=TensorProto.EXTERNAL)
    for key, value in (("location", data.name), ("offset", 0), ("length", w.nbytes)):
        weight.external_data.add(key=key, value=str(value))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "lm_head.weight"], ["logits"], name="lm_head")], "lm_head",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, rows, hidden])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [1, rows, vocab])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    path.write_bytes(model.SerializeToString())
    return int(w.nbytes)


def compile_graph(qdq: Path, soc_name: str) -> dict:
    """The QDQ graph compiled for ``soc_name``'s HTP as qnn_htp compiles a part (onnxruntime-qnn's context
    binary), in a folder beside it: its seconds and bytes."""
    from vlmrun_qnn_htp.ep import compile_onnx
    from vlmrun_qualcomm.socs import soc

    out = qdq.parent / "compiled"
    out.mkdir(exist_ok=True)
    info = compile_onnx(qdq, out, "lm_head", soc(soc_name))
    return {"compile_s": info["compile_s"], "binary_bytes": sum(info["binary_bytes"].values())}


def main(args) -> dict:
    import numpy as np

    from vlmrun.family import size_named
    from vlmrun_qnn_htp.memory import HEAD_QUANTIZE_COPIES
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
        compiled = None
        if not args.no_compile:
            with open(work / "compile.log", "w") as log:
                compiled = children.run_child([__file__, "--compile", str(work / "lm_head.qdq.onnx"), "--soc",
                                               args.soc], log, rss_key="peak_mb")
            if compiled.get("failed"):
                raise SystemExit(f"benchmarks/lm_head.py: the compile failed: {(work / 'compile.log').read_text()[-600:]}")
        return {
            "size": size.name, "lm_head": [size.vocab_rows, size.hidden], "precision": args.precision,
            "weights_bytes": weights, "feeds": args.feeds, "rows": args.rows,
            "child_peak_mb": peaks, "child_peak_copies": {k: round(v * 2**20 / weights, 2) for k, v in peaks.items()},
            "times_s": facts.get("times"), "quantize_wall_s": round(wall, 1), "process": facts.get("process"),
            "qdq_bytes": qdq, "estimate_copies": HEAD_QUANTIZE_COPIES["onnxruntime"],
            "estimate_bytes": HEAD_QUANTIZE_COPIES["onnxruntime"] * weights,
            "writer": {"wall_s": writer["child_wall_s"], "peak_mb": writer["peak_mb"]},
            "compile": compiled and {"soc": args.soc, "wall_s": compiled["child_wall_s"], "peak_mb": compiled["peak_mb"],
                                     "binary_bytes": compiled["binary_bytes"],
                                     "over_int4_weights": round(compiled["binary_bytes"] / (weights / 8), 3)},
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
    p.add_argument("--soc", default="SM8750", help="the SoC the QDQ graph is compiled for (default SM8750)")
    p.add_argument("--no-compile", action="store_true", help="stop after the quantization")
    p.add_argument("--work", help="keep the graph, its QDQ form and the feeds here")
    p.add_argument("--write", metavar="PATH", help=argparse.SUPPRESS)  # the writer child
    p.add_argument("--compile", metavar="PATH", help=argparse.SUPPRESS)  # the compile child
    args = p.parse_args()
    if args.compile:
        print(json.dumps(compile_graph(Path(args.compile), args.soc)))
        return
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
