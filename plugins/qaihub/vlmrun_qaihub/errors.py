"""The hub's errors as vlmrun reports them: one exception class per way a hub operation fails, every client message
as one line, and the API token never in any of them (`redact`)."""

from __future__ import annotations

import re

from vlmrun.errors import BackendError

#: API tokens to keep out of every message (`vlmrun_qaihub.hub.Hub.client` adds the configured one)
_SECRETS: set[str] = set()


class HubUnreachable(BackendError):
    """The hub did not answer (refused, unresolvable, timed out, 5xx) for the whole network budget."""


class HubNotFound(BackendError):
    """The hub does not know the job or model (deleted, expired, another account, a restarted hub)."""


class HubAuthError(BackendError):
    """The hub rejected the API token."""


class HubJobFailed(BackendError):
    """A job ended FAILED on the hub (the message holds the hub's reason)."""


class HubJobTimeout(BackendError):
    """A job did not finish within the job timeout (it keeps running on the hub)."""


class HubTooLarge(BackendError):
    """The hub refused an upload as too large (HTTP 413; the client says "The uploaded asset is too large")."""


def redact(text: object) -> str:
    """``text`` with any known API token replaced by ``***``."""
    s = str(text)
    for secret in _SECRETS:
        if secret:
            s = s.replace(secret, "***")
    return re.sub(r"(?i)(token\s+)[A-Za-z0-9._-]{8,}", r"\1***", s)


_BOX_ROW = re.compile(r"^\s*[|│] ?(.*?) ?[|│]\s*$")
_BOX_EDGE = re.compile(r"^\s*[┌└][─]*[┐┘]\s*$")


def one_line(exc: BaseException | str) -> str:
    """A client exception as one line.

    The client draws boxes around multi-line messages, wrapping them at a fixed width and breaking long words
    (URLs) across rows: the rows are joined back, without a space where a URL or path was broken.
    """
    text = str(exc) or type(exc).__name__
    rows = [(_BOX_ROW.match(line), line) for line in text.splitlines() if not _BOX_EDGE.match(line)]
    rows = [(m, (m.group(1) if m else line).strip()) for m, line in rows]
    rows = [(m, c) for m, c in rows if c]
    width = max((len(m.group(1)) for m, _ in rows if m), default=0)
    out = ""
    for i, (m, content) in enumerate(rows):
        prev_m, prev = rows[i - 1] if i else (None, "")
        # textwrap broke a word only if it was longer than a row: the row before is full, and its last word and
        # this row's first word make one word too long for a row (a URL); or it broke after a hyphen
        last, first = (prev.split() or [""])[-1], content.split()[0]
        glue = bool(prev_m and m) and len(prev) >= width and (
            len(last) + len(first) > width or (last.endswith("-") and len(last) > 1))
        out += ("" if glue or not out else " ") + content
    out = " ".join(out.split()).replace("Internal API failure. ", "")
    return redact(out)[:400]
