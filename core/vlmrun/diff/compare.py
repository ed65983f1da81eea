"""Comparing two captures: the metrics of every checkpoint, the threshold checks, the verdict and the culprit."""

from __future__ import annotations

from typing import Mapping

import attrs
import numpy as np

from .capture import Capture, jsonable
from .metrics import (
    SQNR_CAP_DB, CHECKPOINTS, METRICS_OF_STAGE, common_prefix, divergence_explained, fmt, fmt_shape, generation_metrics,
    logits_steps, per_step_sqnr, tensor_metrics,
)
from .thresholds import thresholds_for


@attrs.define
class Check:
    metric: str
    op: str  # ">=" or "<="
    threshold: float
    value: float | None
    ok: bool

    def describe(self) -> str:
        return f"{self.metric} {fmt(self.value)} {'<' if self.op == '>=' else '>'} {fmt(self.threshold)}"


@attrs.define
class Entry:
    """One checkpoint: a stage-boundary tensor's metrics and the threshold checks on them."""

    stage: str
    tensor: str
    shape_ref: tuple
    shape_dev: tuple
    metrics: dict
    checks: list[Check] = attrs.field(factory=list)
    note: str = ""

    @property
    def passed(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]


@attrs.define
class DiffResult:
    entries: list[Entry]
    steps: dict[str, list]
    thresholds: dict[str, dict[str, float]]
    precision: str
    reference: dict
    device: dict
    notes: list[str] = attrs.field(factory=list)
    token_text: dict[int, str] = attrs.field(factory=dict)  # what the token ids the report names spell

    @property
    def passed(self) -> bool:
        return all(e.passed for e in self.entries)

    @property
    def failed_stages(self) -> list[str]:
        return list(dict.fromkeys(e.stage for e in self.entries if not e.passed))

    @property
    def boundary(self) -> dict | None:
        """Across the runtime boundary (a device whose runtime is not the engine behind its decoder stage): which
        side departs, ``{"departs": "runtime" | "engine", "first_step": k}``, or None (no such runtime, both sides
        agree, or both fail against the reference: then the binaries are the likely culprit, not a runtime).

        The runtime departs when it fails against the reference and the engine over the same binaries passes; the
        engine (vlmrun's own) departs in the converse case; when both pass against the reference but not against
        each other, the side farther from the reference departs."""
        try:
            rt = self.entry("runtime")
            dec = self.entry("decoder", "logits")
        except KeyError:
            return None
        m = rt.metrics
        if "steps" not in m:  # nothing compared across the boundary (no row, other shapes): the entry's own failure
            return None
        rt_ok = all(c.ok for c in rt.checks if not c.metric.startswith("engine_"))
        boundary_ok = all(c.ok for c in rt.checks if c.metric.startswith("engine_"))
        if rt_ok and dec.passed and boundary_ok:
            return None
        if not rt_ok and not dec.passed:
            return None
        if rt_ok and dec.passed:
            rt_db, eng_db = m.get("sqnr_db"), m.get("engine_reference_sqnr_db")
            side = "runtime" if (rt_db is not None and eng_db is not None and rt_db < eng_db) else "engine"
        else:
            side = "engine" if rt_ok else "runtime"
        return {"departs": side, "first_step": m.get("first_departing_step"), "runtime": m.get("runtime")}

    @property
    def culprit(self) -> str | None:
        """The first stage, in pipeline order, that crosses one of its thresholds."""
        failed = self.failed_stages
        return failed[0] if failed else None

    def entry(self, stage: str, tensor: str | None = None) -> Entry:
        for e in self.entries:
            if e.stage == stage and (tensor is None or e.tensor == tensor):
                return e
        raise KeyError(f"{stage}.{tensor}")

    def worst(self) -> Entry | None:
        """The float tensor checkpoint with the lowest SQNR."""
        cands = [e for e in self.entries if "sqnr_db" in e.metrics and e.metrics["sqnr_db"] is not None]
        if not cands:
            return None
        return min(cands, key=lambda e: (np.nan_to_num(e.metrics["sqnr_db"], nan=-1e9), -CHECKPOINTS.index(
            (e.stage, e.tensor))))

    def to_json(self) -> dict:
        culprit = self.culprit
        return jsonable({
            "passed": self.passed,
            "culprit": culprit,
            "culprit_failures": [c.describe() for e in self.entries if e.stage == culprit for c in e.failures],
            "failed_stages": self.failed_stages,
            "boundary": self.boundary,
            "precision": self.precision,
            "reference": self.reference,
            "device": self.device,
            "checkpoints": [
                {"stage": e.stage, "tensor": e.tensor, "shape_ref": list(e.shape_ref), "shape_dev": list(e.shape_dev),
                 "passed": e.passed, "metrics": e.metrics, "note": e.note,
                 "checks": [attrs.asdict(c) for c in e.checks]}
                for e in self.entries
            ],
            "steps": self.steps,
            "thresholds": self.thresholds,
            "notes": self.notes,
        })


