"""The greedy climb of `tune`: candidates and the points they measure to, measuring them (in this process or as Ray
tasks, through the point cache in the store), ranking the layers by sensitivity, and `Climb`, which raises the most
sensitive layers a rung at a time from the base build."""

from __future__ import annotations

import functools
import hashlib
import json
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

import attrs

from ..atomic import write_text_atomic
from ..diff.capture import capture_pipeline
from ..diff.locate import locate
from ..errors import UsageError
from ..eval import LayoutSpec, evaluate
from ..eval.engine import layout_key
from ..pipeline import GenerationSettings, Pipeline
from ..stages import LAYER_PRECISION, STAGES, layer_precision_text, parse_layer_precision

TUNABLE = ("vision", "projector", "decoder")  # stages with layers (embed is a table lookup)
LAYER_OPTION = LAYER_PRECISION
CACHE_VERSION = 2  # 2: keyed by the items' content and the reference, not the data set's path and --limit


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
        drop = self.reference_accuracy - self.accuracy
        return drop if not drop < 0.0 else 0.0  # NaN stays NaN (max(0, nan) is 0: a NaN accuracy met any limit)

    def to_json(self) -> dict:
        out = attrs.asdict(self)
        out["accuracy_drop"] = self.accuracy_drop
        return out

    @classmethod
    def from_json(cls, d: Mapping) -> "Point":
        names = {f.name for f in attrs.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def fewest_bytes(points: Sequence[Point]) -> Point:
    """The point of ``points`` with the fewest bytes (of those, the highest logits SQNR)."""
    return min(points, key=lambda p: (p.bytes, -(p.logits_sqnr_db or -1e9)))


def _gain(prev: Point, new: Point) -> float:
    """How much ``new`` improves on ``prev`` per byte (answers first, then logits SQNR)."""
    d_answers = (new.answers_as_reference or 0.0) - (prev.answers_as_reference or 0.0)
    d_sqnr = (new.logits_sqnr_db or 0.0) - (prev.logits_sqnr_db or 0.0)
    return (10.0 * d_answers + d_sqnr) / (max(0, new.bytes - prev.bytes) + 4096)


# --------------------------------------------------------------------------------------------------------------
# layouts of candidates


def candidate_spec(base, candidate: Candidate):
    """The `vlmrun.eval.LayoutSpec` of ``candidate`` on the ``base`` spec: its layers merged into each
    stage's ``layer_precision`` option."""
    if candidate.anchor is not None:
        spec = LayoutSpec.parse(candidate.anchor)
        return attrs.evolve(spec, label=candidate.label)
    options = {s: dict(v) for s, v in base.options.items()}
    by_stage: dict[str, dict[str, str]] = {}
    for layer, precision in candidate.layers:
        by_stage.setdefault(layer.split(".", 1)[0], {})[layer] = precision
    for stage, layers in by_stage.items():
        current = options.setdefault(stage, {})
        merged = parse_layer_precision(current.get(LAYER_OPTION))
        merged.update(layers)
        current[LAYER_OPTION] = layer_precision_text(merged)
    return attrs.evolve(base, label=candidate.label, options=options)


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
    t0 = time.perf_counter()
    run = evaluate([job.spec], job.dataset, reference=job.reference, model=job.model, store=job.store,
                   limit=job.limit, max_new_tokens=job.max_new_tokens, bar=bar)
    ref = run.report["layouts"][0]
    dev = next((e for e in run.report["layouts"] if not e["is_reference"]), None)
    if dev is None:  # the build is the reference layout itself: its figures would be the reference's own
        raise UsageError(f"{job.label} ({job.spec}) is the reference layout itself: nothing to compare it with")
    logits = ((dev.get("drift") or {}).get("decoder/logits") or {}).get("sqnr_db") or {}
    return Point(
        label=job.label, layers=dict(job.layers), anchor=job.anchor,
        layout={s: {"backend": dev["layout"][s], **{k: v for k, v in dev["options"].get(s, {}).items()}}
                for s in STAGES},
        bytes=int(dev.get("device_bytes") or 0),
        accuracy=dev["accuracy"]["all"]["accuracy"], reference_accuracy=ref["accuracy"]["all"]["accuracy"],
        answers_as_reference=dev.get("same_answer_as_reference"),
        logits_sqnr_db=logits.get("median"), diff_pass_rate=dev.get("diff_pass_rate"), items=int(dev["items"]),
        key=dev["key"], seconds=round(time.perf_counter() - t0, 2), built=True,
    ).to_json()


class PointCache:
    """Measured points in the store (``tune/<key>.json``): what makes an interrupted tune resume."""

    def __init__(self, root: Path):
        self.root = Path(root) / "tune"

    def key(self, eval_key: str, inputs: str) -> str:
        """A point's key: its build's eval layout key and ``inputs`` (`Climb.inputs_key`: the items measured and
        the reference), never a data set's path, whose content may change."""
        text = json.dumps({"v": CACHE_VERSION, "eval": eval_key, "inputs": inputs})
        return hashlib.sha256(text.encode()).hexdigest()[:20]

    def get(self, key: str) -> dict | None:
        path = self.root / f"{key}.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def put(self, key: str, value: dict) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.root / f"{key}.json", json.dumps(value, indent=1, sort_keys=True))


# --------------------------------------------------------------------------------------------------------------
# sensitivity


def sensitivity(ref_pipe, dev_pipe, stages: Sequence[str], record, max_new_tokens: int, progress) -> dict:
    """Per stage, ``[[layer, noise]]`` most sensitive first: ``noise`` is the relative noise power the layer's own
    error alone leaves at the stage output (``--locate``'s isolated impact; without injections, the noise power
    the layer adds). Layers the device probe did not report (inside parts not probed) get 0."""
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
# the climb


@attrs.define(kw_only=True)
class Climb:
    """The search of `tune` from the base build: `start` measures the base and the anchors, then each `step`
    raises the most sensitive layers a rung at a time (`next_raises`: one candidate per layer, up to ``beam``) and
    takes the best candidate; a raise that does not help is not taken (the layer's next rung is tried later
    instead). `run` does both until a build is within the budget, ``max_candidates`` points are measured, or no
    layer has a rung left.

    Every point is read back from the store or built and evaluated (`points_of`), then judged by ``budget`` and
    kept in `points`; `steps`, `sensitivities` and `built` are what `tune` reports besides."""

    # what is built and how it is measured
    base: LayoutSpec  # the base layout, labelled "base"
    base_layout: object  # the base resolved (a `vlmrun.layouts.Layout`): the device build the layers are ranked on
    reference: LayoutSpec
    ref_pipe: Pipeline  # the reference built (its probes name the layers)
    fvlm: object  # the `vlmrun.model.FastVLMModel`
    store: object  # the `vlmrun.store.ArtifactStore`
    registry: object
    records: list  # the data set's items (the sensitivity is measured on the first)
    dataset: str
    limit: int | None
    settings: GenerationSettings  # the generation settings (part of each eval layout key)
    model_hash: str
    cache: PointCache
    executor: object  # `.executors`: where candidates are built and measured
    ray_address: str | None
    # what is searched
    budget: object  # the `Budget` each point is judged by
    ladders: dict  # tuned stage -> the precisions above its own, in the order the stages are tuned
    allowed: set  # the layers that may be raised
    beam: int
    max_candidates: int
    # who sees it
    progress: Callable
    bar: Callable | None = None
    on_point: Callable[[Point], None] | None = None

    # the state of the search
    points: list = attrs.field(init=False, factory=list)  # every point measured or read back, in order
    built: int = attrs.field(init=False, default=0)  # candidates compiled and evaluated by this run
    steps: list = attrs.field(init=False, factory=list)  # per step: the candidates measured and the one taken
    sensitivities: dict = attrs.field(init=False, factory=dict)  # stage -> [[layer, noise]], most sensitive first
    current: Candidate | None = attrs.field(init=False, default=None)  # the build the next step raises from
    current_point: Point | None = attrs.field(init=False, default=None)
    ranked: list = attrs.field(init=False, factory=list)  # the allowed layers, most sensitive first
    tried: dict = attrs.field(init=False, factory=dict)  # layer -> highest rung index tried from `current`, not taken

    @property
    def tuned(self) -> list[str]:
        return list(self.ladders)

    def run(self, anchors: Sequence[Candidate] = ()) -> None:
        """Measure the base and ``anchors``, then step until a build is within the budget, ``max_candidates``
        points are measured, or no layer has a rung left."""
        self.start(anchors)
        while not self.current_point.within_budget and len(self.points) < self.max_candidates:
            if not self.step():
                break

    def start(self, anchors: Sequence[Candidate]) -> None:
        """Step 0: measure the base and ``anchors``; the base is the current build."""
        base = Candidate("base")
        first = self.points_of([base, *anchors])
        self.current, self.current_point = base, first[0]
        self.steps.append({"step": 0, "measured": [p.label for p in first], "took": "base"})

    def step(self) -> bool:
        """Measure the raises `next_raises` offers and take the best candidate: the smallest within the budget,
        else the best `_gain` if it is positive; otherwise mark those rungs tried. False when nothing is left to
        raise."""
        self.ranked = self.ranked or self.rank_layers()
        raises = self.next_raises()
        if not raises:
            return False
        n = len(self.points)
        cands = [self.current.raised(layer, p, f"c{n + k}") for k, (layer, p) in enumerate(raises)]
        got = self.points_of(cands)
        within = [p for p in got if p.within_budget]
        if within:
            best = fewest_bytes(within)
        else:
            best = max(got, key=lambda p: _gain(self.current_point, p))
        step = {"step": len(self.steps), "measured": [p.label for p in got]}
        if within or _gain(self.current_point, best) > 0:
            self.current, self.current_point = cands[got.index(best)], best
            self.tried = {k: v for k, v in self.tried.items() if k not in dict(self.current.layers)}
            step.update(took=best.label, raised=dict(self.current.layers))
        else:
            for layer, p in raises:
                self.tried[layer] = self.ladder_of(layer).index(p)
            step.update(took=None, why="no candidate improved on " + self.current_point.label)
        self.steps.append(step)
        return True

    def next_raises(self) -> list[tuple[str, str]]:
        """``(layer, precision)``: the next untried rung above the current build of each ranked layer that has
        one, most sensitive first, as many as ``beam`` (and the candidates left) allow."""
        rungs = dict(self.current.layers)
        n = len(self.points)
        raises = []
        for layer in self.ranked:
            ladder = self.ladder_of(layer)
            now = ladder.index(rungs[layer]) if layer in rungs else -1
            nxt = max(now, self.tried.get(layer, -1)) + 1
            if nxt < len(ladder):
                raises.append((layer, ladder[nxt]))
            if len(raises) == min(self.beam, self.max_candidates - n):
                break
        return raises

    def ladder_of(self, layer: str) -> list[str]:
        """The precisions ``layer`` can be raised to, lowest first (its stage's ladder)."""
        return self.ladders[layer.split(".", 1)[0]]

    def rank_layers(self) -> list[str]:
        """The allowed layers, most sensitive first. Across stages the noise at different outputs is not
        comparable: the stage nearest the logits first (its error reaches them directly; the decoder attenuates
        what vision hands it), each stage's layers by their own error; layers the device probe did not report
        last."""
        sens = self.layer_sensitivity()
        self.sensitivities.update(sens)
        out = []
        for stage in sorted(self.tuned, key=lambda st: -TUNABLE.index(st)):
            score = dict((k, v) for k, v in sens[stage])
            names = [n for n in self.allowed if n.split(".", 1)[0] == stage]
            out += sorted((n for n in names if n in score), key=lambda n: (-score[n], n))
            out += sorted(n for n in names if n not in score)
        return out

    def layer_sensitivity(self) -> dict:
        """`sensitivity` of the tuned stages on the current build (the base: layers are ranked before the first
        raise), measured on the device and cached with the build's point."""
        tuned = self.tuned
        sens_key = "sens-" + self.cache.key(self.current_point.key, self.inputs_key(self.records[:1]))
        sens = self.cache.get(sens_key)
        if sens is None or set(sens) != set(tuned):
            with self.progress(f"ranking the layers of {', '.join(tuned)} by their own error on the device (--locate)"):
                dev_pipe = Pipeline.build(self.fvlm, self.base_layout, store=self.store, registry=self.registry,
                                          progress=self.progress)
                sens = sensitivity(self.ref_pipe, dev_pipe, tuned, self.records[0], self.settings.max_new_tokens,
                                   self.progress)
            self.cache.put(sens_key, sens)
        return sens

    def points_of(self, candidates: Sequence[Candidate]) -> list[Point]:
        """The points of ``candidates``, in their order: read back from the store, or built and evaluated (all
        together, `build_and_measure`) and stored; each judged by the budget, kept in `points` and shown to
        ``on_point``."""
        found: dict[int, Point] = {}
        jobs, where = [], []
        for i, c in enumerate(candidates):
            spec = candidate_spec(self.base, c)
            key = self.cache_key(spec)
            hit = self.cache.get(key)
            if hit is not None:
                p = Point.from_json(hit)
                p.label, p.layers, p.anchor, p.built = c.label, dict(c.layers), c.anchor, False
                found[i] = p
            else:
                jobs.append(MeasureJob(c.label, c.layers, c.anchor, spec, self.reference, str(self.fvlm.path),
                                       str(self.store.root), self.dataset, self.limit, self.settings.max_new_tokens))
                where.append((i, key))
        if jobs:
            for (i, key), m in zip(where, self.build_and_measure(jobs)):
                self.cache.put(key, {**m, "built": False})
                found[i] = Point.from_json(m)
                self.built += 1
        result = [found[i] for i in range(len(candidates))]
        for p in result:
            self.judge(p)
        return result

    def cache_key(self, spec) -> str:
        """What the point of the build ``spec`` is stored under: its eval layout key, the data set, the items."""
        layout = spec.resolve(self.registry)
        return self.cache.key(layout_key(layout, self.registry, self.model_hash, self.settings),
                              self.inputs_key(self.records))

    def inputs_key(self, records: Sequence) -> str:
        """What a point's figures depend on besides its build: the items measured (each one's inputs and expected
        answer) and the reference layout they are compared with (its eval layout key)."""
        ref = layout_key(self.reference.resolve(self.registry), self.registry, self.model_hash, self.settings)
        items = [[r.key, r.answer, r.kind] for r in records]
        return hashlib.sha256(json.dumps({"reference": ref, "items": items}).encode()).hexdigest()

    def build_and_measure(self, jobs: Sequence[MeasureJob]) -> list[dict]:
        """Build and `measure` ``jobs`` (on Ray with a ``ray_address``), in their order."""
        what = ", ".join(j.label for j in jobs)
        with self.progress(f"building and evaluating {len(jobs)} candidate(s) on {len(self.records)} items ({what})"
                           f"{' on Ray' if self.ray_address else ''}"):
            return self.executor.map(measure if self.ray_address else functools.partial(measure, bar=self.bar), jobs)

    def judge(self, point: Point) -> None:
        """Check ``point`` against the budget, keep it, show it to ``on_point``."""
        point.misses = self.budget.misses(point)
        point.within_budget = not point.misses
        self.points.append(point)
        if self.on_point is not None:
            self.on_point(point)
