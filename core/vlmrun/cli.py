"""The ``vlmrun`` command: a thin layer over `vlmrun.pipeline`.

    vlmrun --image photo.jpg --prompt "Describe the image." [--layout reference] [--vision X --decoder Y]
    vlmrun demo | export | plugins | make-tiny DIR | doctor
"""

from __future__ import annotations

import errno
import json
import sys
from pathlib import Path

import attrs
import click

from . import procs
from .cli_options import (Destination, build_pipeline, generation_options, pipeline_options, settings_from, model_options,  # noqa: F401
                          registry)
from .errors import UsageError, VlmrunError
from .stages import STAGES

DEMO_PROMPT = "Describe the image."


def _format_timings(t: dict) -> str:
    parts = [f"{k} {t[k + '_ms']:.1f} ms" + (f" on device (wall {t[k + '_wall_ms']:.0f} ms)" if k + "_wall_ms" in t else "")
             for k in ("vision", "projector", "embed") if k + "_ms" in t]
    if "ttft_ms" in t:
        parts.append(f"prefill/TTFT {t['ttft_ms']:.1f} ms ({t.get('prompt_tokens', 0)} prompt tokens)")
    if "tokens_per_s" in t:
        parts.append(f"{t['tokens_per_s']:.1f} tokens/s")
    parts.append(f"{t.get('new_tokens', 0)} new tokens")
    return " | ".join(parts)


_CONTROL = {c: f"\\x{c:02x}" for c in [*range(0x00, 0x09), *range(0x0B, 0x20), 0x7F]}


def _visible(text: str) -> str:
    """Generated text for a terminal: control characters (a random model emits them) shown as escapes."""
    return text.translate(_CONTROL)


def _generate(pipe, image, prompt: str, opts: dict) -> None:
    gen = pipe.generate(image, prompt, settings_from(opts))
    if opts["as_json"]:
        gen.run()
        click.echo(json.dumps(default=str, obj={
            "text": gen.text, "token_ids": gen.token_ids, "stopped_by": gen.stopped_by,
            "stop_ids": [] if opts["ignore_eos"] else sorted(pipe.model.stop_ids),
            "timings": gen.timings, "profiles": gen.profiles,
            "layout": {s: pipe.layout.backend(s) for s in STAGES},
            "model": str(pipe.model.source),
        }))
        return
    click.echo(f"[{pipe.layout.describe()}]", err=True)
    show = _visible if sys.stdout.isatty() else str
    for piece in gen:
        click.echo(show(piece), nl=False)
        sys.stdout.flush()
    click.echo()
    click.echo(_format_timings(gen.timings), err=True)


#: options given before a subcommand (``vlmrun --cache-dir X demo``) that the subcommand takes too
INHERITED = ("cache_dir", "model_dir", "image_size")


def _pass_down(ctx, opts: dict) -> None:
    """``vlmrun --cache-dir X store list``: the root's model and store options become the defaults of the
    subcommand (and of a group's subcommands) that declare them, as `--help` presents them as global."""
    given = {k: opts[k] for k in INHERITED if opts.get(k) is not None}
    if not given:
        return
    sub = ctx.command.get_command(ctx, ctx.invoked_subcommand)

    def defaults(cmd) -> dict:
        own = {p.name for p in getattr(cmd, "params", [])}
        out = {k: v for k, v in given.items() if k in own}
        if isinstance(cmd, click.Group):
            for name in cmd.list_commands(ctx):
                out[name] = defaults(cmd.get_command(ctx, name))
        return out

    ctx.default_map = {**(ctx.default_map or {}), ctx.invoked_subcommand: defaults(sub)}
    if "cache_dir" in given:  # the subcommands read VLMRUN_CACHE_DIR before their defaults: the flag must win
        import os

        os.environ["VLMRUN_CACHE_DIR"] = str(given["cache_dir"])


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--image", type=click.Path(path_type=Path), help="Image file to ask about.")
@click.option("--prompt", help="The question about the image.")
@pipeline_options
@generation_options
@click.version_option(package_name="vlmrun")
@click.pass_context
def cli(ctx, image, prompt, **opts):
    """Run FastVLM stage by stage on pluggable backends.

    \b
    Answer a prompt about an image (every stage on the `reference` layout, tiny default model):
      vlmrun --image photo.jpg --prompt "Describe the image."
    Move stages to other backends:
      vlmrun --layout hybrid ...          or   vlmrun --vision PLUGIN --decoder PLUGIN ...
    Stages: vision, projector, embed, decoder. `vlmrun plugins` lists the backends installed,
    `vlmrun plugins --options` the per-stage options each declares.
    """
    if ctx.invoked_subcommand is not None:
        _pass_down(ctx, opts)
        return
    if image is None or prompt is None:
        if image is None and prompt is None:
            click.echo(ctx.get_help())
            ctx.exit(0)
        raise click.UsageError("give both --image and --prompt (or use a subcommand such as `vlmrun demo`)")
    if not prompt.strip():
        raise click.UsageError("--prompt is empty; ask a question about the image (e.g. \"Describe the image.\")")
    pipe = build_pipeline(opts, requests=[(image, prompt)])
    _generate(pipe, image, prompt, opts)


