"""The line protocol of vlmrun's libGenie workers (`genie_worker`, `genie_session`, `genie_pipeline`): the worker
writes one ``WORD rest`` line per event on its own copy of stdout (native code's stdout goes to stderr), and a
session worker reads one command per stdin line.

Worker side: `Replies` (the protocol's file: ``READY``, ``DONE``, ``ERROR reason``, ``CONTEXT reason`` and the
events), `serve_commands` (a session's loop: each command answered by ``DONE`` or one error line). Host side:
`pipeline_text` (a pipeline's ``TEXT`` / ``EMBEDDINGS`` / ``LOGITS`` events as its text pieces).

A hang: before the host kills a worker past its timeout it sends `STACKS_SIGNAL`, on which the worker writes every
thread's Python stack to its stderr (`faulthandler`, registered by `Replies`); `hung_worker_stacks` saves them to a
file that the timeout's error line names: where libGenie or the sampler callback was when it stopped answering.
"""

from __future__ import annotations

import faulthandler
import json
import os
import re
import signal
import sys
import tempfile
from typing import Callable, Iterable, Iterator, Mapping

from vlmrun.errors import BackendError

from .genie import ContextLimitError


#: The signal a host sends a hung worker before killing it: the worker dumps its threads' stacks to stderr.
STACKS_SIGNAL = signal.SIGUSR1

_STACKS_START = re.compile(r"^(?:Current thread|Thread) 0x[0-9a-f]+ \(most recent call first\):$", re.MULTILINE)


class Replies:
    """The worker's protocol file: fd 1 duplicated for the protocol, then fd 1 pointed at stderr so that what
    native code prints cannot be taken for an event. `STACKS_SIGNAL` then dumps every thread's stack to stderr."""

    def __init__(self):
        self.out = os.fdopen(os.dup(1), "w", buffering=1)
        os.dup2(2, 1)
        faulthandler.register(STACKS_SIGNAL, file=sys.stderr, all_threads=True)

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


def hung_worker_stacks(stderr: str, what: str) -> str:
    """The stacks a killed worker dumped on `STACKS_SIGNAL` (found in its ``stderr``), saved to a file: the text to
    end the timeout's error line with (``"; its threads' stacks when it was killed: PATH"``), or ``""`` when it
    dumped none (it was stuck where Python could not run its handler)."""
    found = _STACKS_START.search(stderr or "")
    if found is None:
        return ""
    fd, path = tempfile.mkstemp(prefix="vlmrun-hung-worker-", suffix=".txt")
    with os.fdopen(fd, "w") as f:
        f.write(f"{what}: every thread's Python stack when it was killed for a timeout\n\n")
        f.write(stderr[found.start():])
    return f"; its threads' stacks when it was killed: {path}"
