"""Errors vlmrun reports to users.

Every problem a user can cause or fix (a bad image, an unknown plugin, a missing SDK tool, a tool that hangs)
is raised as a `VlmrunError` whose message is ONE line saying what is wrong and what to do. The CLI
prints that line and exits non-zero without a traceback (unless ``--debug``).
"""

from __future__ import annotations


class VlmrunError(Exception):
    """A user-facing error: ``str(err)`` is one line saying what is wrong and what to do."""

    exit_code = 1

    def __init__(self, message: str):
        super().__init__(" ".join(str(message).split()))


class UsageError(VlmrunError):
    """The command line or a layout names something that does not exist or does not fit."""

    exit_code = 2


class InputError(VlmrunError):
    """A bad input: missing or unreadable image, a prompt too long for the context, ..."""


class ContractError(VlmrunError):
    """A tensor handed from one stage to the next does not match the stage contract."""


class BackendError(VlmrunError):
    """A backend (plugin, runtime, SDK tool) failed, is missing, or does not support what was asked."""