def _apply(entry: Entry, thresholds: Mapping[str, Mapping[str, float]]) -> Entry:
    directions = METRICS_OF_STAGE[entry.stage]
    for metric, limit in thresholds.get(entry.stage, {}).items():
        if metric not in entry.metrics:
            continue
        value = entry.metrics[metric]
        op = ">=" if directions[metric] == "min" else "<="
        ok = value is not None and (value >= limit if op == ">=" else value <= limit)  # NaN fails
        entry.checks.append(Check(metric, op, float(limit), value, bool(ok)))
    if entry.note.startswith("shape"):
        entry.checks.append(Check("shape", "==", 0.0, None, False))
    return entry


def compare(ref: Capture, dev: Capture, thresholds: Mapping[str, Mapping[str, float]] | None = None,
            precision: str = "fp32") -> DiffResult:
    """Metrics of every checkpoint of ``dev`` against ``ref`` and the threshold checks on them."""
    thresholds = {s: dict(m) for s, m in (thresholds or thresholds_for(precision)).items()}
    entries: list[Entry] = []
    notes: list[str] = []
    steps: dict[str, list] = {"top1": [], "top5_overlap": [], "kl": []}
    for stage, name in CHECKPOINTS:
        if name == "runtime_logits":  # only a device whose runtime is not the engine behind its decoder stage
            if name in dev.tensors and "logits" in ref.tensors and "logits" in dev.tensors:
                entry, runtime_steps = _runtime_entry(ref, dev, thresholds)
                entries.append(entry)
                steps.update(runtime_steps)
            continue
        if name not in ref.tensors or name not in dev.tensors:
            side = "device" if name not in dev.tensors else "reference"
            if name in MUST_CAPTURE:  # the answer, and the logits that explain it: without them nothing is certified
                entries.append(_not_captured(ref, dev, stage, name, side))
                notes.append(f"the {side} side's {MUST_CAPTURE[name]} ({name}) were not captured: this diff cannot"
                             f" pass without them")
                continue
            notes.append(f"{name} is not observable on the {side} side (its runtime fuses the stages around it):"
                         f" not compared")
            continue
        r, d = np.asarray(ref.tensors[name]), np.asarray(dev.tensors[name])
        if name == "tokens":
            m = {**generation_metrics(ref.tokens, dev.tokens), **_divergence(ref, dev)}
            entries.append(_apply(Entry(stage, name, r.shape, d.shape, m), thresholds))
            continue
        if name == "logits":
            rows, note = _comparable_rows(ref, dev)
            r, d = r[:, :rows], d[:, :rows]
            if note:
                notes.append(note)
            short = _short_side(rows, ("the reference", r), ("the device", d))
            if short:  # rows a side never gave have shown nothing: not a pass on fewer
                entries.append(_missing_rows(Entry(stage, name, r.shape, d.shape, {}), rows, *short))
                continue
        if r.shape != d.shape:
            m = {"mismatches": int(max(r.size, d.size))} if name == "input_ids" else {}
            entry = Entry(stage, name, r.shape, d.shape, m, note=f"shape {fmt_shape(r.shape)} vs {fmt_shape(d.shape)}")
            entries.append(_apply(entry, thresholds))
            continue
        if name == "input_ids":
            m = {"mismatches": int((r != d).sum())}
        else:
            m = tensor_metrics(r, d)
        if name == "logits":
            steps = {**steps, **logits_steps(r, d)}
            m.update(
                steps=len(steps["top1"]),
                top1_agreement=float(np.mean(steps["top1"])) if steps["top1"] else 1.0,
                top5_overlap=float(np.mean(steps["top5_overlap"])) if steps["top5_overlap"] else 1.0,
                kl_mean=float(np.mean(steps["kl"])) if steps["kl"] else 0.0,
                kl_max=float(np.max(steps["kl"])) if steps["kl"] else 0.0,
            )
        entries.append(_apply(Entry(stage, name, r.shape, d.shape, m), thresholds))
    return DiffResult(entries, steps, thresholds, precision, dict(ref.meta), dict(dev.meta), notes)


