"""The Qualcomm AI Hub client, made safe for vlmrun: one-line errors, one network deadline per operation, waits
with a timeout and a progress display. The errors and their wording are in `errors`, the job ledger for
re-attaching in `ledger`, downloads that cannot escape their directory in `downloads`.

Network failures. The ``qai-hub`` client retries inside every call, in two layers (urllib3 and a backoff
decorator), which made one call to an unreachable hub take about 46 s to 5 min. While vlmrun runs an operation
(``Hub.call``), the client's transport is vlmrun's instead: urllib3 does not retry, and a refused
connection, a DNS failure, a timeout, a dropped connection or an HTTP 5xx answer is retried here with a short
backoff, each retry announced with its real delay, until the hub has not answered for ``network_timeout``
seconds (default 30): then the operation fails with one line naming the hub and the reason. The client's own
retry loops never see a transient error, so they add no time.

Configuration is the client's own: ``~/.qai_hub/client.ini`` or the file named by ``QAIHUB_CLIENT_INI``. The
API token is never printed, logged or written anywhere by this module: every message that leaves it goes
through ``redact`` (`errors`).
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Callable
from urllib.parse import urlparse

from vlmrun.errors import BackendError, VlmrunError

from .downloads import download_model_into, safe_name  # noqa: F401  (re-exported for tests/test_qaihub.py)
from .errors import (_SECRETS, HubAuthError, HubJobFailed, HubJobTimeout, HubNotFound, HubTooLarge, HubUnreachable,
                     one_line, redact)

DEFAULT_NETWORK_TIMEOUT_S = 30.0
DEFAULT_BACKOFF_S = 1.0
MAX_BACKOFF_S = 8.0
DEFAULT_JOB_TIMEOUT_S = 3 * 3600.0
RETRIABLE_STATUSES = frozenset({500, 502, 503, 504})


def config_path() -> Path:
    from qai_hub.api_utils import get_config_path

    return Path(get_config_path(expanduser=True))


# -- the transport: vlmrun's retries and deadline inside the client's HTTP calls --------------------------------
class _GiveUp(Exception):
    """The operation's network budget is spent. Not a ``requests`` exception, so the client's retry loops let it
    through untouched."""


class _Unsure(Exception):
    """A job submission was sent but not answered: retrying could submit the job twice."""


_OP: contextvars.ContextVar["_Operation | None"] = contextvars.ContextVar("vlmrun_qaihub_operation", default=None)


def _describe(exc: BaseException, url: str) -> str:
    """A network failure in a few words: what happened, with which host."""
    import requests

    u = urlparse(url)
    host = u.hostname or "?"
    where = f"{host}:{u.port}" if u.port else host
    chain, e = [], exc
    while e is not None and len(chain) < 8:
        chain.append(e)
        e = e.__cause__ or e.__context__ or (e.args[0] if e.args and isinstance(e.args[0], BaseException) else None)
        e = e if isinstance(e, BaseException) else None
    text = " ".join(str(c) for c in chain) + " " + " ".join(type(c).__name__ for c in chain)
    if re.search(r"NameResolution|Name or service not known|getaddrinfo|nodename nor servname|resolve", text):
        return f"cannot resolve host {host}"
    if re.search(r"Connection refused|ConnectionRefused|Errno 111", text):
        return f"connection refused by {where}"
    if isinstance(exc, requests.exceptions.Timeout) or re.search(r"timed out|Timeout", text):
        return f"no answer from {where} in time"
    if re.search(r"RemoteDisconnected|Connection aborted|reset by peer|closed connection|IncompleteRead", text):
        return f"{where} closed the connection without an answer"
    return f"{where}: {one_line(exc)[:160]}"


def _cap_timeout(timeout, cap: float):
    if timeout is None:
        return (min(3.05, cap), cap)
    if isinstance(timeout, tuple):
        return tuple(cap if t is None else min(float(t), cap) for t in timeout)
    if isinstance(timeout, (int, float)):
        return min(float(timeout), cap)
    return timeout  # a urllib3 Timeout object: leave it


class _Operation:
    """One ``Hub.call``: its network budget counts from the last answer the hub gave."""

    def __init__(self, hub: "Hub", what: str):
        self.hub = hub
        self.what = what
        self.budget = hub.network_timeout
        self.started = self.last_answer = time.monotonic()
        self.failures = 0
        self.error: str | None = None  # the last network failure, in words
        self.status: int | None = None  # the last HTTP status the hub answered

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.last_answer)

    def failed(self, why: str, client_retries: bool = False) -> float:
        """Record a failure; the delay before the next attempt, or _GiveUp when the budget is spent.
        ``client_retries``: the client retries this request itself (a streamed upload), after its own delay."""
        self.failures += 1
        self.error = why
        left = self.left()
        if left <= 0.05:
            raise _GiveUp()
        delay = min(self.hub.backoff * 2 ** (self.failures - 1), MAX_BACKOFF_S, left)
        when = "the client retries it" if client_retries else f"retry {self.failures} in {delay:.1f} s"
        self.hub.say(f"AI Hub: {self.what}: {why}; {when} (giving up in {left:.0f} s)")
        return delay

    def send(self, send: Callable, request, kwargs: dict):
        import requests

        body = request.body
        resendable = body is None or isinstance(body, (bytes, str))
        # a job submission the hub may have received is not sent again (it could create the job twice)
        submission = request.method == "POST" and urlparse(request.url).path.rstrip("/").endswith("/jobs")
        while True:
            if self.failures and self.left() <= 0.05:
                raise _GiveUp()
            kwargs["timeout"] = _cap_timeout(kwargs.get("timeout"), max(1.0, self.left()))
            try:
                resp = send(request, **kwargs)
            except (requests.exceptions.ConnectionError, requests.exceptions.Timeout,
                    requests.exceptions.ChunkedEncodingError) as exc:
                why = _describe(exc, request.url)
                unsent = isinstance(exc, requests.exceptions.ConnectTimeout) or why.startswith(
                    ("connection refused", "cannot resolve"))
                if submission and not unsent:
                    self.error = why
                    raise _Unsure() from None
                delay = self.failed(why, client_retries=not resendable)
                if not resendable:
                    raise  # a streamed body: the client rewinds and retries it itself
                time.sleep(delay)
                continue
            self.status = resp.status_code
            if resp.status_code in RETRIABLE_STATUSES and resendable:
                host = urlparse(request.url).netloc
                delay = self.failed(f"HTTP {resp.status_code} from {host}")
                resp.close()
                time.sleep(delay)
                continue
            self.last_answer = time.monotonic()
            self.failures = 0
            return resp


def _install_transport() -> None:
    """Make the client's HTTP adapter vlmrun's while a ``Hub.call`` runs (elsewhere it is unchanged)."""
    from qai_hub.util import session as client_session

    if getattr(client_session.HTTPAdapter, "_vlmrun", False):
        return
    base = client_session.HTTPAdapter

    class Adapter(base):
        _vlmrun = True

        def __init__(self, *args, **kwargs):
            if _OP.get() is not None:
                kwargs["max_retries"] = 0  # vlmrun's operation owns the retries and their deadline
            super().__init__(*args, **kwargs)

        def send(self, request, **kwargs):
            op = _OP.get()
            if op is None:
                return super().send(request, **kwargs)
            return op.send(lambda r, **kw: base.send(self, r, **kw), request, kwargs)

    client_session.HTTPAdapter = Adapter


class Hub:
    """A lazily created ``qai_hub.Client`` plus vlmrun's error handling around it.

    :param network_timeout: seconds an operation keeps retrying a hub that does not answer (refused, unresolvable,
        timing out, answering 5xx) before it fails.
    :param timeout: seconds to wait for a job before giving up (the job keeps running on the hub).
    :param poll: seconds between status polls (default: the client's ``Job._polling_interval``).
    """

    def __init__(self, *, network_timeout: float | None = None, backoff: float = DEFAULT_BACKOFF_S,
                 timeout: float | None = None, poll: float | None = None, out=None):
        self.network_timeout = float(network_timeout) if network_timeout else DEFAULT_NETWORK_TIMEOUT_S
        self.backoff = float(backoff)
        self.timeout = float(timeout) if timeout else DEFAULT_JOB_TIMEOUT_S
        self._poll = poll
        self.out = out
        self._client = None
        self._devices: list | None = None

    @property
    def poll(self) -> float:
        if self._poll:
            return float(self._poll)
        from qai_hub.client import Job

        return float(Job._polling_interval)

    @property
    def stream(self):
        return self.out or sys.stderr

    def say(self, text: str, end: str = "\n") -> None:
        print(redact(text), end=end, file=self.stream, flush=True)

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
                with contextlib.redirect_stdout(io.StringIO()):
                    client = qai_hub.Client()
                    cfg = client.config
            except Exception as exc:
                raise BackendError(f"Qualcomm AI Hub configuration {path} is not usable: {one_line(exc)}") from None
            if not str(cfg.api_token or "").strip():
                raise BackendError(f"Qualcomm AI Hub configuration {path} has no api_token; run"
                                   " `qai-hub configure --api_token ...`")
            _SECRETS.add(cfg.api_token)
            client.set_verbose(False)  # vlmrun shows its own progress (on stderr)
            self._client = client
        return self._client

    @property
    def api_url(self) -> str:
        return str(self.client.config.api_url).rstrip("/")

    def web_url(self, kind: str, ident: str) -> str:
        return self.client._web_url(kind, ident)

    def devices(self) -> list:
        """Every device the hub offers (one request per Hub)."""
        if self._devices is None:
            self._devices = list(self.call("device list", self.client.get_devices))
        return self._devices

    # -- calls ----------------------------------------------------------------------------------------------
    def call(self, what: str, fn: Callable, *args, idempotent: bool = True, **kwargs):
        """``fn(*args, **kwargs)`` as one operation with one network budget; errors become one line.

        Raises `HubUnreachable` when the hub gave no answer for ``network_timeout`` seconds,
        `HubAuthError` when it rejected the token, `HubNotFound` when it does not know the object,
        `BackendError` otherwise. ``idempotent=False`` (a job submission): an error the client raises after
        the request may have reached the hub is not retried here.
        """
        import requests
        from qai_hub.client import Error as ClientError
        from qai_hub.client import InternalError, RateLimitedError
        from qai_hub.public_rest_api import APIException

        client = self.client  # configuration errors first, outside the operation
        del client
        _install_transport()
        op = _Operation(self, what)
        token = _OP.set(op)
        try:
            while True:
                try:
                    # the client prints chatter ("Downloaded model to ...") on stdout: keep stdout for results
                    with contextlib.redirect_stdout(io.StringIO()):
                        return fn(*args, **kwargs)
                except (KeyboardInterrupt, VlmrunError):
                    raise
                except _GiveUp:
                    raise self._unreachable(op) from None
                except _Unsure:
                    raise BackendError(
                        f"Qualcomm AI Hub: {what}: {op.error} after the request was sent; the hub may have created"
                        f" the job: see {self.web_url('jobs', '')} before running again") from None
                except (RateLimitedError, InternalError, requests.RequestException, ConnectionError,
                        TimeoutError) as exc:
                    why = op.error if op.error and op.failures else one_line(exc)[:200]
                    if not idempotent and not isinstance(exc, RateLimitedError):
                        raise BackendError(f"Qualcomm AI Hub: {what} failed ({why}); the request may have reached"
                                           f" the hub: check its jobs page before retrying") from None
                    try:
                        delay = op.failed(why)
                    except _GiveUp:
                        raise self._unreachable(op) from None
                    time.sleep(delay)
                except (APIException, ClientError, ValueError) as exc:
                    raise self._classify(op, exc) from None
        finally:
            _OP.reset(token)

    def _unreachable(self, op: _Operation) -> HubUnreachable:
        waited = time.monotonic() - op.started
        exc = HubUnreachable(
            f"Qualcomm AI Hub at {self.api_url} did not answer ({op.what}: {op.error or 'no answer'}); gave up after"
            f" {waited:.0f} s (network_timeout {op.budget:g} s): check api_url in {config_path()} and the network"
        )
        exc.why, exc.waited = op.error or "no answer", waited
        return exc

    def _classify(self, op: _Operation, exc: BaseException) -> BackendError:
        msg = one_line(exc)
        if op.status == 401 or "Failed to authenticate" in msg or "authentication failure" in msg:
            return HubAuthError(f"Qualcomm AI Hub at {self.api_url} rejected the API token ({op.what}): check"
                                f" api_token in {config_path()} (`qai-hub configure --api_token ...`)")
        if op.status == 404 or "could not be found" in msg:
            return HubNotFound(f"Qualcomm AI Hub: {op.what}: {msg}")
        if op.status == 413 or getattr(exc, "status_code", None) == 413:
            return HubTooLarge(f"Qualcomm AI Hub: {op.what}: refused as too large (HTTP 413): {msg}")
        return BackendError(f"Qualcomm AI Hub: {op.what}: {msg}")

    # -- jobs -----------------------------------------------------------------------------------------------
    def _in_place(self) -> bool:
        """Status lines update in place on a terminal, unless a live display (a spinner) owns it."""
        s = self.stream
        return bool(getattr(s, "isatty", lambda: False)()) and getattr(s, "rich_proxied_file", None) is None

    def wait(self, job, kind: str, *, rerun: str = "rerun the same command to re-attach to it"):
        """Poll ``job`` until it finishes, showing its state; return the final status.

        A FAILED job raises `HubJobFailed` with the hub's reason; a timeout (`HubJobTimeout`), a
        lost hub (`HubUnreachable`) or Ctrl-C says which job is still running and where (``rerun``
        says what a rerun does), without cancelling it.
        """
        url = redact(job.url)
        t0 = time.monotonic()
        last = None
        live = self._in_place()
        open_line = False

        def end_line():
            nonlocal open_line
            if open_line:
                self.say("")
                open_line = False

        try:
            while True:
                try:
                    status = self.call(f"status of {kind} job {job.job_id}", job.get_status)
                except HubUnreachable as exc:
                    end_line()
                    raise HubUnreachable(
                        f"lost contact with Qualcomm AI Hub at {self.api_url} while waiting for {kind} job"
                        f" {job.job_id}: {getattr(exc, 'why', exc)}, no answer for {getattr(exc, 'waited', 0):.0f} s;"
                        f" the job may still be running at {url}: {rerun}") from None
                elapsed = time.monotonic() - t0
                line = f"AI Hub {kind} job {job.job_id}: {status.code} ({elapsed:.0f} s)"
                if live:
                    width = shutil.get_terminal_size((100, 20)).columns
                    self.say("\r" + line[: max(20, width - 1)] + "\x1b[K", end="")
                    open_line = True
                elif status.code != last:
                    self.say(f"{line} {url}")
                last = status.code
                if status.finished:
                    end_line()
                    break
                if elapsed >= self.timeout:
                    end_line()
                    raise HubJobTimeout(
                        f"AI Hub {kind} job {job.job_id} did not finish within {self.timeout:g} s (state"
                        f" {status.code}); it is still running at {url}: {rerun}, or wait longer with"
                        " --job-timeout SECONDS"
                    )
                time.sleep(min(self.poll, max(0.01, self.timeout - elapsed)))
        except KeyboardInterrupt:
            end_line()
            self.say(f"interrupted: AI Hub {kind} job {job.job_id} is still running on the hub ({url}); {rerun}")
            raise
        if not status.success:
            reason = " ".join((status.message or "no reason given").split())
            raise HubJobFailed(f"AI Hub {kind} job {job.job_id} failed: {redact(reason)} ({url})")
        return status
