"""Graph inputs that onnxruntime's QDQ quantizer leaves in float, quantized where they enter a ``Where``.

The parts form zeroes the past KV slots the mask hides before use (`vlmrun_ort_reference.decoder_parts`:
``Where(seen, past_key_in, 0)``). A ``Where`` gets QDQ inputs from onnxruntime only when its data inputs are
already quantized, and a graph input is not: the past keys and values then reach the HTP in float32, the
``Where`` runs in float and its output is quantized on every call. On the v79 emulator that float-to-uint16
``QuantizeLinear`` of the whole past ([KV, 1, D, C-AR]) took 92% of an AR-1 call (0.67 s of 0.72 s at context
512; QNN's detailed profile), and the quantized AR-1 graph ran 5-7 times slower than the fp16 one.

`quantize_where_inputs` quantizes such an input at the encoding of the ``Where``'s own output (the ``Where``
passes its data input through or gives 0, which every encoding holds exactly), so the KV cache enters the graph
quantized, as a phone runtime feeds it. Measured on the tiny model at w8a16: an answer on the emulator 22.4 ->
8.4 s (AR-1 calls about 5x faster), the same 20 greedy tokens, the prompt graph's logits unchanged, the token
graph's within 0.032 of logits up to 20 (the conversion now happens on the float32 input, not after a float
``Where`` on the HTP), logits SQNR against the reference 28.2 -> 28.1 dB.
"""

from __future__ import annotations

from pathlib import Path


def quantize_where_inputs(path: Path) -> list[str]:
    """Rewrite the QDQ model at ``path`` in place: every float graph input that feeds a ``Where`` whose output
    goes only to a ``QuantizeLinear`` is quantized and dequantized at that output's scale and zero point before
    the ``Where``; an input that feeds several such ``Where`` gets one pair per encoding. Returns the inputs
    rewritten (none: the file is left untouched). Weights stored as external data stay where they are."""
    import onnx
    from onnx import helper

    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    inputs = {i.name for i in graph.input}
    consumers: dict[str, list] = {}
    for node in graph.node:
        for name in node.input:
            consumers.setdefault(name, []).append(node)
    added: list = []
    made: dict[tuple, str] = {}  # (input, scale, zero point, axis) -> its dequantized tensor: one pair per encoding
    for node in graph.node:
        if node.op_type != "Where":
            continue
        after = consumers.get(node.output[0], [])
        if len(after) != 1 or after[0].op_type != "QuantizeLinear" or len(after[0].input) < 3:
            continue
        scale, zero_point = after[0].input[1], after[0].input[2]
        axis = [a for a in after[0].attribute if a.name == "axis"]
        for k in (1, 2):
            name = node.input[k]
            if name not in inputs:
                continue
            key = (name, scale, zero_point, tuple(a.i for a in axis))
            if key not in made:
                earlier = sum(other[0] == name for other in made)  # pairs this input already has
                tag = f"{name}_{earlier}" if earlier else name
                q, dq = f"{tag}_QuantizeLinear", f"{tag}_DequantizeLinear"
                quantize = helper.make_node("QuantizeLinear", [name, scale, zero_point], [f"{q}_Output"], name=q)
                dequantize = helper.make_node("DequantizeLinear", [f"{q}_Output", scale, zero_point],
                                              [f"{dq}_Output"], name=dq)
                for n in (quantize, dequantize):
                    n.attribute.extend(axis)
                added += [quantize, dequantize]
                made[key] = f"{dq}_Output"
            node.input[k] = made[key]
    if not made:
        return []
    for n in reversed(added):  # graph inputs and initializers only: they go first, in topological order
        graph.node.insert(0, n)
    onnx.save(model, str(path))
    return list(dict.fromkeys(key[0] for key in made))
