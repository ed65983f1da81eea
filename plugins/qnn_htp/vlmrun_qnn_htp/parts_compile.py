"""Compiling the decoder in the form Qualcomm ships LLMs to the HTP (``decoder_form = "parts"``).

Form (export ``decoder/parts``, `vlmrun_ort_reference.decoder_parts`; plan: `vlmrun_qualcomm.parts`):

* the decoder split into P parts of consecutive layers, the last part with the final norm and the lm_head;
* each part as two graphs in Genie's I/O layout: "prompt" (AR-N rows, default 128, capped at the hidden size
  because Genie reads AR from embedding inputs as elements / largest dim) and "token" (AR-1), all at one fixed
  context C, and with ``followup_ar`` (default 32) a third, "followup": a second prompt graph of fewer rows
  (AR-32), exported with the other two (`parts_form`; the part's three graphs keep one copy of its weights on
  disk, `vlmrun_ort_reference.part_weights`), so that a short prompt such as a conversation's next turn costs one small call
  (`.genie_engine.GenieLayoutDecoder` picks the smallest graph covering the rows left); inputs ``inputs_embeds`` (first part) or ``residual_{lo}`` (the residual stream from the previous
  part), ``attention_mask`` [1,T,C], ``position_ids_cos``/``_sin``, the part's past keys (transposed,
  [KV,1,D,C-T]) and values; outputs only the NEW keys/values of the part's layers, plus ``residual_{hi}`` or,
  from the last part, ``logits``;
* graph names ``{prompt|token}_ar{T}_cl{C}_..._{k}_of_{P}`` (`.genie_names`): Genie orders the parts of one
  (AR, CL) by that suffix;
* precision ``fp16``, ``w8a16`` or ``w4a16``: 16-bit activations with int8 or int4 weights, quantized by the stage's
  recipe (`.quantizer`: onnxruntime per-channel, or AIMET with LPBQ / Sequential MSE / AdaRound).
  Calibration (`.calibration.parts_calibration_feeds`): the host loop over the float part graphs on the CPU;
* ``weight_sharing``: ``on`` puts each part's graphs (prompt, token, followup) in ONE context binary that holds
  the weights once (onnxruntime-qnn ``ep.share_ep_contexts``: one ``.bin`` per part, a ``_ctx.onnx`` wrapper per
  graph);
  ``off`` compiles each graph into its own binary (the same graphs, the weights twice). ``auto`` (default) is
  ``on`` except on the x86_64 HTP emulator, which cannot load weight-shared binaries (`.parts_run`).

Each part is made (quantized, compiled, named) by `make_part` from one picklable `PartJob`, through the compile
context's ``map``: in the compiling process, in order, or with ``vlmrun bundle --ray ADDRESS`` as Ray tasks, each
declaring its memory (`part_memory_bytes`); the calibration feeds are recorded first, on the driver. Every compiled
part is checked against the part limit. `compile_part_probe` compiles one part's probe graph
(``vlmrun diff --locate``) with the same recipe and calibration feeds.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import attrs

from vlmrun.errors import BackendError
from vlmrun_qualcomm import socs
from vlmrun_qualcomm.manifest import ContextManifest, describe_ctx_onnx
from vlmrun_qualcomm.parts import (FOLLOWUP, check_part_limits, exported_followup_ar, graph_digest,
                                   part_graphs, weight_bytes)

from vlmrun.stages import CompileContext, ExportForm

from . import calibration, ep, image_encoder
from .genie_names import genie_name, rename_graph, rewrite_wrapper
from .layers import LAYER_OPTIONS, part_keep
from .memory import part_peak_bytes, peak_rss_mb, release_memory
from .options import compiled_artifact, parts_plan
from .parts_resume import MadeParts, keep
from .quantizer import is_big, quantize
from .recipe import from_key



def parts_form(plan: dict, opts) -> ExportForm:
    """The ``decoder/parts`` export of ``plan`` (`.options.parts_plan`): prompt graphs of the plan's AR, token graphs
    and, when the plan has a follow-up AR, the follow-up graphs (``opts``: the decoder's normalised options,
    `.options.stage_options`)."""
    extra = {"followup": plan["followup_ar"]} if plan["followup_ar"] else {}
    return ExportForm.of("decoder", "decoder/parts", ar=plan["ar"], ctx=plan["ctx"],
                         layers=",".join(map(str, plan["layers"])), rmsnorm=opts["rmsnorm"], **extra)


def parts_artifact(ctx, stage_plan):
    """The decoder's compiled parts artifact through the store (``ctx``: the stage's context, ``stage_plan``: its
    `.plan.StagePlan`), from the export `parts_form` names (with the plan's follow-up graphs, which every compiler
    reads from the same export: here, or ``--compiler qaihub`` on AI Hub)."""
    opts = stage_plan.opts
    plan = parts_plan(ctx.model, opts)
    return compiled_artifact(ctx, "decoder", opts, parts_form(plan, opts))


def graph_sources(src_dir: Path, p: dict) -> dict:
    """``{kind: (ONNX file, rows, Genie name)}`` of part ``p``'s graphs: prompt, token and, when exported, its
    follow-up prompt graph as "followup" (`vlmrun_qualcomm.parts.part_graphs`)."""
    return {kind: (Path(src_dir) / g["file"], g["ar"], g["name"]) for kind, g in part_graphs(p).items()}


def binary_names(k: int, P: int, kinds, share: bool) -> list[str]:
    """The binary of each graph of part ``k`` in ``kinds`` order: one per part when weight-shared, else one per
    graph."""
    return [f"part{k}_of_{P}_qnn.bin" if share else f"part{k}_of_{P}_{kind}_qnn.bin" for kind in kinds]


def _layers(options: dict, k: int, kind: str) -> dict:
    """This graph's entries of the per-layer options (``keep_fp``, ``keep_a16w16``, ``keep_w8``, ``keep_w4``); the
    follow-up graph takes the prompt graph's (the same module exported at fewer rows: the same node names)."""
    kind = "prompt" if kind == FOLLOWUP else kind
    return {o: e for o in LAYER_OPTIONS if (e := part_keep(options.get(o), k, kind))}


