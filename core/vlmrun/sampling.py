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

from .errors import BackendError


@attrs.frozen
class SamplingSettings:
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


#: the largest seed: a signed 32-bit one, the most a vendor runtime's sampler config takes (one refuses 2**31 and
#: above: measured), so that a seed means the same on every backend
SEED_MAX = 2**31 - 1


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
        if not np.isfinite(logits).all():  # argmax picks a NaN's id; sampling draws index 0: garbage either way
            bad = int((~np.isfinite(logits)).sum())
            raise BackendError(f"the decoder gave {bad} non-finite logits (NaN or inf) for the next token: its"
                               " numbers overflowed; find where with vlmrun diff --locate")
        if s.greedy:
            return int(np.argmax(logits))
        return sample(logits, s, self._rng)


class ForcedSampler:
    """Teacher forcing: step k returns ``tokens[k]`` whatever the logits; past the list, ``then`` samples.

    What the core hands a decoder (``DecodeRequest.sampler``) when a request is teacher-forced, so that every
    decoder that samples through ``request.sampler`` is forced without knowing it."""

    def __init__(self, tokens, then: Sampler):
        self.tokens = [int(t) for t in tokens]
        self.then = then
        self.settings = then.settings
        self.steps = 0

    def __call__(self, logits: np.ndarray) -> int:
        k = self.steps
        self.steps += 1
        return self.tokens[k] if k < len(self.tokens) else self.then(logits)


FIRST_PREFIX = 64  # candidates sorted first; the prefix grows 8x until it holds the answer


def sorted_prefix(scaled: np.ndarray, k: int) -> np.ndarray:
    """The ids of the ``k`` largest values (at least; ties at the boundary included), in the order of
    ``np.argsort(-scaled, kind="stable")``: a prefix of that order, in O(V + k log k) instead of O(V log V)."""
    n = scaled.size
    if k >= n:
        return np.argsort(-scaled, kind="stable")
    kth = np.partition(scaled, n - k)[n - k]  # the k-th largest value
    cand = np.flatnonzero(scaled >= kth)  # every tie of the k-th value: the stable order decides among them
    return cand[np.lexsort((cand, -scaled[cand]))]


def sample(logits: np.ndarray, s: SamplingSettings, rng: np.random.Generator) -> int:
    """One token by temperature, top-k and top-p, without sorting the whole vocabulary.

    The token is the one the plain algorithm (stable sort of the scaled logits, top-k, softmax over the kept ones,
    top-p cut, ``rng.choice``) picks for the same generator state: ``rng.choice(n, p=p)`` draws one ``rng.random()``
    and takes the first cumulative probability above it, so only the sorted prefix up to that point (or up to the
    top-p cut) is needed. Only the softmax's sum over the whole vocabulary is taken in another order (relative
    rounding 1e-16: a token differs only for a draw that close to a boundary)."""
    scaled = logits.astype(np.float64) / s.temperature
    e = np.exp(scaled - scaled.max())
    n = scaled.size
    rank = logits  # the order of the scaled logits (temperature > 0), in the input's own (narrower) dtype
    if s.top_k > 0:  # a small set: exactly the plain arithmetic on it
        order = sorted_prefix(rank, s.top_k)[: s.top_k]
        probs = e[order] / e[order].sum()
        if s.top_p < 1.0:
            cut = int(np.searchsorted(np.cumsum(probs), s.top_p) + 1)
            order, probs = order[:cut], probs[:cut] / probs[:cut].sum()
        return _draw(order, np.cumsum(probs), rng.random())
    total = e.sum()
    k = FIRST_PREFIX
    if s.top_p < 1.0:  # the sorted prefix that reaches top_p
        while True:
            order = sorted_prefix(rank, k)
            cum = np.cumsum(e[order]) / total
            if cum[-1] >= s.top_p or order.size >= n:
                break
            k *= 8
        cut = min(int(np.searchsorted(cum, s.top_p) + 1), order.size)
        p = e[order[:cut]]
        return _draw(order[:cut], np.cumsum(p / p.sum()), rng.random())
    u = rng.random()  # temperature only: the sorted prefix whose cumulative probability passes u
    while True:
        order = sorted_prefix(rank, k)
        cum = np.cumsum(e[order]) / total
        if order.size >= n or cum[-1] > u:
            return _draw(order, cum, u, normalise=order.size >= n)
        k *= 8


def _draw(order: np.ndarray, cum: np.ndarray, u: float, normalise: bool = True) -> int:
    """``rng.choice``'s step: the first cumulative probability above ``u`` (``cum`` divided by its last entry)."""
    cdf = cum / cum[-1] if normalise else cum
    return int(order[min(int(np.searchsorted(cdf, u, side="right")), order.size - 1)])


def sample_sorted(logits: np.ndarray, s: SamplingSettings, rng: np.random.Generator) -> int:
    """The plain algorithm `sample` reproduces: a stable sort of the whole vocabulary, top-k, softmax over the
    kept ones, top-p cut, ``rng.choice``. vlmrun's sampler until partial selection; kept as the reference it is
    held to (tests, ``benchmarks/serve.py``)."""
    scaled = logits.astype(np.float64) / s.temperature
    order = np.argsort(-scaled, kind="stable")
    if s.top_k > 0:
        order = order[: s.top_k]
    kept = scaled[order]
    probs = np.exp(kept - kept.max())
    probs /= probs.sum()
    if s.top_p < 1.0:
        cut = int(np.searchsorted(np.cumsum(probs), s.top_p) + 1)
        order, probs = order[:cut], probs[:cut] / probs[:cut].sum()
    return int(order[rng.choice(len(order), p=probs)])