@cli.command()
@pipeline_options
@generation_options
@click.option("--prompt", default=DEMO_PROMPT, show_default=True)
def demo(prompt, **opts):
    """Build (once) the tiny FastVLM, export its stages, and answer a prompt about a generated image."""
    from .demo_image import demo_image

    image = demo_image()
    pipe = build_pipeline(opts, requests=[(image, prompt)])
    _generate(pipe, image, prompt, opts)


@cli.command()
@pipeline_options
@click.option("--stage", "only", type=click.Choice(STAGES), multiple=True, help="Only these stages (repeatable).")
def export(only, **opts):
    """Export (and compile, for backends that compile) every stage of a layout into the artifact store."""
    pipe = build_pipeline(opts, tuple(only) or STAGES)
    for name in pipe.store.builds:
        click.echo(f"built {name}")
    click.echo(f"artifact store: {pipe.store.root} ({len(pipe.store.builds)} built, others reused)")


def _option_json(o) -> dict:
    return {"name": o.name, "type": o.type.__name__, "choices": list(o.choices) if o.choices else None,
            "stages": list(o.stages) if o.stages else None, "default": o.default, "flag": o.flag, "help": o.help}


@cli.command()
@click.option("--options", "show_options", is_flag=True, help="Also list each backend's per-stage options.")
@click.option("--json", "as_json", is_flag=True, help="Machine-readable output.")
@click.option("--debug", is_flag=True, hidden=True)
def plugins(show_options, as_json, debug):
    """List installed backend plugins: version, stages, hooks, options, the layouts they name (presets), and
    plugins that failed to load."""
    reg = registry()
    table = reg.options.by_backend
    if as_json:
        click.echo(json.dumps({
            "plugins": [
                {"name": p.name, "version": p.version, "module": p.module, "hooks": list(p.hooks),
                 "backends": [{"name": b.name, "stages": list(b.stages), "summary": b.summary,
                               "options": [_option_json(o) for o in table.get(b.name, {}).values()]}
                              for b in p.backends]}
                for p in reg.plugins.values()
            ],
            "core_options": [_option_json(o) for o in table.get("vlmrun", {}).values()],
            "presets": [{"name": p.name, "stages": dict(p.stages), "summary": p.summary, "reference": p.reference,
                         "tune": p.tune_spec}
                        for p in reg.presets.values()],
            "precisions": [attrs.asdict(p) for p in _precisions(reg).values()],
            "failed": reg.failures,
        }, indent=2, default=str))
        return
    if not reg.plugins:
        click.echo("no plugins installed")
    for p in reg.plugins.values():
        click.echo(f"{p.name} {p.version}")
        for b in p.backends:
            click.echo(f"  backend {b.name}: stages {', '.join(b.stages)}" + (f" - {b.summary}" if b.summary else ""))
            if show_options:
                for o in table.get(b.name, {}).values():
                    what = "|".join(map(str, o.choices)) if o.choices else o.type.__name__
                    where = f" ({', '.join(o.stages)})" if o.stages else ""
                    flag = f" {o.flag}" if o.flag else ""
                    default = f" [default {o.default}]" if o.default is not None else ""
                    click.echo(f"    {o.name}={what}{where}{flag}: {o.help}{default}")
        click.echo(f"  hooks: {', '.join(p.hooks)}")
    if show_options:
        click.echo("every backend: " + "; ".join(f"{o.name} ({o.flag}): {o.help}"
                                                  for o in table.get("vlmrun", {}).values()))
    for p in reg.presets.values():
        role = " (the reference)" if p.reference else ""
        click.echo(f"layout {p.name}{role}: " + " ".join(f"{s}={b}" for s, b in p.stages.items())
                   + (f" - {p.summary}" if p.summary else ""))
        if p.tune is not None:
            click.echo(f"  vlmrun tune starts from {p.tune_spec}")
    for p in _precisions(reg).values():
        judged = (f"judged like {p.like}" if p.like else f"diff floors: SQNR {p.sqnr_db:g} dB, cosine {p.cosine:g},"
                  f" top-1 {p.top1:g}")
        click.echo(f"precision {p.name}: {judged}" + (f" - {p.summary}" if p.summary else ""))
    for name, why in reg.failures.items():
        click.echo(f"{name} FAILED to load: {why}")


