"""Generated pictures of shapes with questions and short answers: what the default model is trained and
evaluated on (no data can be downloaded on the machines this project runs on).

A scene is one or two shapes (circle, square, triangle, star) in one of eight colours on a plain or gradient
background, at varied positions, sizes and rotations, on a square or non-square canvas. Each scene gets
questions of four kinds::

    shape     "What shape is in the image?"   -> "A circle."                       (one shape)
    color     "What color is the shape?"      -> "Red."                            (one shape)
    count     "How many shapes are there?"    -> "One." / "Two."
    describe  "Describe the image."           -> "A red circle on a blue background."
                                                 "A red circle and a green star on a white background."
                                                 "An orange star on a gray background."
                                                 (two shapes: left to right)

Conversations (`conversations`) ask one to three of those questions in turn: about one scene, or, after a
question, ``"And this one?"`` with a new picture whose answer is the same kind of answer about it::

    "What shape is in the image?" -> "A circle."   "And this one?" (a new picture) -> "A square."

Everything is deterministic from a seed (`random.Random`, Pillow drawing). `write_dataset` writes
a JSONL data set (``{"image", "question", "answer", "kind"}``, image paths relative to the file) with its
PNG images; `write_conversations` one of conversations (``{"image", "turns", "kind"}``). Needs only Pillow.
"""

from __future__ import annotations

import json
import math
import os
import random
from pathlib import Path
from typing import Iterator

import attrs

SHAPES = ("circle", "square", "triangle", "star")
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "green": (30, 160, 50),
    "blue": (30, 70, 220),
    "yellow": (245, 215, 30),
    "white": (250, 250, 250),
    "black": (15, 15, 15),
    "orange": (250, 130, 10),
    "purple": (130, 40, 170),
}
#: Background colours: the shape colours plus gray. A shape never has its background's colour.
BACKGROUNDS: dict[str, tuple[int, int, int]] = {**COLORS, "gray": (128, 128, 128)}
NUMBERS = ("Zero", "One", "Two")

QUESTIONS: dict[str, str] = {
    "shape": "What shape is in the image?",
    "color": "What color is the shape?",
    "count": "How many shapes are there?",
    "describe": "Describe the image.",
}
KINDS = tuple(QUESTIONS)
#: Other ways people ask the same questions: the default model is also trained on these (`scripts/train_tiny.py
#: --from`, a quarter of the questions), so a chat's natural follow-up is understood; data sets and the held-out
#: sets ask `QUESTIONS`.
PARAPHRASES: dict[str, tuple[str, ...]] = {
    "shape": ("What shape is it?", "Which shape is this?", "What shape is this?"),
    "color": ("What color is it?", "Which color is the shape?", "What colour is it?"),
    "count": ("How many shapes?", "How many shapes are in the image?", "How many are there?"),
    "describe": ("Describe it.", "What do you see?", "Describe this image."),
}

#: Canvas sizes (width, height): mostly the model's 256 x 256, some larger or not square (padded by the
#: preprocessing, so the model sees black bars as the real FastVLM does).
CANVASES = ((256, 256),) * 6 + ((320, 320), (384, 288), (288, 384), (320, 240), (256, 192), (640, 480))

TRAIN_SEED = 0
HELDOUT_SEED = 1
#: Bumped whenever the pictures or answers for a seed change (keys the generated data sets in the store).
GENERATOR_VERSION = 2
#: Bumped whenever the conversations for a seed change (keys the generated conversation sets in the store).
CONVERSATION_GENERATOR_VERSION = 1
#: A later turn's question that brings a new picture: the same kind of question as the turn before, about it.
FOLLOW_UP = "And this one?"


@attrs.frozen
class Shape:
    kind: str  # one of SHAPES
    color: str  # one of COLORS
    cx: float  # centre, as a fraction of the canvas width / height
    cy: float
    size: float  # radius as a fraction of the canvas's short side
    angle: float  # degrees
    rgb: tuple[int, int, int]  # the drawn colour (the named colour, slightly jittered)


