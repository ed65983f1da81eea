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
index), not a part. :attr:`Location.parts` keeps the boundary pass.

``--what-if`` (a quantized device stage): the device side is built again with the located layer kept out of
quantization (the stage option ``keep_fp``, which a backend that can keep layers in float declares), or with
``precision="a16w16"`` (``--what-if-precision a16w16``) quantized with 16-bit activations and weights (the option
``keep_a16w16``), and the diff runs again; the result says how much of the stage's and the logits' error that recovers (the share of the noise
power removed), and the layout-TOML lines that apply it. With ``eval_items`` (``--what-if-eval N``) it also runs
:func:`vlmrun.eval.evaluate` on N items of the default held-out set for the device layout before and after the fix
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
from .metrics import SQNR_CAP_DB, fmt, fmt_shape, tensor_metrics

LOCATABLE = ("vision", "projector", "decoder")
#: the diff checkpoint whose failure sends --locate auto to a stage
STAGE_OF_CHECKPOINT = {"vision": "vision", "projector": "projector", "decoder": "decoder", "generation": "decoder"}
#: the per-layer precision option a backend declares to take --what-if (comma-separated layer names)
KEEP_OPTION = "keep_fp"
#: --what-if-precision -> the per-layer option that applies it, and what it does to the layer
KEEP_OPTIONS = {"fp": "keep_fp", "a16w16": "keep_a16w16"}
KEEP_WORDS = {"fp": "kept in float", "a16w16": "quantized at a16w16 (16-bit activations and weights)"}
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

    @property
    def passed(self) -> bool:
        return all(c.ok for c in self.checks) and not self.note.startswith("shape")

    def to_json(self) -> dict:
        return {"layer": self.name, "shape": list(self.shape), "passed": self.passed, "metrics": self.metrics,
                "drop_db": self.drop_db, "noise_added": self.noise_added, "note": self.note,
                "own_sqnr_db": None if self.own is None else self.own.get("sqnr_db"),
                "own_cosine": None if self.own is None else self.own.get("cosine"),
                "impact_sqnr_db": None if self.impact is None else self.impact.get("sqnr_db"),
                "checks": [attrs.asdict(c) for c in self.checks]}


@attrs.define
class WhatIf:
    """The device side rebuilt with ``layers`` kept out of quantization, and what that recovered."""

    stage: str
    layers: list[str]
    option: str  # the stage option's value that applies it
    before: dict  # checkpoint -> metrics (the original device side)
    after: dict
    recovered: dict  # checkpoint -> share of the noise power removed (1 = all)
    passed_before: bool
    passed_after: bool
    snippet: str
    result: object = None  # the DiffResult of the rebuilt side
    eval: dict | None = None
    precision: str = "fp"  # what the layers got: fp (keep_fp) or a16w16 (keep_a16w16)

    @property
    def option_name(self) -> str:
        return KEEP_OPTIONS[self.precision]

    def to_json(self) -> dict:
        return {"stage": self.stage, "layers": self.layers, "precision": self.precision,
                "option": {self.option_name: self.option},
                "before": self.before, "after": self.after, "recovered": self.recovered,
                "passed_before": self.passed_before, "passed_after": self.passed_after,
                "layout_toml": self.snippet, "eval": self.eval}


@attrs.define
class Location:
    stage: str
    reference: str
    device: str
    points: list[LayerPoint]
    thresholds: dict
    rows: int | None = None  # decoder: teacher-forced rows compared
    notes: list[str] = attrs.field(factory=list)
    what_if: WhatIf | None = None
    parts: list[dict] | None = None  # a decoder in parts: the boundary pass, one entry per part
    probed_part: int | None = None  # the part (from 1) whose layers were probed inside
    probed_why: str = ""

    @property
    def first_failing(self) -> LayerPoint | None:
        return next((p for p in self.points if not p.passed), None)

    @property
    def isolated(self) -> bool:
        """Whether every layer's own error is known (the reference side took injections)."""
        return bool(self.points) and all(p.own is not None for p in self.points if not p.note)

    @property
    def largest_drop(self) -> LayerPoint | None:
        """The layer whose own error alone costs the stage output most (else: the one adding the most relative
        noise power)."""
        if self.isolated:
            cands = [(p, _noise((p.impact or p.own).get("sqnr_db"))) for p in self.points if p.own is not None]
        else:
            cands = [(p, p.noise_added) for p in self.points]
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
        if p.note:
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


