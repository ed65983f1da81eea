"""The QAIRT (QNN) SDK on this machine: where its root is, which QNN version it is, where its tools and libraries
live, the environment its tools need, and one-line errors naming what is missing and where vlmrun looked.

The root comes from a plugin's ``sdk_root`` option, else ``$QAIRT_SDK_ROOT``, else ``$QNN_SDK_ROOT``. Layout
(QAIRT 2.x): ``sdk.yaml`` (``version: 2.42.0.251225``), ``bin/<arch>/`` tools, ``lib/<arch>/`` libraries with
``<arch>`` ``x86_64-linux-clang`` (host) or ``aarch64-android`` (phone), ``lib/hexagon-v<NN>/unsigned/`` the DSP
skeletons, ``lib/python/`` the Python packages (``qti.aisw``) of the Python tools (converters, the genai-transformer
composer), which the SDK's ``bin/envsetup.sh`` puts on ``PYTHONPATH``.

The QNN version matters on a phone: ``--target android`` pushes this SDK's ``libQnnHtp.so`` and Skel, and a
context binary loads only on the QNN version that built it or a newer one.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import attrs

from vlmrun.errors import BackendError
from vlmrun.options import Option

ENV_ROOTS = ("QAIRT_SDK_ROOT", "QNN_SDK_ROOT")
ENV_NDK = ("ANDROID_NDK_ROOT", "ANDROID_NDK_HOME", "ANDROID_NDK")
HOST = "x86_64-linux-clang"
ANDROID = "aarch64-android"
COMPOSER = "qnn-genai-transformer-composer"
#: where the NDK keeps the C++ runtime that the SDK's Android binaries (genie-t2t-run, libGenie.so) link against
NDK_LIBCXX = "toolchains/llvm/prebuilt/linux-x86_64/sysroot/usr/lib/aarch64-linux-android/libc++_shared.so"
LIBCXX = "libc++_shared.so"

#: What Genie on the QnnGenAiTransformer (CPU) backend opens: genie-t2t-run links libGenie.so; Genie dlopens the
#: backend, the model library and the op package by name (Genie's Dialog.cpp: getLibName("QnnGenAiTransformer"),
#: "QnnGenAiTransformerModel", "QnnGenAiTransformerCpuOpPkg").
GENIE_CPU_LIBS = ("libGenie.so", "libQnnGenAiTransformer.so", "libQnnGenAiTransformerModel.so",
                  "libQnnGenAiTransformerCpuOpPkg.so")

#: The SDK's own compile tools (host) and what they load: ONNX -> C++/weights -> model library -> context binary.
QNN_COMPILE_TOOLS = ("qnn-onnx-converter", "qnn-model-lib-generator", "qnn-context-binary-generator",
                     "qnn-context-binary-utility")
QNN_COMPILE_LIBS = ("libQnnHtp.so", "libQnnHtpNetRunExtensions.so")

#: What genie-t2t-run on a phone's HTP opens, as ``{name on the phone: path under the SDK}`` for HTP arch ``NN``
#: (the SoC table's arch): libGenie.so (linked), the QnnHtp backend, its CPU-side Stub for the arch, QnnSystem (context
#: binary metadata), the backend-extension library (an ``extensions`` config), and the Skel that the Stub loads on the
#: DSP through ``ADSP_LIBRARY_PATH``.
def genie_htp_layout(arch: str) -> dict[str, str]:
    nn = str(arch).lower().lstrip("v")
    lib = f"lib/{ANDROID}"
    return {
        "genie-t2t-run": f"bin/{ANDROID}/genie-t2t-run",
        "libGenie.so": f"{lib}/libGenie.so",
        "libQnnHtp.so": f"{lib}/libQnnHtp.so",
        f"libQnnHtpV{nn}Stub.so": f"{lib}/libQnnHtpV{nn}Stub.so",
        "libQnnSystem.so": f"{lib}/libQnnSystem.so",
        "libQnnHtpNetRunExtensions.so": f"{lib}/libQnnHtpNetRunExtensions.so",
        f"libQnnHtpV{nn}Skel.so": f"lib/hexagon-v{nn}/unsigned/libQnnHtpV{nn}Skel.so",
    }


_VERSION = re.compile(rb"(?<![\d.])v?(2\.\d{1,3}\.\d{1,3}\.\d{6,}(?:\.\d+)?)")


def version_tuple(v: str | None) -> tuple[int, ...]:
    """``"v2.42.0.251225"`` -> ``(2, 42, 0, 251225)`` (``()`` when unknown)."""
    return tuple(int(n) for n in re.findall(r"\d+", str(v or "")))


def major_minor(v: str | None) -> str:
    t = version_tuple(v)
    return ".".join(str(n) for n in t[:2]) if t else "?"


def newer_than(binary: str | None, runtime: str | None) -> bool:
    """Whether a context binary built with QNN ``binary`` is newer than the ``runtime`` (major.minor; a binary
    loads only on the same QNN or newer). False when either is unknown."""
    b, r = version_tuple(binary)[:2], version_tuple(runtime)[:2]
    return bool(b and r) and b > r


def ndk_libcxx(ndk_root: str | os.PathLike | None = None) -> tuple[Path | None, str]:
    """The NDK's ``libc++_shared.so`` for arm64 and where vlmrun looked (``ndk_root``, else ``$ANDROID_NDK_ROOT``,
    ``$ANDROID_NDK_HOME``, ``$ANDROID_NDK``)."""
    roots = [(Path(ndk_root).expanduser(), "the ndk_root option")] if ndk_root else []
    roots += [(Path(os.environ[e]).expanduser(), f"${e}") for e in ENV_NDK if os.environ.get(e)]
    for root, _ in roots:
        p = root / NDK_LIBCXX
        if p.is_file():
            return p, str(p)
    where = ", ".join(f"{r / NDK_LIBCXX} ({src})" for r, src in roots) or f"{' / '.join(ENV_NDK)} not set"
    return None, where


@attrs.frozen
class Sdk:
    root: Path | None
    source: str  # where the root came from

    @classmethod
    def find(cls, sdk_root: str | os.PathLike | None) -> "Sdk":
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

    @property
    def where(self) -> str:
        return (f"looked in {self.root} ({self.source})" if self.root
                else f"{' / '.join(ENV_ROOTS)} not set and no sdk_root option")

    # -- version -----------------------------------------------------------------------------------------
    def version_info(self) -> tuple[str | None, str]:
        """(QNN version of this SDK, where it was read): ``sdk.yaml``'s ``version:``, else the root directory's
        name (the SDK unpacks as ``qairt/2.42.0.251225``), else the build id inside ``libQnnHtp.so``."""
        if self.root is None or not self.root.is_dir():
            return None, ""
        yaml = self.root / "sdk.yaml"
        if yaml.is_file():
            for line in yaml.read_text(errors="replace").splitlines():
                if line.strip().startswith("version:"):
                    v = line.split(":", 1)[1].strip().strip("'\"")
                    if version_tuple(v):
                        return v.lstrip("vV"), str(yaml)
        m = re.fullmatch(r"v?(\d+\.\d+\.\d+(?:\.\d+)?)", self.root.resolve().name)
        if m:
            return m.group(1), f"the directory name {self.root.resolve().name}"
        for arch in (ANDROID, HOST):
            lib = self.root / "lib" / arch / "libQnnHtp.so"
            if lib.is_file():
                found = _VERSION.search(lib.read_bytes())
                if found:
                    return found.group(1).decode(), str(lib)
        return None, ""

    def version(self) -> str | None:
        """The QNN version of this SDK (``"2.42.0.251225"``), or None when it cannot be read."""
        return self.version_info()[0]

    # -- environment ---------------------------------------------------------------------------------------
    def env(self, base: dict | None = None) -> dict[str, str]:
        """The environment the SDK's tools run in, as its ``bin/envsetup.sh`` sets it: ``QNN_SDK_ROOT``,
        ``QAIRT_SDK_ROOT``, ``PYTHONPATH`` with ``lib/python``, ``PATH`` with ``bin/x86_64-linux-clang``,
        ``LD_LIBRARY_PATH`` with ``lib/x86_64-linux-clang``."""
        env = dict(os.environ if base is None else base)
        root = self.require_root("to run its tools")

        def front(key: str, value: Path) -> str:
            rest = env.get(key, "")
            return f"{value}{os.pathsep}{rest}" if rest else str(value)

        env["QNN_SDK_ROOT"] = env["QAIRT_SDK_ROOT"] = str(root)
        env["PYTHONPATH"] = front("PYTHONPATH", root / "lib" / "python")
        env["PATH"] = front("PATH", root / "bin" / HOST)
        env["LD_LIBRARY_PATH"] = front("LD_LIBRARY_PATH", root / "lib" / HOST)
        return env

    # -- files ---------------------------------------------------------------------------------------------
    def file(self, *parts: str) -> Path | None:
        """``root/parts...`` when that file exists."""
        return self._file(*parts)

    def _file(self, *parts: str) -> Path | None:
        if self.root is None:
            return None
        p = self.root.joinpath(*parts)
        return p if p.is_file() else None

    def tools(self, target: str = "local", ndk_root: str | os.PathLike | None = None) -> dict[str, Path | None]:
        """genie_cpu's tools and libraries for ``target`` (None where missing). On ``android`` this includes the
        C++ runtime ``libc++_shared.so`` (the SDK's own copy, else the NDK's)."""
        arch = HOST if target == "local" else ANDROID
        out = {
            "composer": self._file("bin", HOST, COMPOSER) or (Path(w) if (w := shutil.which(COMPOSER)) else None),
            "genie-t2t-run": self._file("bin", arch, "genie-t2t-run"),
            **{lib: self._file("lib", arch, lib) for lib in GENIE_CPU_LIBS},
        }
        if target == "android":
            out[LIBCXX] = self._file("lib", ANDROID, LIBCXX) or ndk_libcxx(ndk_root)[0]
        return out

    def require(self, target: str, runner: str = "auto", ndk_root: str | os.PathLike | None = None
                ) -> dict[str, Path]:
        """genie_cpu's tools for ``target``; BackendError (one line) naming every missing file and where vlmrun
        looked. Every way of decoding loads the four Genie CPU libraries; genie-t2t-run is needed unless
        libGenie runs in-process (local ``auto`` / ``libgenie``); a phone also needs ``libc++_shared.so``."""
        t = self.tools(target, ndk_root)
        missing = []
        if t["composer"] is None:
            missing.append(COMPOSER)
        libs_missing = [n for n in GENIE_CPU_LIBS if t[n] is None]
        if target == "android" or runner == "t2t":
            if t["genie-t2t-run"] is None:
                missing.append("genie-t2t-run")
        elif runner == "auto" and libs_missing and t["genie-t2t-run"] is None:
            missing.append("genie-t2t-run")
        missing += libs_missing
        where = self.where
        if target == "android" and t[LIBCXX] is None:
            missing.append(f"{LIBCXX} (from the Android NDK: set ANDROID_NDK_ROOT)")
            where += f"; {LIBCXX}: looked in {ndk_libcxx(ndk_root)[1]}"
        if missing:
            arch = HOST if target == "local" else ANDROID
            raise BackendError(f"genie_cpu needs the QAIRT SDK's {', '.join(missing)} ({arch}); {where}")
        return {k: v for k, v in t.items() if v is not None}

    def genie_htp_files(self, arch: str, ndk_root: str | os.PathLike | None = None) -> dict[str, Path | None]:
        """genie-t2t-run on a phone's HTP (arch e.g. ``v79``): ``{name on the phone: SDK file or None}`` in push
        order (`genie_htp_layout`), then ``libc++_shared.so`` (the SDK's own copy, else the NDK's)."""
        out: dict[str, Path | None] = {n: self._file(*rel.split("/")) for n, rel in genie_htp_layout(arch).items()}
        out[LIBCXX] = self._file("lib", ANDROID, LIBCXX) or ndk_libcxx(ndk_root)[0]
        return out

    def require_genie_htp(self, arch: str, ndk_root: str | os.PathLike | None = None,
                          why: str = "for Genie on the phone's HTP") -> dict[str, Path]:
        """`genie_htp_files`, or one BackendError line naming every missing file (SDK-relative) and where
        vlmrun looked."""
        self.require_root(why)
        files = self.genie_htp_files(arch, ndk_root)
        layout = genie_htp_layout(arch)
        missing = [layout[n] for n, p in files.items() if p is None and n in layout]
        where = self.where
        if files[LIBCXX] is None:
            missing.append(f"{LIBCXX} (from the Android NDK: set ANDROID_NDK_ROOT)")
            where += f"; {LIBCXX}: looked in {self.root / 'lib' / ANDROID / LIBCXX}, {ndk_libcxx(ndk_root)[1]}"
        if missing:
            raise BackendError(f"the QAIRT SDK lacks {', '.join(missing)}, needed {why} (HTP {arch}); {where}")
        return {k: v for k, v in files.items() if v is not None}

    def compile_tools(self) -> dict[str, Path | None]:
        """The SDK's host compile tools and the libraries they load (None where missing)."""
        out: dict[str, Path | None] = {n: self._file("bin", HOST, n) for n in QNN_COMPILE_TOOLS}
        out.update({n: self._file("lib", HOST, n) for n in QNN_COMPILE_LIBS})
        py = self.root / "lib" / "python" / "qti" / "aisw" if self.root else None
        out["lib/python/qti/aisw"] = py if py is not None and py.is_dir() else None
        return out

    def require_compile_tools(self, why: str = "to compile with the SDK's own tools") -> dict[str, Path]:
        """The compile tools, or one BackendError line naming the missing ones and where vlmrun looked."""
        self.require_root(why)
        t = self.compile_tools()
        missing = [k for k, v in t.items() if v is None]
        if missing:
            raise BackendError(f"the QNN SDK lacks {', '.join(missing)} ({HOST}), needed {why}; {self.where}")
        return {k: v for k, v in t.items() if v is not None}


def phone_options(backend: str, stages=None) -> list:
    """The options of a backend that can run on a phone over adb with the SDK's tools (qnn_htp, genie_cpu)."""
    return [
        Option(backend, "target", str, choices=("local", "android"), stages=stages, default="local",
               flag="--target", help="where compiled stages run: this machine, or a phone over adb (needs the"
                                     " QNN SDK: QAIRT_SDK_ROOT)"),
        Option(backend, "device", str, stages=stages, flag="--device",
               help="adb serial of the phone, when more than one is connected"),
        Option(backend, "adb", Path, stages=stages, help="the adb executable (default: $VLMRUN_ADB, else adb on PATH)"),
        Option(backend, "sdk_root", Path, stages=stages,
               help="the unpacked QAIRT SDK (default: $QAIRT_SDK_ROOT, else $QNN_SDK_ROOT)"),
        Option(backend, "adb_timeout", float, stages=stages, default=120.0, minimum=1,
               help="seconds for one adb transfer or command"),
    ]
