"""Conversations: multi-turn chat over any pipeline, the decoder's state kept between turns.

>>> chat = pipe.chat(system="You are a helpful assistant.")         # or Chat(pipe, ...)
>>> for piece in chat.ask("Describe the image.", image="photo.jpg"):  # streams, as Pipeline.generate
...     print(piece, end="")
>>> chat.ask("What color is the shape?").run().text                  # a follow-up: prefills only its new tokens
>>> chat.undo()                                                       # forget the last turn
>>> chat.regenerate()                                                 # answer the last question again

Every turn renders the whole history with the model's chat template (system, user and assistant turns, each
picture's placeholder in the turn where it came) and tokenizes it, so a turn's token sequence is exactly the one a
request computed from scratch would see. What a conversation keeps (`KeptState`) is the decoder's state (its
KV cache, from the ``decoder_state`` hook) and the key of every position that state holds: the token id, or the
picture's hash and row for an image position. A turn keeps the longest prefix its sequence shares with those keys,
drops the rest (``DecoderState.truncate``) and prefills only what follows; the projector's output of a picture is
kept too, so a picture already seen does not run the vision encoder again. A decoder that cannot keep state (its
hook returns ``None``) decodes every turn from the start: the same tokens, only slower.

A conversation longer than the decoder's context is an error that gives the counts; nothing is truncated silently.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from collections import OrderedDict
from typing import Iterator, Sequence

import attrs
import numpy as np

from .errors import InputError, UsageError
from .generation import Generation, GenerationSettings, Prepared
from .preprocess import load_image, preprocess_image, render_conversation, tokenize_conversation
from .sampling import Sampler
from .stages import DecodeRequest, RequestRun


@attrs.frozen
class Picture:
    """One picture of a conversation: its preprocessed ``pixel_values`` and their hash (``key``)."""

    key: str
    pixel_values: np.ndarray = attrs.field(eq=False, repr=False)

    @classmethod
    def of(cls, image, processor_config: dict) -> "Picture":
        """A path or a PIL image, preprocessed as the model's image processor says (a Picture is itself)."""
        if isinstance(image, Picture):
            return image
        if isinstance(image, (str, os.PathLike)):
            image = load_image(image)
        pv = preprocess_image(image, processor_config)
        return cls(hashlib.sha256(pv.tobytes()).hexdigest()[:32], pv)


@attrs.define
class TurnPlan:
    """A turn's whole token sequence: ``input_ids`` [1, T], each position's key (token id, or ``"HASH:row"`` for a
    picture's rows), and where each picture starts."""

    input_ids: np.ndarray
    keys: list
    pictures: list[tuple[int, Picture]]
    text: str

    @property
    def image_positions(self) -> int:
        return sum(1 for k in self.keys if isinstance(k, str))


def plan_turn(pipe, messages: Sequence[dict], pictures: Sequence[Picture]) -> TurnPlan:
    """Render and tokenize ``messages`` (``{"type": "image"}`` parts where ``pictures`` appear, in order) and check
    that the conversation, plus one generated token, fits the decoder's context."""
    model = pipe.model
    text = render_conversation(model.chat_template, messages)
    ids, starts = tokenize_conversation(model.tokenizer, text, model.image_token_id, model.image_tokens)
    if len(starts) != len(pictures):
        raise InputError(f"the conversation places {len(starts)} pictures but {len(pictures)} were given")
    keys: list = [int(t) for t in ids[0]]
    for start, pic in zip(starts, pictures):
        for r in range(model.image_tokens):
            keys[start + r] = f"{pic.key}:{r}"
    plan = TurnPlan(ids, keys, list(zip(starts, pictures)), text)
    if pipe.layout.bundle and len(pictures) != 1:
        raise InputError(f"a bundle's runtime answers a conversation about one picture; this one holds {len(pictures)}")
    ctx = pipe.context_length
    if ids.shape[1] >= ctx:
        raise InputError(
            f"the conversation is {ids.shape[1]} tokens ({plan.image_positions} of them image) but the context holds"
            f" {ctx}; undo a turn, start a new conversation, or raise the decoder's context_length")
    return plan


