"""A tune's output: the Pareto front, the table, JSON, the HTML page with the plot, the winner's layout TOML."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

from ..stages import STAGES


def _objectives(p) -> tuple:
    """Larger is better on each: fewer bytes, higher logits SQNR, more answers as the reference, higher accuracy."""
    return (-p.bytes, p.logits_sqnr_db if p.logits_sqnr_db is not None else -1e9,
            p.answers_as_reference or 0.0, p.accuracy or 0.0)


def pareto_front(points: Sequence) -> list:
    """The points no other point dominates (at least as good on every objective, better on one), by bytes; one
    point per distinct build (the same eval key measured twice counts once)."""
    unique = {}
    for p in points:
        unique.setdefault(p.key, p)
    pts = list(unique.values())
    front = []
    for p in pts:
        op = _objectives(p)
        dominated = any(all(a >= b for a, b in zip(_objectives(q), op)) and _objectives(q) != op for q in pts)
        if not dominated:
            front.append(p)
    return sorted(front, key=lambda p: p.bytes)


def percent(v) -> str:
    return "-" if v is None else f"{100 * v:.1f}%"


def _layers(p) -> str:
    if p.anchor:
        return f"layout {p.anchor}"
    return ", ".join(f"{k}={v}" for k, v in sorted(p.layers.items())) or "(base)"


def format_table(result) -> str:
    """Every point, in the order measured: bytes, accuracy, answers as the reference, logits SQNR, budget, front."""
    rows = [["point", "bytes", "accuracy", "drop", "as reference", "logits SQNR", "budget", "front", "raised"]]
    for p in result.points:
        mark = "*" if result.winner is not None and p is result.winner else ""
        rows.append([p.label + mark, f"{p.bytes:,}", percent(p.accuracy), percent(p.accuracy_drop),
                     percent(p.answers_as_reference),
                     "-" if p.logits_sqnr_db is None else f"{p.logits_sqnr_db:.2f} dB",
                     "within" if p.within_budget else "misses", "yes" if p.on_front else "",
                     _layers(p)])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i in (0, 6, 7, 8) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             .rstrip() for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    head = [f"vlmrun tune: base {result.base}", f"budget: {result.budget.describe()}",
            f"{len(result.points)} points ({result.built} built by this run) on {result.items} items,"
            f" {result.wall_s:.0f} s"]
    if result.winner is not None:
        foot = f"winner: {result.winner.label} ({result.winner.bytes:,} bytes): {_layers(result.winner)}"
    else:
        best = max(result.points, key=lambda p: (p.answers_as_reference or 0, p.logits_sqnr_db or -1e9))
        foot = (f"no build met the budget ({'; '.join(best.misses)} at best, {best.label});"
                " raise --max-candidates or loosen the budget")
    return "\n".join([*head, "", *lines, "", foot])


def write_json(result, path: str | os.PathLike) -> Path:
    path = Path(path)
    path.write_text(json.dumps(result.to_json(), indent=2) + "\n")
    return path


def layout_text(point, base: str) -> str:
    """The layout TOML of a point: every stage's backend and options, as measured."""
    from ..layouts import layout_snippet

    head = [f"# vlmrun tune: {point.label} of base {base}", f"# {point.bytes:,} bytes on the device;"
            f" accuracy {percent(point.accuracy)}, answers as reference {percent(point.answers_as_reference)},"
            f" logits SQNR {'-' if point.logits_sqnr_db is None else f'{point.logits_sqnr_db:.2f} dB'}"
            f" on {point.items} items", f'name = "tuned-{point.label}"', ""]
    body = []
    for stage in STAGES:
        entry = dict(point.layout[stage])
        backend = entry.pop("backend")
        body.append(layout_snippet(stage, backend, {k: v for k, v in entry.items() if v is not None}))
    return "\n".join(head) + "\n\n".join(body) + "\n"


def write_toml(point, path: str | os.PathLike, base: str = "") -> Path:
    """The layout of ``point`` as a TOML file for ``vlmrun --layout-file``, ``vlmrun bundle`` and ``vlmrun eval``."""
    from ..atomic import write_text_atomic

    path = Path(path)
    if path.parent and not path.parent.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, layout_text(point, base))
    return path