# -- what-if --------------------------------------------------------------------------------------------------------
def _noise(sqnr) -> float:
    return math.inf if sqnr is None or not math.isfinite(sqnr) else 10.0 ** (-float(sqnr) / 10.0)


def recovered_share(before_db, after_db) -> float | None:
    """Share of the noise power removed going from ``before_db`` to ``after_db`` SQNR (1 = all, <0 = worse)."""
    nb, na = _noise(before_db), _noise(after_db)
    if not math.isfinite(nb) or nb <= 0:
        return None
    return 1.0 - na / nb if math.isfinite(na) else -math.inf


def layout_snippet(stage: str, backend: str, options: Mapping[str, object]) -> str:
    """Layout-TOML lines for ``stage`` with ``options``."""
    lines = [f"[{stage}]", f'backend = "{backend}"']
    for k, v in options.items():
        if isinstance(v, bool):
            val = "true" if v else "false"
        elif isinstance(v, (int, float)):
            val = str(v)
        else:
            val = '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
        lines.append(f"{k} = {val}")
    return "\n".join(lines)


def what_if(run, location: Location, layers: Sequence[str] | None = None, progress=None, image=None,
            prompt: str | None = None, eval_items: int | None = None, dataset=None, precision: str = "fp"):
    """Rebuild the device side with ``layers`` (default: the located layer) kept out of quantization, diff again.

    ``precision`` (``--what-if-precision``): ``fp`` keeps the layers in float (option ``keep_fp``), ``a16w16``
    quantizes them with 16-bit activations and weights (option ``keep_a16w16``); the rest stays as it was.

    ``run`` is the :class:`vlmrun.diff.DiffRun` whose device pipeline is rebuilt (``run.pipelines``).
    ``eval_items``: also evaluate the device layout before and after the fix, and the reference, on that many items
    of ``dataset`` (default: the held-out set; :func:`what_if_eval`).
    """
    from ..layouts import Layout, StageAssignment
    from ..pipeline import GenerationSettings, Pipeline
    from ..progress import no_progress
    from .capture import capture_pipeline
    from .compare import compare

    progress = progress or no_progress
    if precision not in KEEP_OPTIONS:
        raise UsageError(f"--what-if-precision {precision}: choose one of {', '.join(KEEP_OPTIONS)}")
    option = KEEP_OPTIONS[precision]
    dev_pipe = run.pipelines.get("device")
    if dev_pipe is None:
        raise UsageError("--what-if rebuilds the device side: it needs a live device layout (not --from captures)")
    stage = location.stage
    layers = list(layers or [])
    if not layers:
        target = location.first_failing or location.largest_drop
        if target is None:
            raise UsageError(f"--what-if: no layer of {stage} was located (every layer is within its thresholds)")
        layers = [target.name]
    a = dev_pipe.layout.stages[stage]
    declared = dev_pipe.registry.options.for_stage(a.backend, stage, str(a.options.get("compiler") or a.backend))
    if option not in declared:
        raise UsageError(f"--what-if: backend '{a.backend}' has no per-layer precision {precision} for {stage} (it"
                         f" declares no '{option}' option)")
    info = dev_pipe.registry.backend(a.backend)
    dev_precision = str(a.options.get("precision") or getattr(info, "precision", None) or "fp32")
    if dev_precision in ("fp32", "fp16"):
        raise UsageError(f"--what-if: the device's {stage} runs at {dev_precision}; keeping a layer at higher precision"
                         " applies to quantized precisions (int8, a16w8, ...)")
    existing = [x.strip() for x in str(a.options.get(option) or "").replace(",", " ").split() if x.strip()]
    value = ",".join(dict.fromkeys([*existing, *layers]))
    options = {**dict(a.options), option: value}
    for other in KEEP_OPTIONS.values():  # a layer gets one precision: drop it from the other option
        if other != option and a.options.get(other):
            rest = [x for x in str(a.options[other]).replace(",", " ").split() if x not in layers]
            if rest:
                options[other] = ",".join(rest)
            else:
                options.pop(other)
    stages = {s: (StageAssignment(a.backend, options) if s == stage else dev_pipe.layout.stages[s])
              for s in dev_pipe.layout.stages}
    layout = Layout(f"{dev_pipe.layout.name}+{option}", stages)
    with progress(f"what-if: rebuilding {stage} on {a.backend} with {', '.join(layers)} {KEEP_WORDS[precision]}"):
        pipe = Pipeline.build(dev_pipe.model, layout, store=dev_pipe.store, registry=dev_pipe.registry,
                              progress=dev_pipe.progress)
    ref = run.reference
    settings = GenerationSettings(max_new_tokens=int(ref.meta.get("max_new_tokens") or max(len(ref.tokens), 1)),
                                  ignore_eos=bool(ref.meta.get("ignore_eos")))
    if image is None and ref.meta.get("image") not in (None, "", "<demo image>"):
        image = ref.meta["image"]
    if image is None:
        from ..demo_image import demo_image

        image = demo_image()
    with progress("what-if: capturing the rebuilt device side, teacher-forced"):
        cap = capture_pipeline(pipe, image, prompt if prompt is not None else ref.meta.get("prompt", ""),
                               settings, ref.tokens, str(ref.meta.get("image", "")))
    cap.meta["side"] = "device (what-if)"
    result = compare(ref, cap, run.result.thresholds, run.result.precision)
    boundary = {"vision": "image_features", "projector": "image_embeds", "decoder": "logits"}[stage]
    keys = [(stage, boundary)] + ([("decoder", "logits")] if stage != "decoder" else [])
    before, after, recovered = {}, {}, {}
    for st, tensor in keys:
        b, a2 = run.result.entry(st, tensor).metrics, result.entry(st, tensor).metrics
        label = f"{st}.{tensor}"
        pick = ("sqnr_db", "cosine", "top1_agreement", "kl_mean")
        before[label] = {k: b.get(k) for k in pick if k in b}
        after[label] = {k: a2.get(k) for k in pick if k in a2}
        recovered[label] = recovered_share(b.get("sqnr_db"), a2.get("sqnr_db"))
    snippet = layout_snippet(stage, a.backend, {k: v for k, v in options.items()
                                                if k in ("precision", option) or k in a.options})
    w = WhatIf(stage, layers, value, before, after, recovered, run.result.passed, result.passed, snippet, result,
               precision=precision)
    if eval_items:
        ref_pipe = run.pipelines.get("reference")
        w.eval = what_if_eval(ref_pipe.layout if ref_pipe is not None else "reference", dev_pipe.layout, layout,
                              dev_pipe, int(eval_items), dataset=dataset, progress=progress)
    return w


