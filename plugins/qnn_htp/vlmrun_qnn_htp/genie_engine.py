"""Decoder engine ``genie``: Genie (libGenie.so from onnxruntime-qnn) on the QnnHtp backend.

The decoder is exported in Genie's I/O layout (``decoder/genie``: AR-N and AR-1 graphs taking
``inputs_embeds``), compiled by this plugin into context binaries (the EP's ``*_ctx_qnn.bin``), and handed to
Genie through a dialog config generated from the model (`vlmrun_qualcomm.genie_config.dialog_config`). Genie
runs in a worker process (`vlmrun_qualcomm.genie_worker.stream_tokens_worker`): in one process with
onnxruntime-qnn's EP it gave corrupt tokens.
``GenieDialog_embeddingTokenQuery`` gets the spliced prompt embeddings and a token-to-embedding callback over the
host LUT; token ids stream back as Genie produces them.

On a phone (``target = "android"``) the same dialog config, its paths made remote, runs through the SDK's
``genie-t2t-run`` on the phone's HTP over adb (`.genie_phone`, ``handle.phone``).

The same compiled graphs also run under a host-driven loop (`GenieLayoutDecoder`), used for teacher
forcing (``run_stage``) and to check Genie against this plugin's own arithmetic.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import numpy as np

from vlmrun.errors import BackendError, InputError
from vlmrun.handles import DecoderHandle
from vlmrun_qualcomm import genie_binding, genie_config, genie_worker

from . import ep
from .decoder import MASK_MIN, FixedKVDecoder


def libgenie_path() -> Path:
    try:
        import onnxruntime_qnn
    except ImportError as exc:
        raise BackendError(f"engine genie needs onnxruntime-qnn (it ships libGenie.so): {exc}") from None
    path = Path(onnxruntime_qnn.__file__).parent / "libGenie.so"
    if not path.is_file():
        raise BackendError(f"engine genie: onnxruntime-qnn {onnxruntime_qnn.__version__} has no libGenie.so at {path}")
    return path


def rope_tables(facts: genie_config.GenieModel, ctx: int) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin [ctx, head_dim/2] as Genie computes them (rope-dim = head_dim/2, HF's default rope)."""
    d = facts.head_dim
    inv = 1.0 / (facts.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    ang = np.arange(ctx, dtype=np.float64)[:, None] * inv[None]
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


class GenieLayoutDecoder(FixedKVDecoder):
    """The host loop of `FixedKVDecoder` over the Genie-layout graphs, feeding them exactly what Genie
    feeds: an additive mask whose first C-AR columns are the past slots and last AR columns this call's rows,
    cos/sin rows of the positions, keys [KV,1,D,C-AR] and values [KV,1,C-AR,D]. The state layout and the
    graph I/O (``reset``, ``_step``) differ, and the choice of graph (`_pick`): with more than one prompt graph (the
    parts form's AR-128 and its follow-up AR-32) the smallest that covers the rows left. ``steps``: the calls made
    per AR."""

    def __init__(self, graphs: dict[int, object], ctx: int, facts: genie_config.GenieModel, min_chunk: int = 2):
        self.graphs = dict(sorted(graphs.items()))
        if 1 not in self.graphs:
            raise ValueError("the Genie-layout decoder needs an AR-1 graph")
        self.ctx, self.facts, self.min_chunk = int(ctx), facts, min_chunk
        self.cos, self.sin = rope_tables(facts, self.ctx)
        self.steps = {ar: 0 for ar in self.graphs}

    def _pick(self, left: int) -> int:
        """The AR of the next call for ``left`` rows: the smallest prompt graph that takes them all in one call,
        else the largest (a chunk), among those that fit the context and are worth a call (``left`` >= its AR or
        ``min_chunk``); AR-1 when none is. With one prompt graph this is `FixedKVDecoder._pick`."""
        fits = [ar for ar in self.graphs
                if ar > 1 and left >= min(ar, self.min_chunk) and self.n_past + ar <= self.ctx]
        if not fits:
            return 1
        covering = [ar for ar in fits if ar >= left]
        return min(covering) if covering else max(fits)

    def reset(self):
        f, c = self.facts, self.ctx
        self.k = [np.zeros((f.kv_heads, 1, f.head_dim, c), np.float32) for _ in range(f.layers)]
        self.v = [np.zeros((f.kv_heads, 1, c, f.head_dim), np.float32) for _ in range(f.layers)]
        self.n_past = 0

    def _step(self, embeds: np.ndarray, ar: int) -> np.ndarray:
        n, C, P, f = embeds.shape[1], self.ctx, self.n_past, self.facts
        past_len = C - ar
        if P > past_len:
            raise InputError(f"the decoder context ({C} tokens) is full")
        x = np.zeros((1, ar, f.hidden), np.float32)
        x[:, :n] = embeds
        mask = np.full((1, ar, C), MASK_MIN, np.float32)
        mask[0, :, :P] = 0.0
        for r in range(ar):
            mask[0, r, past_len : past_len + r + 1] = 0.0
        pos = np.minimum(np.arange(P, P + ar), C - 1)
        feeds = {"inputs_embeds": x, "attention_mask": mask,
                 "position_ids_cos": self.cos[pos][None, None], "position_ids_sin": self.sin[pos][None, None]}
        for i in range(f.layers):
            feeds[f"past_key_{i}_in"] = np.ascontiguousarray(self.k[i][..., :past_len])
            feeds[f"past_value_{i}_in"] = np.ascontiguousarray(self.v[i][:, :, :past_len])
        out = self.graphs[ar].run(feeds)
        for i in range(f.layers):
            self.k[i][..., P : P + n] = out[f"past_key_{i}_out"][..., :n]
            self.v[i][:, :, P : P + n] = out[f"past_value_{i}_out"][:, :, :n]
        self.n_past = P + n
        self.steps[ar] += 1
        return out["logits"].reshape(1, ar, -1)[:, :n]


class GenieHtpHandle(DecoderHandle):
    """The decoder stage with engine ``genie``: Genie for ``decode``, the host loop for ``run_stage``."""

    def __init__(self, model, graphs: list[tuple[int, object]], ctx: int, soc, lut_npy: Path,
                 timeout: float = 600.0):
        self.model = model
        self.lut_npy = Path(lut_npy)
        self.timeout = float(timeout)
        self.artifacts = [a for _, a in graphs]
        self.ctx = int(ctx)
        self.soc = soc
        self.facts = genie_config.GenieModel.from_model(model)
        self.ctx_bins = []
        for _, art in graphs:
            bins = [f for f in art.manifest.get("binary_bytes", {})] or [
                f for f in art.manifest["files"] if f.endswith(".bin")]
            self.ctx_bins += [str(art.path / b) for b in bins]
        self.graph_arts = dict(graphs)
        self.tokenizer = self.model.path / "tokenizer.json"
        self.lib = genie_binding.GenieLibrary(libgenie_path())
        self._host: GenieLayoutDecoder | None = None
        self.load_s = 0.0
        self.last_timings: dict = {}
        self.runtime_name = genie_worker.RUNTIME_NAME

    @property
    def context_length(self) -> int:
        return self.ctx

    @property
    def decoder(self) -> GenieLayoutDecoder:
        """The host-driven loop over the same compiled graphs (opened on first use)."""
        if self._host is None:
            sessions = {ar: ep.HtpSession(art.file(), self.soc, f"decoder (decoder/genie ar={ar})")
                        for ar, art in self.graph_arts.items()}
            self._host = GenieLayoutDecoder(sessions, self.ctx, self.facts)
        return self._host

    def engine_decode(self, request):
        """The host loop over the same graphs, step by step as Genie runs them (for diffs)."""
        return self.decoder.generate(request)

    def config(self, request) -> dict:
        stops = sorted(request.stop_ids) if request.stop_ids else [self._never_token()]
        return genie_config.dialog_config(
            self.facts, "QnnHtp", tokenizer=self.tokenizer, context_size=self.ctx,
            sampling=getattr(request.sampler, "settings", None), max_new_tokens=request.max_new_tokens,
            ctx_bins=self.ctx_bins, eos=stops,
        )

    def _never_token(self) -> int:
        """An eos id for 'ignore eos': a vocabulary padding row past the tokenizer (its logit never wins), else
        the model's own eos (Genie cannot run without one)."""
        try:
            n_tok = self.model.tokenizer.get_vocab_size(with_added_tokens=True)
        except Exception:
            n_tok = self.facts.vocab
        return self.facts.vocab - 1 if n_tok < self.facts.vocab else self.facts.eos[0]

    def genie_generate(self, request) -> Iterator[int]:
        limit = min(int(request.context_length or self.ctx), self.ctx)
        if request.inputs_embeds.shape[1] >= limit:
            raise InputError(f"the prompt is {request.inputs_embeds.shape[1]} tokens but the compiled decoder"
                             f" context holds {limit}; compile the decoder with a larger context_length")
        self.last_timings = {}
        yield from genie_worker.stream_tokens_worker(self.lib.path, self.config(request), request.inputs_embeds,
                                                     self.lut_npy, timeout=self.timeout, profile_out=self.last_timings,
                                                     **genie_worker.tap_arguments(request, self.model))