def _precisions(reg) -> dict:
    """fp32 and the precisions the plugins declare, with their default diff thresholds."""
    from .diff.thresholds import declared

    return declared(reg)


@cli.command("make-tiny")
@click.argument("out_dir", type=Destination())
@click.option("--size", default=None, metavar="SIZE",
              help="tiny (default; about 0.5M parameters), 0.5b, 1.5b or 7b: FastVLM-0.5B/1.5B/7B dimensions"
                   " (random weights; 1.25, 3.35 and 15.5 GB in bf16).")
@click.option("--full-size", is_flag=True, help="Same as --size 0.5b.")
@click.option("--format", "fmt", default=None, metavar="FORMAT",
              help="native (transformers' fast_vlm, one float32 file; tiny and 0.5b) or apple-sharded (Apple's"
                   " llava_qwen2 layout, bf16 shards and an index, written tensor by tensor). Default: native for"
                   " tiny, apple-sharded for the real sizes.")
@click.option("--shard-gb", type=click.FloatRange(min=0.001), default=2.0, show_default=True,
              help="Largest shard of --format apple-sharded, in GB.")
@click.option("--image-size", type=int, default=1024, show_default=True, help="Multiple of 64.")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--massive-activations", is_flag=True,
              help="Plant real LLMs' residual outliers (a few channels at several hundred to a few thousand on the"
                   " first token and on delimiters): what makes fp16 NPU decoders overflow. --format native only.")
@click.option("--debug", is_flag=True, hidden=True)
def make_tiny(out_dir, size, full_size, fmt, shard_gb, image_size, seed, massive_activations, debug):
    """Build a random-weight FastVLM checkpoint with the real architecture, tiny or at a FastVLM size."""
    from .family import FORMATS, size_named

    if image_size % 64 or image_size < 64:
        raise UsageError(f"--image-size must be a positive multiple of 64, got {image_size}")
    if full_size and size is not None and size_named(size).name != "0.5b":
        raise UsageError(f"--full-size is --size 0.5b; it cannot go with --size {size}")
    chosen = size_named("0.5b" if full_size else (size or "tiny"))
    fmt = fmt or ("native" if chosen.name == "tiny" else "apple-sharded")
    if fmt not in FORMATS:
        raise UsageError(f"unknown --format {fmt!r}; expected one of {', '.join(FORMATS)}")
    if fmt == "native" and chosen.name not in ("tiny", "0.5b"):
        raise UsageError(f"--format native builds the whole model in float32 memory: tiny and 0.5b only; write"
                         f" {chosen.name} with --format apple-sharded")
    if massive_activations and fmt != "native":
        raise UsageError("--massive-activations needs --format native")
    if fmt == "native":
        _make_native(out_dir, chosen.name, image_size, seed, massive_activations)
    else:
        _make_apple_sharded(out_dir, chosen, image_size, seed, int(shard_gb * 1e9))
    click.echo(str(out_dir))


def _make_native(out_dir: Path, size: str, image_size: int, seed: int, massive_activations: bool) -> None:
    from .progress import step
    from .tiny import make_tiny as build

    with step(f"building {'tiny' if size == 'tiny' else 'full-size (0.5b)'} FastVLM in {out_dir}"):
        build(out_dir, image_size=image_size, full_size=size == "0.5b", seed=seed,
              massive_activations=massive_activations)


