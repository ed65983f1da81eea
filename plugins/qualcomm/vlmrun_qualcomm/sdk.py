"""The QAIRT (QNN) SDK on this machine: where its root is, where its tools and libraries live, and one-line
errors naming what is missing and where vlmrun looked.

The root comes from a plugin's ``sdk_root`` option, else ``$QAIRT_SDK_ROOT``, else ``$QNN_SDK_ROOT``. Layout
(QAIRT 2.x): ``bin/<arch>/`` tools, ``lib/<arch>/`` libraries with ``<arch>`` ``x86_64-linux-clang`` (host) or
``aarch64-android`` (phone), ``lib/hexagon-v<NN>/unsigned/`` the DSP skeletons.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import attrs

from vlmrun.errors import BackendError

ENV_ROOTS = ("QAIRT_SDK_ROOT", "QNN_SDK_ROOT")
HOST = "x86_64-linux-clang"
ANDROID = "aarch64-android"
COMPOSER = "qnn-genai-transformer-composer"


@attrs.frozen
class Sdk:
    root: Path | None
    source: str  # where the root came from

    @classmethod
    def find(cls, sdk_root: str | None) -> "Sdk":
        if sdk_root:
            return cls(Path(sdk_root).expanduser(), "the sdk_root option")
        for env in ENV_ROOTS:
            if os.environ.get(env):
                return cls(Path(os.environ[env]).expanduser(), f"${env}")
        return cls(None, "")

    def require_root(self, why: str) -> Path:
        """The SDK root, or one BackendError line saying which variable to set (``why``: what needs it)."""
        if self.root is None:
            raise BackendError(f"the QNN SDK is needed {why}: set QAIRT_SDK_ROOT (or QNN_SDK_ROOT) to the"
                               " unpacked QAIRT SDK, or pass the sdk_root option")
        if not self.root.is_dir():
            raise BackendError(f"QNN SDK root {self.root} does not exist (from {self.source})")
        return self.root

    def file(self, *parts: str) -> Path | None:
        """``root/parts...`` when that file exists."""
        return self._file(*parts)

    def _file(self, *parts: str) -> Path | None:
        if self.root is None:
            return None
        p = self.root.joinpath(*parts)
        return p if p.is_file() else None

    def tools(self, target: str = "local") -> dict[str, Path | None]:
        arch = HOST if target == "local" else ANDROID
        return {
            "composer": self._file("bin", HOST, COMPOSER) or (Path(w) if (w := shutil.which(COMPOSER)) else None),
            "genie-t2t-run": self._file("bin", arch, "genie-t2t-run"),
            "libQnnGenAiTransformer.so": self._file("lib", arch, "libQnnGenAiTransformer.so"),
            "libGenie.so": self._file("lib", arch, "libGenie.so"),
        }

    def require(self, target: str, runner: str = "auto") -> dict[str, Path]:
        """The tools for ``target``; BackendError (one line) naming what is missing and where vlmrun looked."""
        where = (f"looked in {self.root} ({self.source})" if self.root
                 else f"{' / '.join(ENV_ROOTS)} not set and no sdk_root option")
        t = self.tools(target)
        missing = []
        if t["composer"] is None:
            missing.append(COMPOSER)
        in_proc = t["libQnnGenAiTransformer.so"] is not None and t["libGenie.so"] is not None
        if target == "android" or runner == "t2t":
            if t["genie-t2t-run"] is None:
                missing.append("genie-t2t-run")
            if target == "android" and t["libQnnGenAiTransformer.so"] is None:
                missing.append("libQnnGenAiTransformer.so")
        elif runner == "libgenie":
            missing += [n for n in ("libQnnGenAiTransformer.so", "libGenie.so") if t[n] is None]
        elif not in_proc and t["genie-t2t-run"] is None:
            missing += ["genie-t2t-run"] + [n for n in ("libQnnGenAiTransformer.so",) if t[n] is None]
        if missing:
            arch = HOST if target == "local" else ANDROID
            raise BackendError(f"genie_cpu needs the QAIRT SDK's {', '.join(missing)} ({arch}); {where}")
        return {k: v for k, v in t.items() if v is not None}


def phone_options(backend: str, stages=None) -> list:
    """The options of a backend that can run on a phone over adb with the SDK's tools (qnn_htp, genie_cpu)."""
    from pathlib import Path as _Path

    from vlmrun.options import Option

    return [
        Option(backend, "target", str, choices=("local", "android"), stages=stages, default="local",
               flag="--target", help="where compiled stages run: this machine, or a phone over adb (needs the"
                                     " QNN SDK: QAIRT_SDK_ROOT)"),
        Option(backend, "device", str, stages=stages, flag="--device",
               help="adb serial of the phone, when more than one is connected"),
        Option(backend, "adb", _Path, stages=stages, help="the adb executable (default: $VLMRUN_ADB, else adb on PATH)"),
        Option(backend, "sdk_root", _Path, stages=stages,
               help="the unpacked QAIRT SDK (default: $QAIRT_SDK_ROOT, else $QNN_SDK_ROOT)"),
        Option(backend, "adb_timeout", float, stages=stages, default=120.0, minimum=1,
               help="seconds for one adb transfer or command"),
    ]
