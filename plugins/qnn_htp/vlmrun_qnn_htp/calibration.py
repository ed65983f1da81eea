"""Calibration data for quantizing qnn_htp's graphs: where it comes from, and how it reaches the quantizer.

* vision / projector: images from a folder (preprocessed like real inputs; the projector's through the reference
  fp32 vision stage) or, when none is given, seeded random data that the manifest labels ``"random"``;
* embed: token ids (templated prompts, a vocabulary sweep and the table's extreme rows);
* the fixed decoder (AR-N / AR-1): feeds recorded from the host loop (`.decoder.FixedKVDecoder`) driven by the
  float graph on the CPU over the reference pipeline's prompt embeddings of the calibration images (the demo image
  when none are given), prefill then greedy decode;
* the parts decoder: the same host loop over the float part graphs (`parts_calibration_feeds`), once with
  the prompt graphs, once with the token graphs and, when compiled, once with the follow-up prompt graphs (fewer
  rows, in the same export), the attention mask clipped at `MASK_CLIP`; every part's graph open at once, or one
  part at a time (`calibration_order`, `.calibration_sequence`) when the whole decoder in float32 would not fit.

`Reader` hands feeds to onnxruntime's calibrators; `spill_feeds` / `load_feeds` keep a graph's
feeds on disk until that graph is quantized.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import threading
from pathlib import Path

import numpy as np

from vlmrun.atomic import check_free_space
from vlmrun.checkpoint_stream import memory_allowed
from vlmrun.cpu import onnxruntime_options
from vlmrun.errors import UsageError
from vlmrun.onnx_files import graph_files
from vlmrun_qualcomm.genie_config import GenieModel
from vlmrun_qualcomm.parts import part_graphs

from .calibration_sequence import load, record_in_sequence
from .feed_files import load_arrays, save_arrays
from .parts_run import Chain

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff"}
RANDOM_SAMPLES = 4
MASK_CLIP = -100.0  # quantized parts: the mask range the calibration sees (larger negatives saturate here)
GEN_STEPS = 8  # parts: greedy tokens decoded after each calibration prompt
PROMPT_GEN_STEPS = 8  # ... for the prompt graph's calibration (each a whole AR-N call for one real row)
MAX_SAMPLES = 64  # parts: calibration feeds kept per graph
ORDERS = ("auto", "whole", "sequence")  # the parts decoder's calibration_order
PARTS_CALIBRATION = "parts-demo-image-v1"  # the parts decoder's calibration key when no images are given


def calibration_files(folder: str | Path | None) -> list[Path]:
    if not folder:
        return []
    d = Path(folder).expanduser()
    if not d.is_dir():
        raise UsageError(f"--calibration-images {folder} is not a directory")
    files = sorted(p for p in d.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not files:
        raise UsageError(f"--calibration-images {folder} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    return files


def calibration_digest(folder: str | Path | None) -> str | None:
    """A digest of the calibration images (part of the artifact key), or None for random calibration."""
    files = calibration_files(folder)
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


CALIBRATION_PROMPTS = ("Describe the image.", "What is in the picture?", "What colour is the sky? Answer briefly.")
EMBED_CALIBRATION = "token-ids-v1"   # the calibration key of embed (no images)
DECODER_CALIBRATION = "demo-image-v1"  # the decoder's calibration key when no images are given
DECODER_GEN_STEPS = 8      # greedy tokens decoded (by the float graph) after each calibration prompt
DECODER_MAX_SAMPLES = 64   # feeds kept per decoder graph (evenly spaced over the recorded calls)


def calibration_samples(stage: str, model, folder, seed: int = 0, source=None,
                        context=None) -> tuple[list[dict], str]:
    """Input feeds for calibrating ``stage`` and a label saying where they came from.

    ``source`` (the exported ONNX artifact being quantized) is needed for ``embed`` and ``decoder``;
    ``context`` (the compile request's `vlmrun.stages.CompileContext`) gives the reference activations
    the projector (with images) and the decoder calibrate on.
    """
    files = calibration_files(folder)
    rng = np.random.default_rng(seed)
    if stage == "vision":
        if files:
            from vlmrun.preprocess import load_image, preprocess_image

            feeds = [{"pixel_values": preprocess_image(load_image(f), model.image_processor_config)} for f in files]
            return feeds, f"images:{len(files)}"
        S = model.image_size
        return ([{"pixel_values": rng.random((1, 3, S, S), dtype=np.float32)} for _ in range(RANDOM_SAMPLES)],
                "random")
    if stage == "projector":
        if files:
            return (require_context(context).reference_inputs(files),
                    f"images:{len(files)} (through the reference fp32 vision stage)")
        shape = (1, model.image_tokens, model.feature_dim)
        return [{"image_features": rng.standard_normal(shape).astype(np.float32)} for _ in range(RANDOM_SAMPLES)], \
            "random"
    if stage == "embed":
        return _embed_samples(model, source.file())
    if stage == "decoder":
        return _decoder_samples(model, source, files, require_context(context))
    raise UsageError(f"int8 is not available for stage '{stage}' on qnn_htp; use --precision fp16")


def require_context(context):
    if context is None:
        raise UsageError("calibrating this stage needs reference activations: compile it through a pipeline"
                         " (vlmrun compile), which gives the compiler its context")
    return context


def packs_in_parallel(path) -> bool:
    """Whether `cpu_session` packs ``path``'s weights in parallel: when the second copy that takes while the
    session opens (`vlmrun.cpu.onnxruntime_options`) is at most a quarter of `memory_allowed`. Calibration in
    sequence opens each part's float graph once per greedy round (a FastVLM-1.5B decoder of 3 parts: 81 opens,
    143 -> 73 s). At a 14 GB budget, a graph of up to 3.5 GB of weights; a larger one packs a weight at a time."""
    return 4 * graph_set_bytes([path]) <= memory_allowed()


def cpu_session(path):
    import onnxruntime as ort

    so = onnxruntime_options(parallel_prepack=packs_in_parallel(path))
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _embed_table(path) -> np.ndarray:
    import onnx
    from onnx import numpy_helper

    proto = onnx.load(str(path))
    big = max(proto.graph.initializer, key=lambda t: int(np.prod(t.dims)))
    return numpy_helper.to_array(big)


def _embed_samples(model, path) -> tuple[list[dict], str]:
    """Token ids in chunks of the graph's static length: the chat-templated calibration prompts, an even
    sweep over the vocabulary, and the rows holding the table's extremes (so MinMax covers every row)."""
    from vlmrun.preprocess import render_prompt, tokenize_prompt

    seq = int(cpu_session(path).get_inputs()[0].shape[1])
    table = _embed_table(path)
    V = table.shape[0]
    ids: list[int] = []
    for p in CALIBRATION_PROMPTS:
        text = render_prompt(model.chat_template, p)
        t, _ = tokenize_prompt(model.tokenizer, text, model.image_token_id, model.image_tokens)
        ids += [int(i) for i in t[0]]
    n_prompt = len(ids)
    sweep = np.linspace(0, V - 1, num=min(V, 4 * seq), dtype=np.int64)
    extremes = np.unique(np.concatenate([np.unravel_index([table.argmin(), table.argmax()], table.shape)[0],
                                         np.abs(table).max(axis=1).argsort()[-seq // 2:]]))
    ids += [int(i) for i in sweep] + [int(i) for i in extremes]
    ids += [0] * (-len(ids) % seq)
    arr = np.asarray(ids, np.int64).reshape(-1, seq)
    feeds = [{"input_ids": row[None]} for row in arr]
    return feeds, (f"token-ids:{len(ids)} ({n_prompt} from {len(CALIBRATION_PROMPTS)} templated prompts,"
                   f" {len(sweep)} vocabulary sweep, {len(extremes)} extreme rows)")


class _Recorder:
    """Wraps a float ONNX session as a FixedKVDecoder graph and keeps a copy of every feed."""

    def __init__(self, sess):
        self.sess = sess
        self.outputs = [o.name for o in sess.get_outputs()]
        self.feeds: list[dict] = []

    def run(self, feeds: dict) -> dict:
        self.feeds.append({k: np.array(v, copy=True) for k, v in feeds.items()})
        return dict(zip(self.outputs, self.sess.run(self.outputs, feeds)))


def greedy_host_loop(dec, embeds: np.ndarray, rows: int, steps: int, embed_tokens) -> None:
    """Drive a host-loop decoder (`.decoder.FixedKVDecoder` or a subclass) over one prompt, as calibration records
    it: ``embeds`` prefilled (in chunks of ``rows``), then up to ``steps`` greedy steps of ``rows`` rows while they
    fit its context; ``embed_tokens(ids)``: the reference embeddings of the tokens picked."""
    greedy_steps(dec, greedy_prefill(dec, embeds), rows, steps, embed_tokens)


def greedy_prefill(dec, embeds: np.ndarray) -> np.ndarray:
    """`greedy_host_loop`'s first half: ``embeds`` prefilled from an empty state; the last row's logits."""
    dec.reset()
    return dec.prefill(embeds)


def step_fits(n_past: int, rows: int, ctx: int) -> bool:
    """Whether a greedy step through an AR-``rows`` graph of context ``ctx`` fits after ``n_past`` positions (the
    stop rule of `greedy_steps`, which `host_loop_calls` counts by)."""
    return n_past + rows <= ctx


def greedy_steps(dec, logits: np.ndarray, rows: int, steps: int, embed_tokens) -> None:
    """`greedy_host_loop`'s second half: the greedy steps from ``dec``'s state and the ``logits`` that led there."""
    for _ in range(steps):
        if not step_fits(dec.n_past, rows, dec.ctx):
            break
        tok = int(np.argmax(logits[0, -1]))
        logits = dec._step(embed_tokens(np.array([tok])), rows)


def _decoder_samples(model, source, files, context) -> tuple[list[dict], str]:
    """Realistic feeds for one fixed-KV graph: the host loop (`.decoder.FixedKVDecoder`) driven over the
    reference prompt embeddings with the float graph on the onnxruntime CPU, prefill then greedy decode;
    every call's feeds (mask, positions, past KV from the real prefill) are recorded."""
    from .decoder import FixedKVDecoder

    sess = cpu_session(source.file())
    shapes = {i.name: i.shape for i in sess.get_inputs()}
    ar, ctx = int(shapes["attention_mask"][2]), int(shapes["attention_mask"][3])
    rec = _Recorder(sess)
    dec = FixedKVDecoder({ar: rec, 1: rec}, ctx, model, min_chunk=1)  # min_chunk 1: only this AR is picked
    # the calibration images with one prompt each, or the demo image with every prompt
    prompts = [CALIBRATION_PROMPTS[i % len(CALIBRATION_PROMPTS)] for i in range(len(files))] or CALIBRATION_PROMPTS
    embeds = [f["inputs_embeds"] for f in context.reference_inputs(files or None, prompts)]
    embed_tokens, what = context.embed_tokens, (f"images:{len(files)}" if files else "demo image")
    for e in embeds:
        greedy_host_loop(dec, e[:, : max(1, ctx - ar - DECODER_GEN_STEPS)].astype(np.float32), ar,
                         DECODER_GEN_STEPS, embed_tokens)
    feeds = rec.feeds
    if len(feeds) > DECODER_MAX_SAMPLES:
        keep = np.unique(np.linspace(0, len(feeds) - 1, DECODER_MAX_SAMPLES).round().astype(int))
        feeds = [feeds[i] for i in keep]
    label = (f"{what} x {len(embeds)} prompt(s), reference (ort_reference) prompt embeddings through the"
             f" float AR-{ar} graph on the CPU (prefill + {DECODER_GEN_STEPS} greedy steps): {len(feeds)} of"
             f" {len(rec.feeds)} host-loop feeds")
    return feeds, label


class Reader:
    """onnxruntime's CalibrationDataReader over a list of feeds; ``set_range`` lets the calibrator take them in
    strides (``CalibStridedMinMax``: ranges merged stride by stride, so only one stride's activations are held)."""

    def __init__(self, feeds):
        self.feeds = list(feeds)
        self._it = iter(self.feeds)

    def __len__(self):
        return len(self.feeds)

    def get_next(self):
        return next(self._it, None)

    def set_range(self, start_index: int, end_index: int):
        self._it = iter(self.feeds[start_index:end_index])

    def rewind(self):  # some ORT versions call it
        self._it = iter(self.feeds)



class CpuGraph:
    def __init__(self, path: Path):
        self.sess = cpu_session(path)
        self.input_names = [i.name for i in self.sess.get_inputs()]
        self.outputs = [o.name for o in self.sess.get_outputs()]

    def run(self, feeds: dict) -> dict:
        return dict(zip(self.outputs, self.sess.run(self.outputs, feeds)))


class PromptLoop:
    """One calibration prompt through the parts decoder's host loop (`greedy_host_loop` over
    `.genie_engine.GenieLayoutDecoder`, its graphs of ``rows`` rows): whole (``loop(graph)``, every part chained
    in ``graph``), or in the halves `.calibration_sequence.record_in_sequence` runs: ``prefill(graph)`` once per
    part, each time followed by ``keep`` (that part's layers' keys and values, and the logits from the part making
    them), then ``steps(graph)`` from the state kept."""

    def __init__(self, embeds: np.ndarray, rows: int, steps: int, ctx: int, facts, embed_tokens):
        self.embeds, self.rows, self.n_steps, self.ctx, self.facts = embeds, rows, steps, ctx, facts
        self.embed_tokens = embed_tokens
        self.k: list = [None] * facts.layers
        self.v: list = [None] * facts.layers
        self.n_past = self.logits = self._made = None
        self._zeros: dict[int, dict] = {}

    def _decoder(self, graph):
        from .genie_engine import GenieLayoutDecoder

        return GenieLayoutDecoder({self.rows: graph, 1: graph}, self.ctx, self.facts, min_chunk=1)  # only this AR

    def __call__(self, graph) -> None:
        greedy_host_loop(self._decoder(graph), self.embeds, self.rows, self.n_steps, self.embed_tokens)

    def prefill(self, graph) -> None:
        dec = self._decoder(graph)
        logits = greedy_prefill(dec, self.embeds)
        self._made = dec.k, dec.v, dec.n_past, logits

    def zeros(self, feeds: dict) -> dict:
        """What the loop reads of a call with ``feeds``, as zeros: every layer's new keys and values, the logits."""
        T, f = feeds["inputs_embeds"].shape[1], self.facts
        if T not in self._zeros:
            z = {"logits": np.zeros((1, T, f.vocab), np.float32)}
            for i in range(f.layers):
                z[f"past_key_{i}_out"] = np.zeros((f.kv_heads, 1, f.head_dim, T), np.float32)
                z[f"past_value_{i}_out"] = np.zeros((f.kv_heads, 1, T, f.head_dim), np.float32)
            self._zeros[T] = z
        return self._zeros[T]

    def keep(self, names) -> None:
        """After a prefill through one part, whose outputs ``names`` the loop read: keep what that part made."""
        k, v, n_past, logits = self._made
        self._made = None
        if self.n_past not in (None, n_past):
            raise RuntimeError(f"calibration in sequence: a prefill ended at {n_past} rows, another at {self.n_past}")
        self.n_past = n_past
        for i in range(self.facts.layers):
            if f"past_key_{i}_out" in names or f"past_value_{i}_out" in names:
                self.k[i], self.v[i] = k[i], v[i]
        if "logits" in names:
            self.logits = logits

    def steps(self, graph) -> None:
        missing = [i for i, k in enumerate(self.k) if k is None]
        if missing or self.logits is None:
            raise RuntimeError(f"calibration in sequence: no part made the keys of layers {missing}"
                               if missing else "calibration in sequence: no part made the logits")
        dec = self._decoder(graph)
        dec.k, dec.v, dec.n_past = list(self.k), list(self.v), self.n_past
        greedy_steps(dec, self.logits, self.rows, self.n_steps, self.embed_tokens)


def parts_graph_sets(src_dir: Path, desc: dict, kinds=None) -> list[tuple]:
    """``(kind, rows, [float ONNX file per part])`` of each graph set to calibrate: the prompt graphs, the token
    graphs and, when the export has them, the follow-up prompt graphs as "followup"
    (`vlmrun_qualcomm.parts.part_graphs`); only those of ``kinds`` when given."""
    graphs = [part_graphs(p) for p in desc["parts"]]
    return [(kind, g0["ar"], [Path(src_dir) / g[kind]["file"] for g in graphs]) for kind, g0 in graphs[0].items()
            if kinds is None or kind in kinds]


def host_loop_calls(length: int, rows: int, steps: int, ctx: int) -> int:
    """The calls `greedy_host_loop` makes over a prompt of ``length`` rows through an AR-``rows`` graph of context
    ``ctx``: the prefill in chunks of ``rows``, then a call per greedy step while ``rows`` more fit."""
    n_past, calls = length, -(-length // rows)
    for _ in range(steps):
        if not step_fits(n_past, rows, ctx):
            break
        n_past, calls = n_past + 1, calls + 1
    return calls


def call_bytes(path: Path) -> int:
    """Bytes of one call's feeds of a float part graph (its inputs' static shapes; the graph's weights not read)."""
    import onnx

    graph = onnx.load(str(path), load_external_data=False).graph
    inits = {i.name for i in graph.initializer}
    total = 0
    for i in graph.input:
        if i.name in inits:
            continue
        t = i.type.tensor_type
        n = int(np.prod([d.dim_value or 1 for d in t.shape.dim], dtype=np.int64))
        total += n * np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)).itemsize
    return total


def parts_calibration_feeds(model, src_dir: Path, desc: dict, files, context,
                            order: str = "auto", into: Path | None = None, kinds=None) -> tuple[dict, str]:
    """{(part index, "prompt"|"token"|"followup"): [feeds]} recorded from the float part graphs on the CPU, and a
    label. Each graph set runs the host loop alone: the prompts in chunks of its rows, then greedy steps through
    it (so the follow-up graphs see calls on a filled past, as a conversation's next turn gives them). ``order``
    (`calibration_order`): every part's float graph open at once (``whole``), or one at a time (``sequence``,
    `.calibration_sequence`: the prompts' prefills part by part, then their greedy steps in rounds, each prompt's
    loop a `PromptLoop`): the same feeds either way. With ``into`` (a folder), each part's
    feeds of a graph set are written there as they are made (`spill_feeds`, ``feeds_part{k}_{kind}.npz``) and the
    dict holds those paths: in sequence, memory then holds one part's kept feeds at a time, and the disk the kept
    calls of one graph set (checked before it starts) plus the files written. ``kinds``: only those graph sets
    (`parts_graph_sets`)."""
    facts = GenieModel.from_model(model)
    ar, ctx = desc["ar"], desc["ctx"]
    prompts = [CALIBRATION_PROMPTS[i % len(CALIBRATION_PROMPTS)] for i in range(len(files))] or list(
        CALIBRATION_PROMPTS)
    embeds = [f["inputs_embeds"][:, : max(1, ctx - ar - GEN_STEPS)].astype(np.float32)
              for f in context.reference_inputs(files or None, prompts)]
    sets = parts_graph_sets(src_dir, desc, kinds)
    if not sets:
        raise RuntimeError(f"calibration: this parts export has no graphs of the kinds {list(kinds or [])}")
    order = calibration_order(order, sets)
    embed_lock = threading.Lock()  # in sequence the prompts' greedy steps run in threads: one token lookup at a time

    def embed_tokens(ids: np.ndarray) -> np.ndarray:
        with embed_lock:
            return context.embed_tokens(ids)

    sizes: dict = {}

    def keep_feeds(p: dict, kind: str, feeds: list[dict]):
        sizes[(p["index"], kind)] = len(feeds)
        return feeds if into is None else spill_feeds(feeds, Path(into) / f"feeds_part{p['index']}_{kind}.npz")

    if into is not None:
        Path(into).mkdir(parents=True, exist_ok=True)
    out: dict = {}
    opened, spilled = 0, 0
    for kind, rows, paths in sets:
        steps = GEN_STEPS if kind == "token" else PROMPT_GEN_STEPS
        counts = [host_loop_calls(e.shape[1], rows, steps, ctx) for e in embeds]
        calls = sum(counts)
        keep = set(np.unique(np.linspace(0, calls - 1, min(calls, MAX_SAMPLES)).round().astype(int)).tolist())
        loops = [PromptLoop(e, rows, steps, ctx, facts, embed_tokens) for e in embeds]
        if order == "sequence":
            with tempfile.TemporaryDirectory(prefix="vlmrun-calibration-", dir=into) as spill:
                need = len(keep) * sum(call_bytes(path) for path in paths)
                check_free_space(spill, need * (2 if into is not None else 1),
                                 f"calibrating the {kind} graphs in sequence ({len(keep)} kept calls x {len(paths)}"
                                 f" parts) in {spill}")
                folders, names, n = record_in_sequence(paths, CpuGraph, loops, counts, keep, MASK_CLIP, Path(spill))
                spilled = max(spilled, need)
                for k, p in enumerate(desc["parts"]):  # one part's kept feeds in memory at a time
                    out[(p["index"], kind)] = keep_feeds(p, kind, [load(f, names[k]) for f in folders[k]])
                    shutil.rmtree(Path(spill) / f"part{k}", ignore_errors=True)
            opened += n
        else:
            runners = [CpuGraph(path) for path in paths]
            chain = Chain(runners, keep, MASK_CLIP)
            for loop in loops:
                loop(chain)
            if chain.calls != calls:
                raise RuntimeError(f"calibration: the prompts made {chain.calls} calls, {calls} expected")
            del runners
            for p, rec in zip(desc["parts"], chain.recorded):
                out[(p["index"], kind)] = keep_feeds(p, kind, rec)
            del chain
    what = f"images:{len(files)}" if files else "demo image"
    names = {"prompt": "prompt", "token": "token", "followup": "follow-up"}
    recorded = " / ".join(f"{sizes[(1, kind)]} {names.get(kind, kind)}" for kind, _, _ in sets)
    graphs = (" and ".join(f"{names.get(kind, kind)} graphs" for kind, _, _ in sets[:2]) + " separately"
              if len(sets) > 1 else f"the {names.get(sets[0][0], sets[0][0])} graphs only")
    label = (f"{what} x {len(embeds)} prompt(s): reference (ort_reference) prompt embeddings through the float part"
             f" graphs on the CPU (prefill + {GEN_STEPS} greedy steps, {graphs}); {recorded} feeds per"
             f" part; mask clipped at {MASK_CLIP:g}")
    if order == "sequence":
        label += (f"; in sequence (one part's float graph at a time, {opened} graphs opened, at most"
                  f" {spilled / 1e9:.2f} GB of kept feeds on disk)")
    return out, label


def graph_set_bytes(paths) -> int:
    """Bytes of float graphs on disk: each ONNX file and the external data it names (`vlmrun.onnx_files`)."""
    return sum(f.stat().st_size for path in map(Path, paths) for f in graph_files(path))


def calibration_order(order: str, sets) -> str:
    """``whole`` or ``sequence`` for the option ``calibration_order`` (``sets``: `parts_graph_sets`). ``auto``:
    whole while the largest graph set's float graphs, open at once in onnxruntime (about twice their bytes), fit
    in the memory budget (``VLMRUN_MEMORY_BUDGET_GB``), else in half of this machine's memory; in sequence
    otherwise (FastVLM-1.5B and 7B here: 6 GB and 30 GB of float32 weights)."""
    if order != "auto":
        return order
    need = 2 * max((graph_set_bytes(paths) for _, _, paths in sets), default=0)
    return "whole" if need <= memory_allowed() else "sequence"


def spill_feeds(feeds: list[dict], path: Path) -> Path:
    """Write calibration feeds to ``path`` (.npz) so they are not held while other graphs are quantized; each
    array without its zeros around it (`.feed_files`: a past's unfilled positions), read back to the bit."""
    return save_arrays(path, {f"{i}/{name}": v for i, f in enumerate(feeds) for name, v in f.items()})


def load_feeds(path: Path) -> list[dict]:
    """The feeds `spill_feeds` wrote to ``path``."""
    out: dict[int, dict] = {}
    for key, value in load_arrays(path).items():
        i, name = key.split("/", 1)
        out.setdefault(int(i), {})[name] = value
    return [out[i] for i in sorted(out)]