def layout_toml(layout) -> str:
    """A whole layout as a layout file (every stage's backend and options)."""
    return "\n\n".join(layout_snippet(s, a.backend, a.options) for s, a in layout.stages.items()) + "\n"


def what_if_eval(reference, before, after, pipe, items: int, dataset=None, progress=None) -> dict:
    """Accuracy of ``before`` and ``after`` (layouts) and of ``reference`` (a layout or a preset name) on ``items``
    items of ``dataset`` (default: the held-out set), by :func:`vlmrun.eval.evaluate` on ``pipe``'s model, store
    and plugins (its per-item results are cached in the store, so the reference and an unchanged layout are
    computed once)."""
    import tempfile
    import time
    from pathlib import Path

    from .. import eval as ev
    from ..progress import no_progress

    progress = progress or no_progress
    t = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="vlmrun-what-if-eval-") as tmp:
        specs = {}
        for label, lay in (("reference", reference), ("before", before), ("after", after)):
            if isinstance(lay, str):
                specs[label] = ev.LayoutSpec(label, base=lay)
                continue
            path = Path(tmp) / f"{label}.toml"
            path.write_text(layout_toml(lay))
            specs[label] = ev.LayoutSpec(label, file=str(path))
        with progress(f"what-if: eval on {items} item(s), the device layout before and after the fix and the"
                      " reference"):
            got = ev.evaluate([specs["before"], specs["after"]], dataset, reference=specs["reference"],
                              model=pipe.model, store=pipe.store, registry=pipe.registry, limit=items,
                              progress=progress)
    report = got.report
    entries = report["layouts"]
    ref_entry = next(e for e in entries if e["is_reference"])

    def entry(label):  # a layout equal to another shares its results (and its entry)
        return next((e for e in entries if e["label"] == label), None)

    def acc(e):
        return None if e is None else e["accuracy"]["all"]["accuracy"]

    b, a = entry("before"), entry("after")
    # a layout with the reference's results (the same layout) is the reference's entry
    b = b if b is not None else ref_entry
    a = a if a is not None else (b if layout_toml(after) == layout_toml(before) else ref_entry)
    return {"items": report["items"], "skipped": report["skipped"], "dataset": report["dataset"],
            "reference": acc(ref_entry), "before": acc(b), "after": acc(a),
            "correct": {"reference": ref_entry["accuracy"]["all"]["correct"], "before": b["accuracy"]["all"]["correct"],
                        "after": a["accuracy"]["all"]["correct"]},
            "same_answer_as_reference": {"before": b.get("same_answer_as_reference") if b is not ref_entry else 1.0,
                                         "after": a.get("same_answer_as_reference") if a is not ref_entry else 1.0},
            "seconds": round(time.perf_counter() - t, 3)}


