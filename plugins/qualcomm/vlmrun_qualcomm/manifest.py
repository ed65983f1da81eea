"""The QNN context-binary artifact: its files and its manifest, one format for every Qualcomm plugin.

A compiled stage is a directory in vlmrun's artifact store holding

* ``<name>_ctx.onnx``: an EP-context ONNX wrapper, one ``com.microsoft:EPContext`` node per graph (embed mode 0,
  ``ep_cache_context`` = the binary next to it), which is how onnxruntime-qnn loads a context binary;
* ``<name>_ctx_qnn.bin``: the QNN context binary itself (what ``qnn-net-run --retrieve_context`` and Genie load);
* ``manifest.json`` with the fields of `ContextManifest`.

``qnn_htp`` writes it when it compiles locally (onnxruntime-qnn writes the wrapper), ``qaihub`` when it
downloads a binary from AI Hub (`write_ctx_onnx` writes the wrapper), and ``qnn_htp`` reads it to run the
stage, whoever compiled it.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np

from vlmrun.errors import BackendError

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


def describe_ctx_onnx(path: Path) -> dict:
    """Graph names, binary files, SDK version and I/O of an EP-context ONNX (no weights to load)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    graphs, files, sdk, others = [], [], set(), []
    for node in model.graph.node:
        if node.op_type != "EPContext":
            others.append(f"{node.op_type} (node {node.name or '?'})")
            continue
        attrs_ = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        dec = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in attrs_.items() if k != "notes"}
        graphs.append(dec.get("partition_name") or node.name)
        if dec.get("ep_cache_context") and int(dec.get("embed_mode", 1)) == 0:
            files.append(dec["ep_cache_context"])
        if dec.get("ep_sdk_version"):
            sdk.add(dec["ep_sdk_version"])
    io = onnx_io(path)
    return {
        "graphs": graphs,
        "binaries": sorted(set(files)),
        "ep_sdk_version": sorted(sdk)[0] if sdk else None,
        "non_qnn_nodes": others,
        "inputs": io["inputs"],
        "outputs": io["outputs"],
    }


def _tensors(value) -> list[dict]:
    return [dict(t) for t in (value or [])]


@attrs.define(kw_only=True)
class ContextManifest:
    """The manifest of a QNN context-binary artifact (what ``manifest.json`` holds besides the store's own keys).

    ``inputs``/``outputs`` are ``{"name", "shape", "dtype"}`` dicts, with ``"quant": {"scale", "offset"}`` on a
    quantized tensor (QNN's convention ``float = (q + offset) * scale``). ``extra`` holds what one compiler
    records of its own (quantization facts, an AI Hub job) and is written at the top level of the manifest.
    """

    files: list[str]  # the wrapper first, then the binaries
    graphs: list[str]
    inputs: list[dict] = attrs.field(converter=_tensors)
    outputs: list[dict] = attrs.field(converter=_tensors)
    stage: str
    precision: str
    compiler: str  # the plugin that compiled it (qnn_htp, qaihub, ...)
    qnn_version: str | None = None  # the QNN that built the binary (a runtime loads it only if it is as new)
    ep_sdk_version: str | None = None
    soc: str | None = None
    soc_model: int | None = None
    arch: str | None = None
    source_form: str = ""
    compile_s: float = 0.0
    binary_bytes: dict[str, int] = attrs.field(factory=dict)
    io_quant: dict[str, dict] = attrs.field(factory=dict)
    fallback: str = "disabled"
    target: str = "qnn_htp"
    extra: dict = attrs.field(factory=dict)

    REQUIRED = ("files", "graphs", "inputs", "outputs", "stage", "precision")

    def __attrs_post_init__(self):
        if not self.io_quant:
            self.io_quant = {t["name"]: t["quant"] for t in (*self.inputs, *self.outputs) if "quant" in t}

    @property
    def wrapper(self) -> str:
        return self.files[0]

    @property
    def binaries(self) -> list[str]:
        return [f for f in self.files if f.endswith(".bin")]

    def to_dict(self) -> dict:
        d = attrs.asdict(self, filter=lambda a, _: a.name != "extra")
        return {**self.extra, **d}

    @classmethod
    def from_dict(cls, manifest: dict, what: str = "artifact") -> "ContextManifest":
        """Read a stored manifest; a BackendError naming the artifact when it is not a QNN context artifact."""
        missing = [k for k in cls.REQUIRED if k not in manifest]
        if missing:
            raise BackendError(f"{what} is not a QNN context-binary artifact (manifest lacks {', '.join(missing)});"
                               " compile it again with --rebuild")
        names = {a.name for a in attrs.fields(cls)}
        known = {k: v for k, v in manifest.items() if k in names and k != "extra"}
        extra = {k: v for k, v in manifest.items() if k not in names}
        known.setdefault("compiler", "qnn_htp")
        return cls(**known, extra=extra)