@attrs.frozen
class Scene:
    shapes: tuple[Shape, ...]
    background: str  # one of BACKGROUNDS
    gradient: str  # "none", "horizontal", "vertical", "diagonal"
    width: int = 256
    height: int = 256

    def answer(self, kind: str) -> str:
        """The short answer to the question of ``kind`` (see the module docstring)."""
        if kind == "count":
            return NUMBERS[len(self.shapes)] + "."
        if kind == "describe":
            things = " and ".join(f"{_article(s.color)} {s.color} {s.kind}" for s in self.shapes)
            return f"{things[0].upper()}{things[1:]} on {_article(self.background)} {self.background} background."
        if len(self.shapes) != 1:
            raise ValueError(f"a '{kind}' question needs a scene with one shape")
        if kind == "shape":
            return f"A {self.shapes[0].kind}."
        if kind == "color":
            return self.shapes[0].color.capitalize() + "."
        raise ValueError(f"unknown question kind '{kind}'; kinds are {', '.join(KINDS)}")

    def kinds(self) -> tuple[str, ...]:
        """The question kinds this scene can answer."""
        return KINDS if len(self.shapes) == 1 else ("count", "describe")

    def render(self):
        """The scene as a PIL RGB image."""
        return render(self)


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _jitter(rgb, rng: random.Random, amount: int) -> tuple[int, int, int]:
    return tuple(max(0, min(255, c + rng.randint(-amount, amount))) for c in rgb)  # type: ignore[return-value]


def random_scene(rng: random.Random, n_shapes: int | None = None) -> Scene:
    """One scene drawn from ``rng``: one shape (60%) or two (40%), left to right in two halves when two."""
    n = n_shapes or (1 if rng.random() < 0.6 else 2)
    width, height = rng.choice(CANVASES)
    background = rng.choice(sorted(BACKGROUNDS))
    gradient = rng.choice(("none", "none", "horizontal", "vertical", "diagonal"))
    allowed = [c for c in sorted(COLORS) if c != background]
    short = min(width, height)
    shapes = []
    for i in range(n):
        size = rng.uniform(0.14, 0.26) if n == 1 else rng.uniform(0.10, 0.18)
        # centre: far enough from the edges for the whole shape; with two shapes, one per half
        rx, ry = size * short / width, size * short / height
        lo, hi = (rx, 1 - rx) if n == 1 else ((rx + 0.02, 0.5 - rx) if i == 0 else (0.5 + rx, 1 - rx - 0.02))
        cx = rng.uniform(lo, max(lo, hi))
        cy = rng.uniform(ry, 1 - ry)
        color = rng.choice(allowed)
        shapes.append(Shape(rng.choice(SHAPES), color, cx, cy, size, rng.uniform(-20.0, 20.0),
                            _jitter(COLORS[color], rng, 12)))
    return Scene(tuple(shapes), background, gradient, width, height)


def _polygon(shape: Shape, w: int, h: int) -> list[tuple[float, float]]:
    cx, cy, r = shape.cx * w, shape.cy * h, shape.size * min(w, h)
    a0 = math.radians(shape.angle)
    if shape.kind == "square":
        pts = [(r * 0.85, math.pi / 4 + k * math.pi / 2) for k in range(4)]
        pts = [(rr * math.sqrt(2), a) for rr, a in pts]
    elif shape.kind == "triangle":
        pts = [(r, -math.pi / 2 + k * 2 * math.pi / 3) for k in range(3)]
    elif shape.kind == "star":
        pts = [(r if k % 2 == 0 else r * 0.42, -math.pi / 2 + k * math.pi / 5) for k in range(10)]
    else:
        raise ValueError(shape.kind)
    return [(cx + rr * math.cos(a + a0), cy + rr * math.sin(a + a0)) for rr, a in pts]


