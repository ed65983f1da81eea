"""``vlmrun store list|verify|prune``: the artifact store from the command line (registered in `vlmrun.cli`
as ``store_group``). The work is done by `vlmrun.store.ArtifactStore`."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import click

from . import atomic
from .errors import UsageError

_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration(text: str, option: str) -> float:
    """``"7d"``, ``"12h"``, ``"30m"``, ``"90s"``, ``"2w"`` -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smhdw])\s*", text or "")
    if not m:
        raise UsageError(f"{option} {text!r} is not a duration; expected a number and a unit, e.g. 7d, 12h, 30m")
    return float(m.group(1)) * _UNITS[m.group(2)]


def human_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"  # pragma: no cover


def _when(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(t))


def _store(cache_dir):
    from .store import ArtifactStore

    return ArtifactStore(cache_dir)


def _cache_dir_option(f):
    return click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), envvar="VLMRUN_CACHE_DIR",
                        help="Artifact store location. [env: VLMRUN_CACHE_DIR; default ~/.cache/vlmrun]")(f)


def _common(f):
    f = click.option("--debug", is_flag=True, hidden=True)(f)
    f = click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")(f)
    return _cache_dir_option(f)


@click.group("store", context_settings={"help_option_names": ["-h", "--help"]})
def store_group():
    """List, verify and prune the artifact store (exports, compiled binaries, converted checkpoints)."""


@store_group.command("list")
@_common
def list_command(cache_dir, as_json, debug):
    """Every artifact: model, stage, backend, kind, precision, size, created, last used."""
    store = _store(cache_dir)
    entries = store.entries()
    temps = store.temp_dirs()
    states = [(d, atomic.tree_size(d)) for d in store.unfinished_states()]
    if as_json:
        click.echo(json.dumps({"store": str(store.root), "artifacts": [e.to_json() for e in entries],
                               "temp_dirs": [str(d) for d in temps],
                               "unfinished": [{"path": str(d), "size": size} for d, size in states]}, indent=2))
        return
    if not entries:
        click.echo(f"no artifacts in {store.root}")
    else:
        rows = [("MODEL", "STAGE", "BACKEND", "KIND", "PRECISION", "SIZE", "CREATED", "LAST USED", "NAME")]
        for e in entries:
            model = e.model_name or e.model or "-"
            rows.append((model if len(model) <= 40 else "..." + model[-37:], e.stage or "?", e.backend or "-",
                         e.kind or "-", e.precision or "-", human_size(e.size), _when(e.created), _when(e.last_used),
                         e.name + ("" if e.manifest is not None else " (incomplete)")))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        for r in rows:
            click.echo("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
        total = sum(e.size for e in entries)
        click.echo(f"{len(entries)} artifact{'s' * (len(entries) != 1)}, {human_size(total)} in {store.root}")
    if temps:
        click.echo(f"{len(temps)} temporary build director{'ies' if len(temps) != 1 else 'y'} (in progress, or left"
                   " by killed runs: `vlmrun store prune` removes those whose builder is gone)")
    if states:
        click.echo(f"{len(states)} stopped build{'s' * (len(states) != 1)} kept {human_size(sum(s for _, s in states))}"
                   " to resume from (the same command takes it; `vlmrun store prune --all` removes it): "
                   + ", ".join(d.name for d, _ in states))


@store_group.command("verify")
@_common
def verify_command(cache_dir, as_json, debug):
    """Re-hash every artifact's files against its manifest; exit 1 if any is corrupt."""
    store = _store(cache_dir)
    verdicts = store.verify()
    bad = [v for v in verdicts if not v.ok]
    if as_json:
        click.echo(json.dumps({"store": str(store.root), "artifacts": [
            {"name": v.entry.name, "path": str(v.entry.path), "status": "ok" if v.ok else "corrupt",
             "problems": list(v.problems)} for v in verdicts]}, indent=2))
    else:
        for v in verdicts:
            click.echo(f"ok       {v.entry.name}" if v.ok else f"CORRUPT  {v.entry.name}: {'; '.join(v.problems)}")
        click.echo(f"{len(verdicts) - len(bad)} ok, {len(bad)} corrupt in {store.root}"
                   + (" (a corrupt artifact is rebuilt when next needed, or remove it with `vlmrun store prune`)"
                      if bad else ""))
    if bad:
        raise click.exceptions.Exit(1)


@store_group.command("prune")
@click.option("--stage", "stages", multiple=True, metavar="STAGE", help="Only artifacts of this stage (repeatable).")
@click.option("--backend", "backends", multiple=True, metavar="BACKEND",
              help="Only artifacts for this backend, e.g. onnx, ort_reference (repeatable).")
@click.option("--older-than", metavar="AGE", help="Only artifacts created more than AGE ago (e.g. 7d, 12h).")
@click.option("--unused-for", metavar="AGE", help="Only artifacts not used for AGE (e.g. 30d).")
@click.option("--all", "everything", is_flag=True, help="Every artifact (needed when no other filter is given).")
@click.option("--dry-run", is_flag=True, help="Show what would be removed, remove nothing.")
@_common
def prune_command(stages, backends, older_than, unused_for, everything, dry_run, cache_dir, as_json, debug):
    """Remove the artifacts matching every filter given, and temporary directories of killed builds (with --all,
    also what stopped builds kept to resume from)."""
    older_than_s = parse_duration(older_than, "--older-than") if older_than is not None else None
    unused_for_s = parse_duration(unused_for, "--unused-for") if unused_for is not None else None
    if not (stages or backends or older_than_s is not None or unused_for_s is not None or everything):
        raise UsageError("prune needs a filter (--stage, --backend, --older-than, --unused-for) or --all")
    store = _store(cache_dir)
    result = store.prune(stages=stages, backends=backends, older_than_s=older_than_s, unused_for_s=unused_for_s,
                         everything=everything, dry_run=dry_run)
    if as_json:
        click.echo(json.dumps({
            "store": str(store.root), "dry_run": dry_run,
            "removed": [e.to_json() for e in result.removed],
            "temp_dirs": [{"path": str(d), "size": size} for d, size in result.temp_dirs],
            "unfinished": [{"path": str(d), "size": size} for d, size in result.states],
            "freed": result.freed,
        }, indent=2))
        return
    verb = "would remove" if dry_run else "removed"
    for e in result.removed:
        click.echo(f"{verb} {e.name} ({human_size(e.size)})")
    for d, size in result.temp_dirs:
        click.echo(f"{verb} {d.name} ({human_size(size)}, left by a killed build)")
    for d, size in result.states:
        click.echo(f"{verb} state/{d.name} ({human_size(size)}, kept by a stopped build to resume from)")
    n = len(result.removed)
    click.echo(f"{'would free' if dry_run else 'freed'} {human_size(result.freed)} ({result.freed} bytes):"
               f" {n} artifact{'s' * (n != 1)}, {len(result.temp_dirs)} temporary"
               f" director{'ies' if len(result.temp_dirs) != 1 else 'y'}")