# -- output ----------------------------------------------------------------------------------------------------------
def format_location(loc: Location) -> str:
    """The terminal table of a location: one row per layer, the curve as a bar, then the verdict."""
    lines = ["", f"locate {loc.stage}: layer by layer, both sides on the reference side's inputs"
             f" ({loc.reference} vs {loc.device}" + (f", {loc.rows} teacher-forced rows" if loc.rows else "") + ")"]
    # own: the layer's own error (same input on both sides); at_out: the stage output with only that error
    cols = ("layer", "shape", "sqnr_dB", "cosine", "own_dB", "at_out_dB", "curve", "status")
    rows = []
    first, drop = loc.first_failing, loc.largest_drop
    for p in loc.points:
        m = p.metrics
        s = m.get("sqnr_db")
        bar = "" if s is None or not math.isfinite(s) else "#" * max(0, min(40, int(round(s / 5))))
        if p.note:
            status = "FAIL " + p.note
        elif p.passed:
            status = "ok"
        else:
            status = "FAIL " + ", ".join(c.describe() for c in p.checks if not c.ok)
        mark = []
        if p is first:
            mark.append("<- first to cross")
        if p is drop:
            mark.append("<- largest drop")
        cos = m.get("cosine")
        own = None if p.own is None else p.own.get("sqnr_db")
        out = None if p.impact is None else p.impact.get("sqnr_db")
        rows.append((p.name, fmt_shape(p.shape), "-" if s is None else f"{s:.1f}",
                     "-" if cos is None else f"{cos:.6f}", "-" if own is None else f"{own:.1f}",
                     "-" if out is None else f"{out:.1f}", bar, status + ("  " + " ".join(mark) if mark else "")))
    if loc.parts:
        lines.append(f"parts ({len(loc.parts)}), at their boundaries:")
        for part in loc.parts:
            lo, hi = part["layers"]
            mark = "  <- probed inside (" + loc.probed_why + ")" if part["part"] == loc.probed_part else ""
            lines.append(f"  part {part['part']}: layers {lo}-{hi - 1} -> {part['boundary']}:"
                         f" {fmt(part['sqnr_db'])} dB, cosine {fmt(part['cosine'])},"
                         f" {'ok' if part['passed'] else 'FAIL'}{mark}")
        if loc.probed_part is None and loc.probed_why:
            lines.append(f"  no part probed inside: {loc.probed_why}")
    widths = [max(len(str(r[i])) for r in [cols, *rows]) for i in range(len(cols) - 1)]
    for r in [cols, *rows]:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) + "  " + str(r[-1]))
    for note in loc.notes:
        lines.append(f"note: {note}")
    limits = ", ".join(f"{k} >= {fmt(v)}" for k, v in loc.thresholds.items()) or "none"
    if first is None:
        lines.append(f"located: nothing (every layer of {loc.stage} is within {limits})")
    else:
        why = first.note or ", ".join(c.describe() for c in first.checks if not c.ok)
        lines.append(f"located: {first.name} is the first layer of {loc.stage} to cross its thresholds ({why})")
    if drop is not None:
        k = loc.points.index(drop)
        before = SQNR_CAP_DB if k == 0 else loc.points[k - 1].metrics.get("sqnr_db")
        if loc.isolated:
            at_out = (drop.impact or drop.own).get("sqnr_db")
            lines.append(f"largest drop: {drop.name} (its own error costs the stage output most: {fmt(at_out)} dB SQNR"
                         f" at {loc.points[-1].name} with only that error; the layer alone:"
                         f" {fmt(drop.own.get('sqnr_db'))} dB; {fmt(before)} -> {fmt(drop.metrics.get('sqnr_db'))} dB"
                         " overall)")
        else:
            lines.append(f"largest drop: {drop.name} ({fmt(before)} -> {fmt(drop.metrics.get('sqnr_db'))} dB SQNR;"
                         f" it adds {drop.noise_added:.2e} of relative noise power)")
    if loc.what_if is not None:
        lines.extend(format_what_if(loc.what_if))
    return "\n".join(lines)