def render(scene: Scene):
    """Draw ``scene`` with Pillow (deterministic)."""
    from PIL import Image, ImageDraw

    w, h = scene.width, scene.height
    base = BACKGROUNDS[scene.background]
    if scene.gradient == "none":
        im = Image.new("RGB", (w, h), base)
    else:
        light = tuple(int(c + (255 - c) * 0.2) for c in base)
        dark = tuple(int(c * 0.8) for c in base)
        # a 2 x 2 (or 1 x 2) ramp, stretched bilinearly: smooth and fast
        if scene.gradient == "horizontal":
            ramp = Image.new("RGB", (2, 1))
            ramp.putdata([light, dark])
        elif scene.gradient == "vertical":
            ramp = Image.new("RGB", (1, 2))
            ramp.putdata([light, dark])
        else:
            mid = tuple((a + b) // 2 for a, b in zip(light, dark))
            ramp = Image.new("RGB", (2, 2))
            ramp.putdata([light, mid, mid, dark])
        im = ramp.resize((w, h), Image.Resampling.BILINEAR)
    draw = ImageDraw.Draw(im)
    for s in scene.shapes:
        if s.kind == "circle":
            cx, cy, r = s.cx * w, s.cy * h, s.size * min(w, h)
            draw.ellipse([cx - r, cy - r, cx + r, cy + r], fill=s.rgb)
        else:
            draw.polygon(_polygon(s, w, h), fill=s.rgb)
    return im


@attrs.frozen
class Item:
    scene: Scene
    kind: str
    question: str
    answer: str


def items(seed: int) -> Iterator[Item]:
    """An endless, deterministic stream of (scene, question, answer): the question kinds in turn (shape, color,
    count, describe, ...), each with a fresh scene that can answer it."""
    rng = random.Random(seed)
    i = 0
    while True:
        kind = KINDS[i % len(KINDS)]
        n = 1 if kind in ("shape", "color") else None
        scene = random_scene(rng, n)
        yield Item(scene, kind, QUESTIONS[kind], scene.answer(kind))
        i += 1


def write_dataset(out_dir: str | os.PathLike, n: int, seed: int = HELDOUT_SEED, name: str = "data.jsonl") -> Path:
    """Write ``n`` items as ``out_dir/name`` (JSONL: image, question, answer, kind) and ``out_dir/images/*.png``.
    Returns the JSONL path."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    stream = items(seed)
    lines = []
    for i in range(n):
        item = next(stream)
        rel = f"images/{i:05d}.png"
        item.scene.render().save(out / rel, optimize=False)
        lines.append(json.dumps({"image": rel, "question": item.question, "answer": item.answer,
                                 "kind": item.kind}))
    path = out / name
    path.write_text("\n".join(lines) + "\n")
    return path


@attrs.frozen
class Turn:
    """One turn of a generated conversation: the question kind its answer is about, the question, the expected
    answer, and the picture the turn brings (the first turn's always; ``None``: the one before)."""

    kind: str
    question: str
    answer: str
    scene: Scene | None = None


def conversations(seed: int) -> Iterator[tuple[Turn, ...]]:
    """An endless, deterministic stream of conversations of one to three turns (a fifth of them one turn, the rest
    two or three). The first turn asks a question the scene supports; each later turn either asks another of the
    scene's question kinds not asked yet, or (a third of the time, and always when none is left) ``"And this
    one?"`` with a new picture that supports the previous turn's kind and answers it differently (another shape,
    colour, count or description), which later turns are then about."""
    rng = random.Random(f"conversations:{seed}")  # not the stream of items(seed): other pictures
    while True:
        n = rng.choice((1, 2, 2, 3, 3))
        scene = random_scene(rng)
        kind = rng.choice(scene.kinds())
        turns = [Turn(kind, QUESTIONS[kind], scene.answer(kind), scene)]
        asked = {kind}
        while len(turns) < n:
            fresh = [k for k in scene.kinds() if k not in asked]
            if fresh and rng.random() >= 1 / 3:
                kind = rng.choice(fresh)
                asked.add(kind)
                turns.append(Turn(kind, QUESTIONS[kind], scene.answer(kind)))
                continue
            before = turns[-1].answer
            while True:
                scene = random_scene(rng, 1 if kind in ("shape", "color") else None)
                if scene.answer(kind) != before:
                    break
            turns.append(Turn(kind, FOLLOW_UP, scene.answer(kind), scene))
            asked = {kind}
        yield tuple(turns)


def write_conversations(out_dir: str | os.PathLike, n: int, seed: int = HELDOUT_SEED,
                        name: str = "conversations.jsonl") -> Path:
    """Write ``n`` conversations as ``out_dir/name`` (JSONL: ``{"image", "turns": [{"question", "answer"},
    {"image", "question", "answer"}, ...], "kind": "conversation"}``, a later turn's ``image`` only when it brings
    one) and their pictures as ``out_dir/images/conv*.png``. Returns the JSONL path."""
    out = Path(out_dir)
    (out / "images").mkdir(parents=True, exist_ok=True)
    stream = conversations(seed)
    lines = []
    for i in range(n):
        record: dict = {}
        turns = []
        for t, turn in enumerate(next(stream), 1):
            entry: dict = {}
            if turn.scene is not None:
                rel = f"images/conv{i:05d}-{t}.png"
                turn.scene.render().save(out / rel, optimize=False)
                if t == 1:
                    record["image"] = rel
                else:
                    entry["image"] = rel
            turns.append({**entry, "question": turn.question, "answer": turn.answer})
        lines.append(json.dumps({**record, "turns": turns, "kind": "conversation"}))
    path = out / name
    path.write_text("\n".join(lines) + "\n")
    return path


#: The demo's question and its scene (drawn on a 4:3 canvas, so the preprocessing pads it).
DEMO_QUESTION = QUESTIONS["describe"]
DEMO_SCENE = Scene(
    (Shape("circle", "red", 0.5, 0.52, 0.24, 0.0, COLORS["red"]),),
    "blue", "vertical", 640, 480,
)
