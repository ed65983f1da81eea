"""The EP-context ONNX that lets onnxruntime-qnn load a raw QNN context binary from AI Hub.

onnxruntime-qnn runs a context binary through an ONNX wrapper: one ``com.microsoft:EPContext`` node (embed
mode 0, ``ep_cache_context`` = the ``.bin`` file next to it) with the graph's inputs and outputs. qnn_htp
writes the same shape of file when it compiles locally (``<name>_ctx.onnx`` + ``<name>_ctx_qnn.bin``), so a
binary from the hub is loaded by qnn_htp exactly like its own.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

ORT_IR_VERSION = 10  # onnxruntime 1.31 refuses IR 14, which onnx 1.23 writes by default


def onnx_io(path: Path) -> dict:
    """Inputs and outputs (name, shape, dtype) of an ONNX file, without loading external weights."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    init = {t.name for t in model.graph.initializer}

    def io(values):
        out = []
        for v in values:
            if v.name in init:
                continue
            t = v.type.tensor_type
            shape = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in t.shape.dim]
            out.append({"name": v.name, "shape": shape,
                        "dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name})
        return out

    return {"inputs": io(model.graph.input), "outputs": io(model.graph.output)}


def write_ctx_onnx(path: Path, binary_name: str, inputs: list[dict], outputs: list[dict], *,
                   graph_name: str, sdk_version: str | None) -> None:
    """Write ``path``: one EPContext node over ``binary_name`` (a file in the same directory)."""
    import onnx
    from onnx import helper

    def vi(t):
        elem = helper.np_dtype_to_tensor_dtype(np.dtype(t["dtype"]))
        return helper.make_tensor_value_info(t["name"], elem, list(t["shape"]))

    attrs = dict(main_context=1, ep_cache_context=binary_name, embed_mode=0, source="QNNExecutionProvider",
                 partition_name=graph_name)
    if sdk_version:
        attrs["ep_sdk_version"] = sdk_version
    node = helper.make_node("EPContext", [t["name"] for t in inputs], [t["name"] for t in outputs],
                            name=f"{graph_name}_ctx", domain="com.microsoft", **attrs)
    graph = helper.make_graph([node], graph_name, [vi(t) for t in inputs], [vi(t) for t in outputs])
    model = helper.make_model(graph, ir_version=ORT_IR_VERSION, producer_name="vlmrun-qaihub",
                              opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    onnx.save(model, str(path))
