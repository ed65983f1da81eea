"""``vlmrun compile``: compile stages for a backend into the artifact store (no image, no prompt).

    vlmrun compile --backend PLUGIN --stage vision [--precision int8 ...]   # flags the backend declares
    vlmrun compile --layout all-npu                                         # every stage of a layout
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from .cli_options import layout_overrides, model_options, registry, stage_option_flags
from .errors import UsageError
from .handles import artifacts_of
from .stages import STAGES

# manifest fields too bulky for the one-line summary (the JSON has the scalar ones; the manifest has all)
_SUMMARY_SKIP = {"created", "compile_s", "stage", "source_form", "fallback"}


def _summary(manifest: dict) -> dict:
    """The manifest's scalar facts (precision, SoC, runtime versions, ...), whatever the backend records."""
    return {k: v for k, v in sorted(manifest.items())
            if isinstance(v, (str, int, float, bool)) and not isinstance(v, dict) and k not in _SUMMARY_SKIP}


@click.command("compile")
@click.option("--backend", metavar="PLUGIN", help="Backend to compile for; default: the layout's.")
@click.option("--stage", "stages", multiple=True, type=click.Choice([*STAGES, "all"]),
              help="Stage to compile (repeatable, or 'all'). Default: all stages.")
@click.option("--layout", default=None, metavar="BASE[,STAGE=PLUGIN][,STAGE.KEY=V]",
              help="Layout whose stage backends and options to use (e.g. all-npu, or all-npu,decoder.context_length=256).")
@click.option("--layout-file", type=click.Path(path_type=Path), help="TOML file with a layout.")
@stage_option_flags
@model_options
@click.option("--rebuild", is_flag=True, help="Compile again even if the store has the artifacts.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object describing the artifacts.")
@click.option("--debug", is_flag=True, hidden=True)
def compile_command(backend, stages, layout, layout_file, model_dir, image_size, cache_dir, rebuild, as_json, debug,
                    **flags):
    """Compile stages into a backend's own format (e.g. context binaries) and store them with a manifest.

    Option flags (--precision, --soc, ...) apply to the chosen stages whose backend or compiler declares them;
    `vlmrun plugins --options` lists every backend's options.
    """
    from . import layouts as layouts_mod
    from .pipeline import Pipeline
    from .progress import step

    chosen = tuple(STAGES if (not stages or "all" in stages) else dict.fromkeys(stages))
    if backend is None and layout is None and layout_file is None:
        raise UsageError("say what to compile for: --backend PLUGIN or --layout NAME (e.g. all-npu)")
    overrides = {s: backend for s in chosen} if backend else None
    base = layouts_mod.resolve(layout, layout_file, overrides)
    lay = layouts_mod.resolve(layout, layout_file, overrides, layout_overrides(flags, base, chosen))
    pipe = Pipeline.build(model_dir, lay, store=cache_dir, registry=registry(), rebuild=rebuild,
                          image_size=image_size, stages=chosen, progress=step)
    report = []
    for s in chosen:
        for art in artifacts_of(pipe.handles[s]):
            m = art.manifest
            report.append({
                "stage": s, "backend": lay.backend(s), "path": str(art.path),
                "built": art.path.name in pipe.store.builds,
                **_summary(m),
                **{k: m[k] for k in ("graphs", "files", "binary_bytes", "compile_s") if k in m},
            })
    if as_json:
        click.echo(json.dumps({"store": str(pipe.store.root), "artifacts": report}, indent=2, default=str))
        return
    for r, art_summary in ((r, _summary(r)) for r in report):
        what = "built " if r["built"] else "reused"
        detail = " ".join(f"{k}={v}" for k, v in art_summary.items() if k not in ("backend", "path", "built"))
        click.echo(f"{what} {r['stage']:<9} {r['backend']:<14} {detail} -> {r['path']}")
    if not report:
        click.echo(f"nothing to compile: {', '.join(chosen)} on {lay.describe()} keep no compiled artifacts")
    click.echo(f"artifact store: {pipe.store.root}")
