"""Token sampling from logits: greedy, or seeded temperature / top-k / top-p.

Every decoder backend that sees logits (``ort_reference``, host-driven loops over compiled graphs, any plugin
calling ``request.sampler``) picks its tokens here, so a mask set here holds for all of them: ``vocab_limit`` keeps the
rows at and past it from ever being picked (a converted Apple checkpoint's ``<image>`` and padding rows, which
Apple's model does not have). Runtimes that sample inside themselves (vendor LLM runtimes
that only return tokens) get only the settings and do not apply the mask.
"""

from __future__ import annotations

import attrs
import numpy as np


@attrs.frozen
class SamplingSettings:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


class Sampler:
    """Picks the next token from a logits vector. Deterministic for a given seed.

    ``vocab_limit``: only ids below it can be picked (``None``: every row); greedy, top-k, top-p and
    temperature sampling all choose among ``logits[:vocab_limit]``.
    """

    def __init__(self, settings: SamplingSettings = SamplingSettings(), vocab_limit: int | None = None):
        if vocab_limit is not None and int(vocab_limit) < 1:
            raise ValueError(f"vocab_limit must be positive, got {vocab_limit}")
        self.settings = settings
        self.vocab_limit = None if vocab_limit is None else int(vocab_limit)
        self._rng = np.random.default_rng(settings.seed)

    def __call__(self, logits: np.ndarray) -> int:
        s = self.settings
        logits = np.asarray(logits).reshape(-1)
        if self.vocab_limit is not None:
            logits = logits[: self.vocab_limit]  # a view: the masked rows are simply not candidates
        if s.greedy:
            return int(np.argmax(logits))
        logits = logits.astype(np.float64)
        scaled = logits / s.temperature
        order = np.argsort(-scaled, kind="stable")
        if s.top_k > 0:
            order = order[: s.top_k]
        kept = scaled[order]
        probs = np.exp(kept - kept.max())
        probs /= probs.sum()
        if s.top_p < 1.0:
            cut = int(np.searchsorted(np.cumsum(probs), s.top_p) + 1)
            order, probs = order[:cut], probs[:cut] / probs[:cut].sum()
        return int(order[self._rng.choice(len(order), p=probs)])
