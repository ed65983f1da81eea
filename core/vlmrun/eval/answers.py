"""Scoring answers: exact match after normalising case and punctuation."""

from __future__ import annotations

import re
import unicodedata

# punctuation, except what changes a number: a sign before a digit (-1 is not 1), a percent sign after one (5% is
# not 5), a decimal point or comma between digits
_NUMBER_MARK = r"(?<![\w.])[-+](?=\d)|(?<=\d)%|(?<=\d)[.,](?=\d)"
_PUNCT = re.compile(rf"(?!{_NUMBER_MARK})(?:[^\w\s]|_)", re.UNICODE)


def normalize_answer(text: str) -> str:
    """Lower case, punctuation removed, whitespace collapsed: ``" A red  Circle. "`` -> ``"a red circle"``; a
    number keeps its sign, decimal point and percent sign (``"-1.5%"``)."""
    text = unicodedata.normalize("NFKC", str(text)).casefold()
    return " ".join(_PUNCT.sub(" ", text).split())


def is_correct(answer: str, expected: str) -> bool:
    return normalize_answer(answer) == normalize_answer(expected)
