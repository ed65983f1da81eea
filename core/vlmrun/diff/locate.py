"""``vlmrun diff --locate``: which layer inside a failing stage drifts first, and ``--what-if``: what fixes it.

A diff names the first stage that crosses its thresholds. Locating goes inside it: both sides load the stage's
*probe* variant (the same graph with its layer outputs as extra outputs, through the optional ``load_probe`` /
``run_probe`` hooks: export form ``.probe()``, compiled and cached like any artifact), run it on the same inputs
(the reference side's stage inputs: its ``pixel_values``, its ``image_features``, its prompt embeddings plus
the reference tokens, teacher-forced) and every layer output is compared::

    vision      vision.stem, vision.stage0 .. vision.stage{n-1}, vision.final_conv (= image_features)
    projector   projector.linear_1, projector.linear_2 (= image_embeds)
    decoder     decoder.layer0 .. decoder.layer{L-1}, decoder.norm, decoder.lm_head (= logits)

(the names come from the exporter). Both sides get identical inputs, so each layer's error is the stage's own.
Per layer: SQNR, cosine (and max/mean abs, relative L2), checked against the stage's thresholds. The result
names the **first layer** that crosses them, and the layer with the **largest drop**.

A layer's error is partly its own and partly the error it was handed, amplified or damped. To tell them apart
the reference side runs once more per layer with the device's error at the previous layer added in
(``run_probe`` inputs ``inject:<layer>``: the reference layer k on the device's input to it); the difference
between that and the device's layer k is the layer's **own** error (``own_sqnr_db``). The largest drop is the
layer with the largest own error. A reference backend that does not take injections (the core checks that the
injected layer shows them) leaves the own errors out; the largest drop is then the layer that adds the most noise
power relative to the signal (``10^(-SQNR/10)`` minus the previous layer's).

**Parts.** A device probe of a decoder in parts (a backend's multi-part decoder form) reports the part
boundaries only: the residual stream each part hands to the next (``decoder.layer{hi-1}``) and the logits. Such a
handle declares ``parts`` (the layer ranges ``[(lo, hi), ...]``, global indices) and ``inside(k)`` (a probe handle
that also reports the layers of part ``k``, from 1, compiled like the part and cached in the store). The boundaries
are compared first; then the worst part (the first whose boundary crosses the thresholds, else the one adding the
most noise power) is probed inside and its layers join the curve, so the first layer named is a layer (global
index), not a part. `Location.parts` keeps the boundary pass.

``--what-if`` (`vlmrun.what_if`, above both this module and `vlmrun.eval`; a quantized device stage): the device
side is built again with the located layer kept out of
quantization (``LAYER=fp16`` in the stage option ``layer_precision``, which a backend that takes per-layer
precisions declares), or (``--what-if-precision P``, ``LAYER=P``) at a precision its backend offers a layer, and the
diff runs again; the result says how much of the stage's and the logits' error that recovers (the share of the noise
power removed), and the layout-TOML lines that apply it. With ``eval_items`` (``--what-if-eval N``) it also runs
`vlmrun.eval.evaluate` on N items of the default held-out set for the device layout before and after the fix
(and the reference) and reports their accuracy.
"""

from __future__ import annotations

import math
from typing import Mapping, Sequence

import attrs
import numpy as np

from ..errors import BackendError, UsageError
from ..stages import CONTRACTS, QuantizedTensor
from .compare import Check
from .metrics import SQNR_CAP_DB, fmt_shape, tensor_metrics

LOCATABLE = ("vision", "projector", "decoder")
#: the diff checkpoint whose failure sends --locate auto to a stage
STAGE_OF_CHECKPOINT = {"vision": "vision", "projector": "projector", "decoder": "decoder", "generation": "decoder"}
LAYER_METRICS = ("sqnr_db", "cosine")
NOISE_FLOOR = 1e-9  # relative noise power below which no layer is "the largest drop" (SQNR above 90 dB)


