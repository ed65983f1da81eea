"""``vlmrun bundle``: the deployable folder of a layout (registered in `vlmrun.cli` as ``bundle_command``), a thin
command over `vlmrun.bundle` (`write`, `verify`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from .bundle import VERIFY_ITEMS, answers_checked, verify, write
from .cli_options import Destination, layout_overrides, model_options, registry, stage_option_flags
from .stages import STAGES


@click.command("bundle", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("out", type=Destination())
@click.option("--layout", default=None,
              help="Layout whose stages (all on one backend) the bundle is made from: a preset, with optional"
                   " inline overrides (all-npu,decoder.context_length=256). [default: all-npu, or the base of"
                   " --layout-file]")
@click.option("--layout-file", type=click.Path(path_type=Path), help="TOML file with a layout.")
@click.option("--verify-items", type=click.IntRange(0), default=VERIFY_ITEMS, show_default=True,
              help="Held-out items the new bundle is run on (vlmrun eval) before it is handed out; 0: none.")
@click.option("--verify", "verify_only", is_flag=True,
              help="Check the bundle OUT (files, sha256, configs, inputs: what its backend checks) and exit; nothing"
                   " is written. Stage option flags and -o STAGE.KEY=VALUE become the checks' settings (e.g. --soc,"
                   " or the device runtime's SDK).")
@click.option("--ray", "ray_address", metavar="ADDRESS",
              help="Run the compiles' independent jobs (the decoder's parts: quantize and compile) as tasks on this"
                   " Ray cluster (HOST:PORT; each task declares one CPU and its memory; every node must see --cache-dir"
                   " at the same path). The artifacts are the ones one process makes.")
@model_options
@stage_option_flags
@click.option("--json", "as_json", is_flag=True, help="Print the manifest (or the checks) as JSON.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def bundle_command(out, layout, layout_file, verify_items, verify_only, ray_address, model_dir, image_size, cache_dir,
                   as_json, debug, **flag_opts):
    """Write the folder a device's app loads: the whole VLM in its backend's own runtime.

    \b
      vlmrun bundle out/                               # all-npu, for this machine
      vlmrun bundle out/ -o decoder.precision=P        # the decoder at another precision its backend declares
      vlmrun bundle out/ --target android              # for a phone
      vlmrun bundle out/ --ray HOST:PORT               # the decoder's parts compiled on a Ray cluster
      vlmrun bundle --verify out/                      # files, hashes, configs: before anything runs
      vlmrun --bundle out/ --image I --prompt P        # run it, in the bundle's own runtime
    \b
    What the folder holds is the backend's (`vlmrun plugins` says which backends write bundles); every bundle has
    vlmrun-bundle.json: the sha256 of every file, versions, recipes.
    """
    from . import layouts as layouts_mod
    from .progress import step

    if verify_only:
        from .errors import UsageError
        from .options import parse_assignment

        if ray_address:
            raise UsageError("--ray compiles a new bundle; --verify only checks one: give one of them")

        settings = {name[len("opt_"):]: v for name, v in flag_opts.items() if name.startswith("opt_") and v is not None}
        for spec in flag_opts.get("option_specs") or ():
            _, key, value = parse_assignment(spec)
            settings[key] = value
        checks = verify(out, settings, reg=registry())
        # a bundle never run when written (a phone's, --verify-items 0) has its files and configs checked, not
        # its answers (verify's last line says so): said so, not "verified" alone
        ran = answers_checked(layouts_mod.bundle_manifest(out))
        if as_json:
            click.echo(json.dumps({"bundle": str(out), "ok": True, "answers_checked": ran, "checked": checks}))
        else:
            for i, line in enumerate(checks):
                click.echo(f"{'--' if i == len(checks) - 1 and not ran else 'ok'}  {line}")
            click.echo(f"bundle {out}: verified" if ran else
                       f"bundle {out}: files and configs verified; its answers were not checked when it was written",
                       err=True)
        return
    if layout is None and not (layout_file and "base" in layouts_mod.read_toml(layout_file, "layout file")):
        layout = "all-npu"  # the default base, unless the layout file names its own
    opts = {**flag_opts, "layout": layout, "layout_file": layout_file}
    base = layouts_mod.resolve(layout, layout_file)
    lay = layouts_mod.resolve(layout, layout_file, None, layout_overrides(opts, base, STAGES))
    # --target android: weight-shared part binaries and the extensions config for a phone; local: this machine. The
    # decoder's target as its backend reads it (its declared default when not given); a backend without one: local
    reg = registry()
    decoder = reg.stage_options(lay.backend("decoder"), "decoder", lay.stages["decoder"].options)
    where = {"target": str(decoder["target"])} if "target" in decoder else {}
    manifest = write(lay, out, model=model_dir, store=cache_dir, image_size=image_size, progress=step, reg=reg,
                     verify_items=verify_items, ray=ray_address, **where)
    if as_json:
        click.echo(json.dumps(manifest))
        return
    b = manifest.get("bytes", {})
    click.echo(f"bundle {out}: {len(manifest.get('files', {}))} files, {b.get('total', 0) / 1e6:.1f} MB"
               f" (image encoder {b.get('image_encoder', 0) / 1e6:.1f} MB, decoder {b.get('decoder', 0) / 1e6:.1f} MB,"
               f" LUT {b.get('lut', 0) / 1e6:.1f} MB) for {manifest.get('soc')} ({manifest.get('target')})")
    v = manifest.get("verified") or {}
    if v.get("items"):
        click.echo(f"verified on {v['items']} held-out items: accuracy {v['accuracy']:.0%} (reference"
                   f" {v['reference_accuracy']:.0%}), same answer as the reference {v['same_answer_as_reference']:.0%},"
                   f" logits SQNR median {(v.get('logits_sqnr_db') or {}).get('median', float('nan')):.1f} dB")
    click.echo(f"run it: vlmrun --bundle {out} --image I --prompt P", file=sys.stderr)