def _quantize_facts(facts: dict, q_times: dict, q_peaks: dict, per_layer: dict, where: str) -> dict:
    """Move a graph's times, peaks and per-layer counts out of ``facts`` into the stage-wide tables."""
    for step, sec in facts.pop("times", {}).items():  # where the quantization time goes
        q_times[step] = q_times.get(step, 0.0) + sec
    for step, mb in facts.pop("peak_rss_mb_after", {}).items():  # and the memory (running peak)
        q_peaks[f"{where}_{step}"] = mb
    for option in ("kept_fp", "a16w16", "keep_w8", "keep_w4"):  # per-layer precision: what each graph got
        if option in facts:
            per_layer.setdefault(option, {})[where] = facts.pop(option)
    return facts


@attrs.frozen
class PartJob:
    """Everything a process needs to quantize, compile and name the graphs of one part (picklable: with ``vlmrun
    bundle --ray`` a Ray task makes it; every path is in the store or the compile's work dir, which every node sees
    at the same path)."""

    part: dict  # the part's entry of parts.json (index, layers)
    count: int  # P
    sources: dict  # {kind: (ONNX file, rows, Genie name)}: `graph_sources`
    feeds: dict  # {kind: the .npz of its calibration feeds}, empty when not quantized
    options: dict  # the compile's keyed options
    work: str  # the compile's work dir
    out_dir: str
    keep: str | None = None  # where the part is kept once made (`.parts_resume`), None: not kept

    @property
    def name(self) -> str:
        return f"decoder part {self.part['index']}/{self.count}"


