"""The device's own figures of an inference job (its ``execution_summary``, profiled on the hosted device) as
vlmrun reports them in ``handle.last_profile``: units in the key names, and several jobs merged into one."""

from __future__ import annotations

_US = ("estimated_inference_time", "first_load_time", "warm_load_time", "compile_time")
_RENAME = {
    "estimated_inference_time": "inference_each_ms",
    "estimated_inference_peak_memory": "inference_peak_memory_bytes",
    "first_load_time": "load_cold_ms",
    "first_load_peak_memory": "load_cold_peak_memory_bytes",
    "warm_load_time": "load_warm_ms",
    "warm_load_peak_memory": "load_warm_peak_memory_bytes",
    "compile_time": "device_compile_ms",
    "compile_peak_memory": "device_compile_peak_memory_bytes",
}


def profile_figures(summary: dict, inferences: int) -> dict:
    """The client's ``execution_summary`` (times in microseconds, memory in bytes, unit-less keys) with units in
    the key names: ``*_ms`` milliseconds, ``*_bytes`` bytes. ``inference_ms`` is the device time of the whole
    stage run (``inference_each_ms`` x ``inferences``); missing metrics are left out."""
    out: dict = {}
    for k, v in summary.items():
        if v is None:
            continue
        if k in _RENAME:
            out[_RENAME[k]] = round(v / 1000.0, 3) if k in _US else int(v)
        elif k.startswith("all_") and k.endswith("_times") and isinstance(v, (list, tuple)):
            out[f"{k[4:-6]}_runs_ms"] = [round(t / 1000.0, 3) for t in v]
        elif k.endswith("_range") and isinstance(v, (list, tuple)):
            out[f"{k[: -len('_range')]}_range_bytes"] = [int(x) for x in v]
    if "inference_each_ms" in out:
        out["inferences"] = int(inferences)
        out["inference_ms"] = round(out["inference_each_ms"] * inferences, 3)
    return out


def merge_figures(figures: list[dict]) -> dict:
    """The figures of several jobs as one: ``inferences`` and ``inference_ms`` add up, ``inference_each_ms`` is
    their ratio, lists are joined, other figures (load times, peak memory) are the largest."""
    if len(figures) == 1:
        return dict(figures[0])
    out: dict = {}
    for f in figures:
        for k, v in f.items():
            if isinstance(v, list):
                out[k] = [*out.get(k, []), *v]
            elif k in ("inferences", "inference_ms"):
                out[k] = round(out.get(k, 0) + v, 3)
            else:
                out[k] = max(out.get(k, v), v)
    if out.get("inferences"):
        out["inference_each_ms"] = round(out["inference_ms"] / out["inferences"], 3)
    return out
