"""Command-line options shared by the ``vlmrun`` subcommands."""

from __future__ import annotations

import math
from pathlib import Path

import click

from . import plugins
from .atomic import destination_problem
from .errors import UsageError
from .sampling import SEED_MAX
from .stages import STAGES


class Destination(click.Path):
    """A path a command writes its result to (a folder, or a file with ``folder=False``): what cannot be one is a
    usage error before any work (`vlmrun.atomic.destination_problem`), not an internal error after it."""

    def __init__(self, folder: bool = True):
        super().__init__(path_type=Path)
        self.folder = folder

    def convert(self, value, param, ctx):
        path = super().convert(value, param, ctx)
        problem = destination_problem(path, folder=self.folder)
        if problem:
            self.fail(f"{str(value)!r} {problem}.", param, ctx)
        return path


def model_options(f):
    """``--model``, ``--image-size`` and ``--cache-dir``: which checkpoint, and where artifacts live."""
    f = click.option("--cache-dir", type=Destination(), envvar="VLMRUN_CACHE_DIR",
                     help="Artifact store location. [env: VLMRUN_CACHE_DIR; default ~/.cache/vlmrun]")(f)
    f = click.option("--image-size", type=int, default=None,
                     help="Image size of the default model (ignored with --model). [default: its own, 256; other"
                          " sizes run the same weights, trained at 256 only]")(f)
    f = click.option("--model", "model_dir", type=click.Path(path_type=Path),
                     help="FastVLM checkpoint directory (transformers-native or Apple llava_qwen2 format)."
                          " Default: the tiny trained shapes model shipped with vlmrun.")(f)
    return f


# -- per-stage options: the flags plugins declare, and --option STAGE.KEY=VALUE ------------------------------------
def registry():
    """The plugins, loaded once per process (their declared options become flags of the commands)."""
    return plugins.default()


def _dest(flag: str) -> str:
    return "opt_" + flag.lstrip("-").replace("-", "_")


def _click_type(declared):
    """The flag's click type: a plain one (values are checked against each stage's declaration, with one error
    line naming the stage and the choices); choices are shown as the metavar."""
    types = {o.type for o in declared}
    if all(o.choices for o in declared):
        return click.STRING
    if types == {int}:
        return int
    if types == {float} or types == {int, float}:
        return float
    return str


def stage_option_flags(f):
    """Every flag the installed plugins (and the core) declare for their per-stage options, plus the generic
    ``--option STAGE.KEY=VALUE``. The values reach the layout through `layout_overrides`."""
    f = click.option("--option", "-o", "option_specs", multiple=True, metavar="STAGE.KEY=VALUE",
                     help="Set one per-stage option, e.g. -o vision.precision=int8 (repeatable; `vlmrun plugins"
                          " --options` lists them).")(f)
    for flag, declared in sorted(registry().options.flags().items(), reverse=True):
        owners = ", ".join(sorted({o.backend for o in declared}))
        helps = {o.help for o in declared if o.help}
        text = (next(iter(helps)) if len(helps) == 1 else "; ".join(f"{o.backend}: {o.help}" for o in declared))
        choices = sorted({str(c) for o in declared for c in (o.choices or ())})
        metavar = "[" + "|".join(choices) + "]" if choices and all(o.choices for o in declared) else None
        f = click.option(flag, _dest(flag), type=_click_type(declared), default=None, metavar=metavar,
                         help=f"{text} [option '{declared[0].name}' of {owners}]")(f)
    return f


def layout_overrides(opts: dict, layout, stages) -> dict[str, dict[str, object]]:
    """Per-stage options from the declared flags and ``--option``: ``{stage: {key: value}}``.

    A flag applies to each of ``stages`` whose backend or compiler declares its option; a flag that applies to
    none of them is an error (it would silently do nothing). ``--option`` values go to the stage they name.
    """
    from .errors import UsageError
    from .options import parse_assignment

    table = registry().options
    out: dict[str, dict[str, object]] = {s: {} for s in layout.stages}
    for spec in opts.get("option_specs") or ():
        stage, key, value = parse_assignment(spec)
        out[stage][key] = value
    flags = table.flags()
    # --compiler first: which compiler a stage has decides which other flags apply to it
    for flag in sorted(flags, key=lambda fl: fl != "--compiler"):
        value = opts.get(_dest(flag))
        if value is None:
            continue
        hit = []
        for stage in stages:
            compiler = out[stage].get("compiler") or layout.stages[stage].options.get("compiler")
            known = table.for_stage(layout.stages[stage].backend, stage, str(compiler) if compiler else None)
            for o in flags[flag]:
                if o.name in known:
                    out[stage][o.name] = value
                    hit.append(stage)
                    break
        if not hit:
            owners = ", ".join(sorted({o.backend for o in flags[flag]}))
            on = ", ".join(f"{s}={layout.stages[s].backend}" for s in stages)
            raise UsageError(f"{flag} applies to no stage here ({on}): it is an option of {owners}")
    return out


