"""What the HTML reports (diff, eval, tune) share: matplotlib without a display, and a figure as base64 PNG."""

from __future__ import annotations

from .errors import VlmrunError


def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed); one error line when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg", force=True)
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise VlmrunError(f"--report needs matplotlib ({exc}); pip install matplotlib") from None
    return plt


def png_base64(fig) -> str:
    """``fig`` as a base64 PNG (for an ``<img src="data:image/png;base64,...">``); the figure is closed."""
    import base64
    import io

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    pyplot().close(fig)
    return base64.b64encode(buf.getvalue()).decode("ascii")
