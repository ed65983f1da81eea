"""Scoring answers: exact match after normalising case and punctuation."""

from __future__ import annotations

import re
import unicodedata

_PUNCT = re.compile(r"[^\w\s]|_", re.UNICODE)


def normalize_answer(text: str) -> str:
    """Lower case, punctuation removed, whitespace collapsed: ``" A red  Circle. "`` -> ``"a red circle"``."""
    text = unicodedata.normalize("NFKC", str(text)).casefold()
    return " ".join(_PUNCT.sub(" ", text).split())


def is_correct(answer: str, expected: str) -> bool:
    return normalize_answer(answer) == normalize_answer(expected)
