"""Where the QAIRT SDK pieces genie_cpu needs live, and a one-line error naming what is missing."""

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
