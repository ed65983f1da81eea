"""genie_cpu's decoder options: declared (`declarations`, what ``register_options`` registers) and read once into a
`DecoderPlan` (`DecoderPlan.of`), which the compile (`.compose`) and the handle (`.runner`) read.

Every option's default lives in its declaration only: the core fills the declared defaults in before a hook sees
the options (`vlmrun.options.StageOptions`), and `fill` does the same, from these declarations, for a plain mapping.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Mapping

import attrs

from vlmrun.errors import UsageError
from vlmrun.options import Option, OptionTable, StageOptions
from vlmrun_qualcomm.runtime import DeviceRuntime, target_option
from vlmrun_qualcomm.sdk import phone_options

from .compose import QUANTIZE, quantize_option

NAME = "genie_cpu"
RUNNERS = ("auto", "libgenie", "t2t")
DEFAULT_CONTEXT = 1024
REMOTE_DIR = "/data/local/tmp/vlmrun/genie"


@functools.cache
def declarations() -> tuple[Option, ...]:
    """genie_cpu's options (the decoder's), with their defaults and help."""
    return (
        Option(NAME, "quantize", str, choices=tuple(QUANTIZE), default="none", flag="--quantize",
               help="model-bin weight quantization by the SDK composer (none, z8, q4)"),
        Option(NAME, "context_length", int, default=DEFAULT_CONTEXT, minimum=8, flag="--context-length",
               help="Genie dialog context (prompt plus generated tokens)"),
        Option(NAME, "runner", str, choices=RUNNERS, default="auto",
               help="libgenie (in a worker process), t2t (the SDK's genie-t2t-run) or auto"),
        Option(NAME, "remote_dir", str, default=REMOTE_DIR, help="working directory on the phone"),
        Option(NAME, "timeout", float, default=600.0, minimum=1, help="seconds for one generation"),
        Option(NAME, "compose_timeout", float, default=3600.0, minimum=1, help="seconds for the composer"),
        Option(NAME, "composer_python", Path,
               help="the Python that runs the SDK's composer (default: the composer's own #! line, i.e. python3 on"
                    " PATH); it needs the SDK's Python dependencies"),
        Option(NAME, "ndk_root", Path,
               help="the Android NDK whose libc++_shared.so goes to the phone (default: $ANDROID_NDK_ROOT)"),
        *phone_options(NAME),
    )


@functools.cache
def _table() -> OptionTable:
    return OptionTable.of(declarations())


def fill(options: Mapping[str, object] | None) -> StageOptions:
    """The decoder's ``options`` with every declared default filled in: a `StageOptions` (what the core hands the
    hooks) as it is, a plain mapping from `declarations` (a key given as ``None`` counting as not given)."""
    if isinstance(options, StageOptions):
        return options
    given = {k: v for k, v in dict(options or {}).items() if v is not None}
    return _table().fill("decoder", NAME, given)


@attrs.frozen(kw_only=True)
class DecoderPlan(DeviceRuntime):
    """The decoder's options as genie_cpu reads them, once (`of`): checked, normalised, every default filled in.
    Where it runs are the shared `vlmrun_qualcomm.runtime.DeviceRuntime` fields (target, timeout for one
    generation, device, adb, sdk_root, ndk_root); genie_cpu's own:

    :ivar quantize: the composer's weight quantization (``none``, ``z8``, ``q4``).
    :ivar context_length: Genie's dialog context (the composer config's ``size.context``).
    :ivar runner: ``auto``, ``libgenie`` or ``t2t``.
    :ivar compose_timeout: seconds for the composer.
    :ivar remote_dir: the working directory on the phone.
    :ivar composer_python: the composer's interpreter, or None (this one).
    """

    quantize: str
    context_length: int
    runner: str
    compose_timeout: float
    remote_dir: str
    composer_python: str | None = None

    @classmethod
    def of(cls, options: Mapping[str, object] | None) -> "DecoderPlan":
        """The plan of the decoder's ``options`` (filled, `fill`); UsageError for a bad value."""
        o = fill(options)
        runner = str(o["runner"]).lower()
        if runner not in RUNNERS:
            raise UsageError(f"genie_cpu runner '{runner}' is not one of {', '.join(RUNNERS)}")
        target = target_option(o["target"])
        return cls(quantize=quantize_option(o["quantize"]), context_length=int(o["context_length"]), runner=runner,
                   target=target, timeout=float(o["timeout"]), compose_timeout=float(o["compose_timeout"]),
                   remote_dir=str(o["remote_dir"]), sdk_root=o["sdk_root"], device=o["device"], adb=o["adb"],
                   ndk_root=o["ndk_root"], composer_python=o["composer_python"])
