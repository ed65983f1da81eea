"""Compiling the decoder in the form Qualcomm ships LLMs to the HTP (``decoder_form = "parts"``).

Form (export ``decoder/parts``, `vlmrun_ort_reference.decoder_parts`; plan: `vlmrun_qualcomm.parts`):

* the decoder split into P parts of consecutive layers, the last part with the final norm and the lm_head;
* each part as two graphs in Genie's I/O layout: "prompt" (AR-N rows, default 128, capped at the hidden size
  because Genie reads AR from embedding inputs as elements / largest dim) and "token" (AR-1), both at one fixed
  context C; inputs ``inputs_embeds`` (first part) or ``residual_{lo}`` (the residual stream from the previous
  part), ``attention_mask`` [1,T,C], ``position_ids_cos``/``_sin``, the part's past keys (transposed,
  [KV,1,D,C-T]) and values; outputs only the NEW keys/values of the part's layers, plus ``residual_{hi}`` or,
  from the last part, ``logits``;
* graph names ``{prompt|token}_ar{T}_cl{C}_..._{k}_of_{P}`` (`.genie_names`): Genie orders the parts of one
  (AR, CL) by that suffix;
* precision ``fp16``, ``w8a16`` or ``w4a16``: 16-bit activations with int8 or int4 weights, quantized by the stage's
  recipe (`.quantizer`: onnxruntime per-channel, or AIMET with LPBQ / Sequential MSE / AdaRound).
  Calibration (`.calibration.parts_calibration_feeds`): the host loop over the float part graphs on the CPU;
* ``weight_sharing``: ``on`` puts each part's prompt and token graphs in ONE context binary that holds the
  weights once (onnxruntime-qnn ``ep.share_ep_contexts``: one ``.bin`` per part, two ``_ctx.onnx`` wrappers);
  ``off`` compiles each graph into its own binary (the same graphs, the weights twice). ``auto`` (default) is
  ``on`` except on the x86_64 HTP emulator, which cannot load weight-shared binaries (`.parts_run`).

Every compiled part is checked against the part limit. `compile_part_probe` compiles one part's probe graph
(``vlmrun diff --locate``) with the same recipe and calibration feeds.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

from vlmrun.errors import BackendError
from vlmrun_qualcomm import socs
from vlmrun_qualcomm.manifest import ContextManifest, describe_ctx_onnx
from vlmrun_qualcomm.parts import DEFAULT_PART_LIMIT_MB, check_part_limits, graph_digest, weight_bytes

from . import calibration, ep, image_encoder
from .genie_names import genie_name, rename_graph, rewrite_wrapper
from .layers import LAYER_OPTIONS, part_keep
from .memory import peak_rss_mb, release_memory
from .quantizer import quantize
from .recipe import from_key

GRAPHS = ("prompt", "token")


def _layers(options: dict, k: int, kind: str) -> dict:
    """This graph's entries of the per-layer options (``keep_fp``, ``keep_a16w16``, ``keep_w8``, ``keep_w4``)."""
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


