"""Conversations: time to first token of follow-up turns with the decoder's state kept against recomputed from scratch.

    .venv/bin/python benchmarks/chat.py [--layouts reference-full,all-npu,bundle] [--turns 4] [--repeat 3]
        [--tokens 16] [--bundle-tokens 64] [--warmup 1] [--cache-dir DIR] [--bundle-dir DIR]

A conversation of ``--turns`` turns (turn 1: the demo picture and "Describe the image."; each later turn about 20
new prompt tokens and no picture), every turn greedy with EOS ignored and ``--tokens`` new tokens (a bundle: see
below), once with the
decoder's state kept between turns (``pipe.chat(keep_state=True)``) and once recomputed from the start every turn
(``keep_state=False``: the same tokens). Per turn (median over ``--repeat`` conversations, after ``--warmup``
untimed ones):

* ``first_turn_ms`` (turn 1) = vision_ms + projector_ms + embed_ms + ttft_ms: the picture through its stages, then
  the decoder's prefill up to the first token;
* ``follow_up_ms`` (turns 2..N) = the stages the turn ran (embed; vision and projector only for a new picture) +
  ttft_ms (the prefill of the positions the kept state does not hold);
* ``ratio`` = follow_up_ms / first_turn_ms of the same conversation (the goals: <= 0.10 on the reference layout at
  FastVLM-0.5B dimensions, <= 0.20 on the tiny model's all-npu layout and its bundle).

Stage times are the host's wall clock (``<stage>_wall_ms`` when a backend reports a device time instead). A bundle
runs each turn whole through Genie's pipeline (no stage timings): its ``ttft_ms`` runs from the turn's start and
includes the picture in turn 1. The bundle's turns honour EOS, with a budget (``--bundle-tokens``) the tiny model's
answers end well before, so that its answers are the conversation a user has; the other layouts ignore EOS.

Layouts: ``reference-full`` = the reference layout on the random-weight FastVLM at 0.5B dimensions (``vlmrun
make-tiny --full-size``, built once into ``<cache-dir>/full-size-fastvlm``; the answers are gibberish, which does
not matter here); ``all-npu`` = the tiny default model on the HTP emulator (vlmrun's parts engine, the preset's
fp16 decoder); ``all-npu-w4a16`` = the same with the phone's decoder precision (``decoder.precision=w4a16``, the
bundle's); ``bundle`` = the
tiny default model's all-npu bundle (written once into ``--bundle-dir``, default ``<cache-dir>/chat-bundle``; a
bundle whose decoder lacks the follow-up graph the layout now compiles is written again). Prints one JSON object on stdout
(progress on stderr): per layout the model's dimensions, the per-turn figures kept vs scratch, the ratios,
``goal_met``, the bytes a kept conversation holds, and whether kept and scratch generated the same tokens per turn;
for all-npu also the decoder's prompt ARs (``decoder_ars``: AR-128 and the follow-up AR-32 of the parts form) and
the graph calls per AR each turn made (``graph_calls``, from the handle's ``calls_per_ar``).
Timings on a 2-core x86_64 machine (the HTP emulator is not a phone) are noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

FIRST_PROMPT = "Describe the image."
FOLLOW_UPS = ["What color is the shape?", "Where is the shape?", "Is it large or small?",
              "What is in the background?", "Describe it again, briefly."]
GOALS = {"reference-full": 0.10, "all-npu": 0.20, "all-npu-w4a16": 0.20, "bundle": 0.20}
#: the all-npu layouts measured, by name: the preset (an fp16 decoder) and the phone's decoder precision
NPU_LAYOUTS = {"all-npu": "all-npu", "all-npu-w4a16": "all-npu,decoder.precision=w4a16"}
LAYOUTS = tuple(GOALS)


def log(msg: str) -> None:
    print(f"[chat] {msg}", file=sys.stderr, flush=True)


def prompts(turns: int) -> list[str]:
    return [FIRST_PROMPT] + [FOLLOW_UPS[i % len(FOLLOW_UPS)] for i in range(turns - 1)]


def stage_ms(timings: dict, stage: str) -> float:
    """The host's wall clock of a stage this turn ran (0: it did not run)."""
    v = timings.get(f"{stage}_wall_ms", timings.get(f"{stage}_ms"))
    return float(v) if isinstance(v, (int, float)) else 0.0


