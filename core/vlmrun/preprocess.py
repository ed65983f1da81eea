"""Inputs exactly as the real model prepares them, without torch.

Image: pad to square with the processor's mean colour (black for FastVLM, as Apple's ``image_aspect_ratio:
pad``), then the checkpoint's CLIP image processor (resize shortest edge, bicubic; centre crop; x/255;
normalise). Prompt: the tokenizer's own chat template, tokenized with the checkpoint's tokenizer.json; the
``<image>`` placeholder is expanded to one position per image token, where the image embeddings are spliced.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import numpy as np

from .errors import InputError, UsageError

IMAGE_PLACEHOLDER = "<image>"


def load_image(path: str | os.PathLike):
    """Open an image file as RGB, with one clear error for missing, unreadable, non-image or truncated files.

    An image over Pillow's decompression-bomb limit (``2 * Image.MAX_IMAGE_PIXELS`` pixels) is a usage error that
    names its pixel count and the limit."""
    from PIL import Image, UnidentifiedImageError

    p = Path(path)
    if not p.exists():
        raise InputError(f"image not found: {p}")
    if p.is_dir():
        raise InputError(f"image path is a directory, not a file: {p}")
    try:
        with Image.open(p) as im:
            im.load()
            if im.mode.startswith("I") or im.mode == "F":  # Pillow clips these to 0..255: a 16-bit picture turns white
                return _to_8bit(im, p).convert("RGB")
            return im.convert("RGB")
    except Image.DecompressionBombError as exc:
        raise UsageError(_bomb_message(p, exc, Image.MAX_IMAGE_PIXELS)) from None
    except UnidentifiedImageError:
        raise InputError(f"{p} is not an image file Pillow can read (give a JPEG, PNG, ...)") from None
    except PermissionError:
        raise InputError(f"cannot read image {p}: permission denied") from None
    except (OSError, SyntaxError, ValueError) as exc:
        raise InputError(f"image {p} is truncated or corrupt ({exc}); re-export or re-download it") from None


def _to_8bit(im, p: Path):
    """A 16-bit or 32-bit integer picture (PNG/TIFF ``I;16``, ``I``: 0..65535) or a float one (``F``: 0..1, or
    0..255 when its values pass 1) as 8-bit grey, rescaled by its range instead of clipped; values outside that
    range are one InputError."""
    import numpy as np
    from PIL import Image

    a = np.asarray(im, dtype=np.float64)
    if im.mode == "F":
        top = 1.0 if a.size and np.nanmax(a) <= 1.0 else 255.0
    else:
        top = 65535.0
    if not np.isfinite(a).all() or a.min(initial=0) < 0 or a.max(initial=0) > top:
        raise InputError(f"image {p} is a {im.mode} picture with values outside 0..{top:g}; save it as an 8-bit or"
                         " 16-bit PNG or JPEG")
    return Image.fromarray(np.rint(a * (255.0 / top)).astype(np.uint8))  # 2-D uint8: mode L


def _bomb_message(p: Path, exc: Exception, max_pixels: int | None) -> str:
    import re

    # Pillow: "Image size (N pixels) exceeds limit of M pixels, could be decompression bomb DOS attack."
    m = re.search(r"\((\d+) pixels\).*?limit of (\d+) pixels", str(exc))
    if m:
        pixels, limit = f"{int(m[1]):,} pixels", f"{int(m[2]):,} pixels"
    else:
        pixels = "more pixels"
        limit = f"{2 * max_pixels:,} pixels" if max_pixels else "its limit"
    return (f"image {p} has {pixels}, over Pillow's decompression-bomb limit of {limit}; downscale it first"
            " (the model resizes it to its own input size anyway)")


def pad_to_square(image, fill: tuple[int, int, int]):
    from PIL import Image

    w, h = image.size
    if w == h:
        return image
    side = max(w, h)
    out = Image.new("RGB", (side, side), fill)
    out.paste(image, ((side - w) // 2, (side - h) // 2))
    return out


def preprocess_image(image, processor_config: dict) -> np.ndarray:
    """PIL image -> ``pixel_values`` float32 [1, 3, S, S] per a CLIPImageProcessor config."""
    from PIL import Image

    cfg = processor_config
    mean = np.asarray(cfg.get("image_mean", [0.0, 0.0, 0.0]), dtype=np.float32)
    std = np.asarray(cfg.get("image_std", [1.0, 1.0, 1.0]), dtype=np.float32)
    image = pad_to_square(image.convert("RGB"), tuple(int(m * 255) for m in mean))
    size = cfg.get("size", {})
    if cfg.get("do_resize", True):
        short = size.get("shortest_edge") if isinstance(size, dict) else size
        w, h = image.size
        if short:
            if w <= h:
                new = (int(short), int(short * h / w))
            else:
                new = (int(short * w / h), int(short))
        else:
            new = (int(size["width"]), int(size["height"]))
        resample = Image.Resampling(int(cfg.get("resample", 3)))
        if new != image.size:
            image = image.resize(new, resample=resample)
    if cfg.get("do_center_crop", True):
        crop = cfg.get("crop_size", {})
        ch, cw = (crop["height"], crop["width"]) if isinstance(crop, dict) else (crop, crop)
        w, h = image.size
        top, left = (h - ch) // 2, (w - cw) // 2
        image = image.crop((left, top, left + cw, top + ch))
    x = np.asarray(image, dtype=np.float32)
    if cfg.get("do_rescale", True):
        x = x * np.float32(cfg.get("rescale_factor", 1 / 255))
    if cfg.get("do_normalize", True):
        x = (x - mean) / std
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None], dtype=np.float32)


def render_prompt(chat_template: str, question: str, system: str | None = None) -> str:
    """The chat template applied to one user turn with the image first, plus the generation prompt."""
    messages = []
    if system is not None:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]})
    return render_messages(chat_template, messages)


ROLES = ("system", "user", "assistant")


def render_messages(chat_template: str, messages) -> str:
    """The chat template applied to a whole conversation, plus the generation prompt.

    ``messages``: ``{"role": "system" | "user" | "assistant", "content": str | [parts]}`` in order, a part being
    ``{"type": "text", "text": ...}`` or ``{"type": "image"}`` (the picture, where it appears: once in the whole
    conversation). Every turn is rendered, the assistant's answers included, as the model was trained on them."""
    images = count_images(messages)
    if images != 1:
        raise InputError(f"FastVLM answers about one picture per conversation; these messages hold {images}")
    return render_conversation(chat_template, messages)


