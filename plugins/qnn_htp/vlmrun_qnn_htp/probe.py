"""Probes and per-layer precision on qnn_htp (``vlmrun diff --locate`` / ``--what-if``).

**Probe forms.** ``load_probe`` compiles the stage's probe form (the normal form plus its layer outputs,
:mod:`vlmrun_ort_reference.probes`) exactly like the normal form: the same options, the same compile key (so the
same calibration data: vision/projector's seeded random or image feeds, the decoder's host-loop feeds recorded
from the float graph, whose inputs the probe shares) and the same quantization recipe. MinMax calibration gives
each tensor its range from the values it takes on those feeds, and the probe graph computes every tensor of the
normal graph under the same name: the extra outputs only expose tensors that are quantized anyway, so the main
path's scales and offsets are the normal graph's (``tests/test_locate.py`` compares them, and the outputs).
The decoder's probe is the prefill (AR-N) graph; a teacher-forced sequence runs through it in AR-N chunks from
an empty cache, the host keeping the KV slots as :class:`.decoder.FixedKVDecoder` does.

**The parts form** (``decoder_form = "parts"``) is probed at its part boundaries first, with no extra compile:
the stage's own part binaries run the sequence in prompt-graph chunks and the residual stream each part hands to
the next (``residual_{l}``) is the reference's ``decoder.layer{l-1}``; the last part's logits are
``decoder.lm_head``. Then the layers inside one part (the core picks the worst, :func:`vlmrun.diff.locate.locate`):
:meth:`PartsProbe.inside` compiles that part's probe graph (export ``decoder/parts`` with ``probe`` and
``part = k``: the part's prompt graph plus the residual stream after each of its layers, named
``decoder.layer{l}`` with the global layer index) by :func:`compile_part_probe`, with the stage's precision, options
and compile key, and the same quantization recipe and calibration feeds as the part itself
(:func:`.parts.calibration_feeds` over the float graphs of every part, then :func:`.parts.quantize_graph`), cached in
the store like any artifact; the sequence then runs through the stage's part binaries with that part's prompt
binary swapped for the probe binary. Its main outputs are the part's (``tests/test_locate.py`` compares them).

The probe handle's contract for the core (read by ``getattr``): ``parts``, the layer ranges ``[(lo, hi), ...]`` of
the parts (global indices, ``hi`` exclusive), and ``inside(k)``, a probe handle (for ``run_probe``) that also
reports the layers of part ``k`` (from 1).

**keep_fp.** The option ``keep_fp`` (comma-separated) keeps layers out of int8/a16w8 quantization: probe names
(``vision.stage2``, ``projector.linear_1``, ``decoder.layer1``, ``decoder.lm_head``) or node-name prefixes of
the exported graph (starting with ``/``, e.g. ``/tower/stages.2/``). A layer is every node between its probe
point and the previous one (:func:`excluded_nodes`, resolved on the quantizer's
preprocessed graph); those nodes are left in float (``nodes_to_exclude``), so the HTP runs them in fp16 between
a dequantize and a quantize. The resolved layer boundaries key the binary.

**keep_a16w16.** The same entries, the same node sets (:func:`excluded_nodes`), quantized at 16 bits instead of
left in float: those nodes' activations (outputs) as uint16 and their weights (Conv/MatMul/Gemm weights as
symmetric int16, other constant inputs as uint16) through onnxruntime's per-tensor overrides
(``TensorQuantOverrides``: :func:`.quant.a16w16_overrides`); onnxruntime's mixed-precision fixer adds the 8 <-> 16-bit
conversions at the layer's borders. The rest of the stage keeps its precision.

**Per-layer precision in the parts form** (w8a16/w4a16): ``decoder.layer{l}``, ``decoder.norm`` and
``decoder.lm_head`` name the nodes of that layer in its part's prompt AND token graphs (:func:`parts_keep_key`:
the boundaries from the part's probe export, the same node names in both graphs, which are traced from one
module); both graphs of the part are quantized with them (:func:`.parts.quantize_graph`), so the weight-shared
binary still holds one recipe per layer. Node-name prefixes are refused there (every part graph has the same
node names).
"""

