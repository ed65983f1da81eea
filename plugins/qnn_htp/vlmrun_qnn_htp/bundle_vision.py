"""A bundle's vision side: the image encoder's binary, the token table (LUT) and the range of the decoder's input
embeddings (`embeds_encoding`), made before the decoder (`vision_side`).

For a big model they are made in a child process of their own (`.memory.in_child`), which ends before the
decoder's export starts: the image encoder's calibration at the model's picture size (1024 px for FastVLM) and
the reference pipeline that measures the embeddings' range leave gigabytes in the process that ran them (at
FastVLM-0.5B dimensions 2.0 GB, with the heap handed back, under the decoder's export; the bundle's largest process
went from 10,252 to 9,032 MB, docs/models.md). The child loads the installed plugins (entry points) and leaves
its artifacts in the store; this process then takes them from there (store hits, the same files), so the bundle's
bytes do not depend on where they were made. A small model (the tiny default) makes them here: a child's start
(imports, plugins) would cost more than it saves.
"""

from __future__ import annotations

import pickle
import random

import attrs
import numpy as np

from vlmrun import plugins, shapes
from vlmrun.demo_image import demo_image
from vlmrun.model import FastVLMModel
from vlmrun.pipeline import Pipeline, StageContext
from vlmrun.preprocess import load_image
from vlmrun.progress import no_progress
from vlmrun.stages import ExportForm
from vlmrun.store import ArtifactStore

from . import image_encoder
from .calibration import calibration_files
from .memory import in_child
from .options import compiled_artifact
from .plan import StagePlan

#: the pictures the decoder input's range is calibrated on when the layout names none: the demo picture and this many
#: generated scenes (vlmrun.shapes, a seed of their own), and how far past their range the encoding reaches
CALIBRATION_SCENES, CALIBRATION_SEED, RANGE_MARGIN = 16, 2, 2.0
#: a checkpoint of at least this many bytes (its weight files) makes the vision side in a child process
CHILD_FROM_BYTES = 1 << 30


@attrs.frozen
class VisionSide:
    """What the bundle takes from its vision side: the image encoder's compiled artifact, the LUT's exported
    artifact (``embed_lut_f32.npy``) and the decoder input's encoding (`embeds_encoding`)."""

    image_encoder: object
    lut: object
    embeds: dict


def vision_side(request) -> VisionSide:
    """The vision side of the bundle of ``request`` (a `vlmrun.stages.BundleRequest`), through the store: in a
    child process first when the checkpoint has at least `CHILD_FROM_BYTES` (see the module docstring)."""
    ctx = request.context("vision")
    embeds = None
    if request.model.weight_file_bytes >= CHILD_FROM_BYTES:
        progress = request.progress if _picklable(request.progress) else no_progress
        options = dict(request.layout.stages["vision"].options)  # what request.context("vision") was made of
        embeds = in_child(_make_in_child, ctx.backend, request.model, str(ctx.store.root), options, progress,
                          what="the bundle's image encoder")
    return _make(ctx, embeds)


def _picklable(obj) -> bool:
    try:
        pickle.dumps(obj)
    except Exception:  # noqa: BLE001 (a closure, a lock: the child shows no progress then)
        return False
    return True


def _make_in_child(backend: str, model: FastVLMModel, store_root: str, options: dict, progress) -> dict:
    ctx = StageContext(backend, "vision", model, options, ArtifactStore(store_root), plugins.load(), False, progress)
    return _make(ctx, None).embeds


def _make(ctx, embeds: dict | None) -> VisionSide:
    vis = StagePlan.of("vision", ctx.options)
    enc_art = compiled_artifact(ctx, "vision", vis.opts, ExportForm.of("vision", image_encoder.FORM))
    lut_art = ctx.exported(ExportForm.of("embed", "embed/lut"))
    if embeds is None:
        lut = np.load(lut_art.file("embed_lut_f32.npy"), mmap_mode="r")
        with ctx.progress("measuring the range of the decoder's input embeddings"):  # 105 s at 1024 px
            embeds = embeds_encoding(ctx.model, ctx.store, ctx.options.get("calibration_images"), lut)
    return VisionSide(enc_art, lut_art, embeds)


def embeds_encoding(model, store, calibration_images, lut) -> dict:
    """The uint16 encoding of the decoder's ``inputs_embeds`` in a bundle: the range of the token table and of the
    image encoder's outputs on the calibration pictures (the vision stage's ``calibration_images``, else the demo
    picture and generated scenes), widened to twice that range. Genie quantizes the image's embeddings into it
    WITHOUT clamping: a value outside the range wraps around (measured: a held-out picture whose embeddings reached
    -13.2 against a range from -11.2, calibrated then on the demo picture alone with a quarter's margin, made Genie
    depart from the engine, which saturates, at 22.8 dB); the table is stored in it."""
    ref = Pipeline.build(model, "reference", store=store, stages=("vision", "projector"))
    images = [demo_image()]
    if calibration_images:
        images += [load_image(f) for f in calibration_files(calibration_images)[:16]]
    else:
        rng = random.Random(CALIBRATION_SEED)
        images += [shapes.render(shapes.random_scene(rng)) for _ in range(CALIBRATION_SCENES)]
    lo = hi = 0.0
    for img in images:
        p = ref.prepare(img, "x")
        e = ref.run_stage("projector", ref.run_stage("vision", {"pixel_values": p.pixel_values}))["image_embeds"]
        lo, hi = min(lo, float(e.min())), max(hi, float(e.max()))
    image_range = [lo, hi]
    lo, hi = min(lo, float(np.min(lut))), max(hi, float(np.max(lut)))
    lo, hi = float(f"{lo * RANGE_MARGIN:.3g}"), float(f"{hi * RANGE_MARGIN:.3g}")
    return {**image_encoder.range_encoding(lo, hi), "option": f"uint16:{lo:g}:{hi:g}", "image_range": image_range}
