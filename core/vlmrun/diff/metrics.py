"""The checkpoints, the metrics of each, and how they are computed and printed.

Per tensor: max abs, mean abs, relative L2, cosine, SQNR. Per decoder step (rows of the logits): top-1
agreement, top-5 overlap, KL(ref || dev). Generation: matching tokens and the first divergent step.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

SQNR_CAP_DB = 200.0
CHECKPOINTS: tuple[tuple[str, str], ...] = (
    ("preprocess", "pixel_values"),
    ("preprocess", "input_ids"),
    ("vision", "image_features"),
    ("projector", "image_embeds"),
    ("embed", "text_embeds"),
    ("splice", "inputs_embeds"),
    ("decoder", "logits"),
    ("runtime", "runtime_logits"),
    ("generation", "tokens"),
)
CHECK_STAGES = tuple(dict.fromkeys(s for s, _ in CHECKPOINTS))

# metric -> "min" (higher is better: the threshold is a floor) or "max" (lower is better: a ceiling)
TENSOR_METRICS = {"max_abs": "max", "mean_abs": "max", "rel_l2": "max", "cosine": "min", "sqnr_db": "min"}
LOGITS_METRICS = {"top1_agreement": "min", "top5_overlap": "min", "kl_mean": "max", "kl_max": "max"}
IDS_METRICS = {"mismatches": "max"}
# the runtime that generates, when it is not the engine behind the decoder stage (a bundle's runtime): its own logits,
# teacher-forced through it, against the reference (as the decoder's) and against the engine's over the same binaries
RUNTIME_METRICS = {"engine_sqnr_db": "min", "engine_min_step_sqnr_db": "min", "engine_top1_agreement": "min",
                   "engine_reference_sqnr_db": "min"}
# unexplained_divergence: 1 when the free-running generation leaves the reference at a step where the logits the
# diff checked (the generating runtime's own, teacher-forced) did not lead there: the tokens were not made by them
GENERATION_METRICS = {"matching_tokens": "min", "match_fraction": "min", "unexplained_divergence": "max"}
METRICS_OF_STAGE: dict[str, dict[str, str]] = {
    "preprocess": {**TENSOR_METRICS, **IDS_METRICS},
    "vision": TENSOR_METRICS,
    "projector": TENSOR_METRICS,
    "embed": TENSOR_METRICS,
    "splice": TENSOR_METRICS,
    "decoder": {**TENSOR_METRICS, **LOGITS_METRICS},
    "runtime": {**TENSOR_METRICS, **LOGITS_METRICS, **RUNTIME_METRICS},
    "generation": GENERATION_METRICS,
}


def tensor_metrics(ref, dev) -> dict[str, float]:
    """max abs, mean abs, relative L2, cosine and SQNR (dB, capped at +-200) of ``dev`` against ``ref``; NaN for
    empty tensors."""
    r = np.asarray(ref, dtype=np.float64).ravel()
    err = np.asarray(dev).ravel() - r  # float64, one pass
    if err.size == 0:  # nothing to compare has shown nothing: NaN fails every threshold, never a perfect score
        return dict.fromkeys(("max_abs", "mean_abs", "rel_l2", "cosine", "sqnr_db"), float("nan"))
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
    prefix = common_prefix(ref_tokens, dev_tokens)
    same = ref_tokens == dev_tokens
    longest = max(len(ref_tokens), len(dev_tokens))
    return {
        "matching_tokens": prefix,
        "match_fraction": 1.0 if longest == 0 else prefix / longest,
        "first_divergent_step": None if same else prefix,
        "ref_len": len(ref_tokens),
        "dev_len": len(dev_tokens),
    }


#: a free-running token is explained by a logits row when its probability is at least this fraction of the top
#: token's: a near-tie that rounding flips is explained; a token the row gives far less weight is not
EXPLAINED_PROB_RATIO = 0.5


def divergence_explained(row: np.ndarray, token: int) -> tuple[bool, dict]:
    """Whether a greedy runtime whose logits at this step are ``row`` could have chosen ``token``: its probability
    is at least `EXPLAINED_PROB_RATIO` of the top token's. Returns (explained, details)."""
    row = np.asarray(row, np.float64).reshape(-1)
    lp = _log_softmax(row)
    top = int(row.argmax())
    ok = 0 <= token < row.size
    ratio = float(np.exp(lp[token] - lp[top])) if ok else 0.0
    return ratio >= EXPLAINED_PROB_RATIO, {"row_argmax": top, "prob_ratio": ratio}


def per_step_sqnr(ref: np.ndarray, dev: np.ndarray) -> list[float]:
    """SQNR (dB, capped) of each row of [1, K, V] ``dev`` against ``ref`` (`tensor_metrics` per row)."""
    r = np.asarray(ref).reshape(-1, ref.shape[-1])
    d = np.asarray(dev).reshape(-1, dev.shape[-1])
    return [tensor_metrics(a, b)["sqnr_db"] for a, b in zip(r, d)]


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def fmt(v) -> str:
    """A metric value for tables and messages."""
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


def fmt_shape(shape) -> str:
    return "x".join(str(int(s)) for s in shape) or "scalar"