# -- the pipeline of a command: its layout, model and generation options -----------------------------------------
def _stage_options(f):
    for stage in reversed(STAGES):
        f = click.option(f"--{stage}", f"{stage}_backend", metavar="PLUGIN",
                         help=f"Backend plugin for the {stage} stage (overrides the layout).")(f)
    return f


def pipeline_options(f):
    f = model_options(f)
    f = click.option("--layout", default=None, metavar="BASE[,STAGE=PLUGIN][,STAGE.KEY=V]",
                     help="Layout: a preset (reference, hybrid, all-npu) or a TOML file, with optional inline overrides"
                          " (all-npu,decoder.context_length=256), as every command writes one. [default: reference]")(f)
    f = click.option("--layout-file", type=click.Path(path_type=Path), help="TOML file with a layout.")(f)
    f = click.option("--bundle", type=click.Path(path_type=Path), metavar="DIR",
                     help="Run a bundle folder written by `vlmrun bundle` (its own runtime, as a phone would).")(f)
    f = click.option("--rebuild", is_flag=True, help="Export/compile again even if the store has the artifacts.")(f)
    f = stage_option_flags(f)
    f = click.option("--debug", is_flag=True, help="Show tracebacks.")(f)
    return _stage_options(f)


class FiniteFloatRange(click.FloatRange):
    """`click.FloatRange` that also refuses nan and inf (a range check lets nan through: every comparison is
    false)."""

    def convert(self, value, param, ctx):
        rv = super().convert(value, param, ctx)
        if not math.isfinite(rv):
            self.fail(f"{value!r} is not a finite number.", param, ctx)
        return rv


def generation_options(f):
    f = click.option("--max-new-tokens", type=click.IntRange(1), default=64, show_default=True)(f)
    f = click.option("--temperature", type=FiniteFloatRange(0), default=0.0, show_default=True,
                     help="0 = greedy.")(f)
    f = click.option("--top-k", type=click.IntRange(0), default=0, show_default=True, help="0 = off.")(f)
    f = click.option("--top-p", type=FiniteFloatRange(0, 1), default=1.0, show_default=True)(f)
    f = click.option("--seed", type=click.IntRange(0, SEED_MAX), default=0, show_default=True,
                     help="Sampling seed (0 to 2^31-1: a signed 32-bit one, as runtimes take it).")(f)
    f = click.option("--ignore-eos", is_flag=True, help="Keep generating past end-of-sequence tokens.")(f)
    f = click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of streaming.")(f)
    return f


def build_pipeline(opts: dict, stages=STAGES, requests=()):
    """The pipeline of a command: layout (preset, file, --STAGE overrides, option flags), checked with the
    inputs of ``requests`` (image, prompt) before any export or compile."""
    from . import layouts
    from .pipeline import Pipeline
    from .progress import step

    overrides = {s: opts.get(f"{s}_backend") for s in STAGES}
    if opts.get("bundle"):
        if opts.get("layout") or opts.get("layout_file"):
            raise UsageError("--bundle runs the bundle as it was written: drop --layout / --layout-file")
        opts = {**opts, "layout": f"{layouts.BUNDLE_PREFIX}{opts['bundle']}"}
    base = layouts.resolve(opts.get("layout"), opts.get("layout_file"), overrides)
    layout = layouts.resolve(opts.get("layout"), opts.get("layout_file"), overrides,
                             layout_overrides(opts, base, stages))
    return Pipeline.build(
        opts.get("model_dir"),
        layout,
        store=opts.get("cache_dir"),
        registry=registry(),
        rebuild=opts.get("rebuild", False),
        image_size=opts.get("image_size", 1024),
        stages=stages,
        progress=step,
        requests=requests,
    )


def settings_from(opts: dict):
    from .pipeline import GenerationSettings
    from .sampling import SamplingSettings

    return GenerationSettings(
        max_new_tokens=opts["max_new_tokens"],
        sampling=SamplingSettings(opts["temperature"], opts["top_k"], opts["top_p"], opts["seed"]),
        ignore_eos=opts["ignore_eos"],
    )


