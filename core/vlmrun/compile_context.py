"""Reference activations for a compiler: the core's side of a compile (`vlmrun.stages.CompileContext`), answered from
a pipeline on the ``reference`` layout over the same model and store.

A compiler asks for them to calibrate a quantized stage: the inputs the stage sees on demo or given pictures and
prompts (`ReferenceCompileContext.reference_inputs`), embeddings of token ids, a state directory of its own for
the artifact. The reference pipeline runs only the stages upstream of the one compiled and is built on first use
by `ReferenceCompileContext.build_reference`, which `vlmrun.pipeline.StageCompileContext` implements.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from .preprocess import load_image, preprocess_image
from .stages import CompileContext

CALIBRATION_PROMPT = "Describe the image."

#: The stages whose outputs a stage's inputs are made of (a reference pipeline needs at least one stage: ``embed``).
UPSTREAM = {"vision": (), "projector": ("vision",), "embed": (), "decoder": ("vision", "projector", "embed")}


class ReferenceCompileContext(CompileContext):
    """A `vlmrun.stages.CompileContext` for the compile of one artifact of ``stage_ctx``'s stage: reference
    activations come from a reference pipeline of the stages upstream of it, built on first use by
    `build_reference`."""

    def __init__(self, stage_ctx, artifact: str):
        self._ctx = stage_ctx
        self._artifact = artifact
        self._pipe = None  # the reference pipeline (`vlmrun.pipeline.Pipeline`), built on first use

    def build_reference(self, stages: tuple[str, ...]):
        """A ``reference``-layout pipeline of ``stages`` over the stage context's model and store."""
        raise NotImplementedError

    def _reference(self):
        if self._pipe is None:
            self._pipe = self.build_reference(UPSTREAM[self._ctx.stage] or ("embed",))
        return self._pipe

    def release_reference(self) -> None:
        self._pipe = None

    def reference_inputs(self, images=None, prompts=None) -> list[dict[str, np.ndarray]]:
        from .demo_image import demo_image

        c = self._ctx
        images = list(images or [demo_image()])
        prompts = list(prompts or [CALIBRATION_PROMPT])
        n = max(len(images), len(prompts))
        pairs = [(images[i % len(images)], prompts[i % len(prompts)]) for i in range(n)]
        out = []
        for img, prompt in pairs:
            if c.stage == "vision":
                if isinstance(img, (str, os.PathLike)):
                    img = load_image(img)
                out.append({"pixel_values": preprocess_image(img, c.model.image_processor_config)})
                continue
            pipe = self._reference()
            prepared = pipe.prepare(img, prompt)
            if c.stage == "projector":
                out.append({"image_features": pipe.run_stage("vision", {"pixel_values": prepared.pixel_values})[
                    "image_features"]})
            elif c.stage == "embed":
                out.append({"input_ids": prepared.input_ids})
            else:
                out.append({"inputs_embeds": pipe.embed_prompt(prepared)})
        return out

    def embed_tokens(self, ids: np.ndarray) -> np.ndarray:
        return self._reference().embed_tokens(ids)

    def state_dir(self) -> Path:
        return self._ctx.store.state_dir(self._artifact)

    def progress(self, label: str):
        return self._ctx.progress(label)
