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

**The parts form** (``decoder_form = "parts"``) is probed at its part boundaries, with no extra compile: the
stage's own part binaries run the sequence in prompt-graph chunks and the residual stream each part hands to the
next (``residual_{l}``) is the reference's ``decoder.layer{l-1}``; the last part's logits are ``decoder.lm_head``.
The layers inside a part are not probed yet.

**keep_fp.** The option ``keep_fp`` (comma-separated) keeps layers out of int8/a16w8 quantization: probe names
(``vision.stage2``, ``projector.linear_1``, ``decoder.layer1``, ``decoder.lm_head``) or node-name prefixes of
the exported graph (starting with ``/``, e.g. ``/tower/stages.2/``). A layer is every node between its probe
point and the previous one (:func:`excluded_nodes`, resolved on the quantizer's
preprocessed graph); those nodes are left in float (``nodes_to_exclude``), so the HTP runs them in fp16 between
a dequantize and a quantize. The resolved layer boundaries key the binary.
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


def check_keep_fp(stage: str, names: tuple[str, ...], precision: str) -> None:
    if not names:
        return
    if precision == "fp16":
        raise UsageError(f"{stage}: keep_fp keeps layers out of quantization; precision fp16 quantizes nothing"
                         " (use int8 or a16w8)")
    if stage not in PROBE_STAGES:
        raise UsageError(f"{stage}: keep_fp applies to vision, projector and decoder (embed is a table lookup)")
    for n in names:
        if not n.startswith("/") and not n.startswith(stage + "."):
            raise UsageError(f"{stage}: keep_fp entry '{n}' is neither a layer of this stage ({stage}.<layer>, as"
                             " vlmrun diff --locate names them) nor a node-name prefix starting with '/'")


def keep_fp_key(ctx, form: ExportForm, names: tuple[str, ...]) -> list[list]:
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
                raise UsageError(f"keep_fp: '{name}' is not a layer of stage '{form.stage}'; its layers are"
                                 f" {', '.join(order)}")
            k = order.index(name)
            bounds = [nodes.get(order[k - 1]) if k else None, nodes.get(name)]
            if any(b is not None and b not in tensor_of for b in bounds) or bounds[1] is None:
                raise BackendError(f"keep_fp: the boundary nodes of {name} ({bounds}) are not in the graph of"
                                   f" {form.label()}; run with --rebuild")
            out.append([name, *(tensor_of[b] if b else None for b in bounds)])
    out += [[p] for p in names if p.startswith("/")]
    return out


def excluded_nodes(proto, keep_fp: list[list]) -> list[str]:
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
                raise UsageError(f"keep_fp: no node of the graph starts with '{entry[0]}'")
            out |= hits
            continue
        layer, prev, tensor = entry
        missing = [t for t in (prev, tensor) if t and t not in producers]
        if missing:
            raise BackendError(f"keep_fp: layer {layer}: tensor {missing[0]} is not in the graph being quantized"
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
        return PartsProbe(stage_handle())
    if stage == "decoder" and opts.get("engine") != "host":
        raise UsageError("decoder probes are the fixed form's host engine (engine = \"host\") or the parts form")
    form = forms(stage, opts)[0]  # the decoder: the prefill (AR-N) form comes first
    probe = form.probe()
    art = compiled(probe)
    ep.check_binary(art.manifest, art.file(), soc, f"{stage} probe ({art.path.name})")
    source = ctx.exported(probe)
    session = ep.HtpSession(art.file(), soc, f"{stage} probe ({art.path.name})")
    return ProbeHandle(stage, session, art, dict(source.manifest), ctx.model)


class PartsProbe(StageHandle):
    """The parts form's boundaries: the stage's part binaries over a teacher-forced sequence, every part's output
    kept (see the module docstring)."""

    def __init__(self, handle):
        self.handle = handle
        self.artifacts = tuple(getattr(handle, "artifacts", ()))

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
        try:
            dec.reset()
            for i in range(0, T, ar):
                n = min(ar, T - i)
                dec._step(embeds[:, i : i + n], ar)
                rows.append(n)
        finally:
            dec.graphs[ar] = inner
        logits = np.concatenate([c["logits"].reshape(1, ar, -1)[:, :n] for c, n in zip(calls, rows)], axis=1)
        out = {"logits": logits}
        bounds = sorted((int(m.group(1)), k) for k in calls[0] if (m := re.fullmatch(r"residual_(\d+)", k)))
        for hi, name in bounds:
            out[f"decoder.layer{hi - 1}"] = np.concatenate(
                [c[name].reshape(1, ar, -1)[:, :n] for c, n in zip(calls, rows)], axis=1)
        out["decoder.lm_head"] = logits
        return out