def _make_apple_sharded(out_dir: Path, size, image_size: int, seed: int, shard_bytes: int) -> None:
    """Write ``size`` in Apple's sharded bf16 layout, with a bar over the bytes written for the real sizes."""
    from rich import progress as bars
    from rich.console import Console

    from .family import check_target, write_random_apple, write_tiny_apple
    from .progress import step

    check_target(out_dir, size)  # before any bar: a refused directory is one line

    label = f"writing FastVLM {size.name} (random weights, Apple llava_qwen2 layout, bf16 shards) in {out_dir}"
    if size.name == "tiny":
        with step(label):
            write_tiny_apple(out_dir, image_size=image_size, seed=seed, shard_bytes=shard_bytes)
        return
    bar = bars.Progress(bars.TextColumn("{task.description}"), bars.BarColumn(), bars.DownloadColumn(),
                        bars.TimeRemainingColumn(), console=Console(stderr=True), transient=False)
    with bar:
        task = bar.add_task(f"FastVLM {size.name}: preparing the vision tower", total=None)
        write_random_apple(out_dir, size, image_size=image_size, seed=seed, shard_bytes=shard_bytes,
                           on_total=lambda n: bar.update(task, total=n, description=f"FastVLM {size.name}: tensors"),
                           on_bytes=lambda n: bar.advance(task, n))
    click.echo(f"done {label}", err=True)


@cli.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (loopback by default).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True)
@click.option("--model-id", default=None, help="The model name clients send (default: fastvlm-<model directory>).")
@click.option("--concurrency", type=click.IntRange(1), default=None,
              help="Generations at once: 1 on a device layout; default 2 where every backend may share its stages"
                   " (the reference layout).")
@click.option("--max-queue", type=click.IntRange(0), default=16, show_default=True,
              help="Requests waiting for a slot; beyond them: 429 with Retry-After.")
@click.option("--request-timeout", type=click.FloatRange(1), default=600.0, show_default=True,
              help="Seconds a request may wait and run; then it is cancelled.")
@click.option("--api-key", envvar="VLMRUN_API_KEY", default=None, metavar="KEY",
              help="Require 'Authorization: Bearer KEY' on every /v1 endpoint (401 otherwise; /health stays open);"
                   " also from $VLMRUN_API_KEY. Never printed or logged.")
@click.option("--allowed-local-media-path", type=click.Path(exists=True, file_okay=False, path_type=Path),
              default=None, metavar="DIR",
              help="Let image_url name local files under DIR only (symlinks and .. resolved; a relative path is"
                   " taken under DIR). Default: no local path is read, only data: URIs.")
@click.option("--max-request-bytes", type=click.IntRange(1), default=64 * 1024 * 1024, show_default=True,
              help="A request body's limit: 413 beyond it, before the body is read (its Content-Length, or counted"
                   " as it streams). The default holds two images at the 20 MiB image limit, base64-encoded.")
@click.option("--max-conversations", type=click.IntRange(0), default=16, show_default=True,
              help="Answered conversations whose decoder state is kept, so that a request that extends one prefills"
                   " only its new tokens (least recently used out; 0: keep none).")
@click.option("--conversation-cache-mb", type=click.FloatRange(0), default=1024.0, show_default=True,
              help="Host memory the kept conversation states may take.")
@pipeline_options
def serve(host, port, model_id, concurrency, max_queue, request_timeout, api_key, allowed_local_media_path,
          max_request_bytes, max_conversations, conversation_cache_mb, **opts):
    """Serve a layout (or --bundle DIR) behind an OpenAI-compatible API.

    \b
      vlmrun serve                                   # the reference layout on http://127.0.0.1:8000/v1
      vlmrun serve --layout all-npu --port 8080
      vlmrun serve --bundle out/
    \b
    POST /v1/chat/completions (a conversation: system, user and assistant turns, image_url parts in user turns: a
    data: URI, or a local path under --allowed-local-media-path; stream, temperature, top_p, max_tokens, seed,
    stop), GET /v1/models, GET /health. A request that extends a conversation answered before continues from its
    kept decoder state (usage.prompt_tokens_details.cached_tokens says how many positions it reused).
    The pipeline is built (exported, compiled) before the server listens; an error there stops it with one line.
    Beyond loopback, set --api-key (without one a warning is printed).
    """
    from .serve import serve as run_server

    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise UsageError("vlmrun serve needs FastAPI and uvicorn: pip install 'vlmrun[serve]'") from None
    pipe = build_pipeline(opts)
    run_server(pipe, host=host, port=port,
               announce=f"serving {pipe.layout.name} [{pipe.layout.describe()}] on http://{host}:{port}/v1",
               model_id=model_id, concurrency=concurrency, max_queue=max_queue,
               request_timeout=request_timeout, api_key=api_key or None,
               allowed_local_media_path=allowed_local_media_path, max_request_bytes=max_request_bytes,
               max_conversations=max_conversations, conversation_cache_mb=conversation_cache_mb)


