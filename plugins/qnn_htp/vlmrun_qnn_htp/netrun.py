"""Run a compiled stage on an Android phone with the QNN SDK's ``qnn-net-run`` over adb.

Contract of ``qnn-net-run`` (QAIRT SDK; its output writer is the QNN SampleApp's ``IOTensor::writeOutputTensors``):
``--retrieve_context x.bin --backend libQnnHtp.so --input_list L --output_dir D [--use_native_output_files]``;
``L`` has one line per inference, ``name:=path`` pairs separated by spaces. Outputs land in
``D/Result_<i>/<tensor>.raw`` (float32), or ``D/<graph>/Result_<i>/...`` when the context holds several graphs.
With ``--use_native_output_files`` a float32 tensor is still ``<tensor>.raw``, any other arrives in its own type as
``<tensor>_native.raw`` (a quantized one is dequantized with float = (q + offset) * scale).

The SDK (``QAIRT_SDK_ROOT`` / ``QNN_SDK_ROOT`` or the ``sdk_root`` option) provides
``bin/aarch64-android/qnn-net-run`` and ``lib/aarch64-android/libQnnHtp*.so`` plus the DSP skeleton in
``lib/hexagon-<arch>/unsigned``. These are the QNN runtime on the phone, so a context binary built by a newer QNN
than this SDK is refused before anything is pushed (a context binary loads only on the same QNN or newer).
Everything is pushed once (skipped when the remote sha256 matches).
"""

from __future__ import annotations

import os
import re
import sys
import tempfile
from pathlib import Path

import numpy as np

from vlmrun_qualcomm.adb import Adb
from vlmrun_qualcomm.sdk import Sdk, major_minor, newer_than
from vlmrun.errors import BackendError
from vlmrun.handles import StageHandle
from vlmrun.stages import QuantizedTensor

REMOTE_ROOT = "/data/local/tmp/vlmrun"
_warned: set[str] = set()


def phone_sdk(option: str | os.PathLike | None = None) -> Sdk:
    """The QNN SDK whose runtime goes to the phone (the ``sdk_root`` option, else the environment)."""
    sdk = Sdk.find(option)
    sdk.require_root("for --target android")
    return sdk


def sdk_root(option: str | None = None) -> Path:
    """The QNN SDK root for ``--target android`` (the ``sdk_root`` option, else the environment)."""
    return phone_sdk(option).root


def binary_qnn_version(manifest: dict) -> str | None:
    """The QNN version that built a context binary, from its manifest (``qnn_version``, else the EPContext's
    ``ep_sdk_version``)."""
    v = manifest.get("qnn_version") or manifest.get("ep_sdk_version")
    return str(v).lstrip("vV") if v else None


def refusal(what: str, built: str, runtime: str, sdk: Sdk, compiler: str | None) -> str:
    """One line: a binary newer than the phone's QNN, and the ways to make one for that QNN."""
    by = f" (compiled by {compiler})" if compiler else ""
    old = major_minor(runtime)
    return (f"{what}: the context binary was built with QNN {built}{by} but the phone gets the QNN runtime of"
            f" the SDK at {sdk.root} (QAIRT {runtime}), and a context binary loads only on the same QNN or newer;"
            f" make binaries for QAIRT {old}: --compiler qaihub with the qaihub option qairt_version = \"{old}\", or"
            f" the SDK's own tools (qnn_htp option toolchain = \"sdk\", --toolchain sdk), or point sdk_root /"
            f" QAIRT_SDK_ROOT at a QAIRT SDK >= {major_minor(built)}")


def check_runtime(manifest: dict, sdk: Sdk, what: str) -> None:
    """Refuse a context binary newer than the SDK's QNN (the runtime pushed to the phone); BackendError, one
    line. When the SDK's version cannot be read, say so once on stderr and go on."""
    built = binary_qnn_version(manifest)
    runtime, _ = sdk.version_info()
    if runtime is None:
        key = str(sdk.root)
        if key not in _warned:
            _warned.add(key)
            print(f"vlmrun: warning: cannot read the QNN version of the SDK at {sdk.root} (no sdk.yaml, no version"
                  " in libQnnHtp.so); a context binary newer than it will not load on the phone", file=sys.stderr)
        return
    if newer_than(built, runtime):
        raise BackendError(refusal(what, built, runtime, sdk, manifest.get("compiler")))