def graph_calls(pipe) -> dict:
    """The decoder's graph calls so far per AR (``calls_per_ar`` of a parts handle; ``{}`` elsewhere)."""
    return dict(getattr(pipe.handles.get("decoder"), "calls_per_ar", None) or {})


def conversation(pipe, picture, turns: int, settings, keep: bool) -> dict:
    """One conversation of ``turns`` turns: per turn its figures and tokens; the bytes its kept state holds."""
    chat = pipe.chat(settings=settings, keep_state=keep)
    out = []
    for i, prompt in enumerate(prompts(turns)):
        before = graph_calls(pipe)
        t0 = time.perf_counter()
        gen = chat.ask(prompt, image=picture if i == 0 else None).run()
        wall = (time.perf_counter() - t0) * 1e3
        after = graph_calls(pipe)
        t = gen.timings
        stages = {s: stage_ms(t, s) for s in ("vision", "projector", "embed")}
        out.append({
            "ms": sum(stages.values()) + float(t["ttft_ms"]),  # first_turn_ms (turn 1) / follow_up_ms (later)
            "ttft_ms": float(t["ttft_ms"]), **{f"{s}_ms": v for s, v in stages.items()},
            "turn_wall_ms": wall,
            "prompt_tokens": int(t.get("prompt_tokens", 0)), "prefill_tokens": int(t.get("prefill_tokens", 0)),
            "reused_tokens": int(t.get("reused_tokens", 0)), "new_tokens": int(t.get("new_tokens", 0)),
            "stopped_by": gen.stopped_by,
            "token_ids": list(gen.token_ids),
            "graph_calls": {str(ar): n - before.get(ar, 0) for ar, n in sorted(after.items(), reverse=True)},
        })
    result = {"turns": out, "kept_bytes": int(chat.kept.nbytes), "keeps_state": chat.keeps_state,
              "positions_held": chat.tokens}
    close = getattr(chat.kept, "close", None)  # a runtime's kept state may hold a worker process
    if close is not None:
        close()
    return result


def median(values) -> float:
    return round(float(statistics.median(values)), 2)


def summarise(runs: list[dict], goal: float) -> dict:
    """Per turn the median over the runs of each figure, and of the per-run ratio follow_up/first_turn."""
    n = len(runs[0]["turns"])
    per_turn = []
    for k in range(n):
        rows = [r["turns"][k] for r in runs]
        entry = {"turn": k + 1}
        entry["first_turn_ms" if k == 0 else "follow_up_ms"] = median(r["ms"] for r in rows)
        for key in ("ttft_ms", "vision_ms", "projector_ms", "embed_ms", "turn_wall_ms"):
            entry[key] = median(r[key] for r in rows)
        for key in ("prompt_tokens", "prefill_tokens", "reused_tokens", "new_tokens", "stopped_by"):
            vals = sorted({r[key] for r in rows})
            entry[key] = vals[0] if len(vals) == 1 else vals
        if rows[0]["graph_calls"]:
            entry["graph_calls"] = rows[0]["graph_calls"]
        if k:
            ratio = statistics.median(r["turns"][k]["ms"] / r["turns"][0]["ms"] for r in runs)
            entry["ratio"] = round(float(ratio), 4)
            entry["goal_met"] = bool(ratio <= goal)
        per_turn.append(entry)
    return {"turns": per_turn, "kept_bytes": runs[-1]["kept_bytes"], "keeps_state": runs[-1]["keeps_state"],
            "positions_held": runs[-1]["positions_held"]}


def model_dims(pipe) -> dict:
    m = pipe.model
    return {"image_size": m.image_size, "image_tokens": m.image_tokens, "vision_features": m.feature_dim,
            "hidden_size": m.hidden_size, "layers": m.num_layers, "heads": m.num_heads, "kv_heads": m.num_kv_heads,
            "head_dim": m.head_dim, "vocab_rows": m.vocab_size, "context_length": pipe.context_length}


def decoder_ars(pipe) -> dict:
    """The prompt graphs' ARs of a parts decoder (a bundle's from its manifest), ``{}`` for other decoders."""
    h = pipe.handles.get("decoder")
    parts = getattr(getattr(h, "artifact", None), "manifest", {}).get("decoder_parts")
    if parts:
        return {"decoder_ars": {"prompt": parts["ar"], "followup": parts.get("followup_ar", 0)}}
    runtime = getattr(h, "runtime", None)
    if runtime is not None:
        d = runtime.manifest.get("decoder", {})
        return {"decoder_ars": {"prompt": d.get("ar"), "followup": d.get("followup_ar", 0)}}
    return {}


