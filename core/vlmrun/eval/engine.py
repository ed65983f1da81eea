"""Running layouts over a data set: per-item results cached in the store, worker processes, batched stages.

For each item the reference layout is captured first (every stage-boundary tensor, as ``vlmrun diff`` does),
then each other layout, teacher-forced on the reference tokens, and compared with `vlmrun.diff.compare`.
What is kept per (layout, item) is small: the answer text and tokens and the metrics of every checkpoint
(``<store>/eval/<layout key>/<item key>.json``); the reference also keeps its capture
(``<item key>.npz``) so a layout added later, or an interrupted run, never recomputes it. All results of an item
are written once every layout has finished it, so a failed item leaves nothing behind and an interrupted run
resumes at the first unfinished item.

A conversation (a record with two or more turns) runs as one on every layout (`Pipeline.chat`): each turn's
question is asked with that layout's own earlier answers in the history, as a user of a chat would ask it. What is
kept per turn is its answer and tokens (``turns``); the answers are scored in the report, per turn. Conversations
are not diffed against the reference (a layout's history is its own, so later turns are not the same request).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

import attrs
import numpy as np

from ..cpu import one_thread_per_worker
from ..errors import InputError, UsageError, VlmrunError
from ..stages import CONTRACTS, STAGES, check_tensor
from .. import layouts
from .dataset import Record, Skipped

CACHE_VERSION = 4  # 2: the runtime boundary (runtime/runtime_logits) and the generation's divergence check; 3: a
#                   bundle's key holds its files as they are on disk (`bundle_key`); 4: a device layout's results
#                   hold the reference they were measured against, and the diff's rule for missing rows and stops
BATCH_STAGES = ("vision", "projector", "embed")


# --------------------------------------------------------------------------------------------------------------
# layout specs


@attrs.frozen
class LayoutSpec:
    """One layout to evaluate: ``[LABEL=]BASE[,STAGE=BACKEND][,STAGE.KEY=VALUE]...``; BASE is a preset or a
    TOML layout file."""

    label: str
    base: str | None = None
    file: str | None = None
    overrides: Mapping[str, str] = attrs.field(factory=dict)
    options: Mapping[str, Mapping[str, str]] = attrs.field(factory=dict)

    @classmethod
    def parse(cls, spec: str) -> "LayoutSpec":
        text = spec.strip()
        if not text:
            raise UsageError("an empty --layout; give a preset (reference, all-npu, ...) or a TOML file")
        if text.startswith(layouts.BUNDLE_PREFIX):  # [LABEL=]bundle:DIR: the bundle as written, no overrides
            return cls(text, text)
        label, sep, base = text.partition("=")
        if sep and base.strip().startswith(layouts.BUNDLE_PREFIX):
            return cls(label.strip(), base.strip())
        label, sep, rest = text.partition("=")
        if not sep or "," in label:  # no label (that "=" is an override's): the spec is its own label
            label, rest = text, text
        label, rest = label.strip(), rest.strip()
        if not label or not rest:
            raise UsageError(f"--layout '{spec}': expected [LABEL=]BASE[,STAGE=BACKEND][,STAGE.KEY=VALUE]...")
        try:
            base, overrides, options = layouts.parse_spec(rest)
        except UsageError as exc:
            raise UsageError(str(exc).replace(f"layout '{rest}'", f"--layout '{spec}'", 1)) from None
        is_file = layouts.is_layout_file(base)
        if is_file and not Path(base).is_file():
            raise UsageError(f"--layout '{spec}': layout file {base} does not exist")
        return cls(label, None if is_file else base, base if is_file else None, overrides, options)

    def resolve(self, registry):
        """The validated `vlmrun.layouts.Layout`."""
        from .. import layouts

        layout = layouts.resolve(self.base, self.file, self.overrides, self.options, registry.presets)
        return layouts.validate(layout, registry)


def bundle_key(folder: Path) -> dict:
    """What a bundle's results depend on: its manifest (every file's sha256 as written; not its ``verified``
    figures, added after the verification ran, so that an eval after ``vlmrun bundle`` finds the items the
    verification ran) and each file as it is on disk now (size and modification time: a file changed after the
    bundle was written, with the manifest left as it was, must not get the results of the file it replaced)."""
    manifest = json.loads((folder / layouts.BUNDLE_MANIFEST).read_text())
    manifest.pop("verified", None)
    on_disk = {}
    for name in sorted(manifest.get("files") or {}):
        try:
            st = (folder / name).stat()
            on_disk[name] = [st.st_size, st.st_mtime_ns]
        except OSError:
            on_disk[name] = None  # the run will say what is missing
    return {"manifest": hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest(), "files": on_disk}


def layout_key(layout, registry, model_hash: str, settings, reference: str | None = None) -> str:
    """What a layout's per-item results depend on: the model, the backends and their options, the plugin
    versions and the generation settings; for a device layout (its results are its diff against a reference),
    ``reference``: the reference layout's own key."""
    key = {
        "v": CACHE_VERSION,
        "model": model_hash,
        "stages": {s: {"backend": layout.backend(s), "options": dict(layout.stages[s].options)} for s in STAGES},
        "versions": {p.name: p.version for p in registry.plugins.values()},
        "max_new_tokens": settings.max_new_tokens,
        "system": settings.system,
    }
    if layout.bundle:
        key["bundle"] = bundle_key(Path(layout.bundle))
    if reference is not None:
        key["reference"] = reference
    return hashlib.sha256(json.dumps(key, sort_keys=True, default=str).encode()).hexdigest()[:16]


