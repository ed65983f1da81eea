"""Per-layer precision: which nodes of a graph a layer is, for ``keep_fp``, ``keep_a16w16`` and ``layer_precision``.

The option ``keep_fp`` (comma-separated) keeps layers out of quantization: probe names (``vision.stage2``,
``projector.linear_1``, ``decoder.layer1``, ``decoder.lm_head``) or node-name prefixes of the exported graph
(starting with ``/``, e.g. ``/tower/stages.2/``). A layer is every node between its probe point and the previous
one (`excluded_nodes`, resolved on the quantizer's preprocessed graph); those nodes are left in float
(``nodes_to_exclude``), so the HTP runs them in fp16 between a dequantize and a quantize. The resolved layer
boundaries key the binary.

``keep_a16w16`` takes the same entries and quantizes those nodes at 16 bits (activations and weights) instead;
``layer_precision`` (`vlmrun_qnn_htp.recipe.parse_layer_precision`) maps layers to ``fp16``, ``a16w16``,
``w8`` or ``w4`` and is resolved into the same per-option entries (``keep_w8``, ``keep_w4``: those layers'
weights at 8 / 4 bits). `vlmrun_qnn_htp.quantizer` applies them.

**In the parts form** (w8a16/w4a16): ``decoder.layer{l}``, ``decoder.norm`` and ``decoder.lm_head`` name the nodes
of that layer in its part's prompt AND token graphs (`parts_keep_key`: the boundaries from the part's probe
export, the same node names in both graphs, which are traced from one module); both graphs of the part are
quantized with them, so the weight-shared binary still holds one recipe per layer. Node-name prefixes are refused
there (every part graph has the same node names).
"""

from __future__ import annotations

from vlmrun.errors import BackendError, UsageError
from vlmrun.stages import ExportForm

PROBE_STAGES = ("vision", "projector", "decoder")
#: the per-layer options, in the order the quantizer applies them (a layer named twice is refused)
LAYER_OPTIONS = ("keep_fp", "keep_a16w16", "keep_w8", "keep_w4")


def parse_keep_fp(value) -> tuple[str, ...]:
    """``keep_fp`` as a tuple of layer names / node prefixes (comma- or space-separated string, or a list)."""
    if value is None or value == "":
        return ()
    items = value if isinstance(value, (list, tuple)) else str(value).replace(",", " ").split()
    return tuple(dict.fromkeys(str(i).strip() for i in items if str(i).strip()))


#: what each per-layer precision option does, for its messages
KEEP_WHAT = {"keep_fp": "keeps layers out of quantization", "keep_a16w16": "quantizes layers at 16 bits (a16w16)",
             "keep_w8": "sets layers' weights to 8 bits", "keep_w4": "sets layers' weights to 4 bits"}


def check_keep_fp(stage: str, names: tuple[str, ...], precision: str, option: str = "keep_fp") -> None:
    if not names:
        return
    if precision == "fp16":
        raise UsageError(f"{stage}: {option} {KEEP_WHAT.get(option, 'sets per-layer precision')}; precision fp16"
                         " quantizes nothing (use int8 or a16w8; w8a16 or w4a16 in the decoder's parts form)")
    if stage not in PROBE_STAGES:
        raise UsageError(f"{stage}: {option} applies to vision, projector and decoder (embed is a table lookup)")
    for n in names:
        if not n.startswith("/") and not n.startswith(stage + "."):
            raise UsageError(f"{stage}: {option} entry '{n}' is neither a layer of this stage ({stage}.<layer>, as"
                             " vlmrun diff --locate names them) nor a node-name prefix starting with '/'")


def keep_fp_key(ctx, form: ExportForm, names: tuple[str, ...], option: str = "keep_fp") -> list[list]:
    """The compile-key entry of ``keep_fp`` for ``form``: ``[layer, previous boundary tensor, boundary tensor]`` per
    layer, ``[prefix]`` per node-name prefix.

    The boundaries come from the probe form's manifest (``probe_nodes``: the node producing each layer's output,
    named as in the normal graph) and are written as the tensors those nodes produce in ``form``'s own graph:
    tensor names survive the quantizer's preprocessing (which fuses nodes under new names)."""
    out: list[list] = []
    layers = [n for n in names if not n.startswith("/")]
    if layers:
        import onnx

        probe = ctx.exported(form.probe())
        order = [p[0] for p in probe.manifest.get("probe_outputs") or ()]
        nodes = probe.manifest.get("probe_nodes") or {}
        graph = onnx.load(str(ctx.exported(form).file()), load_external_data=False).graph
        tensor_of = {n.name: n.output[0] for n in graph.node}
        for name in layers:
            if name not in order:
                raise UsageError(f"{option}: '{name}' is not a layer of stage '{form.stage}'; its layers are"
                                 f" {', '.join(order)}")
            k = order.index(name)
            bounds = [nodes.get(order[k - 1]) if k else None, nodes.get(name)]
            if any(b is not None and b not in tensor_of for b in bounds) or bounds[1] is None:
                raise BackendError(f"{option}: the boundary nodes of {name} ({bounds}) are not in the graph of"
                                   f" {form.label()}; run with --rebuild")
            out.append([name, *(tensor_of[b] if b else None for b in bounds)])
    out += [[p] for p in names if p.startswith("/")]
    return out