def stale_bundle(out: Path) -> str:
    """Why the bundle in ``out`` is not the one today's code writes ('' when it is, or when there is none): a
    decoder without the follow-up prompt graph the all-npu layout now compiles."""
    from vlmrun import layouts, plugins

    manifest = out / layouts.BUNDLE_MANIFEST
    if not manifest.is_file():
        return ""
    declared = plugins.default().options.for_stage("qnn_htp", "decoder", "qnn_htp").get("followup_ar")
    want = int(declared.default) if declared is not None and declared.default is not None else 0
    have = int(json.loads(manifest.read_text()).get("decoder", {}).get("followup_ar") or 0)
    return f"its decoder has follow-up AR {have}, the all-npu layout compiles {want}" if have != want else ""


def build(name: str, args, store):
    """The pipeline of one benchmark layout (building what it needs once: the full-size model, the bundle)."""
    from vlmrun import Pipeline, layouts
    from vlmrun.model import FastVLMModel, default_model
    from vlmrun.progress import step

    if name == "reference-full":
        path = Path(args.cache_dir) / "full-size-fastvlm"
        if not (path / "config.json").is_file():
            from vlmrun.tiny import make_tiny

            with step("building the full-size random FastVLM (once)"):
                make_tiny(path, image_size=args.image_size, full_size=True)
        model = FastVLMModel.open(path, store)
        return Pipeline.build(model, "reference", store=store, progress=step), {
            "model": f"FastVLM-0.5B dimensions, random weights ({path})", "layout": "reference"}
    model = default_model(store, 256)
    if name in NPU_LAYOUTS:
        return Pipeline.build(model, NPU_LAYOUTS[name], store=store, progress=step), {
            "model": "tiny default (256x256)", "layout": NPU_LAYOUTS[name]}
    out = Path(args.bundle_dir or Path(args.cache_dir) / "chat-bundle")
    stale = stale_bundle(out)
    if stale:
        import shutil

        log(f"{out}: {stale}; writing it again")
        shutil.rmtree(out)
    if not (out / layouts.BUNDLE_MANIFEST).is_file():
        from vlmrun.bundle import write

        with step(f"writing the all-npu bundle to {out} (once)"):
            write(layouts.resolve("all-npu"), out, model=model, store=store, progress=step)
    return Pipeline.build(model, f"bundle:{out}", store=store, progress=step), {
        "model": "tiny default (256x256)", "layout": f"bundle:{out} (all-npu)"}