def format_what_if(w: WhatIf) -> list[str]:
    lines = ["", f"what-if: {', '.join(w.layers)} {KEEP_WORDS[w.precision]} ({w.option_name} = \"{w.option}\"),"
             f" {w.stage} rebuilt:"]
    for label, b in w.before.items():
        a = w.after.get(label, {})
        rec = w.recovered.get(label)
        parts = [f"SQNR {fmt(b.get('sqnr_db'))} -> {fmt(a.get('sqnr_db'))} dB",
                 f"cosine {fmt(b.get('cosine'))} -> {fmt(a.get('cosine'))}"]
        if "top1_agreement" in b:
            parts.append(f"top-1 {fmt(b.get('top1_agreement'))} -> {fmt(a.get('top1_agreement'))}")
        share = "-" if rec is None else (f"{100 * rec:.0f}%" if math.isfinite(rec) else "worse")
        lines.append(f"  {label}: " + ", ".join(parts) + f"; noise power recovered: {share}")
    if w.eval:
        e = w.eval

        def pct(v):
            return "-" if v is None else f"{100 * v:.1f}%"

        same = e.get("same_answer_as_reference") or {}
        lines.append(f"  eval accuracy ({e.get('items')} held-out items): {pct(e.get('before'))} ->"
                     f" {pct(e.get('after'))} (reference {pct(e.get('reference'))}); same answer as the reference:"
                     f" {pct(same.get('before'))} -> {pct(same.get('after'))}")
    lines.append(f"  thresholds: {'pass' if w.passed_before else 'FAIL'} -> {'pass' if w.passed_after else 'FAIL'}")
    lines.append("  apply it in a layout file (--layout-file):")
    lines.extend("    " + line for line in w.snippet.splitlines())
    return lines


