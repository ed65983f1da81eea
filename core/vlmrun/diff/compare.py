"""Comparing two captures: the metrics of every checkpoint, the threshold checks, the verdict and the culprit."""

from __future__ import annotations

from typing import Mapping

import attrs
import numpy as np

from .capture import Capture, jsonable
from .metrics import (
    CHECKPOINTS, METRICS_OF_STAGE, common_prefix, fmt, fmt_shape, generation_metrics, logits_steps, tensor_metrics,
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

    @property
    def passed(self) -> bool:
        return all(e.passed for e in self.entries)

    @property
    def failed_stages(self) -> list[str]:
        return list(dict.fromkeys(e.stage for e in self.entries if not e.passed))

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
        if name not in ref.tensors or name not in dev.tensors:
            side = "device" if name not in dev.tensors else "reference"
            notes.append(f"{name} is not observable on the {side} side (its runtime fuses the stages around it):"
                         f" not compared")
            continue
        r, d = np.asarray(ref.tensors[name]), np.asarray(dev.tensors[name])
        if name == "tokens":
            m = generation_metrics(ref.tokens, dev.tokens)
            entries.append(_apply(Entry(stage, name, r.shape, d.shape, m), thresholds))
            continue
        if name == "logits":
            rows, note = _comparable_rows(ref, dev)
            r, d = r[:, :rows], d[:, :rows]
            if note:
                notes.append(note)
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
            steps = logits_steps(r, d)
            m.update(
                steps=len(steps["top1"]),
                top1_agreement=float(np.mean(steps["top1"])) if steps["top1"] else 1.0,
                top5_overlap=float(np.mean(steps["top5_overlap"])) if steps["top5_overlap"] else 1.0,
                kl_mean=float(np.mean(steps["kl"])) if steps["kl"] else 0.0,
                kl_max=float(np.max(steps["kl"])) if steps["kl"] else 0.0,
            )
        entries.append(_apply(Entry(stage, name, r.shape, d.shape, m), thresholds))
    return DiffResult(entries, steps, thresholds, precision, dict(ref.meta), dict(dev.meta), notes)


def _comparable_rows(ref: Capture, dev: Capture) -> tuple[int, str]:
    """Logits rows predicting the same context on both sides: k where forced tokens agree before k."""
    fr, fd = ref.forced_tokens, dev.forced_tokens
    n = max(len(fr), 1)
    rows = min(ref.tensors["logits"].shape[1], dev.tensors["logits"].shape[1], n)
    prefix = common_prefix(fr, fd)
    if prefix < min(len(fr), len(fd)) or len(fr) != len(fd):
        keep = min(rows, prefix + 1)
        return keep, (
            f"the device decoder was not teacher-forced on the reference tokens (they differ from step {prefix});"
            f" only the first {keep} logits steps are compared"
        )
    return rows, ""

