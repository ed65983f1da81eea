"""The search of `tune`: budget, candidates, sensitivity, the greedy climb, the cache of measured points."""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

import attrs

from ..errors import UsageError
from ..stages import STAGES

#: the default base: the all-npu preset, each stage at its cheapest quantized precision
DEFAULT_BASE = "all-npu,vision.precision=int8,projector.precision=int8,decoder.precision=w4a16"
TUNABLE = ("vision", "projector", "decoder")  # stages with layers (embed is a table lookup)
LAYER_OPTION = "layer_precision"
DEFAULT_MAX_CANDIDATES = 12
CACHE_VERSION = 1


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
    checked. `of` gives the default, every answer as the reference's, when no limit is set."""

    max_accuracy_drop: float | None = None
    min_answers_as_reference: float | None = None
    min_logits_sqnr: float | None = None

    @classmethod
    def of(cls, max_accuracy_drop=None, min_answers_as_reference=None, min_logits_sqnr=None) -> "Budget":
        """A checked budget (UsageError for values that cannot be one)."""
        drop = _fraction("--max-accuracy-drop", max_accuracy_drop)
        answers = _fraction("--min-answers-as-reference", min_answers_as_reference)
        sqnr = None
        if min_logits_sqnr is not None:
            try:
                sqnr = float(min_logits_sqnr)
            except (TypeError, ValueError):
                raise UsageError(f"--min-logits-sqnr {min_logits_sqnr!r} is not a number of dB") from None
            if not math.isfinite(sqnr) or not -100 <= sqnr <= 200:
                raise UsageError(f"--min-logits-sqnr {min_logits_sqnr!r} dB is not a usable SQNR (-100..200)")
        if drop is None and answers is None and sqnr is None:
            answers = 1.0
        return cls(drop, answers, sqnr)

    def misses(self, point: "Point") -> list[str]:
        """What ``point`` misses, one phrase each (empty: within the budget)."""
        out = []
        if self.max_accuracy_drop is not None and (point.accuracy_drop is None
                                                   or point.accuracy_drop > self.max_accuracy_drop + 1e-9):
            out.append(f"accuracy drop {_pct(point.accuracy_drop)} > {_pct(self.max_accuracy_drop)}")
        if self.min_answers_as_reference is not None and (
                point.answers_as_reference is None
                or point.answers_as_reference < self.min_answers_as_reference - 1e-9):
            out.append(f"answers as reference {_pct(point.answers_as_reference)} <"
                       f" {_pct(self.min_answers_as_reference)}")
        if self.min_logits_sqnr is not None and (point.logits_sqnr_db is None
                                                 or point.logits_sqnr_db < self.min_logits_sqnr):
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
# candidates and points


@attrs.frozen
class Candidate:
    """A build to measure: the base layout with ``layers`` raised (``(layer, precision)`` pairs, sorted), or an
    anchor layout given whole (``anchor``: a ``vlmrun eval --layout`` spec)."""

    label: str
    layers: tuple = ()
    anchor: str | None = None

    def raised(self, layer: str, precision: str, label: str) -> "Candidate":
        d = dict(self.layers)
        d[layer] = precision
        return Candidate(label, tuple(sorted(d.items())))


