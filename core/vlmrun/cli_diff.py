"""``vlmrun diff``: the command over `vlmrun.diff` (registered in `vlmrun.cli` as ``diff_command``)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .cli_options import Destination, model_options
from .errors import VlmrunError
from .stages import STAGES


def _device_options(f):
    for stage in reversed(STAGES):
        f = click.option(f"--device-{stage}", f"device_{stage}", metavar="PLUGIN",
                         help=f"Backend plugin for the device side's {stage} stage (overrides --device).")(f)
    return f


@click.command("diff", context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--reference", default="reference", show_default=True, metavar="LAYOUT|torch",
              help="The side to trust: a layout (preset or TOML file), or `torch` for torch fp32 eager.")
@click.option("--device", default="reference", show_default=True, metavar="LAYOUT|torch",
              help="The side under test: a layout (a preset or TOML file, with optional inline overrides:"
                   " all-npu,decoder.context_length=256), or `torch`.")
@_device_options
@click.option("--image", type=click.Path(path_type=Path), help="Image file. [default: the built-in demo image]")
@click.option("--prompt", help='The question. [default: "Describe the image."]')
@model_options
@click.option("--max-new-tokens", type=click.IntRange(1), default=None,
              help="Tokens to generate on each side. [default: 32, or what a --from reference used]")
@click.option("--ignore-eos", is_flag=True, help="Generate all --max-new-tokens even past end-of-sequence.")
@click.option("--precision", default=None, metavar="PRECISION",
              help="Which default thresholds to use: fp32 or a precision a plugin declares (vlmrun plugins lists"
                   " them). [default: the most lenient of the device layout's stage precisions, else fp32]")
@click.option("--threshold", "threshold_specs", multiple=True, metavar="STAGE.METRIC=VALUE",
              help="Override one threshold, e.g. projector.sqnr_db=25 or decoder.kl_mean=none (repeatable).")
@click.option("--thresholds-file", type=click.Path(path_type=Path),
              help="TOML thresholds: optional precision = \"fp16\", then tables like [projector] sqnr_db = 25.")
@click.option("--from", "from_dirs", multiple=True, type=click.Path(path_type=Path), metavar="DIR",
              help="Use a saved capture instead of running a side: once = a --save DIR (both sides) or the"
                   " reference (the device runs live, teacher-forced on its tokens); twice = reference, device.")
@click.option("--save", "save_dir", type=Destination(), metavar="DIR",
              help="Save both captures (npz) to DIR/reference and DIR/device, and DIR/metrics.json.")
@click.option("--report", "report_dir", type=Destination(), metavar="DIR",
              help="Write DIR/index.html (plots embedded) and DIR/metrics.json.")
@click.option("--locate", "locate", is_flag=False, flag_value="auto", default=None, metavar="[auto|STAGE]",
              help="Look inside a stage layer by layer (probe variants on both sides, the same inputs) and name the"
                   " first layer that crosses the thresholds: auto (also the bare flag) = the likely culprit;"
                   " or vision, projector, decoder.")
@click.option("--what-if", "what_if", is_flag=False, flag_value="auto", default=None, metavar="[LAYER,...]",
              help="With --locate on a quantized device stage: rebuild it with the located layer (or the LAYERs"
                   " named) kept out of quantization and report what that recovers, with the layout lines.")
@click.option("--what-if-precision", "what_if_precision", default=None, metavar="fp|PRECISION",
              help="With --what-if: what the layer gets, through the stage option layer_precision: fp (LAYER=fp16, kept"
                   " out of quantization) or a per-layer precision the stage's backend offers above its own (its"
                   " layer_precisions hook; --what-if names them). [default: fp]")
@click.option("--what-if-eval", "what_if_eval", type=click.IntRange(1), default=None, metavar="N",
              help="With --what-if: also run vlmrun eval on N items of the held-out set for the device layout before"
                   " and after the fix, and the reference, and report their accuracy (off by default: it runs the"
                   " layouts over N items).")
@click.option("--json", "as_json", is_flag=True, help="Print the metrics as one JSON object instead of a table.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
@click.pass_context
def diff_command(ctx, reference, device, image, prompt, model_dir, image_size, cache_dir, max_new_tokens,
                 ignore_eos, precision, threshold_specs, thresholds_file, from_dirs, save_dir, report_dir, locate,
                 what_if, what_if_precision, what_if_eval, as_json, debug, **device_overrides):
    """Compare a device layout with a reference stage by stage; name the first stage that breaks.

    \b
    Both sides get the same image and prompt; every stage boundary is captured (pixel_values, image_features,
    image_embeds, text embeds, inputs_embeds, per-step logits, tokens). The device decoder is fed the
    reference tokens (teacher forcing) so per-step logits stay comparable.
    \b
      vlmrun diff --reference reference --device all-npu --image I --prompt P
      vlmrun diff --reference torch --device reference          # check the ONNX Runtime reference itself
      vlmrun diff --device-vision PLUGIN --precision fp16 --report out/
      vlmrun diff --from host/reference --from phone/device     # compare saved captures
      vlmrun diff --device L.toml --locate --what-if             # which layer drifts, and does fp16 there fix it
      vlmrun diff --device L.toml --what-if --what-if-precision P   # ... or at a precision its backend offers
      vlmrun diff --device L.toml --what-if --what-if-eval 40    # ... and the eval accuracy it gives back
    Exit status: 0 every threshold holds, 1 some threshold fails, 2 usage error.
    """
    from . import diff
    from .progress import step

    if what_if_eval is not None and what_if is None:
        raise click.UsageError("--what-if-eval N evaluates the fix --what-if makes: add --what-if")
    if what_if_precision is not None and what_if is None:
        raise click.UsageError("--what-if-precision chooses what --what-if gives the layer: add --what-if")
    if what_if is not None and locate is None:
        locate = "auto"
    if locate is not None and locate != "auto":
        from .diff.locate import LOCATABLE

        if locate not in LOCATABLE:
            raise click.UsageError(f"--locate {locate}: choose auto or one of {', '.join(LOCATABLE)}")

    thresholds: dict[str, dict[str, float | None]] = {}
    for spec in threshold_specs:
        stage, metric, value = diff.parse_threshold(spec)
        thresholds.setdefault(stage, {})[metric] = value
    overrides = {stage: device_overrides.get(f"device_{stage}") for stage in STAGES}
    result_run = diff.run(
        reference=diff.Side(reference),
        device=diff.Side(device, {s: b for s, b in overrides.items() if b}),
        image=image,
        prompt=prompt,
        model=model_dir,
        store=cache_dir,
        max_new_tokens=max_new_tokens,
        ignore_eos=ignore_eos,
        precision=precision,
        thresholds=thresholds,
        thresholds_file=thresholds_file,
        from_dirs=from_dirs,
        image_size=image_size,
        progress=step,
    )
    result = result_run.result
    located_note = None
    if locate is not None:
        from . import what_if as what_if_mod
        from .diff import locate as loc_mod

        stage, why = loc_mod.stage_to_locate(result, locate)
        if stage is None:
            located_note = f"--locate: {why}"
        else:
            missing = [s for s in ("reference", "device") if s not in result_run.pipelines]
            if missing:
                raise click.UsageError(f"--locate runs the stage's probes on both sides live; the {missing[0]} side"
                                       " came from --from (give it as a layout instead)")
            result_run.location = loc_mod.locate(result_run.pipelines["reference"], result_run.pipelines["device"],
                                                 stage, result_run.reference, result.thresholds, progress=step)
            if what_if is not None:
                layers = None if what_if == "auto" else [x for x in what_if.replace(",", " ").split() if x]
                result_run.location.what_if = what_if_mod.what_if(result_run, result_run.location, layers,
                                                                  progress=step, image=image, prompt=prompt,
                                                                  eval_items=what_if_eval,
                                                                  precision=what_if_precision or "fp")
    if save_dir is not None:
        diff.save_run(result_run, save_dir)
        click.echo(f"captures saved to {save_dir} (compare again with --from {save_dir})", err=True)
    if report_dir is not None:
        page = diff.write_report(result_run, report_dir)
        click.echo(f"report: {page}", err=True)
    if as_json:
        data = result.to_json()
        if locate is not None:
            data["locate"] = (result_run.location.to_json() if result_run.location is not None
                              else {"stage": None, "note": located_note})
        from .diff.capture import jsonable

        click.echo(json.dumps(jsonable(data)))
    else:
        click.echo(diff.format_table(result))
        if result_run.location is not None:
            from .diff.locate_report import format_location

            click.echo(format_location(result_run.location))
        elif located_note:
            click.echo(located_note)
    if not result.passed:
        # an exception rather than ctx.exit(1): vlmrun.cli.main ignores the return value of cli.main(...,
        # standalone_mode=False), which is where click puts ctx.exit codes
        raise DiffFailed(
            f"thresholds failed; likely culprit: {result.culprit}"
            f" (failing: {', '.join(result.failed_stages)})"
        )


class DiffFailed(VlmrunError):
    """Some threshold failed (exit status 1); the table or JSON on stdout says which."""

    exit_code = 1
