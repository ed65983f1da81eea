"""The reference decoder run part by part (``-o decoder.parts=N``): one part's float32 weights in memory at a time.

FastVLM-7B's decoder is about 28 GB of float32 weights (its layers and lm_head): one onnxruntime session of it
cannot open on a 24 GB machine, and a bf16 one would not run on onnxruntime's CPU provider. With ``parts`` other
than 1 the reference runs the float ``decoder/parts`` export instead with ``rows = any`` (`.decoder_parts`: the same
layers, the same math, each part one graph of its own over a fixed context, taking any number of rows) under the
host loop below:

* the keys and values of every layer live in host buffers (`PartsState`), ``[KV,1,D,C]`` and ``[KV,1,C,D]``;
* the new rows (a prompt, a turn, a generated token) go through part 1 in one call, then through part 2, ... So a
  prompt, or a teacher-forced diff, opens each part once; each generated token opens every part once;
* a part's session is opened when its rows come and closed after them (`PartGraphs`), unless the sessions of every
  part fit in the memory allowed together: then they stay open (a small model runs at full speed).

Slow at 7B (each token reads every part's weights again) and bounded by one part. ``parts = 0`` plans the fewest
parts whose export fits the memory budget (`plan_layers`); ``parts = 1`` (the default) is the whole decoder in one
session (`.engine.KVDecoder`), as before.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Iterator

import numpy as np

from vlmrun.checkpoint_stream import (EXPORT_BASE_BYTES, EXPORT_WEIGHT_COPIES, MEMORY_BUDGET_ENV, export_peak_bytes,
                                      memory_allowed, memory_budget, physical_memory)
from vlmrun.errors import InputError, UsageError
from vlmrun.handles import DecoderHandle
from vlmrun.stages import ExportForm

from .engine import FeedingState, Session
from .torch_common import MASK_MIN

#: the rows the part graphs are traced with (they take any number)
TRACE_ROWS = 16
#: the part graphs' fixed context when the layout sets no ``context_length`` (at most the model's own)
DEFAULT_CONTEXT = 2048


# -- the plan ------------------------------------------------------------------------------------------------------
def layer_bytes(model) -> int:
    """Bytes of one decoder layer's float32 weights (attention with biases on q/k/v, the MLP, two norms)."""
    H, I = model.hidden_size, int(model.text_config["intermediate_size"])
    q, kv = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
    return 4 * (H * (q + 2 * kv) + (q + 2 * kv) + q * H + 3 * H * I + 2 * H)


def head_bytes(model) -> int:
    """Bytes of the final norm and the lm_head in float32 (the last part holds them, tied or not)."""
    return 4 * (model.vocab_size * model.hidden_size + model.hidden_size)


