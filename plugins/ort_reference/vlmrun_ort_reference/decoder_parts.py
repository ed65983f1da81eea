"""The decoder in the form Qualcomm ships LLMs to the HTP: split into parts, each as a "prompt" (AR-N) and a
"token" (AR-1) graph in Genie's I/O layout (export form ``decoder/parts``).

Params: ``ar`` (N, the prompt graph's rows), ``ctx`` (C, the fixed context), ``layers`` (layers per part, comma
separated, e.g. ``"16,8"``: part ``k`` holds the next ``layers[k]`` decoder layers, the last part also the final
norm and the lm_head), ``rmsnorm`` (see `vlmrun_ort_reference.onnx_export.rms_norm_of`) and ``rows`` (``fixed``, the
default: the prompt and token graphs below; ``any``: one graph per part whose rows ``T`` and past slots ``C-T`` are
dynamic, ``part{k}_of_{P}_any.onnx``, what the reference runs part by part, `.streamed`) and ``followup`` (F: a
third graph per part, ``part{k}_of_{P}_followup.onnx``, the prompt graph at F rows, Genie-named
``prompt_arF_clC_{k}_of_{P}``; `graph_kinds`).

One export writes every graph of every part into the artifact directory, ``part{k}_of_{P}_{prompt|token}.onnx``
(``k`` from 1; a large graph's weights outside it, in ``part{k}_of_{P}.onnx.data``, one file its part's graphs
share, `.part_weights`), and ``parts.json`` describing them. The I/O of
part ``k`` (layers ``lo..hi-1``), graph with ``T`` rows (T = N or 1):

==================================== ========================================================================
``inputs_embeds`` [1,T,H]            first part only: the spliced prompt / token embeddings
``residual_{lo}`` [1,T,H]       other parts: the residual stream entering layer ``lo`` (the previous part's
                                     output of the same name)
``attention_mask`` [1,T,C]           additive float32: columns ``0..C-T-1`` are the past slots, the last ``T``
                                     this call's rows (0 = attend; a large negative = masked); past slots the
                                     first row does not attend are zeroed in the graph (their KV is not read)
``position_ids_cos/_sin`` [1,1,T,D/2] the rotary table rows of the positions (HF's rotate_half convention)
``past_key_{l}_in`` [KV,1,D,C-T]     keys of layer ``l`` (global index), transposed
``past_value_{l}_in`` [KV,1,C-T,D]
-> ``past_key_{l}_out`` [KV,1,D,T], ``past_value_{l}_out`` [KV,1,T,D]: only the NEW keys and values
-> ``residual_{hi}`` [1,T,H] (not the last part) or ``logits`` [1,T,V] (the last part)
==================================== ========================================================================

Part and graph names follow Genie's split convention (``{prompt|token}_ar{T}_cl{C}_{k}_of_{P}``), recorded in
``parts.json``. The math is the ``decoder/genie`` form's, layer for layer (same modules, same rope, same
RMSNorm), so one part covering every layer computes exactly that graph.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from vlmrun.checkpoint_stream import (check_budget, decoder_weights, export_peak_bytes, memory_budget, meta_model,
                                      part_bytes)
from vlmrun.errors import UsageError
from vlmrun.progress import no_progress, step
from vlmrun.stages import ExportForm

from .part_weights import SharedWeights, place_graph
from .probe_names import graph_output
from .torch_common import OPSET, import_torch, rms_norm_of

#: a mask entry above this is "attend" (0); masked entries are far below (vlmrun -65504, Genie -1000, a
#: 16-bit quantized mask saturates at -100)
MASK_SEEN = -50.0


def layer_split(form, num_layers: int) -> list[tuple[int, int]]:
    """``[(lo, hi), ...]`` layer ranges of the parts from the form's ``layers`` param (UsageError if bad)."""

    raw = str(form.get("layers") or num_layers)
    try:
        counts = [int(x) for x in raw.split(",")]
    except ValueError:
        raise UsageError(f"{form.label()}: layers '{raw}' is not a comma-separated list of layer counts") from None
    if any(c < 1 for c in counts) or sum(counts) != num_layers:
        raise UsageError(f"{form.label()}: layers {raw} must be positive counts adding up to the model's"
                         f" {num_layers} layers")
    out, lo = [], 0
    for c in counts:
        out.append((lo, lo + c))
        lo += c
    return out