#: the checkpoints every side must have (a runtime may fuse the others away, e.g. a bundle's image features): the
#: answer and the decoder's logits, which explain it
MUST_CAPTURE = {"logits": "decoder logits", "tokens": "answer tokens"}


def _not_captured(ref: Capture, dev: Capture, stage: str, name: str, side: str) -> Entry:
    """A failed checkpoint for a `MUST_CAPTURE` tensor one side lacks (a third-party backend's capture, one built
    through the Python API): without it the diff would pass on the checkpoints it has, or on none."""
    def shape(c: Capture) -> tuple:
        return tuple(np.shape(c.tensors[name])) if name in c.tensors else ()

    m: dict = {}
    if name == "tokens":  # the side that has tokens against none: the generation line still reads its figures
        m = {**generation_metrics(*(c.tokens if name in c.tensors else [] for c in (ref, dev))),
             "unexplained_divergence": 0}
    entry = Entry(stage, name, shape(ref), shape(dev), m, note=f"not captured on the {side} side")
    entry.checks.append(Check(f"{name}_captured", ">=", 1.0, 0.0, False))
    return entry


def _runtime_entry(ref: Capture, dev: Capture, thresholds) -> tuple[Entry, dict]:
    """The runtime boundary: the runtime's own logits (teacher-forced through it) against the reference's, as the
    decoder's are, and against the engine's over the same binaries (``engine_*``); the first step where the
    runtime leaves the engine (its row's SQNR against the engine's below ``engine_sqnr_db``, or another top-1)."""
    rows, _ = _comparable_rows(ref, dev)
    r = np.asarray(ref.tensors["logits"])[:, :rows]
    d = np.asarray(dev.tensors["runtime_logits"])[:, :rows]
    e = np.asarray(dev.tensors["logits"])[:, :rows]
    short = _short_side(rows, ("the reference", r), ("the runtime", d), ("the engine", e))
    if short:  # a side that gave fewer rows: not a pass on fewer
        return _missing_rows(Entry("runtime", "runtime_logits", r.shape, d.shape, {}), rows, *short), {}
    if r.shape != d.shape:
        entry = Entry("runtime", "runtime_logits", r.shape, d.shape, {}, note=f"shape {fmt_shape(r.shape)} vs"
                      f" {fmt_shape(d.shape)}")
        return _apply(entry, thresholds), {}
    m = tensor_metrics(r, d)
    st = logits_steps(r, d)
    eng = tensor_metrics(e, d)
    engine_ref = tensor_metrics(r, e)  # the engine's own distance from the reference, to say which side departs
    step_sqnr = per_step_sqnr(e, d)
    eng_top1 = (e.reshape(rows, -1).argmax(-1) == d.reshape(rows, -1).argmax(-1)).tolist()
    floor = thresholds.get("runtime", {}).get("engine_sqnr_db")
    first = next((k for k in range(rows) if not eng_top1[k] or (floor is not None and not step_sqnr[k] >= floor)),
                 None)
    m.update(
        steps=rows,
        top1_agreement=float(np.mean(st["top1"])) if rows else 1.0,
        top5_overlap=float(np.mean(st["top5_overlap"])) if rows else 1.0,
        kl_mean=float(np.mean(st["kl"])) if rows else 0.0,
        kl_max=float(np.max(st["kl"])) if rows else 0.0,
        engine_sqnr_db=eng["sqnr_db"],
        engine_min_step_sqnr_db=float(np.min(step_sqnr)) if rows else SQNR_CAP_DB,
        engine_top1_agreement=float(np.mean(eng_top1)) if rows else 1.0,
        engine_reference_sqnr_db=engine_ref["sqnr_db"],
        first_departing_step=first,
        runtime=dev.meta.get("runtime"),
    )
    entry = _apply(Entry("runtime", "runtime_logits", r.shape, d.shape, m), thresholds)
    return entry, {"runtime_top1": st["top1"], "runtime_kl": st["kl"], "runtime_engine_sqnr": step_sqnr,
                   "runtime_engine_top1": [float(x) for x in eng_top1], "runtime_argmax": st["dev_argmax"]}


