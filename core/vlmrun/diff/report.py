"""Output of a diff: the terminal table, saved captures with metrics.json, and the self-contained HTML report."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from ..plots import png_base64, pyplot
from .locate_report import location_html, plot_location
from .metrics import SQNR_CAP_DB, fmt, fmt_shape

if TYPE_CHECKING:
    from . import DiffRun
    from .capture import Capture
    from .compare import DiffResult


def format_table(result: DiffResult) -> str:
    """The terminal table: one row per checkpoint, then per-step and generation summaries and the verdict."""
    ref, dev = result.reference, result.device
    lines = [
        f"reference: {ref.get('source', '?')}    device: {dev.get('source', '?')}    precision: {result.precision}",
        "",
    ]
    cols = ("stage", "tensor", "shape", "max_abs", "mean_abs", "rel_l2", "cosine", "sqnr_dB", "status")
    rows = []
    for e in result.entries:
        if e.stage == "generation":
            continue
        m = e.metrics
        if e.note:
            status = "FAIL " + e.note
        elif not e.checks:
            status = "(no check)"
        else:
            status = "ok" if e.passed else "FAIL " + ", ".join(c.describe() for c in e.failures)
        if e.tensor == "input_ids":
            vals = [f"{m.get('mismatches', '-')} differ", "", "", "", ""]
        else:
            cos = m.get("cosine")
            vals = [fmt(m.get("max_abs")), fmt(m.get("mean_abs")), fmt(m.get("rel_l2")),
                    "-" if cos is None else f"{cos:.8f}", "-" if m.get("sqnr_db") is None else f"{m['sqnr_db']:.1f}"]
        shape = "-" if e.note.startswith("not captured") else fmt_shape(e.shape_dev)
        rows.append((e.stage, e.tensor, shape, *vals, status))
    widths = [max(len(str(r[i])) for r in [cols, *rows]) for i in range(len(cols) - 1)]
    for r in [cols, *rows]:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) + "  " + str(r[-1]))
    dec = result.entry("decoder")
    m = dec.metrics
    if "steps" in m:
        agree = int(round(sum(result.steps["top1"])))
        lines.append(
            f"decoder, teacher-forced, {m['steps']} steps: top-1 agreement {agree}/{m['steps']}"
            f" ({m['top1_agreement']:.3f}), top-5 overlap {m['top5_overlap']:.3f},"
            f" KL mean {fmt(m['kl_mean'])} max {fmt(m['kl_max'])}"
        )
    lines += _runtime_lines(result)
    g = result.entry("generation")
    gm = g.metrics
    first = gm["first_divergent_step"]
    lines.append(
        f"generation, free-running: {gm['matching_tokens']}/{gm['ref_len']} reference tokens matched"
        f" (device made {gm['dev_len']}); first divergent step: {'none' if first is None else first}"
        + ("" if g.passed else "  FAIL " + ", ".join(c.describe() for c in g.failures))
    )
    div = gm.get("divergence") or {}
    if gm.get("unexplained_divergence") and div.get("why"):
        lines.append(f"      {div['why']}: the answer was not made by the logits checked")
    elif gm.get("unexplained_divergence"):
        judged = "the runtime's own" if div.get("judged_by") == "runtime_logits" else "the decoder's"
        lines.append(
            f"      the device's token {div.get('device_token')} at step {div.get('step')} is not what {judged}"
            f" teacher-forced logits give there (top-1 {div.get('row_argmax')}; its probability"
            f" {div.get('prob_ratio', 0):.2g}x the top token's): the answer was not made by the logits checked")
    for note in result.notes:
        lines.append(f"note: {note}")
    culprit = result.culprit
    boundary = runtime_verdict(result)
    if culprit is None:
        lines.append("PASS: every checkpoint is within its thresholds")
    elif boundary:
        lines.append(boundary)
        if len(result.failed_stages) > 1:
            lines.append(f"      also failing downstream: {', '.join(result.failed_stages[1:])}")
    else:
        why = "; ".join(f"{e.tensor}: " + (e.note or ", ".join(c.describe() for c in e.failures))
                        for e in result.entries if e.stage == culprit and not e.passed)
        lines.append(f"FAIL: likely culprit: {culprit} (first stage to cross its thresholds: {why})")
        if len(result.failed_stages) > 1:
            lines.append(f"      also failing downstream: {', '.join(result.failed_stages[1:])}")
    return "\n".join(lines)


def _runtime_lines(result: DiffResult) -> list[str]:
    """The runtime boundary, when the device's runtime is not the engine behind its decoder stage (a bundle's
    a vendor's LLM runtime): its teacher-forced logits against the reference and against the engine over the same binaries."""
    try:
        e = result.entry("runtime")
    except KeyError:
        return []
    m = e.metrics
    if "steps" not in m:
        return []
    n = m["steps"]
    first = m.get("first_departing_step")
    return [
        f"runtime ({m.get('runtime') or 'the device runtime'}), teacher-forced through it, {n} steps: top-1"
        f" agreement {int(round(m['top1_agreement'] * n))}/{n} with the reference,"
        f" {int(round(m['engine_top1_agreement'] * n))}/{n} with the engine over the same binaries;"
        f" first step departing from the engine: {'none' if first is None else first}",
        f"      its logits: SQNR {m['sqnr_db']:.1f} dB against the reference, {m['engine_sqnr_db']:.1f} dB against"
        f" the engine over the same binaries",
    ]


