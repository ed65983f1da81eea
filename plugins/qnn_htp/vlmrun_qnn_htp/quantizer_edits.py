"""onnxruntime's QDQ quantizer renames a tensor in every node of the graph once per tensor it quantizes.

``ONNXModel.replace_input_of_all_nodes`` (and ``..._output_...``) visit every node and, in Python, every input of
it for each tensor quantized: quadratic in the graph's size, with a Python-level step per node input. On the tiny
model's w4a16 decoder (3 graphs, 1068 renames, 862k node visits) that was 1.96 of the quantizer's 7.3 s (cProfile).
`graph_edits_in_c` swaps them, while it is open, for versions that ask each node whether it names the tensor at
all (``name in node.input``: one membership test in protobuf's C code) and rename only where it does, with
onnxruntime's own ``replace_node_input``/``replace_node_output``: the same nodes get the same names in the same
order, so the quantized graph is the same to the byte (tests/test_quantizer.py).
"""

from __future__ import annotations

from contextlib import contextmanager


def _replace_input_of_all_nodes(self, old_input_name, new_input_name):
    from onnxruntime.quantization.onnx_model import ONNXModel

    assert isinstance(old_input_name, str) and isinstance(new_input_name, str)
    for node in self.model.graph.node:
        if old_input_name in node.input:
            ONNXModel.replace_node_input(node, old_input_name, new_input_name)


def _replace_output_of_all_nodes(self, old_output_name, new_output_name):
    from onnxruntime.quantization.onnx_model import ONNXModel

    assert isinstance(old_output_name, str) and isinstance(new_output_name, str)
    for node in self.model.graph.node:
        if old_output_name in node.output:
            ONNXModel.replace_node_output(node, old_output_name, new_output_name)


@contextmanager
def graph_edits_in_c():
    """onnxruntime's ``ONNXModel`` renames done through a C membership test per node while the block runs."""
    from onnxruntime.quantization.onnx_model import ONNXModel

    saved = ONNXModel.replace_input_of_all_nodes, ONNXModel.replace_output_of_all_nodes
    ONNXModel.replace_input_of_all_nodes = _replace_input_of_all_nodes
    ONNXModel.replace_output_of_all_nodes = _replace_output_of_all_nodes
    try:
        yield
    finally:
        ONNXModel.replace_input_of_all_nodes, ONNXModel.replace_output_of_all_nodes = saved
