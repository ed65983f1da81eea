"""Compile a stage with the QAIRT SDK's own tools (qnn_htp option ``toolchain = "sdk"``), so that the context
binary carries the SDK's QNN version and loads on a phone that runs that SDK's ``libQnnHtp.so``.

Never the default: onnxruntime-qnn (`.ep`) compiles unless ``toolchain = "sdk"`` is asked for. The SDK is
the one of the ``sdk_root`` option / ``$QAIRT_SDK_ROOT`` (the same that ``--target android`` pushes), its tools
run in the environment its ``bin/envsetup.sh`` sets (`vlmrun_qualcomm.sdk.Sdk.env`)::

    qnn-onnx-converter --input_network stage.onnx -o work/NAME.cpp --preserve_io [--float_bitwidth 16]
        [--input_list calib.txt --act_bitwidth 8|16 --weights_bitwidth 8 --bias_bitwidth 32
         --use_per_channel_quantization]
    qnn-model-lib-generator -c work/NAME.cpp -b work/NAME.bin -o work/libs -t x86_64-linux-clang -l NAME
    qnn-context-binary-generator --backend SDK/lib/x86_64-linux-clang/libQnnHtp.so
        --model work/libs/x86_64-linux-clang/libNAME.so --binary_file NAME_ctx_qnn --output_dir work/ctx
        --config_file work/htp_wrapper.json
    qnn-context-binary-utility --context_binary work/ctx/NAME_ctx_qnn.bin --json_file work/ctx_info.json

``htp_wrapper.json`` names ``libQnnHtpNetRunExtensions.so`` and ``htp.json`` (graph NAME, the SoC's soc_model and
dsp_arch, O3, 8 MB VTCM, fp16 relaxed precision for float graphs). ``--preserve_io`` keeps the graph's inputs and
outputs in the ONNX layout and float type, so a quantized graph still takes and returns float32. The artifact is
the same as onnxruntime-qnn's: the ``.bin``, an EPContext wrapper naming it (written here) and the manifest, whose
``qnn_version`` is the SDK's.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np

from vlmrun import procs
from vlmrun.errors import BackendError

from vlmrun_qualcomm.manifest import onnx_io, write_ctx_onnx
from vlmrun_qualcomm.sdk import HOST, Sdk
from vlmrun_qualcomm.socs import Soc

TOOL_TIMEOUT = 3600.0
QNN_DTYPES = {
    "QNN_DATATYPE_FLOAT_32": "float32", "QNN_DATATYPE_FLOAT_16": "float16",
    "QNN_DATATYPE_INT_8": "int8", "QNN_DATATYPE_INT_16": "int16", "QNN_DATATYPE_INT_32": "int32",
    "QNN_DATATYPE_INT_64": "int64", "QNN_DATATYPE_UINT_8": "uint8", "QNN_DATATYPE_UINT_16": "uint16",
    "QNN_DATATYPE_UINT_32": "uint32", "QNN_DATATYPE_BOOL_8": "bool",
    "QNN_DATATYPE_UFIXED_POINT_8": "uint8", "QNN_DATATYPE_UFIXED_POINT_16": "uint16",
    "QNN_DATATYPE_SFIXED_POINT_8": "int8", "QNN_DATATYPE_SFIXED_POINT_16": "int16",
}
ACT_BITS = {"int8": "8", "a16w8": "16"}


def converter_argv(tool: Path, src: Path, cpp: Path, precision: str, input_list: Path | None) -> list[str]:
    argv = [str(tool), "--input_network", str(src), "-o", str(cpp), "--preserve_io"]
    if precision == "fp16":
        argv += ["--float_bitwidth", "16"]
    else:
        argv += ["--input_list", str(input_list), "--act_bitwidth", ACT_BITS[precision], "--weights_bitwidth", "8",
                 "--bias_bitwidth", "32", "--use_per_channel_quantization"]
    return argv


def htp_config(name: str, soc: Soc, precision: str) -> dict:
    graph = {"graph_names": [name], "vtcm_mb": 8, "O": 3}
    if precision == "fp16":
        graph["fp16_relaxed_precision"] = 1
    return {"graphs": [graph], "devices": [{"soc_model": soc.soc_model, "dsp_arch": soc.arch}]}


def _run(argv: list[str], sdk: Sdk, what: str, cwd: Path) -> None:
    res = procs.run(argv, timeout=TOOL_TIMEOUT, what=what, cwd=cwd, env=sdk.env())
    if res.returncode != 0:
        lines = [ln.strip() for ln in (res.stderr + "\n" + res.stdout).splitlines() if ln.strip()]
        err = next((ln for ln in reversed(lines) if "error" in ln.lower()), lines[-1] if lines else "no message")
        raise BackendError(f"{what} failed (exit {res.returncode}): {err[:300]}")


def _tensor(t: dict) -> dict:
    info = t.get("info", t)
    dtype = QNN_DTYPES.get(str(info.get("dataType")), None)
    if dtype is None:
        raise BackendError(f"qnn-context-binary-utility reported tensor {info.get('name')} with unknown type"
                           f" {info.get('dataType')}")
    out = {"name": info["name"], "shape": [int(d) for d in info.get("dimensions", [])], "dtype": dtype}
    if "FIXED_POINT" in str(info.get("dataType")):
        so = (info.get("quantizeParams") or {}).get("scaleOffset") or {}
        out["quant"] = {"scale": float(so.get("scale", 0.0)), "offset": int(so.get("offset", 0)), "dtype": dtype}
    return out


def read_context_info(path: Path) -> list[dict]:
    """Graphs of a ``qnn-context-binary-utility`` JSON: [{"name", "inputs", "outputs"}]."""
    data = json.loads(path.read_text())
    graphs = (data.get("info") or {}).get("graphs") or data.get("graphs") or []
    out = []
    for g in graphs:
        info = g.get("info", g)
        out.append({"name": info["graphName"], "inputs": [_tensor(t) for t in info.get("graphInputs", [])],
                    "outputs": [_tensor(t) for t in info.get("graphOutputs", [])]})
    if not out:
        raise BackendError(f"qnn-context-binary-utility found no graph in the context binary ({path.name})")
    return out


def write_input_list(feeds: list[dict], work: Path) -> Path:
    """Calibration samples as raw float32 files and the converter's ``--input_list`` (one line per sample)."""
    d = work / "calibration"
    d.mkdir()
    lines = []
    for i, sample in enumerate(feeds):
        pairs = []
        for name, value in sample.items():
            f = d / f"{i:04d}_{name}.raw"
            np.ascontiguousarray(value, dtype=np.float32).tofile(f)
            pairs.append(f"{name}:={f}")
        lines.append(" ".join(pairs))
    (work / "input_list.txt").write_text("\n".join(lines) + "\n")
    return work / "input_list.txt"


