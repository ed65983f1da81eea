"""``vlmrun diff``: capture every stage boundary on two sides and say which stage broke.

A *side* is a layout run by the :class:`~vlmrun.pipeline.Pipeline` (``reference``, ``all-npu``, a layout file,
per-stage overrides), the torch eager model (``torch``), or a capture saved earlier (``--from``). Both sides
get the same image and prompt; the reference side is captured first and the device side's decoder is then fed
the reference tokens (teacher forcing), so the per-step logits stay comparable after the first divergent token.

>>> from vlmrun import diff
>>> run = diff.run("torch", "reference", image="photo.jpg", prompt="Describe the image.")
>>> run.result.passed, run.result.culprit
>>> print(diff.format_table(run.result)); diff.write_report(run, "out/")

Checkpoints, in pipeline order (the first whose thresholds fail is named the likely culprit)::

    preprocess  pixel_values, input_ids      (host side; differs only between machines or versions)
    vision      image_features
    projector   image_embeds
    embed       text_embeds
    splice      inputs_embeds                (image embeds spliced into the text embeds)
    decoder     logits, teacher-forced       (+ per step: top-1 agreement, top-5 overlap, KL(ref || dev))
    generation  tokens, free-running         (matching tokens, first divergent step)
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path
from typing import Mapping, Sequence

import attrs
import numpy as np

from .errors import UsageError, VlmrunError
from .stages import STAGES

TORCH = "torch"
DEFAULT_PROMPT = "Describe the image."
SQNR_CAP_DB = 200.0
PRECISIONS = ("fp32", "fp16", "int8")
CAPTURE_KEYS = (
    "pixel_values", "input_ids", "image_features", "image_embeds", "text_embeds", "inputs_embeds", "logits", "tokens",
)
CHECKPOINTS: tuple[tuple[str, str], ...] = (
    ("preprocess", "pixel_values"),
    ("preprocess", "input_ids"),
    ("vision", "image_features"),
    ("projector", "image_embeds"),
    ("embed", "text_embeds"),
    ("splice", "inputs_embeds"),
    ("decoder", "logits"),
    ("generation", "tokens"),
)
CHECK_STAGES = tuple(dict.fromkeys(s for s, _ in CHECKPOINTS))

# metric -> "min" (higher is better: the threshold is a floor) or "max" (lower is better: a ceiling)
TENSOR_METRICS = {"max_abs": "max", "mean_abs": "max", "rel_l2": "max", "cosine": "min", "sqnr_db": "min"}
LOGITS_METRICS = {"top1_agreement": "min", "top5_overlap": "min", "kl_mean": "max", "kl_max": "max"}
IDS_METRICS = {"mismatches": "max"}
GENERATION_METRICS = {"matching_tokens": "min", "match_fraction": "min"}
METRICS_OF_STAGE: dict[str, dict[str, str]] = {
    "preprocess": {**TENSOR_METRICS, **IDS_METRICS},
    "vision": TENSOR_METRICS,
    "projector": TENSOR_METRICS,
    "embed": TENSOR_METRICS,
    "splice": TENSOR_METRICS,
    "decoder": {**TENSOR_METRICS, **LOGITS_METRICS},
    "generation": GENERATION_METRICS,
}


def _defaults(sqnr: float, cosine: float, top1: float, top5: float, kl: float, gen: float | None) -> dict:
    tensors = {"sqnr_db": sqnr, "cosine": cosine}
    table = {
        # host-side preprocessing is the same numpy code on both sides: strict at every precision
        "preprocess": {"sqnr_db": 60.0, "mismatches": 0},
        "vision": dict(tensors),
        "projector": dict(tensors),
        "embed": dict(tensors),
        "splice": dict(tensors),
        "decoder": {**tensors, "top1_agreement": top1, "top5_overlap": top5, "kl_mean": kl},
        "generation": {} if gen is None else {"match_fraction": gen},
    }
    return table


# Defaults per device precision. fp32: what two correct fp32 implementations must reach (greedy tokens equal).
# fp16 / int8: typical whole-network accuracy of NPU builds; free-running tokens may legitimately diverge there,
# so generation is reported but not checked.
DEFAULT_THRESHOLDS: dict[str, dict[str, dict[str, float]]] = {
    "fp32": _defaults(sqnr=60.0, cosine=0.9999, top1=0.99, top5=0.99, kl=1e-4, gen=1.0),
    "fp16": _defaults(sqnr=30.0, cosine=0.999, top1=0.9, top5=0.8, kl=0.05, gen=None),
    "int8": _defaults(sqnr=15.0, cosine=0.97, top1=0.6, top5=0.6, kl=0.5, gen=None),
}


# -- captures -----------------------------------------------------------------------------------------


@attrs.define
class Capture:
    """Every stage-boundary tensor of one request on one side, plus what produced it (``meta``)."""

    tensors: dict[str, np.ndarray]
    meta: dict = attrs.field(factory=dict)

    @property
    def tokens(self) -> list[int]:
        return [int(t) for t in np.asarray(self.tensors["tokens"]).reshape(-1)]

    @property
    def forced_tokens(self) -> list[int]:
        """The tokens the decoder was teacher-forced on to produce ``logits``."""
        forced = self.meta.get("teacher_tokens")
        return [int(t) for t in forced] if forced is not None else self.tokens

    @property
    def label(self) -> str:
        return str(self.meta.get("source") or self.meta.get("side") or "?")

    def save(self, directory: str | os.PathLike) -> Path:
        """Write ``capture.npz`` (tensors + meta, self-contained) and a readable ``meta.json`` into ``directory``."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        meta_json = json.dumps(_jsonable(self.meta))
        tmp = d / f".capture.{os.getpid()}.npz"
        with open(tmp, "wb") as fh:
            np.savez(fh, **{k: np.asarray(v) for k, v in self.tensors.items()}, __meta__=np.array(meta_json))
        os.replace(tmp, d / "capture.npz")
        (d / "meta.json").write_text(json.dumps(json.loads(meta_json), indent=2) + "\n")
        return d

    @classmethod
    def load(cls, path: str | os.PathLike) -> "Capture":
        """Read a capture from a directory written by :meth:`save` or from its ``capture.npz``."""
        p = Path(path)
        file = p / "capture.npz" if p.is_dir() else p
        if not file.is_file():
            raise UsageError(f"{p} is not a vlmrun capture (no capture.npz); give a directory written by --save")
        try:
            with np.load(file, allow_pickle=False) as data:
                tensors = {k: data[k] for k in data.files if k != "__meta__"}
                meta = json.loads(str(data["__meta__"])) if "__meta__" in data.files else {}
        except (OSError, ValueError) as exc:
            raise UsageError(f"cannot read capture {file}: {exc}") from None
        missing = [k for k in CAPTURE_KEYS if k not in tensors]
        if missing:
            raise UsageError(f"capture {file} lacks {', '.join(missing)}; it was not written by vlmrun diff --save")
        meta.setdefault("loaded_from", str(file))
        return cls(tensors, meta)


