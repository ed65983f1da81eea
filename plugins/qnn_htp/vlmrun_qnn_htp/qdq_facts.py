"""What a QDQ model holds, read back from the file: the graph I/O encodings (`io_quant`, which the manifest and
the engines use to feed and read a compiled graph) and the dtypes it really stores per class of tensor
(`stored_dtypes`, the manifest's ``quantization.stored``). Read-only: nothing here changes a model."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def io_quant(path: Path) -> dict:
    """Scale/offset (QNN convention, offset = -zero_point) of the Q/DQ pairs at the graph inputs and outputs."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(path), load_external_data=False)
    vals = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer if not _external(i)}
    for n in m.graph.node:
        if n.op_type == "Constant":
            vals[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    ins = {i.name for i in m.graph.input}
    outs = {o.name for o in m.graph.output}
    result = {}
    for n in m.graph.node:
        if n.op_type == "QuantizeLinear" and n.input[0] in ins:
            name = n.input[0]
        elif n.op_type == "DequantizeLinear" and n.output[0] in outs:
            name = n.output[0]
        else:
            continue
        scale = vals.get(n.input[1])
        zp = vals.get(n.input[2]) if len(n.input) > 2 else None
        if scale is None or np.size(scale) != 1:
            continue
        dtype = zp.dtype.name if zp is not None else "uint8"
        result[name] = {"scale": float(scale), "offset": -int(zp) if zp is not None else 0, "dtype": dtype}
    return result


def _external(init) -> bool:
    import onnx

    return init.data_location == onnx.TensorProto.EXTERNAL


#: tensor classes of `stored_dtypes`
WEIGHT_OPS = {"MatMul": 1, "Gemm": 1, "Conv": 1, "ConvTranspose": 1}


def stored_dtypes(path: Path) -> dict:
    """What the QDQ model at ``path`` really stores, per class of tensor: ``{class: {dtype: count}}``.

    Classes: ``weights`` (the weight input of MatMul / Gemm / Conv), ``biases`` (Conv / Gemm input 2, or the
    constant added to a MatMul's output), ``norm_gains`` (constants named ``*norm*``, and LayerNormalization's
    gamma), ``other_constants``, ``activations`` (quantized tensors computed by the graph), ``io`` (the graph's
    inputs and outputs), ``float`` (constants of the compute ops left unquantized). A weight whose dequantize holds
    per-block scales (``block_size``) or whose scale is itself dequantized (LPBQ: a per-channel scale times
    integer block scales) is counted as ``<dtype> blockwise (block N)``."""
    import onnx

    m = onnx.load(str(path), load_external_data=False)
    g = m.graph
    inits = {i.name: i for i in g.initializer}
    producers = {o: n for n in g.node for o in n.output}
    consumers: dict[str, list[tuple]] = {}
    for n in g.node:
        for k, t in enumerate(n.input):
            consumers.setdefault(t, []).append((n, k))
    io = {i.name for i in g.input} | {o.name for o in g.output}
    dtype_name = {v: k.lower() for k, v in onnx.TensorProto.DataType.items()}
    out: dict[str, dict[str, int]] = {}

    def add(cls: str, dtype: str):
        out.setdefault(cls, {})
        out[cls][dtype] = out[cls].get(dtype, 0) + 1

    def final_consumers(t: str) -> list[tuple]:
        """The compute nodes a dequantized tensor reaches (through Q/DQ pairs and Casts)."""
        found, stack, seen = [], [t], set()
        while stack:
            x = stack.pop()
            for n, k in consumers.get(x, ()):
                if n.op_type in ("QuantizeLinear", "DequantizeLinear", "Cast", "Transpose", "Reshape"):
                    if n.output[0] not in seen:
                        seen.add(n.output[0])
                        stack.append(n.output[0])
                else:
                    found.append((n, k))
        return found

    def classify_constant(name: str, reach: list[tuple]) -> str:
        if any(n.op_type == "LayerNormalization" and k == 2 for n, k in reach):
            return "biases"
        if "norm" in name.lower() or any(n.op_type == "LayerNormalization" and k == 1 for n, k in reach):
            return "norm_gains"
        if any(WEIGHT_OPS.get(n.op_type) == k for n, k in reach):
            return "weights"
        if any(k == 2 and n.op_type in ("Conv", "Gemm", "ConvTranspose") for n, k in reach):
            return "biases"
        for n, k in reach:
            if n.op_type == "Add":
                other = producers.get(n.input[1 - k]) if len(n.input) == 2 else None
                if other is not None and other.op_type in ("MatMul", "DequantizeLinear", "QuantizeLinear"):
                    if other.op_type == "MatMul" or _through_qdq_from(other, producers, "MatMul"):
                        return "biases"
        return "other_constants"

    def const_source(t: str):
        """The initializer (or Constant) a tensor is, through a QuantizeLinear of a float constant."""
        if t in inits:
            return inits[t]
        p = producers.get(t)
        if p is not None and p.op_type == "QuantizeLinear" and p.input[0] in inits:
            return inits[p.input[0]]
        return None

    for n in g.node:
        if n.op_type != "DequantizeLinear":
            continue
        if all(c.op_type == "DequantizeLinear" and k == 1 for c, k in consumers.get(n.output[0], ())):
            add("block_scales", dtype_name.get(inits[n.input[0]].data_type, "?") if n.input[0] in inits else "?")
            continue  # LPBQ: the integer per-block scales of a weight, expanded from its per-channel scale
        x = n.input[0]
        src = const_source(x)
        zp_name = n.input[2] if len(n.input) > 2 else None
        if x in inits:
            dt = dtype_name.get(inits[x].data_type, "?")
        elif zp_name and zp_name in inits:
            dt = dtype_name.get(inits[zp_name].data_type, "?")
        else:
            dt = "uint8"
        if src is None:  # an activation (or a graph input / output)
            if n.output[0] in io or producers.get(x) is not None and producers[x].input[0] in io:
                add("io", dt)
            else:
                add("activations", dt)
            continue
        cls = classify_constant(src.name, final_consumers(n.output[0]))
        block = next((a.i for a in n.attribute if a.name == "block_size" and a.i), 0)
        scale_p = producers.get(n.input[1])
        if block:
            dt = f"{dt} blockwise (block {block})"
        elif scale_p is not None and scale_p.op_type in ("DequantizeLinear", "Mul"):
            dt = f"{dt} blockwise (LPBQ)"
        add(cls, dt)
    # constants of compute ops with no dequantize in front: stored as float
    for n in g.node:
        if n.op_type in ("QuantizeLinear", "DequantizeLinear"):
            continue
        for k, t in enumerate(n.input):
            if t in inits and inits[t].data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16) \
                    and np.prod(inits[t].dims or [1]) > 1:
                add("float", dtype_name[inits[t].data_type])
    return out


def _through_qdq_from(node, producers, op: str) -> bool:
    while node is not None and node.op_type in ("QuantizeLinear", "DequantizeLinear"):
        node = producers.get(node.input[0])
    return node is not None and node.op_type == op