@attrs.define
class LayerPoint:
    """One probe point: a layer's output compared between the sides."""

    name: str
    shape: tuple
    metrics: dict
    checks: list[Check] = attrs.field(factory=list)
    drop_db: float | None = None  # SQNR of the previous point minus this one's
    noise_added: float = 0.0  # relative noise power added by this layer (10^(-SQNR/10) minus the previous)
    note: str = ""
    own: dict | None = None  # the layer's own error: device layer vs reference layer on the device's input
    impact: dict | None = None  # the stage output with only this layer's own error (reference elsewhere)
    part_output: int | None = None  # a decoder part's output whose layers were not probed one by one: its error
    #                                 is the whole part's, never one layer's (no largest drop, no own error)

    @property
    def passed(self) -> bool:
        return all(c.ok for c in self.checks) and not self.note.startswith("shape")

    def to_json(self) -> dict:
        return {"layer": self.name, "shape": list(self.shape), "passed": self.passed, "metrics": self.metrics,
                "drop_db": self.drop_db, "noise_added": self.noise_added, "note": self.note,
                "own_sqnr_db": None if self.own is None else self.own.get("sqnr_db"),
                "own_cosine": None if self.own is None else self.own.get("cosine"),
                "impact_sqnr_db": None if self.impact is None else self.impact.get("sqnr_db"),
                "part_output": self.part_output,
                "checks": [attrs.asdict(c) for c in self.checks]}


@attrs.define
class Location:
    stage: str
    reference: str
    device: str
    points: list[LayerPoint]
    thresholds: dict
    rows: int | None = None  # decoder: teacher-forced rows compared
    notes: list[str] = attrs.field(factory=list)
    what_if: object = None  # a vlmrun.what_if.WhatIf, when --what-if ran
    parts: list[dict] | None = None  # a decoder in parts: the boundary pass, one entry per part
    probed_part: int | None = None  # the part (from 1) whose layers were probed inside
    probed_why: str = ""

    @property
    def first_failing(self) -> LayerPoint | None:
        return next((p for p in self.points if not p.passed), None)

    @property
    def isolated(self) -> bool:
        """Whether every layer's own error is known (the reference side took injections)."""
        return bool(self.points) and all(p.own is not None for p in self.points
                                         if not p.note and p.part_output is None)

    @property
    def largest_drop(self) -> LayerPoint | None:
        """The layer whose own error alone costs the stage output most (else: the one adding the most relative
        noise power)."""
        layers = [p for p in self.points if p.part_output is None]  # a part's output is no layer
        if self.isolated:
            cands = [(p, noise_power((p.impact or p.own).get("sqnr_db"))) for p in layers if p.own is not None]
        else:
            cands = [(p, p.noise_added) for p in layers]
        best = max(cands, key=lambda c: c[1], default=None)
        return best[0] if best is not None and best[1] > NOISE_FLOOR else None

    @property
    def located(self) -> str | None:
        """The layer to look at: the first that crosses the thresholds (None when none does)."""
        p = self.first_failing
        return p.name if p is not None else None

    def to_json(self) -> dict:
        first, drop = self.first_failing, self.largest_drop
        return {
            "stage": self.stage, "reference": self.reference, "device": self.device,
            "first_failing": first.name if first else None,
            "largest_drop": drop.name if drop else None,
            "isolated": self.isolated,
            "thresholds": self.thresholds, "rows": self.rows, "notes": self.notes,
            "layers": [p.to_json() for p in self.points],
            "parts": self.parts, "probed_part": self.probed_part, "probed_why": self.probed_why or None,
            "what_if": self.what_if.to_json() if self.what_if else None,
        }


# -- choosing the stage ------------------------------------------------------------------------------------------
def stage_to_locate(result, asked: str) -> tuple[str | None, str]:
    """(stage, why) for ``--locate asked`` (``auto``: the diff's culprit; or a stage name)."""
    if asked != "auto":
        if asked not in LOCATABLE:
            raise UsageError(f"--locate {asked}: stages with layers are {', '.join(LOCATABLE)} (or auto)")
        return asked, f"asked for {asked}"
    culprit = result.culprit
    if culprit is None:
        return None, "every stage is within its thresholds: nothing to locate"
    stage = STAGE_OF_CHECKPOINT.get(culprit)
    if stage is None:
        what = {"embed": "a table lookup", "splice": "host code", "preprocess": "host code"}.get(culprit, "")
        return None, f"the culprit {culprit} has no layers to locate" + (f" ({what})" if what else "")
    return stage, f"the likely culprit is {culprit}"