def plot_location(loc: Location, plt) -> object:
    """The per-layer curve (SQNR and cosine) as a matplotlib figure."""
    names = [p.name for p in loc.points]
    x = np.arange(len(names))
    sqnr = [float(np.nan_to_num(p.metrics.get("sqnr_db", np.nan), nan=-SQNR_CAP_DB)) for p in loc.points]
    cos = [float(np.nan_to_num(p.metrics.get("cosine", np.nan), nan=0.0)) for p in loc.points]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 4.8), sharex=True)
    a1.plot(x, sqnr, "o-", color="#1565c0", label="SQNR")
    if loc.isolated:
        own = [float(np.nan_to_num(p.own.get("sqnr_db", np.nan), nan=-SQNR_CAP_DB)) if p.own else np.nan
               for p in loc.points]
        a1.plot(x, own, "^--", color="#2e7d32", alpha=0.8, label="own error (same input)")
        out = [float(np.nan_to_num((p.impact or {}).get("sqnr_db", np.nan), nan=-SQNR_CAP_DB)) for p in loc.points]
        a1.plot(x, out, "v:", color="#ef6c00", alpha=0.8, label="stage output, this layer's error only")
    a2.plot(x, [max(1.0 - c, 1e-12) for c in cos], "s-", color="#6a1b9a")
    if "sqnr_db" in loc.thresholds:
        a1.axhline(loc.thresholds["sqnr_db"], color="black", linestyle="dashed", linewidth=1)
    if "cosine" in loc.thresholds:
        a2.axhline(max(1.0 - loc.thresholds["cosine"], 1e-12), color="black", linestyle="dashed", linewidth=1)
    first, drop = loc.first_failing, loc.largest_drop
    for p, color, label in ((first, "#c62828", "first to cross"), (drop, "#ef6c00", "largest drop")):
        if p is not None:
            k = loc.points.index(p)
            a1.axvline(k, color=color, alpha=0.5, label=f"{label}: {p.name}")
    a1.legend(loc="best", fontsize=7, framealpha=0.6)
    a1.set_ylabel("SQNR (dB)")
    a1.set_title(f"{loc.stage}, layer by layer ({loc.reference} vs {loc.device}; dashes: thresholds)")
    a2.set_yscale("log")
    a2.set_ylabel("1 - cosine")
    a2.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    return fig


def location_html(loc: Location, png: str) -> str:
    """The report's section for a location (``png``: the curve, base64)."""
    import html

    esc = html.escape
    first, drop = loc.first_failing, loc.largest_drop
    verdict = (f"<p class='fail'>first layer to cross the thresholds: <b>{esc(first.name)}</b></p>" if first else
               "<p class='pass'>located: nothing (every layer is within its thresholds)</p>")
    if drop is not None:
        verdict += f"<p>largest drop (relative noise power added): <b>{esc(drop.name)}</b></p>"
    rows = []
    for p in loc.points:
        m = p.metrics
        rows.append(f"<tr class='{'ok' if p.passed else 'bad'}'><td>{esc(p.name)}</td><td>{fmt_shape(p.shape)}</td>"
                    f"<td>{fmt(m.get('sqnr_db'))}</td><td>{fmt(m.get('cosine'))}</td>"
                    f"<td>{fmt(None if p.own is None else p.own.get('sqnr_db'))}</td>"
                    f"<td>{fmt(None if p.impact is None else p.impact.get('sqnr_db'))}</td>"
                    f"<td>{p.noise_added:.2e}</td><td>{esc(p.note)}</td></tr>")
    if loc.parts:
        prow = "".join(
            f"<tr class='{'ok' if p['passed'] else 'bad'}'><td>{p['part']}</td><td>{p['layers'][0]}-"
            f"{p['layers'][1] - 1}</td><td>{esc(p['boundary'])}</td><td>{fmt(p['sqnr_db'])}</td>"
            f"<td>{fmt(p['cosine'])}</td><td>{'probed inside: ' + esc(loc.probed_why) if p['part'] == loc.probed_part else ''}"
            "</td></tr>" for p in loc.parts)
        verdict += ("<p>decoder parts at their boundaries first, then the layers inside the worst part:</p><table>"
                    "<tr><th>part</th><th>layers</th><th>boundary</th><th>SQNR dB</th><th>cosine</th><th></th></tr>"
                    + prow + "</table>")
    extra = ""
    if loc.what_if is not None:
        w = loc.what_if
        what = "stayed in float" if w.precision == "fp" else "were quantized at a16w16"
        extra = (f"<h3>What if {esc(', '.join(w.layers))} {what}?</h3><pre>"
                 + esc("\n".join(format_what_if(w)[1:])) + "</pre>")
    return (f"<h2>Layer by layer: {esc(loc.stage)} (--locate)</h2>{verdict}"
            f"<img alt='per-layer SQNR and cosine' src='data:image/png;base64,{png}'>"
            "<table><tr><th>layer</th><th>shape</th><th>SQNR dB</th><th>cosine</th><th>own SQNR dB</th><th>at output dB</th>"
            "<th>noise added</th><th>note</th></tr>" + "".join(rows) + "</table>" + extra)