@attrs.define
class Point:
    """One measured build."""

    label: str
    layers: dict  # layer -> precision raised above the base
    layout: dict  # stage -> {"backend", options...}: the build as a layout
    bytes: int
    accuracy: float | None
    reference_accuracy: float | None
    answers_as_reference: float | None
    logits_sqnr_db: float | None
    diff_pass_rate: float | None
    items: int
    key: str  # the eval layout key (what its results are cached under)
    seconds: float = 0.0
    anchor: str | None = None
    built: bool = False  # measured by this run (not read back from the store)
    within_budget: bool = False
    misses: list = attrs.field(factory=list)
    on_front: bool = False

    @property
    def accuracy_drop(self) -> float | None:
        if self.accuracy is None or self.reference_accuracy is None:
            return None
        return max(0.0, self.reference_accuracy - self.accuracy)

    def to_json(self) -> dict:
        out = attrs.asdict(self)
        out["accuracy_drop"] = self.accuracy_drop
        return out

    @classmethod
    def from_json(cls, d: Mapping) -> "Point":
        names = {f.name for f in attrs.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


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
# layouts of candidates


def candidate_spec(base, candidate: Candidate):
    """The `vlmrun.eval.LayoutSpec` of ``candidate`` on the ``base`` spec: its layers merged into each
    stage's ``layer_precision`` option."""
    from ..eval import LayoutSpec

    if candidate.anchor is not None:
        spec = LayoutSpec.parse(candidate.anchor)
        return attrs.evolve(spec, label=candidate.label)
    options = {s: dict(v) for s, v in base.options.items()}
    by_stage: dict[str, dict[str, str]] = {}
    for layer, precision in candidate.layers:
        by_stage.setdefault(layer.split(".", 1)[0], {})[layer] = precision
    for stage, layers in by_stage.items():
        current = options.setdefault(stage, {})
        merged = _parse_map(current.get(LAYER_OPTION))
        merged.update(layers)
        current[LAYER_OPTION] = ";".join(f"{k}={v}" for k, v in sorted(merged.items()))
    return attrs.evolve(base, label=candidate.label, options=options)


def _parse_map(value) -> dict[str, str]:
    if not value:
        return {}
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    out = {}
    for part in str(value).replace(";", ",").split(","):
        name, sep, p = part.partition("=")
        if sep:
            out[name.strip()] = p.strip()
    return out


# --------------------------------------------------------------------------------------------------------------
# measuring one candidate (in this process or in a Ray task)


@attrs.frozen
class MeasureJob:
    """Everything a process needs to build and measure one candidate (picklable: Ray ships it to a worker)."""

    label: str
    layers: tuple
    anchor: str | None
    spec: object  # LayoutSpec
    reference: object  # LayoutSpec
    model: str
    store: str
    dataset: str | None
    limit: int | None
    max_new_tokens: int


def measure(job: MeasureJob, bar: Callable | None = None) -> dict:
    """Build the candidate, run `vlmrun.eval.evaluate` on it, return its figures (a `Point`'s JSON).
    ``bar``: eval's progress bar factory (in this process; a Ray task shows none)."""
    from ..eval import evaluate

    t0 = time.perf_counter()
    run = evaluate([job.spec], job.dataset, reference=job.reference, model=job.model, store=job.store,
                   limit=job.limit, max_new_tokens=job.max_new_tokens, bar=bar)
    ref = run.report["layouts"][0]
    dev = next((e for e in run.report["layouts"] if not e["is_reference"]), ref)
    logits = ((dev.get("drift") or {}).get("decoder/logits") or {}).get("sqnr_db") or {}
    return Point(
        label=job.label, layers=dict(job.layers), anchor=job.anchor,
        layout={s: {"backend": dev["layout"][s], **{k: v for k, v in dev["options"].get(s, {}).items()}}
                for s in STAGES},
        bytes=int(dev.get("device_bytes") or 0),
        accuracy=dev["accuracy"]["all"]["accuracy"], reference_accuracy=ref["accuracy"]["all"]["accuracy"],
        answers_as_reference=dev.get("same_answer_as_reference", 1.0 if dev is ref else None),
        logits_sqnr_db=logits.get("median"), diff_pass_rate=dev.get("diff_pass_rate"), items=int(dev["items"]),
        key=dev["key"], seconds=round(time.perf_counter() - t0, 2), built=True,
    ).to_json()


class PointCache:
    """Measured points in the store (``tune/<key>.json``): what makes an interrupted tune resume."""

    def __init__(self, root: Path):
        self.root = Path(root) / "tune"

    def key(self, eval_key: str, dataset: str, limit: int | None) -> str:
        text = json.dumps({"v": CACHE_VERSION, "eval": eval_key, "dataset": dataset, "limit": limit})
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    def get(self, key: str) -> dict | None:
        path = self.root / f"{key}.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def put(self, key: str, value: dict) -> None:
        from ..atomic import write_text_atomic

        self.root.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.root / f"{key}.json", json.dumps(value, indent=1, sort_keys=True))


# --------------------------------------------------------------------------------------------------------------
# sensitivity


def layer_names(ref_pipe, stage: str) -> list[str]:
    """The layers of ``stage`` as the probes name them (the reference's probe export: ``decoder.layer0``...)."""
    from ..diff.locate import load_probe

    handle = load_probe(ref_pipe, stage)
    arts = list(getattr(handle, "artifacts", ()) or ())
    manifest = dict(getattr(handle, "manifest", None) or (arts[0].manifest if arts else {}))
    return [name for name, _ in manifest.get("probe_outputs") or ()]


def sensitivity(ref_pipe, dev_pipe, stages: Sequence[str], record, max_new_tokens: int, progress) -> dict:
    """Per stage, ``[[layer, noise]]`` most sensitive first: ``noise`` is the relative noise power the layer's own
    error alone leaves at the stage output (``--locate``'s isolated impact; without injections, the noise power
    the layer adds). Layers the device probe did not report (inside parts not probed) get 0."""
    from ..diff.capture import capture_pipeline
    from ..diff.locate import locate
    from ..pipeline import GenerationSettings

    cap = capture_pipeline(ref_pipe, record.image, record.question, GenerationSettings(max_new_tokens=max_new_tokens),
                           image_desc=str(record.image))
    out = {}
    for stage in stages:
        loc = locate(ref_pipe, dev_pipe, stage, cap, {}, progress)
        scores = {}
        for p in loc.points:
            if loc.isolated and p.own is not None:
                sqnr = (p.impact or p.own).get("sqnr_db")
                scores[p.name] = 0.0 if sqnr is None else 10 ** (-float(sqnr) / 10)
            else:
                scores[p.name] = float(p.noise_added)
        out[stage] = sorted(([k, v] for k, v in scores.items()), key=lambda kv: -kv[1])
    return out


