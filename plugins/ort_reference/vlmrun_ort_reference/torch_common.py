"""What every exporter of this plugin shares: the ONNX opset, when weights go to external data, the fixed-KV
mask value, torch (imported on first use: the core never needs it) and the decoder's RMSNorm forms
(`safe_rms_norm`, see `.onnx_export` for why)."""

from __future__ import annotations

OPSET = 17
EXTERNAL_DATA_THRESHOLD = 512 * 1024 * 1024  # bytes of ONNX above which weights go to a .data file
MASK_MIN = -65504.0  # the fixed-KV mask value (fp16-representable, as NPUs want)
RMSNORMS = ("safe", "plain")


def import_torch():
    try:
        import torch
        import torch.nn.functional as F
    except ImportError as exc:
        from vlmrun.errors import BackendError

        raise BackendError(f"ONNX export needs torch ({exc}); pip install 'vlmrun-ort-reference[export]'") from None
    return torch, F


def safe_rms_norm(x, weight, eps: float):
    """Qwen2's RMSNorm ``weight * x / sqrt(mean(x^2) + eps)`` computed without squaring anything larger than 1.

    ``x`` [.., H] gets one more channel holding ``sqrt(H * eps)``; ``s`` is the largest |value| of that row (so
    ``s >= sqrt(H * eps) > 0``: an all-zero padding row gives 0, not NaN) and ``y = x / s``::

        x / sqrt(mean(x^2) + eps) = y / sqrt((sum(y^2) + H * eps / s^2) / H)

    exactly, so fp32 results equal the plain form's to rounding. In fp16 every square is at most 1 and the sum
    at most H + 1, whatever the magnitude of ``x`` (plain: overflow once |x| > 256, and small rows underflow).
    No reciprocal and no clamp, whose outputs quantize badly (the HTP's 16-bit Reciprocal of a small max
    failed, and QDQ folds a Clip into its range): the form also compiles for int8 / a16w8.
    """
    torch, _ = import_torch()
    H = x.shape[-1]
    pad = torch.full_like(x[..., :1], (H * max(float(eps), 1e-12)) ** 0.5)
    xa = torch.cat([x, pad], dim=-1)
    ya = xa / xa.abs().amax(dim=-1, keepdim=True)
    return weight * (ya[..., :H] * torch.rsqrt((ya * ya).sum(dim=-1, keepdim=True) / H))


def rms_norm_of(form):
    """The RMSNorm the decoder ``form`` is exported with: ``norm(module, x)`` (see the module docstring)."""
    default = "plain" if form.kind == "decoder/kv" else "safe"
    kind = str(form.get("rmsnorm") or default)
    if kind not in RMSNORMS:
        from vlmrun.errors import UsageError

        raise UsageError(f"{form.label()}: rmsnorm '{kind}' is not one of {', '.join(RMSNORMS)}")
    if kind == "plain":
        return lambda module, x: module(x)
    return lambda module, x: safe_rms_norm(x, module.weight, module.variance_epsilon)
