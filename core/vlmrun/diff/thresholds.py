"""Thresholds: defaults per device precision, ``--threshold STAGE.METRIC=VALUE``, thresholds files."""

from __future__ import annotations

import os
from typing import Mapping

from .. import plugins
from ..errors import UsageError
from ..plugins import Precision
from .metrics import CHECK_STAGES, METRICS_OF_STAGE

RUNTIME_ENGINE_SQNR_DB = 30.0
RUNTIME_ENGINE_TOP1 = 1.0

#: the core's own precision: what two correct float32 implementations must reach (greedy tokens equal). Every other
#: precision, and its thresholds, is declared by the plugins whose backends build at it (``register_precisions``).
FP32 = Precision("fp32", sqnr_db=60.0, cosine=0.9999, top1=0.99, top5=0.99, kl=1e-4, generation=1.0,
                 summary="float32: two correct implementations agree to the last greedy token")


def default_table(p: Precision) -> dict[str, dict[str, float]]:
    """The checks of a device at precision ``p``, per checkpoint stage."""
    tensors = {"sqnr_db": p.sqnr_db, "cosine": p.cosine}
    return {
        # host-side preprocessing is the same numpy code on both sides: strict at every precision
        "preprocess": {"sqnr_db": 60.0, "mismatches": 0},
        "vision": dict(tensors),
        "projector": dict(tensors),
        "embed": dict(tensors),
        "splice": dict(tensors),
        "decoder": {**tensors, "top1_agreement": p.top1, "top5_overlap": p.top5, "kl_mean": p.kl},
        # the runtime's own logits: the decoder's thresholds against the reference, and against the engine over
        # the same binaries a floor that does not depend on the precision (same binaries, same inputs)
        "runtime": {**tensors, "top1_agreement": p.top1, "top5_overlap": p.top5, "kl_mean": p.kl,
                    "engine_sqnr_db": RUNTIME_ENGINE_SQNR_DB, "engine_min_step_sqnr_db": RUNTIME_ENGINE_SQNR_DB,
                    "engine_top1_agreement": RUNTIME_ENGINE_TOP1},
        # a free-running token the checked logits did not lead to fails at every precision
        "generation": {"unexplained_divergence": 0, **({} if p.generation is None else
                                                      {"match_fraction": p.generation})},
    }


def declared(registry=None) -> dict[str, Precision]:
    """``fp32`` and every precision the plugins of ``registry`` (default: the installed ones) declare."""
    if registry is None:
        registry = plugins.default()
    return {FP32.name: FP32, **registry.precisions}


def precisions(registry=None) -> tuple[str, ...]:
    """The precisions that have thresholds of their own (not ``like`` another), from the strictest to the most
    lenient (a layout is judged by the most lenient precision among its stages)."""
    table = declared(registry)
    return tuple(sorted((n for n, p in table.items() if p.like is None), key=lambda n: table[n].leniency))


def _own(precision: str, registry=None) -> Precision:
    """The declaration whose thresholds ``precision`` is judged by (an alias's target)."""
    table = declared(registry)
    check_precision(precision, registry)
    p = table[precision]
    return table[p.like] if p.like else p


def __getattr__(name: str):
    """``PRECISIONS`` and ``DEFAULT_THRESHOLDS``: the installed plugins' (computed when first asked for)."""
    if name == "PRECISIONS":
        return precisions()
    if name == "DEFAULT_THRESHOLDS":
        return {n: default_table(_own(n)) for n in declared()}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def parse_threshold(spec: str) -> tuple[str, str, float | None]:
    """``STAGE.METRIC=VALUE`` (``VALUE`` may be ``none`` to switch that check off)."""
    key, sep, value = spec.partition("=")
    stage, dot, metric = key.strip().partition(".")
    if not sep or not dot:
        raise UsageError(f"--threshold wants STAGE.METRIC=VALUE (e.g. projector.sqnr_db=25), got '{spec}'")
    value = value.strip()
    if value.lower() in ("none", "off", ""):
        return check_key(stage, metric, spec), metric, None
    try:
        number = float(value)
    except ValueError:
        raise UsageError(f"threshold '{spec}': '{value}' is not a number (or 'none')") from None
    return check_key(stage, metric, spec), metric, number


def check_precision(precision: str, registry=None) -> None:
    known = declared(registry)
    if precision not in known:
        raise UsageError(f"unknown precision '{precision}'; the installed plugins declare {', '.join(known)}"
                         " (vlmrun plugins lists them)")


def check_key(stage: str, metric: str, where: str) -> str:
    """``stage`` if it is a checkpoint stage with the metric ``metric``; a usage error naming ``where`` if not."""
    if stage not in METRICS_OF_STAGE:
        raise UsageError(f"threshold '{where}': unknown stage '{stage}'; stages are {', '.join(CHECK_STAGES)}")
    if metric not in METRICS_OF_STAGE[stage]:
        raise UsageError(
            f"threshold '{where}': stage '{stage}' has no metric '{metric}';"
            f" it has {', '.join(METRICS_OF_STAGE[stage])}"
        )
    return stage


def read_thresholds_file(path: str | os.PathLike,
                         registry=None) -> tuple[str | None, dict[str, dict[str, float | None]]]:
    """A TOML file: optional ``precision = "fp16"`` and one table per stage, e.g. ``[projector] sqnr_db = 25``.

    ``metric = false`` switches a default check off.
    """
    from ..layouts import read_toml

    table = read_toml(path, "thresholds file")
    precision = table.pop("precision", None)
    known = declared(registry)
    if precision is not None and precision not in known:
        raise UsageError(f"thresholds file {path}: precision must be one of {', '.join(known)}")
    out: dict[str, dict[str, float | None]] = {}
    for stage, metrics in table.items():
        if not isinstance(metrics, dict):
            raise UsageError(f"thresholds file {path}: '{stage}' should be a table like [{stage}] sqnr_db = 30")
        for metric, value in metrics.items():
            check_key(stage, metric, f"{path}: {stage}.{metric}")
            if value is False:
                value = None
            elif isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UsageError(f"thresholds file {path}: {stage}.{metric} must be a number (or false)")
            out.setdefault(stage, {})[metric] = None if value is None else float(value)
    return precision, out


def thresholds_for(
    precision: str = "fp32",
    *overrides: Mapping[str, Mapping[str, float | None]],
    registry=None,
) -> dict[str, dict[str, float]]:
    """The default thresholds of ``precision`` (as its plugin declares them, `vlmrun.plugins.Precision`) with
    ``overrides`` applied in order (``None`` removes a check)."""
    table = default_table(_own(precision, registry))
    for layer in overrides:
        for stage, metrics in (layer or {}).items():
            for metric, value in metrics.items():
                check_key(stage, metric, f"{stage}.{metric}")
                if value is None:
                    table.setdefault(stage, {}).pop(metric, None)
                else:
                    table.setdefault(stage, {})[metric] = float(value)
    return table


def infer_precision(layout_options: Mapping[str, Mapping[str, object]] | None, registry=None) -> str:
    """The most lenient precision of the device layout's stages (their ``precision`` options, an alias read as the
    precision it is ``like``); ``fp32`` when none is declared."""
    table = declared(registry)
    named = {str(o["precision"]) for o in (layout_options or {}).values() if o.get("precision")}
    found = {table[n].like or n for n in named if n in table}
    for p in reversed(precisions(registry)):
        if p in found:
            return p
    return FP32.name

