"""``vlmrun eval``: the command over `vlmrun.eval` (registered in `vlmrun.cli` as ``eval_command``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from .cli_options import Destination, model_options


def progress_bar(total: int, initial: int, desc: str):
    """A progress bar on stderr with items/s (tqdm); plain lines when stderr is not a terminal."""
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc=desc, unit="item", file=sys.stderr, dynamic_ncols=True,
                mininterval=0.5 if sys.stderr.isatty() else 5.0, smoothing=0.1)


@click.command("eval", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("dataset", required=False, type=click.Path(path_type=Path))
@click.option("--layout", "-L", "layout_specs", multiple=True, metavar="[LABEL=]BASE[,STAGE=PLUGIN][,STAGE.KEY=V]",
              help="A layout to evaluate (repeatable): a preset or TOML layout file, then per-stage overrides,"
                   " e.g. all-npu or 'int8-vision=all-npu,vision.precision=int8' or 'reference,vision=acme_npu'."
                   " [default: reference]")
@click.option("--reference", default="reference", show_default=True, metavar="SPEC",
              help="The layout the drift is measured against (same syntax as --layout).")
@click.option("--conversations", is_flag=True,
              help="Evaluate the generated held-out conversations (100 of 1-3 turns, some bringing a second"
                   " picture) instead of a DATASET: every turn is scored, also per turn.")
@model_options
@click.option("--limit", type=click.IntRange(1), default=None, help="Only the first N usable records.")
@click.option("--workers", type=click.IntRange(1), default=1, show_default=True,
              help="Processes for the layouts that run on this host (batched hosted stages run in this one).")
@click.option("--strict", is_flag=True, help="Stop at the first bad record instead of skipping it.")
@click.option("--max-new-tokens", type=click.IntRange(1), default=48, show_default=True,
              help="Budget per answer (the generated set's longest answer is 40 tokens with <|im_end|>).")
@click.option("--report", "report_dir", type=Destination(), metavar="DIR",
              help="Write DIR/index.html (plots embedded) and DIR/eval.json.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object instead of tables.")
@click.option("--ray", "ray_address", metavar="ADDRESS",
              help="Run the items as tasks on this Ray cluster (--workers actors, or one per CPU; every node must see"
                   " --cache-dir at the same path).")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def eval_command(dataset, layout_specs, reference, conversations, model_dir, image_size, cache_dir, limit, workers,
                 strict, max_new_tokens, report_dir, as_json, ray_address, debug):
    """Task accuracy and drift of layouts over a data set.

    \b
    DATASET is a JSONL file of {"image", "question", "answer"} records (image paths relative to the file; an
    optional "kind" groups the accuracy). Without it: the held-out set of generated shapes pictures.
    A record may be a conversation, {"image", "turns": [{"question", "answer"}, {"image"?, "question",
    "answer"}, ...]}: its turns are asked in one chat with the layout's own answers in the history, each
    answer scored (the accuracy counts every turn, and is shown per turn); --conversations: the generated ones.
    Each item runs on the reference layout and on every --layout; answers are scored by exact match after
    normalising case and punctuation; every stage boundary is compared with the reference (the decoder
    teacher-forced on the reference tokens; one-turn records only). Results are cached per item: an
    interrupted run resumes.
    \b
      vlmrun eval                                             # the reference layout, held-out set
      vlmrun eval -L reference -L all-npu -L 'int8-vision=all-npu,vision.precision=int8' --report out/
      vlmrun eval my-data.jsonl -L my-layout.toml --workers 2 --json
      vlmrun eval --conversations --limit 50                  # generated conversations, accuracy per turn
    A bad record (unreadable line, no question or answer, missing image; a turn without question or answer)
    is one line on stderr naming the file and line, skipped and counted in the report (--strict: stop there).
    """
    from . import eval as ev
    from .progress import step

    def on_skip(skipped):
        from tqdm import tqdm

        tqdm.write(f"vlmrun eval: skipped {skipped.message}", file=sys.stderr)  # its own line, under any bar

    run = ev.evaluate(
        list(layout_specs) or ["reference"],
        dataset,
        reference=reference,
        model=model_dir,
        store=cache_dir,
        limit=limit,
        workers=workers,
        strict=strict,
        max_new_tokens=max_new_tokens,
        image_size=image_size,
        progress=step,
        bar=progress_bar,
        on_skip=on_skip,
        ray_address=ray_address,
        conversations=conversations,
    )
    if report_dir is not None:
        page = ev.write_html(run.report, report_dir)
        click.echo(f"report: {page}", err=True)
    if as_json:
        click.echo(json.dumps(run.report))
    else:
        click.echo(ev.format_table(run.report))