def make_part(job: PartJob) -> dict:
    """Quantize (by the options' recipe), compile (one binary per part when weight-shared: the part's graphs in
    consecutive sessions of this process) and name for Genie the graphs of ``job``'s part in ``job.out_dir``: the
    part's manifest entry, its wrappers and graph names, and the facts of the steps (times, peaks, per-layer)."""
    options, k, P, out_dir = job.options, job.part["index"], job.count, Path(job.out_dir)
    work = Path(job.work) / f"part{k}"  # its own: parts made at once do not share the quantizer's scratch files
    work.mkdir(parents=True, exist_ok=True)
    soc, precision, recipe = socs.soc(options.get("soc")), options["precision"], from_key(options)
    share = options["weight_sharing"] == "on"
    embeds = image_encoder.parse_embeds_input(options.get("embeds_input"))
    res = {"q_times": {}, "q_peaks": {}, "per_layer": {}, "facts": None, "quant_s": 0.0, "graph_s": {},
           "process": _process()}
    kinds = list(job.sources)
    big = any(is_big(Path(job.sources[kind][0])) for kind in kinds)
    srcs = {}
    for kind in kinds:
        srcs[kind] = Path(job.sources[kind][0])
        if recipe is not None:
            t0 = time.perf_counter()
            dst = work / f"part{k}_{kind}.qdq.onnx"
            facts = quantize(srcs[kind], dst, Path(job.feeds[kind]), recipe, work, _layers(options, k, kind))
            res["facts"] = _quantize_facts(facts, res["q_times"], res["q_peaks"], res["per_layer"], f"part{k}_{kind}")
            srcs[kind] = dst
            release_memory(big)
            res["quant_s"] += time.perf_counter() - t0
    if embeds is not None and k == 1:  # a bundle's decoder: the embeddings come in quantized (uint16)
        for kind in kinds:
            dst = work / f"part{k}_{kind}.embeds16.onnx"
            image_encoder.with_quantized_input(srcs[kind], dst, embeds, "inputs_embeds")
            srcs[kind] = dst
    t0 = time.perf_counter()
    entry = {"index": k, "layers": job.part["layers"], "graphs": {}, "binaries": [],
             "source_sha256": {kind: graph_digest(srcs[kind]) for kind in srcs}}
    for i, kind in enumerate(kinds):
        wrapper = out_dir / f"part{k}_of_{P}_{kind}_ctx.onnx"
        what = f"decoder part {k}/{P} {kind} graph ({precision})"
        t_graph = time.perf_counter()
        _compile(srcs[kind], wrapper, soc, share, i == len(kinds) - 1, what)
        res["graph_s"][kind] = time.perf_counter() - t_graph
        release_memory(big)
        res["q_peaks"][f"part{k}_{kind}_qnn_compile"] = peak_rss_mb()
        info = describe_ctx_onnx(wrapper)
        if info["non_qnn_nodes"] or len(info["graphs"]) != 1 or len(info["binaries"]) != 1:
            raise BackendError(f"{what}: expected one EPContext graph on QNN, got {info['graphs']}"
                               f" ({', '.join(info['non_qnn_nodes'][:3]) or 'no other nodes'})")
        entry["graphs"][kind] = {"wrapper": wrapper.name, "ort_graph": info["graphs"][0],
                                 "binary": info["binaries"][0], "ar": job.sources[kind][1],
                                 "inputs": info["inputs"], "outputs": info["outputs"]}
    res["compile_s"] = time.perf_counter() - t0
    # name the binaries and the graphs as Genie wants them
    names = binary_names(k, P, kinds, share)
    res["wrappers"], res["graphs"] = [], []
    for kind, new_bin in zip(kinds, names):
        g = entry["graphs"][kind]
        if (out_dir / g["binary"]).exists() and g["binary"] != new_bin:
            (out_dir / g["binary"]).rename(out_dir / new_bin)
        g["binary"] = new_bin
        g["name"] = genie_name(job.sources[kind][2], g["ort_graph"])
        rename_graph(out_dir / new_bin, g["ort_graph"], g["name"])
        rewrite_wrapper(out_dir / g["wrapper"], g["name"], new_bin)
        res["wrappers"].append(g["wrapper"])
        res["graphs"].append(g["name"])
    entry["binaries"] = sorted(set(names), key=names.index)
    entry["bytes"] = sum((out_dir / b).stat().st_size for b in entry["binaries"])
    res["entry"] = entry
    keep(job.keep, res, out_dir)
    # the part's quantized graphs are in its binaries now: its scratch goes (at 7B, 2.1 GB a part, which the ten
    # parts' scratch together, kept until the compile's end, would have taken from a disk the float graphs fill)
    shutil.rmtree(work, ignore_errors=True)
    return res