def common_prefix(a: Sequence, b: Sequence) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class KeptState:
    """What a conversation keeps between turns: the decoder's state (``None``: recompute every turn), the keys of the
    positions it holds, and each picture's ``image_embeds`` by hash."""

    def __init__(self, state, runtime=None):
        self.state = state  # a DecoderState (stage by stage), or None
        self.runtime = runtime  # a RequestState (a runtime of whole requests, e.g. a bundle's), or None
        self._seq: list = []  # the last turn's sequence: its prompt keys, then the tokens it generated
        self._generated: list[int] = []
        self.embeds: dict[str, np.ndarray] = {}
        self._answered: list[int] = []  # the lengths of the prompts this state answered

    @property
    def keys(self) -> list:
        """The keys of the positions the state holds (what was fed: the prompt and every generated token but the
        last, also when the turn was stopped early)."""
        held = self.held
        return (self._seq + list(self._generated))[:held] if held else []

    @property
    def held(self) -> int:
        """The positions kept (by the decoder state or the runtime)."""
        if self.state is not None:
            return int(self.state.length)
        return int(self.runtime.length) if self.runtime is not None else 0

    @property
    def answered(self) -> list[int]:
        """The lengths of the prompts this conversation answered that the state still holds."""
        return [n for n in self._answered if n <= self.held]

    @property
    def keeps(self) -> bool:
        return self.state is not None or self.runtime is not None

    def reset(self) -> None:
        if self.state is not None:
            self.state.reset()
        if self.runtime is not None:
            self.runtime.reset()
        self._seq, self._generated, self._answered = [], [], []

    def close(self) -> None:
        """Release what is kept (a runtime's worker process)."""
        for held in (self.state, self.runtime):
            if held is not None:
                held.close()

    @property
    def nbytes(self) -> int:
        kept = sum(int(x.nbytes) for x in (self.state, self.runtime) if x is not None)
        return kept + sum(e.nbytes for e in self.embeds.values())


