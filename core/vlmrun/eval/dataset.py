"""Data sets for ``vlmrun eval``: a JSONL file of ``{"image", "question", "answer"}`` records (image paths relative to
the file; an optional ``"kind"`` groups the accuracy), checked before any work; and the generated held-out sets.

A record may be a conversation instead: ``{"image", "turns": [{"question", "answer"}, {"image"?, "question",
"answer"}, ...], "kind"?}``; the record's ``image`` is the first turn's picture and a later turn may bring its own.
Each turn is asked with the model's own earlier answers in the history and each answer is scored. A ``turns`` list
of one turn is a one-turn record (the same key, the same results).

A bad record (a line that is not a JSON object, no question, no answer, no image, an image that is missing or
cannot be decoded; for a conversation also turns that are not a list, a turn without question or answer) is one
`Skipped` entry naming the file and line; it is counted in the report, or stops the run with ``strict``.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import attrs

from .. import shapes
from ..errors import InputError, UsageError, VlmrunError
from ..preprocess import load_image
from ..progress import no_progress
from .answers import normalize_answer

#: Items of the default held-out set (100 per question kind).
HELDOUT_ITEMS = 400
#: Conversations of the generated held-out conversation set (``vlmrun eval --conversations``).
HELDOUT_CONVERSATIONS = 100
#: The record kind of a conversation that names none.
CONVERSATION_KIND = "conversation"


@attrs.frozen
class Turn:
    """One turn of a conversation record: its question, the expected answer, the picture it brings (or ``None``)."""

    question: str
    answer: str
    image: Path | None = None


@attrs.frozen
class Record:
    """One usable data set item."""

    file: str  # the JSONL file
    line: int  # 1-based line number in it
    image: Path
    question: str
    answer: str
    kind: str
    key: str  # identifies the inputs (image bytes + question; a conversation's every picture and question)
    # a conversation's turns (two or more; the first is image, question, answer above); () for a one-turn record
    turns: tuple[Turn, ...] = ()

    @property
    def where(self) -> str:
        return f"{self.file}:{self.line}"

    @property
    def asked(self) -> tuple[Turn, ...]:
        """The turns to ask and score: a one-turn record's only turn, or the conversation's."""
        return self.turns or (Turn(self.question, self.answer, self.image),)


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
    kind = record.get("kind")
    if isinstance(kind, str) and kind.strip():
        return kind.strip()
    by_question = {q.casefold(): k for k, q in shapes.QUESTIONS.items()}
    return by_question.get(str(record.get("question", "")).strip().casefold(), "other")


#: an answer that normalises to nothing (punctuation only) would match every answer that does too
_UNSCORABLE = "the answer {answer!r} is punctuation only: nothing is left to match once case and punctuation are set aside"


def _field(record: dict, name: str) -> str | None:
    value = record.get(name)
    return value if isinstance(value, str) and value.strip() else None


def _picture(path: Path, image: str, check_images: bool) -> tuple[Path, bytes] | str:
    """The picture ``image`` (relative to the data set file) and its bytes, or why it cannot be used."""
    image_path = (path.parent / image) if not os.path.isabs(image) else Path(image)
    if not image_path.is_file():
        what = "is a directory" if image_path.is_dir() else "not found"
        return f"image {image} {what} (looked for {image_path})"
    try:
        data = image_path.read_bytes()
    except OSError as exc:
        return f"cannot read image {image}: {exc.strerror or exc}"
    if check_images:
        try:
            load_image(image_path)
        except VlmrunError as exc:
            return str(exc)
    return image_path, data


def _check(path: Path, n: int, text: str, check_images: bool) -> Record | Skipped:
    where = str(path)
    try:
        record = json.loads(text)
    except ValueError as exc:
        return Skipped(where, n, f"not valid JSON ({exc})")
    if not isinstance(record, dict):
        return Skipped(where, n, f"not a JSON object (a {type(record).__name__})")
    if "turns" in record:
        return _check_conversation(path, n, record, check_images)
    question = _field(record, "question")
    if question is None:
        return Skipped(where, n, "the record has no question (a non-empty string 'question')")
    answer = _field(record, "answer")
    if answer is None:
        return Skipped(where, n, "the record has no answer (a non-empty string 'answer')")
    if not normalize_answer(answer):
        return Skipped(where, n, _UNSCORABLE.format(answer=answer))
    image = _field(record, "image")
    if image is None:
        return Skipped(where, n, "the record has no image (a path 'image', relative to the data set file)")
    picture = _picture(path, image, check_images)
    if isinstance(picture, str):
        return Skipped(where, n, picture)
    image_path, data = picture
    key = _key(hashlib.sha256(data).digest(), question)
    return Record(where, n, image_path, question, answer, kind_of(record), key)


def _key(digest: bytes, question: str) -> str:
    """A one-turn record's key: the digest of the picture's bytes and the question."""
    return hashlib.sha256(digest + b"\0" + question.encode("utf-8")).hexdigest()[:24]


def _check_conversation(path: Path, n: int, record: dict, check_images: bool) -> Record | Skipped:
    """A record with ``turns``: every turn a question and an answer, the first with the record's picture."""
    where = str(path)
    raw = record["turns"]
    if not isinstance(raw, list) or not raw:
        what = "an empty list" if isinstance(raw, list) else f"a {type(raw).__name__}"
        return Skipped(where, n, f"the record's turns are {what}, not a list of turns (a non-empty list 'turns' of"
                                 " {\"question\", \"answer\"} objects)")
    if "question" in record or "answer" in record:
        return Skipped(where, n, "the record has both turns and a question or answer of its own (give the first"
                                 " question and answer as the first turn)")
    turns: list[Turn] = []
    digests: list[bytes] = []
    for i, turn in enumerate(raw, 1):
        if not isinstance(turn, dict):
            return Skipped(where, n, f"turn {i} is not a JSON object (a {type(turn).__name__})")
        question = _field(turn, "question")
        if question is None:
            return Skipped(where, n, f"turn {i} has no question (a non-empty string 'question')")
        answer = _field(turn, "answer")
        if answer is None:
            return Skipped(where, n, f"turn {i} has no answer (a non-empty string 'answer')")
        if not normalize_answer(answer):
            return Skipped(where, n, f"turn {i}: " + _UNSCORABLE.format(answer=answer))
        image = _field(turn, "image")
        if "image" in turn and image is None:
            return Skipped(where, n, f"turn {i} has an image that is not a path (a non-empty string 'image',"
                                     " relative to the data set file)")
        if i == 1:
            if image is not None and _field(record, "image") not in (None, image):
                return Skipped(where, n, "the record's image and its first turn's image differ (give one)")
            image = image or _field(record, "image")
            if image is None:
                return Skipped(where, n, "the record has no image (a path 'image', relative to the data set file)")
        if image is None:
            turns.append(Turn(question, answer))
            digests.append(b"")
            continue
        picture = _picture(path, image, check_images)
        if isinstance(picture, str):
            return Skipped(where, n, picture if i == 1 else f"turn {i}: {picture}")
        turns.append(Turn(question, answer, picture[0]))
        digests.append(hashlib.sha256(picture[1]).digest())
    first = turns[0]
    if len(turns) == 1:  # a one-turn record written as turns: the same record, the same results
        kind = kind_of({"kind": record.get("kind"), "question": first.question})
        return Record(where, n, first.image, first.question, first.answer, kind, _key(digests[0], first.question))
    h = hashlib.sha256(b"conversation")
    for digest, turn in zip(digests, turns):
        question = turn.question.encode("utf-8")
        h.update(b"\0" + len(digest).to_bytes(1, "big") + digest + len(question).to_bytes(8, "big") + question)
    kind = record.get("kind")
    kind = kind.strip() if isinstance(kind, str) and kind.strip() else CONVERSATION_KIND
    return Record(where, n, first.image, first.question, first.answer, kind, h.hexdigest()[:24], tuple(turns))