def compile_onnx_sdk(src: Path, out_dir: Path, name: str, soc: Soc, precision: str, sdk: Sdk, work: Path,
                     calibration: list[dict] | None = None, what: str = "") -> dict:
    """Compile ``src`` with the SDK's tools into ``out_dir/<name>_ctx_qnn.bin`` + its EPContext wrapper.

    :return: the manifest fields (as `vlmrun_qnn_htp.ep.compile_onnx`), ``qnn_version`` = the SDK's.
    """
    what = what or name
    tools = sdk.require_compile_tools()
    version = sdk.version()
    if not version:
        raise BackendError(f"cannot read the QNN version of the SDK at {sdk.root} (no sdk.yaml): the binaries it"
                           " makes must record it; use a complete QAIRT SDK")
    t0 = time.perf_counter()
    input_list = write_input_list(calibration or [], work) if precision != "fp16" else None
    if precision != "fp16" and not calibration:
        raise BackendError(f"{what}: {precision} with the SDK's tools needs calibration samples")
    cpp = work / f"{name}.cpp"
    argvs = [converter_argv(tools["qnn-onnx-converter"], src, cpp, precision, input_list)]
    _run(argvs[-1], sdk, f"qnn-onnx-converter ({what})", work)
    for produced in (cpp, cpp.with_suffix(".bin")):
        if not produced.is_file():
            raise BackendError(f"qnn-onnx-converter ({what}) exited 0 but wrote no {produced.name}")
    argvs.append([str(tools["qnn-model-lib-generator"]), "-c", str(cpp), "-b", str(cpp.with_suffix(".bin")),
                  "-o", str(work / "libs"), "-t", HOST, "-l", name])
    _run(argvs[-1], sdk, f"qnn-model-lib-generator ({what})", work)
    lib = work / "libs" / HOST / f"lib{name}.so"
    if not lib.is_file():
        raise BackendError(f"qnn-model-lib-generator ({what}) exited 0 but wrote no {lib.relative_to(work)}")
    (work / "htp.json").write_text(json.dumps(htp_config(name, soc, precision), indent=1))
    (work / "htp_wrapper.json").write_text(json.dumps({"backend_extensions": {
        "shared_library_path": str(tools["libQnnHtpNetRunExtensions.so"]),
        "config_file_path": str(work / "htp.json")}}, indent=1))
    bin_name = f"{name}_ctx_qnn.bin"
    argvs.append([str(tools["qnn-context-binary-generator"]), "--backend", str(tools["libQnnHtp.so"]),
                  "--model", str(lib), "--binary_file", bin_name[: -len(".bin")], "--output_dir", str(work / "ctx"),
                  "--config_file", str(work / "htp_wrapper.json")])
    _run(argvs[-1], sdk, f"qnn-context-binary-generator ({what})", work)
    made = work / "ctx" / bin_name
    if not made.is_file():
        raise BackendError(f"qnn-context-binary-generator ({what}) exited 0 but wrote no {bin_name}")
    argvs.append([str(tools["qnn-context-binary-utility"]), "--context_binary", str(made),
                  "--json_file", str(work / "ctx_info.json")])
    _run(argvs[-1], sdk, f"qnn-context-binary-utility ({what})", work)
    graphs = read_context_info(work / "ctx_info.json")
    if len(graphs) != 1:
        raise BackendError(f"{what}: the SDK's context binary holds {len(graphs)} graphs, expected one")
    g = graphs[0]
    shutil.copy(made, out_dir / bin_name)
    src_io = onnx_io(src)
    names_in = {t["name"] for t in src_io["inputs"]}
    names_out = {t["name"] for t in src_io["outputs"]}
    if {t["name"] for t in g["inputs"]} != names_in or {t["name"] for t in g["outputs"]} != names_out:
        raise BackendError(f"{what}: the SDK's graph I/O ({[t['name'] for t in g['inputs']]} ->"
                           f" {[t['name'] for t in g['outputs']]}) is not the stage's ONNX I/O")
    ctx_name = f"{name}_ctx.onnx"
    sdk_tag = f"v{version}"
    write_ctx_onnx(out_dir / ctx_name, bin_name, g["inputs"], g["outputs"], graph_name=g["name"], sdk_version=sdk_tag)
    root = str(sdk.root)
    return {
        "files": [ctx_name, bin_name],
        "graphs": [g["name"]],
        "inputs": g["inputs"],
        "outputs": g["outputs"],
        "ep_sdk_version": sdk_tag,
        "qnn_version": version,
        "soc": soc.name,
        "soc_model": soc.soc_model,
        "arch": soc.arch,
        "compile_s": round(time.perf_counter() - t0, 3),
        "binary_bytes": {bin_name: (out_dir / bin_name).stat().st_size},
        "toolchain": {"name": "sdk", "sdk_root": root, "qnn_version": version,
                      "argv": [[Path(a).name if a.startswith(root) else a.replace(str(work), "<work>") for a in argv]
                               for argv in argvs]},
    }
