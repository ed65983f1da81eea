"""``vlmrun serve``: a layout (or a bundle) behind an OpenAI-compatible HTTP API (FastAPI + uvicorn).

    POST /v1/chat/completions   messages with text and one ``image_url`` part (``data:`` URI or a local path);
                                temperature, top_p, max_tokens, seed, stop; ``stream: true`` as server-sent
                                ``chat.completion.chunk`` events (``stream_options.include_usage``: a usage chunk)
    GET  /v1/models             what is served: the model id, its layout and the backend of each stage
    GET  /health                ok, and how many requests run and wait

Every response carries ``usage`` and vlmrun's own figures (``vlmrun.timings``: per-stage ms, TTFT, tokens/s).

Concurrency: a device has one of each stage, so a layout runs one generation at a time unless every backend of it
says its stages are safe to share (:attr:`vlmrun.plugins.BackendInfo.concurrent`: the reference layout); then
``--concurrency`` generations (default 2, this machine's cores) run in parallel. Requests beyond those wait in a
bounded queue (``--max-queue``); when it is full the answer is 429 with ``Retry-After``. A client that disconnects
cancels its generation (the next token is not computed) and frees its slot; a request that runs past
``--request-timeout`` is cancelled the same way.

Bad requests (malformed JSON, no or an undecodable image, bad base64, a decompression bomb, two images, a prompt
past the context, an unknown model or field value) get a JSON error body (``{"error": {"message", "type",
"param", "code"}}``, as OpenAI's) and a 4xx status before anything runs: the store is not touched.
"""


import asyncio
import base64
import binascii
import io
import json
import threading
import time
import uuid
import warnings
from pathlib import Path
from typing import Iterator

import attrs

from .errors import InputError, UsageError, VlmrunError
from .stages import STAGES

MAX_IMAGE_BYTES = 20 * 1024 * 1024  # a request's image, decoded
MAX_IMAGE_PIXELS = 40_000_000  # above this PIL's decompression-bomb check refuses the image
DEFAULT_MAX_TOKENS = 256