def _short_side(rows: int, *sides: tuple[str, np.ndarray]) -> tuple[str, tuple] | None:
    """The first of ``sides`` (name, [1, K, V] logits) with fewer than ``rows`` rows: (name, its shape)."""
    return next(((side, got.shape) for side, got in sides if got.ndim == 3 and got.shape[1] < rows), None)


def _missing_rows(entry: Entry, want: int, side: str, shape: tuple) -> Entry:
    """A failed checkpoint for teacher-forced logits rows a side did not give (``want`` of them were due; the side's
    logits have ``shape``)."""
    got = shape[1] if len(shape) == 3 else 0
    entry.note = f"{side} gave {got} of the {want} teacher-forced logits rows due"
    entry.checks.append(Check(f"{entry.tensor}_steps", ">=", float(want), float(got), False))
    return entry


def _divergence(ref: Capture, dev: Capture) -> dict:
    """Was the free-running generation made by the logits the diff checked? At the first step where it leaves the
    reference, the context is the reference's on both sides, so the generating runtime's own teacher-forced row
    there (``runtime_logits`` when the device has a separate runtime, else ``logits``) must give the device's token
    (greedy; a near-tie is explained, `.metrics.divergence_explained`). 1 when it does not: the tokens come
    from somewhere the teacher-forced checkpoints never measured (a runtime, a sampler, a KV cache)."""
    rt, dt = ref.tokens, dev.tokens
    p = common_prefix(rt, dt)
    if p >= len(rt) and p >= len(dt):
        return {"unexplained_divergence": 0}
    if p >= len(rt) or p >= len(dt):  # one side stopped where the other went on, with no stop token of its own
        # (a side's answer ends with its stop token; one that stops without one was cut off, or runs past a stop):
        # the logits checked never predicted that, unless the shorter side only used up its token budget
        short, other = (dev, ref) if p >= len(dt) else (ref, dev)
        budget = short.meta.get("max_new_tokens")
        if budget is not None and p >= int(budget) and other.meta.get("max_new_tokens") == budget:
            return {"unexplained_divergence": 0}  # both sides had this budget; the shorter one used it up
        who = "the device stopped" if short is dev else "the device went on"
        return {"unexplained_divergence": 1,
                "divergence": {"step": p, "device_token": dt[p] if p < len(dt) else None,
                               "reference_token": rt[p] if p < len(rt) else None, "judged_by": "length",
                               "why": f"{who} after {p} tokens where the reference made {len(rt)}"}}
    key = "runtime_logits" if "runtime_logits" in dev.tensors else "logits"
    rows = np.asarray(dev.tensors.get(key, np.zeros((1, 0, 0))))
    if rows.ndim != 3 or rows.shape[1] <= p or common_prefix(dev.forced_tokens, rt) < p:
        # no row of the device's, on the reference's context, at the step it left the reference: what made the
        # token was never measured, so the departure cannot be explained by the logits checked
        return {"unexplained_divergence": 1,
                "divergence": {"step": p, "device_token": dt[p], "reference_token": rt[p], "judged_by": key,
                               "why": f"the device has no teacher-forced {key} row on the reference's context at"
                                      f" step {p}"}}
    explained, detail = divergence_explained(rows[0, p], dt[p])
    return {"unexplained_divergence": 0 if explained else 1,
            "divergence": {"step": p, "device_token": dt[p], "reference_token": rt[p], "judged_by": key, **detail}}


def _comparable_rows(ref: Capture, dev: Capture) -> tuple[int, str]:
    """Logits rows due on both sides, predicting the same context: k where forced tokens agree before k (the rows
    of the reference's; a device that gave fewer fails on them)."""
    fr, fd = ref.forced_tokens, dev.forced_tokens
    rows = max(len(fr), 1)  # one row per token the reference was forced on: a side with fewer fails on them
    prefix = common_prefix(fr, fd)
    if prefix < min(len(fr), len(fd)) or len(fr) != len(fd):
        keep = min(rows, prefix + 1)
        return keep, (
            f"the device decoder was not teacher-forced on the reference tokens (they differ from step {prefix});"
            f" only the first {keep} logits steps are compared"
        )
    return rows, ""

