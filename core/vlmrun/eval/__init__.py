"""``vlmrun eval``: task accuracy and drift of one or more layouts over a data set.

>>> from vlmrun import eval as ev
>>> run = ev.evaluate(["reference", "all-npu", "int8-vision=all-npu,vision.precision=int8"], limit=40)
>>> print(ev.format_table(run.report)); ev.write_html(run.report, "out/")

Every item is run on the reference layout (``reference`` unless told otherwise) and on each layout; the answers
are scored by exact match after normalising case and punctuation (per question kind), and every stage boundary
of each layout is compared with the reference's by `vlmrun.diff.compare` (the decoder teacher-forced on
the reference tokens). The report gives, per layout: accuracy per kind, the distribution over the items of
cosine and SQNR per stage boundary and of teacher-forced top-1 agreement (median, 5th percentile), how many
items pass the diff's thresholds, and the items where the layout departs the most.

A record may be a conversation (``"turns"``): it is asked turn by turn on each layout, with that layout's own
answers in the history, and every turn's answer is scored (``conversations=True``: the generated held-out
conversations); the report then adds the accuracy per turn.

Modules: `.answers` (scoring), `.dataset` (JSONL records, bad records, the generated held-out sets),
`.engine` (per-item runs, the result cache, worker processes, batched stages), `.report`
(aggregation, terminal table, JSON, HTML).
"""

from __future__ import annotations

import os
import time
from typing import Callable, Sequence

import attrs

from ..errors import InputError, UsageError, VlmrunError
from .answers import is_correct, normalize_answer
from .dataset import (HELDOUT_CONVERSATIONS, HELDOUT_ITEMS, Record, Skipped, Turn, heldout_conversations,
                      heldout_dataset, read_dataset)
from .engine import LayoutSpec, ResultCache, Side, WorkerConfig, layout_key
from .report import aggregate, format_table, write_html

__all__ = [
    "HELDOUT_CONVERSATIONS", "HELDOUT_ITEMS", "EvalRun", "LayoutSpec", "Record", "Skipped", "Turn", "aggregate",
    "evaluate", "format_table", "heldout_conversations", "heldout_dataset", "is_correct", "normalize_answer",
    "read_dataset", "write_html",
]

DEFAULT_MAX_NEW_TOKENS = 48  # the longest generated answer is 39 tokens + <|im_end|>


@attrs.define
class EvalRun:
    report: dict
    records: list[Record]
    skipped: list[Skipped]
    results: dict  # layout key -> item key -> result


def _no_bar(total: int, initial: int, desc: str):
    class _Bar:
        def update(self, n=1):
            pass

        def close(self):
            pass

    return _Bar()


