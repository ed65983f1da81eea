"""``vlmrun diff``: capture every stage boundary on two sides and say which stage broke.

A *side* is a layout run by the `vlmrun.pipeline.Pipeline` (``reference``, ``all-npu``, a layout file,
per-stage overrides), the torch eager model (``torch``), or a capture saved earlier (``--from``). Both sides
get the same image and prompt; the reference side is captured first and the device side's decoder is then fed
the reference tokens (teacher forcing), so the per-step logits stay comparable after the first divergent token.

>>> from vlmrun import diff
>>> run = diff.run("torch", "reference", image="photo.jpg", prompt="Describe the image.")
>>> run.result.passed, run.result.culprit
>>> print(diff.format_table(run.result)); diff.write_report(run, "out/")

Checkpoints, in pipeline order (the first whose thresholds fail is named the likely culprit)::

    preprocess  pixel_values, input_ids      (host side; differs only between machines or versions)
    vision      image_features
    projector   image_embeds
    embed       text_embeds
    splice      inputs_embeds                (image embeds spliced into the text embeds)
    decoder     logits, teacher-forced       (+ per step: top-1 agreement, top-5 overlap, KL(ref || dev))
    generation  tokens, free-running         (matching tokens, first divergent step)

Modules, in the order of the flow: `.capture` (running a side, npz captures), `.metrics`,
`.thresholds`, `.compare` (verdict and culprit), `.report` (table, JSON, HTML); `run`
ties them together. `.locate` goes inside a stage layer by layer (``--locate``) and tries a layer at higher
precision (``--what-if``) on the pipelines a run keeps (`DiffRun.pipelines`).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING, Mapping, Sequence

import attrs

from .. import layouts
from ..errors import UsageError
from .capture import CAPTURE_KEYS, Capture, capture_pipeline, capture_torch, load_from
from .compare import Check, DiffResult, Entry, compare
from .metrics import (
    CHECK_STAGES, CHECKPOINTS, GENERATION_METRICS, IDS_METRICS, LOGITS_METRICS, METRICS_OF_STAGE, SQNR_CAP_DB,
    TENSOR_METRICS, generation_metrics, logits_steps, tensor_metrics,
)
from .report import format_table, save_run, write_report
from . import thresholds as _thresholds
from .thresholds import (
    check_key, check_precision, infer_precision, parse_threshold, precisions, read_thresholds_file, thresholds_for,
)

if TYPE_CHECKING:
    from ..pipeline import Pipeline

__all__ = [
    "CAPTURE_KEYS", "CHECKPOINTS", "CHECK_STAGES", "DEFAULT_PROMPT", "DEFAULT_THRESHOLDS", "GENERATION_METRICS",
    "IDS_METRICS", "LOGITS_METRICS", "METRICS_OF_STAGE", "PRECISIONS", "SQNR_CAP_DB", "TENSOR_METRICS", "TORCH",
    "Capture", "Check", "DiffResult", "DiffRun", "Entry", "Side", "UsageError", "capture_pipeline", "capture_torch",
    "compare", "format_table", "generation_metrics", "infer_precision", "load_from", "logits_steps",
    "parse_threshold", "precisions", "read_thresholds_file", "run", "save_run", "tensor_metrics", "thresholds_for",
    "write_report",
]

TORCH = "torch"


def __getattr__(name: str):
    """``PRECISIONS`` and ``DEFAULT_THRESHOLDS`` come from the installed plugins (`vlmrun.diff.thresholds`)."""
    if name in ("PRECISIONS", "DEFAULT_THRESHOLDS"):
        return getattr(_thresholds, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
DEFAULT_PROMPT = "Describe the image."


@attrs.frozen
class Side:
    """What to run on one side: ``torch`` or a layout (preset name or TOML file) with per-stage overrides."""

    layout: str = "reference"
    overrides: Mapping[str, str | None] = attrs.field(factory=dict)

    @property
    def is_torch(self) -> bool:
        return self.layout == TORCH

    def describe(self) -> str:
        extra = " ".join(f"{s}={b}" for s, b in self.overrides.items() if b)
        return self.layout + (f" ({extra})" if extra else "")


@attrs.define
class DiffRun:
    reference: Capture
    device: Capture
    result: DiffResult
    timings: dict = attrs.field(factory=dict)
    pipelines: dict = attrs.field(factory=dict)  # side -> the Pipeline that ran it live (for --locate)
    location: object = None  # a locate.Location when --locate ran


def _side(value):
    from ..pipeline import Pipeline

    return value if isinstance(value, (Side, Pipeline)) else Side(str(value))


def _describe(side) -> str:
    return side.describe() if isinstance(side, Side) else f"layout {side.layout.name}"


def _build_pipeline(side, model, store, registry, progress):
    from ..pipeline import Pipeline

    if isinstance(side, Pipeline):
        return side
    if side.is_torch:
        if any(side.overrides.values()):
            raise UsageError("per-stage overrides do not apply to the torch reference")
        return None
    layout, layout_file = side.layout, None
    if "," not in layout and layouts.is_layout_file(layout):  # a spec with overrides: layouts.resolve reads it
        layout, layout_file = None, Path(layout)
        if not layout_file.is_file():
            raise UsageError(f"layout file {layout_file} does not exist")
    return Pipeline.build(model, layout, overrides=dict(side.overrides), layout_file=layout_file, store=store,
                          registry=registry, progress=progress)


def _check_two_sides(ref_side, ref_pipe, dev_side, dev_pipe) -> None:
    """Two sides named (not passed as built pipelines) that resolve to the same stages, backends and options would
    pass against each other whatever they answer: a usage error, not a PASS."""
    if not (isinstance(ref_side, Side) and isinstance(dev_side, Side)):
        return
    if ref_side.is_torch or dev_side.is_torch:
        same = ref_side.is_torch and dev_side.is_torch
    else:
        same = ref_pipe.layout.stages == dev_pipe.layout.stages and ref_pipe.layout.bundle == dev_pipe.layout.bundle
    if same:
        raise UsageError(f"the device side ({dev_side.describe()}) is the reference side ({ref_side.describe()}):"
                         " the diff would compare it with itself; name the layout under test, e.g. --device all-npu,"
                         " --device L.toml or --device-STAGE PLUGIN")


def run(
    reference: "str | Side | Pipeline" = "reference",
    device: "str | Side | Pipeline" = "reference",
    *,
    image=None,
    prompt: str | None = None,
    model=None,
    store=None,
    registry=None,
    max_new_tokens: int | None = None,
    ignore_eos: bool = False,
    precision: str | None = None,
    thresholds: Mapping[str, Mapping[str, float | None]] | None = None,
    thresholds_file: str | os.PathLike | None = None,
    from_dirs: Sequence[str | os.PathLike] = (),
    image_size: int | None = None,
    progress=None,
) -> DiffRun:
    """Capture both sides (or load them, ``from_dirs``) and compare them; see the module docstring.

    A side is ``"torch"``, a layout name or TOML file, a `Side` (layout + per-stage overrides), or an
    already built `vlmrun.pipeline.Pipeline` (reused as is).

    ``image`` defaults to the built-in demo image, ``prompt`` to "Describe the image." (or what a loaded
    reference capture used). Thresholds: defaults of ``precision`` < ``thresholds_file`` < ``thresholds``.
    """
    from ..model import open_model
    from ..pipeline import GenerationSettings
    from ..progress import no_progress
    from ..store import ArtifactStore

    progress = progress or no_progress
    file_precision, file_thresholds = (read_thresholds_file(thresholds_file, registry) if thresholds_file
                                       else (None, {}))
    for stage, metrics in (thresholds or {}).items():
        for metric in metrics:
            check_key(stage, metric, f"{stage}.{metric}")
    if precision is not None:
        check_precision(precision, registry)
    ref_cap, dev_cap = load_from(from_dirs)
    ref_side, dev_side = _side(reference), _side(device)
    timings: dict[str, float] = {}
    pipelines: dict = {}
    fvlm = None

    if ref_cap is None or dev_cap is None:
        if ref_cap is not None:
            prompt = prompt if prompt is not None else ref_cap.meta.get("prompt")
            if image is None and ref_cap.meta.get("image") not in (None, "", "<demo image>"):
                image = ref_cap.meta["image"]
            if max_new_tokens is None:
                max_new_tokens = ref_cap.meta.get("max_new_tokens")
            ignore_eos = ignore_eos or bool(ref_cap.meta.get("ignore_eos"))
        prompt = prompt if prompt is not None else DEFAULT_PROMPT
        max_new_tokens = int(max_new_tokens or 32)
        if max_new_tokens < 1:
            raise UsageError("--max-new-tokens must be at least 1")
        if image is None:
            from ..demo_image import demo_image

            image, image_desc = demo_image(), "<demo image>"
        else:
            image_desc = str(image)
            if isinstance(image, (str, os.PathLike)) and not Path(image).is_file():
                raise UsageError(f"image {image} does not exist")
        if not isinstance(store, ArtifactStore):
            store = ArtifactStore(store)
        fvlm = open_model(model, store, image_size, progress)
        if registry is None:
            from .. import plugins as plugins_mod

            registry = plugins_mod.load()
        settings = GenerationSettings(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
        # build the device side first: layout errors (unknown plugin, ...) surface before any long capture
        dev_pipe = _build_pipeline(dev_side, fvlm, store, registry, progress)
        pipelines["device"] = dev_pipe
        if ref_cap is None:
            ref_pipe = _build_pipeline(ref_side, fvlm, store, registry, progress)
            pipelines["reference"] = ref_pipe
            _check_two_sides(ref_side, ref_pipe, dev_side, dev_pipe)
            t = time.perf_counter()
            with progress(f"capturing the reference side ({_describe(ref_side)})"):
                if ref_pipe is None:
                    ref_cap = capture_torch(fvlm, image, prompt, settings, image_desc=image_desc)
                else:
                    ref_cap = capture_pipeline(ref_pipe, image, prompt, settings, image_desc=image_desc)
            timings["reference_s"] = time.perf_counter() - t
            ref_cap.meta["side"] = "reference"
        t = time.perf_counter()
        with progress(f"capturing the device side ({_describe(dev_side)}), teacher-forced"):
            if dev_pipe is None:
                dev_cap = capture_torch(fvlm, image, prompt, settings, ref_cap.tokens, image_desc)
            else:
                dev_cap = capture_pipeline(dev_pipe, image, prompt, settings, ref_cap.tokens, image_desc)
        timings["device_s"] = time.perf_counter() - t
        dev_cap.meta["side"] = "device"
        if dev_pipe is not None:
            dev_cap.meta["layout_options"] = dev_pipe.layout_options()

    if precision is None:
        precision = file_precision or infer_precision(dev_cap.meta.get("layout_options"), registry)
    table = thresholds_for(precision, file_thresholds, thresholds or {}, registry=registry)
    t = time.perf_counter()
    result = compare(ref_cap, dev_cap, table, precision)
    if fvlm is not None:  # the ids a verdict names, spelt
        ids = {int(t) for k in ("ref_argmax", "runtime_argmax") for t in result.steps.get(k, [])}
        result.token_text = {t: fvlm.tokenizer.decode([t]) for t in sorted(ids)}
    timings["compare_s"] = time.perf_counter() - t
    return DiffRun(ref_cap, dev_cap, result, timings, {k: v for k, v in pipelines.items() if v is not None})

