"""What `vlmrun.pipeline.Pipeline.capture` does: every stage-boundary tensor of one request, with the decoder's
per-step logits teacher-forced on the generated (or given) tokens, as `vlmrun diff` compares them.

The logits come from the cheapest path that gives the teacher-forced rows: the rows the decoder reported while
generating, the decoder's own step-by-step path forced on the tokens (`forced_rows`), or the decoder stage run
once over the prompt plus the tokens. When a vendor runtime generates, both sides of the runtime boundary are
captured: the engine's logits over the same binaries and the runtime's own, teacher-forced through it.
"""

from __future__ import annotations

import attrs
import numpy as np

from .errors import BackendError
from .generation import GenerationSettings
from .sampling import ForcedSampler, Sampler
from .stages import DecodeRequest

def forced_rows(pipe, embeds: np.ndarray, forced: list[int], settings: GenerationSettings,
                engine: bool = False) -> list:
    """The decoder's rows teacher-forced on ``forced``, decoding step by step as it generates: through the
    ``decode`` hook, or (``engine``) the handle's ``engine_decode``; [] when that path reports no logits."""
    handle = pipe.handles["decoder"]
    rows: list[np.ndarray] = []
    if not forced or (engine and not hasattr(handle, "engine_decode")):
        return rows
    base = Sampler(settings.sampling, vocab_limit=pipe.model.vocab_limit)
    request = DecodeRequest(inputs_embeds=embeds, max_new_tokens=len(forced), sampler=ForcedSampler(forced, base),
                            stop_ids=frozenset(), embed_tokens=pipe.embed_tokens,
                            context_length=pipe.context_length, on_logits=lambda r: rows.append(np.array(r)),
                            teacher_tokens=forced)
    if engine:
        tokens = handle.engine_decode(request)
    else:
        tokens = pipe.registry.hook.decode(backend=pipe.layout.backend("decoder"), handle=handle, request=request)
    for _ in tokens or ():
        pass
    return rows


def capture(pipe, image, prompt: str, settings: GenerationSettings = GenerationSettings(),
            teacher_tokens: list[int] | None = None) -> dict[str, np.ndarray]:
    """`vlmrun.pipeline.Pipeline.capture` on ``pipe`` (see there)."""
    runtime = pipe.runtime_name
    gen = pipe.generate(image, prompt, settings, keep_logits=runtime is None).run()
    p, embeds = gen.prepared, gen.tensors["inputs_embeds"]
    forced = list(teacher_tokens if teacher_tokens is not None else gen.token_ids)
    n = max(len(forced), 1)
    rows = gen.step_logits or []
    extra: dict[str, np.ndarray] = {}
    if forced == gen.token_ids[: len(forced)] and len(rows) >= n:
        logits = np.stack(rows[:n])[None].astype(np.float32)
    elif rows and runtime is None and len(again := forced_rows(pipe, embeds, forced, settings)) >= n:
        # a decoder that reports its logits, teacher-forced the way it generates (its step-by-step path: the
        # graphs that made the free-running tokens, which the check of those tokens compares them with)
        logits = np.stack(again[:n])[None].astype(np.float32)
    else:
        tail = pipe.embed_tokens(np.asarray(forced, dtype=np.int64)) if forced else embeds[:, :0]
        full = np.concatenate([embeds, tail], axis=1)
        logits = pipe.run_stage("decoder", {"inputs_embeds": full})["logits"][:, embeds.shape[1] - 1 :][:, :n]
    if runtime is not None:
        engine_rows = forced_rows(pipe, embeds, forced, settings, engine=True)
        if engine_rows:  # the engine step by step, as the runtime runs the binaries
            logits = np.stack(engine_rows[:n])[None].astype(np.float32)
        # the runtime's own logits, teacher-forced on the same tokens through the runtime itself; a budget of
        # exactly the forced tokens, stop tokens kept (a forced stop token ends it where the forced list ends)
        budget = attrs.evolve(settings, max_new_tokens=max(len(forced), 1))
        tf = pipe.generate_prepared(p, budget, keep_logits=True, teacher_tokens=forced or None).run()
        got = tf.step_logits or []
        if not got:
            raise BackendError(f"the decoder's runtime ({runtime}) reported no logits under teacher forcing")
        extra["runtime_logits"] = np.stack(got[:n])[None].astype(np.float32)
        extra["runtime_tokens"] = np.asarray(tf.token_ids, dtype=np.int64)
    return {
        "pixel_values": p.pixel_values,
        "input_ids": p.input_ids,
        **gen.tensors,
        "logits": logits,
        "tokens": np.asarray(gen.token_ids, dtype=np.int64),
        **extra,
    }
