"""The files an ONNX graph is made of: the graph, and the external data files its tensors name.

A graph above 2 GiB (or big enough that it is better so) keeps its weights outside the protobuf, in files named by
each tensor's ``location``, relative to the graph's folder. Most writers put them in ``<graph>.onnx.data``; the
decoder parts' export puts the weights of all of a part's graphs in one file they share (each tensor stored once:
``vlmrun_ort_reference.part_weights``). Whoever hashes, measures, copies or uploads a graph asks `graph_files`
which files it needs instead of guessing from its name.
"""

from __future__ import annotations

from pathlib import Path

#: a graph file at least this big holds its weights itself (it is not parsed to look for external data)
INLINE_GRAPH_BYTES = 64 << 20


def tensors(graph):
    """``(tensor, is an initializer)`` of every tensor stored in ``graph`` (an ONNX ``GraphProto``): initializers
    and the values of Constant (and other) node attributes, subgraphs included."""
    for t in graph.initializer:
        yield t, True
    for node in graph.node:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t, False
            for t in attr.tensors:
                yield t, False
            if attr.HasField("g"):
                yield from tensors(attr.g)
            for sub in attr.graphs:
                yield from tensors(sub)


def graph_files(path: str | Path) -> list[Path]:
    """``path`` and the external data files its tensors name, in the order first named (``<graph>.onnx.data``
    beside it is taken as its one data file without reading the graph)."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo

    path = Path(path)
    own = path.parent / (path.name + ".data")
    if own.is_file():
        return [path, own]
    if path.stat().st_size >= INLINE_GRAPH_BYTES:
        return [path]
    proto = onnx.load(str(path), load_external_data=False)
    names = dict.fromkeys(ExternalDataInfo(t).location for t, _ in tensors(proto.graph)
                          if t.data_location == onnx.TensorProto.EXTERNAL)
    return [path, *(path.parent / n for n in names)]
