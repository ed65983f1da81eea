"""The eval report: aggregation over items (accuracy per kind, drift distributions, the most departing items),
the terminal table, and the self-contained HTML page (in the style of the diff report).

When the data set holds conversations, accuracy counts every turn, and each layout's entry adds ``turns`` (the
turns scored), ``accuracy_by_turn`` (``"turn 1"``, ``"turn 2"``, ...: a one-turn record is a turn 1) and
``records`` (per record its turns: question, expected, got, correct); drift and the departing items come from the
one-turn records only. A data set of one-turn records gives the report it always did."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ..diff.metrics import SQNR_CAP_DB
from ..handles import device_bytes
from .answers import normalize_answer

#: The stage boundaries whose drift is summarised, in pipeline order.
DRIFT_CHECKPOINTS = ("preprocess/pixel_values", "vision/image_features", "projector/image_embeds",
                     "embed/text_embeds", "splice/inputs_embeds", "decoder/logits", "runtime/runtime_logits")
WORST_ITEMS = 5


def distribution(values: Sequence[float]) -> dict:
    """median, 5th percentile (numpy's linear interpolation), min, max and mean of ``values`` (None: not measured).
    A NaN or infinite value (a device that gave non-finite outputs) is no figure to leave out: the statistics are
    then None (``non_finite`` counts them), so that no median or budget is met without it."""
    v = np.asarray([x for x in values if x is not None], dtype=np.float64)
    bad = int((~np.isfinite(v)).sum())
    if v.size == 0 or bad:
        return {"n": int(v.size), "median": None, "p5": None, "min": None, "max": None, "mean": None,
                **({"non_finite": bad} if bad else {})}
    return {"n": int(v.size), "median": float(np.median(v)), "p5": float(np.percentile(v, 5)),
            "min": float(v.min()), "max": float(v.max()), "mean": float(v.mean())}


def _accuracy(rows: list[tuple[str, bool]]) -> dict:
    kinds: dict[str, list[bool]] = {}
    for kind, ok in rows:
        kinds.setdefault(kind, []).append(ok)
    out = {k: {"correct": int(sum(v)), "n": len(v), "accuracy": sum(v) / len(v)} for k, v in sorted(kinds.items())}
    n = len(rows)
    correct = int(sum(ok for _, ok in rows))
    out["all"] = {"correct": correct, "n": n, "accuracy": correct / n if n else None}
    return out


def _by_turn(by_turn: dict[int, list[bool]]) -> dict:
    return {f"turn {i}": {"correct": int(sum(v)), "n": len(v), "accuracy": sum(v) / len(v)}
            for i, v in sorted(by_turn.items())}


def _turns(record, item: dict, ref_item: dict) -> list[dict]:
    """A record's turns scored: question (and the picture a later turn brings), expected, got, correct, and
    whether the reference answered the same (``same``)."""
    got = [t.get("text", "") for t in item.get("turns") or []] if record.turns else [item.get("text", "")]
    ref = [t.get("text", "") for t in ref_item.get("turns") or []] if record.turns else [ref_item.get("text", "")]
    out = []
    for i, turn in enumerate(record.asked):
        text = got[i] if i < len(got) else ""
        entry = {"question": turn.question}
        if i and turn.image is not None:
            entry["image"] = str(turn.image)
        entry.update(expected=turn.answer, got=text, correct=normalize_answer(text) == normalize_answer(turn.answer),
                     same=normalize_answer(text) == normalize_answer(ref[i] if i < len(ref) else ""))
        out.append(entry)
    return out


def aggregate(*, records, skipped, sides, results, labels, timing, dataset, model, settings, workers=1,
              batched=None) -> dict:
    """The report as a JSON-able dict; see the module docstring of `vlmrun.eval`."""
    ref = sides[0]
    ref_results = results[ref.key]
    conversations = any(r.turns for r in records)
    layouts = []
    for side in sides:
        res = results[side.key]
        rows, same, worst, scored = [], [], [], []
        by_turn: dict[int, list[bool]] = {}
        drift: dict[str, dict[str, list]] = {}
        passed, culprits, not_run = [], {}, 0
        for r in records:
            item = res.get(r.key)
            if item is None and side is not ref and ref_results.get(r.key) is not None:
                # the reference answered it and this layout could not (a failed run, a context too short): a wrong
                # answer and a failed diff, never an item left out of its score
                not_run += 1
                for i in range(1, len(r.asked) + 1):  # every turn it was to answer: wrong
                    rows.append((r.kind, False))
                    same.append(False)
                    by_turn.setdefault(i, []).append(False)
                passed.append(False)
                culprits["not run"] = culprits.get("not run", 0) + 1
                continue
            if item is None:
                continue
            turns = _turns(r, item, ref_results.get(r.key) or {})
            for i, turn in enumerate(turns, 1):
                rows.append((r.kind, turn["correct"]))
                same.append(turn["same"])
                by_turn.setdefault(i, []).append(turn["correct"])
            scored.append({"file": r.file, "line": r.line, "image": str(r.image), "kind": r.kind,
                           "turns": [{k: v for k, v in t.items() if k != "same"} for t in turns]})
            if side is ref or r.turns:
                continue
            text, ok, ref_text = turns[0]["got"], turns[0]["correct"], (ref_results.get(r.key) or {}).get("text", "")
            for cp, metrics in (item.get("drift") or {}).items():
                for m, v in metrics.items():
                    drift.setdefault(cp, {}).setdefault(m, []).append(v)
            passed.append(bool(item.get("passed")))
            if item.get("culprit"):
                culprits[item["culprit"]] = culprits.get(item["culprit"], 0) + 1
            logits = (item.get("drift") or {}).get("decoder/logits", {})
            worst.append({
                "file": r.file, "line": r.line, "image": str(r.image), "kind": r.kind, "question": r.question,
                "expected": r.answer, "reference_answer": ref_text, "answer": text, "correct": ok,
                "logits_sqnr_db": logits.get("sqnr_db"), "logits_cosine": logits.get("cosine"),
                "runtime_logits_sqnr_db": (item.get("drift") or {}).get("runtime/runtime_logits", {}).get("sqnr_db"),
                "top1_agreement": logits.get("top1_agreement"), "culprit": item.get("culprit"),
            })
        entry = {
            "label": labels.get(side.key, side.label),
            "key": side.key,
            "is_reference": side is ref,
            "layout": {s: side.pipe.layout.backend(s) for s in side.pipe.layout.stages},
            "options": {s: dict(side.pipe.layout.stages[s].options) for s in side.pipe.layout.stages
                        if side.pipe.layout.stages[s].options},
            "batched_stages": list((batched or {}).get(side.key, [])),
            "items": len(scored),
            "not_run": not_run,  # items the reference answered and this layout could not: scored wrong
            "device_bytes": device_bytes(side.pipe.handles),
            "accuracy": _accuracy(rows),
            "same_answer_as_reference": (sum(same) / len(same)) if same else None,
            "computed": timing[side.key]["computed"],
            "cached": len(scored) - timing[side.key]["computed"],
            # seconds spent on this layout's items in this run (its captures; the reference's include the
            # generation it is compared against), and the items per second that makes
            "seconds": round(timing[side.key]["seconds"], 3),
            "items_per_s": (timing[side.key]["computed"] / timing[side.key]["seconds"]
                            if timing[side.key]["seconds"] > 0 and timing[side.key]["computed"] else None),
        }
        if conversations:
            entry.update(turns=len(rows), accuracy_by_turn=_by_turn(by_turn), records=scored)
        if side is not ref:
            entry["precision"] = next((item["precision"] for item in res.values() if item and item.get("precision")),
                                      None)
            entry["drift"] = {
                cp: {m: distribution(v) for m, v in drift[cp].items()
                     if m in ("cosine", "sqnr_db", "top1_agreement", "top5_overlap", "kl_mean", "match_fraction",
                              "engine_sqnr_db", "unexplained_divergence")}
                for cp in [*DRIFT_CHECKPOINTS, "generation/tokens"] if cp in drift
            }
            entry["diff_pass_rate"] = (sum(passed) / len(passed)) if passed else None
            if conversations:
                entry["diffed_items"] = len(passed)
            entry["culprits"] = culprits
            # departing the most: lowest logits SQNR (wrong answers where the reference was right first)
            worst.sort(key=lambda w: (w["correct"] or normalize_answer(w["reference_answer"])
                                      != normalize_answer(w["expected"]),
                                      w["logits_sqnr_db"] if w["logits_sqnr_db"] is not None else -1e9))
            entry["worst_items"] = worst[:WORST_ITEMS]
        layouts.append(entry)
    report = {
        "dataset": dataset,
        "model": model,
        "items": len(records),
        "skipped": len(skipped),
        "skipped_records": [s.to_json() for s in skipped],
        "reference": layouts[0]["label"],
        "settings": settings,
        "workers": workers,
        "layouts": layouts,
    }
    if conversations:
        report["turns"] = sum(len(r.asked) for r in records)
    return report


# --------------------------------------------------------------------------------------------------------------
# terminal


def _pct(acc: dict | None) -> str:
    if not acc or acc.get("accuracy") is None:
        return "-"
    return f"{100 * acc['accuracy']:.1f}%"


def _table(rows: list[list[str]], left: int = 1) -> list[str]:
    """Aligned columns: the first ``left`` left-aligned, the others right-aligned."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip()
            for r in rows]