def load_from(paths: Sequence[str | os.PathLike]) -> tuple[Capture | None, Capture | None]:
    """Resolve ``--from`` arguments to (reference, device) captures; ``None`` means "run that side live".

    No path: both live. One path: a directory written by ``--save`` (with ``reference/`` and ``device/``) gives
    both sides; otherwise it is the reference side and the device runs live, teacher-forced on its tokens.
    Two paths: reference then device.
    """
    paths = [Path(p) for p in paths]
    if not paths:
        return None, None
    if len(paths) > 2:
        raise UsageError(f"--from takes at most two captures (reference, then device); got {len(paths)}")
    if len(paths) == 1:
        p = paths[0]
        if (p / "reference").is_dir() and (p / "device").is_dir():
            return Capture.load(p / "reference"), Capture.load(p / "device")
        return Capture.load(p), None
    for p in paths:
        if (p / "reference").is_dir() and not (p / "capture.npz").exists():
            raise UsageError(f"{p} holds two captures; name one of them: {p / 'reference'} or {p / 'device'}")
    return Capture.load(paths[0]), Capture.load(paths[1])


def _base_meta(model, image_desc: str, prompt: str, settings, teacher_tokens, tokens=()) -> dict:
    from . import __version__

    try:
        text = model.tokenizer.decode([int(t) for t in tokens], skip_special_tokens=True)
    except Exception:  # the text is a convenience for the report; never fail a capture over it
        text = None
    return {
        "text": text,
        "model": str(getattr(model, "source", "")),
        "image": image_desc,
        "prompt": prompt,
        "max_new_tokens": settings.max_new_tokens,
        "ignore_eos": settings.ignore_eos,
        "teacher_tokens": None if teacher_tokens is None else [int(t) for t in teacher_tokens],
        "vlmrun_version": __version__,
        "host": platform.node(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def capture_pipeline(pipe, image, prompt: str, settings, teacher_tokens=None, image_desc: str = "") -> Capture:
    """Capture one request on a :class:`~vlmrun.pipeline.Pipeline` (a layout)."""
    tensors = pipe.capture(image, prompt, settings, teacher_tokens=teacher_tokens)
    meta = _base_meta(pipe.model, image_desc, prompt, settings, teacher_tokens, tensors["tokens"])
    meta.update(source=f"layout {pipe.layout.name}", layout={s: pipe.layout.backend(s) for s in STAGES})
    return Capture({k: np.asarray(tensors[k]) for k in CAPTURE_KEYS}, meta)


def _prepare(model, image, prompt: str, system: str | None = None):
    """pixel_values, input_ids, image_start exactly as :meth:`Pipeline.prepare` makes them."""
    from .preprocess import load_image, preprocess_image, render_prompt, tokenize_prompt

    if isinstance(image, (str, os.PathLike)):
        image = load_image(image)
    pixel_values = preprocess_image(image, model.image_processor_config)
    text = render_prompt(model.chat_template, prompt, system)
    ids, start = tokenize_prompt(model.tokenizer, text, model.image_token_id, model.image_tokens)
    return pixel_values, ids, start


def capture_torch(model, image, prompt: str, settings, teacher_tokens=None, image_desc: str = "") -> Capture:
    """Capture the same boundary tensors from the torch eager model (transformers, float32).

    vision = ``vision_tower(pv).last_hidden_state`` flattened to [1, N, F], projector = ``multi_modal_projector``,
    embed = ``get_input_embeddings``, logits = a full forward on the spliced ``inputs_embeds`` plus the embedded
    teacher tokens; free-running tokens from greedy ``generate``.
    """
    import torch

    from .preprocess import splice

    tm = model.load_torch()
    inner = tm.model
    pixel_values, ids, start = _prepare(model, image, prompt, settings.system)
    budget = min(settings.max_new_tokens, model.max_context - ids.shape[1])
    if budget < 1:
        raise VlmrunError(f"the prompt is {ids.shape[1]} tokens and fills the context of {model.max_context}")
    stops = frozenset() if settings.ignore_eos else model.stop_ids
    with torch.no_grad():
        pv = torch.from_numpy(pixel_values)
        feats = inner.vision_tower(pv).last_hidden_state.flatten(2).permute(0, 2, 1)
        img = inner.multi_modal_projector(feats)
        embed = inner.get_input_embeddings()
        txt = embed(torch.from_numpy(ids))
        embeds = splice(txt.numpy(), img.numpy(), start)
        ids_t = torch.from_numpy(ids)
        gen_kwargs = dict(max_new_tokens=budget, do_sample=False, pad_token_id=0)
        if stops:
            gen_kwargs["eos_token_id"] = sorted(stops)
        else:
            gen_kwargs.update(eos_token_id=None, min_new_tokens=budget)
        out = tm.generate(input_ids=ids_t, attention_mask=torch.ones_like(ids_t), pixel_values=pv, **gen_kwargs)
        tokens: list[int] = []
        for t in out[0, ids.shape[1]:].tolist():
            tokens.append(int(t))
            if int(t) in stops:
                break
        forced = list(teacher_tokens if teacher_tokens is not None else tokens)
        full = torch.from_numpy(embeds)
        if forced:
            full = torch.cat([full, embed(torch.tensor([forced], dtype=torch.long))], dim=1)
        logits = tm(inputs_embeds=full, attention_mask=torch.ones(full.shape[:2], dtype=torch.long)).logits
    tensors = {
        "pixel_values": pixel_values,
        "input_ids": ids,
        "image_features": feats.numpy().astype(np.float32),
        "image_embeds": img.numpy().astype(np.float32),
        "text_embeds": txt.numpy().astype(np.float32),
        "inputs_embeds": embeds.astype(np.float32),
        "logits": logits[:, embeds.shape[1] - 1:, :].numpy().astype(np.float32),
        "tokens": np.asarray(tokens, dtype=np.int64),
    }
    meta = _base_meta(model, image_desc, prompt, settings, teacher_tokens, tokens)
    import transformers

    meta.update(source="torch eager (fp32)", layout=dict.fromkeys(STAGES, "torch"),
                torch_version=torch.__version__, transformers_version=transformers.__version__)
    return Capture(tensors, meta)


# -- metrics ------------------------------------------------------------------------------------------


def tensor_metrics(ref, dev) -> dict[str, float]:
    """max abs, mean abs, relative L2, cosine and SQNR (dB, capped at +-200) of ``dev`` against ``ref``."""
    r = np.asarray(ref, dtype=np.float64).ravel()
    err = np.asarray(dev).ravel() - r  # float64, one pass
    if err.size == 0:
        return {"max_abs": 0.0, "mean_abs": 0.0, "rel_l2": 0.0, "cosine": 1.0, "sqnr_db": SQNR_CAP_DB}
    noise, signal = float(err @ err), float(r @ r)
    cross = float(r @ err)
    nr = float(np.sqrt(signal))
    nd = float(np.sqrt(max(signal + 2.0 * cross + noise, 0.0)))  # |r + err|
    if not np.isfinite(noise):
        sqnr = float("nan")
    elif noise == 0.0:
        sqnr = SQNR_CAP_DB
    elif signal == 0.0:
        sqnr = -SQNR_CAP_DB
    else:
        sqnr = float(np.clip(10.0 * np.log10(signal / noise), -SQNR_CAP_DB, SQNR_CAP_DB))
    if noise == 0.0:
        cos = 1.0
    elif nr == 0.0 or nd == 0.0 or not np.isfinite(noise):
        cos = float("nan") if not np.isfinite(noise) else 0.0
    else:
        cos = float(np.clip((signal + cross) / (nr * nd), -1.0, 1.0))
    abs_err = np.abs(err, out=err)
    return {
        "max_abs": float(abs_err.max()),
        "mean_abs": float(abs_err.mean()),
        "rel_l2": float(np.sqrt(noise) / nr) if nr > 0 else (0.0 if noise == 0 else float("inf")),
        "cosine": cos,
        "sqnr_db": sqnr,
    }


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def logits_steps(ref: np.ndarray, dev: np.ndarray) -> dict[str, list]:
    """Per step (row) of [1, K, V] logits: top-1 agreement, top-5 overlap, KL(softmax(ref) || softmax(dev))."""
    r = np.asarray(ref).reshape(-1, ref.shape[-1])
    d = np.asarray(dev).reshape(-1, dev.shape[-1])
    k = min(5, r.shape[-1])
    top1 = (r.argmax(-1) == d.argmax(-1)).astype(float)
    tr = np.argpartition(-r, k - 1, axis=-1)[:, :k]
    td = np.argpartition(-d, k - 1, axis=-1)[:, :k]
    top5 = np.array([len(set(a.tolist()) & set(b.tolist())) / k for a, b in zip(tr, td)])
    lr, ld = _log_softmax(r), _log_softmax(d)
    kl = np.maximum((np.exp(lr) * (lr - ld)).sum(-1), 0.0)
    return {"top1": top1.tolist(), "top5_overlap": top5.tolist(), "kl": kl.tolist(),
            "ref_argmax": r.argmax(-1).tolist(), "dev_argmax": d.argmax(-1).tolist()}


def generation_metrics(ref_tokens: Sequence[int], dev_tokens: Sequence[int]) -> dict:
    ref_tokens, dev_tokens = list(ref_tokens), list(dev_tokens)
    prefix = 0
    for a, b in zip(ref_tokens, dev_tokens):
        if a != b:
            break
        prefix += 1
    same = ref_tokens == dev_tokens
    longest = max(len(ref_tokens), len(dev_tokens))
    return {
        "matching_tokens": prefix,
        "match_fraction": 1.0 if longest == 0 else prefix / longest,
        "first_divergent_step": None if same else prefix,
        "ref_len": len(ref_tokens),
        "dev_len": len(dev_tokens),
    }


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


# -- thresholds ---------------------------------------------------------------------------------------


def parse_threshold(spec: str) -> tuple[str, str, float | None]:
    """``STAGE.METRIC=VALUE`` (``VALUE`` may be ``none`` to switch that check off)."""
    key, sep, value = spec.partition("=")
    stage, dot, metric = key.strip().partition(".")
    if not sep or not dot:
        raise UsageError(f"--threshold wants STAGE.METRIC=VALUE (e.g. projector.sqnr_db=25), got '{spec}'")
    value = value.strip()
    if value.lower() in ("none", "off", ""):
        return _check_key(stage, metric, spec), metric, None
    try:
        number = float(value)
    except ValueError:
        raise UsageError(f"threshold '{spec}': '{value}' is not a number (or 'none')") from None
    return _check_key(stage, metric, spec), metric, number


def _check_key(stage: str, metric: str, where: str) -> str:
    if stage not in METRICS_OF_STAGE:
        raise UsageError(f"threshold '{where}': unknown stage '{stage}'; stages are {', '.join(CHECK_STAGES)}")
    if metric not in METRICS_OF_STAGE[stage]:
        raise UsageError(
            f"threshold '{where}': stage '{stage}' has no metric '{metric}';"
            f" it has {', '.join(METRICS_OF_STAGE[stage])}"
        )
    return stage


def read_thresholds_file(path: str | os.PathLike) -> tuple[str | None, dict[str, dict[str, float | None]]]:
    """A TOML file: optional ``precision = "fp16"`` and one table per stage, e.g. ``[projector] sqnr_db = 25``.

    ``metric = false`` switches a default check off.
    """
    from .layouts import read_toml

    table = read_toml(path, "thresholds file")
    precision = table.pop("precision", None)
    if precision is not None and precision not in PRECISIONS:
        raise UsageError(f"thresholds file {path}: precision must be one of {', '.join(PRECISIONS)}")
    out: dict[str, dict[str, float | None]] = {}
    for stage, metrics in table.items():
        if not isinstance(metrics, dict):
            raise UsageError(f"thresholds file {path}: '{stage}' should be a table like [{stage}] sqnr_db = 30")
        for metric, value in metrics.items():
            _check_key(stage, metric, f"{path}: {stage}.{metric}")
            if value is False:
                value = None
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UsageError(f"thresholds file {path}: {stage}.{metric} must be a number (or false)")
            out.setdefault(stage, {})[metric] = None if value is None else float(value)
    return precision, out


def thresholds_for(
    precision: str = "fp32",
    *overrides: Mapping[str, Mapping[str, float | None]],
) -> dict[str, dict[str, float]]:
    """The default thresholds of ``precision`` with ``overrides`` applied in order (``None`` removes a check)."""
    if precision not in DEFAULT_THRESHOLDS:
        raise UsageError(f"unknown precision '{precision}'; choose one of {', '.join(PRECISIONS)}")
    table = {stage: dict(metrics) for stage, metrics in DEFAULT_THRESHOLDS[precision].items()}
    for layer in overrides:
        for stage, metrics in (layer or {}).items():
            for metric, value in metrics.items():
                _check_key(stage, metric, f"{stage}.{metric}")
                if value is None:
                    table.setdefault(stage, {}).pop(metric, None)
                else:
                    table.setdefault(stage, {})[metric] = float(value)
    return table


# -- comparison ---------------------------------------------------------------------------------------


@attrs.define
class Check:
    metric: str
    op: str  # ">=" or "<="
    threshold: float
    value: float | None
    ok: bool

    def describe(self) -> str:
        return f"{self.metric} {_fmt(self.value)} {'<' if self.op == '>=' else '>'} {_fmt(self.threshold)}"


@attrs.define
class Entry:
    """One checkpoint: a stage-boundary tensor's metrics and the threshold checks on them."""

    stage: str
    tensor: str
    shape_ref: tuple
    shape_dev: tuple
    metrics: dict
    checks: list[Check] = attrs.field(factory=list)
    note: str = ""

    @property
    def passed(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def failures(self) -> list[Check]:
        return [c for c in self.checks if not c.ok]


@attrs.define
class DiffResult:
    entries: list[Entry]
    steps: dict[str, list]
    thresholds: dict[str, dict[str, float]]
    precision: str
    reference: dict
    device: dict
    notes: list[str] = attrs.field(factory=list)

    @property
    def passed(self) -> bool:
        return all(e.passed for e in self.entries)

    @property
    def failed_stages(self) -> list[str]:
        return list(dict.fromkeys(e.stage for e in self.entries if not e.passed))

    @property
    def culprit(self) -> str | None:
        """The first stage, in pipeline order, that crosses one of its thresholds."""
        failed = self.failed_stages
        return failed[0] if failed else None

    def entry(self, stage: str, tensor: str | None = None) -> Entry:
        for e in self.entries:
            if e.stage == stage and (tensor is None or e.tensor == tensor):
                return e
        raise KeyError(f"{stage}.{tensor}")

    def worst(self) -> Entry | None:
        """The float tensor checkpoint with the lowest SQNR."""
        cands = [e for e in self.entries if "sqnr_db" in e.metrics and e.metrics["sqnr_db"] is not None]
        if not cands:
            return None
        return min(cands, key=lambda e: (np.nan_to_num(e.metrics["sqnr_db"], nan=-1e9), -CHECKPOINTS.index(
            (e.stage, e.tensor))))

    def to_json(self) -> dict:
        culprit = self.culprit
        return _jsonable({
            "passed": self.passed,
            "culprit": culprit,
            "culprit_failures": [c.describe() for e in self.entries if e.stage == culprit for c in e.failures],
            "failed_stages": self.failed_stages,
            "precision": self.precision,
            "reference": self.reference,
            "device": self.device,
            "checkpoints": [
                {"stage": e.stage, "tensor": e.tensor, "shape_ref": list(e.shape_ref), "shape_dev": list(e.shape_dev),
                 "passed": e.passed, "metrics": e.metrics, "note": e.note,
                 "checks": [attrs.asdict(c) for c in e.checks]}
                for e in self.entries
            ],
            "steps": self.steps,
            "thresholds": self.thresholds,
            "notes": self.notes,
        })


def _apply(entry: Entry, thresholds: Mapping[str, Mapping[str, float]]) -> Entry:
    directions = METRICS_OF_STAGE[entry.stage]
    for metric, limit in thresholds.get(entry.stage, {}).items():
        if metric not in entry.metrics:
            continue
        value = entry.metrics[metric]
        op = ">=" if directions[metric] == "min" else "<="
        ok = value is not None and (value >= limit if op == ">=" else value <= limit)  # NaN fails
        entry.checks.append(Check(metric, op, float(limit), value, bool(ok)))
    if entry.note.startswith("shape"):
        entry.checks.append(Check("shape", "==", 0.0, None, False))
    return entry


def compare(ref: Capture, dev: Capture, thresholds: Mapping[str, Mapping[str, float]] | None = None,
            precision: str = "fp32") -> DiffResult:
    """Metrics of every checkpoint of ``dev`` against ``ref`` and the threshold checks on them."""
    thresholds = {s: dict(m) for s, m in (thresholds or thresholds_for(precision)).items()}
    entries: list[Entry] = []
    notes: list[str] = []
    steps: dict[str, list] = {"top1": [], "top5_overlap": [], "kl": []}
    for stage, name in CHECKPOINTS:
        r, d = np.asarray(ref.tensors[name]), np.asarray(dev.tensors[name])
        if name == "tokens":
            m = generation_metrics(ref.tokens, dev.tokens)
            entries.append(_apply(Entry(stage, name, r.shape, d.shape, m), thresholds))
            continue
        if name == "logits":
            rows, note = _comparable_rows(ref, dev)
            r, d = r[:, :rows], d[:, :rows]
            if note:
                notes.append(note)
        if r.shape != d.shape:
            m = {"mismatches": int(max(r.size, d.size))} if name == "input_ids" else {}
            entry = Entry(stage, name, r.shape, d.shape, m, note=f"shape {_shape(r.shape)} vs {_shape(d.shape)}")
            entries.append(_apply(entry, thresholds))
            continue
        if name == "input_ids":
            m = {"mismatches": int((r != d).sum())}
        else:
            m = tensor_metrics(r, d)
        if name == "logits":
            steps = logits_steps(r, d)
            m.update(
                steps=len(steps["top1"]),
                top1_agreement=float(np.mean(steps["top1"])) if steps["top1"] else 1.0,
                top5_overlap=float(np.mean(steps["top5_overlap"])) if steps["top5_overlap"] else 1.0,
                kl_mean=float(np.mean(steps["kl"])) if steps["kl"] else 0.0,
                kl_max=float(np.max(steps["kl"])) if steps["kl"] else 0.0,
            )
        entries.append(_apply(Entry(stage, name, r.shape, d.shape, m), thresholds))
    return DiffResult(entries, steps, thresholds, precision, dict(ref.meta), dict(dev.meta), notes)


def _comparable_rows(ref: Capture, dev: Capture) -> tuple[int, str]:
    """Logits rows predicting the same context on both sides: k where forced tokens agree before k."""
    fr, fd = ref.forced_tokens, dev.forced_tokens
    n = max(len(fr), 1)
    rows = min(ref.tensors["logits"].shape[1], dev.tensors["logits"].shape[1], n)
    prefix = _common_prefix(fr, fd)
    if prefix < min(len(fr), len(fd)) or len(fr) != len(fd):
        keep = min(rows, prefix + 1)
        return keep, (
            f"the device decoder was not teacher-forced on the reference tokens (they differ from step {prefix});"
            f" only the first {keep} logits steps are compared"
        )
    return rows, ""


# -- running both sides -------------------------------------------------------------------------------


@attrs.frozen
class Side:
    """What to run on one side: ``torch`` or a layout (preset name or TOML file) with per-stage overrides."""

    layout: str = "reference"
    overrides: Mapping[str, str | None] = attrs.field(factory=dict)

    @property
    def is_torch(self) -> bool:
        return self.layout == TORCH

    def describe(self) -> str:
        extra = " ".join(f"{s}={b}" for s, b in self.overrides.items() if b)
        return self.layout + (f" ({extra})" if extra else "")


@attrs.define
class DiffRun:
    reference: Capture
    device: Capture
    result: DiffResult
    timings: dict = attrs.field(factory=dict)


def _side(value):
    from .pipeline import Pipeline

    return value if isinstance(value, (Side, Pipeline)) else Side(str(value))


def _describe(side) -> str:
    return side.describe() if isinstance(side, Side) else f"layout {side.layout.name}"


def _build_pipeline(side, model, store, registry, progress):
    from .pipeline import Pipeline

    if isinstance(side, Pipeline):
        return side
    if side.is_torch:
        if any(side.overrides.values()):
            raise UsageError("per-stage overrides do not apply to the torch reference")
        return None
    layout, layout_file = side.layout, None
    if layout.endswith(".toml") or os.sep in layout:
        layout, layout_file = None, Path(layout)
        if not layout_file.is_file():
            raise UsageError(f"layout file {layout_file} does not exist")
    return Pipeline.build(model, layout, overrides=dict(side.overrides), layout_file=layout_file, store=store,
                          registry=registry, progress=progress)


def infer_precision(layout_options: Mapping[str, Mapping[str, object]] | None) -> str:
    """The most lenient precision of the device layout's stages: their ``precision`` options, else each
    backend's own (:attr:`vlmrun.plugins.BackendInfo.precision`); ``fp32`` when none is known."""
    aliases = {"a16w8": "int8", "a8w8": "int8", "w8a16": "int8"}
    found = {aliases.get(str(o["precision"]), str(o["precision"]))
             for o in (layout_options or {}).values() if o.get("precision")}
    for p in reversed(PRECISIONS):
        if p in found:
            return p
    return "fp32"


def run(
    reference: "str | Side | Pipeline" = "reference",
    device: "str | Side | Pipeline" = "reference",
    *,
    image=None,
    prompt: str | None = None,
    model=None,
    store=None,
    registry=None,
    max_new_tokens: int | None = None,
    ignore_eos: bool = False,
    precision: str | None = None,
    thresholds: Mapping[str, Mapping[str, float | None]] | None = None,
    thresholds_file: str | os.PathLike | None = None,
    from_dirs: Sequence[str | os.PathLike] = (),
    image_size: int = 1024,
    progress=None,
) -> DiffRun:
    """Capture both sides (or load them, ``from_dirs``) and compare them; see the module docstring.

    A side is ``"torch"``, a layout name or TOML file, a :class:`Side` (layout + per-stage overrides), or an
    already built :class:`~vlmrun.pipeline.Pipeline` (reused as is).

    ``image`` defaults to the built-in demo image, ``prompt`` to "Describe the image." (or what a loaded
    reference capture used). Thresholds: defaults of ``precision`` < ``thresholds_file`` < ``thresholds``.
    """
    from .model import open_model
    from .pipeline import GenerationSettings
    from .progress import no_progress
    from .store import ArtifactStore

    progress = progress or no_progress
    file_precision, file_thresholds = read_thresholds_file(thresholds_file) if thresholds_file else (None, {})
    for stage, metrics in (thresholds or {}).items():
        for metric in metrics:
            _check_key(stage, metric, f"{stage}.{metric}")
    if precision is not None and precision not in PRECISIONS:
        raise UsageError(f"unknown precision '{precision}'; choose one of {', '.join(PRECISIONS)}")
    ref_cap, dev_cap = load_from(from_dirs)
    ref_side, dev_side = _side(reference), _side(device)
    timings: dict[str, float] = {}

    if ref_cap is None or dev_cap is None:
        if ref_cap is not None:
            prompt = prompt if prompt is not None else ref_cap.meta.get("prompt")
            if image is None and ref_cap.meta.get("image") not in (None, "", "<demo image>"):
                image = ref_cap.meta["image"]
            if max_new_tokens is None:
                max_new_tokens = ref_cap.meta.get("max_new_tokens")
            ignore_eos = ignore_eos or bool(ref_cap.meta.get("ignore_eos"))
        prompt = prompt if prompt is not None else DEFAULT_PROMPT
        max_new_tokens = int(max_new_tokens or 32)
        if max_new_tokens < 1:
            raise UsageError("--max-new-tokens must be at least 1")
        if image is None:
            from .demo_image import demo_image

            image, image_desc = demo_image(), "<demo image>"
        else:
            image_desc = str(image)
            if isinstance(image, (str, os.PathLike)) and not Path(image).is_file():
                raise UsageError(f"image {image} does not exist")
        if not isinstance(store, ArtifactStore):
            store = ArtifactStore(store)
        fvlm = open_model(model, store, image_size, progress)
        if registry is None:
            from . import plugins as plugins_mod

            registry = plugins_mod.load()
        settings = GenerationSettings(max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
        # build the device side first: layout errors (unknown plugin, ...) surface before any long capture
        dev_pipe = _build_pipeline(dev_side, fvlm, store, registry, progress)
        if ref_cap is None:
            ref_pipe = _build_pipeline(ref_side, fvlm, store, registry, progress)
            t = time.perf_counter()
            with progress(f"capturing the reference side ({_describe(ref_side)})"):
                if ref_pipe is None:
                    ref_cap = capture_torch(fvlm, image, prompt, settings, image_desc=image_desc)
                else:
                    ref_cap = capture_pipeline(ref_pipe, image, prompt, settings, image_desc=image_desc)
            timings["reference_s"] = time.perf_counter() - t
            ref_cap.meta["side"] = "reference"
        t = time.perf_counter()
        with progress(f"capturing the device side ({_describe(dev_side)}), teacher-forced"):
            if dev_pipe is None:
                dev_cap = capture_torch(fvlm, image, prompt, settings, ref_cap.tokens, image_desc)
            else:
                dev_cap = capture_pipeline(dev_pipe, image, prompt, settings, ref_cap.tokens, image_desc)
        timings["device_s"] = time.perf_counter() - t
        dev_cap.meta["side"] = "device"
        if dev_pipe is not None:
            dev_cap.meta["layout_options"] = {
                s: {"precision": dev_pipe.registry.backend(dev_pipe.layout.backend(s)).precision,
                    **dev_pipe.layout.stages[s].options}
                for s in STAGES
            }

    if precision is None:
        precision = file_precision or infer_precision(dev_cap.meta.get("layout_options"))
    table = thresholds_for(precision, file_thresholds, thresholds or {})
    t = time.perf_counter()
    result = compare(ref_cap, dev_cap, table, precision)
    timings["compare_s"] = time.perf_counter() - t
    return DiffRun(ref_cap, dev_cap, result, timings)


# -- output -------------------------------------------------------------------------------------------


def _fmt(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int):
        return str(v)
    v = float(v)
    if not np.isfinite(v):
        return str(v)
    if v == 0:
        return "0"
    if abs(v) >= 1e4 or abs(v) < 1e-3:
        return f"{v:.2e}"
    return f"{v:.4g}"


def _shape(shape) -> str:
    return "x".join(str(int(s)) for s in shape) or "scalar"


def format_table(result: DiffResult) -> str:
    """The terminal table: one row per checkpoint, then per-step and generation summaries and the verdict."""
    ref, dev = result.reference, result.device
    lines = [
        f"reference: {ref.get('source', '?')}    device: {dev.get('source', '?')}    precision: {result.precision}",
        "",
    ]
    cols = ("stage", "tensor", "shape", "max_abs", "mean_abs", "rel_l2", "cosine", "sqnr_dB", "status")
    rows = []
    for e in result.entries:
        if e.stage == "generation":
            continue
        m = e.metrics
        if e.note:
            status = "FAIL " + e.note
        elif not e.checks:
            status = "(no check)"
        else:
            status = "ok" if e.passed else "FAIL " + ", ".join(c.describe() for c in e.failures)
        if e.tensor == "input_ids":
            vals = [f"{m.get('mismatches', '-')} differ", "", "", "", ""]
        else:
            cos = m.get("cosine")
            vals = [_fmt(m.get("max_abs")), _fmt(m.get("mean_abs")), _fmt(m.get("rel_l2")),
                    "-" if cos is None else f"{cos:.8f}", "-" if m.get("sqnr_db") is None else f"{m['sqnr_db']:.1f}"]
        rows.append((e.stage, e.tensor, _shape(e.shape_dev), *vals, status))
    widths = [max(len(str(r[i])) for r in [cols, *rows]) for i in range(len(cols) - 1)]
    for r in [cols, *rows]:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(r, widths)) + "  " + str(r[-1]))
    dec = result.entry("decoder")
    m = dec.metrics
    if "steps" in m:
        agree = int(round(sum(result.steps["top1"])))
        lines.append(
            f"decoder, teacher-forced, {m['steps']} steps: top-1 agreement {agree}/{m['steps']}"
            f" ({m['top1_agreement']:.3f}), top-5 overlap {m['top5_overlap']:.3f},"
            f" KL mean {_fmt(m['kl_mean'])} max {_fmt(m['kl_max'])}"
        )
    g = result.entry("generation")
    gm = g.metrics
    first = gm["first_divergent_step"]
    lines.append(
        f"generation, free-running: {gm['matching_tokens']}/{gm['ref_len']} reference tokens matched"
        f" (device made {gm['dev_len']}); first divergent step: {'none' if first is None else first}"
        + ("" if g.passed else "  FAIL " + ", ".join(c.describe() for c in g.failures))
    )
    for note in result.notes:
        lines.append(f"note: {note}")
    culprit = result.culprit
    if culprit is None:
        lines.append("PASS: every checkpoint is within its thresholds")
    else:
        why = "; ".join(f"{e.tensor}: " + (e.note or ", ".join(c.describe() for c in e.failures))
                        for e in result.entries if e.stage == culprit and not e.passed)
        lines.append(f"FAIL: likely culprit: {culprit} (first stage to cross its thresholds: {why})")
        if len(result.failed_stages) > 1:
            lines.append(f"      also failing downstream: {', '.join(result.failed_stages[1:])}")
    return "\n".join(lines)


def _jsonable(obj):
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.ndarray):
        return _jsonable(obj.tolist())
    if isinstance(obj, (np.integer,)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        v = float(obj)
        return v if np.isfinite(v) else str(v)
    if isinstance(obj, Path):
        return str(obj)
    return obj


def save_run(run_: DiffRun, directory: str | os.PathLike) -> Path:
    """``--save DIR``: DIR/reference and DIR/device (captures) and DIR/metrics.json; ``--from DIR`` replays it."""
    d = Path(directory)
    run_.reference.save(d / "reference")
    run_.device.save(d / "device")
    (d / "metrics.json").write_text(json.dumps(run_.result.to_json(), indent=2) + "\n")
    return d


def _png(fig) -> str:
    import base64
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def _plots(run_: DiffRun) -> dict[str, str]:
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise VlmrunError(f"--report needs matplotlib ({exc}); pip install matplotlib") from None
    result = run_.result
    figs: dict[str, str] = {}

    tensors = [e for e in result.entries if e.metrics.get("sqnr_db") is not None]
    fig, ax = plt.subplots(figsize=(8, 3.2))
    labels = [f"{e.stage}\n{e.tensor}" for e in tensors]
    values = [float(np.nan_to_num(e.metrics["sqnr_db"], nan=-SQNR_CAP_DB)) for e in tensors]
    colors = ["#2e7d32" if e.passed else "#c62828" for e in tensors]
    ax.bar(range(len(tensors)), values, color=colors)
    for i, e in enumerate(tensors):
        limit = result.thresholds.get(e.stage, {}).get("sqnr_db")
        if limit is not None:
            ax.hlines(limit, i - 0.4, i + 0.4, colors="black", linestyles="dashed")
    ax.set_xticks(range(len(tensors)), labels, fontsize=8)
    ax.set_ylabel("SQNR (dB)")
    ax.set_title(f"SQNR per stage boundary (capped at {SQNR_CAP_DB:.0f} dB; dashes: thresholds; red: failed)")
    figs["sqnr"] = _png(fig)

    steps = result.steps
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 4.5), sharex=True)
    x = np.arange(len(steps["top1"]))
    a1.plot(x, steps["top1"], "o-", label="top-1 agreement")
    a1.plot(x, steps["top5_overlap"], "s--", label="top-5 overlap", alpha=0.7)
    a1.set_ylim(-0.05, 1.05)
    a1.set_ylabel("agreement")
    a1.legend(loc="lower left", fontsize=8)
    a1.set_title("decoder per step (teacher-forced on the reference tokens)")
    a2.plot(x, steps["kl"], "o-", color="#6a1b9a")
    a2.set_yscale("symlog", linthresh=1e-9)
    a2.set_ylabel("KL(ref || dev)")
    a2.set_xlabel("generation step")
    figs["steps"] = _png(fig)

    worst = result.worst()
    shown = [worst] if worst is not None else []
    culprit = result.culprit
    if culprit is not None:  # also the first failing stage, when that is not the worst one
        first = next((e for e in result.entries if e.stage == culprit and "sqnr_db" in e.metrics), None)
        if first is not None and first is not worst:
            shown.append(first)
    fig, axes = plt.subplots(1, max(len(shown), 1), figsize=(8 if len(shown) < 2 else 11, 3.2), squeeze=False)
    for ax, entry in zip(axes[0], shown):
        if entry.shape_ref != entry.shape_dev:
            ax.set_title(f"{entry.stage}/{entry.tensor}: shapes differ", fontsize=9)
            continue
        err = (np.asarray(run_.device.tensors[entry.tensor], dtype=np.float64)
               - np.asarray(run_.reference.tensors[entry.tensor], dtype=np.float64))
        if entry.tensor == "logits":
            err = err[:, : entry.metrics.get("steps", err.shape[1])]
        err = err.ravel()
        err = err[np.isfinite(err)]
        ax.hist(err, bins=100, color="#1565c0" if entry is worst else "#c62828")
        ax.set_yscale("log")
        kind = "worst checkpoint" if entry is worst else "first failing stage"
        ax.set_title(f"{kind}: {entry.stage}/{entry.tensor} (SQNR {entry.metrics['sqnr_db']:.1f} dB)"
                     + ("; all errors zero" if not np.any(err) else ""), fontsize=9)
        ax.set_xlabel("error (device - reference)")
        ax.set_ylabel("count")
    figs["hist"] = _png(fig)
    return figs