from __future__ import annotations

import numpy as np

from vlmrun.errors import BackendError, UsageError
from vlmrun.handles import StageHandle
from vlmrun.stages import ExportForm, probe_outputs

PROBE_STAGES = ("vision", "projector", "decoder")


def parse_keep_fp(value) -> tuple[str, ...]:
    """``keep_fp`` as a tuple of layer names / node prefixes (comma- or space-separated string, or a list)."""
    if value is None or value == "":
        return ()
    items = value if isinstance(value, (list, tuple)) else str(value).replace(",", " ").split()
    return tuple(dict.fromkeys(str(i).strip() for i in items if str(i).strip()))


#: what each per-layer precision option does, for its messages
KEEP_WHAT = {"keep_fp": "keeps layers out of quantization", "keep_a16w16": "quantizes layers at 16 bits (a16w16)"}


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

    The boundaries come from the part's probe form (``probe_nodes``, :func:`part_probe_form`), named by the node
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
    """The entries of a :func:`parts_keep_key` value for part ``k``'s ``kind`` graph, as :func:`excluded_nodes`
    takes them (None when the part keeps no layer)."""
    return [[e["layer"], *e[kind]] for e in key or () if int(e["part"]) == int(k)] or None


def excluded_nodes(proto, keep_fp: list[list], option: str = "keep_fp") -> list[str]:
    """Node names of ``proto`` (the graph being quantized) that ``keep_fp`` (:func:`keep_fp_key`) keeps in float:
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


class ProbeHandle(StageHandle):
    """A compiled probe graph on the local HTP."""

    def __init__(self, stage, session, artifact, source_manifest: dict, model, ctx_len: int | None = None):
        self.stage = stage
        self.session = session
        self.artifact = artifact
        self.artifacts = (artifact,)
        self.manifest = source_manifest
        self.model = model
        self.ctx_len = ctx_len
        self.load_s = session.load_s

    def _run(self, feeds: dict) -> dict:
        fed = {}
        for name, (shape, dtype) in self.session.inputs.items():
            fed[name] = np.ascontiguousarray(feeds[name], dtype=dtype)
        return self.session.run(fed)

    def run(self, inputs: dict) -> dict:
        if self.stage != "decoder":
            return probe_outputs(self.stage, self.manifest, self._run(inputs))
        return self._decoder(np.asarray(inputs["inputs_embeds"], np.float32))

    def _decoder(self, embeds: np.ndarray) -> dict:
        from .decoder import FixedKVDecoder

        shape = self.session.inputs["attention_mask"][0]
        ar, ctx = int(shape[2]), int(shape[3])
        calls: list[dict] = []
        session = self

        class Keep:  # the probe graph as FixedKVDecoder's AR-N graph, keeping every call's outputs
            def run(self, feeds):
                out = session._run(feeds)
                calls.append(out)
                return out

        T = embeds.shape[1]
        if (T - 1) // ar * ar > ctx - ar:  # the last chunk's past must fit the graph's past slots
            raise UsageError(f"probe: {T} teacher-forced rows do not fit the decoder's context of {ctx} in AR-{ar}"
                             " chunks; use fewer --max-new-tokens or a larger context_length")
        dec = FixedKVDecoder({ar: Keep(), 1: Keep()}, ctx, self.model, min_chunk=1)
        dec.reset()
        rows: list[int] = []
        i = 0
        while i < T:
            n = min(ar, T - i)
            dec._step(embeds[:, i : i + n], ar)
            rows.append(n)
            i += n
        merged = {name: np.concatenate([c[name][:, :n] for c, n in zip(calls, rows)], axis=1)
                  for name in calls[0] if name == "logits" or name.startswith("probe_")}
        return probe_outputs("decoder", self.manifest, merged)


def load_probe(ctx, stage: str, opts: dict, soc, compiled, stage_handle=None) -> ProbeHandle:
    """The probe handle of ``stage`` (``opts`` from ``stage_options``; ``compiled(form)`` compiles like the stage;
    ``stage_handle()`` loads the stage itself, whose part binaries probe the parts form)."""
    from . import ep, forms

    if stage not in PROBE_STAGES:
        raise UsageError(f"stage '{stage}' has no layers to probe")
    if opts["target"] != "local":
        raise UsageError("probes run on the local HTP backend (target = \"local\"); a phone's qnn-net-run path"
                         " does not run them yet")
    if stage == "decoder" and opts.get("decoder_form") == "parts":
        from vlmrun.stages import ExportForm

        from .parts import plan

        p = plan(ctx.model, opts)  # the stage's own export form (as load_stage builds it)
        form = ExportForm.of("decoder", "decoder/parts", ar=p["ar"], ctx=p["ctx"],
                             layers=",".join(map(str, p["layers"])), rmsnorm=opts.get("rmsnorm") or "safe")
        return PartsProbe(stage_handle(), form=form, compiled=compiled, exported=ctx.exported, soc=soc)
    if stage == "decoder" and opts.get("engine") != "host":
        raise UsageError("decoder probes are the fixed form's host engine (engine = \"host\") or the parts form")
    form = forms(stage, opts)[0]  # the decoder: the prefill (AR-N) form comes first
    probe = form.probe()
    art = compiled(probe)
    ep.check_binary(art.manifest, art.file(), soc, f"{stage} probe ({art.path.name})")
    source = ctx.exported(probe)
    session = ep.HtpSession(art.file(), soc, f"{stage} probe ({art.path.name})")
    return ProbeHandle(stage, session, art, dict(source.manifest), ctx.model)


def part_probe_form(form: ExportForm, k: int) -> ExportForm:
    """The probe form of part ``k`` (from 1) of the parts form ``form``."""
    return ExportForm(form.stage, form.kind, tuple(sorted({**dict(form.params), "probe": True, "part": k}.items())))


def compile_part_probe(model, source, options: dict, out_dir, context=None) -> dict:
    """Compile the probe graph of one part (the ``decoder/parts`` probe export ``source``, ``parts.json`` with
    ``probe_part``) into ``out_dir``: the part's prompt graph with its layer outputs, quantized exactly as
    :func:`.parts.compile_parts` quantizes that part (the same calibration feeds, recorded from the float graphs
    of every part; the same recipe), one binary, not weight-shared; the manifest."""
    import json
    import shutil
    import tempfile
    import time
    from pathlib import Path

    from vlmrun_qualcomm import socs
    from vlmrun_qualcomm.manifest import ContextManifest, describe_ctx_onnx

    from . import ep, parts, quant

    soc = socs.soc(options.get("soc"))
    precision = options["precision"]
    src_dir = Path(source.path)
    desc = json.loads((src_dir / "parts.json").read_text())
    k, P = int(desc["probe_part"]), len(desc["parts"])
    part = desc["parts"][k - 1]
    src = src_dir / part["graphs"]["prompt"]["file"]
    work = Path(tempfile.mkdtemp(prefix="vlmrun-qnn-part-probe-"))
    t_all = time.perf_counter()
    extra: dict = {"probe_part": {"part": k, "of": P, "layers": part["layers"]}}
    try:
        if precision != "fp16":
            t0 = time.perf_counter()
            files = quant.calibration_files(options.get("calibration_images"))
            feeds, label = parts.calibration_feeds(model, src_dir, desc, files, quant._require(context))
            dst = work / f"part{k}_prompt_probe.qdq.onnx"
            facts = parts.quantize_graph(src, dst, feeds[(k, "prompt")], precision, work,
                                         keep_fp=part_keep(options.get("keep_fp"), k, "prompt"),
                                         keep_a16w16=part_keep(options.get("keep_a16w16"), k, "prompt"))
            extra["quantization"] = {**facts, "calibration": label,
                                     "quantize_s": round(time.perf_counter() - t0, 3)}
            src = dst
        wrapper = Path(out_dir) / f"part{k}_of_{P}_prompt_probe_ctx.onnx"
        what = f"decoder part {k}/{P} probe graph ({precision})"
        t0 = time.perf_counter()
        try:
            parts._compile_session(src, wrapper, soc, False, stop=False)
        except Exception as exc:
            raise BackendError(f"QNN HTP ({soc.name}/{soc.arch}) could not compile {what}: {ep._one_line(exc)}"
                               ) from None
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


class PartsProbe(StageHandle):
    """The parts form's boundaries: the stage's part binaries over a teacher-forced sequence, every part's output
    kept; with ``part`` (:meth:`inside`), that part's prompt binary swapped for its probe binary, whose layer
    outputs are kept too (see the module docstring)."""

    def __init__(self, handle, form: ExportForm | None = None, compiled=None, exported=None, soc=None,
                 part: int | None = None, graph=None, manifest: dict | None = None, artifact=None):
        self.handle = handle
        self.form, self._compiled, self._exported, self.soc = form, compiled, exported, soc
        self.part, self.graph, self.manifest = part, graph, manifest or {}
        self.artifacts = tuple(getattr(handle, "artifacts", ())) + ((artifact,) if artifact is not None else ())

    @property
    def parts(self) -> list[tuple[int, int]]:
        """The layer ranges of the parts, ``[(lo, hi), ...]`` (global layer indices, ``hi`` exclusive)."""
        return [tuple(p["layers"]) for p in self.handle.parts["parts"]]

    def inside(self, k: int) -> "PartsProbe":
        """The probe that also reports the layers of part ``k`` (from 1): its probe binary compiled like the part
        (cached in the store), swapped in for the part's prompt binary."""
        from . import ep
        from .parts import _HtpGraph

        if self._compiled is None or self.form is None:
            raise BackendError("this parts probe cannot look inside a part (no compile context)")
        if not 1 <= k <= len(self.parts):
            raise UsageError(f"probe: part {k} is not one of the decoder's {len(self.parts)} parts")
        form = part_probe_form(self.form, k)
        art = self._compiled(form)
        ep.check_binary(art.manifest, art.file(), self.soc, f"decoder part {k} probe ({art.path.name})")
        source = self._exported(form)
        graph = _HtpGraph(art.file(), self.soc, f"decoder part {k}/{len(self.parts)} probe")
        return PartsProbe(self.handle, self.form, self._compiled, self._exported, self.soc, k, graph,
                          dict(source.manifest), art)

    def run(self, inputs: dict) -> dict:
        import re

        embeds = np.asarray(inputs["inputs_embeds"], np.float32)
        dec = self.handle.decoder  # the host engine over the part binaries
        ar, ctx = max(dec.graphs), dec.ctx
        T = embeds.shape[1]
        if (T - 1) // ar * ar > ctx - ar:
            raise UsageError(f"probe: {T} teacher-forced rows do not fit the decoder's context of {ctx} in AR-{ar}"
                             " chunks; use fewer --max-new-tokens or a larger context_length")
        inner, calls = dec.graphs[ar], []

        class Keep:
            input_names = getattr(inner, "input_names", None)

            def run(self, feeds):
                out = inner.run(feeds)
                calls.append(out)
                return out

        rows = []
        dec.graphs[ar] = Keep()
        swapped = None
        if self.part is not None:  # this part's prompt binary -> its probe binary (same inputs, more outputs)
            swapped = inner.runners[self.part - 1]
            inner.runners[self.part - 1] = self.graph
        try:
            dec.reset()
            for i in range(0, T, ar):
                n = min(ar, T - i)
                dec._step(embeds[:, i : i + n], ar)
                rows.append(n)
        finally:
            dec.graphs[ar] = inner
            if swapped is not None:
                inner.runners[self.part - 1] = swapped

        def rows_of(name):
            return np.concatenate([c[name].reshape(1, ar, -1)[:, :n] for c, n in zip(calls, rows)], axis=1)

        logits = rows_of("logits")
        out = {"logits": logits}
        bounds = sorted((int(m.group(1)), k) for k in calls[0] if (m := re.fullmatch(r"residual_(\d+)", k)))
        for hi, name in bounds:
            out[f"decoder.layer{hi - 1}"] = rows_of(name)
        for name, graph_name in self.manifest.get("probe_outputs") or ():  # the layers inside the swapped part
            if graph_name in calls[0]:
                out[name] = rows_of(graph_name)
        out["decoder.lm_head"] = logits
        return out
