"""The Qualcomm AI Hub client, made safe for vlmrun: one-line errors, bounded retries, waits with a timeout and
a progress display, a job ledger for re-attaching, downloads that cannot escape their directory.

Configuration is the client's own: ``~/.qai_hub/client.ini`` or the file named by ``QAIHUB_CLIENT_INI``. The
API token is never printed, logged or written anywhere by this module: every message that leaves it goes
through :func:`redact`.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from vlmrun.errors import BackendError, VlmrunError

LEDGER = "qaihub-jobs.json"
DEFAULT_RETRIES = 4
DEFAULT_BACKOFF_S = 1.0
MAX_BACKOFF_S = 20.0
DEFAULT_TIMEOUT_S = 3 * 3600.0

_SECRETS: set[str] = set()


def redact(text: object) -> str:
    """``text`` with any known API token replaced by ``***``."""
    s = str(text)
    for secret in _SECRETS:
        if secret:
            s = s.replace(secret, "***")
    return re.sub(r"(?i)(token\s+)[A-Za-z0-9._-]{8,}", r"\1***", s)


def one_line(exc: BaseException) -> str:
    """A client exception as one line (the client draws boxes around multi-line messages)."""
    text = str(exc) or type(exc).__name__
    text = re.sub(r"[┌┐└┘─│|]", " ", text)
    text = " ".join(text.split())
    text = text.replace("Internal API failure. ", "")
    return redact(text)[:400]


def config_path() -> Path:
    from qai_hub.api_utils import get_config_path

    return Path(get_config_path(expanduser=True))


class Hub:
    """A lazily created ``qai_hub.Client`` plus vlmrun's error handling around it.

    :param retries: how many times a failed network call is retried (with exponential backoff).
    :param timeout: seconds to wait for a job before giving up (the job keeps running on the hub).
    :param poll: seconds between status polls (default: the client's ``Job._polling_interval``).
    """

    def __init__(self, *, retries: int = DEFAULT_RETRIES, backoff: float = DEFAULT_BACKOFF_S,
                 timeout: float | None = None, poll: float | None = None, out=None):
        self.retries = int(retries)
        self.backoff = float(backoff)
        self.timeout = float(timeout) if timeout else DEFAULT_TIMEOUT_S
        self._poll = poll
        self.out = out
        self._client = None

    @property
    def poll(self) -> float:
        if self._poll:
            return float(self._poll)
        from qai_hub.client import Job

        return float(Job._polling_interval)

    def say(self, text: str, end: str = "\n") -> None:
        out = self.out or sys.stderr
        print(redact(text), end=end, file=out, flush=True)

    @property
    def client(self):
        if self._client is None:
            import qai_hub

            path = config_path()
            if not path.is_file():
                raise BackendError(
                    f"Qualcomm AI Hub is not configured: {path} not found; run `qai-hub configure --api_token ...`"
                    " or point QAIHUB_CLIENT_INI at a client.ini"
                )
            try:
                client = qai_hub.Client()
                cfg = client.config
            except Exception as exc:
                raise BackendError(f"Qualcomm AI Hub configuration {path} is not usable: {one_line(exc)}") from None
            _SECRETS.add(cfg.api_token)
            client.set_verbose(False)  # vlmrun shows its own progress (on stderr)
            self._client = client
        return self._client

    def web_url(self, kind: str, ident: str) -> str:
        return self.client._web_url(kind, ident)

    # -- calls ----------------------------------------------------------------------------------------------
    def call(self, what: str, fn: Callable, *args, retry: bool = True, **kwargs):
        """``fn(*args, **kwargs)``; network failures are retried with bounded backoff, errors become one line."""
        import requests
        from qai_hub.client import Error as HubError
        from qai_hub.client import InternalError, RateLimitedError, UserError
        from qai_hub.public_rest_api import APIException

        attempts = 1 + (self.retries if retry else 0)
        for attempt in range(attempts):
            try:
                # the client prints chatter ("Downloaded model to ...") on stdout: keep stdout for results
                with contextlib.redirect_stdout(io.StringIO()):
                    return fn(*args, **kwargs)
            except (KeyboardInterrupt, VlmrunError):
                raise
            except (InternalError, RateLimitedError, requests.RequestException, ConnectionError, TimeoutError) as exc:
                if attempt + 1 >= attempts:
                    raise BackendError(
                        f"Qualcomm AI Hub: {what} failed after {attempt + 1} attempt(s): {one_line(exc)}"
                    ) from None
                delay = min(self.backoff * (2**attempt), MAX_BACKOFF_S)
                self.say(f"AI Hub: {what}: {one_line(exc)[:160]}; retrying in {delay:.1f} s"
                         f" ({attempt + 1}/{attempts - 1})")
                time.sleep(delay)
            except (UserError, APIException, HubError, ValueError) as exc:
                raise BackendError(f"Qualcomm AI Hub: {what}: {one_line(exc)}") from None

    # -- jobs -----------------------------------------------------------------------------------------------
    def wait(self, job, kind: str, *, on_interrupt: Callable[[], None] | None = None):
        """Poll ``job`` until it finishes, showing its state and web link; return the final status.

        A FAILED job raises a BackendError with the hub's failure reason; a timeout or Ctrl-C says which job is
        still running (and where), without cancelling it.
        """
        url = job.url
        t0 = time.monotonic()
        last = None
        tty = bool(getattr(self.out or sys.stderr, "isatty", lambda: False)())
        try:
            while True:
                status = self.call(f"status of {kind} job {job.job_id}", job.get_status)
                elapsed = time.monotonic() - t0
                if status.code != last or tty:
                    line = f"AI Hub {kind} job {job.job_id}: {status.code} ({elapsed:.0f} s) {url}"
                    if tty:
                        self.say("\r" + line + " " * 4, end="" if not status.finished else "\n")
                    else:
                        self.say(line)
                    last = status.code
                if status.finished:
                    break
                if elapsed >= self.timeout:
                    raise BackendError(
                        f"AI Hub {kind} job {job.job_id} did not finish within {self.timeout:.0f} s (state"
                        f" {status.code}); it is still running at {url}: rerun to re-attach, or raise the timeout"
                    )
                time.sleep(min(self.poll, max(0.01, self.timeout - elapsed)))
        except KeyboardInterrupt:
            self.say(f"\ninterrupted: AI Hub {kind} job {job.job_id} is still running on the hub ({url});"
                     " rerun the same command to re-attach to it")
            if on_interrupt:
                on_interrupt()
            raise
        if not status.success:
            reason = " ".join((status.message or "no reason given").split())
            raise BackendError(f"AI Hub {kind} job {job.job_id} failed: {redact(reason)} ({url})")
        return status


# -- safe downloads --------------------------------------------------------------------------------------------
_SAFE_NAME = re.compile(r"[^A-Za-z0-9._-]")


def safe_name(name: str, default: str = "download") -> str:
    """A server-given file name reduced to a plain file name (no directories, no ``..``)."""
    base = os.path.basename(str(name).replace("\\", "/"))
    base = _SAFE_NAME.sub("_", base).lstrip(".")
    return base or default


def download_model_into(hub: Hub, model, out_dir: Path, final_name: str) -> tuple[Path, str]:
    """Download ``model`` into ``out_dir/final_name`` whatever name the server gives the file.

    The client is handed a *file* path inside a private directory (never a directory: the client would join
    the server's file name onto it), and the result must resolve inside that directory.
    :return: (path, the name the client gave the file (with the server's extension), sanitized)
    """
    out_dir = Path(out_dir)
    private = Path(tempfile.mkdtemp(prefix=".hub-dl-", dir=out_dir))
    try:
        target = private / "model"
        got = hub.call(f"download of model {model.model_id}", model.download, str(target))
        got_path = Path(str(got)).resolve()
        if got_path.parent != private.resolve() or not got_path.is_file():
            raise BackendError(f"AI Hub download of model {model.model_id} wrote outside its directory ({got_path.name});"
                               " refusing it")
        if got_path.stat().st_size == 0:
            raise BackendError(f"AI Hub returned an empty file for model {model.model_id}")
        final = out_dir / final_name
        os.replace(got_path, final)
        return final, safe_name(got_path.name)
    finally:
        shutil.rmtree(private, ignore_errors=True)


# -- the job ledger --------------------------------------------------------------------------------------------
class Ledger:
    """``<store root>/qaihub-jobs.json``: key -> {job_id, model_id, state, ...}, so a rerun re-attaches to a job
    submitted by an interrupted run instead of uploading and compiling again. Written atomically under a lock."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.path = self.root / LEDGER

    @contextlib.contextmanager
    def _locked(self):
        self.root.mkdir(parents=True, exist_ok=True)
        lock = open(self.root / (LEDGER + ".lock"), "a+")
        try:
            try:
                import fcntl

                fcntl.flock(lock, fcntl.LOCK_EX)
            except ImportError:  # pragma: no cover (Windows)
                pass
            yield
        finally:
            lock.close()

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def _write(self, data: dict) -> None:
        fd, tmp = tempfile.mkstemp(prefix=".qaihub-jobs-", dir=self.root)
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=True)
        os.replace(tmp, self.path)

    def get(self, key: str) -> dict | None:
        with self._locked():
            return self._read().get(key)

    def update(self, key: str, **fields) -> dict:
        with self._locked():
            data = self._read()
            entry = {**data.get(key, {}), **{k: v for k, v in fields.items()}, "updated": time.time()}
            data[key] = entry
            self._write(data)
            return entry

    def drop(self, key: str) -> None:
        with self._locked():
            data = self._read()
            if data.pop(key, None) is not None:
                self._write(data)