def _process() -> dict:
    """Where a part is made: host, process and, in a Ray task, the Ray node."""
    import socket

    out = {"host": socket.gethostname(), "pid": os.getpid()}
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        try:
            out["ray_node"] = ray.get_runtime_context().get_node_id()
        except Exception:  # noqa: BLE001 - a fact, not a requirement
            pass
    return out


def part_memory_bytes(model, recipe, layers: int, last: bool) -> int:
    """What the task making one part declares to Ray: `.memory.part_peak_bytes`, at least 1 GiB."""
    return max(1 << 30, part_peak_bytes(model, recipe.quantizer if recipe is not None else None, layers, last))


def compile_parts(model, source, options: dict, out_dir: Path, *, calibration_order: str, context=None,
                  rebuild: bool = False) -> dict:
    """Compile every part of the ``decoder/parts`` export ``source`` into ``out_dir``; the manifest.
    ``calibration_order``: the option (`.calibration.calibration_order`); it does not key the binary.
    The feeds and each part are kept as they are made (`.parts_resume`): a compile of the same artifact stopped
    part-way starts again from them (``rebuild``: from nothing).

    The calibration feeds of every part are recorded here (the host loop needs the reference pipeline), then each
    part is made by `make_part` as one job of ``context.map``: in this process, in order, or (``vlmrun bundle
    --ray``) as Ray tasks, each declaring `part_memory_bytes`; the work dir is then ``context.work_dir()``, in the
    store. When a part was made in another process, ``part_processes`` says where."""
    soc = socs.soc(options.get("soc"))
    precision = options["precision"]
    recipe = from_key(options)
    share = options["weight_sharing"] == "on"  # the parts form's compile key always names it, resolved
    embeds = image_encoder.parse_embeds_input(options.get("embeds_input"))
    src_dir = source.path
    desc = json.loads((src_dir / "parts.json").read_text())
    if desc.get("probe_part"):  # one part's probe graph (vlmrun diff --locate)
        return compile_part_probe(model, source, options, out_dir, calibration_order, context=context)
    P, ar, ctx = len(desc["parts"]), desc["ar"], desc["ctx"]
    limit = int(options["part_limit_mb"]) * 1_000_000
    jobs_at = context if context is not None else CompileContext()  # the base: in this process, a /tmp work dir
    work = Path(jobs_at.work_dir("vlmrun-qnn-parts-"))
    kept = MadeParts.for_compile(context, rebuild)
    extra: dict = {}
    t_all = time.perf_counter()
    try:
        feeds, label, quant_s, q_times, q_peaks = {}, None, 0.0, {}, {}
        recorded = kept.feeds() if recipe is not None else None
        if recorded is not None:
            feeds, label = recorded
            with context.progress(f"calibration feeds of {P} part(s): recorded by an earlier compile, taken"):
                pass
        elif recipe is not None:
            t0 = time.perf_counter()
            files = calibration.calibration_files(options.get("calibration_images"))
            # on disk as they are made, until their graph is quantized: one graph's feeds in memory at a time
            feeds, label = calibration.parts_calibration_feeds(model, src_dir, desc, files,
                                                               calibration.require_context(context),
                                                               calibration_order, into=kept.feeds_dir(work))
            feeds = kept.keep_feeds({key: str(path) for key, path in feeds.items()}, label)
            context.release_reference()  # its image encoder's session would outlive every quantization below
            release_memory(any(is_big(src_dir / p["graphs"]["prompt"]["file"]) for p in desc["parts"]))
            quant_s += time.perf_counter() - t0
            q_times["record_feeds_s"] = time.perf_counter() - t0
            q_peaks["record_feeds"] = peak_rss_mb()
        jobs = []
        for p in desc["parts"]:
            sources = {kind: (str(f), rows, name) for kind, (f, rows, name)
                       in graph_sources(src_dir, p).items()}
            jobs.append(PartJob(part={"index": p["index"], "layers": p["layers"]}, count=P, sources=sources,
                                feeds={kind: feeds[(p["index"], kind)] for kind in sources if feeds},
                                options=dict(options), work=str(work), out_dir=str(out_dir),
                                keep=kept.part_dir(p["index"])))
        made = {j.part["index"]: kept.made(j.part["index"], Path(out_dir)) for j in jobs}
        for j in jobs:
            if made[j.part["index"]] is not None:
                with context.progress(f"{j.name}: made by an earlier compile, taken ({j.keep})"):
                    pass
        todo = [(j, part_memory_bytes(model, recipe, len(j.part["layers"]), j.part["index"] == P)) for j in jobs
                if made[j.part["index"]] is None]
        results = jobs_at.map(make_part, [j for j, _ in todo], [m for _, m in todo], [j.name for j, _ in todo])
        if len(todo) < len(jobs):
            extra["resumed_parts"] = sorted(k for k, r in made.items() if r is not None)
        made.update({j.part["index"]: r for (j, _), r in zip(todo, results)})
        made = [made[j.part["index"]] for j in jobs]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    parts, wrappers, binaries, graphs, facts, per_layer = [], [], [], [], None, {}
    compile_s, graph_s = 0.0, {}
    for r in made:  # the facts of every part, in part order (as one process gathers them)
        for step, sec in r["q_times"].items():
            q_times[step] = q_times.get(step, 0.0) + sec
        q_peaks.update(r["q_peaks"])
        for option, where in r["per_layer"].items():
            per_layer.setdefault(option, {}).update(where)
        facts = r["facts"] if r["facts"] is not None else facts
        quant_s += r["quant_s"]
        compile_s += r["compile_s"]
        for kind, sec in r["graph_s"].items():
            graph_s[kind] = graph_s.get(kind, 0.0) + sec
        wrappers += r["wrappers"]
        graphs += r["graphs"]
        binaries += r["entry"]["binaries"]
        parts.append(r["entry"])
    elsewhere = [r["process"]["pid"] != os.getpid() or r["process"]["host"] != _process()["host"]
                 for j, r in zip(jobs, made) if j.part["index"] not in extra.get("resumed_parts", ())]
    if any(elsewhere):
        extra["part_processes"] = {j.name: r["process"] for j, r in zip(jobs, made)}
    out_dir = Path(out_dir)
    kept.done()  # a part over the limit is over it again on the next try
    check_part_limits(out_dir, parts, limit)
    weights = weight_bytes(model, precision)
    total = sum(e["bytes"] for e in parts)
    first, last = parts[0]["graphs"]["prompt"], parts[-1]["graphs"]["prompt"]
    extra["decoder_parts"] = {
        "ar": ar, "ctx": ctx, "parts": parts, "count": P, "layers": desc["layers"],
        "followup_ar": exported_followup_ar(desc), "graph_compile_s": {k: round(v, 3) for k, v in graph_s.items()},
        "graph_bytes": graph_bytes(out_dir, parts, share),
        "weight_sharing": share, "graphs_per_binary": len(parts[0]["graphs"]) if share else 1,
        "binaries_in_order": binaries, "total_bytes": total, "limit_bytes": limit,
        "weight_bytes": weights, "bytes_over_weights": round(total / weights, 4),
        "loads_on_emulator": not share,
    }
    if embeds is not None:
        extra["decoder_parts"]["embeds_input"] = embeds
    extra["peak_rss_mb_after"] = q_peaks  # the compile's running peak after each step (where the memory goes)
    if recipe is not None:
        extra["quantization"] = {**(facts or {}), **per_layer, "mask_range": f"[{calibration.MASK_CLIP:g}, 0]",
                                 "calibration": label, "quantize_s": round(quant_s, 3),
                                 "times": {k: round(v, 3) for k, v in q_times.items()}}
    return ContextManifest(
        files=[*wrappers, *binaries], graphs=graphs, inputs=first["inputs"], outputs=last["outputs"],
        stage="decoder", precision=precision, compiler="qnn_htp", qnn_version=ep.qnn_version(),
        ep_sdk_version=describe_ctx_onnx(out_dir / wrappers[0])["ep_sdk_version"], soc=soc.name,
        soc_model=soc.soc_model, arch=soc.arch, source_form=source.manifest.get("form", "decoder/parts"),
        compile_s=round(compile_s, 3), binary_bytes={b: (out_dir / b).stat().st_size for b in binaries},
        extra={**extra, "compile_wall_s": round(time.perf_counter() - t_all, 3)},
    ).to_dict()