def runtime_verdict(result: DiffResult) -> str:
    """The verdict across the runtime boundary (`DiffResult.boundary`), '' when there is none to give: the
    side that departs (the runtime, or vlmrun's engine), not the binary, from the first step where the two leave
    each other, with that step's figures and the other side's standing against the reference."""
    b = result.boundary
    if b is None:
        return ""
    e = result.entry("runtime")
    m, steps = e.metrics, result.steps
    first = b["first_step"]
    name = b["runtime"] or "the device runtime"
    engine = result.entry("decoder", "logits")
    bits = []
    if first is not None:
        sq = steps.get("runtime_engine_sqnr", [])
        top1 = steps.get("runtime_engine_top1", [])
        ra, da = steps.get("ref_argmax", []), steps.get("runtime_argmax", [])
        if first < len(sq):
            bits.append(f"step {first}: SQNR {sq[first]:.1f} dB between the two")
        if first < len(top1) and not top1[first] and first < len(da) and first < len(ra) and b["departs"] == "runtime":
            bits.append(f"{name}'s top-1 token {_spell(result, da[first])} where the reference's is"
                        f" {_spell(result, ra[first])}")
    at = "" if first is None else f" from step {first}"
    if b["departs"] == "runtime":
        why = [c.describe() for c in e.failures]
        return (f"FAIL: the runtime departs, not the binary: {name} leaves the engine over the same binaries{at}\n"
                f"      {'; '.join([*bits, ', '.join(why)])}; the binaries pass under the engine (decoder logits"
                f" {engine.metrics['sqnr_db']:.1f} dB, {name}'s {m['sqnr_db']:.1f} dB)")
    why = [c.describe() for c in engine.failures] or [c.describe() for c in e.failures]
    return (f"FAIL: the engine departs, not the binary: vlmrun's host engine leaves {name} over the same binaries{at}\n"
            f"      {'; '.join([*bits, ', '.join(why)])}; {name} holds to the reference (its logits"
            f" {m['sqnr_db']:.1f} dB, the engine's {engine.metrics['sqnr_db']:.1f} dB)")


def _spell(result: DiffResult, token) -> str:
    text = result.token_text.get(int(token))
    return f"{token} ({text!r})" if text is not None else str(token)


def save_run(run_: DiffRun, directory: str | os.PathLike) -> Path:
    """``--save DIR``: DIR/reference and DIR/device (captures) and DIR/metrics.json; ``--from DIR`` replays it."""
    d = Path(directory)
    run_.reference.save(d / "reference")
    run_.device.save(d / "device")
    (d / "metrics.json").write_text(json.dumps(_data(run_), indent=2) + "\n")
    return d


def _data(run_: DiffRun) -> dict:
    """metrics.json: the result, plus the layer-by-layer location when --locate ran."""
    from .capture import jsonable

    data = run_.result.to_json()
    if getattr(run_, "location", None) is not None:
        data["locate"] = jsonable(run_.location.to_json())
    return data