def measure(name: str, args, store) -> dict:
    from vlmrun import GenerationSettings
    from vlmrun.conversation import Picture
    from vlmrun.demo_image import demo_image

    t0 = time.perf_counter()
    pipe, about = build(name, args, store)
    build_s = time.perf_counter() - t0
    picture = Picture.of(demo_image(), pipe.model.image_processor_config)  # preprocessed once, outside the timing
    if name == "bundle":  # Genie keeps a conversation only after a turn it finished itself (see the docstring)
        settings = GenerationSettings(max_new_tokens=args.bundle_tokens)
    else:
        settings = GenerationSettings(max_new_tokens=args.tokens, ignore_eos=True)
    for w in range(args.warmup):
        log(f"{name}: warm-up conversation {w + 1}/{args.warmup}")
        conversation(pipe, picture, args.turns, settings, keep=True)
    kept, scratch = [], []
    for r in range(args.repeat):
        order = (True, False) if r % 2 == 0 else (False, True)  # alternate, so drift does not favour one side
        for keep in order:
            log(f"{name}: repeat {r + 1}/{args.repeat}, {'kept state' if keep else 'from scratch'}")
            (kept if keep else scratch).append(conversation(pipe, picture, args.turns, settings, keep))
    goal = GOALS[name]
    k, s = summarise(kept, goal), summarise(scratch, goal)
    same = [all(a["turns"][t]["token_ids"] == b["turns"][t]["token_ids"] for a, b in zip(kept, scratch))
            for t in range(args.turns)]
    follow = k["turns"][1:]
    result = {
        **about, "dims": model_dims(pipe), **decoder_ars(pipe), "build_s": round(build_s, 1), "goal_ratio": goal,
        "max_new_tokens": settings.max_new_tokens, "ignore_eos": settings.ignore_eos,
        "kept": k, "scratch": s,
        "ratios_kept": [t["ratio"] for t in follow], "ratios_scratch": [t["ratio"] for t in s["turns"][1:]],
        "follow_up_speedup": [round(b["follow_up_ms"] / a["follow_up_ms"], 2) for a, b in zip(follow, s["turns"][1:])],
        "goal_met": bool(follow) and all(t["goal_met"] for t in follow),
        "goal_met_per_turn": [t["goal_met"] for t in follow],
        "kept_bytes_per_conversation": k["kept_bytes"],
        # a bundle's kept bytes are a worker's resident set, not a figure per position
        "kept_bytes_per_position": (round(k["kept_bytes"] / k["positions_held"], 1)
                                    if k["positions_held"] and name != "bundle" else None),
        "scratch_bytes_per_conversation": s["kept_bytes"],
        "same_tokens_per_turn": same,
        "differing_tokens": {  # the first pair of conversations that differ, per turn
            str(t + 1): next({"kept": x["turns"][t]["token_ids"], "scratch": y["turns"][t]["token_ids"]}
                             for x, y in zip(kept, scratch) if x["turns"][t]["token_ids"] != y["turns"][t]["token_ids"])
            for t in range(args.turns) if not same[t]},
        "tokens_turn1": kept[0]["turns"][0]["token_ids"],
    }
    if not k["keeps_state"]:
        result["note"] = ("the decoder keeps no state between turns on this layout: every turn is computed from the"
                          " start, kept and scratch alike")
    elif name == "bundle":
        result["note"] = ("the kept bytes of a bundle's conversation are the resident set of the Genie worker kept"
                          " alive between turns (the loaded bundle and runtime), not KV bytes")
    log(f"{name}: ratios kept {result['ratios_kept']}, scratch {result['ratios_scratch']},"
        f" goal {goal}: {'met' if result['goal_met'] else 'NOT met'}")
    return result


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help=f"comma-separated, of {', '.join(LAYOUTS)}")
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=3, help="conversations per mode; the figures are medians")
    ap.add_argument("--warmup", type=int, default=1, help="untimed conversations first (page-in, arena growth)")
    ap.add_argument("--tokens", type=int, default=16, help="new tokens every turn (EOS ignored)")
    ap.add_argument("--bundle-tokens", type=int, default=64,
                    help="the bundle's budget per turn (EOS honoured: each answer must end before it)")
    ap.add_argument("--image-size", type=int, default=1024, help="the full-size model's picture size")
    ap.add_argument("--cache-dir", default=os.path.join(os.path.expanduser("~"), ".cache", "vlmrun-bench"))
    ap.add_argument("--bundle-dir", help="the all-npu bundle's folder (default: <cache-dir>/chat-bundle)")
    a = ap.parse_args(argv)
    names = [n for n in a.layouts.split(",") if n]
    unknown = [n for n in names if n not in GOALS]
    if unknown:
        ap.error(f"unknown layouts {unknown}; choose from {', '.join(LAYOUTS)}")
    if a.turns < 2 or a.repeat < 1 or a.tokens < 1:
        ap.error("--turns must be at least 2, --repeat and --tokens at least 1")
    from vlmrun.store import ArtifactStore

    store = ArtifactStore(a.cache_dir)
    t0 = time.perf_counter()
    out = {"benchmark": "chat", "turns": a.turns, "repeat": a.repeat, "warmup": a.warmup, "new_tokens": a.tokens,
           "prompts": prompts(a.turns), "cache_dir": a.cache_dir, "layouts": {}}
    for name in names:
        log(f"{name}: building")
        t1 = time.perf_counter()
        try:
            out["layouts"][name] = measure(name, a, store)
        except Exception as e:  # noqa: BLE001 -- one layout's failure is reported, the others still run
            import traceback

            traceback.print_exc()
            out["layouts"][name] = {"error": f"{type(e).__name__}: {e}"}
        out["layouts"][name]["wall_s"] = round(time.perf_counter() - t1, 1)
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