def compile_parts(model, source, options: dict, out_dir: Path, context=None) -> dict:
    """Compile every part of the ``decoder/parts`` export ``source`` into ``out_dir``; the manifest."""
    soc = socs.soc(options.get("soc"))
    precision = options["precision"]
    recipe = from_key(options)
    share = options.get("weight_sharing", "on") == "on"
    embeds = image_encoder.parse_embeds_input(options.get("embeds_input"))
    src_dir = source.path
    desc = json.loads((src_dir / "parts.json").read_text())
    if desc.get("probe_part"):  # one part's probe graph (vlmrun diff --locate)
        return compile_part_probe(model, source, options, out_dir, context=context)
    P, ar, ctx = len(desc["parts"]), desc["ar"], desc["ctx"]
    limit = int(options.get("part_limit_mb") or DEFAULT_PART_LIMIT_MB) * 1_000_000
    work = Path(tempfile.mkdtemp(prefix="vlmrun-qnn-parts-"))
    extra: dict = {}
    t_all = time.perf_counter()
    try:
        feeds, label, quant_s, q_times, q_peaks = {}, None, 0.0, {}, {}
        if recipe is not None:
            t0 = time.perf_counter()
            files = calibration.calibration_files(options.get("calibration_images"))
            feeds, label = calibration.parts_calibration_feeds(model, src_dir, desc, files,
                                                               calibration.require_context(context))
            # on disk until their graph is quantized: only one graph's feeds are in memory at a time
            feeds = {key: calibration.spill_feeds(f, work / f"feeds_part{key[0]}_{key[1]}.npz")
                     for key, f in feeds.items()}
            release_memory()
            quant_s += time.perf_counter() - t0
            q_times["record_feeds_s"] = time.perf_counter() - t0
            q_peaks["record_feeds"] = peak_rss_mb()
        parts, wrappers, binaries, graphs, facts, per_layer = [], [], [], None, None, {}
        graphs = []
        compile_s = 0.0
        for p in desc["parts"]:
            k = p["index"]
            srcs = {}
            for kind in GRAPHS:
                srcs[kind] = src_dir / p["graphs"][kind]["file"]
                if recipe is not None:
                    t0 = time.perf_counter()
                    dst = work / f"part{k}_{kind}.qdq.onnx"
                    facts = quantize(srcs[kind], dst, feeds.pop((k, kind)), recipe, work,
                                     _layers(options, k, kind))
                    _quantize_facts(facts, q_times, q_peaks, per_layer, f"part{k}_{kind}")
                    srcs[kind] = dst
                    release_memory()
                    quant_s += time.perf_counter() - t0
            if embeds is not None and k == 1:  # a bundle's decoder: the embeddings come in quantized (uint16)
                for kind in GRAPHS:
                    dst = work / f"part{k}_{kind}.embeds16.onnx"
                    image_encoder.with_quantized_input(srcs[kind], dst, embeds, "inputs_embeds")
                    srcs[kind] = dst
            t0 = time.perf_counter()
            entry = {"index": k, "layers": p["layers"], "graphs": {}, "binaries": [],
                     "source_sha256": {kind: graph_digest(srcs[kind]) for kind in srcs}}
            for i, kind in enumerate(GRAPHS):
                wrapper = out_dir / f"part{k}_of_{P}_{kind}_ctx.onnx"
                what = f"decoder part {k}/{P} {kind} graph ({precision})"
                _compile(srcs[kind], wrapper, soc, share, i == 1, what)
                release_memory()
                q_peaks[f"part{k}_{kind}_qnn_compile"] = peak_rss_mb()
                info = describe_ctx_onnx(wrapper)
                if info["non_qnn_nodes"] or len(info["graphs"]) != 1 or len(info["binaries"]) != 1:
                    raise BackendError(f"{what}: expected one EPContext graph on QNN, got {info['graphs']}"
                                       f" ({', '.join(info['non_qnn_nodes'][:3]) or 'no other nodes'})")
                entry["graphs"][kind] = {"wrapper": wrapper.name, "ort_graph": info["graphs"][0],
                                         "binary": info["binaries"][0], "ar": p["graphs"][kind]["ar"],
                                         "inputs": info["inputs"], "outputs": info["outputs"]}
            compile_s += time.perf_counter() - t0
            # name the binaries and the graphs as Genie wants them
            names = ([f"part{k}_of_{P}_qnn.bin"] * 2 if share else
                     [f"part{k}_of_{P}_prompt_qnn.bin", f"part{k}_of_{P}_token_qnn.bin"])
            for kind, new_bin in zip(GRAPHS, names):
                g = entry["graphs"][kind]
                if (out_dir / g["binary"]).exists() and g["binary"] != new_bin:
                    (out_dir / g["binary"]).rename(out_dir / new_bin)
                g["binary"] = new_bin
                g["name"] = genie_name(p["graphs"][kind]["name"], g["ort_graph"])
                rename_graph(out_dir / new_bin, g["ort_graph"], g["name"])
                rewrite_wrapper(out_dir / g["wrapper"], g["name"], new_bin)
                wrappers.append(g["wrapper"])
                graphs.append(g["name"])
            entry["binaries"] = sorted(set(names), key=names.index)
            entry["bytes"] = sum((out_dir / b).stat().st_size for b in entry["binaries"])
            binaries += entry["binaries"]
            parts.append(entry)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    check_part_limits(out_dir, parts, limit)
    weights = weight_bytes(model, precision)
    total = sum(e["bytes"] for e in parts)
    first, last = parts[0]["graphs"]["prompt"], parts[-1]["graphs"]["prompt"]
    extra["decoder_parts"] = {
        "ar": ar, "ctx": ctx, "parts": parts, "count": P, "layers": desc["layers"],
        "weight_sharing": share, "graphs_per_binary": 2 if share else 1,
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


def compile_part_probe(model, source, options: dict, out_dir, context=None) -> dict:
    """Compile the probe graph of one part (the ``decoder/parts`` probe export ``source``, ``parts.json`` with
    ``probe_part``) into ``out_dir``: the part's prompt graph with its layer outputs, quantized exactly as
    `compile_parts` quantizes that part (the same calibration feeds, recorded from the float graphs of every
    part; the same recipe), one binary, not weight-shared; the manifest."""
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
                                                               calibration.require_context(context))
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
