"""The opset onnxruntime's quantizer wants, reached without loading the graph's weights.

``quantize_static`` raises a graph below opset 21 to 21 when the recipe has 16-bit activations (every a16 recipe:
w8a16, w4a16, a16w8) by ``onnx.version_converter.convert_version`` over the whole model, weights included, then
copies the result twice more (a deep copy to re-run shape inference, another for calibration). For a big graph
that conversion is the quantization's peak: a 1.5B lm_head (0.93 GB of float32) went from 1.4 to 5.4 GB inside
it, about four copies of the weights (profiled; issue 32: at 7B the same step alone passes 14 GB).

The conversion changes nodes and attributes, never an initializer's bytes, so `at_quantizer_opset` converts the
weightless proto (its initializers stay references into the same external-data file) and hands onnxruntime a
graph already at the target: it then loads the weights once and converts nothing. The target is onnxruntime's own
decision (`target_opset` asks `update_opset_version` about an empty graph with the same opsets), so the graph it
quantizes is the one it would have made (tests/test_memory.py: the same QDQ bytes).
"""

from __future__ import annotations

import shutil
from contextlib import contextmanager
from pathlib import Path


def target_opset(proto, config) -> int:
    """The default-domain opset onnxruntime's ``quantize_static`` would convert ``proto`` to under ``config`` (a
    ``StaticQuantConfig``): its ``update_opset_version`` applied to an empty graph with ``proto``'s opsets. (It
    warns through the root logger that it converts; the quantizer's caller has that logger at ERROR.)"""
    import onnx
    from onnxruntime.quantization.quant_utils import get_opset_version, update_opset_version

    stub = onnx.helper.make_model(onnx.helper.make_graph([], "opset-probe", [], []),
                                  opset_imports=list(proto.opset_import), ir_version=proto.ir_version)
    extra = config.extra_options or {}
    return get_opset_version(update_opset_version(stub, config.weight_type, config.activation_type,
                                                  tensor_quant_overrides=extra.get("TensorQuantOverrides"),
                                                  block_size=extra.get("BlockSize", 0)))


@contextmanager
def at_quantizer_opset(model_in: Path, proto, config, work: Path):
    """``model_in`` (and ``proto``, it loaded without weights) at `target_opset`, as ``(path, proto)``: unchanged
    when already there, else a converted copy of the graph written in ``work`` beside the same weights (its
    external-data files copied there, as a preprocessed graph's already are), removed on exit."""
    import onnx
    from onnxruntime.quantization.quant_utils import get_opset_version

    target = target_opset(proto, config)
    if target <= get_opset_version(proto):
        yield model_in, proto
        return
    converted = onnx.version_converter.convert_version(proto, target)
    out = Path(work) / f"{model_in.stem}.opset{target}.onnx"
    made = [out]
    try:
        for init in converted.graph.initializer:
            entry = {e.key: e.value for e in init.external_data}
            if "location" not in entry:
                continue
            src, dst = model_in.parent / entry["location"], out.parent / entry["location"]
            if dst in made or (dst.exists() and dst.resolve() == src.resolve()):  # copied, or the graph is in work
                continue
            if dst.exists():
                raise FileExistsError(f"{dst} is in the way of {src.name}'s weights in the quantization's work folder")
            dst.parent.mkdir(parents=True, exist_ok=True)
            made.append(dst)
            shutil.copyfile(src, dst)  # not a link: onnx refuses to load data through one ("hardlink attack")
        onnx.save(converted, str(out))
        yield out, converted
    finally:
        for f in made:
            f.unlink(missing_ok=True)
