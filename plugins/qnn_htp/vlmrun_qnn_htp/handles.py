"""qnn_htp's stage handles for the fixed forms: a compiled stage on the local HTP, the static-shape embed graph
over any length, and the fixed decoder's host loop (the parts form's handles are `.parts_run`)."""

from __future__ import annotations

import numpy as np

from vlmrun.handles import DecoderHandle as DecoderHandleBase
from vlmrun.handles import StageHandle

from . import ep


class LocalStage(StageHandle):
    """A compiled non-decoder stage on the local HTP backend."""

    def __init__(self, session: "ep.HtpSession", artifact):
        self.session = session
        self.artifact = artifact
        self.artifacts = (artifact,)
        self.load_s = session.load_s

    def run(self, inputs: dict) -> dict:
        feeds = {}
        for name, (shape, dtype) in self.session.inputs.items():
            feeds[name] = np.ascontiguousarray(inputs[name], dtype=dtype)
        return self.session.run(feeds)


class ChunkedEmbed(StageHandle):
    """The static-shape embed graph (seq E) over any length: pad with token 0, run in chunks, slice."""

    def __init__(self, runner: StageHandle, seq: int):
        self.runner = runner
        self.seq = seq
        self.artifacts = runner.artifacts
        self.artifact = runner.artifacts[0] if runner.artifacts else None
        self.load_s = runner.load_s

    def run(self, inputs: dict) -> dict:
        ids = np.asarray(inputs["input_ids"], dtype=np.int64)
        T, E = ids.shape[1], self.seq
        parts = []
        for i in range(0, T, E):
            chunk = np.zeros((1, E), np.int64)
            n = min(E, T - i)
            chunk[0, :n] = ids[0, i : i + n]
            out = self.runner.run({"input_ids": chunk})["inputs_embeds"]
            if not isinstance(out, np.ndarray):  # QuantizedTensor from a phone
                out = out.dequantize()
            parts.append(out[:, :n])
        return {"inputs_embeds": np.concatenate(parts, axis=1).astype(np.float32)}


class DecoderHandle(DecoderHandleBase):
    def __init__(self, decoder, artifacts, load_s):
        self.decoder = decoder
        self.artifacts = list(artifacts)
        self.load_s = load_s

    @property
    def context_length(self) -> int:
        """The context the graphs were compiled for (the core checks prompt lengths against it)."""
        return self.decoder.ctx


