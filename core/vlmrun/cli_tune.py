"""``vlmrun tune``: the command over `vlmrun.tune` (registered in `vlmrun.cli` as ``tune_command``)."""

from __future__ import annotations

import json
from pathlib import Path

import click

from .cli_eval import progress_bar
from .cli_options import Destination, model_options


@click.command("tune", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("dataset", required=False, type=click.Path(path_type=Path))
@click.option("--layout", "-L", "layout_spec", metavar="[LABEL=]BASE[,STAGE.KEY=V]...",
              help="The base layout, as vlmrun eval --layout takes it: the cheapest build, each quantized stage at"
                   " the precision the search starts from. [default: the preset a plugin declares for tuning; vlmrun"
                   " plugins names it]")
@click.option("--layout-file", type=click.Path(path_type=Path), help="The base layout as a TOML file.")
@click.option("--limit", type=click.IntRange(1), default=8, show_default=True,
              help="Items of the data set each candidate is measured on.")
@click.option("--max-accuracy-drop", metavar="X", help="Budget: accuracy at most X below the reference's (0.05 or 5%).")
@click.option("--min-answers-as-reference", metavar="Y",
              help="Budget: at least Y of the answers equal the reference's (0..1 or %). [default when no budget"
                   " is given: 1.0, every answer]")
@click.option("--min-logits-sqnr", metavar="Z", help="Budget: median logits SQNR at least Z dB (teacher-forced).")
@click.option("--stages", metavar="STAGE[,STAGE]", help="Stages to tune. [default: every quantized stage]")
@click.option("--layers", metavar="LAYER[,LAYER]",
              help="Only these layers, named as vlmrun diff --locate names them (decoder.layer1, decoder.lm_head).")
@click.option("--anchor", "anchors", multiple=True, metavar="SPEC",
              help="Another layout to measure and place on the front (repeatable), as --layout takes it, e.g. a"
                   " uniform 8-bit build 'LABEL=PRESET,decoder.precision=P,vision.precision=P'.")
@click.option("--max-candidates", type=click.IntRange(1), default=12, show_default=True,
              help="Builds measured at most (the base and anchors included).")
@click.option("--beam", type=click.IntRange(1), default=1, show_default=True,
              help="Per step, how many of the most sensitive layers are tried (in parallel on Ray).")
@click.option("--max-new-tokens", type=click.IntRange(1), default=48, show_default=True)
@click.option("--out", "out", type=Destination(folder=False), metavar="BEST.toml",
              help="Write the winning layout here (a layout file for vlmrun, vlmrun bundle, vlmrun eval).")
@click.option("--report", "report_dir", type=Destination(), metavar="DIR",
              help="Write DIR/index.html (the front plotted) and DIR/tune.json.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object instead of the table.")
@click.option("--ray", "ray_address", metavar="ADDRESS",
              help="Build and measure candidates as tasks on this Ray cluster (every node must see --cache-dir).")
@model_options
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def tune_command(dataset, layout_spec, layout_file, limit, max_accuracy_drop, min_answers_as_reference,
                 min_logits_sqnr, stages, layers, anchors, max_candidates, beam, max_new_tokens, out, report_dir,
                 as_json, ray_address, model_dir, image_size, cache_dir, debug):
    """The smallest build of a layout whose answers stay within a budget, measured on the device.

    \b
    Ranks the layers of each quantized stage by their own error on the device (as diff --locate measures it),
    then raises the most sensitive ones a rung at a time (to the precisions its backend offers a layer: vlmrun plugins),
    building and evaluating each candidate with vlmrun eval on DATASET
    (default: the generated held-out set), until one meets the budget. Prints every point with the Pareto front
    (bytes on the device, accuracy, answers as the reference, logits SQNR) and writes the winner with --out.
    Measured points are kept in the store: an interrupted tune resumes, a finished one builds nothing again.
    \b
      vlmrun tune --out best.toml
      vlmrun tune --min-logits-sqnr 25 --stages decoder --report tune-report/ --out best.toml
      vlmrun tune --layers decoder.layer0,decoder.lm_head --limit 4 --json
      vlmrun eval -L best.toml          # the winner again; vlmrun bundle OUT --layout-file best.toml ships it
    Exit status: 0 with a winner, 1 when no build met the budget, 2 for bad arguments.
    """
    from . import tune as tn
    from .errors import VlmrunError
    from .progress import step

    budget = tn.Budget.of(max_accuracy_drop, min_answers_as_reference, min_logits_sqnr)

    def split(v):
        return [x.strip() for x in str(v).split(",") if x.strip()] if v else None

    def on_point(p):
        if not as_json:
            what = "built" if p.built else "from the store"
            click.echo(f"vlmrun tune: {p.label} ({what}): {p.bytes:,} bytes, answers as reference"
                       f" {tn.front.percent(p.answers_as_reference)}, logits SQNR"
                       f" {'-' if p.logits_sqnr_db is None else f'{p.logits_sqnr_db:.2f} dB'}"
                       f"{'' if p.within_budget else ' (misses: ' + '; '.join(p.misses) + ')'}", err=True)

    result = tn.tune(layout_spec, dataset, layout_file=layout_file, budget=budget, stages=split(stages),
                     layers=split(layers), anchors=list(anchors), limit=limit, max_candidates=max_candidates,
                     beam=beam, model=model_dir, store=cache_dir, max_new_tokens=max_new_tokens,
                     ray_address=ray_address, progress=step, bar=progress_bar, on_point=on_point)
    if report_dir is not None:
        click.echo(f"report: {tn.write_html(result, report_dir)}", err=True)
    if out is not None and result.winner is not None:
        tn.write_toml(result.winner, out, result.base)
        click.echo(f"winner written to {out}", err=True)
    if as_json:
        click.echo(json.dumps(result.to_json()))
    else:
        click.echo(tn.format_table(result))
    if result.winner is None:
        raise VlmrunError("no build met the budget; nothing written" if out else "no build met the budget")