def device_files(root: Path, arch: str) -> tuple[Path, list[Path], list[Path]]:
    """qnn-net-run, host-side libs, DSP libs for ``arch`` (e.g. v79) from the SDK; BackendError naming a gap."""
    exe = root / "bin" / "aarch64-android" / "qnn-net-run"
    libdir = root / "lib" / "aarch64-android"
    need = [exe, libdir / "libQnnHtp.so"]
    missing = [str(p.relative_to(root)) for p in need if not p.is_file()]
    if missing:
        raise BackendError(f"the QNN SDK at {root} lacks {', '.join(missing)}; is it a full QAIRT SDK?")
    num = arch.lstrip("v")
    libs = [p for p in (libdir / n for n in ("libQnnHtp.so", f"libQnnHtpV{num}Stub.so", "libQnnSystem.so",
                                             "libQnnHtpPrepare.so")) if p.is_file()]
    dsp_dir = root / "lib" / f"hexagon-v{num}" / "unsigned"
    dsp = sorted(dsp_dir.glob("*.so")) if dsp_dir.is_dir() else []
    return exe, libs, dsp


def file_names(name: str) -> list[str]:
    """The names qnn-net-run may give tensor ``name``'s file: as is, and sanitised as the QNN converters do
    (characters outside [A-Za-z0-9_] become "_", a leading digit gets a "_" prefix)."""
    clean = re.sub(r"\W", "_", name)
    if clean[:1].isdigit():
        clean = "_" + clean
    return list(dict.fromkeys([name, clean]))


