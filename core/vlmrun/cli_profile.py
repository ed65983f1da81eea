"""``vlmrun profile``: run one stage on a (hosted) device and print its latency figures.

    vlmrun profile --backend PLUGIN --stage vision [--device NAME ...] [--json]

The stage is compiled (cached in the artifact store), run once on inputs made from the demo image (vision),
a prompt (embed) or seeded random features (projector), and the figures the backend's handle reports as
``last_profile`` (`vlmrun.handles.StageHandle`) are printed, e.g. a hosted device's inference time,
load times and peak memory.
"""

from __future__ import annotations

import json
import time

import click
import numpy as np

from .cli_options import layout_overrides, model_options, registry, stage_option_flags
from .handles import profile_of

PROFILE_STAGES = ("vision", "projector", "embed")


def _inputs(pipe, stage: str) -> dict:
    model = pipe.model
    if stage == "vision":
        from .demo_image import demo_image
        from .preprocess import preprocess_image

        return {"pixel_values": preprocess_image(demo_image(), model.image_processor_config)}
    if stage == "projector":
        d = model.dims()
        rng = np.random.default_rng(0)
        return {"image_features": rng.standard_normal((1, d["N"], d["F"])).astype(np.float32)}
    ids = model.tokenizer.encode("Describe the image in one sentence.").ids
    return {"input_ids": np.asarray([ids], dtype=np.int64)}


@click.command("profile")
@click.option("--backend", required=True, metavar="PLUGIN", help="Backend to profile on.")
@click.option("--stage", type=click.Choice(PROFILE_STAGES), default="vision", show_default=True)
@stage_option_flags
@model_options
@click.option("--rebuild", is_flag=True, help="Compile again even if the store has the artifact.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
@click.option("--debug", is_flag=True, hidden=True)
def profile_command(backend, stage, model_dir, image_size, cache_dir, rebuild, as_json, debug, **flags):
    """Run one stage once on a backend's device and print its latency figures."""
    from . import layouts as layouts_mod
    from .pipeline import Pipeline
    from .progress import step

    base = layouts_mod.resolve("reference", None, {stage: backend})
    lay = layouts_mod.resolve("reference", None, {stage: backend}, layout_overrides(flags, base, (stage,)))
    pipe = Pipeline.build(model_dir, lay, store=cache_dir, registry=registry(), rebuild=rebuild,
                          image_size=image_size, stages=(stage,), progress=step)
    inputs = _inputs(pipe, stage)
    t0 = time.perf_counter()
    out = pipe.run_stage(stage, inputs)
    wall_ms = (time.perf_counter() - t0) * 1e3
    figures = profile_of(pipe.handles[stage])
    report = {
        "backend": backend, "stage": stage, "device": figures.pop("device", flags.get("opt_device")),
        "outputs": {k: list(np.shape(v)) for k, v in out.items()},
        "wall_ms": round(wall_ms, 1), "figures": figures,
    }
    if not figures and not as_json:
        click.echo(f"note: backend '{backend}' reports no device figures; only the wall time is known", err=True)
    if as_json:
        click.echo(json.dumps(report, indent=2, default=str))
        return
    click.echo(f"{stage} on {backend} ({report['device'] or 'default device'}): wall {wall_ms:.1f} ms")
    for k, v in figures.items():
        if k in ("url", "job_id"):
            click.echo(f"  {k}: {v}")
        elif isinstance(v, (int, float)) and k.endswith("_time"):
            click.echo(f"  {k}: {v / 1000:.3f} ms")
        elif v is not None:
            click.echo(f"  {k}: {v}")
