"""``vlmrun serve``: a layout (or a bundle) behind an OpenAI-compatible HTTP API (FastAPI + uvicorn).

    POST /v1/chat/completions   messages with text and one ``image_url`` part (a ``data:`` URI; a local path only
                                under ``--allowed-local-media-path``);
                                temperature, top_p, max_tokens, seed, stop; ``stream: true`` as server-sent
                                ``chat.completion.chunk`` events (``stream_options.include_usage``: a usage chunk)
    GET  /v1/models             what is served: the model id, its layout and the backend of each stage
    GET  /health                ok, and how many requests run and wait

Every response carries ``usage`` and vlmrun's own figures (``vlmrun.timings``: per-stage ms, TTFT, tokens/s).

Concurrency: a device has one of each stage, so a layout runs one generation at a time unless every backend of it
says its stages are safe to share (`vlmrun.plugins.BackendInfo.concurrent`: the reference layout); then
``--concurrency`` generations (default 2, this machine's cores) run in parallel. Requests beyond those wait in a
bounded queue (``--max-queue``); when it is full the answer is 429 with ``Retry-After``. A client that disconnects
cancels its generation (the next token is not computed) and frees its slot; a request that runs past
``--request-timeout`` is cancelled the same way.

Exposed safely (as vLLM and llama-server): ``--api-key`` (or ``VLMRUN_API_KEY``) makes every ``/v1`` endpoint
require ``Authorization: Bearer KEY`` (401 otherwise; compared in constant time, never printed or logged; ``/health``
stays open); a local image path is refused unless ``--allowed-local-media-path DIR`` is given, and then only a file
under DIR is read (symlinks and ``..`` resolved first; a path outside gets the same 400 whether it exists or not:
no file-existence oracle); a body over ``--max-request-bytes`` is 413 before it is read whole (its Content-Length
first, then the bytes counted as they stream in, for a chunked body).

Bad requests (malformed JSON, no or an undecodable image, bad base64, a decompression bomb, two images, a prompt
past the context, an unknown model or field value) get a JSON error body (``{"error": {"message", "type",
"param", "code"}}``, as OpenAI's) and a 4xx status before anything runs: the store is not touched.
"""


import asyncio
import base64
import binascii
import hmac
import io
import json
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Iterator

import attrs

from .conversation import KeptStates, Picture, plan_turn
from .errors import InputError, UsageError, VlmrunError
from .generation import GenerationSettings
from .sampling import SamplingSettings
from .stages import STAGES

MAX_IMAGE_BYTES = 20 * 1024 * 1024  # a request's image, decoded
MAX_IMAGE_PIXELS = 40_000_000  # above this PIL's decompression-bomb check refuses the image
#: a request body's limit by default: two pictures at the image limit as base64 (2 x 26.7 MB) and their text
MAX_REQUEST_BYTES = 64 * 1024 * 1024
API_KEY_ENV = "VLMRUN_API_KEY"
DEFAULT_MAX_TOKENS = 256


