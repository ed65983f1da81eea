"""How ``vlmrun serve`` runs a request: `Slots` (the concurrency and the bounded queue), `Run` (one generation in a
worker thread, cancellable before the next token) and `Responder` (a run's events as a JSON answer or as
server-sent ``chat.completion.chunk`` events; the slot freed only when the worker has stopped)."""

import asyncio
import json
import secrets
import threading
import time
from typing import Callable, Iterator

import attrs

from .conversation import KeptStates
from .generation import GenerationSettings
from .sampling import SamplingSettings
from .serve_requests import ChatRequest, RequestError, as_request_error

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
            seed = r.seed  # none asked for: a fresh one when sampling (greedy needs none: 0 keeps a runtime's
            if seed is None:  # config, and so its kept conversation, the same from turn to turn)
                seed = secrets.randbits(31) if r.temperature > 0 else 0
            settings = GenerationSettings(max_new_tokens=r.max_tokens, system=r.system,
                                          sampling=SamplingSettings(r.temperature, 0, r.top_p, seed))
            gen = self.pipe.generate_turn(r.plan, kept, settings)
            text, sent = "", 0  # what the model said; how much of it the client has
            for piece in gen:
                if self.cancelled.is_set():
                    gen.stopped_by = "cancelled"
                    break
                text += piece
                hit = min((text.find(s) for s in r.stop if s in text), default=-1)
                if hit >= 0:  # a stop string: the text up to it, and no further tokens
                    if hit > sent:
                        self._put(("text", text[sent:hit]))
                    gen.stopped_by = "stop"
                    gen.text = text[:hit]
                    break
                ready = len(text) - held_back(text, r.stop)  # a stop string's start is sent once it is not one
                if ready > sent:
                    self._put(("text", text[sent:ready]))
                    sent = ready
            else:
                if len(text) > sent:  # the answer's end, held back as a possible stop string's start
                    self._put(("text", text[sent:]))
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


def held_back(text: str, stops) -> int:
    """How many characters at the end of ``text`` could be the start of a stop string (not streamed yet: a client
    must never see part of a stop string the answer is then cut at)."""
    return max((k for s in stops for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])),
               default=0)


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


@attrs.define
class Responder:
    """A started `Run`'s events as the HTTP answer: `collect` (one JSON completion) or `stream` (server-sent
    events); `release` frees the request's slot once the worker has stopped using the device."""

    slots: Callable[[], Slots]  # made on the server's own event loop, on first use
    model_id: str
    request_timeout: float

    def release(self, run: Run) -> None:
        run.cancel()
        slot_s = time.perf_counter() - run.t0
        slots = self.slots()

        def wait_then_release():  # the slot is free only when the worker has stopped using the device
            run.thread.join()
            app_loop.call_soon_threadsafe(slots.release, slot_s)

        app_loop = asyncio.get_running_loop()
        if run.thread.is_alive():
            threading.Thread(target=wait_then_release, daemon=True).start()
        else:
            slots.release(slot_s)

    async def collect(self, run: Run):
        """The finished generation, or a RequestError (the run's error; 504 past the request timeout)."""
        deadline = run.t0 + self.request_timeout
        try:
            while True:
                kind, value = await _next(run, deadline)
                if kind == "done":
                    return value
                if kind == "error":
                    raise as_request_error(value)
        except asyncio.TimeoutError:
            raise RequestError(504, f"the generation ran past the request timeout ({self.request_timeout:g} s) and"
                               " was cancelled", kind="server_error", code="timeout") from None

    def completion(self, run: Run, gen, rid: str) -> dict:
        """The ``chat.completion`` body of a finished generation."""
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": self.model_id,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": gen.text},
                             "finish_reason": _finish_reason(gen), "logprobs": None}],
                "usage": _usage(gen), "vlmrun": _figures(gen, time.perf_counter() - run.t0)}

    def _chunk(self, rid: str, delta: dict, finish=None, **extra) -> bytes:
        chunk = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": self.model_id,
                 "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}
        return f"data: {json.dumps(chunk)}\n\n".encode()

    async def stream(self, run: Run, req: ChatRequest, rid: str, request) -> Iterator[bytes]:
        """Server-sent events: the role, the text as it comes (pieces that arrived meanwhile in one event), the
        finish with vlmrun's figures, the usage chunk if asked, ``[DONE]``. A client that disconnects, or the
        request timeout, cancels the generation; the slot is released in every case."""
        deadline = run.t0 + self.request_timeout
        try:
            yield self._chunk(rid, {"role": "assistant", "content": ""})
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
                    yield self._chunk(rid, {"content": value + _drain_text(run)})
                elif kind == "done":
                    yield self._chunk(rid, {}, _finish_reason(value),
                                      vlmrun=_figures(value, time.perf_counter() - run.t0))
                    if req.include_usage:
                        usage = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                                 "model": self.model_id, "choices": [], "usage": _usage(value)}
                        yield f"data: {json.dumps(usage)}\n\n".encode()
                    yield b"data: [DONE]\n\n"
                    return
                else:
                    yield f"data: {json.dumps(as_request_error(value).body())}\n\n".encode()
                    return
        finally:
            self.release(run)


async def _next(run: Run, deadline: float):
    """The run's next event (one taken early first), or asyncio.TimeoutError at ``deadline``."""
    if run.pending is not None:
        item, run.pending = run.pending, None
        return item
    left = deadline - time.perf_counter()
    if left <= 0:
        raise asyncio.TimeoutError
    return await asyncio.wait_for(run.events.get(), left)


def _drain_text(run: Run) -> str:
    """The text pieces already queued behind the current one; a done/error event met on the way is kept for
    next."""
    text = ""
    while not run.events.empty():
        kind, value = run.events.get_nowait()
        if kind != "text":
            run.pending = (kind, value)
            break
        text += value
    return text