def _plot(result) -> str:
    from ..plots import png_base64, pyplot

    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    pts = [p for p in result.points if p.logits_sqnr_db is not None]
    ax.scatter([p.bytes / 1e6 for p in pts], [p.logits_sqnr_db for p in pts],
               c=["tab:green" if p.within_budget else "tab:red" for p in pts], s=30, zorder=3)
    front = [p for p in result.front if p.logits_sqnr_db is not None]
    ax.plot([p.bytes / 1e6 for p in front], [p.logits_sqnr_db for p in front], "-", color="tab:blue",
            label="Pareto front", zorder=2)
    for p in pts:
        ax.annotate(p.label, (p.bytes / 1e6, p.logits_sqnr_db), fontsize=7, xytext=(3, 3),
                    textcoords="offset points")
    if result.winner is not None and result.winner.logits_sqnr_db is not None:
        ax.scatter([result.winner.bytes / 1e6], [result.winner.logits_sqnr_db], marker="*", s=220,
                   color="gold", edgecolor="black", zorder=4, label="winner")
    if result.budget.min_logits_sqnr is not None:
        ax.axhline(result.budget.min_logits_sqnr, color="gray", ls="--", lw=1, label="budget (logits SQNR)")
    ax.set_xlabel("bytes on the device (MB)")
    ax.set_ylabel("logits SQNR, median (dB)")
    ax.set_title("vlmrun tune: green within the budget, red outside")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return png_base64(fig)


def write_html(result, directory: str | os.PathLike) -> Path:
    """DIR/index.html (the table, the plot embedded), DIR/front.png (the plot) and DIR/tune.json."""
    import base64
    import html

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    esc = html.escape
    png = _plot(result)
    (d / "front.png").write_bytes(base64.b64decode(png))
    rows = "".join(
        f"<tr class='{'ok' if p.within_budget else 'bad'}'><td>{esc(p.label)}"
        f"{' &#9733;' if result.winner is not None and p is result.winner else ''}</td><td>{p.bytes:,}</td>"
        f"<td>{percent(p.accuracy)}</td><td>{percent(p.accuracy_drop)}</td><td>{percent(p.answers_as_reference)}</td>"
        f"<td>{'-' if p.logits_sqnr_db is None else f'{p.logits_sqnr_db:.2f}'}</td>"
        f"<td>{'yes' if p.on_front else ''}</td><td>{esc(_layers(p))}</td><td>{esc('; '.join(p.misses))}</td></tr>"
        for p in result.points)
    winner = (f"<p>Winner: <b>{esc(result.winner.label)}</b>, {result.winner.bytes:,} bytes:"
              f" <code>{esc(_layers(result.winner))}</code></p><pre>{esc(layout_text(result.winner, result.base))}</pre>"
              if result.winner is not None else "<p>No build met the budget.</p>")
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>vlmrun tune: {esc(result.base)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 75em; }}
table {{ border-collapse: collapse; font-size: 0.9em; margin-bottom: 1em; }}
td, th {{ border: 1px solid #ccc; padding: 3px 6px; }}
tr.bad {{ background: #ffebee; }} tr.ok {{ background: #f1f8e9; }}
pre {{ background: #f5f5f5; padding: 1em; overflow: auto; font-size: 0.85em; }}
</style></head><body>
<h1>vlmrun tune</h1>
<p>base: <code>{esc(result.base)}</code><br>budget: {esc(result.budget.describe())}<br>
{len(result.points)} points ({result.built} built by this run) on {result.items} items of
<code>{esc(result.dataset)}</code>, {result.wall_s:.0f} s</p>
<img alt="bytes against logits SQNR" src="data:image/png;base64,{png}">
<h2>Points</h2>
<table><tr><th>point</th><th>bytes</th><th>accuracy</th><th>drop</th><th>answers as reference</th>
<th>logits SQNR dB</th><th>front</th><th>raised</th><th>misses</th></tr>{rows}</table>
{winner}
<h2>Raw figures</h2><p><a href="tune.json">tune.json</a></p>
</body></html>
"""
    write_json(result, d / "tune.json")
    (d / "index.html").write_text(page)
    return d / "index.html"
