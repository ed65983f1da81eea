"""``vlmrun diff --locate --what-if``: the device side rebuilt with the located layers at a higher precision, diffed
again, and (``--what-if-eval N``) evaluated before and after the fix.

It sits above both `vlmrun.diff` (it captures and compares) and `vlmrun.eval` (it evaluates): neither imports it.
The layers get their precision through the stage option ``layer_precision`` (`vlmrun.stages.LAYER_PRECISION`, the
one per-layer contract `vlmrun tune` also writes): ``LAYER=fp16`` (``--what-if-precision fp``: kept out of
quantization) or ``LAYER=P`` with ``P`` a per-layer precision the stage's backend offers above its own (its
``layer_precisions`` hook, e.g. 16-bit activations and weights); a backend that takes per-layer precisions declares
that option.
"""

from __future__ import annotations

import math
import tempfile
import time
from pathlib import Path
from typing import Sequence

import attrs

from . import eval as ev
from .demo_image import demo_image
from .diff.capture import capture_pipeline
from .diff.compare import compare
from .diff.locate import Location, noise_power
from .diff.metrics import fmt
from .errors import UsageError
from .layouts import Layout, StageAssignment, layout_snippet, layout_toml
from .pipeline import GenerationSettings, Pipeline
from .progress import no_progress
from .stages import LAYER_PRECISION, layer_precision_text, parse_layer_precision

#: ``--what-if-precision fp``: the layer precision it sets (``LAYER=fp16`` in the stage's ``layer_precision``); any
#: other value is one of the precisions the stage's backend offers a layer (``layer_precisions``), set as given
FLOAT = "fp"
FLOAT_LAYER = "fp16"


def keep_words(precision: str) -> str:
    """What ``--what-if-precision precision`` does to a layer, in words."""
    return "kept in float" if precision == FLOAT else f"quantized at {precision}"


@attrs.define
class WhatIf:
    """The device side rebuilt with ``layers`` kept out of quantization, and what that recovered."""

    stage: str
    layers: list[str]
    option: str  # the stage's layer_precision value that applies it (``LAYER=fp16;...``)
    before: dict  # checkpoint -> metrics (the original device side)
    after: dict
    recovered: dict  # checkpoint -> share of the noise power removed (1 = all)
    passed_before: bool
    passed_after: bool
    snippet: str
    result: object = None  # the DiffResult of the rebuilt side
    eval: dict | None = None
    precision: str = FLOAT  # what the layers got (--what-if-precision): fp (LAYER=fp16) or a backend's (LAYER=P)

    @property
    def option_name(self) -> str:
        return LAYER_PRECISION

    def to_json(self) -> dict:
        return {"stage": self.stage, "layers": self.layers, "precision": self.precision,
                "option": {self.option_name: self.option},
                "before": self.before, "after": self.after, "recovered": self.recovered,
                "passed_before": self.passed_before, "passed_after": self.passed_after,
                "layout_toml": self.snippet, "eval": self.eval}

    def lines(self) -> list[str]:
        """The what-if as the lines that follow a location's table."""
        return format_what_if(self)


# -- the rebuild --------------------------------------------------------------------------------------------------------
def recovered_share(before_db, after_db) -> float | None:
    """Share of the noise power removed going from ``before_db`` to ``after_db`` SQNR (1 = all, <0 = worse)."""
    nb, na = noise_power(before_db), noise_power(after_db)
    if not math.isfinite(nb) or nb <= 0:
        return None
    return 1.0 - na / nb if math.isfinite(na) else -math.inf


