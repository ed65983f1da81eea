"""Bundles: a layout's deployable folder, written and verified by the one backend all its stages are on (the Python
API of ``vlmrun bundle``; `vlmrun.cli_bundle` is its command).

The core only resolves the layout, finds the one backend all its stages are on and hands it a
`vlmrun.stages.BundleRequest` (``write_bundle`` hook) or the folder (``verify_bundle`` hook); what a bundle
holds is the backend's business. The folder appears only when the bundle is complete: it is written into a
temporary directory beside ``OUT`` and renamed. Run one with ``Pipeline.build(layout="bundle:DIR")``.

With ``ray = ADDRESS`` (``vlmrun bundle --ray``) the compiles' independent jobs (the decoder's parts: quantize and
compile) run as Ray tasks on that cluster (`vlmrun.cluster`; each declares one CPU and its memory; every node must
see the store at the same path); the artifacts are the ones a single process makes.
"""

from __future__ import annotations

import json
from pathlib import Path

from . import atomic, cluster, plugins
from . import layouts as layouts_mod
from .errors import BackendError, UsageError
from .model import open_model
from .pipeline import StageContext
from .progress import no_progress
from .stages import STAGES, BundleRequest
from .store import ArtifactStore


def bundle_backend(layout) -> str:
    """The backend every stage of ``layout`` is on (a bundle is one runtime), or one UsageError line."""
    backends = {layout.backend(s) for s in STAGES}
    if len(backends) != 1:
        raise UsageError(f"a bundle is one runtime: every stage must be on the same backend (this layout has"
                         f" {layout.describe()}); use --layout all-npu or a layout file with one backend")
    return backends.pop()


VERIFY_ITEMS = 4  # held-out items a local bundle is run on before it is handed out (its manifest's "verified")


def write(layout, out: Path, *, model=None, store=None, target: str = "local", image_size=None, progress=None,
          reg=None, verify_items: int = VERIFY_ITEMS, ray: str | None = None) -> dict:
    """Write the bundle of ``layout`` to ``out`` (the Python API of ``vlmrun bundle``); its manifest.

    A bundle for this machine (``target = "local"``) is then run as written, through its own runtime, on
    ``verify_items`` held-out items by ``vlmrun eval`` (against the reference layout); the accuracy and drift it
    showed go into its manifest (``verified``). A phone's bundle does not run here: ``verified`` says so.
    ``ray``: the address of a Ray cluster the compiles' jobs run on (joined before anything is written)."""
    progress = progress or no_progress
    reg = reg or plugins.load()
    layout = layouts_mod.validate(layout, reg)
    backend = bundle_backend(layout)
    out = Path(out).expanduser()
    if out.exists() and any(out.iterdir()):
        raise UsageError(f"{out} exists and is not empty; give a new folder (a bundle is written whole)")
    store = store if isinstance(store, ArtifactStore) else ArtifactStore(store)
    executor = cluster.executor(ray, store.root) if ray else None  # joined and checked before any work
    fvlm = open_model(model, store, image_size, progress)
    for stage in STAGES:
        reg.hook.preflight(backend=backend, stage=stage, model=fvlm, options=dict(layout.stages[stage].options))

    def context(stage: str, options=None) -> StageContext:
        opts = dict(layout.stages[stage].options if options is None else options)
        return StageContext(backend, stage, fvlm, opts, store, reg, False, progress, executor=executor)

    with atomic.atomic_directory(out) as tmp:  # the folder appears only when the bundle is complete
        request = BundleRequest(model=fvlm, layout=layout, out_dir=tmp, target=target, context=context,
                                progress=progress)
        manifest = reg.hook.write_bundle(backend=backend, request=request)
        if manifest is None:
            raise BackendError(f"backend '{backend}' does not write bundles (no installed plugin implements"
                               " write_bundle for it)")
        figures = manifest["verified"] = verified(tmp, fvlm, store, reg, target, verify_items, progress)
        failures = verification_failures(figures)
        if figures.get("items"):
            figures["passed"] = not failures
        (tmp / layouts_mod.BUNDLE_MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    if failures:  # written whole (to look into), but never handed out as good: exit 1, and --verify fails on it
        raise BackendError(f"bundle {out} is written but failed its verification: {'; '.join(failures)}; do not"
                           f" ship it: vlmrun diff --device bundle:{out} names where it departs from the reference")
    return manifest


def answers_checked(manifest: dict) -> bool:
    """Whether a bundle was run on held-out items when it was written (a phone's bundle, or one written with
    ``verify_items = 0``, was not: `verify` then checks its files and configs only)."""
    return bool((manifest.get("verified") or {}).get("items"))


def verification_failures(figures: dict) -> list[str]:
    """What the figures a bundle was verified with (its manifest's ``verified``) show wrong: an item asked that it
    could not run, an item whose diff failed (its answer or its logits left the reference beyond the precision's
    thresholds). [] when nothing was run here (a phone's bundle, ``verify_items = 0``)."""
    items = figures.get("items") or 0
    if not items:
        return []
    out = []
    asked = int(figures.get("asked") or items)
    if items < asked:  # an item the bundle could not run is no item it passed
        out.append(f"the bundle ran {items} of the {asked} held-out items asked (the others failed)")
    rate = figures.get("diff_pass_rate")
    diffed = items + int(figures.get("not_run") or 0)
    if rate is None:
        out.append(f"no item of the {items} run was diffed against the reference")
    elif rate < 1:
        out.append(f"vlmrun diff failed on {round(diffed * (1 - rate))} of {diffed} held-out items (same answer as"
                   f" the reference {figures.get('same_answer_as_reference') or 0:.0%})")
    return out


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
    return {"items": lay["items"], "asked": len(run.records), "not_run": lay.get("not_run", 0),
            "dataset": "held-out generated shapes (vlmrun eval's default)",
            "accuracy": lay["accuracy"]["all"]["accuracy"],
            "reference_accuracy": run.report["layouts"][0]["accuracy"]["all"]["accuracy"],
            "same_answer_as_reference": lay["same_answer_as_reference"], "diff_pass_rate": lay["diff_pass_rate"],
            "logits_sqnr_db": logits.get("sqnr_db"), "top1_agreement": logits.get("top1_agreement"),
            "image_embeds_sqnr_db": lay.get("drift", {}).get("projector/image_embeds", {}).get("sqnr_db")}


def verify(folder: Path, options: dict | None = None, reg=None) -> list[str]:
    """``vlmrun bundle --verify``: what was checked (one line each), or one VlmrunError line."""
    reg = reg or plugins.load()
    m = layouts_mod.bundle_manifest(folder)
    checked = reg.hook.verify_bundle(backend=m["backend"], path=Path(folder), options=dict(options or {}))
    if checked is None:
        raise BackendError(f"no installed plugin verifies bundles of backend '{m['backend']}'")
    figures = m.get("verified") or {}
    failures = verification_failures(figures)
    if failures:
        raise BackendError(f"bundle {folder} failed its verification when it was written: {'; '.join(failures)};"
                           f" write it again (vlmrun diff --device bundle:{folder} names where it departs)")
    if answers_checked(m):  # the last line: what was known of its answers
        checked.append(f"verified when written: vlmrun diff passed on all {figures['items']} held-out items")
    else:
        checked.append(f"not verified when written: {figures.get('why') or 'no figures recorded'}")
    return checked