class RequestError(Exception):
    """A bad request: ``status`` and an OpenAI-style error body."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.param, self.code, self.kind, self.headers = status, param, code, kind, headers or {}

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@attrs.define
class ChatRequest:
    image: object  # a PIL image
    prompt: str
    system: str | None
    max_tokens: int
    temperature: float
    top_p: float
    seed: int
    stop: list[str]
    stream: bool
    include_usage: bool
    prepared: object = None  # the pipeline's Prepared inputs, made once by the handler when it checks the request


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


def decode_image(url: str):
    """An ``image_url``: a ``data:`` URI (base64) or a local path (``file://`` or plain); a PIL image, or a
    RequestError (400) saying what is wrong."""
    from PIL import Image, UnidentifiedImageError

    if url.startswith("data:"):
        head, sep, payload = url.partition(",")
        if not sep or ";base64" not in head:
            raise RequestError(400, "an image data: URI must be base64 (data:image/png;base64,...)", "messages")
        try:
            data = base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise RequestError(400, "the image's base64 data is malformed", "messages", "bad_base64") from None
    else:
        path = Path(url[len("file://"):] if url.startswith("file://") else url)
        if url.startswith(("http://", "https://")):
            raise RequestError(400, "remote image URLs are not fetched; send a data: URI or a local path", "messages")
        if not path.is_file():
            raise RequestError(400, f"image {path} does not exist", "messages", "image_not_found")
        data = path.read_bytes()
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


def parse_chat(body, model_id: str) -> ChatRequest:
    """The JSON body of /v1/chat/completions as a :class:`ChatRequest`, or a RequestError."""
    if not isinstance(body, dict):
        raise RequestError(400, "the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != model_id:
        raise RequestError(404, f"model '{model}' does not exist; this server serves '{model_id}' (GET /v1/models)",
                           "model", "model_not_found")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError(400, "'messages' must be a non-empty list", "messages")
    system, texts, images = None, [], []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "developer"):
            raise RequestError(400, f"messages[{i}] must be an object with role system, user or assistant",
                               "messages")
        content = m.get("content")
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        if not isinstance(parts, list):
            raise RequestError(400, f"messages[{i}].content must be a string or a list of parts", "messages")
        for p in parts:
            if not isinstance(p, dict):
                raise RequestError(400, f"messages[{i}].content has a part that is not an object", "messages")
            if p.get("type") == "text" and isinstance(p.get("text"), str):
                if m["role"] in ("system", "developer"):
                    system = p["text"]
                elif m["role"] == "user":
                    texts.append(p["text"])
            elif p.get("type") == "image_url":
                url = p.get("image_url")
                url = url.get("url") if isinstance(url, dict) else url
                if not isinstance(url, str) or not url:
                    raise RequestError(400, f"messages[{i}] has an image_url part without a url", "messages")
                images.append(url)
            else:
                raise RequestError(400, f"messages[{i}] has a part of unknown type {p.get('type')!r}", "messages")
    if not images:
        raise RequestError(400, "FastVLM answers about one image: the request has none (an image_url part)",
                           "messages", "no_image")
    if len(images) > 1:
        raise RequestError(400, f"FastVLM takes one image per request; this one has {len(images)}", "messages",
                           "too_many_images")
    prompt = "\n".join(t for t in texts if t).strip()
    if not prompt:
        raise RequestError(400, "the user message has no text", "messages")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(x, str) and x for x in stop):
        raise RequestError(400, "'stop' must be a string or a list of up to 4 non-empty strings", "stop")
    opts = body.get("stream_options") or {}
    return ChatRequest(
        image=decode_image(images[0]), prompt=prompt, system=system,
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

    def __init__(self, pipe, req: ChatRequest, loop: asyncio.AbstractEventLoop):
        self.pipe, self.req, self.loop = pipe, req, loop
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
        from .pipeline import GenerationSettings
        from .sampling import SamplingSettings

        r = self.req
        gen = None
        try:
            settings = GenerationSettings(max_new_tokens=r.max_tokens, system=r.system,
                                          sampling=SamplingSettings(r.temperature, 0, r.top_p, r.seed))
            gen = self.pipe.generate_prepared(r.prepared, settings)
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
            self._put(("done", gen))
        except Exception as exc:  # VlmrunError: one line for the client; anything else: a server error
            self._put(("error", exc))


def _finish_reason(gen) -> str:
    return "length" if gen.stopped_by in ("max_new_tokens", "context") else "stop"


def _usage(gen) -> dict:
    n = len([t for t in gen.token_ids if t not in gen.pipeline.model.stop_ids])
    p = int(gen.prepared.input_ids.shape[1])
    return {"prompt_tokens": p, "completion_tokens": n, "total_tokens": p + n}


def _figures(gen, wall: float) -> dict:
    t = {k: (round(v, 3) if isinstance(v, float) else v) for k, v in gen.timings.items()}
    return {"timings": t, "wall_ms": round(wall * 1e3, 3), "stopped_by": gen.stopped_by}


def create_app(pipe, *, model_id: str | None = None, concurrency: int | None = None, max_queue: int = 16,
               request_timeout: float = 600.0):
    """The FastAPI app serving ``pipe`` (a built :class:`vlmrun.pipeline.Pipeline`)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    model_id = model_id or f"fastvlm-{pipe.model.path.name}"
    shareable = all(getattr(pipe.registry.backend(pipe.layout.backend(s)), "concurrent", False) for s in STAGES)
    if concurrency is None:
        concurrency = 2 if shareable else 1
    if concurrency > 1 and not shareable:
        raise UsageError(f"--concurrency {concurrency}: layout {pipe.layout.name} runs on a device (one of each"
                         " stage): it serves one generation at a time")
    app = FastAPI(title="vlmrun", description="FastVLM on a vlmrun layout, OpenAI-compatible")
    app.state.slots = None
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
            raw = await request.body()
            try:
                body = json.loads(raw)
            except (ValueError, UnicodeDecodeError):
                raise RequestError(400, "the request body is not valid JSON", code="bad_json") from None
            req = parse_chat(body, model_id)
            try:  # the prompt must fit the context before the request takes a slot (prepared once, kept)
                req.prepared = pipe.prepare(req.image, req.prompt, req.system)
            except InputError as exc:
                raise RequestError(400, str(exc), "messages", "context_length_exceeded") from None
            await slots().acquire(request_timeout)
        except RequestError as exc:
            return error(exc)
        run = Run(pipe, req, asyncio.get_running_loop())
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


def serve(pipe, host: str = "127.0.0.1", port: int = 8000, **kwargs) -> None:
    """Run the server until interrupted (the CLI's ``vlmrun serve``)."""
    import uvicorn

    app = create_app(pipe, **kwargs)
    uvicorn.run(app, host=host, port=port, log_level="warning", timeout_graceful_shutdown=5)