def _kinds(report: Mapping) -> list[str]:
    """The question kinds of the report: the generated set's in their order, then others sorted."""
    from ..shapes import KINDS

    found = {k for lay in report["layouts"] for k in lay["accuracy"] if k != "all"}
    return [k for k in KINDS if k in found] + sorted(found - set(KINDS))


def format_table(report: Mapping) -> str:
    """Accuracy per layout and kind, drift per stage boundary (median / 5th percentile over the items), and the
    items where each layout departs the most."""
    turns = f", {report['turns']} turns" if "turns" in report else ""
    lines = [f"data set: {report['dataset']} ({report['items']} items{turns}, {report['skipped']} skipped)"
             f"    model: {report['model']}    reference: {report['reference']}", ""]
    kinds = _kinds(report)
    rows = [["accuracy", "items", *kinds, "all", "same as ref", "computed", "items/s"]]
    for lay in report["layouts"]:
        ips = lay["items_per_s"]
        rows.append([lay["label"], str(lay["items"]), *[_pct(lay["accuracy"].get(k)) for k in kinds],
                     _pct(lay["accuracy"]["all"]), _share(lay["same_answer_as_reference"]),
                     f"{lay['computed']}/{lay['items']}", "-" if ips is None else f"{ips:.2f}"])
    lines += _table(rows)
    by_turn = _turn_names(report)
    if by_turn:
        lines += ["", "accuracy per turn (a one-turn record is a turn 1)"]
        rows = [["layout", *by_turn]]
        for lay in report["layouts"]:
            rows.append([lay["label"], *[_counted(lay["accuracy_by_turn"].get(t)) for t in by_turn]])
        lines += _table(rows)
    others = [lay for lay in report["layouts"] if not lay["is_reference"]]
    if others:
        rows = [["layout", "stage boundary", "cosine", "SQNR dB", "top-1 (teacher-forced)"]]
        for lay in others:
            for cp, m in lay["drift"].items():
                if cp == "generation/tokens":
                    continue
                cos, sq = m.get("cosine", {}), m.get("sqnr_db", {})
                top1 = m.get("top1_agreement")
                rows.append([lay["label"], cp, f"{_f(cos.get('median'), 6)} / {_f(cos.get('p5'), 6)}",
                             f"{_f(sq.get('median'), 1)} / {_f(sq.get('p5'), 1)}",
                             "" if top1 is None else f"{_f(top1.get('median'), 3)} / {_f(top1.get('p5'), 3)}"])
        if len(rows) > 1:  # (none when every item is a conversation)
            lines += ["", "drift against the reference, over the items: median / 5th percentile", *_table(rows, left=2)]
        else:
            lines.append("")
        for lay in others:
            rate = lay["diff_pass_rate"]
            if rate is None:
                lines.append(f"{lay['label']}: no one-turn item to diff (conversations are scored, not diffed)")
                continue
            culprits = ", ".join(f"{k} {v}" for k, v in sorted(lay["culprits"].items(), key=lambda kv: -kv[1]))
            of = f"the {lay['diffed_items']} one-turn items" if "diffed_items" in lay else "items"
            lines.append(f"{lay['label']}: {100 * rate:.1f}% of {of} pass the diff's"
                         f" {lay['precision']} thresholds" + (f" (failing first at: {culprits})" if culprits else ""))
        for lay in others:
            if lay["diff_pass_rate"] is None:
                continue
            lines += ["", f"items where {lay['label']} departs the most:"]
            for w in lay["worst_items"]:
                lines.append(
                    f"  {Path(w['file']).name}:{w['line']} {w['question']!r} expected {w['expected']!r},"
                    f" reference {w['reference_answer']!r}, {lay['label']} {w['answer']!r}"
                    f" ({'correct' if w['correct'] else 'WRONG'}; logits SQNR {_f(w['logits_sqnr_db'], 1)} dB,"
                    f" top-1 {_f(w['top1_agreement'], 3)}" + (f", culprit {w['culprit']}" if w["culprit"] else "")
                    + ")")
    if report["skipped"]:
        lines += ["", f"skipped {report['skipped']} record(s):"]
        lines += [f"  {s['file']}:{s['line']}: {s['reason']}" for s in report["skipped_records"]]
    return "\n".join(lines)