def parts_keep_key(ctx, form: ExportForm, names: tuple[str, ...], option: str = "keep_fp") -> list[dict]:
    """The compile-key entry of ``keep_fp`` / ``keep_a16w16`` for the parts form ``form`` (``decoder/parts``, or one
    part's probe form): per layer, ``{"layer", "part", "prompt": [previous boundary, boundary], "token": [...]}``,
    the part holding the layer and its boundary tensors in that part's prompt and token graphs of ``form``.

    The boundaries come from the part's probe form (``probe_nodes``, `part_probe_form`), named by the node
    that produces them: the part's prompt and token graphs are traced from the same module and share node names.
    A part's first layer starts at the part's input (no previous boundary). Node-name prefixes are refused: every
    part graph uses the same node names, so a prefix would not say which part."""
    import json

    import onnx

    prefixes = [n for n in names if n.startswith("/")]
    if prefixes:
        raise UsageError(f"{option}: node-name prefixes ('{prefixes[0]}') do not apply to decoder_form = \"parts\""
                         " (all its part graphs use the same node names); name layers: decoder.layer<i>,"
                         " decoder.norm, decoder.lm_head")
    base = ExportForm(form.stage, form.kind, tuple((k, v) for k, v in form.params if k not in ("probe", "part")))
    src = ctx.exported(form)
    desc = json.loads((src.path / "parts.json").read_text())
    ranges = [tuple(p["layers"]) for p in desc["parts"]]
    valid = [f"decoder.layer{i}" for i in range(ranges[-1][1])] + ["decoder.norm", "decoder.lm_head"]
    graphs: dict = {}
    out: list[dict] = []
    for name in names:
        if name not in valid:
            raise UsageError(f"{option}: '{name}' is not a layer of stage 'decoder'; its layers are"
                             f" {', '.join(valid)}")
        if name.startswith("decoder.layer"):
            layer = int(name[len("decoder.layer"):])
            k = next(i for i, (lo, hi) in enumerate(ranges, start=1) if lo <= layer < hi)
        else:
            k = len(ranges)
        probe = ctx.exported(part_probe_form(base, k))
        order = [p[0] for p in probe.manifest.get("probe_outputs") or ()]
        nodes = probe.manifest.get("probe_nodes")
        if not nodes or name not in order:
            raise BackendError(f"{option}: the probe export of decoder part {k} ({probe.path.name}) does not name"
                               " its layers' nodes (an older export); run with --rebuild")
        i = order.index(name)
        bounds = [nodes.get(order[i - 1]) if i else None, nodes.get(name)]
        entry: dict = {"layer": name, "part": k}
        for kind in ("prompt", "token"):
            if (k, kind) not in graphs:
                g = onnx.load(str(src.path / desc["parts"][k - 1]["graphs"][kind]["file"]),
                              load_external_data=False).graph
                graphs[(k, kind)] = {n.name: n.output[0] for n in g.node}
            tensor_of = graphs[(k, kind)]
            if bounds[1] is None or any(b is not None and b not in tensor_of for b in bounds):
                raise BackendError(f"{option}: the boundary nodes of {name} ({bounds}) are not in the {kind} graph of"
                                   f" decoder part {k} ({form.label()}); run with --rebuild")
            entry[kind] = [tensor_of[b] if b else None for b in bounds]
        out.append(entry)
    return out


def part_keep(key, k: int, kind: str) -> list[list] | None:
    """The entries of a `parts_keep_key` value for part ``k``'s ``kind`` graph, as `excluded_nodes`
    takes them (None when the part keeps no layer)."""
    return [[e["layer"], *e[kind]] for e in key or () if int(e["part"]) == int(k)] or None


def excluded_nodes(proto, keep_fp: list[list], option: str = "keep_fp") -> list[str]:
    """Node names of ``proto`` (the graph being quantized) that ``keep_fp`` (`keep_fp_key`) keeps in float:
    per layer, the nodes its output tensor depends on that the previous layer's output does not."""
    names = [n.name for n in proto.graph.node]
    producers = {o: n for n in proto.graph.node for o in n.output}

    def ancestors(tensor):
        seen, stack = set(), [tensor]
        while stack:
            node = producers.get(stack.pop())
            if node is None or node.name in seen:
                continue
            seen.add(node.name)
            stack.extend(i for i in node.input if i)
        return seen

    out: set[str] = set()
    for entry in keep_fp or ():
        if len(entry) == 1:
            hits = {n for n in names if n.startswith(entry[0])}
            if not hits:
                raise UsageError(f"{option}: no node of the graph starts with '{entry[0]}'")
            out |= hits
            continue
        layer, prev, tensor = entry
        missing = [t for t in (prev, tensor) if t and t not in producers]
        if missing:
            raise BackendError(f"{option}: layer {layer}: tensor {missing[0]} is not in the graph being quantized"
                               " (the export changed?); run with --rebuild")
        out |= ancestors(tensor) - (ancestors(prev) if prev else set())
    return sorted(out)


def part_probe_form(form: ExportForm, k: int) -> ExportForm:
    """The probe form of part ``k`` (from 1) of the parts form ``form``."""
    return ExportForm(form.stage, form.kind, tuple(sorted({**dict(form.params), "probe": True, "part": k}.items())))


