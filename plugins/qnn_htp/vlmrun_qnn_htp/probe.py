"""Probes and per-layer precision on qnn_htp (``vlmrun diff --locate`` / ``--what-if``).

**Probe forms.** ``load_probe`` compiles the stage's probe form (the normal form plus its layer outputs,
`vlmrun_ort_reference.probes`) exactly like the normal form: the same options, the same compile key (so the
same calibration data: vision/projector's seeded random or image feeds, the decoder's host-loop feeds recorded
from the float graph, whose inputs the probe shares) and the same quantization recipe. MinMax calibration gives
each tensor its range from the values it takes on those feeds, and the probe graph computes every tensor of the
normal graph under the same name: the extra outputs only expose tensors that are quantized anyway, so the main
path's scales and offsets are the normal graph's (``tests/test_locate.py`` compares them, and the outputs).
The decoder's probe is the prefill (AR-N) graph; a teacher-forced sequence runs through it in AR-N chunks from
an empty cache, the host keeping the KV slots as `.decoder.FixedKVDecoder` does.

**The parts form** (``decoder_form = "parts"``) is probed at its part boundaries first, with no extra compile:
the stage's own part binaries run the sequence in prompt-graph chunks and the residual stream each part hands to
the next (``residual_{l}``) is the reference's ``decoder.layer{l-1}``; the last part's logits are
``decoder.lm_head``. Then the layers inside one part (the core picks the worst, `vlmrun.diff.locate.locate`):
`PartsProbe.inside` compiles that part's probe graph (export ``decoder/parts`` with ``probe`` and
``part = k``: the part's prompt graph plus the residual stream after each of its layers, named
``decoder.layer{l}`` with the global layer index) by `.parts_compile.compile_part_probe`, with the stage's precision, options
and compile key, and the same quantization recipe and calibration feeds as the part itself
(`.calibration.parts_calibration_feeds` over the float graphs of every part, then `.quantizer.quantize`), cached in
the store like any artifact; the sequence then runs through the stage's part binaries with that part's prompt
binary swapped for the probe binary. Its main outputs are the part's (``tests/test_locate.py`` compares them).

The probe handle's contract for the core (read by ``getattr``): ``parts``, the layer ranges ``[(lo, hi), ...]`` of
the parts (global indices, ``hi`` exclusive), and ``inside(k)``, a probe handle (for ``run_probe``) that also
reports the layers of part ``k`` (from 1).

Per-layer precision (``keep_fp``, ``keep_a16w16``, ``layer_precision``) is `.layers`.
"""

from __future__ import annotations

import numpy as np

from vlmrun.errors import BackendError, UsageError
from vlmrun.handles import StageHandle
from vlmrun.stages import ExportForm, probe_outputs

from .layers import PROBE_STAGES, part_probe_form


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


def load_probe(ctx, plan, compiled, stage_handle=None) -> ProbeHandle:
    """The probe handle of the stage of ``plan`` (its `.plan.StagePlan`); ``compiled(form)`` compiles like the
    stage; ``stage_handle()`` loads the stage itself, whose part binaries probe the parts form."""
    from . import ep
    from .options import forms

    stage, opts, soc = plan.stage, plan.opts, plan.soc
    if stage not in PROBE_STAGES:
        raise UsageError(f"stage '{stage}' has no layers to probe")
    if plan.target != "local":
        raise UsageError("probes run on the local HTP backend (target = \"local\"); a phone's qnn-net-run path"
                         " does not run them yet")
    if stage == "decoder" and plan.form == "parts":
        from vlmrun.stages import ExportForm

        from .options import parts_plan

        p = parts_plan(ctx.model, opts)  # the stage's own export form (as load_stage builds it)
        form = ExportForm.of("decoder", "decoder/parts", ar=p["ar"], ctx=p["ctx"],
                             layers=",".join(map(str, p["layers"])), rmsnorm=opts["rmsnorm"])
        return PartsProbe(stage_handle(), form=form, compiled=compiled, exported=ctx.exported, soc=soc)
    if stage == "decoder" and plan.engine != "host":
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
    kept; with ``part`` (`inside`), that part's prompt binary swapped for its probe binary, whose layer
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
        from .parts_run import HtpGraph

        if self._compiled is None or self.form is None:
            raise BackendError("this parts probe cannot look inside a part (no compile context)")
        if not 1 <= k <= len(self.parts):
            raise UsageError(f"probe: part {k} is not one of the decoder's {len(self.parts)} parts")
        form = part_probe_form(self.form, k)
        art = self._compiled(form)
        ep.check_binary(art.manifest, art.file(), self.soc, f"decoder part {k} probe ({art.path.name})")
        source = self._exported(form)
        graph = HtpGraph(art.file(), self.soc, f"decoder part {k}/{len(self.parts)} probe")
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