def plan_layers(model, parts: int) -> list[int]:
    """Layers per part. ``parts`` > 0: that many parts, even (the first ones a layer more; one part is refused, in one
    line naming ``parts = 0``, when the decoder's float32 weights alone are more than this machine's memory, as
    FastVLM-7B's 28.3 GB here). ``0``: one part when the whole decoder's export fits `memory_allowed`, else the
    fewest parts whose every export fits it: the last part (which holds the lm_head too) as many layers as fit
    beside it, the layers before it split evenly."""
    N = model.num_layers
    if parts > N:
        raise UsageError(f"decoder.parts {parts}: the model's decoder has {N} layers, so at most {N} parts")
    weights = N * layer_bytes(model) + head_bytes(model)
    if parts == 1 and weights > physical_memory():
        raise UsageError(f"the reference decoder in one session holds {weights / 1e9:.1f} GB of float32 weights, more"
                         f" than this machine's {physical_memory() / 1e9:.1f} GB of memory;"
                         " run it part by part: -o decoder.parts=0 (planned from VLMRUN_MEMORY_BUDGET_GB, else half"
                         " this machine's memory)")
    if parts > 0:
        base, extra = divmod(N, parts)
        return [base + (1 if i < extra else 0) for i in range(parts)]
    allowed, L, head = memory_allowed(), layer_bytes(model), head_bytes(model)
    if export_peak_bytes(N * L + head) <= allowed:
        return [N]
    per_layer = EXPORT_WEIGHT_COPIES * L
    cap = (allowed - EXPORT_BASE_BYTES) // per_layer
    last = min(N - 1, (allowed - EXPORT_BASE_BYTES - EXPORT_WEIGHT_COPIES * head) // per_layer)
    if cap < 1 or last < 1:
        need = max(export_peak_bytes(L), export_peak_bytes(L + head))
        where = f"{MEMORY_BUDGET_ENV}={allowed / 1e9:g} GB" if memory_budget() is not None else \
            f"half of this machine's memory ({allowed / 1e9:.1f} GB)"
        raise UsageError(f"the reference decoder part by part needs about {need / 1e9:.2f} GB for its part with one"
                         f" layer{' and the lm_head' if last < 1 else ''}, more than {where}; raise the budget")
    rest = N - last
    n = math.ceil(rest / cap)
    base, extra = divmod(rest, n)
    return [base + (1 if i < extra else 0) for i in range(n)] + [last]


def parts_form(model, layers: list[int], context_length: int | None) -> ExportForm:
    """The float ``decoder/parts`` export the reference runs part by part: ``layers`` per part, the context
    ``context_length`` (or `DEFAULT_CONTEXT`, at most the model's), graphs of any rows (traced with `TRACE_ROWS`, fewer
    for a short context: the form wants a context above twice them), the plain RMSNorm as ``decoder/kv`` has."""
    ctx = int(context_length or min(model.max_context, DEFAULT_CONTEXT))
    ar = max(2, min(TRACE_ROWS, (ctx - 1) // 2))
    return ExportForm.of("decoder", "decoder/parts", ar=ar, ctx=ctx, layers=",".join(map(str, layers)),
                         rmsnorm="plain", rows="any")


# -- the graphs ----------------------------------------------------------------------------------------------------
def graph_bytes(folder: Path, graph: dict) -> int:
    return sum((folder / f).stat().st_size for f in graph["files"])


class PartGraphs:
    """The part graphs of a ``decoder/parts`` export of any rows, opened when rows come to them. When every part's
    graph fits in ``keep_bytes`` together (counting twice their bytes, as onnxruntime holds them) the sessions stay
    open; otherwise each is closed once its part has run (`release`). ``opened`` counts the sessions opened."""

    def __init__(self, folder: Path, desc: dict, keep_bytes: int):
        self.folder, self.parts = Path(folder), desc["parts"]
        self.keep = 2 * sum(graph_bytes(self.folder, p["graphs"]["any"]) for p in self.parts) <= keep_bytes
        self._open: dict[int, Session] = {}
        self.opened = 0

    def session(self, index: int) -> Session:
        """Part ``index`` (from 0)."""
        s = self._open.get(index)
        if s is None:
            s = self._open[index] = Session(self.folder / self.parts[index]["graphs"]["any"]["file"])
            self.opened += 1
        return s

    def release(self, index: int) -> None:
        """Close part ``index``'s session unless the sessions are kept."""
        if not self.keep:
            self._open.pop(index, None)


# -- the host loop -------------------------------------------------------------------------------------------------
class PartsDecoder(DecoderHandle):
    """The reference decoder over the float part graphs of ``artifact`` (see the module docstring)."""

    def __init__(self, artifact, model, keep_bytes: int | None = None):
        desc = json.loads((artifact.path / "parts.json").read_text())
        if any("any" not in p["graphs"] for p in desc["parts"]):
            raise ValueError(f"{artifact.path}: the reference runs part graphs of any rows (decoder/parts, rows=any)")
        self.artifacts = (artifact,)
        self.context_length = int(desc["ctx"])
        self.layers = [tuple(p["layers"]) for p in desc["parts"]]
        self.probe_pairs = [p.get("probe_outputs", []) for p in desc["parts"]]  # a probe export's (PartsProbe)
        self.graphs = PartGraphs(artifact.path, desc, memory_allowed() if keep_bytes is None else keep_bytes)
        self.kv_heads, self.head_dim, self.num_layers = model.num_kv_heads, model.head_dim, model.num_layers
        d = self.head_dim
        inv = 1.0 / (model.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
        ang = np.arange(self.context_length, dtype=np.float64)[:, None] * inv[None]
        self.cos, self.sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

    def new_state(self) -> "PartsState":
        return PartsState(self)

    def logits_of(self, embeds: np.ndarray) -> np.ndarray:
        """Teacher forcing: logits [1,T,V] of ``embeds`` [1,T,H] from an empty cache."""
        return self.feed(self.new_state(), embeds, all_logits=True)

    def generate(self, request) -> Iterator[int]:
        """Decode ``request`` from an empty cache."""
        return self.new_state().decode(request)

    def _feeds(self, state: "PartsState", x: np.ndarray, lo: int, hi: int) -> dict:
        """One part's inputs for the rows ``x`` [1,T,.] after ``state``'s positions: an additive mask whose first
        C-T columns are the past slots and last T columns these rows (causal), the rotary rows of their positions,
        the past keys [KV,1,D,C-T] and values [KV,1,C-T,D] of the part's layers."""
        T, C, pos = x.shape[1], self.context_length, state.length
        past = C - T
        mask = np.full((1, T, C), MASK_MIN, np.float32)
        mask[0, :, :pos] = 0.0  # every row sees the filled past slots
        mask[0, :, past:] = np.triu(np.full((T, T), MASK_MIN, np.float32), k=1)  # and the rows up to its own
        at = np.arange(pos, pos + T)
        feeds = {"inputs_embeds" if lo == 0 else f"residual_{lo}": x, "attention_mask": mask,
                 "position_ids_cos": self.cos[at][None, None], "position_ids_sin": self.sin[at][None, None]}
        for layer in range(lo, hi):
            feeds[f"past_key_{layer}_in"] = np.ascontiguousarray(state.k[layer][..., :past])
            feeds[f"past_value_{layer}_in"] = np.ascontiguousarray(state.v[layer][:, :, :past])
        return feeds

    def feed(self, state: "PartsState", embeds: np.ndarray, all_logits: bool = False,
             probes: dict | None = None) -> np.ndarray:
        """Feed ``embeds`` [1,T,H] after ``state``'s positions, part by part; logits of every row, or of the last.
        ``probes`` (a probe export): filled with each probe point's rows by probe name."""
        T, start = embeds.shape[1], state.length
        if start + T > self.context_length:
            raise InputError(f"{start + T} positions do not fit the reference decoder's context of"
                             f" {self.context_length} (in parts); raise the decoder's context_length")
        x = np.ascontiguousarray(embeds, np.float32)
        for index, (lo, hi) in enumerate(self.layers):
            last = index == len(self.layers) - 1
            out = self.graphs.session(index).run(self._feeds(state, x, lo, hi))
            for layer in range(lo, hi):
                state.k[layer][..., start:start + T] = out[f"past_key_{layer}_out"]
                state.v[layer][:, :, start:start + T] = out[f"past_value_{layer}_out"]
            x = out["logits" if last else f"residual_{hi}"]
            for name, graph_output in self.probe_pairs[index] if probes is not None else ():
                probes[name] = out[graph_output]
            self.graphs.release(index)
        state.length = start + T
        return x if all_logits else x[:, -1:]


class PartsState(FeedingState):
    """A conversation's keys and values in the host buffers of a `PartsDecoder` (``decoder_state``); its greedy loop
    is `.engine.FeedingState`'s."""

    def __init__(self, decoder: PartsDecoder):
        self.decoder = decoder
        self.reset()

    def reset(self) -> None:
        d = self.decoder
        self.k = [np.zeros((d.kv_heads, 1, d.head_dim, d.context_length), np.float32) for _ in range(d.num_layers)]
        self.v = [np.zeros((d.kv_heads, 1, d.context_length, d.head_dim), np.float32) for _ in range(d.num_layers)]
        self.length = 0

    def truncate(self, n: int) -> bool:
        self.length = min(self.length, n)  # slots past the length are masked, and zeroed in the graphs
        return True

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (*self.k, *self.v))

    def _feed(self, embeds: np.ndarray) -> np.ndarray:
        return self.decoder.feed(self, embeds)


class PartsProbe:
    """The probe of the reference decoder in parts (``load_probe``, ``vlmrun diff --locate``): ``run(inputs)`` gives
    the logits of ``inputs_embeds`` [1,T,H] and the residual stream after every layer and the final norm, one
    teacher-forced forward from an empty cache through every part's probe graph
    (`.decoder_parts.export_parts_probe`), each opened once. It takes no ``inject:`` inputs: `vlmrun.diff.locate`
    then says that each layer's own error is not known."""

    def __init__(self, artifact, model, keep_bytes: int | None = None):
        self.decoder = PartsDecoder(artifact, model, keep_bytes)
        self.artifacts = (artifact,)
        self.manifest = dict(artifact.manifest)

    def run(self, inputs: dict) -> dict:
        probes: dict[str, np.ndarray] = {}
        d = self.decoder
        logits = d.feed(d.new_state(), np.asarray(inputs["inputs_embeds"], np.float32), all_logits=True, probes=probes)
        return {"logits": logits, **{name: probes[name] for name, _ in self.manifest["probe_outputs"]}}
