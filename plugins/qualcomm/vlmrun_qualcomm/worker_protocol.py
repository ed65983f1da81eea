"""The line protocol of vlmrun's libGenie workers (`genie_worker`, `genie_session`, `genie_pipeline`): the worker
writes one ``WORD rest`` line per event on its own copy of stdout (native code's stdout goes to stderr), and a
session worker reads one command per stdin line.

Worker side: `Replies` (the protocol's file: ``READY``, ``DONE``, ``ERROR reason``, ``CONTEXT reason`` and the
events), `serve_commands` (a session's loop: each command answered by ``DONE`` or one error line). Host side:
`pipeline_text` (a pipeline's ``TEXT`` / ``EMBEDDINGS`` / ``LOGITS`` events as its text pieces).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Callable, Iterable, Iterator, Mapping

from vlmrun.errors import BackendError

from .genie import ContextLimitError


class Replies:
    """The worker's protocol file: fd 1 duplicated for the protocol, then fd 1 pointed at stderr so that what
    native code prints cannot be taken for an event."""

    def __init__(self):
        self.out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)

    def write(self, word: str, rest: object = None) -> None:
        self.out.write(word if rest is None else f"{word} {rest}")
        self.out.write("\n")

    def failed(self, exc: BackendError) -> int:
        """One ``CONTEXT`` (the context limit) or ``ERROR`` line for ``exc``; the worker's exit status (3)."""
        self.write("CONTEXT" if isinstance(exc, ContextLimitError) else "ERROR", exc)
        return 3


def serve_commands(replies: Replies, commands: Mapping[str, Callable[[str], None]],
                   lines: Iterable[str] = sys.stdin) -> None:
    """A session worker's loop: per line ``WORD rest``, run ``commands[WORD](rest)`` and answer ``DONE``, or one
    ``CONTEXT`` / ``ERROR`` line when it raised a BackendError (an unknown command too); EOF ends it."""
    for line in lines:
        word, _, rest = line.strip().partition(" ")
        try:
            if word not in commands:
                raise BackendError(f"unknown command {word!r}")
            commands[word](rest)
            replies.write("DONE")
        except BackendError as exc:
            replies.failed(exc)


def pipeline_text(events: Iterable[tuple[str, str]], result: dict, logits=None) -> Iterator[str]:
    """A Genie pipeline worker's events as its text pieces: ``EMBEDDINGS dims`` into ``result["embeddings_dims"]``,
    each ``LOGITS`` row to ``logits`` (a `vlmrun_qualcomm.genie_sampler.LogitsRows`), ``DONE`` into
    ``result["done"]``, ``ERROR reason`` into ``result["error"]`` (``CONTEXT reason`` too, with
    ``result["context_limit"]``)."""
    for word, rest in events:
        if word == "TEXT":
            text, _ = json.loads(rest)
            if text:
                yield text
        elif word == "EMBEDDINGS":
            result["embeddings_dims"] = json.loads(rest)
        elif word == "LOGITS" and logits is not None:
            logits.event(rest)
        elif word == "DONE":
            result["done"] = True
        elif word in ("ERROR", "CONTEXT"):
            result["error"], result["context_limit"] = rest, word == "CONTEXT"
