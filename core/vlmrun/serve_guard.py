"""What stands in front of ``vlmrun serve``'s ``/v1`` endpoints before a body is read: the API key (401), the
request's size (413, declared or counted as it streams in), and the warning for a server exposed without a key."""

import hmac
import ipaddress
import json

from .serve_requests import RequestError

API_KEY_ENV = "VLMRUN_API_KEY"
#: a request body's limit by default: two pictures at the image limit as base64 (2 x 26.7 MB) and their text
MAX_REQUEST_BYTES = 64 * 1024 * 1024


class Guard:
    """ASGI middleware in front of every ``/v1`` endpoint, before any of the body is read: the API key (401), and
    a declared Content-Length over the limit (413; the connection is closed, the body never read)."""

    def __init__(self, app, api_key: str | None, max_request_bytes: int):
        self.app, self.max_request_bytes = app, max_request_bytes
        self.key = api_key.encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not (scope["path"] == "/v1" or scope["path"].startswith("/v1/")):
            return await self.app(scope, receive, send)
        headers = dict(scope["headers"])  # lower-case names (ASGI)
        if self.key is not None:
            scheme, _, given = headers.get(b"authorization", b"").decode("latin-1").strip().partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode("latin-1"), self.key):
                err = RequestError(401, "a valid API key is required: send 'Authorization: Bearer <key>' (the"
                                   " server's --api-key)", code="invalid_api_key",
                                   headers={"WWW-Authenticate": "Bearer"})
                return await _send_error(send, err)
        length = headers.get(b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_request_bytes:
            return await _send_error(send, too_large(int(length), self.max_request_bytes))
        return await self.app(scope, receive, send)


def too_large(size: int | None, limit: int) -> RequestError:
    said = f"is {size} bytes; the limit is" if size is not None else "is over the limit of"
    return RequestError(413, f"the request body {said} {limit} bytes (the server's --max-request-bytes)",
                        code="request_too_large", headers={"Connection": "close"})


async def _send_error(send, err: RequestError) -> None:
    payload = json.dumps(err.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
               *((k.lower().encode(), v.encode()) for k, v in err.headers.items())]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})


async def read_body(request, limit: int) -> bytes:
    """The request's body, counted as it streams in: past ``limit`` bytes, a 413 without reading the rest."""
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise too_large(None, limit)
    return bytes(buf)


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """One line when the server listens beyond loopback without an API key."""
    if api_key:
        return None
    try:
        loopback = host == "localhost" or ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a host name
        loopback = False
    if loopback:
        return None
    return (f"warning: serving on {host} without --api-key (or {API_KEY_ENV}): anyone who can reach this port can"
            " use the model")
