"""Data sets for ``vlmrun eval``: a JSONL file of ``{"image", "question", "answer"}`` records (image paths relative to
the file; an optional ``"kind"`` groups the accuracy), checked before any work; and the generated held-out set.

A bad record (a line that is not a JSON object, no question, no answer, no image, an image that is missing or
cannot be decoded) is one :class:`Skipped` entry naming the file and line; it is counted in the report, or stops
the run with ``strict``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import attrs

from ..errors import InputError, UsageError, VlmrunError

#: Items of the default held-out set (100 per question kind).
HELDOUT_ITEMS = 400


@attrs.frozen
class Record:
    """One usable data set item."""

    file: str  # the JSONL file
    line: int  # 1-based line number in it
    image: Path
    question: str
    answer: str
    kind: str
    key: str  # identifies the inputs (image bytes + question): the cache key of its results

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"


@attrs.frozen
class Skipped:
    """A record left out, and why."""

    file: str
    line: int
    reason: str

    @property
    def message(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"

    def to_json(self) -> dict:
        return {"file": self.file, "line": self.line, "reason": self.reason}


def kind_of(record: dict) -> str:
    """The record's ``kind``, else the question kind of the generated set it asks, else ``other``."""
    from ..shapes import QUESTIONS

    kind = record.get("kind")
    if isinstance(kind, str) and kind.strip():
        return kind.strip()
    by_question = {q.casefold(): k for k, q in QUESTIONS.items()}
    return by_question.get(str(record.get("question", "")).strip().casefold(), "other")


def _field(record: dict, name: str) -> str | None:
    value = record.get(name)
    return value if isinstance(value, str) and value.strip() else None


def _check(path: Path, n: int, text: str, check_images: bool) -> Record | Skipped:
    where = str(path)
    try:
        record = json.loads(text)
    except ValueError as exc:
        return Skipped(where, n, f"not valid JSON ({exc})")
    if not isinstance(record, dict):
        return Skipped(where, n, f"not a JSON object (a {type(record).__name__})")
    question = _field(record, "question")
    if question is None:
        return Skipped(where, n, "the record has no question (a non-empty string 'question')")
    answer = _field(record, "answer")
    if answer is None:
        return Skipped(where, n, "the record has no answer (a non-empty string 'answer')")
    image = _field(record, "image")
    if image is None:
        return Skipped(where, n, "the record has no image (a path 'image', relative to the data set file)")
    image_path = (path.parent / image) if not os.path.isabs(image) else Path(image)
    if not image_path.is_file():
        what = "is a directory" if image_path.is_dir() else "not found"
        return Skipped(where, n, f"image {image} {what} (looked for {image_path})")
    try:
        data = image_path.read_bytes()
    except OSError as exc:
        return Skipped(where, n, f"cannot read image {image}: {exc.strerror or exc}")
    if check_images:
        from ..preprocess import load_image

        try:
            load_image(image_path)
        except VlmrunError as exc:
            return Skipped(where, n, str(exc))
    key = hashlib.sha256(hashlib.sha256(data).digest() + b"\0" + question.encode("utf-8")).hexdigest()[:24]
    return Record(where, n, image_path, question, answer, kind_of(record), key)


def read_dataset(path: str | os.PathLike, *, strict: bool = False, limit: int | None = None,
                 check_images: bool = True, on_skip=None) -> tuple[list[Record], list[Skipped]]:
    """The usable records of a JSONL data set (at most ``limit``) and the skipped ones.

    ``on_skip(skipped)`` is called for each bad record as it is found. With ``strict`` the first bad record
    raises :class:`~vlmrun.errors.InputError` naming the file and line instead."""
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"data set {p} does not exist" if not p.exists() else f"data set {p} is not a file")
    try:
        raw = p.read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read data set {p}: {exc.strerror or exc}") from None
    records: list[Record] = []
    skipped: list[Skipped] = []
    for n, line in enumerate(raw.split(b"\n"), 1):
        if limit is not None and len(records) >= limit:
            break
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as exc:
            result: Record | Skipped = Skipped(str(p), n, f"not UTF-8 text ({exc.reason} at byte {exc.start})")
        else:
            if not text.strip():
                continue
            result = _check(p, n, text, check_images)
        if isinstance(result, Skipped):
            if strict:
                raise InputError(f"{result.message} (--strict stops at the first bad record)")
            skipped.append(result)
            if on_skip is not None:
                on_skip(result)
            continue
        records.append(result)
    return records, skipped


def heldout_dataset(store, n: int = HELDOUT_ITEMS, progress=None) -> Path:
    """The generated held-out set (:data:`vlmrun.shapes.HELDOUT_SEED`, a different seed from training), written
    once into the artifact store; returns its JSONL file."""
    from .. import shapes
    from ..progress import no_progress

    def build(tmp: Path) -> dict:
        with (progress or no_progress)(f"generating the held-out shapes data set ({n} items, once)"):
            shapes.write_dataset(tmp, n, seed=shapes.HELDOUT_SEED)
        return {"files": ["data.jsonl"], "items": n, "seed": shapes.HELDOUT_SEED}

    key = {"stage": "dataset", "kind": "shapes-heldout", "seed": shapes.HELDOUT_SEED, "items": n,
           "generator": shapes.GENERATOR_VERSION}
    return store.get_or_build(key, build).path / "data.jsonl"