# --------------------------------------------------------------------------------------------------------------
# the cache


class ResultCache:
    """``<root>/<layout key>/<item key>.json`` (+ ``.npz``: the reference capture), written atomically."""

    def __init__(self, root: Path):
        self.root = Path(root)

    def _path(self, lkey: str, ikey: str, suffix: str) -> Path:
        return self.root / lkey / f"{ikey}{suffix}"

    def get(self, lkey: str, ikey: str) -> dict | None:
        try:
            return json.loads(self._path(lkey, ikey, ".json").read_text())
        except (OSError, ValueError):
            return None

    def has_capture(self, lkey: str, ikey: str) -> bool:
        return self._path(lkey, ikey, ".npz").is_file()

    def capture(self, lkey: str, ikey: str):
        from ..diff.capture import Capture

        path = self._path(lkey, ikey, ".npz")
        try:
            return Capture.load(path)
        except VlmrunError:
            return None

    def describe_layout(self, lkey: str, info: dict) -> None:
        d = self.root / lkey
        d.mkdir(parents=True, exist_ok=True)
        f = d / "layout.json"
        if not f.is_file():
            _atomic_write(f, json.dumps(info, indent=2, default=str).encode())

    def put(self, lkey: str, ikey: str, result: dict, capture=None) -> None:
        """Write one item's result (and capture); the capture first, so a result never lacks its capture."""
        d = self.root / lkey
        d.mkdir(parents=True, exist_ok=True)
        if capture is not None:
            import io

            from ..diff.capture import jsonable

            buf = io.BytesIO()
            np.savez_compressed(buf, **{k: np.asarray(v) for k, v in capture.tensors.items()},
                                __meta__=np.array(json.dumps(jsonable(capture.meta))))
            _atomic_write(self._path(lkey, ikey, ".npz"), buf.getvalue())
        _atomic_write(self._path(lkey, ikey, ".json"), json.dumps(result).encode())


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as fh:
        fh.write(data)
    os.replace(tmp, path)


# --------------------------------------------------------------------------------------------------------------
# one item


def drift_metrics(result) -> dict:
    """The per-checkpoint metrics of a `vlmrun.diff.DiffResult`, keyed ``stage/tensor``."""
    out = {}
    for e in result.entries:
        if e.stage == "preprocess" and e.tensor == "input_ids":
            out[f"{e.stage}/{e.tensor}"] = {"mismatches": e.metrics.get("mismatches")}
            continue
        keep = ("cosine", "sqnr_db", "max_abs", "rel_l2", "top1_agreement", "top5_overlap", "kl_mean", "steps",
                "matching_tokens", "match_fraction", "first_divergent_step", "unexplained_divergence",
                "engine_sqnr_db", "engine_top1_agreement", "first_departing_step")
        out[f"{e.stage}/{e.tensor}"] = {k: e.metrics[k] for k in keep if k in e.metrics}
    return out


