"""Token sampling from logits: greedy, or seeded temperature / top-k / top-p."""

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
    """Picks the next token from a logits vector. Deterministic for a given seed."""

    def __init__(self, settings: SamplingSettings = SamplingSettings()):
        self.settings = settings
        self._rng = np.random.default_rng(settings.seed)

    def __call__(self, logits: np.ndarray) -> int:
        s = self.settings
        if s.greedy:
            return int(np.argmax(logits))
        logits = np.asarray(logits, dtype=np.float64).reshape(-1)
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
