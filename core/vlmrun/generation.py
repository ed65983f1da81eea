"""A generation: the decoder's tokens streamed as text, with the figures of the request.

`Generation` is what `vlmrun.Pipeline.generate` and `vlmrun.conversation.Chat.ask` return: iterate
it for text pieces; afterwards ``token_ids``, ``text`` and ``timings`` are final.
"""

from __future__ import annotations

import time
from typing import Iterator, Sequence

import attrs
import numpy as np

from .errors import BackendError
from .handles import timings_of
from .sampling import ForcedSampler, Sampler, SamplingSettings
from .stages import DecodeRequest, RequestRun


@attrs.frozen
class GenerationSettings:
    max_new_tokens: int = 64
    sampling: SamplingSettings = SamplingSettings()
    ignore_eos: bool = False
    system: str | None = None


@attrs.define
class Prepared:
    """The host-side inputs of one request."""

    pixel_values: np.ndarray  # [1, 3, S, S] float32
    input_ids: np.ndarray  # [1, T] int64, placeholder expanded
    image_start: int
    prompt_text: str


class Generation:
    """An iterator of text pieces; after it is exhausted, ``token_ids``, ``text`` and ``timings`` are final."""

    def __init__(self, pipeline, prepared: Prepared, settings: GenerationSettings,
                 keep_logits: bool = False, teacher_tokens: Sequence[int] | None = None):
        self.pipeline = pipeline
        self.step_logits: list[np.ndarray] | None = [] if keep_logits else None  # rows the decoder reported
        # teacher forcing: step k takes teacher_tokens[k] (the decoder's own runtime forces them)
        self.teacher_tokens = None if teacher_tokens is None else [int(t) for t in teacher_tokens]
        self.prepared = prepared
        self.settings = settings
        self.token_ids: list[int] = []
        self.text = ""
        self.timings: dict[str, float] = {}
        self.tensors: dict[str, np.ndarray] = {}  # stage-boundary tensors of this request
        self.profiles: dict[str, dict] = {}  # device figures of the stages whose handles report them
        self.stopped_by = ""
        self._iter = self._run()

    def __iter__(self) -> Iterator[str]:
        return self._iter

    def __next__(self) -> str:
        return next(self._iter)

    def close(self) -> None:
        """Stop generating now: the backend's token iterator is closed (a worker process it runs is stopped)."""
        self._iter.close()

    def run(self) -> "Generation":
        """Consume the whole generation (no streaming)."""
        for _ in self._iter:
            pass
        return self

    def _whole_request(self, budget: int, stops: frozenset) -> Iterator[int] | None:
        """The ``run_request`` hook's tokens when every stage is on one backend that runs whole requests."""
        pipe = self.pipeline
        backend = pipe.whole_backend
        if backend is None:
            return None
        p = self.prepared
        request = RequestRun(pixel_values=p.pixel_values, input_ids=p.input_ids, image_start=p.image_start,
                             prompt_text=p.prompt_text, max_new_tokens=budget, sampling=self.settings.sampling,
                             stop_ids=stops, tensors=self.tensors, on_logits=self._on_logits(),
                             teacher_tokens=self.teacher_tokens)
        return pipe.registry.hook.run_request(backend=backend, handles=dict(pipe.handles), request=request)

    def _run(self) -> Iterator[str]:
        pipe, s = self.pipeline, self.settings
        ctx_len = pipe.context_length
        stops = frozenset() if s.ignore_eos else pipe.model.stop_ids
        prompt_len = self.prepared.input_ids.shape[1]
        budget = min(s.max_new_tokens, ctx_len - prompt_len)
        self._t0 = time.perf_counter()  # TTFT: from the decode's start (whole requests: from the start)
        tokens = self._whole_request(budget, stops)
        yield from self._stream(self._stage_by_stage(budget, stops) if tokens is None else tokens, budget, stops)

    def _stage_by_stage(self, budget: int, stops: frozenset) -> Iterator[int]:
        pipe, s = self.pipeline, self.settings
        inputs_embeds = pipe.embed_prompt(self.prepared, self.timings, self.tensors, self.profiles)
        sampler = Sampler(s.sampling, vocab_limit=pipe.model.vocab_limit)
        request = DecodeRequest(
            inputs_embeds=inputs_embeds,
            max_new_tokens=budget,
            sampler=sampler if self.teacher_tokens is None else ForcedSampler(self.teacher_tokens, sampler),
            stop_ids=stops,
            embed_tokens=pipe.embed_tokens,
            context_length=pipe.context_length,
            on_logits=self._on_logits(),
            teacher_tokens=self.teacher_tokens,
        )
        backend = pipe.layout.backend("decoder")
        self._t0 = time.perf_counter()
        tokens = pipe.registry.hook.decode(backend=backend, handle=pipe.handles["decoder"], request=request)
        if tokens is None:
            raise BackendError(f"backend '{backend}' does not implement decode")
        yield from tokens

    def _on_logits(self):
        return None if self.step_logits is None else (lambda row: self.step_logits.append(np.array(row)))

    def _stream(self, tokens: Iterator[int], budget: int, stops: frozenset) -> Iterator[str]:
        pipe, s = self.pipeline, self.settings
        self.timings["prompt_tokens"] = self.prepared.input_ids.shape[1]
        from tokenizers.decoders import DecodeStream

        t_first = t_last = None
        tok = pipe.model.tokenizer
        stream = DecodeStream(skip_special_tokens=True)  # incremental detokenizer (handles split UTF-8)
        for tid in tokens:
            t_last = time.perf_counter()
            if t_first is None:
                t_first = t_last
            tid = int(tid)
            self.token_ids.append(tid)
            if tid in stops:
                self.stopped_by = "eos"
                break
            piece = stream.step(tok, tid)
            if piece:
                self.text += piece
                yield piece
            if len(self.token_ids) >= budget:
                break
        self.stopped_by = self.stopped_by or ("context" if budget < s.max_new_tokens else "max_new_tokens")
        final = tok.decode(self.token_ids, skip_special_tokens=True)
        if final.startswith(self.text) and len(final) > len(self.text):
            yield final[len(self.text) :]  # what was held back (an incomplete UTF-8 sequence)
        self.text = final
        n = len(self.token_ids)
        if t_first is not None:
            self.timings["ttft_ms"] = (t_first - self._t0) * 1e3
            self.timings["decode_ms"] = (t_last - t_first) * 1e3
            if n > 1 and t_last > t_first:
                self.timings["tokens_per_s"] = (n - 1) / (t_last - t_first)
        # A runtime that measures itself (its own profile) knows better than the host clock, which sees the
        # tokens of a non-streaming tool all at once.
        self.timings.update(timings_of(pipe.handles["decoder"]))
        self.timings["new_tokens"] = n  # what this generation yielded, whatever the runtime counted
