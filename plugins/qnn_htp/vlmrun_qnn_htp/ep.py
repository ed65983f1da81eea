"""onnxruntime-qnn: register the QNN execution provider, compile ONNX to a QNN context binary, load it.

Compiling = creating a session with ``ep.context_enable=1`` (embed mode 0), which writes ``<name>_ctx.onnx``
(one ``com.microsoft:EPContext`` node per QNN graph) and the raw context binary ``<name>_ctx_qnn.bin``.
CPU fallback is always disabled; when the HTP rejects a node, a second diagnostic pass with fallback allowed
finds which nodes were left to the CPU so the error can name them.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys

import tempfile
import time
from pathlib import Path

import numpy as np

from vlmrun.errors import BackendError
from vlmrun.procs import stdout_to_stderr  # QNN prints a banner on stdout (callers use it too)

from vlmrun_qualcomm import emulator
from vlmrun_qualcomm.emulator import is_emulator  # noqa: F401 (qnn_htp's modules take it from here)
from vlmrun_qualcomm.manifest import describe_ctx_onnx
from vlmrun_qualcomm.socs import Soc

EP_NAME = "QNNExecutionProvider"
_registered = False

ONNX_DTYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(int32)": "int32",
    "tensor(int64)": "int64",
    "tensor(uint8)": "uint8",
    "tensor(int8)": "int8",
    "tensor(uint16)": "uint16",
    "tensor(int16)": "int16",
    "tensor(bool)": "bool",
}


def versions() -> dict[str, str]:
    import onnxruntime as ort
    import onnxruntime_qnn

    return {
        "onnxruntime": ort.__version__,
        "onnxruntime_qnn": onnxruntime_qnn.__version__,
        "qnn": getattr(onnxruntime_qnn.build_and_package_info, "qnn_version", "?"),
    }


def qnn_version() -> str:
    return versions()["qnn"]


def _ensure_registered():
    global _registered
    import onnxruntime as ort

    try:
        import onnxruntime_qnn
    except ImportError as exc:
        raise BackendError(f"onnxruntime-qnn is not installed ({exc}); pip install onnxruntime-qnn==2.7.0") from None
    if not _registered:
        emulator.route_pow(Path(onnxruntime_qnn.get_qnn_htp_path()).parent)
        try:
            with stdout_to_stderr():
                ort.register_execution_provider_library(EP_NAME, onnxruntime_qnn.get_library_path())
        except Exception as exc:  # already registered by someone else in this process is fine
            if "already" not in str(exc).lower():
                raise BackendError(f"cannot register the QNN execution provider: {_one_line(exc)}") from None
        _registered = True
    with stdout_to_stderr():
        devices = [d for d in ort.get_ep_devices() if d.ep_name == EP_NAME]
    if not devices:
        raise BackendError("the QNN execution provider registered but offers no device")
    return ort, devices


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    msg = text[0] if text else type(exc).__name__
    return re.sub(r"^\[ONNXRuntimeError\] : \d+ : \w+ : ", "", msg)


def session_options(soc: Soc, *, fallback: bool = False, context_path: Path | None = None,
                    log_level: int = 3, extra_provider: dict | None = None):
    ort, devices = _ensure_registered()
    so = ort.SessionOptions()
    so.log_severity_level = log_level
    so.add_session_config_entry("session.disable_cpu_ep_fallback", "0" if fallback else "1")
    if context_path is not None:
        so.add_session_config_entry("ep.context_enable", "1")
        so.add_session_config_entry("ep.context_file_path", str(context_path))
        so.add_session_config_entry("ep.context_embed_mode", "0")
    provider = {"backend_type": "htp", "htp_arch": soc.arch_number, "soc_model": str(soc.soc_model)}
    provider.update(extra_provider or {})
    so.add_provider_for_devices(devices, provider)
    return ort, so


def compile_session(src: Path, ctx_path: Path, soc: Soc, share: bool = False, stop: bool = False) -> None:
    """Compile ``src`` into the EPContext wrapper ``ctx_path`` (and its binary) by opening a session on it;
    ``share``: onnxruntime-qnn's ``ep.share_ep_contexts`` (graphs of consecutive sessions in one weight-shared
    binary, written when ``stop``)."""
    ort, so = session_options(soc, context_path=ctx_path)
    if share:
        so.add_session_config_entry("ep.share_ep_contexts", "1")
        if stop:
            so.add_session_config_entry("ep.stop_share_ep_contexts", "1")
    log: list[str] = []
    try:
        with native_log(log):
            ort.InferenceSession(str(src), so)
    except Exception as exc:
        refused = refused_node("".join(log), str(src.name), soc)
        if refused is not None:
            raise refused from exc
        raise


def unsupported_nodes(src: Path, soc: Soc) -> list[str]:
    """Which nodes of ``src`` the HTP does not take: compile once with CPU fallback allowed and look."""
    with tempfile.TemporaryDirectory(prefix="vlmrun-qnn-diag-") as tmp:
        ctx = Path(tmp) / "diag_ctx.onnx"
        try:
            ort, so = session_options(soc, fallback=True, context_path=ctx, log_level=4)
            with stdout_to_stderr():
                ort.InferenceSession(str(src), so)
            return describe_ctx_onnx(ctx)["non_qnn_nodes"]
        except Exception:
            return []


@contextlib.contextmanager
def native_log(sink: list):
    """Collect what native code writes on stderr (and stdout: QNN's banners) while the block runs, into ``sink``
    (one string); it is written back to stderr when the block succeeds, kept for the error message when it fails."""
    import tempfile

    sys.stdout.flush()
    sys.stderr.flush()
    saved_out, saved_err = os.dup(1), os.dup(2)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 1)
        os.dup2(tmp.fileno(), 2)
        ok = False
        try:
            yield
            ok = True
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved_out, 1)
            os.dup2(saved_err, 2)
            os.close(saved_out)
            os.close(saved_err)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            sink.append(text)
            if ok and text:
                sys.stderr.write(text)
                sys.stderr.flush()


REFUSED_NODE = re.compile(r"graphAddNode\(\) failed for node `([^`]+)` of type `([^`]+)` with error code (\d+)")


def refused_node(log: str, what: str, soc: Soc) -> BackendError | None:
    """The one-line error for a node the HTP refused while composing the graph (an op or an encoding it does not
    take), from onnxruntime-qnn's log; None when the log names none."""
    m = REFUSED_NODE.search(log or "")
    if m is None:
        return None
    node, qnn_type, code = m.groups()
    return BackendError(f"QNN HTP ({soc.name}/{soc.arch}) refused node {node} (QNN {qnn_type}, error {code}) of {what}:"
                        " an op or an encoding it does not take; keep that layer in float (keep_fp) or at 16 bits"
                        " (keep_a16w16), or quantize with the other engine (quantizer)")


def compile_onnx(src: Path, out_dir: Path, name: str, soc: Soc, what: str = "") -> dict:
    """Compile ``src`` into ``out_dir/<name>_ctx.onnx`` + ``<name>_ctx_qnn.bin`` for ``soc``.

    :return: the manifest fields (files, graphs, inputs/outputs, QNN version, SoC, arch, compile time).
    """
    what = what or name
    ctx = out_dir / f"{name}_ctx.onnx"
    t0 = time.perf_counter()
    log: list[str] = []
    try:
        ort, so = session_options(soc, context_path=ctx)
        with native_log(log):
            ort.InferenceSession(str(src), so)
    except BackendError:
        raise
    except Exception as exc:
        refused = refused_node("".join(log), what, soc)
        if refused is not None:
            raise refused from None
        rejected = unsupported_nodes(src, soc)
        if rejected:
            raise BackendError(
                f"QNN HTP ({soc.name}/{soc.arch}) rejects {what}: unsupported op(s) {', '.join(rejected[:5])}"
                f"{' ...' if len(rejected) > 5 else ''}; CPU fallback is disabled"
            ) from None
        raise BackendError(f"QNN HTP ({soc.name}/{soc.arch}) could not compile {what}: {_one_line(exc)}") from None
    seconds = time.perf_counter() - t0
    info = describe_ctx_onnx(ctx)
    if info["non_qnn_nodes"]:  # cannot happen with fallback disabled, but never ship a partial graph
        raise BackendError(f"{what}: nodes left off QNN: {', '.join(info['non_qnn_nodes'][:5])}")
    if not info["binaries"]:
        raise BackendError(f"{what}: onnxruntime-qnn wrote no context binary next to {ctx.name}")
    for b in info["binaries"]:
        if not (out_dir / b).is_file():
            raise BackendError(f"{what}: context binary {b} is missing after compile")
    return {
        "files": [ctx.name, *info["binaries"]],
        "graphs": info["graphs"],
        "inputs": info["inputs"],
        "outputs": info["outputs"],
        "ep_sdk_version": info["ep_sdk_version"],
        "qnn_version": qnn_version(),
        "soc": soc.name,
        "soc_model": soc.soc_model,
        "arch": soc.arch,
        "compile_s": round(seconds, 3),
        "binary_bytes": {b: (out_dir / b).stat().st_size for b in info["binaries"]},
    }


def _version_tuple(v: str | None) -> tuple[int, ...]:
    nums = re.findall(r"\d+", v or "")
    return tuple(int(n) for n in nums[:3])


def check_binary(manifest: dict, ctx_path: Path, soc: Soc, what: str) -> None:
    """Refuse a context binary made for another SoC or a newer QNN than the runtime here (clear errors).

    The HTP emulator happily runs a binary built for another SoC; a phone does not (context error 5000/5005),
    so the check is made on the host, from the manifest and the EPContext node's SDK version.
    """
    made_for = manifest.get("soc")
    if made_for and made_for != soc.name:
        raise BackendError(
            f"{what}: the context binary was built for {made_for}/{manifest.get('arch')} but the target is"
            f" {soc.name}/{soc.arch}; compile again with --soc {soc.name.lower()}"
        )
    info = describe_ctx_onnx(ctx_path)
    built = info["ep_sdk_version"] or manifest.get("ep_sdk_version")
    here = qnn_version()
    if built and _version_tuple(built)[:2] > _version_tuple(here)[:2]:
        raise BackendError(
            f"{what}: the context binary was built with QNN {built.lstrip('v')} but this runtime is QNN {here};"
            " a binary loads only on the same QNN version or newer: upgrade onnxruntime-qnn or recompile (--rebuild)"
        )
    if info["non_qnn_nodes"]:
        raise BackendError(f"{what}: {', '.join(info['non_qnn_nodes'][:5])} would not run on QNN")


class HtpSession:
    """A loaded context binary: an onnxruntime session on the QNN EP with CPU fallback disabled."""

    def __init__(self, ctx_path: Path, soc: Soc, what: str):
        self.what = what
        self.path = Path(ctx_path)
        t0 = time.perf_counter()
        try:
            ort, so = session_options(soc)
            with stdout_to_stderr():
                self.sess = ort.InferenceSession(str(ctx_path), so)
        except BackendError:
            raise
        except Exception as exc:
            msg = _one_line(exc)
            hint = ""
            if re.search(r"\b500[05]\b|INVALID_ARGUMENT|context", msg, re.I):
                hint = " (QNN context errors 5000/5005 mean a SoC or QAIRT version mismatch)"
            raise BackendError(f"{what}: QNN could not load {Path(ctx_path).name}: {msg}{hint}") from None
        self.load_s = time.perf_counter() - t0
        self.inputs = {i.name: (tuple(i.shape), ONNX_DTYPES.get(i.type, i.type)) for i in self.sess.get_inputs()}
        self.outputs = [o.name for o in self.sess.get_outputs()]
        # placement check: the compiled model must be EPContext nodes only (fallback is disabled as well)
        stray = describe_ctx_onnx(self.path)["non_qnn_nodes"]
        if stray:
            raise BackendError(f"{what}: {', '.join(stray[:5])} not on QNN")

    def run(self, feeds: dict) -> dict:
        try:
            outs = self.sess.run(self.outputs, feeds)
        except Exception as exc:
            raise BackendError(f"{self.what}: QNN HTP run failed: {_one_line(exc)}") from None
        return dict(zip(self.outputs, outs))


def htp_backend_loads() -> tuple[bool, str]:
    """Whether libQnnHtp.so from onnxruntime-qnn loads (for doctor; quick, no compiling)."""
    import ctypes

    try:
        import onnxruntime_qnn

        path = onnxruntime_qnn.get_qnn_htp_path()
        lib = ctypes.CDLL(path)
        ok = hasattr(lib, "QnnInterface_getProviders")
        return ok, path if ok else f"{path} has no QnnInterface_getProviders"
    except Exception as exc:
        return False, _one_line(exc)


def np_dtype(name: str):
    return np.dtype(name)

