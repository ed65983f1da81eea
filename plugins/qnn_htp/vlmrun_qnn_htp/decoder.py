"""The host-driven fixed-KV decode loop over two compiled graphs: AR-N (prefill chunks) and AR-1 (generation).

Graph contract (``decoder/fixed`` export, AR = N, context C): inputs ``inputs_embeds`` [1,N,H], additive
``attention_mask`` f32 [1,1,N,C] (0 or -65504), ``position_ids`` int32 [1,N], ``past_key_i``/``past_value_i``
[1,KV,C-N,D]; outputs ``logits`` [1,N,V] and ``new_key_i``/``new_value_i`` [1,KV,N,D]. Inside the graph the
keys are ``concat(past, new)``, so mask column ``j < C-N`` is past slot ``j`` and column ``C-N+r`` is row ``r``
of this call.

The host owns the KV slots (one [1,KV,C,D] buffer per tensor), the mask and the positions; it writes the new
keys at slot ``n_past`` and picks AR-N while at least ``min_chunk`` tokens are left (and they fit), else AR-1.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from vlmrun.errors import InputError
from vlmrun.handles import DecoderState

MASK_MIN = np.float32(-65504.0)


class FixedKVDecoder:
    def __init__(self, graphs: dict[int, object], ctx: int, model, min_chunk: int = 2):
        """:param graphs: AR -> a runner with ``run(feeds) -> dict`` (an `HtpSession`)."""
        self.graphs = dict(sorted(graphs.items()))
        self.ctx = int(ctx)
        self.layers, self.kv_heads, self.head_dim = model.num_layers, model.num_kv_heads, model.head_dim
        self.hidden = model.hidden_size
        self.min_chunk = min_chunk
        self.prefill_ar = max(self.graphs)
        self.steps: dict[int, int] = {ar: 0 for ar in self.graphs}
        if 1 not in self.graphs:
            raise ValueError("the fixed-KV decoder needs an AR-1 graph")

    # -- state ---------------------------------------------------------------------------------------
    def reset(self):
        shape = (1, self.kv_heads, self.ctx, self.head_dim)
        self.k = [np.zeros(shape, np.float32) for _ in range(self.layers)]
        self.v = [np.zeros(shape, np.float32) for _ in range(self.layers)]
        self.n_past = 0

    def _pick(self, left: int) -> int:
        for ar in sorted(self.graphs, reverse=True):
            if ar == 1 or (left >= min(ar, self.min_chunk) and self.n_past + ar <= self.ctx):
                return ar
        return 1

    def _step(self, embeds: np.ndarray, ar: int) -> np.ndarray:
        """Run ``embeds`` [1,n,H] (n <= ar) through the AR-``ar`` graph; returns logits [1,n,V]."""
        n, C, P = embeds.shape[1], self.ctx, self.n_past
        past_len = C - ar
        if P > past_len:
            raise InputError(f"the decoder context ({C} tokens) is full")
        x = np.zeros((1, ar, self.hidden), np.float32)
        x[:, :n] = embeds
        mask = np.full((1, 1, ar, C), MASK_MIN, np.float32)
        mask[0, 0, :, :P] = 0.0  # every row sees the filled past slots
        for r in range(ar):  # causal over this call's rows (padding rows too; their outputs are dropped)
            mask[0, 0, r, past_len : past_len + r + 1] = 0.0
        pos = np.minimum(np.arange(P, P + ar), C - 1).astype(np.int32)[None]
        feeds = {"inputs_embeds": x, "attention_mask": mask, "position_ids": pos}
        for i in range(self.layers):
            feeds[f"past_key_{i}"] = np.ascontiguousarray(self.k[i][:, :, :past_len])
            feeds[f"past_value_{i}"] = np.ascontiguousarray(self.v[i][:, :, :past_len])
        out = self.graphs[ar].run(feeds)
        for i in range(self.layers):
            self.k[i][:, :, P : P + n] = out[f"new_key_{i}"][:, :, :n]
            self.v[i][:, :, P : P + n] = out[f"new_value_{i}"][:, :, :n]
        self.n_past = P + n
        self.steps[ar] += 1
        return out["logits"][:, :n]

    def prefill(self, embeds: np.ndarray, all_logits: bool = False) -> np.ndarray:
        """Feed ``embeds`` [1,T,H] from the current state; logits of every row, or of the last only."""
        T = embeds.shape[1]
        if self.n_past + T > self.ctx:
            raise InputError(
                f"{self.n_past + T} tokens do not fit the compiled decoder context of {self.ctx};"
                " shorten the prompt or compile with a larger context_length"
            )
        outs, i = [], 0
        while i < T:
            ar = self._pick(T - i)
            n = min(ar, T - i)
            logits = self._step(embeds[:, i : i + n], ar)
            outs.append(logits if all_logits else logits[:, -1:])
            i += n
        return np.concatenate(outs, axis=1) if all_logits else outs[-1]

    # -- API used by the hooks -------------------------------------------------------------------------
    def forward_all(self, embeds: np.ndarray) -> np.ndarray:
        """Teacher forcing: logits [1,T,V] of a causal forward from an empty cache."""
        self.reset()
        return self.prefill(embeds.astype(np.float32), all_logits=True)

    def generate(self, request) -> Iterator[int]:
        """Decode ``request`` from an empty cache."""
        self.reset()
        return self.resume(request)

    def resume(self, request) -> Iterator[int]:
        """Decode ``request`` on top of the positions the KV buffers hold (``n_past``): prefill its rows, then
        generate (a conversation's next turn, `FixedKVState`)."""
        limit = min(int(request.context_length or self.ctx), self.ctx)
        if self.n_past + request.inputs_embeds.shape[1] >= limit:
            raise InputError(
                f"the prompt is {self.n_past + request.inputs_embeds.shape[1]} tokens but the compiled decoder context"
                f" holds {limit}; compile the decoder with a larger context_length"
            )
        return self._resume(request, limit)

    def _resume(self, request, limit: int) -> Iterator[int]:
        logits = self.prefill(request.inputs_embeds.astype(np.float32))
        for i in range(request.max_new_tokens):
            if request.on_logits is not None:
                request.on_logits(logits[0, -1])
            tok = int(request.sampler(logits[0, -1]))
            yield tok
            if tok in request.stop_ids or i + 1 >= request.max_new_tokens or self.n_past >= limit:
                return
            logits = self._step(request.embed_tokens(np.array([tok])), 1)


class FixedKVState(DecoderState):
    """A conversation's KV buffers over a `FixedKVDecoder` (or its Genie-layout subclass), kept between turns:
    swapped into the decoder for a turn, the slots past ``length`` masked and overwritten (so cutting is free)."""

    def __init__(self, decoder: FixedKVDecoder):
        self.decoder = decoder
        self.k = self.v = None
        self.length = 0

    def reset(self) -> None:
        self.k = self.v = None
        self.length = 0

    def truncate(self, n: int) -> bool:
        self.length = min(self.length, int(n))
        return True

    @property
    def nbytes(self) -> int:
        return 0 if self.k is None else sum(a.nbytes for a in self.k) + sum(a.nbytes for a in self.v)

    def decode(self, request) -> Iterator[int]:
        d = self.decoder
        if self.k is None:
            d.reset()
            self.k, self.v = d.k, d.v
        d.k, d.v, d.n_past = self.k, self.v, self.length
        tokens = d.resume(request)  # checks the context before anything runs
        return self._follow(tokens)

    def _follow(self, tokens: Iterator[int]) -> Iterator[int]:
        d = self.decoder
        d.k, d.v, d.n_past = self.k, self.v, self.length  # another turn may have used the decoder since
        for tok in tokens:
            self.length = d.n_past
            yield tok
            d.k, d.v, d.n_past = self.k, self.v, self.length
        self.length = d.n_past
