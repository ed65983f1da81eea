"""Captures: every stage-boundary tensor of one request on one side, run live or saved to / loaded from npz."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Sequence

import attrs
import numpy as np

from ..errors import UsageError, VlmrunError
from ..stages import STAGES

CAPTURE_KEYS = (
    "pixel_values", "input_ids", "image_features", "image_embeds", "text_embeds", "inputs_embeds", "logits", "tokens",
)
#: kept when a side has them: the logits and tokens of a runtime that is not the engine behind the decoder stage
#: (a bundle's own runtime), teacher-forced through that runtime
OPTIONAL_KEYS = ("runtime_logits", "runtime_tokens")


@attrs.define
class Capture:
    """Every stage-boundary tensor of one request on one side, plus what produced it (``meta``)."""

    tensors: dict[str, np.ndarray]
    meta: dict = attrs.field(factory=dict)

    @property
    def tokens(self) -> list[int]:
        return [int(t) for t in np.asarray(self.tensors["tokens"]).reshape(-1)]

    @property
    def forced_tokens(self) -> list[int]:
        """The tokens the decoder was teacher-forced on to produce ``logits``."""
        forced = self.meta.get("teacher_tokens")
        if forced is None:
            return self.tokens if "tokens" in self.tensors else []
        return [int(t) for t in forced]

    @property
    def label(self) -> str:
        return str(self.meta.get("source") or self.meta.get("side") or "?")

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``capture.npz`` (tensors + meta, self-contained) and a readable ``meta.json`` into ``directory``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        meta_json = json.dumps(jsonable(self.meta))
        tmp = d / f".capture.{os.getpid()}.npz"
        with open(tmp, "wb") as fh:
            np.savez(fh, **{k: np.asarray(v) for k, v in self.tensors.items()}, __meta__=np.array(meta_json))
        os.replace(tmp, d / "capture.npz")
        (d / "meta.json").write_text(json.dumps(json.loads(meta_json), indent=2) + "\n")
        return d

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Capture":
        """Read a capture from a directory written by `save` or from its ``capture.npz``."""
        p = Path(path)
        file = p / "capture.npz" if p.is_dir() else p
        if not file.is_file():
            raise UsageError(f"{p} is not a vlmrun capture (no capture.npz); give a directory written by --save")
        try:
            with np.load(file, allow_pickle=False) as data:
                tensors = {k: data[k] for k in data.files if k != "__meta__"}
                meta = json.loads(str(data["__meta__"])) if "__meta__" in data.files else {}
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot read capture {file}: {exc}") from None
        # image_features may be absent: a runtime that fuses vision and projector (a bundle) has no such tensor
        missing = [k for k in CAPTURE_KEYS if k not in tensors and k != "image_features"]
        if missing:
            raise UsageError(f"capture {file} lacks {', '.join(missing)}; it was not written by vlmrun diff --save")
        meta.setdefault("loaded_from", str(file))
        return cls(tensors, meta)


def load_from(paths: Sequence[str | os.PathLike]) -> tuple[Capture | None, Capture | None]:
    """Resolve ``--from`` arguments to (reference, device) captures; ``None`` means "run that side live".

    No path: both live. One path: a directory written by ``--save`` (with ``reference/`` and ``device/``) gives
    both sides; otherwise it is the reference side and the device runs live, teacher-forced on its tokens.
    Two paths: reference then device.
    """
    paths = [Path(p) for p in paths]
    if not paths:
        return None, None
    if len(paths) > 2:
        raise UsageError(f"--from takes at most two captures (reference, then device); got {len(paths)}")
    if len(paths) == 1:
        p = paths[0]
        if (p / "reference").is_dir() and (p / "device").is_dir():
            return Capture.load(p / "reference"), Capture.load(p / "device")
        return Capture.load(p), None
    # a --save folder holds both sides of its run; from two of them, the device sides are compared (a host run
    # against a phone run of the same request), e.g. vlmrun diff --from host-run/ --from phone-run/
    sides = [p / "device" if (p / "device").is_dir() and not (p / "capture.npz").exists() else p for p in paths]
    for p, side in zip(paths, sides):
        if not (side / "capture.npz").exists() and (p / "reference").is_dir():
            raise UsageError(f"{p} holds no device capture; name one: {p / 'reference'}")
    if sides[0].resolve() == sides[1].resolve():
        raise UsageError(f"both --from name the same capture ({sides[0]}): it would pass against itself; give the"
                         " reference's capture, then the device's")
    return Capture.load(sides[0]), Capture.load(sides[1])


def _base_meta(model, image_desc: str, prompt: str, settings, teacher_tokens, tokens=()) -> dict:
    from .. import __version__

    try:
        text = model.tokenizer.decode([int(t) for t in tokens], skip_special_tokens=True)
    except Exception:  # the text is a convenience for the report; never fail a capture over it
        text = None
    return {
        "text": text,
        "model": str(getattr(model, "source", "")),
        "image": image_desc,
        "prompt": prompt,
        "max_new_tokens": settings.max_new_tokens,
        "ignore_eos": settings.ignore_eos,
        "teacher_tokens": None if teacher_tokens is None else [int(t) for t in teacher_tokens],
        "vlmrun_version": __version__,
        "host": platform.node(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def capture_pipeline(pipe, image, prompt: str, settings, teacher_tokens=None, image_desc: str = "") -> Capture:
    """Capture one request on a `vlmrun.pipeline.Pipeline` (a layout)."""
    tensors = pipe.capture(image, prompt, settings, teacher_tokens=teacher_tokens)
    meta = _base_meta(pipe.model, image_desc, prompt, settings, teacher_tokens, tensors["tokens"])
    meta.update(source=f"layout {pipe.layout.name}", layout={s: pipe.layout.backend(s) for s in STAGES})
    if pipe.runtime_name is not None:
        meta["runtime"] = pipe.runtime_name
    # a runtime that fuses stages (a bundle's image encoder: vision + projector) has no tensor between them
    return Capture({k: np.asarray(tensors[k]) for k in (*CAPTURE_KEYS, *OPTIONAL_KEYS) if k in tensors}, meta)


def _prepare(model, image, prompt: str, system: str | None = None):
    """pixel_values, input_ids, image_start exactly as `Pipeline.prepare` makes them."""
    from ..preprocess import load_image, preprocess_image, render_prompt, tokenize_prompt

    if isinstance(image, (str, os.PathLike)):
        image = load_image(image)
    pixel_values = preprocess_image(image, model.image_processor_config)
    text = render_prompt(model.chat_template, prompt, system)
    ids, start = tokenize_prompt(model.tokenizer, text, model.image_token_id, model.image_tokens)
    return pixel_values, ids, start


def capture_torch(model, image, prompt: str, settings, teacher_tokens=None, image_desc: str = "") -> Capture:
    """Capture the same boundary tensors from the torch eager model (transformers, float32).

    vision, projector and embed are `vlmrun.torch_stages`; logits = a full forward on the spliced
    ``inputs_embeds`` plus the embedded teacher tokens; free-running tokens from greedy ``generate``.
    """
    import torch

    from ..preprocess import splice
    from ..torch_stages import embed_tokens, project, vision_features

    tm = model.load_torch()
    pixel_values, ids, start = _prepare(model, image, prompt, settings.system)
    budget = min(settings.max_new_tokens, model.max_context - ids.shape[1])
    if budget < 1:
        raise VlmrunError(f"the prompt is {ids.shape[1]} tokens and fills the context of {model.max_context}")
    stops = frozenset() if settings.ignore_eos else model.stop_ids
    with torch.no_grad():
        pv = torch.from_numpy(pixel_values)
        feats = vision_features(tm, pv)
        img = project(tm, feats)
        txt = embed_tokens(tm, torch.from_numpy(ids))
        embeds = splice(txt.numpy(), img.numpy(), start)
        ids_t = torch.from_numpy(ids)
        gen_kwargs = dict(max_new_tokens=budget, do_sample=False, pad_token_id=0)
        if stops:
            gen_kwargs["eos_token_id"] = sorted(stops)
        else:
            gen_kwargs.update(eos_token_id=None, min_new_tokens=budget)
        out = tm.generate(input_ids=ids_t, attention_mask=torch.ones_like(ids_t), pixel_values=pv, **gen_kwargs)
        tokens: list[int] = []
        for t in out[0, ids.shape[1]:].tolist():
            tokens.append(int(t))
            if int(t) in stops:
                break
        forced = list(teacher_tokens if teacher_tokens is not None else tokens)
        full = torch.from_numpy(embeds)
        if forced:
            full = torch.cat([full, embed_tokens(tm, torch.tensor([forced], dtype=torch.long))], dim=1)
        logits = tm(inputs_embeds=full, attention_mask=torch.ones(full.shape[:2], dtype=torch.long)).logits
    tensors = {
        "pixel_values": pixel_values,
        "input_ids": ids,
        "image_features": feats.numpy().astype(np.float32),
        "image_embeds": img.numpy().astype(np.float32),
        "text_embeds": txt.numpy().astype(np.float32),
        "inputs_embeds": embeds.astype(np.float32),
        "logits": logits[:, embeds.shape[1] - 1:, :].numpy().astype(np.float32),
        "tokens": np.asarray(tokens, dtype=np.int64),
    }
    meta = _base_meta(model, image_desc, prompt, settings, teacher_tokens, tokens)
    import transformers

    meta.update(source="torch eager (fp32)", layout=dict.fromkeys(STAGES, "torch"),
                torch_version=torch.__version__, transformers_version=transformers.__version__)
    return Capture(tensors, meta)


def jsonable(obj):
    """``obj`` with numpy values as Python ones and non-finite floats as strings (strict JSON)."""
    if isinstance(obj, dict):
        return {str(k): jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return jsonable(obj.tolist())
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        v = float(obj)
        return v if np.isfinite(v) else str(v)
    if isinstance(obj, Path):
        return str(obj)
    return obj

