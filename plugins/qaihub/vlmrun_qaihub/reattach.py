"""What qaihub says about the jobs its ledger records (compile, link and inference jobs alike): that a rerun
re-attaches to a job still running, that ``--rebuild`` never does, and that a job the hub no longer knows is
dropped and submitted again."""

from __future__ import annotations

from . import hub as hubmod

REATTACH = "rerun the same command to re-attach to it"
REBUILD_NOTE = "--rebuild never re-attaches: a rerun with --rebuild submits a new job"


def rerun_note(rebuild: bool) -> str:
    """What a rerun does with a job left running: re-attach, or (``--rebuild``) submit a new one."""
    return REBUILD_NOTE if rebuild else REATTACH


def forgotten(hub: hubmod.Hub, kind: str, job_id: str, exc: BaseException) -> None:
    """Say that the hub no longer knows ``kind`` job ``job_id`` (``exc``: its answer) and that it is submitted again."""
    hub.say(f"AI Hub no longer knows {kind} job {job_id} ({str(exc).rsplit(': ', 1)[-1]}); it was deleted, expired,"
            " belongs to another account, or the hub restarted: dropped from the ledger, submitting a new job")
