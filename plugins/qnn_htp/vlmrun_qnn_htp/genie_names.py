"""Genie's names for the decoder's part binaries and graphs, written into what onnxruntime-qnn compiled.

onnxruntime-qnn names graphs after its fused nodes (``QNNExecutionProvider_QNNExecutionProvider_<hash>_<id>_0``;
``ep.context_node_name_prefix`` does not change them) and Genie orders the parts of one (AR, CL) by a
``_<k>_of_<P>`` suffix, so the names are rewritten in the binary (`rename_graph`, same length:
`genie_name`) and in the EPContext wrapper that points at it (`rewrite_wrapper`).
"""

from __future__ import annotations

import re
from pathlib import Path

from vlmrun.errors import BackendError


def rename_graph(binary: Path, old: str, new: str) -> int:
    """Rename QNN graph ``old`` to ``new`` inside a context binary, in place; returns the occurrences replaced.

    onnxruntime-qnn names graphs after its fused nodes (``QNNExecutionProvider_QNNExecutionProvider_<hash>_<id>_0``,
    ``ep.context_node_name_prefix`` does not change them) and Genie orders the parts of a model by a
    ``_<k>_of_<P>`` suffix, so the names are rewritten. The binary stores each name as a length-prefixed string;
    ``new`` must have the same length (see `genie_name`)."""
    if len(new) != len(old):
        raise ValueError(f"graph name {new!r} must have the length of {old!r}")
    data = binary.read_bytes()
    n = data.count(old.encode())
    if n == 0:
        raise BackendError(f"{binary.name}: graph {old} not found in the context binary")
    binary.write_bytes(data.replace(old.encode(), new.encode()))
    return n


def genie_name(base: str, old: str) -> str:
    """``base`` (``prompt_ar128_cl1024_1_of_2``) padded to the length of ``old`` before its ``_k_of_P`` suffix."""
    m = re.match(r"(.*)(_\d+_of_\d+)$", base)
    head, tail = m.group(1), m.group(2)
    fill = len(old) - len(head) - len(tail)
    if fill < 1:
        raise BackendError(f"graph name {old} is too short to rename to {base}")
    return head + "_" + "0" * (fill - 1) + tail


def rewrite_wrapper(path: Path, graph: str, binary: str) -> None:
    """Point the EPContext node of ``path`` at ``binary`` under the graph name ``graph``."""
    import onnx

    m = onnx.load(str(path))
    node = next(n for n in m.graph.node if n.op_type == "EPContext")
    node.name = graph
    for a in node.attribute:
        if a.name == "partition_name":
            a.s = graph.encode()
        elif a.name == "ep_cache_context":
            a.s = binary.encode()
    onnx.save(m, str(path))
