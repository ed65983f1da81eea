"""What the core reads from the handles plugins return from ``load_stage``.

``load_stage`` may return any object; the core reads nothing from it except through these classes. A handle
that subclasses `StageHandle` (or `DecoderHandle` for the decoder) and sets their attributes tells
the core what it loaded and what it measured; a plain object is a handle with nothing to report.

>>> class MyVision(StageHandle):
...     def __init__(self, session, artifact):
...         self.session, self.artifacts = session, (artifact,)
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Iterator, Mapping, Sequence

_EMPTY: Mapping = MappingProxyType({})


class StageHandle:
    """Base class of a stage handle. Subclasses set what applies (instance attributes); the defaults say
    "nothing to report".

    :ivar artifacts: the store artifacts (`vlmrun.store.Artifact`) the stage runs from, reported by
        ``vlmrun compile``.
    :ivar last_profile: figures a device measured on the last ``run_stage`` (e.g. a hosted device's
        ``inference_ms``, ``peak_memory_bytes``, ``job_id``, ``device``), reported by ``vlmrun profile``.
    :ivar load_s: seconds spent loading (opening sessions, pushing files).
    """

    artifacts: Sequence = ()
    last_profile: Mapping[str, object] = _EMPTY
    load_s: float = 0.0


class DecoderHandle(StageHandle):
    """Base class of a decoder handle.

    :ivar context_length: the context the decoder was built for (compiled graphs fix it), or ``None`` when it
        follows the layout's ``context_length`` option or the model; the core checks prompt lengths against it.
    :ivar last_timings: figures the runtime measured during the last ``decode`` (e.g. ``ttft_ms``,
        ``tokens_per_s``, ``prompt_tokens_per_s``); they replace the host-clock figures of a generation.
    :ivar runtime_name: the name of the runtime that generates (``decode`` / ``run_request``) when it is NOT the engine
        behind ``run_stage`` (e.g. a vendor's LLM runtime generating over binaries that ``run_stage`` runs in vlmrun's
        host engine); ``None`` when both are the same code. A diff then captures the logits of both, teacher-forced
        on the same tokens, and names the runtime when it departs from the engine (``vlmrun diff``). Such a runtime
        must honour ``on_logits`` and ``teacher_tokens`` of its requests.
    """

    context_length: int | None = None
    last_timings: Mapping[str, float] = _EMPTY
    runtime_name: str | None = None

    def engine_decode(self, request) -> "Iterator[int] | None":
        """With a ``runtime_name``: the engine behind ``run_stage`` decoding ``request`` (a
        `vlmrun.stages.DecodeRequest`) step by step over the same binaries as the runtime does (prefill,
        then one step per token: the same graphs in the same order), so that a diff compares the runtime with the
        engine graph for graph. ``None``: the diff compares with ``run_stage`` over the whole sequence."""
        return None


class DecoderState:
    """A decoder's state kept between the turns of a conversation (its KV cache over ``length`` positions), from the
    ``decoder_state`` hook. The core keeps one per conversation and calls, for each turn:

    1. `truncate` to the longest prefix the kept positions share with the turn's whole token sequence (the
       history re-rendered; picture positions compared by the picture's hash): ``False`` when this state cannot drop
       positions, and then the core calls `reset` and feeds the whole sequence;
    2. `decode` with a `vlmrun.stages.DecodeRequest` whose ``inputs_embeds`` are only the positions after
       `length` (at least one): prefill them on top of the kept positions, then generate as the ``decode`` hook
       does. The positions fed (the new prompt rows and every generated token but the last, which is sampled and not
       fed) stay in the state, and `length` counts them, also when the caller stops the iterator early.

    A decoder whose runtime cannot keep state returns ``None`` from the hook; the core then decodes every turn from
    the start through ``decode`` (the same tokens, only slower).
    """

    length: int = 0
    #: positions the state fed again on its own in the last `decode` (a runtime that cannot cut its cache
    #: replays the kept ones into a new one): the core counts them as prefilled, not reused
    replayed: int = 0

    def truncate(self, n: int) -> bool:
        """Keep the first ``n`` positions only; ``False`` when the state cannot drop positions (the core resets)."""
        return n >= self.length

    def reset(self) -> None:
        """Drop every kept position."""
        raise NotImplementedError

    def decode(self, request) -> Iterator[int]:
        """Continue from the kept positions: see the class docstring."""
        raise NotImplementedError

    @property
    def nbytes(self) -> int:
        """Host bytes this state holds (a server's cache of conversations is bounded by them)."""
        return 0

    def close(self) -> None:
        """Release what the state holds beyond host memory (a runtime's worker process); nothing by default."""


class RequestState:
    """A conversation kept by a runtime that runs whole requests (``run_request``: a bundle's), from the
    ``request_state`` hook. Each turn the core calls `run` with a `vlmrun.stages.RequestRun` holding the
    WHOLE conversation (``prompt_text`` rendered over every turn); the runtime compares it with what it holds, feeds
    only what is new when the conversation extends it (else starts again from nothing: the same answer, slower),
    and sets `reused` (the positions it did not feed again) and `length` (the positions it holds, the
    turn's generated tokens counted) as it goes. `close` releases what it holds (a worker process)."""

    length: int = 0
    reused: int = 0

    def run(self, request) -> Iterator[int]:
        raise NotImplementedError

    def reset(self) -> None:
        """Forget the conversation."""
        raise NotImplementedError

    def close(self) -> None:
        self.reset()

    @property
    def nbytes(self) -> int:
        """Host bytes held while the conversation is kept (a worker's loaded model counts)."""
        return 0


def artifacts_of(handle: object) -> list:
    return list(handle.artifacts) if isinstance(handle, StageHandle) else []


def profile_of(handle: object) -> dict:
    return dict(handle.last_profile) if isinstance(handle, StageHandle) else {}


def context_of(handle: object) -> int | None:
    return handle.context_length if isinstance(handle, DecoderHandle) else None


def runtime_of(handle: object) -> str | None:
    return handle.runtime_name if isinstance(handle, DecoderHandle) else None


def timings_of(handle: object) -> dict[str, float]:
    if not isinstance(handle, DecoderHandle):
        return {}
    return {k: float(v) for k, v in handle.last_timings.items() if isinstance(v, (int, float))}


def device_bytes(handles: Mapping[str, object]) -> int:
    """Bytes on the device of a pipeline's stages: the compiled binaries their artifacts' manifests list
    (``binary_bytes``), each artifact counted once; host-side stages (ONNX on the CPU) count nothing."""
    seen, total = set(), 0
    for handle in handles.values():
        for art in artifacts_of(handle):
            path = str(getattr(art, "path", id(art)))
            if path in seen:
                continue
            seen.add(path)
            total += sum(int(v) for v in (dict(getattr(art, "manifest", {}) or {}).get("binary_bytes") or {}).values())
    return total