def count_images(messages) -> int:
    """The pictures of ``messages`` (``{"type": "image"}`` parts); each role checked to be one of `ROLES`."""
    images = 0
    for i, m in enumerate(messages):
        if m.get("role") not in ROLES:
            raise InputError(f"message {i}: role {m.get('role')!r} is not one of {', '.join(ROLES)}")
        content = m.get("content")
        texts = [content] if isinstance(content, str) else [p.get("text") or "" for p in content]
        if any(IMAGE_PLACEHOLDER in t for t in texts):
            raise InputError(placeholder_in_text(i))
        if not isinstance(content, str):
            images += sum(1 for part in content if part.get("type") == "image")
    return images


def placeholder_in_text(i: int) -> str:
    """The error for a message whose text holds the picture placeholder (it would be read as a picture)."""
    return (f"message {i}'s text holds {IMAGE_PLACEHOLDER}, the model's picture placeholder: a picture is given as an"
            " image, not typed into the text; write it otherwise (e.g. 'image')")


def render_conversation(chat_template: str, messages) -> str:
    """`render_messages` for a conversation with any number of pictures (none, or one in several turns): one
    ``<image>`` placeholder where each picture appears, in order."""
    images = count_images(messages)
    text = _compiled_template(chat_template).render(messages=list(messages), add_generation_prompt=True)
    if text.count(IMAGE_PLACEHOLDER) != images:
        raise InputError(f"the model's chat template placed {text.count(IMAGE_PLACEHOLDER)} <image> placeholders for"
                         f" {images} pictures; cannot splice them")
    return text


def _raise_exception(message):
    raise InputError(f"chat template error: {message}")


@functools.lru_cache(maxsize=8)
def _compiled_template(chat_template: str):
    """A chat template compiled once per process (as transformers caches it): compiling took 35 ms, as long as a
    decoder step of the tiny model, on every prompt rendered."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    return env.from_string(chat_template)


def check_utf8(text: str) -> None:
    """One InputError for text that is not UTF-8 (a byte a shell or a file could not decode, kept by Python as a
    lone surrogate; JSON's \\ud800 too): the tokenizer would fail with a TypeError."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InputError(f"the prompt is not valid UTF-8 text (character {exc.start} of its rendered form); give"
                         " it as UTF-8") from None


def tokenize_conversation(tokenizer, text: str, image_token_id: int, image_tokens: int) -> tuple[np.ndarray, list[int]]:
    """Token ids [1, T] int64 with every ``<image>`` placeholder expanded to ``image_tokens`` copies, and where
    each picture's positions start (in order). The text between placeholders is tokenized piece by piece, as
    `tokenize_prompt` does for one picture."""
    check_utf8(text)
    pieces = text.split(IMAGE_PLACEHOLDER)
    ids: list[int] = []
    starts: list[int] = []
    for i, piece in enumerate(pieces):
        if i:
            starts.append(len(ids))
            ids += [image_token_id] * image_tokens
        ids += tokenizer.encode(piece, add_special_tokens=False).ids
    return np.asarray([ids], dtype=np.int64), starts


def tokenize_prompt(tokenizer, text: str, image_token_id: int, image_tokens: int) -> tuple[np.ndarray, int]:
    """Token ids [1, T] int64 with the placeholder expanded to ``image_tokens`` copies, and where it starts."""
    check_utf8(text)
    before, _, after = text.partition(IMAGE_PLACEHOLDER)
    if IMAGE_PLACEHOLDER in after:
        raise InputError("the prompt holds more than one <image> placeholder; vlmrun takes one image")
    head = tokenizer.encode(before, add_special_tokens=False).ids
    tail = tokenizer.encode(after, add_special_tokens=False).ids
    ids = head + [image_token_id] * image_tokens + tail
    return np.asarray([ids], dtype=np.int64), len(head)


def splice(text_embeds: np.ndarray, image_embeds: np.ndarray, image_start: int) -> np.ndarray:
    """Put the image embeddings where the placeholder positions are: [1, T, H]."""
    out = text_embeds.copy()
    n = image_embeds.shape[1]
    out[:, image_start : image_start + n, :] = image_embeds
    return out