def _plots(run_: DiffRun) -> dict[str, str]:
    plt = pyplot()
    result = run_.result
    figs: dict[str, str] = {}

    tensors = [e for e in result.entries if e.metrics.get("sqnr_db") is not None]
    fig, ax = plt.subplots(figsize=(8, 3.2))
    labels = [f"{e.stage}\n{e.tensor}" for e in tensors]
    values = [float(np.nan_to_num(e.metrics["sqnr_db"], nan=-SQNR_CAP_DB)) for e in tensors]
    colors = ["#2e7d32" if e.passed else "#c62828" for e in tensors]
    ax.bar(range(len(tensors)), values, color=colors)
    for i, e in enumerate(tensors):
        limit = result.thresholds.get(e.stage, {}).get("sqnr_db")
        if limit is not None:
            ax.hlines(limit, i - 0.4, i + 0.4, colors="black", linestyles="dashed")
    ax.set_xticks(range(len(tensors)), labels, fontsize=8)
    ax.set_ylabel("SQNR (dB)")
    ax.set_title(f"SQNR per stage boundary (capped at {SQNR_CAP_DB:.0f} dB; dashes: thresholds; red: failed)")
    figs["sqnr"] = png_base64(fig)

    steps = result.steps
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 4.5), sharex=True)
    x = np.arange(len(steps["top1"]))
    a1.plot(x, steps["top1"], "o-", label="top-1 agreement")
    a1.plot(x, steps["top5_overlap"], "s--", label="top-5 overlap", alpha=0.7)
    a1.set_ylim(-0.05, 1.05)
    a1.set_ylabel("agreement")
    a1.legend(loc="lower left", fontsize=8)
    a1.set_title("decoder per step (teacher-forced on the reference tokens)")
    a2.plot(x, steps["kl"], "o-", color="#6a1b9a")
    a2.set_yscale("symlog", linthresh=1e-9)
    a2.set_ylabel("KL(ref || dev)")
    a2.set_xlabel("generation step")
    figs["steps"] = png_base64(fig)

    worst = result.worst()
    shown = [worst] if worst is not None else []
    culprit = result.culprit
    if culprit is not None:  # also the first failing stage, when that is not the worst one
        first = next((e for e in result.entries if e.stage == culprit and "sqnr_db" in e.metrics), None)
        if first is not None and first is not worst:
            shown.append(first)
    fig, axes = plt.subplots(1, max(len(shown), 1), figsize=(8 if len(shown) < 2 else 11, 3.2), squeeze=False)
    for ax, entry in zip(axes[0], shown):
        if entry.shape_ref != entry.shape_dev:
            ax.set_title(f"{entry.stage}/{entry.tensor}: shapes differ", fontsize=9)
            continue
        err = (np.asarray(run_.device.tensors[entry.tensor], dtype=np.float64)
               - np.asarray(run_.reference.tensors[entry.tensor], dtype=np.float64))
        if entry.tensor == "logits":
            err = err[:, : entry.metrics.get("steps", err.shape[1])]
        err = err.ravel()
        err = err[np.isfinite(err)]
        ax.hist(err, bins=100, color="#1565c0" if entry is worst else "#c62828")
        ax.set_yscale("log")
        kind = "worst checkpoint" if entry is worst else "first failing stage"
        ax.set_title(f"{kind}: {entry.stage}/{entry.tensor} (SQNR {entry.metrics['sqnr_db']:.1f} dB)"
                     + ("; all errors zero" if not np.any(err) else ""), fontsize=9)
        ax.set_xlabel("error (device - reference)")
        ax.set_ylabel("count")
    figs["hist"] = png_base64(fig)
    if getattr(run_, "location", None) is not None:  # --locate: the per-layer curve
        figs["locate"] = png_base64(plot_location(run_.location, plt))
    return figs


def _location_section(run_: DiffRun, figs: dict) -> str:
    if getattr(run_, "location", None) is None:
        return ""
    return location_html(run_.location, figs["locate"])


