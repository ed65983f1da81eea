"""`tune`: the budget, the checks of what can be tuned, and the setup of the search (`.climb`) and its result: the
points, their Pareto front, the winner."""

from __future__ import annotations

import math
import os
import time
from typing import Callable, Sequence

import attrs

from .. import plugins as plugins_mod
from ..diff.locate import load_probe
from ..errors import UsageError
from ..eval import DEFAULT_MAX_NEW_TOKENS, LayoutSpec, heldout_dataset, read_dataset
from ..eval.engine import layout_key
from ..model import open_model
from ..pipeline import GenerationSettings, Pipeline
from ..progress import no_progress
from ..stages import STAGES
from ..store import ArtifactStore
from .climb import TUNABLE, Candidate, Climb, Point, PointCache, fewest_bytes
from .executors import executor_for
from .front import pareto_front

DEFAULT_MAX_CANDIDATES = 12


def default_base(registry) -> str:
    """Where a tune starts when no layout is given: the preset a plugin declares with ``tune`` options, with them
    (`vlmrun.plugins.Preset.tune_spec`)."""
    found = [p.tune_spec for p in registry.presets.values() if p.tune is not None]
    if not found:
        raise UsageError("no installed plugin declares a layout for vlmrun tune to start from: give one with"
                         " --layout or --layout-file")
    return found[0]


# --------------------------------------------------------------------------------------------------------------
# budget


def _fraction(name: str, value) -> float | None:
    if value is None:
        return None
    text = str(value).strip()
    try:
        v = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise UsageError(f"{name} {value!r} is not a number (a fraction such as 0.05, or a percentage: 5%)") from None
    if not 0.0 <= v <= 1.0 or math.isnan(v):
        raise UsageError(f"{name} {value!r} is outside 0..1 (a fraction such as 0.05, or a percentage: 5%)")
    return v


@attrs.frozen
class Budget:
    """What a build must keep to count: accuracy at most ``max_accuracy_drop`` below the reference's, at least
    ``min_answers_as_reference`` of the answers equal to the reference's, a median logits SQNR of at least
    ``min_logits_sqnr`` dB (teacher-forced). Fractions are 0..1 (``"5%"`` is taken too); unset limits are not
    checked. With no limit set (``Budget()``, or `of` without one) the budget is the default: every answer as the
    reference's; a budget never takes every build."""

    max_accuracy_drop: float | None = None
    min_answers_as_reference: float | None = None
    min_logits_sqnr: float | None = None

    def __attrs_post_init__(self):
        if self.max_accuracy_drop is None and self.min_answers_as_reference is None and self.min_logits_sqnr is None:
            object.__setattr__(self, "min_answers_as_reference", 1.0)  # frozen: set once, here

    @classmethod
    def of(cls, max_accuracy_drop=None, min_answers_as_reference=None, min_logits_sqnr=None) -> "Budget":
        """A checked budget (UsageError for values that cannot be one)."""
        drop = _fraction("--max-accuracy-drop", max_accuracy_drop)
        answers = _fraction("--min-answers-as-reference", min_answers_as_reference)
        # a limit that no build can miss would take every build, whatever its answers: refused, not applied
        if drop is not None and drop >= 1.0:
            raise UsageError(f"--max-accuracy-drop {max_accuracy_drop!r} takes every build (no accuracy drops by more"
                             " than all of it); give less than 1 (100%), e.g. 0.05")
        if answers is not None and answers <= 0.0:
            raise UsageError(f"--min-answers-as-reference {min_answers_as_reference!r} takes every build; give more"
                             " than 0, e.g. 0.9 (90%)")
        sqnr = None
        if min_logits_sqnr is not None:
            try:
                sqnr = float(min_logits_sqnr)
            except (TypeError, ValueError):
                raise UsageError(f"--min-logits-sqnr {min_logits_sqnr!r} is not a number of dB") from None
            if not math.isfinite(sqnr) or not 0 < sqnr <= 200:  # at 0 dB and below the noise is the logits' size
                raise UsageError(f"--min-logits-sqnr {min_logits_sqnr!r} dB is not a usable floor: give more than 0"
                                 " dB (below, the logits are mostly noise) and at most 200, e.g. 25")
        return cls(drop, answers, sqnr)

    def misses(self, point: "Point") -> list[str]:
        """What ``point`` misses, one phrase each (empty: within the budget)."""
        out = []
        # written as "not within": a missing (None) or NaN figure misses, never meets, a limit
        if self.max_accuracy_drop is not None and (point.accuracy_drop is None
                                                   or not point.accuracy_drop <= self.max_accuracy_drop + 1e-9):
            out.append(f"accuracy drop {_pct(point.accuracy_drop)} > {_pct(self.max_accuracy_drop)}")
        if self.min_answers_as_reference is not None and (
                point.answers_as_reference is None
                or not point.answers_as_reference >= self.min_answers_as_reference - 1e-9):
            out.append(f"answers as reference {_pct(point.answers_as_reference)} <"
                       f" {_pct(self.min_answers_as_reference)}")
        if self.min_logits_sqnr is not None and (point.logits_sqnr_db is None
                                                 or not point.logits_sqnr_db >= self.min_logits_sqnr):
            out.append(f"logits SQNR {point.logits_sqnr_db if point.logits_sqnr_db is None else round(point.logits_sqnr_db, 2)}"
                       f" dB < {self.min_logits_sqnr} dB")
        return out

    def describe(self) -> str:
        parts = []
        if self.max_accuracy_drop is not None:
            parts.append(f"accuracy drop <= {_pct(self.max_accuracy_drop)}")
        if self.min_answers_as_reference is not None:
            parts.append(f"answers as reference >= {_pct(self.min_answers_as_reference)}")
        if self.min_logits_sqnr is not None:
            parts.append(f"logits SQNR >= {self.min_logits_sqnr} dB")
        return ", ".join(parts)