def graph_name(kind: str, ar: int, ctx: int, k: int, parts: int) -> str:
    """Genie's split naming: ``<prefix>_<k>_of_<P>`` (Genie orders the parts of one (AR, CL) by it)."""
    return f"{kind}_ar{ar}_cl{ctx}_{k}_of_{parts}"


def part_io(model, lo: int, hi: int, last: bool, rows: int, ctx: int) -> tuple[list[dict], list[dict]]:
    """Names, shapes and dtypes of one part graph's inputs and outputs (see the module docstring)."""
    H, KV, D, V = model.hidden_size, model.num_kv_heads, model.head_dim, model.vocab_size
    past = ctx - rows
    first = {"name": "inputs_embeds" if lo == 0 else f"residual_{lo}", "shape": [1, rows, H]}
    ins = [first, {"name": "attention_mask", "shape": [1, rows, ctx]},
           {"name": "position_ids_cos", "shape": [1, 1, rows, D // 2]},
           {"name": "position_ids_sin", "shape": [1, 1, rows, D // 2]}]
    outs = [{"name": "logits", "shape": [1, rows, V]} if last else {"name": f"residual_{hi}", "shape": [1, rows, H]}]
    for layer in range(lo, hi):
        ins += [{"name": f"past_key_{layer}_in", "shape": [KV, 1, D, past]},
                {"name": f"past_value_{layer}_in", "shape": [KV, 1, past, D]}]
        outs += [{"name": f"past_key_{layer}_out", "shape": [KV, 1, D, rows]},
                 {"name": f"past_value_{layer}_out", "shape": [KV, 1, rows, D]}]
    for t in (*ins, *outs):
        t["dtype"] = "float32"
    return ins, outs


def _part_module(model, fvlm, form, lo: int, hi: int, last: bool, probe: bool = False):
    """The torch module of one part (layers ``lo..hi-1``; the last part adds the final norm and the lm_head).

    ``probe``: the outputs also hold the residual stream after each layer but the part's last (whose stream is
    ``residual_{hi}`` already), and in the last part after its last layer and the final norm too
    (`export_part_probe`)."""
    torch, _ = import_torch()

    nn = torch.nn
    lm = fvlm.model.language_model
    KV, D, nh = model.num_kv_heads, model.head_dim, model.num_heads
    rep, half = nh // KV, D // 2
    norm = rms_norm_of(form)

    class Part(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList(lm.layers[lo:hi])
            if last:
                self.norm = lm.norm
                self.lm_head = fvlm.lm_head

        def forward(self, h, attention_mask, cos, sin, *past):
            T = h.shape[1]
            mask = attention_mask[:, None]  # [1,1,T,C] broadcast over [KV,rep,T,C]
            # past slots the first row may attend (every row sees the same filled past): the others hold no KV
            # yet, and a runtime may leave them uninitialised (Genie does), which in fp16 can be inf/NaN that no
            # mask neutralises (0 * inf); so they are zeroed before use
            P = attention_mask.shape[2] - T
            seen = attention_mask[:, :1, :P] > MASK_SEEN  # [1,1,P]
            seen_k, seen_v = seen, seen.reshape(1, 1, P, 1)

            def rope(t):  # t [.., T, D]; cos/sin [1,1,T,D/2]
                a, b = t[..., :half], t[..., half:]
                return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

            outs, seen_h = [], []
            for j, layer in enumerate(self.layers):
                attn = layer.self_attn
                xn = norm(layer.input_layernorm, h)
                q = rope(attn.q_proj(xn).view(1, T, nh, D).transpose(1, 2))  # [1,nh,T,D]
                k = rope(attn.k_proj(xn).view(1, T, KV, D).transpose(1, 2))  # [1,KV,T,D]
                v = attn.v_proj(xn).view(1, T, KV, D).transpose(1, 2)
                k_out = k.permute(1, 0, 3, 2)  # [KV,1,D,T]
                v_out = v.permute(1, 0, 2, 3)  # [KV,1,T,D]
                k_past = torch.where(seen_k, past[2 * j], torch.zeros_like(past[2 * j]))
                v_past = torch.where(seen_v, past[2 * j + 1], torch.zeros_like(past[2 * j + 1]))
                k_all = torch.cat([k_past, k_out], dim=3)  # [KV,1,D,C]
                v_all = torch.cat([v_past, v_out], dim=2)  # [KV,1,C,D]
                qg = q.view(KV, rep, T, D)
                scores = torch.matmul(qg, k_all) * attn.scaling + mask  # [KV,rep,T,C]
                probs = torch.softmax(scores.float(), dim=-1)
                o = torch.matmul(probs, v_all).reshape(1, nh, T, D).transpose(1, 2).reshape(1, T, nh * D)
                h = h + attn.o_proj(o)
                h = h + layer.mlp(norm(layer.post_attention_layernorm, h))
                outs += [k_out, v_out]
                seen_h.append(h)
            if last:
                normed = norm(self.norm, h)
                first = self.lm_head(normed)
            else:
                first = h
            if probe:
                extra = seen_h if last else seen_h[:-1]
                return (first, *outs, *extra, *([normed] if last else []))
            return (first, *outs)

    return Part().eval()  # a fresh wrapper is in train mode; the exporter would restore that flag tree-wide


def row_axes(tensors: list[dict]) -> dict:
    """The dynamic axes of a part graph of any number of rows (param ``rows = any``): each tensor's rows, and the
    past slots (the context less the rows) of the past keys and values."""
    axes = {}
    for t in tensors:
        name = t["name"]
        if name.startswith(("past_key_", "past_value_")):
            axes[name] = {3 if name.startswith("past_key_") else 2: "past" if name.endswith("_in") else "rows"}
        elif name.startswith("position_ids_"):
            axes[name] = {2: "rows"}
        else:  # inputs_embeds, residual_*, attention_mask, logits, probe_*
            axes[name] = {1: "rows"}
    return axes


def _export_graph(module, ins: list[dict], outs: list[dict], path: Path, any_rows: bool = False,
                  weights: SharedWeights | None = None) -> list[str]:
    """Trace ``module`` to ``path`` (``any_rows``: its rows and past slots dynamic, `row_axes`); the files the graph
    is made of (the graph, and its weights file when they are stored outside it: ``weights``, the file its part's
    other graphs share, `.part_weights`, or ``<graph>.onnx.data``).

    The graph is traced in a folder of its own, then moved beside the others. Above 2 GiB (a 1.5B or 7B part)
    torch's exporter writes every tensor of more than 1024 elements to its own file beside the graph, named after
    the tensor, and the prompt and token graphs of a part share those names: ``/Constant_45_output_0``, the zeros
    that stand for unseen past keys, is [KV,1,D,C-AR] in one and [KV,1,D,C-1] in the other. Traced into one
    folder, the token graph's files replaced the prompt graph's and the prompt graph no longer loaded (issue 32:
    "raw_data size (523264 bytes) does not match expected size ... (393216 bytes)")."""
    import tempfile

    torch, _ = import_torch()
    example = tuple(torch.zeros(*t["shape"]) for t in ins)
    with tempfile.TemporaryDirectory(prefix=f".{path.stem}.", dir=path.parent) as tmp:
        staged = Path(tmp) / path.name
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the legacy exporter's deprecation notices
            torch.onnx.export(module, example, str(staged), input_names=[t["name"] for t in ins],
                              output_names=[t["name"] for t in outs], opset_version=OPSET, dynamo=False,
                              do_constant_folding=True, dynamic_axes=row_axes(ins + outs) if any_rows else None)
        return place_graph(staged, path, weights)


def export_parts(model, form, out_dir: Path, only: int | None = None) -> dict:
    """Write every graph of every part of ``form`` (``decoder/parts``) into ``out_dir`` (``only``: part ``only``
    alone, from 1); the manifest fields.

    A streamed model (`vlmrun.model.FastVLMModel.streams`) loads each part's weights alone, reads them from the
    shards that hold them and frees them before the next part: peak memory follows the largest part. With a
    memory budget (`vlmrun.checkpoint_stream.MEMORY_BUDGET_ENV`) every part is checked before any is written."""

    torch, _ = import_torch()
    ar, ctx, split = form_shape(model, form)
    P = len(split)
    chosen = range(1, P + 1) if only is None else [only]
    if only is not None and not 1 <= only <= P:
        raise UsageError(f"{form.label()}: part {only} is not one of the form's {P} parts")
    if model.streams:
        check_parts_budget(model, split, chosen)
    parts, files = [], []
    for k in chosen:
        lo, hi = split[k - 1]
        last = k == P
        with _progress(model, f"exporting decoder part {k} of {P} (layers {lo}-{hi - 1})"):
            module = _part_module(model, _part_model(model, lo, hi, last, k, P), form, lo, hi, last)
            graphs = {}
            weights = SharedWeights(out_dir / f"part{k}_of_{P}.onnx.data")  # one copy for the part's graphs
            for kind, rows in graph_kinds(form, ar):
                ins, outs = part_io(model, lo, hi, last, rows, ctx)
                name = f"part{k}_of_{P}_{kind}"
                written = _export_graph(module, ins, outs, out_dir / f"{name}.onnx", any_rows=kind == "any",
                                        weights=weights)
                files += [f for f in written if f not in files]
                graphs[kind] = {"file": written[0], "files": written, "ar": rows, "inputs": ins, "outputs": outs,
                                "name": graph_name("prompt" if kind == "followup" else kind, rows, ctx, k, P)}
            del module
            model.release_torch_part()
        parts.append({"index": k, "layers": [lo, hi], "last": last, "graphs": graphs})
    desc = {"ar": ar, "ctx": ctx, "parts": parts, "layers": [hi - lo for lo, hi in split],
            "hidden": model.hidden_size, "num_layers": model.num_layers}
    (out_dir / "parts.json").write_text(json.dumps(desc, indent=1))
    return {"files": [*files, "parts.json"], "form": form.label(), "opset": OPSET, "torch": torch.__version__,
            "parts": P, "ar": ar, "ctx": ctx, "layers": desc["layers"]}


def form_shape(model, form) -> tuple[int, int, list[tuple[int, int]]]:
    """The form's prompt rows ``ar``, context ``ctx`` and part layer ranges (`layer_split`); UsageError if bad."""

    ar, ctx = int(form.get("ar") or 128), int(form.get("ctx") or 0)
    if ar < 2 or ctx <= 2 * ar:
        raise UsageError(f"{form.label()}: needs a prompt AR of at least 2 and a context of more than twice it")
    return ar, ctx, layer_split(form, model.num_layers)


def graph_kinds(form, ar: int) -> tuple[tuple[str, int], ...]:
    """``(kind, rows)`` of each graph of a part: a prompt graph of ``ar`` rows and a token graph of one (with param
    ``followup = F``, a third, "followup": the prompt graph at ``F`` rows, qnn_htp's graph for a conversation's
    next turn), or with param ``rows = any`` (the reference decoder run part by part, `.streamed`) one graph of any
    number of rows (``ar`` only traces it)."""
    followup = int(form.get("followup") or 0)
    if followup and not 1 < followup < ar:
        raise UsageError(f"{form.label()}: followup {followup} is not between 1 and the prompt AR {ar}")
    if form.get("rows") in (None, "fixed"):
        return (("prompt", ar), ("token", 1)) + ((("followup", followup),) if followup else ())
    if form.get("rows") == "any":
        return (("any", ar),)

    raise UsageError(f"{form.label()}: rows '{form.get('rows')}' is not one of fixed, any")


def _part_model(model, lo: int, hi: int, last: bool, k: int, parts: int):
    """The torch model holding part ``k``'s weights (the whole model when ``model`` does not stream)."""
    return model.load_torch_part(decoder_weights(lo, hi, last), f"exporting decoder part {k} of {parts}"
                                 f" (layers {lo}-{hi - 1})")


def check_parts_budget(model, split: list[tuple[int, int]], chosen) -> None:
    """`UsageError` naming the memory the largest of the ``chosen`` parts needs when it is above the budget
    (`vlmrun.checkpoint_stream.check_budget`); nothing is read or written before."""
    if memory_budget() is None:
        return
    meta = meta_model(model.path)
    one_layer = export_peak_bytes(part_bytes(meta, decoder_weights(0, 1, False)))
    P = len(split)
    for k in chosen:
        lo, hi = split[k - 1]
        needed = export_peak_bytes(part_bytes(meta, decoder_weights(lo, hi, k == P)))
        check_budget(f"exporting decoder part {k} of {P} (layers {lo}-{hi - 1})", needed, one_layer)


def _progress(model, label: str):
    """A progress line for a streamed (large) model's part; nothing for one loaded whole."""
    return step(label) if model.streams else no_progress(label)


def probe_part_outputs(lo: int, hi: int, last: bool) -> list[tuple[str, str]]:
    """The probe points of part ``lo..hi-1`` as ``(probe name, graph output)`` pairs in network order: the
    residual stream after each layer (``decoder.layer{l}``, global index; a non-last part's last one is its
    ``residual_{hi}`` output), then in the last part ``decoder.norm`` and ``decoder.lm_head`` (= ``logits``)."""

    pairs = [(f"decoder.layer{l}", graph_output(f"decoder.layer{l}")) for l in range(lo, hi if last else hi - 1)]
    if last:
        pairs += [("decoder.norm", graph_output("decoder.norm")), ("decoder.lm_head", "logits")]
    else:
        pairs.append((f"decoder.layer{hi - 1}", f"residual_{hi}"))
    return pairs


def export_part_probe(model, form, out_dir: Path) -> dict:
    """The probe of one part (``decoder/parts`` with ``probe`` and ``part = k``, from 1): every graph of the
    normal form (the calibration of a quantized part runs the float graphs of all parts in order), with part
    ``k``'s prompt graph replaced by the same graph plus the residual stream after each of its layers
    (`probe_part_outputs`; only outputs are added, so its inputs, nodes and main outputs are the normal
    graph's). ``parts.json`` says which part is probed (``probe_part``) and the manifest lists
    ``probe_outputs`` and ``probe_nodes`` as every probe form does."""

    base = ExportForm(form.stage, form.kind, tuple((k, v) for k, v in form.params if k not in ("probe", "part")))
    manifest = export_parts(model, base, out_dir)
    desc = json.loads((out_dir / "parts.json").read_text())
    k = int(form.get("part") or 0)
    if not 1 <= k <= len(desc["parts"]):
        raise UsageError(f"{form.label()}: part {k} is not one of the form's {len(desc['parts'])} parts")
    p = desc["parts"][k - 1]
    lo, hi = p["layers"]
    last = bool(p["last"])
    ar, ctx = desc["ar"], desc["ctx"]
    pairs = probe_part_outputs(lo, hi, last)
    ins, outs = part_io(model, lo, hi, last, ar, ctx)
    H = model.hidden_size
    extra = [{"name": g, "shape": [1, ar, H], "dtype": "float32"} for _, g in pairs if g.startswith("probe_")]
    g = p["graphs"]["prompt"]
    (out_dir / g["file"]).unlink()  # its weights file stays: the part's other graphs point into it
    module = _part_module(model, _part_model(model, lo, hi, last, k, len(desc["parts"])), form, lo, hi, last,
                          probe=True)
    written = _export_graph(module, ins, outs + extra, out_dir / g["file"])  # weights, if outside, its own
    files = [f for f in manifest["files"] if f not in written] + written
    g.update({"files": written, "outputs": outs + extra})
    desc["probe_part"] = k
    (out_dir / "parts.json").write_text(json.dumps(desc, indent=1))
    import onnx

    proto = onnx.load(str(out_dir / g["file"]), load_external_data=False)
    producers = {o: n.name for n in proto.graph.node for o in n.output}
    return {**manifest, "files": files, "form": form.label(), "probe_part": k, "probe_layers": [lo, hi],
            "probe_outputs": [list(x) for x in pairs],
            # the node producing each probe point, named as in the part's normal graphs (probe outputs are added
            # to the same nodes): qnn_htp resolves keep_fp / keep_a16w16 layers with it
            "probe_nodes": {name: producers.get(out) for name, out in pairs}}


def export_parts_probe(model, form, out_dir: Path) -> dict:
    """The probe of every part (``decoder/parts`` with ``probe`` and no ``part``; the reference decoder run part by
    part, `.streamed.PartsProbe`): each part's prompt graph (or its graph of any rows) alone, with the residual
    stream after each of its layers as extra outputs (`probe_part_outputs`), and no token graph (a probe is one
    teacher-forced forward). The manifest's ``probe_outputs`` list every part's points in network order."""
    torch, _ = import_torch()
    ar, ctx, split = form_shape(model, form)
    P = len(split)
    kind = graph_kinds(form, ar)[0][0]  # the prompt graph, or the graph of any rows
    if model.streams:
        check_parts_budget(model, split, range(1, P + 1))
    parts, files, pairs_all, H = [], [], [], model.hidden_size
    for k, (lo, hi) in enumerate(split, start=1):
        last = k == P
        with _progress(model, f"exporting the probe of decoder part {k} of {P} (layers {lo}-{hi - 1})"):
            module = _part_module(model, _part_model(model, lo, hi, last, k, P), form, lo, hi, last, probe=True)
            pairs = probe_part_outputs(lo, hi, last)
            ins, outs = part_io(model, lo, hi, last, ar, ctx)
            outs += [{"name": g, "shape": [1, ar, H], "dtype": "float32"} for _, g in pairs if g.startswith("probe_")]
            written = _export_graph(module, ins, outs, out_dir / f"part{k}_of_{P}_{kind}.onnx", any_rows=kind == "any")
            del module
            model.release_torch_part()
        files += written
        pairs_all += pairs
        parts.append({"index": k, "layers": [lo, hi], "last": last, "probe_outputs": [list(x) for x in pairs],
                      "graphs": {kind: {"file": written[0], "files": written, "ar": ar, "inputs": ins,
                                        "outputs": outs}}})
    desc = {"ar": ar, "ctx": ctx, "parts": parts, "layers": [hi - lo for lo, hi in split], "hidden": H,
            "num_layers": model.num_layers, "probe": True}
    (out_dir / "parts.json").write_text(json.dumps(desc, indent=1))
    return {"files": [*files, "parts.json"], "form": form.label(), "opset": OPSET, "torch": torch.__version__,
            "parts": P, "ar": ar, "ctx": ctx, "layers": desc["layers"], "probe_outputs": [list(x) for x in pairs_all]}