def write_report(run_: DiffRun, directory: str | os.PathLike) -> Path:
    """``--report DIR``: DIR/index.html (self-contained, plots as base64 PNG) and DIR/metrics.json."""
    import html

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    result = run_.result
    data = _data(run_)
    figs = _plots(run_)
    esc = html.escape
    ref, dev = result.reference, result.device
    verdict = ("<p class='pass'>PASS: every checkpoint is within its thresholds</p>" if result.passed else
               f"<p class='fail'>FAIL: likely culprit <b>{esc(str(result.culprit))}</b>"
               f" (first stage to cross its thresholds; failing: {esc(', '.join(result.failed_stages))})</p>")
    if runtime_verdict(result):
        verdict += f"<p class='fail'>{esc(runtime_verdict(result))}</p>"
    rows = []
    for e in result.entries:
        m = e.metrics
        cells = [e.stage, e.tensor, fmt_shape(e.shape_ref) + ("" if e.shape_ref == e.shape_dev else
                                                             " vs " + fmt_shape(e.shape_dev))]
        metric_text = ", ".join(f"{k} {fmt(v) if isinstance(v, (int, float)) or v is None else v}"
                                for k, v in m.items())
        checks = "; ".join(("ok " if c.ok else "FAIL ") + f"{c.metric} {c.op} {fmt(c.threshold)}"
                           for c in e.checks) or "(no check)"
        rows.append(
            f"<tr class='{'ok' if e.passed else 'bad'}'>" + "".join(f"<td>{esc(c)}</td>" for c in cells)
            + f"<td>{esc(metric_text + (' ' + e.note if e.note else ''))}</td><td>{esc(checks)}</td></tr>"
        )
    def tokens_text(cap: Capture) -> str:
        text = cap.meta.get("text")
        return " ".join(str(t) for t in cap.tokens) + (f"  ({text!r})" if text is not None else "")

    notes = "".join(f"<li>{esc(n)}</li>" for n in result.notes)
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>vlmrun diff: {esc(ref.get('source', '?'))} vs
{esc(dev.get('source', '?'))}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 70em; }}
table {{ border-collapse: collapse; font-size: 0.9em; }} td, th {{ border: 1px solid #ccc; padding: 3px 6px; }}
tr.bad {{ background: #ffebee; }} tr.ok {{ background: #f1f8e9; }}
.pass {{ color: #2e7d32; font-weight: bold; }} .fail {{ color: #c62828; font-weight: bold; }}
code, pre {{ font-size: 0.85em; }} pre {{ background: #f5f5f5; padding: 1em; overflow: auto; }}
</style></head><body>
<h1>vlmrun diff</h1>
<p>reference: <b>{esc(str(ref.get('source', '?')))}</b> &nbsp; device: <b>{esc(str(dev.get('source', '?')))}</b>
&nbsp; precision thresholds: <b>{esc(result.precision)}</b><br>
model: <code>{esc(str(ref.get('model', '')))}</code> &nbsp; image: <code>{esc(str(ref.get('image', '')))}</code>
&nbsp; prompt: <code>{esc(str(ref.get('prompt', '')))}</code></p>
{verdict}
<ul>{notes}</ul>
<h2>Stage boundaries</h2>
<table><tr><th>stage</th><th>tensor</th><th>shape</th><th>metrics</th><th>checks</th></tr>
{''.join(rows)}</table>
<h2>SQNR per stage</h2><img alt="SQNR per stage" src="data:image/png;base64,{figs['sqnr']}">
<h2>Decoder per step</h2><img alt="per-step top-1 agreement and KL" src="data:image/png;base64,{figs['steps']}">
<h2>Errors of the worst stage</h2><img alt="error histogram" src="data:image/png;base64,{figs['hist']}">
{_location_section(run_, figs)}
<h2>Tokens</h2>
<p>reference: <code>{esc(tokens_text(run_.reference))}</code><br>
device (free-running): <code>{esc(tokens_text(run_.device))}</code></p>
<h2>Raw metrics</h2><p><a href="metrics.json">metrics.json</a></p>
<details><summary>show</summary><pre>{esc(json.dumps(data, indent=2))}</pre></details>
</body></html>
"""
    (d / "metrics.json").write_text(json.dumps(data, indent=2) + "\n")
    (d / "index.html").write_text(page)
    return d / "index.html"
