"""``vlmrun serve``: a layout (or a bundle) behind an OpenAI-compatible HTTP API (FastAPI + uvicorn).

    POST /v1/chat/completions   messages with text and one ``image_url`` part (a ``data:`` URI; a local path only
                                under ``--allowed-local-media-path``);
                                temperature, top_p, max_tokens, seed, stop; ``stream: true`` as server-sent
                                ``chat.completion.chunk`` events (``stream_options.include_usage``: a usage chunk)
    GET  /v1/models             what is served: the model id, its layout and the backend of each stage
    GET  /health                ok, and how many requests run and wait

Every response carries ``usage`` and vlmrun's own figures (``vlmrun.timings``: per-stage ms, TTFT, tokens/s).

The parts: `vlmrun.serve_requests` (the request parsed, its pictures decoded, OpenAI-style errors),
`vlmrun.serve_guard` (API key, body size, exposure warning), `vlmrun.serve_runs` (slots, the generation's worker
thread, the JSON or streamed answer); this module wires them into the app.

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
import json
import socket
import sys
import time
import uuid
from pathlib import Path

from .conversation import KeptStates, Picture, plan_turn
from .errors import InputError, UsageError
from .serve_guard import API_KEY_ENV, MAX_REQUEST_BYTES, Guard, exposure_warning, read_body
from .serve_requests import ChatRequest, RequestError, parse_chat
from .serve_runs import Responder, Run, Slots
from .stages import STAGES

__all__ = ["API_KEY_ENV", "MAX_REQUEST_BYTES", "create_app", "exposure_warning", "serve"]


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
    allowed = _allowed_folder(allowed_local_media_path)
    if max_request_bytes < 1:
        raise UsageError(f"--max-request-bytes must be positive, got {max_request_bytes}")
    concurrency = _concurrency(pipe, concurrency)
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

    answer = Responder(slots, model_id, request_timeout)

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
            req = await _checked_request(request, pipe, model_id, allowed, max_request_bytes)
            await slots().acquire(request_timeout)
        except RequestError as exc:
            return error(exc)
        run = Run(pipe, req, asyncio.get_running_loop(), states)
        run.start()
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        if req.stream:
            return StreamingResponse(answer.stream(run, req, rid, request), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            gen = await answer.collect(run)
        except RequestError as exc:
            return error(exc)
        finally:
            answer.release(run)
        return answer.completion(run, gen, rid)

    return app


async def _checked_request(request, pipe, model_id: str, allowed: Path | None, limit: int) -> ChatRequest:
    """The request's body read (at most ``limit`` bytes), parsed, and its conversation planned: it must fit the
    context before it takes a slot (the plan is made once and kept on the request)."""
    raw = await read_body(request, limit)
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        raise RequestError(400, "the request body is not valid JSON", code="bad_json") from None
    del raw
    req = parse_chat(body, model_id, allowed)
    try:
        req.plan = plan_turn(pipe, req.messages,  # every turn, as the template says
                             [Picture.of(im, pipe.model.image_processor_config) for im in req.images])
    except InputError as exc:
        raise RequestError(400, str(exc), "messages", "context_length_exceeded") from None
    return req


def _allowed_folder(path: str | Path | None) -> Path | None:
    if path is None:
        return None
    allowed = Path(path).expanduser().resolve()
    if not allowed.is_dir():
        raise UsageError(f"--allowed-local-media-path {path}: not a folder")
    return allowed


def _concurrency(pipe, asked: int | None) -> int:
    """Generations at once: 2 on a layout whose every backend shares its stages, else 1 (and more is an error)."""
    shareable = all(getattr(pipe.registry.backend(pipe.layout.backend(s)), "concurrent", False) for s in STAGES)
    concurrency = asked if asked is not None else (2 if shareable else 1)
    if concurrency > 1 and not shareable:
        raise UsageError(f"--concurrency {concurrency}: layout {pipe.layout.name} runs on a device (one of each"
                         " stage): it serves one generation at a time")
    return concurrency


def serve(pipe, host: str = "127.0.0.1", port: int = 8000, announce: str | None = None, **kwargs) -> None:
    """Run the server until interrupted (the CLI's ``vlmrun serve``). The port is bound first: ``announce`` (a
    "serving on" line) is printed only once it listens; a port in use or a host not of this machine is one
    UsageError line."""
    import uvicorn

    app = create_app(pipe, **kwargs)
    try:
        family = socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.create_server((host.strip("[]"), port), family=family)
    except OSError as exc:
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}; choose another --port or --host")
    warning = exposure_warning(host, kwargs.get("api_key"))
    if warning:
        print(warning, file=sys.stderr, flush=True)
    if announce:
        print(announce, file=sys.stderr, flush=True)
    with sock:
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5)
        uvicorn.Server(config).run(sockets=[sock])
