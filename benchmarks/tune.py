"""``vlmrun tune`` measured, as JSON: the tiny model's two fronts and the search's cost; at full size a sizes-only plan.

    .venv/bin/python benchmarks/tune.py [--items 16] [--max-candidates 12] [--beam 1] [--ray local|ADDRESS]
        [--cache-dir DIR]
    .venv/bin/python benchmarks/tune.py --full-size [--compile-min 15] [--nodes 1]

Tiny model, HTP v79 emulator, ``--items`` held-out items (the generated held-out set: no calibration item). The
base is the cheapest all-NPU build (w4a16 decoder, int8 vision and projector); the anchor is the uniform 8-bit build
(w8a16 decoder, a16w8 vision and projector). Two tunes:

* ``answers``: budget "answers as the reference on every item"; goal: the winner at most 0.85x the anchor's bytes;
* ``logits``: budget "logits SQNR at least the base's + 2 dB"; goal: the winner at most 1.15x the base's bytes.

Each reports its points (bytes, accuracy, answers as the reference, logits SQNR), its front, the winner, the
candidates it built and its wall time (a tune resumed from the store builds nothing: ``--cache-dir`` fresh for a
cold figure). ``--ray local`` starts a loopback Ray cluster (2 CPUs) and runs the ``logits`` tune again on it, on a
copy of the store without any measured point, and reports whether its front equals the in-process one.

``--full-size`` (FastVLM-0.5B dimensions, nothing compiled): per decoder layer and the lm_head the bytes of its
weights at each rung (int4 with LPBQ block 64 scales, int8, int16), the greedy path's candidate bytes when the
layers are raised one rung in order of size, and the projected search cost: candidates x ``--compile-min`` minutes
(a w4a16 decoder compile measured by benchmarks/npu_decoder.py), divided over ``--nodes`` Ray nodes with ``--beam``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
BASE = "all-npu,vision.precision=int8,projector.precision=int8,decoder.precision=w4a16"
ANCHOR = "w8=all-npu,decoder.precision=w8a16,vision.precision=a16w8,projector.precision=a16w8"
LPBQ_BLOCK = 64


def point_row(p) -> dict:
    return {"label": p.label, "bytes": p.bytes, "accuracy": p.accuracy, "answers_as_reference": p.answers_as_reference,
            "logits_sqnr_db": None if p.logits_sqnr_db is None else round(p.logits_sqnr_db, 3),
            "within_budget": p.within_budget, "on_front": p.on_front, "raised": p.layers, "anchor": p.anchor}


def run_tune(budget, args, store, ray_address=None) -> dict:
    from vlmrun import tune

    t0 = time.perf_counter()
    r = tune.tune(BASE, anchors=[ANCHOR], budget=budget, limit=args.items, max_candidates=args.max_candidates,
                  beam=args.beam, store=store, ray_address=ray_address)
    return {"result": r, "wall_s": round(time.perf_counter() - t0, 1), "built": r.built,
            "candidates": len(r.points), "points": [point_row(p) for p in r.points],
            "front": [p.label for p in r.front], "winner": r.winner.label if r.winner else None}


def start_local_ray() -> tuple[str, dict]:
    ray_cli = Path(sys.executable).with_name("ray")
    env = dict(os.environ, RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    subprocess.run([str(ray_cli), "start", "--head", "--num-cpus", "2", "--node-ip-address=127.0.0.1",
                    "--include-dashboard=false", "--disable-usage-stats", "--port", str(port)],
                   check=True, capture_output=True, env=env)
    return f"127.0.0.1:{port}", env


def tiny(args) -> dict:
    from vlmrun import tune
    from vlmrun.store import ArtifactStore

    store = ArtifactStore(args.cache_dir)
    answers = run_tune(tune.Budget.of(min_answers_as_reference=1.0), args, store)
    ra = answers.pop("result")
    base = next(p for p in ra.points if p.label == "base")
    anchor = next(p for p in ra.points if p.anchor)
    logits = run_tune(tune.Budget.of(min_logits_sqnr=round(base.logits_sqnr_db + 2.0, 3)), args, store)
    rl = logits.pop("result")
    out = {"model": "shapes-tiny (trained, 256x256)", "items": args.items, "base": BASE, "anchor": ANCHOR,
           "base_bytes": base.bytes, "base_logits_sqnr_db": round(base.logits_sqnr_db, 3),
           "anchor_bytes": anchor.bytes, "anchor_logits_sqnr_db": round(anchor.logits_sqnr_db, 3),
           "answers": answers, "logits": logits}
    if ra.winner is not None:
        out["answers"]["winner_bytes_over_anchor"] = round(ra.winner.bytes / anchor.bytes, 3)
        out["answers"]["goal_met"] = ra.winner.bytes <= 0.85 * anchor.bytes
    if rl.winner is not None:
        out["logits"]["winner_gain_db"] = round(rl.winner.logits_sqnr_db - base.logits_sqnr_db, 3)
        out["logits"]["winner_bytes_over_base"] = round(rl.winner.bytes / base.bytes, 3)
        out["logits"]["goal_met"] = (rl.winner.logits_sqnr_db - base.logits_sqnr_db >= 2.0
                                     and rl.winner.bytes <= 1.15 * base.bytes)
    if args.ray:
        copy = Path(tempfile.mkdtemp(prefix="vlmrun-tune-ray-"))
        for p in store.root.iterdir():
            if p.name not in ("eval", "tune"):
                (shutil.copytree if p.is_dir() else shutil.copy2)(p, copy / p.name)
        address, env = (start_local_ray() if args.ray == "local" else (args.ray, dict(os.environ)))
        os.environ.update(env)
        try:
            on_ray = run_tune(rl.budget, args, ArtifactStore(copy), ray_address=address)
        finally:
            import ray

            ray.shutdown()  # before the cluster stops: a connected driver prints the raylet's death on stdout
            if args.ray == "local":
                subprocess.run([str(Path(sys.executable).with_name("ray")), "stop", "--force"], capture_output=True)
            shutil.rmtree(copy, ignore_errors=True)
        on_ray.pop("result")
        same = [(p["label"], p["bytes"], p["answers_as_reference"]) for p in on_ray["points"]] == \
               [(p["label"], p["bytes"], p["answers_as_reference"]) for p in logits["points"]] and all(
            abs(a["logits_sqnr_db"] - b["logits_sqnr_db"]) < 1e-3 for a, b in zip(on_ray["points"], logits["points"]))
        out["ray"] = {"wall_s": on_ray["wall_s"], "built": on_ray["built"], "front": on_ray["front"],
                      "same_points_as_in_process": same, "same_front": on_ray["front"] == logits["front"]}
    return out


def full_size(args) -> dict:
    """Bytes per rung and per candidate of the greedy path at FastVLM-0.5B dimensions; nothing compiled."""
    from vlmrun.tiny import _text_kwargs

    V = 151936  # FastVLM-0.5B's vocabulary (Qwen2)
    t = _text_kwargs(True, V)
    H, inter = t["hidden_size"], t["intermediate_size"]
    nh, nkv = t["num_attention_heads"], t["num_key_value_heads"]
    D = H // nh
    per_layer = H * nh * D + 2 * H * nkv * D + nh * D * H + 3 * H * inter  # q, k, v, o, gate, up, down
    layers = {f"decoder.layer{i}": per_layer for i in range(t["num_hidden_layers"])}
    layers["decoder.lm_head"] = V * H

    def rung_bytes(params: int, rung: str) -> int:
        if rung == "w4":  # 4-bit weights + one 4-bit LPBQ block scale per 64 weights (per-channel scales aside)
            return params // 2 + params // LPBQ_BLOCK // 2
        return params * (1 if rung == "w8" else 2)

    ladder = ["w4", "w8", "a16w16"]
    base = sum(rung_bytes(p, "w4") for p in layers.values())
    order = sorted(layers, key=lambda n: -layers[n])  # no device sensitivity without compiling: largest first
    path, current = [], dict.fromkeys(layers, "w4")
    total = base
    for rung in ladder[1:]:
        for name in order:
            prev = current[name]
            current[name] = rung
            total += rung_bytes(layers[name], rung) - rung_bytes(layers[name], prev)
            path.append({"raised": f"{name}={rung}", "weight_bytes": total})
    per_candidate_min = args.compile_min
    steps = len(path)
    return {"model": "FastVLM-0.5B dimensions (vlmrun make-tiny --full-size)", "nothing_compiled": True,
            "params_per_layer": per_layer, "lm_head_params": V * H,
            "rung_bytes": {n: {r: rung_bytes(p, r) for r in ladder} for n, p in
                           [("decoder.layer*", per_layer), ("decoder.lm_head", V * H)]},
            "uniform_w4_weight_bytes": base, "uniform_w8_weight_bytes": sum(layers.values()),
            "greedy_path_candidates": steps, "greedy_path": path[:6] + path[-2:],
            "projected_cost": {"compile_min_per_candidate": per_candidate_min, "peak_rss_gb_per_candidate": 17,
                               "nodes": args.nodes, "beam": args.beam,
                               "worst_case_hours": round(steps * per_candidate_min / 60 / max(1, min(args.nodes,
                                                                                                    args.beam)), 1),
                               "typical_hours_12_candidates": round(12 * per_candidate_min / 60
                                                                    / max(1, min(args.nodes, args.beam)), 1)}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=16)
    ap.add_argument("--max-candidates", type=int, default=12)
    ap.add_argument("--beam", type=int, default=1)
    ap.add_argument("--ray", metavar="local|ADDRESS")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--full-size", action="store_true")
    ap.add_argument("--compile-min", type=float, default=15.0)
    ap.add_argument("--nodes", type=int, default=1)
    args = ap.parse_args(argv)
    print(json.dumps(full_size(args) if args.full_size else tiny(args), indent=1))


if __name__ == "__main__":
    main()
