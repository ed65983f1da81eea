"""``vlmrun bundle``: the deployable folder of a layout (registered in `vlmrun.cli` as ``bundle_command``).

The core only resolves the layout, finds the one backend all its stages are on and hands it a
`vlmrun.stages.BundleRequest` (``write_bundle`` hook) or the folder (``verify_bundle`` hook); what a bundle
holds is the backend's business. The folder appears only when the bundle is complete: it is written into a
temporary directory beside ``OUT`` and renamed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from .cli_options import layout_overrides, model_options, registry, stage_option_flags
from .stages import STAGES


def bundle_backend(layout) -> str:
    """The backend every stage of ``layout`` is on (a bundle is one runtime), or one UsageError line."""
    from .errors import UsageError

    backends = {layout.backend(s) for s in STAGES}
    if len(backends) != 1:
        raise UsageError(f"a bundle is one runtime: every stage must be on the same backend (this layout has"
                         f" {layout.describe()}); use --layout all-npu or a layout file with one backend")
    return backends.pop()


VERIFY_ITEMS = 4  # held-out items a local bundle is run on before it is handed out (its manifest's "verified")


def write(layout, out: Path, *, model=None, store=None, target: str = "local", image_size=None, progress=None,
          reg=None, verify_items: int = VERIFY_ITEMS) -> dict:
    """Write the bundle of ``layout`` to ``out`` (the Python API of ``vlmrun bundle``); its manifest.

    A bundle for this machine (``target = "local"``) is then run as written, through its own runtime, on
    ``verify_items`` held-out items by ``vlmrun eval`` (against the reference layout); the accuracy and drift it
    showed go into its manifest (``verified``). A phone's bundle does not run here: ``verified`` says so."""
    from . import atomic
    from . import layouts as layouts_mod
    from .errors import BackendError, UsageError
    from .model import open_model
    from .pipeline import StageContext
    from .progress import no_progress
    from .stages import BundleRequest
    from .store import ArtifactStore

    progress = progress or no_progress
    reg = reg or registry()
    layout = layouts_mod.validate(layout, reg)
    backend = bundle_backend(layout)
    out = Path(out).expanduser()
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"{out} exists and is not empty; give a new folder (a bundle is written whole)")
    store = store if isinstance(store, ArtifactStore) else ArtifactStore(store)
    fvlm = open_model(model, store, image_size, progress)
    for stage in STAGES:
        reg.hook.preflight(backend=backend, stage=stage, model=fvlm, options=dict(layout.stages[stage].options))

    def context(stage: str, options=None) -> StageContext:
        opts = dict(layout.stages[stage].options if options is None else options)
        return StageContext(backend, stage, fvlm, opts, store, reg, False, progress)

    with atomic.atomic_directory(out) as tmp:  # the folder appears only when the bundle is complete
        request = BundleRequest(model=fvlm, layout=layout, out_dir=tmp, target=target, context=context,
                                progress=progress)
        manifest = reg.hook.write_bundle(backend=backend, request=request)
        if manifest is None:
            raise BackendError(f"backend '{backend}' does not write bundles (no installed plugin implements"
                               " write_bundle for it)")
        manifest["verified"] = verified(tmp, fvlm, store, reg, target, verify_items, progress)
        (tmp / layouts_mod.BUNDLE_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def verified(folder: Path, model, store, reg, target: str, items: int, progress) -> dict:
    """The figures the bundle in ``folder`` was verified with: ``vlmrun eval`` of the bundle as written."""
    if target != "local":
        return {"items": 0, "why": f"a {target} bundle does not run on this machine; run vlmrun eval -L"
                                   f" bundle:DIR on the device"}
    if items < 1:
        return {"items": 0, "why": "not run (verify_items = 0)"}
    from . import eval as ev

    with progress(f"verifying the bundle on {items} held-out items (vlmrun eval)"):
        run = ev.evaluate([f"bundle:{folder}"], model=model, store=store, registry=reg, limit=items)
    lay = next(x for x in run.report["layouts"] if not x["is_reference"])
    logits = lay.get("drift", {}).get("decoder/logits", {})
    return {"items": lay["items"], "dataset": "held-out generated shapes (vlmrun eval's default)",
            "accuracy": lay["accuracy"]["all"]["accuracy"],
            "reference_accuracy": run.report["layouts"][0]["accuracy"]["all"]["accuracy"],
            "same_answer_as_reference": lay["same_answer_as_reference"], "diff_pass_rate": lay["diff_pass_rate"],
            "logits_sqnr_db": logits.get("sqnr_db"), "top1_agreement": logits.get("top1_agreement"),
            "image_embeds_sqnr_db": lay.get("drift", {}).get("projector/image_embeds", {}).get("sqnr_db")}


def verify(folder: Path, options: dict | None = None, reg=None) -> list[str]:
    """``vlmrun bundle --verify``: what was checked (one line each), or one VlmrunError line."""
    from . import layouts as layouts_mod
    from .errors import BackendError

    reg = reg or registry()
    m = layouts_mod.bundle_manifest(folder)
    checked = reg.hook.verify_bundle(backend=m["backend"], path=Path(folder), options=dict(options or {}))
    if checked is None:
        raise BackendError(f"no installed plugin verifies bundles of backend '{m['backend']}'")
    return checked


@click.command("bundle", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("out", type=click.Path(path_type=Path))
@click.option("--layout", default="all-npu", show_default=True,
              help="Layout preset whose stages (all on one backend) the bundle is made from.")
@click.option("--layout-file", type=click.Path(path_type=Path), help="TOML file with a layout.")
@click.option("--verify-items", type=click.IntRange(0), default=VERIFY_ITEMS, show_default=True,
              help="Held-out items the new bundle is run on (vlmrun eval) before it is handed out; 0: none.")
@click.option("--verify", "verify_only", is_flag=True,
              help="Check the bundle OUT (files, sha256, configs, inputs: what its backend checks) and exit; nothing"
                   " is written. Stage option flags and -o STAGE.KEY=VALUE become the checks' settings (e.g. --soc,"
                   " or the device runtime's SDK).")
@model_options
@stage_option_flags
@click.option("--json", "as_json", is_flag=True, help="Print the manifest (or the checks) as JSON.")
@click.option("--debug", is_flag=True, help="Show tracebacks.")
def bundle_command(out, layout, layout_file, verify_items, verify_only, model_dir, image_size, cache_dir, as_json, debug,
                   **flag_opts):
    """Write the folder a device's app loads: the whole VLM in its backend's own runtime.

    \b
      vlmrun bundle out/                               # all-npu, for this machine
      vlmrun bundle out/ -o decoder.precision=w4a16    # the decoder in 4-bit weights (parts form)
      vlmrun bundle out/ --target android              # for a phone
      vlmrun bundle --verify out/                      # files, hashes, configs: before anything runs
      vlmrun --bundle out/ --image I --prompt P        # run it, in the bundle's own runtime
    \b
    What the folder holds is the backend's (`vlmrun plugins` says which backends write bundles); every bundle has
    vlmrun-bundle.json: the sha256 of every file, versions, recipes.
    """
    from . import layouts as layouts_mod
    from .progress import step

    if verify_only:
        from .options import parse_assignment

        settings = {name[len("opt_"):]: v for name, v in flag_opts.items() if name.startswith("opt_") and v is not None}
        for spec in flag_opts.get("option_specs") or ():
            _, key, value = parse_assignment(spec)
            settings[key] = value
        checks = verify(out, settings)
        if as_json:
            click.echo(json.dumps({"bundle": str(out), "ok": True, "checked": checks}))
        else:
            for line in checks:
                click.echo(f"ok  {line}")
            click.echo(f"bundle {out}: verified", err=True)
        return
    opts = {**flag_opts, "layout": layout, "layout_file": layout_file}
    base = layouts_mod.resolve(layout, layout_file)
    lay = layouts_mod.resolve(layout, layout_file, None, layout_overrides(opts, base, STAGES))
    # --target android: weight-shared part binaries and the extensions config for a phone; local: this machine
    target = str(lay.stages["decoder"].options.get("target") or "local")
    manifest = write(lay, out, model=model_dir, store=cache_dir, target=target, image_size=image_size, progress=step,
                     verify_items=verify_items)
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