def graph_bytes(out_dir: Path, parts: list[dict], share: bool) -> dict | None:
    """Bytes of each graph kind over the parts (what the follow-up graph costs), when each graph has its own
    binary; ``None`` when weight-shared (the kinds share their part's binary)."""
    if share:
        return None
    out: dict = {}
    for e in parts:
        for kind, g in e["graphs"].items():
            out[kind] = out.get(kind, 0) + (out_dir / g["binary"]).stat().st_size
    return out


def _compile(src: Path, wrapper: Path, soc, share: bool, stop: bool, what: str) -> None:
    """`.ep.compile_session`, its failure as one line naming the ops the HTP refuses."""
    try:
        ep.compile_session(src, wrapper, soc, share, stop)
    except BackendError as exc:
        raise BackendError(str(exc).replace(f"of {src.name}:", f"of {what}:")) from None
    except Exception as exc:
        rejected = ep.unsupported_nodes(src, soc)
        why = f"unsupported op(s) {', '.join(rejected[:5])}" if rejected else ep._one_line(exc)
        raise BackendError(f"QNN HTP ({soc.name}/{soc.arch}) could not compile {what}: {why}") from None


def compile_part_probe(model, source, options: dict, out_dir, calibration_order: str, context=None) -> dict:
    """Compile the probe graph of one part (the ``decoder/parts`` probe export ``source``, ``parts.json`` with
    ``probe_part``) into ``out_dir``: the part's prompt graph with its layer outputs, quantized exactly as
    `compile_parts` quantizes that part (the same calibration feeds, recorded from the float prompt graphs of every
    part: only the prompt graph set, the others' feeds would not be read; the same recipe), one binary, not weight-shared; the manifest."""
    soc = socs.soc(options.get("soc"))
    precision = options["precision"]
    recipe = from_key(options)
    src_dir = Path(source.path)
    desc = json.loads((src_dir / "parts.json").read_text())
    k, P = int(desc["probe_part"]), len(desc["parts"])
    part = desc["parts"][k - 1]
    src = src_dir / part["graphs"]["prompt"]["file"]
    work = Path(tempfile.mkdtemp(prefix="vlmrun-qnn-part-probe-"))
    t_all = time.perf_counter()
    extra: dict = {"probe_part": {"part": k, "of": P, "layers": part["layers"]}}
    try:
        if recipe is not None:
            t0 = time.perf_counter()
            files = calibration.calibration_files(options.get("calibration_images"))
            feeds, label = calibration.parts_calibration_feeds(model, src_dir, desc, files,
                                                               calibration.require_context(context),
                                                               order=calibration_order, kinds=("prompt",))
            dst = work / f"part{k}_prompt_probe.qdq.onnx"
            facts = quantize(src, dst, feeds[(k, "prompt")], recipe, work, _layers(options, k, "prompt"))
            extra["quantization"] = {**facts, "calibration": label, "quantize_s": round(time.perf_counter() - t0, 3)}
            src = dst
        wrapper = Path(out_dir) / f"part{k}_of_{P}_prompt_probe_ctx.onnx"
        what = f"decoder part {k}/{P} probe graph ({precision})"
        t0 = time.perf_counter()
        _compile(src, wrapper, soc, False, False, what)
        compile_s = time.perf_counter() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    info = describe_ctx_onnx(wrapper)
    if info["non_qnn_nodes"] or len(info["graphs"]) != 1:
        raise BackendError(f"{what}: expected one EPContext graph on QNN, got {info['graphs']}"
                           f" ({', '.join(info['non_qnn_nodes'][:3]) or 'no other nodes'})")
    out_dir = Path(out_dir)
    return ContextManifest(
        files=[wrapper.name, *info["binaries"]], graphs=info["graphs"], inputs=info["inputs"],
        outputs=info["outputs"], stage="decoder", precision=precision, compiler="qnn_htp",
        qnn_version=ep.qnn_version(), ep_sdk_version=info["ep_sdk_version"], soc=soc.name, soc_model=soc.soc_model,
        arch=soc.arch, source_form=source.manifest.get("form", "decoder/parts"), compile_s=round(compile_s, 3),
        binary_bytes={b: (out_dir / b).stat().st_size for b in info["binaries"]},
        extra={**extra, "compile_wall_s": round(time.perf_counter() - t_all, 3)},
    ).to_dict()