def evaluate(
    layouts: Sequence[str | LayoutSpec] = ("reference",),
    dataset: str | os.PathLike | None = None,
    *,
    reference: str | LayoutSpec = "reference",
    model=None,
    store=None,
    registry=None,
    limit: int | None = None,
    workers: int = 1,
    strict: bool = False,
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
    image_size: int | None = None,
    progress=None,
    bar: Callable | None = None,
    on_skip: Callable[[Skipped], None] | None = None,
    on_item: Callable[[Record, dict | None], None] | None = None,
    ray_address: str | None = None,
    conversations: bool = False,
) -> EvalRun:
    """Run ``layouts`` (and the reference) over ``dataset`` (default: the generated held-out set; with
    ``conversations``: the generated held-out conversations) and aggregate.

    ``progress(label)`` wraps long steps (exports, compiles); ``bar(total, initial, desc)`` makes a progress bar
    with ``update()``/``close()``; ``on_skip`` sees each bad record as it is found; ``on_item(record, results)``
    is called after each finished item (``results``: layout key -> result, ``None`` if the item failed).
    ``ray_address``: run the items of the layouts that run on this host as Ray tasks on that cluster (``workers``
    actors, or one per CPU of the cluster; every node must see the store at the same path).
    """
    from .. import plugins as plugins_mod
    from ..model import open_model
    from ..pipeline import GenerationSettings, Pipeline
    from ..progress import no_progress
    from ..store import ArtifactStore
    from . import engine

    progress = progress or no_progress
    bar = bar or _no_bar
    if max_new_tokens < 1:
        raise UsageError("--max-new-tokens must be at least 1")
    if workers < 1:
        raise UsageError("--workers must be at least 1")
    if limit is not None and limit < 1:
        raise UsageError("--limit must be at least 1")
    if conversations and dataset is not None:
        raise UsageError("give a DATASET or --conversations (the generated conversations), not both")
    ref_spec = reference if isinstance(reference, LayoutSpec) else LayoutSpec.parse(reference)
    specs = [s if isinstance(s, LayoutSpec) else LayoutSpec.parse(s) for s in layouts] or [ref_spec]
    registry = registry or plugins_mod.load()
    resolved = [(spec, spec.resolve(registry)) for spec in [ref_spec, *specs]]  # layout errors before any work
    if not isinstance(store, ArtifactStore):
        store = ArtifactStore(store)
    store.clean_stale()

    if dataset is None:
        dataset = (heldout_conversations if conversations else heldout_dataset)(store, progress=progress)
    records, skipped = read_dataset(dataset, strict=strict, limit=limit, on_skip=on_skip)
    if not records:
        raise UsageError(f"data set {dataset} has no usable record ({len(skipped)} skipped)")

    fvlm = open_model(model, store, image_size, progress)
    settings = GenerationSettings(max_new_tokens=max_new_tokens)
    run_id = f"{os.getpid()}-{time.time_ns()}"  # marks the results this run computed
    model_hash = fvlm.weights_hash(store)
    cache = ResultCache(store.root / "eval")

    # one side per distinct layout (a --layout equal to the reference shares its results); a device layout's
    # results are its diff against this reference: keyed by both, never another reference's nor a reference-only one
    sides: list[Side] = []
    labels: dict[str, list[str]] = {}
    ref_key = None
    for i, (spec, layout) in enumerate(resolved):
        key = layout_key(layout, registry, model_hash, settings)
        if i == 0:
            ref_key = key
        elif key != ref_key:
            key = layout_key(layout, registry, model_hash, settings, reference=ref_key)
        labels.setdefault(key, []).append(spec.label)
        if any(s.key == key for s in sides):
            continue
        pipe = Pipeline.build(fvlm, layout, store=store, registry=registry, progress=progress)
        sides.append(Side(spec.label, key, pipe, is_reference=(i == 0)))
        cache.describe_layout(key, {"label": spec.label, "layout": pipe.layout_options(),
                                    "backends": {s: layout.backend(s) for s in layout.stages},
                                    "model": str(fvlm.source), "max_new_tokens": max_new_tokens})
    ref = sides[0]
    layout_labels = {k: v[1] if len(v) > 1 and k == ref.key else v[0] for k, v in labels.items()}

    batched = {s.key: engine.batched_stages(s.pipe.layout, registry) for s in sides}
    host_sides = [s for s in sides if not batched[s.key]]
    hosted_sides = [s for s in sides if batched[s.key]]
    timing: dict[str, dict] = {s.key: {"computed": 0, "seconds": 0.0} for s in sides}

    def pending(side_list):
        return [r for r in records if any(cache.get(s.key, r.key) is None for s in side_list)]

    failures: list[Skipped] = []

    def finished(record, results, error):
        if error is not None:
            skip = Skipped(record.file, record.line, error)
            if strict:
                raise InputError(f"{skip.message} (--strict stops at the first bad record)")
            failures.append(skip)
            if on_skip is not None:
                on_skip(skip)
        if on_item is not None:
            on_item(record, results)

    def phase(side_list, n_workers, on_ray=False):
        if not side_list:
            return
        todo = pending(side_list)
        desc = "eval " + ", ".join(s.label for s in side_list)
        progress_bar = bar(len(records), len(records) - len(todo), desc)
        this_ref = ref if ref in side_list else None
        run_sides = side_list if this_ref else [ref, *side_list]

        def done(record, results, error):
            progress_bar.update(1)
            for s in side_list:
                res = (results or {}).get(s.key)
                if res is not None and res.get("run") == run_id:
                    timing[s.key]["computed"] += 1
                    timing[s.key]["seconds"] += float(res.get("seconds") or 0.0)
            finished(record, results, error)

        try:
            if (n_workers > 1 or (on_ray and ray_address)) and len(todo) > 1:
                config = WorkerConfig(str(fvlm.path), str(store.root),
                                      tuple((s.label, s.key, s.pipe.layout, s.is_reference) for s in run_sides),
                                      settings, str(cache.root), run_id)
                engine.run_items(todo, run_sides, cache, settings, run_id, workers=n_workers, config=config,
                                 ray_address=ray_address if on_ray else None, on_item=done)
            else:
                engine.run_items(todo, run_sides, cache, settings, run_id, on_item=done)
        finally:
            progress_bar.close()

    if ref in host_sides:
        phase(host_sides, workers, on_ray=True)
    else:
        for s in hosted_sides[:1]:  # the reference itself is batched: it goes first, in this process
            engine.precompute(s, pending([s]), batched[s.key], progress)
            phase([s], 1)
        phase([s for s in host_sides], workers, on_ray=True)
    for s in hosted_sides:
        if s is ref:
            continue
        todo = pending([s])
        if todo:
            engine.precompute(s, todo, batched[s.key], progress)
        phase([s], 1)

    results = {s.key: {r.key: cache.get(s.key, r.key) for r in records} for s in sides}
    report = aggregate(
        records=records, skipped=[*skipped, *failures], sides=sides, results=results, labels=layout_labels,
        timing=timing, dataset=str(dataset), model=str(fvlm.source), settings={"max_new_tokens": max_new_tokens},
        workers=workers, batched=batched,
    )
    for lay in report["layouts"]:  # every item failed there: no figure to report, not a report of nothing
        if not lay["items"]:
            why = f" (the first: {failures[0].message})" if failures else ""
            raise VlmrunError(f"layout '{lay['label']}' ran none of the {len(records)} items: each one failed{why};"
                              " nothing was measured")
    return EvalRun(report, records, [*skipped, *failures], results)