class RequestError(Exception):
    """A bad request: ``status`` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.param, self.code, self.kind, self.headers = status, param, code, kind, headers or {}

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


MAX_PICTURES = 8  # pictures in one request's conversation


@attrs.define
class ChatRequest:
    images: list  # the conversation's pictures (PIL images), in the order they appear
    prompt: str  # the last user turn's text
    system: str | None
    messages: list  # the whole conversation (system, user and assistant turns), as vlmrun.preprocess.render_messages takes it
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: list[str]
    stream: bool
    include_usage: bool
    plan: object = None  # the conversation's TurnPlan (vlmrun.conversation), made once by the handler when it checks it

    @property
    def image(self):
        """The first picture (None in a text-only conversation)."""
        return self.images[0] if self.images else None


# -- parsing --------------------------------------------------------------------------------------------------
def _number(body: dict, key: str, kind, default, lo=None, hi=None):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not float(value).is_integer()):
        raise RequestError(400, f"'{key}' must be {'an integer' if kind is int else 'a number'}", key)
    value = kind(value)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        rng = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise RequestError(400, f"'{key}' must be {rng}, got {value}", key)
    return value


def _forbidden_path(url: str, allowed: Path | None) -> RequestError:
    """The one answer for a local path the server will not read: the same whether the file exists or not."""
    if allowed is None:
        return RequestError(400, "local image paths are not accepted by this server (it was started without"
                            " --allowed-local-media-path); send a data: URI", "messages", "local_path_forbidden")
    return RequestError(400, "the image path is not under the server's allowed local media folder"
                        " (--allowed-local-media-path)", "messages", "local_path_forbidden")


def read_local_image(url: str, allowed: Path | None) -> bytes:
    """The bytes of a local image ``url`` (``file://`` or a plain path; a relative one is taken under ``allowed``),
    read only when it resolves (symlinks and ``..`` followed) to a regular file under ``allowed``; at most
    ``MAX_IMAGE_BYTES + 1`` bytes are read. Anything else: a RequestError that says nothing about the file."""
    import os
    import stat

    if allowed is None:
        raise _forbidden_path(url, None)
    raw = url[len("file://"):] if url.startswith("file://") else url
    try:
        real = (allowed / raw).resolve()  # an absolute raw replaces allowed; a symlink loop raises
    except (OSError, RuntimeError, ValueError):
        raise _forbidden_path(url, allowed) from None
    if not real.is_relative_to(allowed):
        raise _forbidden_path(url, allowed)
    try:  # the resolved path, not following a link swapped in since; not blocking on a FIFO
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise RequestError(400, f"image {url} does not exist", "messages", "image_not_found") from None
    except OSError:
        raise _forbidden_path(url, allowed) from None
    with os.fdopen(fd, "rb") as f:
        st, proc = os.fstat(fd), Path(f"/proc/self/fd/{fd}")
        if not stat.S_ISREG(st.st_mode) or (proc.exists() and not Path(os.readlink(proc)).is_relative_to(allowed)):
            raise _forbidden_path(url, allowed)
        if st.st_size > MAX_IMAGE_BYTES:
            raise RequestError(413, f"the image is {st.st_size} bytes; the limit is {MAX_IMAGE_BYTES}", "messages")
        return f.read(MAX_IMAGE_BYTES + 1)


def decode_image(url: str, allowed_media: Path | None = None):
    """An ``image_url``: a ``data:`` URI (base64), or a local path (``file://`` or plain) under ``allowed_media``
    (a resolved folder; None: no local path is read); a PIL image, or a RequestError (400) saying what is wrong."""
    from PIL import Image, UnidentifiedImageError

    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or ";base64" not in head:
            raise RequestError(400, "an image data: URI must be base64 (data:image/png;base64,...)", "messages")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(400, "the image's base64 data is malformed", "messages", "bad_base64") from None
    elif url.startswith(("http://", "https://")):
        raise RequestError(400, "remote image URLs are not fetched; send a data: URI", "messages")
    else:
        data = read_local_image(url, allowed_media)
    if len(data) > MAX_IMAGE_BYTES:
        raise RequestError(413, f"the image is {len(data)} bytes; the limit is {MAX_IMAGE_BYTES}", "messages")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            saved, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, MAX_IMAGE_PIXELS
            try:
                img = Image.open(io.BytesIO(data))
                if img.width * img.height > MAX_IMAGE_PIXELS:
                    raise Image.DecompressionBombError("too many pixels")
                img.load()
            finally:
                Image.MAX_IMAGE_PIXELS = saved
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise RequestError(400, f"the image has more than {MAX_IMAGE_PIXELS} pixels (a decompression bomb?)",
                           "messages", "image_too_large") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        raise RequestError(400, "the image cannot be decoded (not an image, or truncated)", "messages",
                           "bad_image") from None
    return img.convert("RGB")


def parse_chat(body, model_id: str, allowed_media: Path | None = None) -> ChatRequest:
    """The JSON body of /v1/chat/completions as a `ChatRequest`, or a RequestError; local image paths are
    read only under ``allowed_media`` (see `decode_image`)."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_id:
        raise RequestError(404, f"model '{model}' does not exist; this server serves '{model_id}' (GET /v1/models)",
                           "model", "model_not_found")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list", "messages")
    system, images, turns = None, [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise RequestError(400, f"messages[{i}] must be an object with role system, user or assistant",
                               "messages")
        content = m.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list):
            raise RequestError(400, f"messages[{i}].content must be a string or a list of parts", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        turn: list[dict] = []  # this turn as the chat template takes it: text parts and the picture where it is
        for p in parts:
            if not isinstance(p, dict):
                raise RequestError(400, f"messages[{i}].content has a part that is not an object", "messages")
            if p.get("type") == "text" and isinstance(p.get("text"), str):
                turn.append({"type": "text", "text": p["text"]})
                if role == "system":
                    system = p["text"]
            elif p.get("type") == "image_url":
                if role != "user":
                    raise RequestError(400, f"messages[{i}]: only a user turn can hold the picture", "messages")
                url = p.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str) or not url:
                    raise RequestError(400, f"messages[{i}] has an image_url part without a url", "messages")
                images.append(url)
                turn.append({"type": "image"})
            else:
                raise RequestError(400, f"messages[{i}] has a part of unknown type {p.get('type')!r}", "messages")
        if role == "assistant" and any(t.get("type") != "text" for t in turn):
            raise RequestError(400, f"messages[{i}]: an assistant turn holds text only", "messages")
        if not any(t.get("type") == "image" or t.get("text", "").strip() for t in turn):
            raise RequestError(400, f"messages[{i}] is an empty turn (no text, no picture)", "messages", "empty_turn")
        # the picture first in its turn, whatever order the client sent the parts in: FastVLM's prompts put it there
        turns.append({"role": role, "content": sorted(turn, key=lambda t: t.get("type") != "image")})
    if len(images) > MAX_PICTURES:
        raise RequestError(400, f"a conversation holds at most {MAX_PICTURES} pictures; this one has {len(images)}",
                           "messages", "too_many_images")
    if turns[-1]["role"] != "user":
        raise RequestError(400, "the last message must be the user's (the turn to answer)", "messages")
    prompt = "".join(t["text"] for t in turns[-1]["content"] if t.get("type") == "text").strip()
    if not prompt and not any(t.get("type") == "image" for t in turns[-1]["content"]):
        raise RequestError(400, "the user message has no text", "messages")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(x, str) and x for x in stop):
        raise RequestError(400, "'stop' must be a string or a list of up to 4 non-empty strings", "stop")
    opts = body.get("stream_options") or {}
    return ChatRequest(
        images=[decode_image(u, allowed_media) for u in images], prompt=prompt, system=system, messages=turns,
        max_tokens=_number(body, "max_tokens", int, _number(body, "max_completion_tokens", int, DEFAULT_MAX_TOKENS,
                                                            1), 1),
        temperature=_number(body, "temperature", float, 0.0, 0.0, 2.0),
        top_p=_number(body, "top_p", float, 1.0, 0.0, 1.0),
        seed=_number(body, "seed", int, 0),
        stop=stop, stream=bool(body.get("stream", False)),
        include_usage=bool(isinstance(opts, dict) and opts.get("include_usage")),
    )


# -- running --------------------------------------------------------------------------------------------------
class Slots:
    """``concurrency`` generations at once and ``max_queue`` waiting; beyond that, 429."""

    def __init__(self, concurrency: int, max_queue: int):
        self.concurrency, self.max_queue = concurrency, max_queue
        self.sem = asyncio.Semaphore(concurrency)
        self.running = self.waiting = 0
        self.recent: list[float] = []  # seconds of the last generations (for Retry-After)

    def retry_after(self) -> int:
        per = sum(self.recent[-8:]) / len(self.recent[-8:]) if self.recent else 5.0
        return max(1, int(per * (self.waiting + 1) / self.concurrency + 0.999))

    async def acquire(self, timeout: float):
        if self.running + self.waiting >= self.concurrency + self.max_queue:
            raise RequestError(429, f"the server is busy: {self.running} running, {self.waiting} waiting (limit"
                               f" {self.max_queue}); retry later", kind="rate_limit_error", code="busy",
                               headers={"Retry-After": str(self.retry_after())})
        self.waiting += 1
        try:
            await asyncio.wait_for(self.sem.acquire(), timeout)
        except asyncio.TimeoutError:
            raise RequestError(503, f"no slot became free within {timeout:g} s", kind="server_error",
                               code="timeout", headers={"Retry-After": str(self.retry_after())}) from None
        finally:
            self.waiting -= 1
        self.running += 1

    def release(self, seconds: float | None = None):
        self.running -= 1
        if seconds is not None:
            self.recent = [*self.recent[-15:], seconds]
        self.sem.release()


class Run:
    """One generation in a worker thread; ``events`` gets ("text", piece), then ("done", generation) or
    ("error", exception). ``cancel()`` stops it before the next token."""

    def __init__(self, pipe, req: ChatRequest, loop: asyncio.AbstractEventLoop, states: "KeptStates | None" = None):
        self.pipe, self.req, self.loop, self.states = pipe, req, loop, states
        self.events: asyncio.Queue = asyncio.Queue()
        self.cancelled = threading.Event()
        self.pending = None  # an event taken from the queue early, to be handled next
        self.thread = threading.Thread(target=self._work, daemon=True)
        self.t0 = time.perf_counter()

    def start(self):
        self.thread.start()

    def cancel(self):
        self.cancelled.set()

    def _put(self, item):
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, item)
        except RuntimeError:  # the server's loop is gone (shutting down): nobody is listening any more
            self.cancelled.set()

    def _work(self):
        r = self.req
        gen = kept = None
        try:
            kept = self.states.take(r.plan.keys) if self.states is not None else None
            settings = GenerationSettings(max_new_tokens=r.max_tokens, system=r.system,
                                          sampling=SamplingSettings(r.temperature, 0, r.top_p, r.seed))
            gen = self.pipe.generate_turn(r.plan, kept, settings)
            text = ""
            for piece in gen:
                if self.cancelled.is_set():
                    gen.stopped_by = "cancelled"
                    break
                text += piece
                hit = min((text.find(s) for s in r.stop if s in text), default=-1)
                if hit >= 0:  # a stop string: the text up to it, and no further tokens
                    keep = hit - (len(text) - len(piece))
                    if keep > 0:
                        self._put(("text", piece[:keep]))
                    gen.stopped_by = "stop"
                    gen.text = text[:hit]
                    break
                self._put(("text", piece))
            if gen.stopped_by in ("cancelled", "stop"):
                final = gen.text
                gen.close()  # the backend stops here (a runtime's worker process is ended)
                gen.text = final
            if self.states is not None:
                self.states.put(gen.kept)  # its keys are what the state holds, also after a stop
            self._put(("done", gen))
        except Exception as exc:  # VlmrunError: one line for the client; anything else: a server error
            if self.states is not None:
                self.states.drop(kept)  # a state that failed mid-turn is released, never reused
            self._put(("error", exc))


