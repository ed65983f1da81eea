"""Where a Qualcomm runtime runs a stage: on this machine, or on a phone over adb. The runtime options qnn_htp's
stages (`vlmrun_qnn_htp.plan.Runtime`) and genie_cpu's decoder (`vlmrun_genie_cpu.options.DecoderPlan`) both take,
declared once here as fields; each plugin adds its own."""

from __future__ import annotations

import attrs

from vlmrun.errors import UsageError

TARGETS = ("local", "android")


@attrs.frozen(kw_only=True)
class DeviceRuntime:
    """Where and how long a runtime runs.

    :ivar target: ``local`` (this machine) or ``android`` (a phone over adb).
    :ivar timeout: seconds for one stage run or one generation.
    :ivar device: the phone's adb serial, or None (the one connected).
    :ivar adb: the adb executable, or None (``$VLMRUN_ADB``, else adb on PATH).
    :ivar sdk_root: the QAIRT SDK, or None (``$QAIRT_SDK_ROOT``, else ``$QNN_SDK_ROOT``).
    :ivar ndk_root: the Android NDK (its ``libc++_shared.so`` for the phone), or None (``$ANDROID_NDK_ROOT``).
    """

    target: str
    timeout: float
    device: str | None = None
    adb: str | None = None
    sdk_root: str | None = None
    ndk_root: str | None = None

    @property
    def on_phone(self) -> bool:
        return self.target == "android"


def target_option(value: object) -> str:
    """``value`` as a target (`TARGETS`, any case); UsageError otherwise."""
    target = str(value).lower()
    if target not in TARGETS:
        raise UsageError(f"target '{target}' is not one of {', '.join(TARGETS)}")
    return target