def write_report(run_: DiffRun, directory: str | os.PathLike) -> Path:
    """``--report DIR``: DIR/index.html (self-contained, plots as base64 PNG) and DIR/metrics.json."""
    import html

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    result = run_.result
    data = result.to_json()
    figs = _plots(run_)
    esc = html.escape
    ref, dev = result.reference, result.device
    verdict = ("<p class='pass'>PASS: every checkpoint is within its thresholds</p>" if result.passed else
               f"<p class='fail'>FAIL: likely culprit <b>{esc(str(result.culprit))}</b>"
               f" (first stage to cross its thresholds; failing: {esc(', '.join(result.failed_stages))})</p>")
    rows = []
    for e in result.entries:
        m = e.metrics
        cells = [e.stage, e.tensor, _shape(e.shape_ref) + ("" if e.shape_ref == e.shape_dev else
                                                          " vs " + _shape(e.shape_dev))]
        metric_text = ", ".join(f"{k} {_fmt(v)}" for k, v in m.items())
        checks = "; ".join(("ok " if c.ok else "FAIL ") + f"{c.metric} {c.op} {_fmt(c.threshold)}"
                           for c in e.checks) or "(no check)"
        rows.append(
            f"<tr class='{'ok' if e.passed else 'bad'}'>" + "".join(f"<td>{esc(c)}</td>" for c in cells)
            + f"<td>{esc(metric_text + (' ' + e.note if e.note else ''))}</td><td>{esc(checks)}</td></tr>"
        )
    def tokens_text(cap: Capture) -> str:
        text = cap.meta.get("text")
        return " ".join(str(t) for t in cap.tokens) + (f"  ({text!r})" if text is not None else "")

    notes = "".join(f"<li>{esc(n)}</li>" for n in result.notes)
    page = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>vlmrun diff: {esc(ref.get('source', '?'))} vs
{esc(dev.get('source', '?'))}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 70em; }}
table {{ border-collapse: collapse; font-size: 0.9em; }} td, th {{ border: 1px solid #ccc; padding: 3px 6px; }}
tr.bad {{ background: #ffebee; }} tr.ok {{ background: #f1f8e9; }}
.pass {{ color: #2e7d32; font-weight: bold; }} .fail {{ color: #c62828; font-weight: bold; }}
code, pre {{ font-size: 0.85em; }} pre {{ background: #f5f5f5; padding: 1em; overflow: auto; }}
</style></head><body>
<h1>vlmrun diff</h1>
<p>reference: <b>{esc(str(ref.get('source', '?')))}</b> &nbsp; device: <b>{esc(str(dev.get('source', '?')))}</b>
&nbsp; precision thresholds: <b>{esc(result.precision)}</b><br>
model: <code>{esc(str(ref.get('model', '')))}</code> &nbsp; image: <code>{esc(str(ref.get('image', '')))}</code>
&nbsp; prompt: <code>{esc(str(ref.get('prompt', '')))}</code></p>
{verdict}
<ul>{notes}</ul>
<h2>Stage boundaries</h2>
<table><tr><th>stage</th><th>tensor</th><th>shape</th><th>metrics</th><th>checks</th></tr>
{''.join(rows)}</table>
<h2>SQNR per stage</h2><img alt="SQNR per stage" src="data:image/png;base64,{figs['sqnr']}">
<h2>Decoder per step</h2><img alt="per-step top-1 agreement and KL" src="data:image/png;base64,{figs['steps']}">
<h2>Errors of the worst stage</h2><img alt="error histogram" src="data:image/png;base64,{figs['hist']}">
<h2>Tokens</h2>
<p>reference: <code>{esc(tokens_text(run_.reference))}</code><br>
device (free-running): <code>{esc(tokens_text(run_.device))}</code></p>
<h2>Raw metrics</h2><p><a href="metrics.json">metrics.json</a></p>
<details><summary>show</summary><pre>{esc(json.dumps(data, indent=2))}</pre></details>
</body></html>
"""
    (d / "metrics.json").write_text(json.dumps(data, indent=2) + "\n")
    (d / "index.html").write_text(page)
    return d / "index.html"