class ChatGeneration(Generation):
    """One turn of a conversation: a `vlmrun.generation.Generation` whose prompt is the whole history, of which
    the decoder prefills only the positions its kept state does not hold. ``timings`` add ``prefill_tokens`` (the
    positions this turn fed the decoder) and ``reused_tokens`` (the positions taken from the kept state)."""

    def __init__(self, pipeline, plan: TurnPlan, kept: KeptState, settings: GenerationSettings, on_done=None):
        first = plan.pictures[0] if plan.pictures else None
        prepared = Prepared(first[1].pixel_values if first else None, plan.input_ids, first[0] if first else -1,
                            plan.text)
        super().__init__(pipeline, prepared, settings)
        self.plan, self.kept, self._on_done = plan, kept, on_done
        self.started = self.done = False

    def _run(self) -> Iterator[str]:
        self.started = True
        pipe, s = self.pipeline, self.settings
        stops = frozenset() if s.ignore_eos else pipe.model.stop_ids
        budget = min(s.max_new_tokens, pipe.context_length - self.plan.input_ids.shape[1])
        finished = False
        try:
            tokens = self._whole(budget, stops)
            if tokens is None:
                tokens = self._continue(budget, stops)
            yield from self._stream(tokens, budget, stops)
            finished = True
        except (GeneratorExit, KeyboardInterrupt):  # stopped by the caller: the answer so far is the turn's answer
            finished = True
            raise
        finally:
            self.done = True
            if finished and self._on_done is not None:
                self._on_done(self)

    def _whole(self, budget: int, stops: frozenset) -> Iterator[int] | None:
        """A whole-request runtime (a bundle) answers the whole history itself, from the start."""
        pipe = self.pipeline
        if pipe.whole_backend is None:
            return None
        if self.kept.state is not None:  # a decoder state kept stage by stage: the stage-by-stage path
            return None
        if len(self.plan.pictures) != 1:
            return None
        self._t0 = time.perf_counter()
        kept, total = self.kept, int(self.plan.input_ids.shape[1])
        if kept.runtime is None:
            tokens = self._whole_request(budget, stops)
            if tokens is not None:
                self.timings.update(prefill_tokens=total, reused_tokens=0)
            return tokens
        p = self.prepared
        request = RequestRun(pixel_values=p.pixel_values, input_ids=p.input_ids, image_start=p.image_start,
                             prompt_text=p.prompt_text, max_new_tokens=budget, sampling=self.settings.sampling,
                             stop_ids=stops, tensors=self.tensors)
        kept._seq, kept._generated = list(self.plan.keys), self.token_ids
        kept._answered = [n for n in kept._answered if n <= kept.runtime.reused] + [total]
        return self._counted(kept.runtime.run(request), total)

    def _counted(self, tokens: Iterator[int], total: int) -> Iterator[int]:
        """The runtime's tokens, with the positions it reused in the timings once it says (its first token)."""
        first = True
        for tok in tokens:
            if first:
                reused = int(self.kept.runtime.reused)
                self.timings.update(prefill_tokens=total - reused, reused_tokens=reused)
                first = False
            yield tok

    def _continue(self, budget: int, stops: frozenset) -> Iterator[int]:
        pipe, plan, kept = self.pipeline, self.plan, self.kept
        total = len(plan.keys)
        state = kept.state
        start = 0
        if state is not None:
            start = min(common_prefix(kept.keys, plan.keys), total - 1)  # at least one position to prefill
            if start < state.length and not state.truncate(start):
                state.reset()
                start = 0
            if state.length != start:  # a state that kept fewer positions than asked: start from what it holds
                state.reset()
                start = 0
        embeds = self._embeds(start)
        self.timings.update(prefill_tokens=total - start, reused_tokens=start)
        self.tensors["inputs_embeds"] = embeds
        request = DecodeRequest(
            inputs_embeds=embeds, max_new_tokens=budget,
            sampler=Sampler(self.settings.sampling, vocab_limit=pipe.model.vocab_limit), stop_ids=stops,
            embed_tokens=pipe.embed_tokens, context_length=pipe.context_length)
        self._t0 = time.perf_counter()
        if state is not None:
            kept._seq, kept._generated = list(plan.keys), self.token_ids
            kept._answered = [n for n in kept._answered if n <= start] + [total]
            tokens = state.decode(request)
            replayed = int(getattr(state, "replayed", 0) or 0)
            if replayed:
                self.timings.update(prefill_tokens=total - start + replayed, reused_tokens=start - replayed)
        else:
            backend = pipe.layout.backend("decoder")
            tokens = pipe.registry.hook.decode(backend=backend, handle=pipe.handles["decoder"], request=request)
        try:
            yield from tokens
        finally:
            close = getattr(tokens, "close", None)
            if close is not None:
                close()

    def _embeds(self, start: int) -> np.ndarray:
        """The decoder's input rows ``start..T``: the embed stage over the new token ids, each picture's rows from
        its kept ``image_embeds`` (the vision encoder and projector run once per picture and conversation)."""
        pipe, plan, kept = self.pipeline, self.plan, self.kept
        rows = pipe._timed("embed", {"input_ids": plan.input_ids[:, start:]}, self.timings, self.profiles)
        out = np.array(rows["inputs_embeds"], dtype=np.float32, copy=True)
        n = pipe.model.image_tokens
        for pic_start, pic in plan.pictures:
            if pic_start + n <= start:
                continue
            img = kept.embeds.get(pic.key)
            if img is None:
                feats, img = pipe.image_embeds(pic.pixel_values, self.timings, self.profiles)
                kept.embeds[pic.key] = img
                self.tensors.update(image_features=feats, image_embeds=img)
            lo = max(pic_start, start)
            out[:, lo - start : pic_start + n - start] = img[:, lo - pic_start :]
        return out


