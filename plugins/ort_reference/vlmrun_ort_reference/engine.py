"""The reference runtime on ONNX Runtime (CPU): a graph's session, and the growing-KV decoder loop with the
conversation state it keeps (`KVState`)."""

from __future__ import annotations

import numpy as np

from vlmrun.cpu import onnxruntime_options
from vlmrun.handles import DecoderState


class Session:
    """An onnxruntime session with its input/output names."""

    def __init__(self, path):
        import onnxruntime as ort

        self.sess = ort.InferenceSession(str(path), onnxruntime_options(), providers=["CPUExecutionProvider"])
        self.inputs = [i.name for i in self.sess.get_inputs()]
        self.outputs = [o.name for o in self.sess.get_outputs()]

    def run(self, feeds: dict) -> dict:
        return dict(zip(self.outputs, self.sess.run(self.outputs, feeds)))


class KVDecoder:
    """The growing-KV decoder graph and the loop around it."""

    def __init__(self, path, model):
        self.session = Session(path)
        self.layers, self.kv_heads, self.head_dim = model.num_layers, model.num_kv_heads, model.head_dim
        self.past_names = [n for n in self.session.inputs if n.startswith("past_")]
        self.present_names = [n for n in self.session.outputs if n.startswith("present_")]

    def empty_past(self) -> dict:
        z = np.zeros((1, self.kv_heads, 0, self.head_dim), dtype=np.float32)
        return dict.fromkeys(self.past_names, z)

    def forward(self, embeds: np.ndarray, past: dict, past_len: int):
        t = embeds.shape[1]
        feeds = {
            "inputs_embeds": embeds,
            "attention_mask": np.ones((1, past_len + t), dtype=np.int64),
            "position_ids": np.arange(past_len, past_len + t, dtype=np.int64)[None],
            **past,
        }
        outs = self.session.sess.run(None, feeds)
        logits = outs[0]
        new_past = dict(zip(self.past_names, outs[1:]))
        return logits, new_past

    def new_state(self) -> "KVState":
        return KVState(self)

    def logits_of(self, embeds: np.ndarray) -> np.ndarray:
        """Teacher forcing: logits [1,T,V] of ``embeds`` [1,T,H] from an empty cache."""
        return self.forward(embeds, self.empty_past(), 0)[0]

    def generate(self, request):
        """Decode ``request`` from an empty cache."""
        return KVState(self).decode(request)


class FeedingState(DecoderState):
    """A decoder state that feeds rows itself (`_feed`: rows [1,T,H] after its positions -> their logits); `decode`
    prefills a request's rows, then samples and feeds one token at a time."""

    def _feed(self, embeds: np.ndarray) -> np.ndarray:
        raise NotImplementedError

    def decode(self, request):
        logits = self._feed(request.inputs_embeds)
        for i in range(request.max_new_tokens):
            if request.on_logits is not None:
                request.on_logits(logits[0, -1])
            tok = request.sampler(logits[0, -1])
            yield tok
            if tok in request.stop_ids or i + 1 >= request.max_new_tokens or self.length >= request.context_length:
                return
            logits = self._feed(request.embed_tokens(np.array([tok])))


class KVState(FeedingState):
    """A conversation's past keys and values (``decoder_state``): growing arrays, cut to keep a prefix."""

    def __init__(self, decoder: KVDecoder):
        self.decoder = decoder
        self.reset()

    def reset(self) -> None:
        self.past, self.length = self.decoder.empty_past(), 0

    def truncate(self, n: int) -> bool:
        if n < self.length:
            self.past = {k: v[:, :, :n] for k, v in self.past.items()}
            self.length = n
        return True

    @property
    def nbytes(self) -> int:
        return sum(v.nbytes for v in self.past.values())

    def _feed(self, embeds: np.ndarray) -> np.ndarray:
        logits, self.past = self.decoder.forward(embeds, self.past, self.length)
        self.length += embeds.shape[1]
        return logits