def _finish_reason(gen) -> str:
    return "length" if gen.stopped_by in ("max_new_tokens", "context") else "stop"


def _usage(gen) -> dict:
    n = len([t for t in gen.token_ids if t not in gen.pipeline.model.stop_ids])
    p = int(gen.prepared.input_ids.shape[1])
    cached = int(gen.timings.get("reused_tokens", 0))  # positions taken from the conversation's kept state
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _figures(gen, wall: float) -> dict:
    t = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in gen.timings.items()}
    return {"timings": t, "wall_ms": round(wall * 1e3, 3), "stopped_by": gen.stopped_by}


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


def create_app(pipe, *, model_id: str | None = None, concurrency: int | None = None, max_queue: int = 16,
               request_timeout: float = 600.0, api_key: str | None = None,
               allowed_local_media_path: str | Path | None = None, max_request_bytes: int = MAX_REQUEST_BYTES,
               max_conversations: int = 16, conversation_cache_mb: float = 1024.0):
    """The FastAPI app serving ``pipe`` (a built `vlmrun.pipeline.Pipeline`). ``api_key``: required as a
    Bearer token on every /v1 endpoint; ``allowed_local_media_path``: the one folder local image paths may name
    (none by default); ``max_request_bytes``: a body's limit (413 beyond, before it is read); ``max_conversations``
    and ``conversation_cache_mb``: the kept decoder states of answered conversations (0: keep none)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    model_id = model_id or f"fastvlm-{pipe.model.path.name}"
    allowed = None
    if allowed_local_media_path is not None:
        allowed = Path(allowed_local_media_path).expanduser().resolve()
        if not allowed.is_dir():
            raise UsageError(f"--allowed-local-media-path {allowed_local_media_path}: not a folder")
    if max_request_bytes < 1:
        raise UsageError(f"--max-request-bytes must be positive, got {max_request_bytes}")
    shareable = all(getattr(pipe.registry.backend(pipe.layout.backend(s)), "concurrent", False) for s in STAGES)
    if concurrency is None:
        concurrency = 2 if shareable else 1
    if concurrency > 1 and not shareable:
        raise UsageError(f"--concurrency {concurrency}: layout {pipe.layout.name} runs on a device (one of each"
                         " stage): it serves one generation at a time")
    states = KeptStates(pipe, max_conversations, int(conversation_cache_mb * 2**20))
    app = FastAPI(title="vlmrun", description="FastVLM on a vlmrun layout, OpenAI-compatible")
    app.state.conversations = states
    app.state.slots = None
    app.add_middleware(Guard, api_key=api_key or None, max_request_bytes=max_request_bytes)
    created = int(time.time())

    def slots() -> Slots:  # made on the server's own event loop
        if app.state.slots is None:
            app.state.slots = Slots(concurrency, max_queue)
        return app.state.slots

    def error(exc: RequestError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.get("/health")
    async def health():
        s = slots()
        return {"status": "ok", "model": model_id, "running": s.running, "waiting": s.waiting,
                "concurrency": s.concurrency, "max_queue": s.max_queue}

    @app.get("/v1/models")
    async def models():
        lay = pipe.layout
        return {"object": "list", "data": [{
            "id": model_id, "object": "model", "created": created, "owned_by": "vlmrun",
            "layout": {"name": lay.name, "stages": {s: {"backend": lay.backend(s),
                                                        "options": dict(lay.stages[s].options)} for s in STAGES}},
            "context_length": pipe.context_length, "concurrency": concurrency}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        try:
            raw = await read_body(request, max_request_bytes)
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                raise RequestError(400, "the request body is not valid JSON", code="bad_json") from None
            del raw
            req = parse_chat(body, model_id, allowed)
            try:  # the conversation must fit the context before the request takes a slot (planned once, kept)
                req.plan = plan_turn(pipe, req.messages,  # every turn, as the template says
                                     [Picture.of(im, pipe.model.image_processor_config) for im in req.images])
            except InputError as exc:
                raise RequestError(400, str(exc), "messages", "context_length_exceeded") from None
            await slots().acquire(request_timeout)
        except RequestError as exc:
            return error(exc)
        run = Run(pipe, req, asyncio.get_running_loop(), states)
        run.start()
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        if req.stream:
            return StreamingResponse(_stream(run, req, rid, request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            gen = await _collect(run, request_timeout)
        except RequestError as exc:
            return error(exc)
        finally:
            _release(run)
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model_id,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": gen.text},
                             "finish_reason": _finish_reason(gen), "logprobs": None}],
                "usage": _usage(gen), "vlmrun": _figures(gen, time.perf_counter() - run.t0)}

    def _release(run: Run):
        run.cancel()
        slot_s = time.perf_counter() - run.t0

        def wait_then_release():  # the slot is free only when the worker has stopped using the device
            run.thread.join()
            app_loop.call_soon_threadsafe(slots().release, slot_s)

        app_loop = asyncio.get_running_loop()
        if run.thread.is_alive():
            threading.Thread(target=wait_then_release, daemon=True).start()
        else:
            slots().release(slot_s)

    async def _next(run: Run, deadline: float):
        if run.pending is not None:
            item, run.pending = run.pending, None
            return item
        left = deadline - time.perf_counter()
        if left <= 0:
            raise asyncio.TimeoutError
        return await asyncio.wait_for(run.events.get(), left)

    async def _collect(run: Run, timeout: float):
        deadline = run.t0 + timeout
        try:
            while True:
                kind, value = await _next(run, deadline)
                if kind == "done":
                    return value
                if kind == "error":
                    raise _as_request_error(value)
        except asyncio.TimeoutError:
            raise RequestError(504, f"the generation ran past the request timeout ({timeout:g} s) and was"
                               " cancelled", kind="server_error", code="timeout") from None

    async def _stream(run: Run, req: ChatRequest, rid: str, request: Request) -> Iterator[bytes]:
        deadline = run.t0 + request_timeout

        def event(delta: dict, finish=None, **extra) -> bytes:
            chunk = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": model_id,
                     "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}
            return f"data: {json.dumps(chunk)}\n\n".encode()

        try:
            yield event({"role": "assistant", "content": ""})
            while True:
                try:
                    kind, value = await _next(run, min(deadline, time.perf_counter() + 1.0))
                except asyncio.TimeoutError:
                    if await request.is_disconnected() or time.perf_counter() >= deadline:
                        return  # the finally cancels the generation and frees the slot
                    continue
                if kind == "text":
                    if await request.is_disconnected():
                        return
                    pending = None
                    while not run.events.empty():  # pieces that arrived meanwhile go out in one event
                        k2, v2 = run.events.get_nowait()
                        if k2 != "text":
                            pending = (k2, v2)
                            break
                        value += v2
                    yield event({"content": value})
                    if pending is not None:
                        run.pending = pending  # the done/error event, handled next
                elif kind == "done":
                    yield event({}, _finish_reason(value), vlmrun=_figures(value, time.perf_counter() - run.t0))
                    if req.include_usage:
                        usage = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                                 "model": model_id, "choices": [], "usage": _usage(value)}
                        yield f"data: {json.dumps(usage)}\n\n".encode()
                    yield b"data: [DONE]\n\n"
                    return
                else:
                    err = _as_request_error(value)
                    yield f"data: {json.dumps(err.body())}\n\n".encode()
                    return
        finally:
            _release(run)

    return app


def _as_request_error(exc: Exception) -> RequestError:
    if isinstance(exc, RequestError):
        return exc
    if isinstance(exc, InputError):
        return RequestError(400, str(exc))
    if isinstance(exc, VlmrunError):
        return RequestError(500, str(exc), kind="server_error", code="backend_error")
    return RequestError(500, f"internal error: {type(exc).__name__}: {exc}", kind="server_error")


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """One line when the server listens beyond loopback without an API key."""
    import ipaddress

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


def serve(pipe, host: str = "127.0.0.1", port: int = 8000, **kwargs) -> None:
    """Run the server until interrupted (the CLI's ``vlmrun serve``)."""
    import sys

    import uvicorn

    app = create_app(pipe, **kwargs)
    warning = exposure_warning(host, kwargs.get("api_key"))
    if warning:
        print(warning, file=sys.stderr, flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
