"""A location (`vlmrun.diff.locate`) as the terminal table, the per-layer plot and the report's HTML section."""

from __future__ import annotations

import math

import numpy as np

from .locate import Location
from .metrics import SQNR_CAP_DB, fmt, fmt_shape


# -- the location as text, a plot and a report section ----------------------------------------------------------------------------------------------------------
def format_location(loc: Location) -> str:
    """The terminal table of a location: one row per layer, the curve as a bar, then the verdict."""
    lines = ["", f"locate {loc.stage}: layer by layer, both sides on the reference side's inputs"
             f" ({loc.reference} vs {loc.device}" + (f", {loc.rows} teacher-forced rows" if loc.rows else "") + ")"]
    # own: the layer's own error (same input on both sides); at_out: the stage output with only that error
    cols = ("layer", "shape", "sqnr_dB", "cosine", "own_dB", "at_out_dB", "curve", "status")
    rows = []
    first, drop = loc.first_failing, loc.largest_drop
    for p in loc.points:
        m = p.metrics
        s = m.get("sqnr_db")
        bar = "" if s is None or not math.isfinite(s) else "#" * max(0, min(40, int(round(s / 5))))
        if p.note:
            status = "FAIL " + p.note
        elif p.passed:
            status = "ok"
        else:
            status = "FAIL " + ", ".join(c.describe() for c in p.checks if not c.ok)
        mark = []
        if p is first:
            mark.append("<- first to cross")
        if p is drop:
            mark.append("<- largest drop")
        if p.part_output is not None:  # its error is the whole part's: no own error, never the largest drop
            mark.append(f"<- part {p.part_output}'s output (its layers not probed)")
        cos = m.get("cosine")
        own = None if p.own is None else p.own.get("sqnr_db")
        out = None if p.impact is None else p.impact.get("sqnr_db")
        rows.append((p.name, fmt_shape(p.shape), "-" if s is None else f"{s:.1f}",
                     "-" if cos is None else f"{cos:.6f}", "-" if own is None else f"{own:.1f}",
                     "-" if out is None else f"{out:.1f}", bar, status + ("  " + " ".join(mark) if mark else "")))
    if loc.parts:
        lines.append(f"parts ({len(loc.parts)}), at their boundaries:")
        for part in loc.parts:
            lo, hi = part["layers"]
            mark = "  <- probed inside (" + loc.probed_why + ")" if part["part"] == loc.probed_part else ""
            lines.append(f"  part {part['part']}: layers {lo}-{hi - 1} -> {part['boundary']}:"
                         f" {fmt(part['sqnr_db'])} dB, cosine {fmt(part['cosine'])},"
                         f" {'ok' if part['passed'] else 'FAIL'}{mark}")
        if loc.probed_part is None and loc.probed_why:
            lines.append(f"  no part probed inside: {loc.probed_why}")
    widths = [max(len(str(r[i])) for r in [cols, *rows]) for i in range(len(cols) - 1)]
    for r in [cols, *rows]:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) + "  " + str(r[-1]))
    for note in loc.notes:
        lines.append(f"note: {note}")
    limits = ", ".join(f"{k} >= {fmt(v)}" for k, v in loc.thresholds.items()) or "none"
    if first is None:
        lines.append(f"located: nothing (every layer of {loc.stage} is within {limits})")
    else:
        why = first.note or ", ".join(c.describe() for c in first.checks if not c.ok)
        lines.append(f"located: {first.name} is the first layer of {loc.stage} to cross its thresholds ({why})")
    if drop is not None:
        k = loc.points.index(drop)
        before = SQNR_CAP_DB if k == 0 else loc.points[k - 1].metrics.get("sqnr_db")
        if loc.isolated:
            at_out = (drop.impact or drop.own).get("sqnr_db")
            lines.append(f"largest drop: {drop.name} (its own error costs the stage output most: {fmt(at_out)} dB SQNR"
                         f" at {loc.points[-1].name} with only that error; the layer alone:"
                         f" {fmt(drop.own.get('sqnr_db'))} dB; {fmt(before)} -> {fmt(drop.metrics.get('sqnr_db'))} dB"
                         " overall)")
        else:
            lines.append(f"largest drop: {drop.name} ({fmt(before)} -> {fmt(drop.metrics.get('sqnr_db'))} dB SQNR;"
                         f" it adds {drop.noise_added:.2e} of relative noise power)")
    if loc.what_if is not None:
        lines.extend(loc.what_if.lines())
    return "\n".join(lines)