class Chat:
    """A conversation over a pipeline: see the module docstring."""

    def __init__(self, pipe, system: str | None = None, settings: GenerationSettings = GenerationSettings(),
                 keep_state: bool = True):
        self.pipe, self.system, self.settings = pipe, system, settings
        self.kept = pipe.new_kept_state() if keep_state else KeptState(None)
        self.messages: list[dict] = []  # user and assistant turns; a picture part names its index in ``pictures``
        self.pictures: list[Picture] = []
        self._asks: list[str] = []  # each answered turn's prompt, for regenerate
        self._running: ChatGeneration | None = None

    @property
    def keeps_state(self) -> bool:
        """Whether the decoder (or the runtime) continues from a kept state (else every turn is computed from the
        start)."""
        return self.kept.keeps

    def _rendered(self) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system is not None else []
        return head + self.messages

    def ask(self, prompt: str, image=None, settings: GenerationSettings | None = None) -> ChatGeneration:
        """A user turn (``image``: a path or PIL image, shown first in this turn) -> the streaming answer. The turn
        joins the history when its generation ends or is closed (a stopped answer stays, as far as it got)."""
        if self._running is not None and self._running.started and not self._running.done:
            raise UsageError("the previous answer is still streaming; finish or close it first")
        settings = settings or self.settings
        if settings.max_new_tokens < 1:
            raise InputError("max_new_tokens must be at least 1")
        if not prompt.strip() and image is None:
            raise InputError("an empty turn: give a prompt or a picture")
        pictures = list(self.pictures)
        content: list[dict] = []
        if image is not None:
            pic = Picture.of(image, self.pipe.model.image_processor_config)
            content.append({"type": "image", "picture": len(pictures)})
            pictures.append(pic)
        content.append({"type": "text", "text": prompt})
        user = {"role": "user", "content": content}
        plan = plan_turn(self.pipe, self._rendered() + [user], pictures)

        def done(gen: ChatGeneration) -> None:
            self.messages += [user, {"role": "assistant", "content": gen.text}]
            self.pictures = pictures
            self._asks.append(prompt)

        gen = ChatGeneration(self.pipe, plan, self.kept, settings, on_done=done)
        self._running = gen
        return gen

    def undo(self) -> None:
        """Forget the last turn (question and answer; its picture too). The decoder's kept state drops those
        positions at the next turn (``DecoderState.truncate``; a state that cannot is recomputed)."""
        if not self._asks:
            raise UsageError("nothing to undo: the conversation has no answered turn")
        last_user = self.messages[-2]
        self.messages = self.messages[:-2]
        if any(p.get("type") == "image" for p in last_user["content"]):
            self.pictures = self.pictures[:-1]
        self._asks.pop()

    def regenerate(self, settings: GenerationSettings | None = None) -> ChatGeneration:
        """Answer the last question again (e.g. with other sampling settings)."""
        if not self._asks:
            raise UsageError("nothing to regenerate: the conversation has no answered turn")
        prompt = self._asks[-1]
        last_user = self.messages[-2]
        pic = self.pictures[-1] if any(p.get("type") == "image" for p in last_user["content"]) else None
        self.undo()
        return self.ask(prompt, pic, settings)  # the same picture, not read again

    def reset(self) -> None:
        """Start over: no turns, no pictures, an empty decoder state."""
        self.messages, self.pictures, self._asks = [], [], []
        self.kept.reset()
        self.kept.embeds.clear()

    @property
    def tokens(self) -> int:
        """The positions the decoder's kept state holds."""
        return len(self.kept.keys)

    def close(self) -> None:
        """Release what the conversation holds (a runtime's worker process); it can go on afterwards, from the start."""
        self.kept.close()

    def __enter__(self) -> "Chat":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class KeptStates:
    """The kept states of the conversations a server answered, least recently used out beyond ``max_count``
    conversations or ``max_bytes``. A request takes the state of the conversation it extends: one that answered a
    prompt the request starts with (the same tokens and the same pictures; of those, the one sharing the longest
    prefix; what follows the shared prefix, an edited answer or turn, is recomputed), or a new one; the state is out of the cache while its turn runs,
    so two requests never share one, and goes back when the turn ends (stopped or not). A turn that failed is not
    put back. With no ``decoder_state`` (the decoder cannot continue), nothing is kept."""

    def __init__(self, pipe, max_count: int = 16, max_bytes: int = 1 << 30):
        self.pipe, self.max_count, self.max_bytes = pipe, int(max_count), int(max_bytes)
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, KeptState] = OrderedDict()

    def take(self, keys: Sequence) -> KeptState:
        with self._lock:
            best, best_len = None, 0
            for ident, kept in self._entries.items():
                shared = common_prefix(kept.keys, keys)
                if shared > best_len and any(n <= shared for n in kept.answered):
                    best, best_len = ident, shared
            if best is not None:
                return self._entries.pop(best)
        return self.pipe.new_kept_state() if self.max_count > 0 else KeptState(None)

    def put(self, kept: KeptState) -> None:
        if kept is None or not kept.keeps:
            return
        if kept.held == 0 or self.max_count <= 0:
            kept.close()
            return
        with self._lock:
            self._entries[id(kept)] = kept
            while self._entries and (len(self._entries) > self.max_count or self.nbytes > self.max_bytes):
                self._entries.popitem(last=False)[1].close()

    def drop(self, kept: KeptState) -> None:
        """A state whose turn failed: released, never reused."""
        if kept is not None:
            kept.close()

    @property
    def nbytes(self) -> int:
        return sum(k.nbytes for k in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)