def _pct(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


# --------------------------------------------------------------------------------------------------------------
# the result


@attrs.define
class TuneResult:
    base: str
    budget: Budget
    points: list[Point]
    front: list[Point]
    winner: Point | None
    sensitivity: dict  # stage -> [[layer, noise power of its own error at the stage output], ...], most first
    ladders: dict  # stage -> [precisions above the stage's own]
    steps: list  # per step: the candidates measured and the one taken
    built: int  # candidates compiled and evaluated by this run
    wall_s: float
    items: int
    dataset: str

    def to_json(self) -> dict:
        return {
            "base": self.base, "budget": attrs.asdict(self.budget), "budget_text": self.budget.describe(),
            "winner": self.winner.label if self.winner else None, "built": self.built, "wall_s": round(self.wall_s, 1),
            "candidates": len(self.points), "items": self.items, "dataset": self.dataset,
            "sensitivity": self.sensitivity, "ladders": self.ladders, "steps": self.steps,
            "front": [p.label for p in self.front], "points": [p.to_json() for p in self.points],
        }


# --------------------------------------------------------------------------------------------------------------
# what is tuned


def layer_names(ref_pipe, stage: str) -> list[str]:
    """The layers of ``stage`` as the probes name them (the reference's probe export: ``decoder.layer0``...)."""
    handle = load_probe(ref_pipe, stage)
    arts = list(getattr(handle, "artifacts", ()) or ())
    manifest = dict(getattr(handle, "manifest", None) or (arts[0].manifest if arts else {}))
    return [name for name, _ in manifest.get("probe_outputs") or ()]


def _example(registry, stage: str) -> str:
    """`` (e.g. STAGE.precision=P)`` from the tune preset's options, '' when it sets none for ``stage``."""
    for p in registry.presets.values():
        if p.tune is not None and p.tune.get(stage, {}).get("precision"):
            return f" (e.g. {stage}.precision={p.tune[stage]['precision']})"
    return ""


def tuned_ladders(base_layout, registry, stages: Sequence[str] | None, layers: Sequence[str] | None,
                  base_text: str) -> dict[str, list[str]]:
    """Per stage to tune, in order (``stages``, or every stage whose backend offers per-layer precisions above the
    stage's own), those precisions. `vlmrun.errors.UsageError` for a stage that cannot be tuned, or a layer in
    ``layers`` of a stage not tuned."""
    ladders: dict[str, list[str]] = {}
    for stage in TUNABLE:
        a = base_layout.stages[stage]
        got = registry.hook.layer_precisions(backend=a.backend, stage=stage, options=dict(a.options))
        if got:
            ladders[stage] = list(got)
    asked = list(dict.fromkeys(stages)) if stages else None
    for stage in asked or ():
        if stage not in STAGES:
            raise UsageError(f"unknown stage '{stage}' in --stages; stages are {', '.join(STAGES)}")
        if stage not in ladders:
            a = base_layout.stages[stage]
            precision = a.options.get("precision") or registry.backend(a.backend).precision
            example = _example(registry, stage)
            raise UsageError(f"stage '{stage}' ({a.backend}, precision {precision}) has no quantized precision to"
                             f" tune: give it one in the layout{example} or leave it out of --stages")
    tuned = asked or list(ladders)
    if not tuned:
        starts = [p.tune_spec for p in registry.presets.values() if p.tune is not None]
        raise UsageError(f"layout '{base_text}' has no stage with a quantized precision to tune"
                         + (f"; e.g. --layout '{starts[0]}'" if starts else ""))
    if layers:
        for name in layers:
            stage = str(name).split(".", 1)[0]
            if stage not in tuned:
                raise UsageError(f"--layers {name}: its stage '{stage}' is not tuned (tuned: {', '.join(tuned)})")
    return {s: ladders[s] for s in tuned}


def allowed_layers(ref_pipe, tuned: Sequence[str], layers: Sequence[str] | None) -> set[str]:
    """The layers the climb may raise: ``layers`` (`vlmrun.errors.UsageError` for one the reference's probes do not
    name), or every layer of the ``tuned`` stages."""
    names = {s: layer_names(ref_pipe, s) for s in tuned}
    if layers:
        known = {n for v in names.values() for n in v}
        for name in layers:
            if name not in known:
                stage = str(name).split(".", 1)[0]
                raise UsageError(f"--layers: '{name}' is not a layer of stage '{stage}'; its layers are"
                                 f" {', '.join(names[stage])}")
    return set(layers) if layers else {n for v in names.values() for n in v}


# --------------------------------------------------------------------------------------------------------------
# the search


def tune(
    layout: str | None = None,
    dataset: str | os.PathLike | None = None,
    *,
    layout_file: str | os.PathLike | None = None,
    budget: Budget | None = None,
    stages: Sequence[str] | None = None,
    layers: Sequence[str] | None = None,
    anchors: Sequence[str] = (),
    reference: str = "reference",
    limit: int | None = 8,
    max_candidates: int = DEFAULT_MAX_CANDIDATES,
    beam: int = 1,
    model=None,
    store=None,
    registry=None,
    max_new_tokens: int | None = None,
    ray_address: str | None = None,
    progress=None,
    bar: Callable | None = None,
    on_point: Callable[[Point], None] | None = None,
) -> TuneResult:
    """Search the smallest build of ``layout`` within ``budget`` (see the package docstring).

    ``stages``: the stages to tune (default: every stage of the layout whose backend offers per-layer
    precisions at its precision); ``layers``: only these layers (probe names, e.g. ``decoder.layer1``);
    ``anchors``: more layouts to measure and place on the front (``vlmrun eval --layout`` specs, e.g. a uniform
    8-bit build); ``on_point(point)`` sees each point as it is measured or read back; ``bar`` makes the progress
    bars of the evals run in this process (as `vlmrun.eval.evaluate` takes it).
    Raises `vlmrun.errors.UsageError` for a bad budget, stage or layer before anything is compiled.
    """
    t_start = time.perf_counter()
    progress = progress or no_progress
    budget = budget or Budget.of()
    max_new_tokens = max_new_tokens or DEFAULT_MAX_NEW_TOKENS
    if max_candidates < 1:
        raise UsageError("--max-candidates must be at least 1")
    if beam < 1:
        raise UsageError("--beam must be at least 1")
    if limit is not None and limit < 1:
        raise UsageError("--limit must be at least 1")
    if layout and layout_file:
        raise UsageError("give --layout or --layout-file, not both")
    registry = registry or plugins_mod.load()
    base_text = str(layout_file) if layout_file else (layout or default_base(registry))
    base = LayoutSpec.parse(base_text)
    base = attrs.evolve(base, label="base")
    ref_spec = LayoutSpec.parse(reference)
    anchor_specs = [LayoutSpec.parse(a) for a in anchors]
    base_layout = base.resolve(registry)
    ref_layout = ref_spec.resolve(registry)
    for a in anchor_specs:
        a.resolve(registry)

    ladders = tuned_ladders(base_layout, registry, stages, layers, base_text)
    tuned = list(ladders)

    if not isinstance(store, ArtifactStore):
        store = ArtifactStore(store)
    store.clean_stale()
    fvlm = open_model(model, store, None, progress)
    ref_pipe = Pipeline.build(fvlm, ref_layout, store=store, registry=registry, progress=progress)
    allowed = allowed_layers(ref_pipe, tuned, layers)

    if dataset is None:
        dataset = heldout_dataset(store, progress=progress)
    records, _ = read_dataset(dataset, limit=limit)
    if not records:
        raise UsageError(f"data set {dataset} has no usable record")
    settings = GenerationSettings(max_new_tokens=max_new_tokens)
    model_hash = fvlm.weights_hash(store)
    ref_key = layout_key(ref_layout, registry, model_hash, settings)
    for spec, text in [(base, base_text), *zip(anchor_specs, anchors)]:  # compared with itself, it would win
        if layout_key(spec.resolve(registry), registry, model_hash, settings) == ref_key:
            raise UsageError(f"{text} is the reference layout itself: it would be compared with itself (every answer"
                             " the reference's); give a device build, or another --reference")
    climb = Climb(
        base=base, base_layout=base_layout, reference=ref_spec, ref_pipe=ref_pipe, fvlm=fvlm, store=store,
        registry=registry, records=records, dataset=str(dataset), limit=limit, settings=settings,
        model_hash=model_hash, cache=PointCache(store.root),
        executor=executor_for(ray_address, store.root, fvlm), ray_address=ray_address,
        budget=budget, ladders=ladders, allowed=allowed, beam=beam, max_candidates=max_candidates,
        progress=progress, bar=bar, on_point=on_point)
    climb.run([Candidate(a.label if a.label != a.base else f"anchor{i + 1}", anchor=text)
               for i, (a, text) in enumerate(zip(anchor_specs, anchors))])

    points = climb.points
    front = pareto_front(points)
    for p in front:
        p.on_front = True
    within = [p for p in points if p.within_budget]
    winner = fewest_bytes(within) if within else None
    return TuneResult(base_text, budget, points, front, winner, climb.sensitivities, ladders, climb.steps, climb.built,
                      time.perf_counter() - t_start, len(records), str(dataset))