# --------------------------------------------------------------------------------------------------------------
# the search


def _gain(prev: Point, new: Point) -> float:
    """How much ``new`` improves on ``prev`` per byte (answers first, then logits SQNR)."""
    d_answers = (new.answers_as_reference or 0.0) - (prev.answers_as_reference or 0.0)
    d_sqnr = (new.logits_sqnr_db or 0.0) - (prev.logits_sqnr_db or 0.0)
    return (10.0 * d_answers + d_sqnr) / (max(0, new.bytes - prev.bytes) + 4096)


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
    ``anchors``: more layouts to measure and place on the front (``vlmrun eval --layout`` specs, e.g. the uniform
    w8a16 build); ``on_point(point)`` sees each point as it is measured or read back; ``bar`` makes the progress
    bars of the evals run in this process (as `vlmrun.eval.evaluate` takes it).
    Raises `vlmrun.errors.UsageError` for a bad budget, stage or layer before anything is compiled.
    """
    from .. import plugins as plugins_mod
    from ..eval import DEFAULT_MAX_NEW_TOKENS, LayoutSpec, heldout_dataset, read_dataset
    from ..eval.engine import layout_key
    from ..model import open_model
    from ..pipeline import GenerationSettings, Pipeline
    from ..progress import no_progress
    from ..store import ArtifactStore
    from .executors import executor_for

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
    base_text = str(layout_file) if layout_file else (layout or DEFAULT_BASE)
    base = LayoutSpec.parse(base_text)
    base = attrs.evolve(base, label="base")
    ref_spec = LayoutSpec.parse(reference)
    anchor_specs = [LayoutSpec.parse(a) for a in anchors]
    registry = registry or plugins_mod.load()
    base_layout = base.resolve(registry)
    ref_layout = ref_spec.resolve(registry)
    for a in anchor_specs:
        a.resolve(registry)

    # what can be tuned: stages whose backend offers per-layer precisions above the stage's own
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
            raise UsageError(f"stage '{stage}' ({a.backend}, precision {precision}) has no quantized precision to"
                             f" tune: give it one in the layout (e.g. {stage}.precision="
                             f"{'w4a16' if stage == 'decoder' else 'int8'}) or leave it out of --stages")
    tuned = asked or list(ladders)
    if not tuned:
        raise UsageError(f"layout '{base_text}' has no stage with a quantized precision to tune; e.g. --layout"
                         f" '{DEFAULT_BASE}'")
    if layers:
        for name in layers:
            stage = str(name).split(".", 1)[0]
            if stage not in tuned:
                raise UsageError(f"--layers {name}: its stage '{stage}' is not tuned (tuned: {', '.join(tuned)})")
    ladders = {s: ladders[s] for s in tuned}

    if not isinstance(store, ArtifactStore):
        store = ArtifactStore(store)
    store.clean_stale()
    fvlm = open_model(model, store, None, progress)
    ref_pipe = Pipeline.build(fvlm, ref_layout, store=store, registry=registry, progress=progress)
    names = {s: layer_names(ref_pipe, s) for s in tuned}
    if layers:
        known = {n for v in names.values() for n in v}
        for name in layers:
            if name not in known:
                stage = str(name).split(".", 1)[0]
                raise UsageError(f"--layers: '{name}' is not a layer of stage '{stage}'; its layers are"
                                 f" {', '.join(names[stage])}")
    allowed = set(layers) if layers else {n for v in names.values() for n in v}

    if dataset is None:
        dataset = heldout_dataset(store, progress=progress)
    records, _ = read_dataset(dataset, limit=limit)
    if not records:
        raise UsageError(f"data set {dataset} has no usable record")
    settings = GenerationSettings(max_new_tokens=max_new_tokens)
    model_hash = fvlm.weights_hash(store)
    cache = PointCache(store.root)
    executor = executor_for(ray_address, store.root, fvlm)

    points: list[Point] = []
    built = 0

    def cache_key(spec) -> str:
        return cache.key(layout_key(spec.resolve(registry), registry, model_hash, settings), str(dataset), limit)

    def run(cands: Sequence[Candidate]) -> list[Point]:
        nonlocal built
        out: dict[int, Point] = {}
        jobs, where = [], []
        for i, c in enumerate(cands):
            spec = candidate_spec(base, c)
            key = cache_key(spec)
            hit = cache.get(key)
            if hit is not None:
                p = Point.from_json(hit)
                p.label, p.layers, p.anchor, p.built = c.label, dict(c.layers), c.anchor, False
                out[i] = p
            else:
                jobs.append(MeasureJob(c.label, c.layers, c.anchor, spec, ref_spec, str(fvlm.path), str(store.root),
                                       str(dataset), limit, max_new_tokens))
                where.append((i, key))
        if jobs:
            what = ", ".join(j.label for j in jobs)
            with progress(f"building and evaluating {len(jobs)} candidate(s) on {len(records)} items ({what})"
                          f"{' on Ray' if ray_address else ''}"):
                measured = executor.map(measure if ray_address else functools.partial(measure, bar=bar), jobs)
            for (i, key), m in zip(where, measured):
                cache.put(key, {**m, "built": False})
                out[i] = Point.from_json(m)
                built += 1
        result = [out[i] for i in range(len(cands))]
        for p in result:
            p.misses = budget.misses(p)
            p.within_budget = not p.misses
            points.append(p)
            if on_point is not None:
                on_point(p)
        return result

    # step 0: the base and the anchors
    start = Candidate("base")
    first = run([start, *[Candidate(a.label if a.label != a.base else f"anchor{i + 1}", anchor=text)
                          for i, (a, text) in enumerate(zip(anchor_specs, anchors))]])
    current, current_point = start, first[0]
    steps = [{"step": 0, "measured": [p.label for p in first], "took": "base"}]

    def ranking() -> list[str]:
        """The tuned layers, most sensitive first (the base build's own error per layer, cached with its point)."""
        sens_key = "sens-" + cache.key(current_point.key, str(dataset), 1)
        sens = cache.get(sens_key)
        if sens is None or set(sens) != set(tuned):
            with progress(f"ranking the layers of {', '.join(tuned)} by their own error on the device (--locate)"):
                dev_pipe = Pipeline.build(fvlm, base_layout, store=store, registry=registry, progress=progress)
                sens = sensitivity(ref_pipe, dev_pipe, tuned, records[0], max_new_tokens, progress)
            cache.put(sens_key, sens)
        sensitivities.update(sens)
        # across stages the noise at different outputs is not comparable: the stage nearest the logits first (its
        # error reaches them directly; the decoder attenuates what vision hands it), each stage's layers by their
        # own error
        out = []
        for stage in sorted(tuned, key=lambda st: -TUNABLE.index(st)):
            score = dict((k, v) for k, v in sens[stage])
            names = [n for n in allowed if n.split(".", 1)[0] == stage]
            out += sorted((n for n in names if n in score), key=lambda n: (-score[n], n))
            out += sorted(n for n in names if n not in score)  # not reported by the device probe: last
        return out

    # the climb: raise the most sensitive layers a rung at a time; a raise that does not help is not taken (the
    # layer's next rung is tried later instead)
    sensitivities: dict = {}
    ranked: list[str] = []
    tried: dict[str, int] = {}  # layer -> highest rung index tried from the current build and not taken
    n = len(points)
    while not current_point.within_budget and n < max_candidates:
        ranked = ranked or ranking()
        rungs = dict(current.layers)
        options = []
        for layer in ranked:
            ladder = ladders[layer.split(".", 1)[0]]
            now = ladder.index(rungs[layer]) if layer in rungs else -1
            nxt = max(now, tried.get(layer, -1)) + 1
            if nxt < len(ladder):
                options.append((layer, ladder[nxt]))
            if len(options) == min(beam, max_candidates - n):
                break
        if not options:
            break
        cands = [current.raised(layer, p, f"c{n + k}") for k, (layer, p) in enumerate(options)]
        got = run(cands)
        n += len(got)
        within = [p for p in got if p.within_budget]
        if within:
            best = min(within, key=lambda p: (p.bytes, -(p.logits_sqnr_db or -1e9)))
        else:
            best = max(got, key=lambda p: _gain(current_point, p))
        step = {"step": len(steps), "measured": [p.label for p in got]}
        if within or _gain(current_point, best) > 0:
            current, current_point = cands[got.index(best)], best
            tried = {k: v for k, v in tried.items() if k not in dict(current.layers)}
            step.update(took=best.label, raised=dict(current.layers))
        else:
            for layer, p in options:
                tried[layer] = ladders[layer.split(".", 1)[0]].index(p)
            step.update(took=None, why="no candidate improved on " + current_point.label)
        steps.append(step)

    from .front import pareto_front

    front = pareto_front(points)
    for p in front:
        p.on_front = True
    within = [p for p in points if p.within_budget]
    winner = min(within, key=lambda p: (p.bytes, -(p.logits_sqnr_db or -1e9))) if within else None
    return TuneResult(base_text, budget, points, front, winner, sensitivities, ladders, steps, built,
                      time.perf_counter() - t_start, len(records), str(dataset))