@cli.command()
@click.option("--debug", is_flag=True, hidden=True)
def doctor(debug):
    """Check each plugin's environment (runtimes, libraries, SDK tools, devices)."""
    reg = registry()
    for name, record in reg.plugins.items():
        plugin = reg.pm.get_plugin(name)
        impl = getattr(plugin, "doctor", None)
        with procs.stdout_to_stderr():  # native libraries a check loads may print banners on fd 1
            checks = impl() if impl else []
        click.echo(f"{name} {record.version}")
        for check in checks:
            click.echo(f"  [{'ok' if check.ok else '!!'}] {check.name}: {check.detail}")
    for name, why in reg.failures.items():
        click.echo(f"{name}\n  [!!] failed to load: {why}")


from .cli_compile import compile_command  # noqa: E402  (subcommands living in their own modules)
from .cli_diff import diff_command  # noqa: E402
from .cli_profile import profile_command  # noqa: E402
from .cli_store import store_group  # noqa: E402
from .cli_eval import eval_command  # noqa: E402
from .cli_bundle import bundle_command  # noqa: E402
from .cli_tune import tune_command  # noqa: E402
from .cli_chat import chat_command  # noqa: E402

cli.add_command(compile_command, "compile")
cli.add_command(diff_command, "diff")
cli.add_command(profile_command, "profile")
cli.add_command(store_group, "store")
cli.add_command(eval_command, "eval")
cli.add_command(bundle_command, "bundle")
cli.add_command(tune_command, "tune")
cli.add_command(chat_command, "chat")

#: the documentation page that explains each command (docs/, the site `mkdocs build` makes from it)
DOCS_PAGES = {
    "": "getting-started.md", "demo": "getting-started.md", "doctor": "getting-started.md",
    "export": "models.md", "make-tiny": "models.md", "store": "models.md", "plugins": "layouts.md",
    "compile": "npu.md", "profile": "cloud.md", "diff": "diff.md", "eval": "eval.md", "tune": "tune.md",
    "bundle": "bundles.md", "serve": "serve.md", "chat": "chat.md",
}


def _point_to_docs() -> None:
    for name, page in DOCS_PAGES.items():
        cmd = cli if not name else cli.commands[name]
        cmd.epilog = f"Docs: docs/{page} (the site: mkdocs serve, or mkdocs build into site/)"


_point_to_docs()


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    procs.raise_on_sigterm()
    try:
        code = cli.main(args=argv, prog_name="vlmrun", standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        return 130
    except click.ClickException as exc:
        exc.show()
        return exc.exit_code
    except click.exceptions.Exit as exc:
        return exc.exit_code
    except VlmrunError as exc:
        if debug:
            raise
        click.echo(f"vlmrun: error: {exc}", err=True)
        return exc.exit_code
    except KeyboardInterrupt:
        click.echo("vlmrun: interrupted", err=True)
        return 130
    except procs.Terminated:
        click.echo("vlmrun: terminated (SIGTERM)", err=True)
        return 143
    except Exception as exc:
        if debug:
            raise
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            where = f" writing {exc.filename}" if exc.filename else ""
            click.echo(f"vlmrun: error: no space left on the disk{where}; free space there, or move the artifact"
                       " store (--cache-dir, VLMRUN_CACHE_DIR) or the temporary files (TMPDIR) to a larger disk",
                       err=True)
            return 1
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        click.echo(f"vlmrun: internal error: {type(exc).__name__}: {first} (rerun with --debug for the traceback)",
                   err=True)
        return 1
    return code if isinstance(code, int) else 0


if __name__ == "__main__":
    sys.exit(main())