@attrs.define
class Side:
    """One layout, ready to run in this process."""

    label: str
    key: str
    pipe: object
    is_reference: bool
    precomputed: dict = attrs.field(factory=dict)  # (stage, digest of inputs) -> outputs (batched stages)


def _digest(inputs: Mapping[str, np.ndarray]) -> str:
    h = hashlib.sha1()
    for name in sorted(inputs):
        a = np.ascontiguousarray(inputs[name])
        h.update(name.encode() + str(a.dtype).encode() + str(a.shape).encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _install_precomputed(side: Side) -> None:
    """Serve the batched stages' outputs from ``side.precomputed`` (run_stage of other stages unchanged)."""
    pipe = side.pipe
    original = type(pipe).run_stage

    def run_stage(stage, inputs, producer="the caller"):
        hit = side.precomputed.get((stage, _digest(inputs))) if side.precomputed else None
        if hit is not None:
            return hit
        return original(pipe, stage, inputs, producer)

    pipe.run_stage = run_stage


def run_item(record: Record, ref: Side, sides: Sequence[Side], cache: ResultCache, settings,
             run_id: str = "") -> dict[str, dict]:
    """Every layout's result for one item (from the cache when there), the new ones written once all succeeded.

    Returns ``{layout key: result}``. Raises `VlmrunError` for an item that cannot run (nothing written).
    """
    if record.turns:
        return run_conversation(record, ref, sides, cache, settings, run_id)
    from ..diff.capture import capture_pipeline
    from ..diff.compare import compare
    from ..diff.thresholds import infer_precision, thresholds_for

    results: dict[str, dict] = {}
    todo = [s for s in sides if cache.get(s.key, record.key) is None]
    for s in sides:
        if s not in todo:
            results[s.key] = cache.get(s.key, record.key)
    ref_result = cache.get(ref.key, record.key)
    need_ref_capture = any(not s.is_reference for s in todo)
    ref_cap = cache.capture(ref.key, record.key) if (ref_result is not None and need_ref_capture) else None
    new: list[tuple[Side, dict, object]] = []
    if ref_result is None or (need_ref_capture and ref_cap is None):
        t = time.perf_counter()
        ref_cap = capture_pipeline(ref.pipe, record.image, record.question, settings,
                                   image_desc=str(record.image))
        ref_result = {"item": record.key, "text": ref_cap.meta.get("text") or "", "tokens": ref_cap.tokens,
                      "seconds": time.perf_counter() - t, "run": run_id}
        new.append((ref, ref_result, ref_cap))
    results[ref.key] = ref_result
    for s in todo:
        if s.is_reference:
            continue
        t = time.perf_counter()
        try:
            dev_cap = capture_pipeline(s.pipe, record.image, record.question, settings, ref_cap.tokens,
                                       image_desc=str(record.image))
        except VlmrunError:  # the reference's answer stands: the layout that could not answer is scored by it
            if new and new[0][0] is ref:
                cache.put(ref.key, record.key, new[0][1], capture=new[0][2])
            raise
        seconds = time.perf_counter() - t
        options = s.pipe.layout_options()
        precision = infer_precision(options, s.pipe.registry)
        diff = compare(ref_cap, dev_cap, thresholds_for(precision, registry=s.pipe.registry), precision)
        result = {"item": record.key, "text": dev_cap.meta.get("text") or "", "tokens": dev_cap.tokens,
                  "seconds": seconds, "run": run_id, "precision": precision, "passed": diff.passed,
                  "culprit": diff.culprit, "drift": drift_metrics(diff)}
        new.append((s, result, None))
        results[s.key] = result
    for s, result, cap in new:
        cache.put(s.key, record.key, result, capture=cap)
    return results


def converse(pipe, record: Record, settings) -> list[dict]:
    """Ask ``record``'s turns in one conversation on ``pipe``, each with the pipeline's own earlier answers in the
    history: per turn its question, answer (``text``), ``tokens`` and the positions it prefilled and reused."""
    turns = []
    with pipe.chat(system=settings.system, settings=settings) as chat:  # a bundle's worker ends with it
        for turn in record.turns:
            gen = chat.ask(turn.question, image=turn.image).run()
            turns.append({"question": turn.question, "text": gen.text, "tokens": [int(t) for t in gen.token_ids],
                          "prefill_tokens": gen.timings.get("prefill_tokens"),
                          "reused_tokens": gen.timings.get("reused_tokens")})
    return turns


def run_conversation(record: Record, ref: Side, sides: Sequence[Side], cache: ResultCache, settings,
                     run_id: str = "") -> dict[str, dict]:
    """`run_item` for a conversation: every layout answers it as a conversation of its own (no capture, no
    diff); the result's ``turns`` hold each turn's answer."""
    results: dict[str, dict] = {}
    new: list[tuple[Side, dict]] = []
    for s in [ref, *[s for s in sides if s is not ref]]:
        cached = cache.get(s.key, record.key)
        if cached is not None:
            results[s.key] = cached
            continue
        t = time.perf_counter()
        turns = converse(s.pipe, record, settings)
        new.append((s, {"item": record.key, "turns": turns, "seconds": time.perf_counter() - t, "run": run_id}))
        results[s.key] = new[-1][1]
    for s, result in new:
        cache.put(s.key, record.key, result)
    return results


# --------------------------------------------------------------------------------------------------------------
# batched stages


def batch_capable(registry, backend: str) -> bool:
    """Does the plugin providing ``backend`` implement ``run_stage_batch``?"""
    for p in registry.plugins.values():
        if any(b.name == backend for b in p.backends):
            return "run_stage_batch" in p.hooks
    return False


def batched_stages(layout, registry) -> list[str]:
    return [s for s in BATCH_STAGES if batch_capable(registry, layout.backend(s))]


def precompute(side: Side, records: Sequence[Record], stages: Sequence[str], progress) -> None:
    """Run ``stages`` of ``side``'s layout over ``records`` with one ``run_stage_batch`` call per stage (vision
    first, the projector on its outputs, then embed) and keep the outputs for the per-item runs."""
    records = [r for r in records if not r.turns]  # a conversation's turns run one by one, stage by stage
    if not records:
        return
    pipe = side.pipe
    if "run_stage" not in vars(pipe):
        _install_precomputed(side)
    dims = pipe.model.dims()
    prepared = [pipe.prepare(r.image, r.question) for r in records]
    feeds = {
        "vision": [{"pixel_values": p.pixel_values} for p in prepared],
        "embed": [{"input_ids": p.input_ids} for p in prepared],
    }
    for stage in stages:
        if stage == "projector":
            if "vision" in stages:
                feats = [side.precomputed[("vision", _digest(f))]["image_features"] for f in feeds["vision"]]
            else:
                feats = [pipe.run_stage("vision", f)["image_features"] for f in feeds["vision"]]
            feeds["projector"] = [{"image_features": f} for f in feats]
        inputs = feeds[stage]
        backend = pipe.layout.backend(stage)
        contract = CONTRACTS[stage]
        checked = [{s.name: check_tensor(i[s.name], s, dims, "the caller", f"{backend} ({stage})")
                    for s in contract.inputs} for i in inputs]
        with progress(f"{side.label}: {stage} on {backend} for {len(inputs)} items in one batch"):
            outs = pipe.registry.hook.run_stage_batch(backend=backend, stage=stage, handle=pipe.handles[stage],
                                                     inputs=checked)
        if outs is None:
            continue  # declined: per item as usual
        if len(outs) != len(inputs):
            raise VlmrunError(f"backend '{backend}' returned {len(outs)} results for a batch of {len(inputs)}"
                              f" ({stage})")
        for feed, out in zip(inputs, outs):
            result = {}
            for spec in contract.outputs:
                if spec.name not in out:
                    raise VlmrunError(f"backend '{backend}' returned no '{spec.name}' from stage '{stage}' (batch)")
                result[spec.name] = check_tensor(out[spec.name], spec, dims, f"{backend} ({stage})", "eval")
            side.precomputed[(stage, _digest(feed))] = result


# --------------------------------------------------------------------------------------------------------------
# worker processes


@attrs.frozen
class WorkerConfig:
    model: str
    store: str
    layouts: tuple  # (label, key, Layout, is_reference)
    settings: object
    cache_root: str
    run_id: str = ""


_WORKER: dict = {}


def _build_sides(config: WorkerConfig, registry=None) -> list[Side]:
    from .. import plugins
    from ..pipeline import Pipeline
    from ..store import ArtifactStore

    registry = registry or plugins.load()
    store = ArtifactStore(config.store)
    sides = []
    for label, key, layout, is_ref in config.layouts:
        pipe = Pipeline.build(config.model, layout, store=store, registry=registry)
        sides.append(Side(label, key, pipe, is_ref))
    return sides


def _worker_init(config: WorkerConfig) -> None:
    one_thread_per_worker()  # one worker per core
    _WORKER["config"] = config
    _WORKER["sides"] = _build_sides(config)
    _WORKER["cache"] = ResultCache(Path(config.cache_root))


def _worker_item(record: Record):
    sides = _WORKER["sides"]
    ref = next(s for s in sides if s.is_reference)
    try:
        config = _WORKER["config"]
        return record.key, run_item(record, ref, sides, _WORKER["cache"], config.settings, config.run_id), None
    except InputError as exc:  # this item's fault (e.g. its prompt does not fit): skipped; others stop the run
        return record.key, None, str(exc)


def run_items(records: Sequence[Record], sides: Sequence[Side], cache: ResultCache, settings, run_id: str = "", *,
              workers: int = 1, config: WorkerConfig | None = None, ray_address: str | None = None,
              on_item: Callable[[Record, dict | None, str | None], None] | None = None) -> None:
    """Run ``records`` through ``sides`` (the reference first), in this process, in ``workers`` processes (each
    builds its own pipelines from ``config``; the artifacts are already in the store) or, with ``ray_address``, on
    Ray actors (`run_items_on_ray`). ``on_item(record, results, error)`` is called in
    this process as each item finishes."""
    ref = next(s for s in sides if s.is_reference)
    if ray_address and config is not None and records:
        by_key = {r.key: r for r in records}
        run_items_on_ray(ray_address, records, config, workers,
                         lambda key, results, error: on_item and on_item(by_key[key], results, error))
        return
    if workers <= 1 or len(records) <= 1:
        for record in records:
            try:
                results, error = run_item(record, ref, sides, cache, settings, run_id), None
            except InputError as exc:
                results, error = None, str(exc)
            if on_item is not None:
                on_item(record, results, error)
        return
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")  # runtimes with thread pools do not survive fork
    by_key = {r.key: r for r in records}
    pool = ctx.Pool(workers, initializer=_worker_init, initargs=(config,))
    try:
        for key, results, error in pool.imap_unordered(_worker_item, records):
            if on_item is not None:
                on_item(by_key[key], results, error)
        pool.close()
    except BaseException:
        pool.terminate()
        raise
    finally:
        pool.join()


class _EvalActor:
    """A Ray actor holding the layouts' pipelines (built once per actor), running items as the worker processes do."""

    def __init__(self, config: WorkerConfig):
        _worker_init(config)

    def item(self, record: Record):
        return _worker_item(record)


def run_items_on_ray(address: str, records: Sequence[Record], config: WorkerConfig, workers: int, on_item) -> None:
    """``vlmrun eval --ray``: ``records`` over ``workers`` Ray actors (1: one per CPU of the cluster); each result is
    handed to ``on_item(key, results, error)`` here as it finishes. Every node must see the store (`..cluster`)."""
    from ..cluster import connect, raise_task_error

    ray = connect(address, Path(config.store))
    from ray.util import ActorPool

    if workers <= 1:
        workers = max(1, int(ray.cluster_resources().get("CPU", 1)))
    actor = ray.remote(num_cpus=1, max_restarts=0)(_EvalActor)
    actors = [actor.remote(config) for _ in range(min(workers, len(records)))]
    try:
        for key, results, error in ActorPool(actors).map_unordered(lambda a, r: a.item.remote(r), list(records)):
            on_item(key, results, error)
    except ray.exceptions.RayError as exc:
        raise_task_error(exc, "a Ray eval worker")
    finally:
        for a in actors:
            ray.kill(a)


def skipped_from_error(record: Record, error: str) -> Skipped:
    return Skipped(record.file, record.line, error)