# -- probes --------------------------------------------------------------------------------------------------------
def load_probe(pipe, stage: str):
    """The probe handle of ``stage`` on ``pipe``'s backend for it (the optional ``load_probe`` hook)."""
    from ..pipeline import StageContext

    a = pipe.layout.stages[stage]
    ctx = StageContext(a.backend, stage, pipe.model, dict(a.options), pipe.store, pipe.registry, False,
                       pipe.progress)
    handle = pipe.registry.hook.load_probe(backend=a.backend, stage=stage, ctx=ctx)
    if handle is None:
        raise BackendError(f"backend '{a.backend}' has no probe for stage '{stage}' (it does not implement the"
                           f" optional load_probe / run_probe hooks), so --locate cannot look inside it")
    return handle


def run_probe(pipe, stage: str, handle, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    backend = pipe.layout.backend(stage)
    out = pipe.registry.hook.run_probe(backend=backend, stage=stage, handle=handle, inputs=dict(inputs))
    if out is None:
        raise BackendError(f"backend '{backend}' loaded a probe for '{stage}' but does not run it (run_probe)")
    result = {}
    for k, v in out.items():
        if isinstance(v, QuantizedTensor):
            v = v.dequantize()
        result[k] = np.asarray(v)
    for spec in CONTRACTS[stage].outputs:
        if spec.name not in result:
            raise BackendError(f"backend '{backend}' probe of '{stage}' returned no '{spec.name}'")
    return result


def probe_inputs(stage: str, ref_capture, embed_tokens) -> dict[str, np.ndarray]:
    """The stage's inputs from the reference capture (the decoder: prompt + reference tokens, teacher-forced)."""
    t = ref_capture.tensors
    if stage == "vision":
        return {"pixel_values": np.asarray(t["pixel_values"], np.float32)}
    if stage == "projector":
        return {"image_features": np.asarray(t["image_features"], np.float32)}
    embeds = np.asarray(t["inputs_embeds"], np.float32)
    forced = np.asarray(ref_capture.tokens, np.int64)
    if forced.size:
        embeds = np.concatenate([embeds, embed_tokens(forced).astype(np.float32)], axis=1)
    return {"inputs_embeds": embeds}


def compare_points(stage: str, ref: Mapping[str, np.ndarray], dev: Mapping[str, np.ndarray],
                   thresholds: Mapping[str, float]) -> tuple[list[LayerPoint], list[str]]:
    """Per-layer metrics of ``dev`` against ``ref`` (probe names in ``ref``'s order) and their checks."""
    main = {s.name for s in CONTRACTS[stage].outputs}
    names = [k for k in ref if k not in main]
    notes = []
    missing = [n for n in names if n not in dev]
    if missing:
        notes.append(f"the device probe lacks {', '.join(missing)} (compared: the layers both sides report)")
    extra = [k for k in dev if k not in main and k not in ref]
    if extra:
        notes.append(f"the device probe reports layers the reference does not: {', '.join(extra)}")
    points: list[LayerPoint] = []
    prev_sqnr, prev_noise = SQNR_CAP_DB, 0.0
    for name in names:
        if name not in dev:
            continue
        r, d = ref[name], dev[name]
        if r.shape != d.shape:
            points.append(LayerPoint(name, tuple(d.shape), {}, note=f"shape {fmt_shape(r.shape)} vs"
                                     f" {fmt_shape(d.shape)}"))
            continue
        m = tensor_metrics(r, d)
        checks = []
        for metric in LAYER_METRICS:
            limit = thresholds.get(metric)
            if limit is None:
                continue
            v = m[metric]
            ok = v is not None and v >= limit  # NaN fails
            checks.append(Check(metric, ">=", float(limit), v, bool(ok)))
        sqnr = m["sqnr_db"]
        noise = math.inf if sqnr is None or not math.isfinite(sqnr) else 10.0 ** (-sqnr / 10.0)
        drop = None if not math.isfinite(noise) else prev_sqnr - sqnr
        points.append(LayerPoint(name, tuple(d.shape), m, checks, drop, noise - prev_noise))
        if math.isfinite(noise):
            prev_sqnr, prev_noise = sqnr, noise
    return points, notes


def locate(ref_pipe, dev_pipe, stage: str, ref_capture, thresholds: Mapping[str, Mapping[str, float]],
           progress=None) -> Location:
    """Load ``stage``'s probe on both sides, run both on the reference side's inputs, compare every layer."""
    from ..progress import no_progress

    progress = progress or no_progress
    if stage not in LOCATABLE:
        raise UsageError(f"stage '{stage}' has no layers to locate; stages with layers are {', '.join(LOCATABLE)}")
    inputs = probe_inputs(stage, ref_capture, ref_pipe.embed_tokens)
    outs, handles = {}, {}
    for side, pipe in (("reference", ref_pipe), ("device", dev_pipe)):
        backend = pipe.layout.backend(stage)
        with progress(f"probing {stage} layer by layer on the {side} side ({backend})"):
            handles[side] = load_probe(pipe, stage)
            outs[side] = run_probe(pipe, stage, handles[side], inputs)
    limits = {k: v for k, v in dict(thresholds.get(stage, {})).items() if k in LAYER_METRICS}
    points, notes = compare_points(stage, outs["reference"], outs["device"], limits)
    if not points:
        raise BackendError(f"the probes of '{stage}' reported no layer outputs on both sides")
    parts, probed, why = None, None, ""
    ranges = getattr(handles["device"], "parts", None) if stage == "decoder" else None
    if ranges:
        parts = part_summary(points, ranges)
        probed, why = worst_part(parts)
        if probed is None:
            notes.append(f"parts: {why}; no part probed inside")
        elif not callable(getattr(handles["device"], "inside", None)):
            notes.append(f"parts: backend '{dev_pipe.layout.backend(stage)}' probes the part boundaries only")
            probed = None
        else:
            lo, hi = ranges[probed - 1]
            with progress(f"probing the layers inside decoder part {probed}/{len(ranges)} (layers {lo}-{hi - 1};"
                          f" {why}) on the device side"):
                inner = handles["device"].inside(probed)
                outs["device"] = {**outs["device"], **run_probe(dev_pipe, stage, inner, inputs)}
            points, notes = compare_points(stage, outs["reference"], outs["device"], limits)
        # the outputs of the parts not probed inside stand for their whole part
        unprobed = {part["boundary"]: part["part"] for part in parts if part["part"] != probed}
        for p in points:
            p.part_output = unprobed.get(p.name)
    with progress(f"isolating each layer's own error ({len(points) - 1} reference runs)"):
        isolate(ref_pipe, stage, handles["reference"], inputs, outs["reference"], outs["device"], points, notes)
    rows = inputs["inputs_embeds"].shape[1] if stage == "decoder" else None
    return Location(stage, ref_pipe.layout.backend(stage), dev_pipe.layout.backend(stage), points, limits, rows,
                    notes, parts=parts, probed_part=probed, probed_why=why)


def part_summary(points: Sequence[LayerPoint], ranges: Sequence[Sequence[int]]) -> list[dict]:
    """One entry per part from the boundary pass: its layers, its boundary point and that point's metrics."""
    by_name = {p.name: p for p in points}
    out = []
    for k, (lo, hi) in enumerate(ranges, start=1):
        name = "decoder.lm_head" if k == len(ranges) else f"decoder.layer{hi - 1}"
        p = by_name.get(name)
        out.append({"part": k, "layers": [int(lo), int(hi)], "boundary": name,
                    "sqnr_db": None if p is None else p.metrics.get("sqnr_db"),
                    "cosine": None if p is None else p.metrics.get("cosine"),
                    "noise_added": None if p is None or p.note else p.noise_added,
                    "passed": None if p is None else p.passed})
    return out


def worst_part(parts: Sequence[dict]) -> tuple[int | None, str]:
    """(the part to probe inside, why): the first whose boundary crosses the thresholds, else the one whose
    boundary adds the most relative noise power (none when every boundary is exact)."""
    first = next((p for p in parts if p["passed"] is False), None)
    if first is not None:
        return first["part"], f"the first part whose output crosses the thresholds ({first['boundary']})"
    cands = [p for p in parts if p["noise_added"] is not None]
    best = max(cands, key=lambda p: p["noise_added"], default=None)
    if best is None or best["noise_added"] <= NOISE_FLOOR:
        return None, "every part's output is exact"
    return best["part"], f"the part adding the most noise power ({best['boundary']})"


def isolate(ref_pipe, stage: str, handle, inputs, ref: Mapping[str, np.ndarray], dev: Mapping[str, np.ndarray],
            points: list[LayerPoint], notes: list[str]) -> None:
    """Set each point's ``own`` error: the device layer against the reference layer run on the device's input to it
    (the device's previous layer output, injected into the reference probe as ``inject:<previous layer>``)."""
    pick = ("sqnr_db", "cosine", "rel_l2")
    for k, p in enumerate(points):
        if p.note or p.part_output is not None:  # a part's output: its error is the part's, not its own
            continue
        prev = points[k - 1] if k else None
        if prev is None:  # the stage's inputs are the same on both sides: the first layer's error is its own
            p.own = {m: p.metrics[m] for m in pick}
            continue
        if prev.note:
            continue
        delta = dev[prev.name].astype(np.float32) - ref[prev.name].astype(np.float32)
        if not np.any(delta):
            base = ref[p.name]
        else:
            out = run_probe(ref_pipe, stage, handle, {**inputs, f"inject:{prev.name}": delta})
            scale = float(np.abs(dev[prev.name]).max()) or 1.0
            if not np.allclose(out[prev.name], dev[prev.name], rtol=1e-4, atol=1e-5 * scale):
                notes.append(f"the reference backend ({ref_pipe.layout.backend(stage)}) does not take injected inputs"
                             " (inject:<layer>): each layer's own error is not known; the largest drop is the layer"
                             " adding the most relative noise power")
                for q in points:
                    q.own = None
                return
            base = out[p.name]
        m = tensor_metrics(base, dev[p.name])
        p.own = {k2: m[k2] for k2 in pick}
    # each layer's own error alone, carried by the reference's later layers to the stage output
    last = points[-1]
    for k, p in enumerate(points):
        if p.own is None:
            continue
        if p is last:
            p.impact = dict(p.own)
            continue
        prev = points[k - 1] if k else None
        if prev is None or not np.any(dev[prev.name].astype(np.float32) - ref[prev.name].astype(np.float32)):
            own_err = dev[p.name].astype(np.float32) - ref[p.name].astype(np.float32)
        else:
            got = run_probe(ref_pipe, stage, handle, {**inputs, f"inject:{prev.name}": dev[prev.name].astype(
                np.float32) - ref[prev.name].astype(np.float32)})
            own_err = dev[p.name].astype(np.float32) - got[p.name].astype(np.float32)
        if not np.any(own_err):
            p.impact = {"sqnr_db": SQNR_CAP_DB, "cosine": 1.0, "rel_l2": 0.0}
            continue
        out = run_probe(ref_pipe, stage, handle, {**inputs, f"inject:{p.name}": own_err})
        m = tensor_metrics(ref[last.name], out[last.name])
        p.impact = {k2: m[k2] for k2 in pick}


def noise_power(sqnr) -> float:
    """Relative noise power of an SQNR in dB (``10^(-SQNR/10)``; infinite when unknown)."""
    return math.inf if sqnr is None or not math.isfinite(sqnr) else 10.0 ** (-float(sqnr) / 10.0)