class NetRunStage(StageHandle):
    """One compiled stage run on a phone. ``run(inputs)`` returns floats or QuantizedTensors."""

    def __init__(self, artifact, stage: str, *, sdk: Sdk | Path, adb: Adb, native_outputs: bool = False,
                 timeout: float = 300.0, remote_root: str = REMOTE_ROOT):
        sdk = sdk if isinstance(sdk, Sdk) else Sdk.find(sdk)
        self.stage = stage
        self.artifact = artifact
        self.artifacts = (artifact,)
        self.manifest = artifact.manifest
        check_runtime(self.manifest, sdk, f"{stage} ({artifact.path.name})")  # before anything goes to the phone
        self.adb = adb
        self.native = native_outputs
        self.timeout = timeout
        self.inputs = {i["name"]: i for i in self.manifest["inputs"]}
        self.outputs = {o["name"]: o for o in self.manifest["outputs"]}
        self.quant = self.manifest.get("io_quant", {})
        self.graphs = list(self.manifest.get("graphs") or [])
        exe, libs, dsp = device_files(sdk.root, self.manifest.get("arch", "v79"))
        binaries = [f for f in self.manifest["files"] if f.endswith(".bin")]
        if len(binaries) != 1:
            raise BackendError(f"{stage}: expected one context binary in the artifact, found {binaries}")
        self.remote_bin = f"{remote_root}/bin"
        self.remote_lib = f"{remote_root}/lib"
        self.remote_model = f"{remote_root}/{artifact.path.name}"
        adb.mkdir(self.remote_bin)
        adb.mkdir(self.remote_lib)
        adb.mkdir(self.remote_model)
        adb.push(exe, f"{self.remote_bin}/qnn-net-run")
        adb.shell(["chmod", "755", f"{self.remote_bin}/qnn-net-run"], what="adb shell chmod")
        for lib in [*libs, *dsp]:
            adb.push(lib, f"{self.remote_lib}/{lib.name}")
        for f in self.manifest["files"]:  # the .bin and its small EPContext wrapper
            adb.push(artifact.path / f, f"{self.remote_model}/{f}")
        self.remote_ctx = f"{self.remote_model}/{binaries[0]}"

    def _candidates(self, name: str) -> list[tuple[str, bool]]:
        """(path under the output directory, native?) in the order qnn-net-run's naming makes them likely."""
        dirs = [f"{g}/Result_0" for g in self.graphs] if len(self.graphs) > 1 else []
        dirs += ["Result_0"]
        out = []
        for d in dirs:
            for n in file_names(name):
                if self.native:
                    out.append((f"{d}/{n}_native.raw", True))
                out.append((f"{d}/{n}.raw", False))
        return out

    def _dtype(self, name: str, native: bool, nbytes: int, count: int) -> np.dtype:
        if not native:
            return np.dtype(np.float32)
        if name in self.quant:
            return np.dtype(self.quant[name].get("dtype", "uint8"))
        per = nbytes // max(count, 1)  # a non-quantized native tensor (e.g. float16) in its own type
        declared = np.dtype(self.outputs[name]["dtype"])
        if per == declared.itemsize:
            return declared
        return {2: np.dtype(np.float16), 4: np.dtype(np.float32), 1: np.dtype(np.uint8)}.get(per, declared)

    def _listing(self, out_dir: str) -> set[str]:
        """The .raw files qnn-net-run wrote, relative to ``out_dir`` (``Result_0/x.raw``, ``g/Result_0/x.raw``)."""
        res = self.adb.shell(["find", ".", "-name", "*.raw"], cwd=out_dir, what="adb shell find", check=False)
        return {ln.strip()[2:] for ln in res.stdout.splitlines() if ln.strip().startswith("./")}

    def run(self, inputs: dict) -> dict:
        work = f"{self.remote_model}/run"
        self.adb.shell(["rm", "-rf", work], what="adb shell rm")
        self.adb.mkdir(f"{work}/in")
        with tempfile.TemporaryDirectory(prefix="vlmrun-netrun-") as tmp:
            tmp = Path(tmp)
            pairs = []
            for name, spec in self.inputs.items():
                if name not in inputs:
                    raise BackendError(f"{self.stage}: missing input '{name}'")
                arr = np.ascontiguousarray(inputs[name], dtype=np.float32)
                want = [int(d) for d in spec["shape"]]
                if list(arr.shape) != want:
                    raise BackendError(f"{self.stage}: input '{name}' is {list(arr.shape)}, the binary wants {want}")
                local = tmp / f"{name}.raw"
                arr.tofile(local)
                remote = f"{work}/in/{name}.raw"
                self.adb.push(local, remote, skip_same=False)
                pairs.append(f"{name}:={remote}")
            (tmp / "input_list.txt").write_text(" ".join(pairs) + "\n")
            self.adb.push(tmp / "input_list.txt", f"{work}/input_list.txt", skip_same=False)
            argv = [f"{self.remote_bin}/qnn-net-run", "--retrieve_context", self.remote_ctx,
                    "--backend", f"{self.remote_lib}/libQnnHtp.so", "--input_list", f"{work}/input_list.txt",
                    "--output_dir", f"{work}/out"]
            if self.native:
                argv.append("--use_native_output_files")
            env = {"LD_LIBRARY_PATH": self.remote_lib, "ADSP_LIBRARY_PATH": self.remote_lib}
            res = self.adb.shell(argv, cwd=work, env=env, timeout=self.timeout, check=False,
                                 what=f"qnn-net-run ({self.stage})")
            if res.returncode != 0:
                lines = [ln for ln in (res.stderr + "\n" + res.stdout).splitlines() if ln.strip()]
                detail = lines[-1].strip() if lines else "no output"
                raise BackendError(f"qnn-net-run ({self.stage}) exited with code {res.returncode} on"
                                   f" {self.adb.serial}: {detail}")
            present = self._listing(f"{work}/out")
            result = {}
            for name, spec in self.outputs.items():
                found = next(((p, nat) for p, nat in self._candidates(name) if p in present), None)
                if found is None:
                    seen = ", ".join(sorted(present)[:6]) or "nothing"
                    raise BackendError(f"qnn-net-run ({self.stage}) wrote no file for output '{name}'"
                                       f" (looked for {self._candidates(name)[0][0]}; found {seen})")
                rel, native = found
                local = self.adb.pull(f"{work}/out/{rel}", tmp / "out" / rel.replace("/", "__"))
                shape = [int(d) for d in spec["shape"]]
                count = int(np.prod(shape))
                got = local.stat().st_size
                dtype = self._dtype(name, native, got, count)
                want = count * dtype.itemsize
                if got != want:
                    raise BackendError(
                        f"qnn-net-run ({self.stage}): output '{name}' is {got} bytes, expected {want}"
                        f" ({dtype.name}{shape}); the binary and the manifest disagree"
                    )
                data = np.fromfile(local, dtype=dtype).reshape(shape)
                if native and name in self.quant:
                    q = self.quant[name]
                    result[name] = QuantizedTensor(data, float(q["scale"]), int(q["offset"]))
                else:
                    result[name] = data.astype(np.float32, copy=False)
            return result
