"""Run a compiled stage on an Android phone with the QNN SDK's ``qnn-net-run`` over adb.

Contract of ``qnn-net-run`` (QAIRT SDK): ``--retrieve_context x.bin --backend libQnnHtp.so --input_list L
--output_dir D [--use_native_output_files]``; ``L`` has one line per inference, ``name:=path`` pairs separated
by spaces; outputs land in ``D/Result_<i>/<tensor>.raw``, float32 unless native output files are asked for,
in which case a quantized tensor arrives in its own type and is dequantized with float = (q + offset) * scale.

The SDK (``QAIRT_SDK_ROOT`` / ``QNN_SDK_ROOT`` or the ``sdk_root`` option) provides
``bin/aarch64-android/qnn-net-run`` and ``lib/aarch64-android/libQnnHtp*.so`` plus the DSP skeleton in
``lib/hexagon-<arch>/unsigned``. Everything is pushed once (skipped when the remote sha256 matches).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np

from vlmrun_qualcomm.adb import Adb
from vlmrun_qualcomm.sdk import Sdk
from vlmrun.errors import BackendError
from vlmrun.handles import StageHandle
from vlmrun.stages import QuantizedTensor

REMOTE_ROOT = "/data/local/tmp/vlmrun"


def sdk_root(option: str | None = None) -> Path:
    """The QNN SDK root for ``--target android`` (the ``sdk_root`` option, else the environment)."""
    return Sdk.find(option).require_root("for --target android")


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


class NetRunStage(StageHandle):
    """One compiled stage run on a phone. ``run(inputs)`` returns floats or QuantizedTensors."""

    def __init__(self, artifact, stage: str, *, sdk: Path, adb: Adb, native_outputs: bool = False,
                 timeout: float = 300.0, remote_root: str = REMOTE_ROOT):
        self.stage = stage
        self.artifact = artifact
        self.artifacts = (artifact,)
        self.manifest = artifact.manifest
        self.adb = adb
        self.native = native_outputs
        self.timeout = timeout
        self.inputs = {i["name"]: i for i in self.manifest["inputs"]}
        self.outputs = {o["name"]: o for o in self.manifest["outputs"]}
        self.quant = self.manifest.get("io_quant", {})
        exe, libs, dsp = device_files(sdk, self.manifest.get("arch", "v79"))
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
        binaries = [f for f in self.manifest["files"] if f.endswith(".bin")]
        if len(binaries) != 1:
            raise BackendError(f"{stage}: expected one context binary in the artifact, found {binaries}")
        for f in self.manifest["files"]:  # the .bin and its small EPContext wrapper
            adb.push(artifact.path / f, f"{self.remote_model}/{f}")
        self.remote_ctx = f"{self.remote_model}/{binaries[0]}"

    def _out_dtype(self, name: str) -> np.dtype:
        if self.native and name in self.quant:
            return np.dtype(self.quant[name]["dtype"])
        if self.native:
            return np.dtype(self.outputs[name]["dtype"])
        return np.dtype(np.float32)

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
            result = {}
            for name, spec in self.outputs.items():
                local = self.adb.pull(f"{work}/out/Result_0/{name}.raw", tmp / "out" / f"{name}.raw")
                dtype = self._out_dtype(name)
                shape = [int(d) for d in spec["shape"]]
                want = int(np.prod(shape)) * dtype.itemsize
                got = local.stat().st_size
                if got != want:
                    raise BackendError(
                        f"qnn-net-run ({self.stage}): output '{name}' is {got} bytes, expected {want}"
                        f" ({dtype.name}{shape}); the binary and the manifest disagree"
                    )
                data = np.fromfile(local, dtype=dtype).reshape(shape)
                if self.native and name in self.quant:
                    q = self.quant[name]
                    result[name] = QuantizedTensor(data, float(q["scale"]), int(q["offset"]))
                else:
                    result[name] = data.astype(np.float32, copy=False)
            return result