def what_if(run, location: Location, layers: Sequence[str] | None = None, progress=None, image=None,
            prompt: str | None = None, eval_items: int | None = None, dataset=None, precision: str = FLOAT):
    """Rebuild the device side with ``layers`` (default: the located layer) kept out of quantization, diff again.

    ``precision`` (``--what-if-precision``): ``fp`` keeps the layers in float (``LAYER=fp16`` in the stage option
    ``layer_precision``); another value must be one the stage's backend offers a layer above the stage's own
    precision (its ``layer_precisions`` hook), set as ``LAYER=precision``; the rest stays as it was (other layers'
    entries kept; a layer already listed gets the new precision).

    ``run`` is the `vlmrun.diff.DiffRun` whose device pipeline is rebuilt (``run.pipelines``).
    ``eval_items``: also evaluate the device layout before and after the fix, and the reference, on that many items
    of ``dataset`` (default: the held-out set; `what_if_eval`).
    """

    progress = progress or no_progress
    option = LAYER_PRECISION
    dev_pipe = run.pipelines.get("device")
    if dev_pipe is None:
        raise UsageError("--what-if rebuilds the device side: it needs a live device layout (not --from captures)")
    stage = location.stage
    layers = list(layers or [])
    if not layers:
        first = location.first_failing
        if first is not None and first.part_output is not None:  # a whole part crossed, its layers not probed
            raise UsageError(f"--what-if: {stage} part {first.part_output} crosses the thresholds at its output"
                             f" ({first.name}) but its layers were not probed one by one; name the layers"
                             " (--what-if LAYER ...)")
        target = first or location.largest_drop
        if target is None:
            raise UsageError(f"--what-if: no layer of {stage} was located (every layer is within its thresholds)")
        layers = [target.name]
    a = dev_pipe.layout.stages[stage]
    declared = dev_pipe.registry.options.for_stage(a.backend, stage, str(a.options.get("compiler") or a.backend))
    if option not in declared:
        raise UsageError(f"--what-if: backend '{a.backend}' takes no per-layer precision for {stage} (it declares"
                         f" no '{option}' option)")
    backend_precision = dev_pipe.registry.backend(a.backend).precision  # a backend that declares no precision option
    dev_precision = str(dev_pipe.stage_options(stage).get("precision") or backend_precision)
    if dev_precision in ("fp32", "fp16"):
        raise UsageError(f"--what-if: the device's {stage} runs at {dev_precision}; keeping a layer at higher precision"
                         " applies to quantized precisions")
    if precision != FLOAT:
        offered = list(dev_pipe.registry.hook.layer_precisions(backend=a.backend, stage=stage,
                                                               options=dict(a.options)) or [])
        if precision not in offered:
            raise UsageError(f"--what-if-precision {precision}: backend '{a.backend}' offers a layer of {stage} at"
                             f" {dev_precision} {', '.join([FLOAT, *offered])}")
    merged = parse_layer_precision(a.options.get(option))
    merged.update({layer: FLOAT_LAYER if precision == FLOAT else precision for layer in layers})  # one per layer
    value = layer_precision_text(merged)
    options = {**dict(a.options), option: value}
    stages = {s: (StageAssignment(a.backend, options) if s == stage else dev_pipe.layout.stages[s])
              for s in dev_pipe.layout.stages}
    layout = Layout(f"{dev_pipe.layout.name}+{option}", stages)
    with progress(f"what-if: rebuilding {stage} on {a.backend} with {', '.join(layers)} {keep_words(precision)}"):
        pipe = Pipeline.build(dev_pipe.model, layout, store=dev_pipe.store, registry=dev_pipe.registry,
                              progress=dev_pipe.progress)
    ref = run.reference
    settings = GenerationSettings(max_new_tokens=int(ref.meta.get("max_new_tokens") or max(len(ref.tokens), 1)),
                                  ignore_eos=bool(ref.meta.get("ignore_eos")))
    if image is None and ref.meta.get("image") not in (None, "", "<demo image>"):
        image = ref.meta["image"]
    if image is None:
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


def what_if_eval(reference, before, after, pipe, items: int, dataset=None, progress=None) -> dict:
    """Accuracy of ``before`` and ``after`` (layouts) and of ``reference`` (a layout or a preset name) on ``items``
    items of ``dataset`` (default: the held-out set), by `vlmrun.eval.evaluate` on ``pipe``'s model, store
    and plugins (its per-item results are cached in the store, so the reference and an unchanged layout are
    computed once)."""

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


def format_what_if(w: WhatIf) -> list[str]:
    lines = ["", f"what-if: {', '.join(w.layers)} {keep_words(w.precision)} ({w.option_name} = \"{w.option}\"),"
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