def plot_location(loc: Location, plt) -> object:
    """The per-layer curve (SQNR and cosine) as a matplotlib figure."""
    names = [p.name for p in loc.points]
    x = np.arange(len(names))
    sqnr = [float(np.nan_to_num(p.metrics.get("sqnr_db", np.nan), nan=-SQNR_CAP_DB)) for p in loc.points]
    cos = [float(np.nan_to_num(p.metrics.get("cosine", np.nan), nan=0.0)) for p in loc.points]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 4.8), sharex=True)
    a1.plot(x, sqnr, "o-", color="#1565c0", label="SQNR")
    if loc.isolated:
        own = [float(np.nan_to_num(p.own.get("sqnr_db", np.nan), nan=-SQNR_CAP_DB)) if p.own else np.nan
               for p in loc.points]
        a1.plot(x, own, "^--", color="#2e7d32", alpha=0.8, label="own error (same input)")
        out = [float(np.nan_to_num((p.impact or {}).get("sqnr_db", np.nan), nan=-SQNR_CAP_DB)) for p in loc.points]
        a1.plot(x, out, "v:", color="#ef6c00", alpha=0.8, label="stage output, this layer's error only")
    a2.plot(x, [max(1.0 - c, 1e-12) for c in cos], "s-", color="#6a1b9a")
    if "sqnr_db" in loc.thresholds:
        a1.axhline(loc.thresholds["sqnr_db"], color="black", linestyle="dashed", linewidth=1)
    if "cosine" in loc.thresholds:
        a2.axhline(max(1.0 - loc.thresholds["cosine"], 1e-12), color="black", linestyle="dashed", linewidth=1)
    first, drop = loc.first_failing, loc.largest_drop
    for p, color, label in ((first, "#c62828", "first to cross"), (drop, "#ef6c00", "largest drop")):
        if p is not None:
            k = loc.points.index(p)
            a1.axvline(k, color=color, alpha=0.5, label=f"{label}: {p.name}")
    a1.legend(loc="best", fontsize=7, framealpha=0.6)
    a1.set_ylabel("SQNR (dB)")
    a1.set_title(f"{loc.stage}, layer by layer ({loc.reference} vs {loc.device}; dashes: thresholds)")
    a2.set_yscale("log")
    a2.set_ylabel("1 - cosine")
    a2.set_xticks(x, names, rotation=30, ha="right", fontsize=8)
    return fig


def location_html(loc: Location, png: str) -> str:
    """The report's section for a location (``png``: the curve, base64)."""
    import html

    esc = html.escape
    first, drop = loc.first_failing, loc.largest_drop
    verdict = (f"<p class='fail'>first layer to cross the thresholds: <b>{esc(first.name)}</b></p>" if first else
               "<p class='pass'>located: nothing (every layer is within its thresholds)</p>")
    if drop is not None:
        verdict += f"<p>largest drop (relative noise power added): <b>{esc(drop.name)}</b></p>"
    rows = []
    for p in loc.points:
        m = p.metrics
        rows.append(f"<tr class='{'ok' if p.passed else 'bad'}'><td>{esc(p.name)}</td><td>{fmt_shape(p.shape)}</td>"
                    f"<td>{fmt(m.get('sqnr_db'))}</td><td>{fmt(m.get('cosine'))}</td>"
                    f"<td>{fmt(None if p.own is None else p.own.get('sqnr_db'))}</td>"
                    f"<td>{fmt(None if p.impact is None else p.impact.get('sqnr_db'))}</td>"
                    f"<td>{p.noise_added:.2e}</td><td>{esc(p.note)}</td></tr>")
    if loc.parts:
        prow = "".join(
            f"<tr class='{'ok' if p['passed'] else 'bad'}'><td>{p['part']}</td><td>{p['layers'][0]}-"
            f"{p['layers'][1] - 1}</td><td>{esc(p['boundary'])}</td><td>{fmt(p['sqnr_db'])}</td>"
            f"<td>{fmt(p['cosine'])}</td><td>{'probed inside: ' + esc(loc.probed_why) if p['part'] == loc.probed_part else ''}"
            "</td></tr>" for p in loc.parts)
        verdict += ("<p>decoder parts at their boundaries first, then the layers inside the worst part:</p><table>"
                    "<tr><th>part</th><th>layers</th><th>boundary</th><th>SQNR dB</th><th>cosine</th><th></th></tr>"
                    + prow + "</table>")
    extra = ""
    if loc.what_if is not None:
        w = loc.what_if
        what = "stayed in float" if w.precision == "fp" else f"were quantized at {w.precision}"
        extra = (f"<h3>What if {esc(', '.join(w.layers))} {what}?</h3><pre>"
                 + esc("\n".join(w.lines()[1:])) + "</pre>")
    return (f"<h2>Layer by layer: {esc(loc.stage)} (--locate)</h2>{verdict}"
            f"<img alt='per-layer SQNR and cosine' src='data:image/png;base64,{png}'>"
            "<table><tr><th>layer</th><th>shape</th><th>SQNR dB</th><th>cosine</th><th>own SQNR dB</th><th>at output dB</th>"
            "<th>noise added</th><th>note</th></tr>" + "".join(rows) + "</table>" + extra)
