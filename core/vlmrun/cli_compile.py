"""``vlmrun compile``: compile stages for a backend into the artifact store (no image, no prompt).

    vlmrun compile --backend qnn_htp --stage vision --precision int8 [--calibration-images DIR] [--soc sm8750]
    vlmrun compile --layout all-npu                      # every stage of a layout
"""

from __future__ import annotations

import json
from pathlib import Path

import click

from .cli_options import model_options
from .errors import UsageError
from .stages import STAGES


def _artifacts_of(handle) -> list:
    arts = list(getattr(handle, "artifacts", None) or [])
    art = getattr(handle, "artifact", None)
    if art is not None and art not in arts:
        arts.append(art)
    return arts


@click.command("compile")
@click.option("--backend", metavar="PLUGIN", help="Backend to compile for (e.g. qnn_htp); default: the layout's.")
@click.option("--stage", "stages", multiple=True, type=click.Choice([*STAGES, "all"]),
              help="Stage to compile (repeatable, or 'all'). Default: all stages.")
@click.option("--layout", default=None, help="Layout preset whose stage backends and options to use (e.g. all-npu).")
@click.option("--layout-file", type=click.Path(path_type=Path), help="TOML file with a layout.")
@click.option("--precision", type=click.Choice(["fp16", "int8", "a16w8"]), help="Numeric precision. [default: fp16]")
@click.option("--quantize", type=click.Choice(["none", "z8", "q4"]),
              help="genie_cpu model-bin quantization (the SDK composer's Z8 / Q4). [default: none]")
@click.option("--calibration-images", type=click.Path(path_type=Path),
              help="Folder of images to calibrate int8 (default: random data, labelled so in the manifest).")
@click.option("--soc", help="Target SoC, e.g. sm8750 (default), sm8650, sm8550.")
@click.option("--compiler", metavar="PLUGIN",
              help="Plugin that compiles for --backend, e.g. qaihub (Qualcomm AI Hub). [default: the backend itself]")
@click.option("--device", "hub_device", metavar="NAME",
              help='Remote compiler\'s device, e.g. "Snapdragon 8 Elite QRD" for qaihub. [default: from --soc]')
@click.option("--context-length", type=click.IntRange(8), help="Decoder context length to compile for.")
@model_options
@click.option("--rebuild", is_flag=True, help="Compile again even if the store has the artifacts.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object describing the artifacts.")
@click.option("--debug", is_flag=True, hidden=True)
def compile_command(backend, stages, layout, layout_file, precision, quantize, calibration_images, soc, compiler,
                    hub_device, context_length, model_dir, image_size, cache_dir, rebuild, as_json, debug):
    """Compile stages into a backend's own format (e.g. QNN context binaries) and store them with a manifest."""
    from . import layouts as layouts_mod
    from .pipeline import Pipeline
    from .progress import step

    chosen = tuple(STAGES if (not stages or "all" in stages) else dict.fromkeys(stages))
    if backend is None and layout is None and layout_file is None:
        raise UsageError("say what to compile for: --backend PLUGIN (e.g. qnn_htp) or --layout NAME (e.g. all-npu)")
    if calibration_images is not None and not Path(calibration_images).is_dir():
        raise UsageError(f"--calibration-images {calibration_images} is not a directory")
    if calibration_images is not None and precision in (None, "fp16"):
        raise UsageError("--calibration-images is for int8 precisions; add --precision int8")
    overrides = {s: backend for s in chosen} if backend else None
    base = layouts_mod.resolve(layout, layout_file, overrides)
    extra = {"precision": precision, "soc": soc, "quantize": quantize, "compiler": compiler, "hub_device": hub_device,
             "calibration_images": str(calibration_images) if calibration_images else None}
    staged = {}
    for s in STAGES:
        opts = dict(base.stages[s].options)
        if s in chosen:
            opts.update({k: v for k, v in extra.items() if v is not None})
            if s == "decoder" and context_length:
                opts["context_length"] = context_length
        staged[s] = layouts_mod.StageAssignment(base.stages[s].backend, opts)
    lay = layouts_mod.Layout(base.name, staged)
    pipe = Pipeline.build(model_dir, lay, store=cache_dir, rebuild=rebuild, image_size=image_size,
                          stages=chosen, progress=step)
    report = []
    for s in chosen:
        for art in _artifacts_of(pipe.handles[s]):
            m = art.manifest
            report.append({
                "stage": s, "backend": lay.backend(s), "path": str(art.path),
                "built": art.path.name in pipe.store.builds,
                **{k: m[k] for k in ("precision", "quantize", "soc", "arch", "qnn_version", "graphs", "files", "binary_bytes",
                                     "compile_s") if k in m},
            })
    if as_json:
        click.echo(json.dumps({"store": str(pipe.store.root), "artifacts": report}, indent=2))
        return
    for r in report:
        what = "built " if r["built"] else "reused"
        detail = " ".join(f"{k}={r[k]}" for k in ("precision", "quantize", "soc", "arch", "qnn_version") if k in r)
        click.echo(f"{what} {r['stage']:<9} {r['backend']:<14} {detail} -> {r['path']}")
    if not report:
        click.echo(f"nothing to compile: {', '.join(chosen)} on {lay.describe()} keep no compiled artifacts")
    click.echo(f"artifact store: {pipe.store.root}")