def read_dataset(path: str | os.PathLike, *, strict: bool = False, limit: int | None = None,
                 check_images: bool = True, on_skip=None) -> tuple[list[Record], list[Skipped]]:
    """The usable records of a JSONL data set (at most ``limit``) and the skipped ones.

    ``on_skip(skipped)`` is called for each bad record as it is found. With ``strict`` the first bad record
    raises `vlmrun.errors.InputError` naming the file and line instead."""
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
    """The generated held-out set (`vlmrun.shapes.HELDOUT_SEED`, a different seed from training), written
    once into the artifact store; returns its JSONL file."""

    def build(tmp: Path) -> dict:
        with (progress or no_progress)(f"generating the held-out shapes data set ({n} items, once)"):
            shapes.write_dataset(tmp, n, seed=shapes.HELDOUT_SEED)
        return {"files": ["data.jsonl"], "items": n, "seed": shapes.HELDOUT_SEED}

    key = {"stage": "dataset", "kind": "shapes-heldout", "seed": shapes.HELDOUT_SEED, "items": n,
           "generator": shapes.GENERATOR_VERSION}
    return store.get_or_build(key, build).path / "data.jsonl"


def heldout_conversations(store, n: int = HELDOUT_CONVERSATIONS, progress=None) -> Path:
    """The generated held-out conversations (`vlmrun.shapes.conversations` of
    `vlmrun.shapes.HELDOUT_SEED`: 1-3 turns about a scene, some bringing a second picture), written once into
    the artifact store; returns its JSONL file."""

    def build(tmp: Path) -> dict:
        with (progress or no_progress)(f"generating the held-out shapes conversations ({n}, once)"):
            shapes.write_conversations(tmp, n, seed=shapes.HELDOUT_SEED)
        return {"files": ["conversations.jsonl"], "conversations": n, "seed": shapes.HELDOUT_SEED}

    key = {"stage": "dataset", "kind": "shapes-heldout-conversations", "seed": shapes.HELDOUT_SEED,
           "conversations": n, "generator": shapes.GENERATOR_VERSION,
           "conversation_generator": shapes.CONVERSATION_GENERATOR_VERSION}
    return store.get_or_build(key, build).path / "conversations.jsonl"