def _turn_names(report: Mapping) -> list[str]:
    """``turn 1``, ``turn 2``, ... of the layouts' ``accuracy_by_turn`` (none for a data set of one-turn records)."""
    found = {t for lay in report["layouts"] for t in lay.get("accuracy_by_turn") or {}}
    return sorted(found, key=lambda t: int(t.split()[-1]))


def _counted(acc: dict | None) -> str:
    if not acc or acc.get("accuracy") is None:
        return "-"
    return f"{_pct(acc)} ({acc['correct']}/{acc['n']})"


def _share(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _f(v, digits: int) -> str:
    if v is None:
        return "-"
    return f"{v:.{digits}f}"


# --------------------------------------------------------------------------------------------------------------
# HTML


def _plots(report: Mapping) -> dict[str, str]:
    from ..plots import png_base64, pyplot

    plt = pyplot()

    figs = {}
    lays = report["layouts"]
    kinds = _kinds(report) + ["all"]
    fig, ax = plt.subplots(figsize=(8, 3.4))
    width = 0.8 / max(len(lays), 1)
    x = np.arange(len(kinds))
    for i, lay in enumerate(lays):
        vals = [100 * (lay["accuracy"].get(k, {}).get("accuracy") or 0.0) for k in kinds]
        ax.bar(x + (i - (len(lays) - 1) / 2) * width, vals, width, label=lay["label"])
    ax.set_xticks(x, kinds)
    ax.set_ylim(0, 105)
    ax.set_ylabel("accuracy (%)")
    ax.set_title("accuracy per layout and question kind (exact match)")
    ax.legend(fontsize=8, loc="lower right")
    figs["accuracy"] = png_base64(fig)

    others = [lay for lay in lays if not lay["is_reference"]]
    if others:
        cps = [cp for cp in DRIFT_CHECKPOINTS if any(cp in lay["drift"] for lay in others)]
        fig, ax = plt.subplots(figsize=(9, 3.6))
        width = 0.8 / len(others)
        for i, lay in enumerate(others):
            xs = np.arange(len(cps)) + (i - (len(others) - 1) / 2) * width
            med = [lay["drift"].get(cp, {}).get("sqnr_db", {}).get("median") for cp in cps]
            p5 = [lay["drift"].get(cp, {}).get("sqnr_db", {}).get("p5") for cp in cps]
            lo = [lay["drift"].get(cp, {}).get("sqnr_db", {}).get("min") for cp in cps]
            med = [SQNR_CAP_DB if v is None else v for v in med]
            ax.bar(xs, med, width, label=f"{lay['label']} (median)", alpha=0.85)
            ax.scatter(xs, [SQNR_CAP_DB if v is None else v for v in p5], marker="_", s=200, color="black",
                       zorder=3, label="5th percentile" if i == 0 else None)
            ax.scatter(xs, [SQNR_CAP_DB if v is None else v for v in lo], marker="v", s=18, color="#c62828",
                       zorder=3, label="worst item" if i == 0 else None)
        ax.set_xticks(np.arange(len(cps)), [cp.replace("/", "\n") for cp in cps], fontsize=8)
        ax.set_ylabel("SQNR (dB)")
        ax.set_title(f"drift per stage boundary over the items (SQNR capped at {SQNR_CAP_DB:.0f} dB)")
        ax.legend(fontsize=7, loc="upper right")
        figs["drift"] = png_base64(fig)

        fig, ax = plt.subplots(figsize=(8, 3.0))
        data, names = [], []
        for lay in others:
            top1 = lay["drift"].get("decoder/logits", {}).get("top1_agreement")
            if top1 is not None:
                names.append(lay["label"])
                data.append([top1["p5"], top1["median"], top1["mean"]])
        if data:
            arr = np.asarray(data)
            x = np.arange(len(names))
            for j, what in enumerate(("5th percentile", "median", "mean")):
                ax.bar(x + (j - 1) * 0.25, arr[:, j], 0.25, label=what)
            ax.set_xticks(x, names)
            ax.set_ylim(0, 1.05)
            ax.set_ylabel("top-1 agreement")
            ax.set_title("decoder: teacher-forced top-1 agreement with the reference, over the items")
            ax.legend(fontsize=8, loc="lower right")
        figs["top1"] = png_base64(fig)
    return figs


def write_html(report: Mapping, directory: str | os.PathLike) -> Path:
    """DIR/index.html (self-contained, plots as base64 PNG) and DIR/eval.json."""
    import html

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    figs = _plots(report)
    esc = html.escape
    kinds = _kinds(report)
    acc_rows = "".join(
        "<tr><td>" + esc(lay["label"]) + "</td><td>" + str(lay["items"]) + "</td>"
        + "".join(f"<td>{_pct(lay['accuracy'].get(k))}</td>" for k in [*kinds, "all"])
        + f"<td>{_share(lay['same_answer_as_reference'])}</td>"
        + f"<td>{esc(' '.join(f'{s}={b}' for s, b in lay['layout'].items()))}"
        + (f" {esc(json.dumps(lay['options']))}" if lay["options"] else "") + "</td></tr>"
        for lay in report["layouts"]
    )
    by_turn = _turn_names(report)
    turn_rows = "".join(
        "<tr><td>" + esc(lay["label"]) + "</td>"
        + "".join(f"<td>{_counted(lay['accuracy_by_turn'].get(t))}</td>" for t in by_turn) + "</tr>"
        for lay in report["layouts"]) if by_turn else ""
    drift_rows = []
    worst_blocks = []
    for lay in report["layouts"]:
        if lay["is_reference"]:
            continue
        for cp, m in lay["drift"].items():
            if cp == "generation/tokens":
                continue
            cos, sq, top1 = m.get("cosine", {}), m.get("sqnr_db", {}), m.get("top1_agreement")
            drift_rows.append(
                f"<tr><td>{esc(lay['label'])}</td><td>{esc(cp)}</td><td>{_f(cos.get('median'), 6)}</td>"
                f"<td>{_f(cos.get('p5'), 6)}</td><td>{_f(cos.get('min'), 6)}</td><td>{_f(sq.get('median'), 1)}</td>"
                f"<td>{_f(sq.get('p5'), 1)}</td><td>{_f(sq.get('min'), 1)}</td>"
                f"<td>{'' if top1 is None else _f(top1.get('median'), 3) + ' / ' + _f(top1.get('p5'), 3)}</td></tr>")
        items = "".join(
            f"<tr class='{'ok' if w['correct'] else 'bad'}'><td>{esc(Path(w['file']).name)}:{w['line']}</td>"
            f"<td>{esc(w['question'])}</td><td>{esc(w['expected'])}</td><td>{esc(w['reference_answer'])}</td>"
            f"<td>{esc(w['answer'])}</td><td>{_f(w['logits_sqnr_db'], 1)}</td><td>{_f(w['top1_agreement'], 3)}</td>"
            f"<td>{esc(str(w['culprit'] or ''))}</td></tr>" for w in lay["worst_items"])
        rate = lay["diff_pass_rate"]
        if rate is None:
            continue
        worst_blocks.append(
            f"<h3>{esc(lay['label'])}</h3><p>{0 if rate is None else 100 * rate:.1f}% of the items pass the diff's"
            f" {esc(str(lay['precision']))} thresholds; first failing stage: "
            f"{esc(', '.join(f'{k} ({v})' for k, v in lay['culprits'].items()) or 'none')}</p>"
            "<table><tr><th>item</th><th>question</th><th>expected</th><th>reference</th><th>answer</th>"
            f"<th>logits SQNR dB</th><th>top-1</th><th>culprit</th></tr>{items}</table>")
    skipped = "".join(f"<li>{esc(s['file'])}:{s['line']}: {esc(s['reason'])}</li>" for s in report["skipped_records"])
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>vlmrun eval: {esc(', '.join(lay['label'] for lay in
report['layouts']))}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 75em; }}
table {{ border-collapse: collapse; font-size: 0.9em; margin-bottom: 1em; }}
td, th {{ border: 1px solid #ccc; padding: 3px 6px; }}
tr.bad {{ background: #ffebee; }} tr.ok {{ background: #f1f8e9; }}
code, pre {{ font-size: 0.85em; }} pre {{ background: #f5f5f5; padding: 1em; overflow: auto; }}
</style></head><body>
<h1>vlmrun eval</h1>
<p>data set: <code>{esc(report['dataset'])}</code> ({report['items']} items, {report['skipped']} skipped)<br>
model: <code>{esc(report['model'])}</code> &nbsp; reference: <b>{esc(report['reference'])}</b> &nbsp;
max new tokens: {report['settings'].get('max_new_tokens')}</p>
<h2>Accuracy (exact match after normalising case and punctuation)</h2>
<table><tr><th>layout</th><th>items</th>{''.join(f'<th>{esc(k)}</th>' for k in kinds)}<th>all</th>
<th>same answer as reference</th><th>stages</th></tr>{acc_rows}</table>
<img alt="accuracy per layout" src="data:image/png;base64,{figs['accuracy']}">
"""
    if turn_rows:
        page += f"""<h2>Accuracy per turn ({report.get('turns')} turns; a one-turn record is a turn 1)</h2>
<table><tr><th>layout</th>{''.join(f'<th>{esc(t)}</th>' for t in by_turn)}</tr>{turn_rows}</table>
"""
    if "drift" in figs:
        page += f"""<h2>Drift against the reference, per stage boundary, over the items</h2>
<table><tr><th>layout</th><th>stage boundary</th><th>cosine median</th><th>cosine p5</th><th>cosine min</th>
<th>SQNR median</th><th>SQNR p5</th><th>SQNR min</th><th>top-1 median / p5</th></tr>{''.join(drift_rows)}</table>
<img alt="SQNR per stage" src="data:image/png;base64,{figs['drift']}">
<img alt="top-1 agreement" src="data:image/png;base64,{figs['top1']}">
<h2>Items where each layout departs the most</h2>{''.join(worst_blocks)}
"""
    if skipped:
        page += f"<h2>Skipped records</h2><ul>{skipped}</ul>\n"
    page += f"""<h2>Raw figures</h2><p><a href="eval.json">eval.json</a></p>
<details><summary>show</summary><pre>{esc(json.dumps(report, indent=2))}</pre></details>
</body></html>
"""
    (d / "eval.json").write_text(json.dumps(report, indent=2) + "\n")
    (d / "index.html").write_text(page)
    return d / "index.html"
