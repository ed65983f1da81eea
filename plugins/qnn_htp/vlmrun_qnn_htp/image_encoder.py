"""The image-encoder form (``vision/encoder``): what Genie's image-encoder node loads.

Genie's ``image-encoder`` node (the pipeline API, ``genie-app``) takes ONE context binary whose graph input is
named ``pixel_values`` and whose output ``image_features`` is already at the decoder's hidden width: FastVLM's
vision tower and projector as one graph. The image input must be a quantized tensor (UFIXED_8 / UFIXED_16):
``GenieNode_setData`` takes float32 pixels and quantizes them to the tensor's encoding. A float32 input is refused
("Unsupported input tensor pixel_values dtype QNN_DATATYPE_FLOAT_32"); an fp16 one is silently ignored (the answer
is made without the image). onnxruntime-qnn keeps float32 graph I/O even for QDQ models, so this form's input is
made quantized by hand: the graph input becomes ``uint8`` (or ``uint16``) followed by a ``DequantizeLinear``
whose scale and offset come from the checkpoint's image processor (`pixel_encoding`), and the EP compiles
that into a quantized input tensor.

* A processor that only rescales (FastVLM: ``rescale_factor`` 1/255, mean 0, std 1) is represented exactly by
  uint8 with scale = ``rescale_factor``, offset 0: the pixels ARE the 8-bit values.
* A processor that normalises (``image_mean`` / ``image_std`` other than 0 / 1) maps each channel to its own
  range, which no single 8-bit scale holds exactly: uint16 over the union of the channels' ranges, whose rounding
  error (at most half a step) is recorded in the manifest.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from vlmrun.errors import BackendError, UsageError
from vlmrun.handles import StageHandle

FORM = "vision/encoder"
INPUT, OUTPUT = "pixel_values", "image_features"


def pixel_encoding(processor: dict) -> dict:
    """The quantized encoding of ``pixel_values`` for a CLIP-style image processor config: ``dtype`` (uint8 or
    uint16), ``scale``, ``zero_point`` (value = scale * (q - zero_point)) and ``max_error`` (largest rounding error
    of a pixel value in the processor's output units; 0 when exact)."""
    rescale = float(processor.get("rescale_factor", 1 / 255)) if processor.get("do_rescale", True) else 1.0
    mean = np.asarray(processor.get("image_mean", [0.0] * 3), np.float64)
    std = np.asarray(processor.get("image_std", [1.0] * 3), np.float64)
    normalises = processor.get("do_normalize", True) and (np.any(mean != 0) or np.any(std != 1))
    if not normalises:
        return {"dtype": "uint8", "scale": rescale, "zero_point": 0, "max_error": 0.0,
                "why": f"the processor only rescales (x {rescale:g}): uint8 pixels are exact"}
    lo = float(np.min((0.0 - mean) / std))
    hi = float(np.max((255.0 * rescale - mean) / std))
    scale = (hi - lo) / 65535.0
    zp = int(round(-lo / scale))
    return {"dtype": "uint16", "scale": scale, "zero_point": zp, "max_error": scale / 2,
            "why": "the processor normalises per channel: uint16 over the channels' union range"}


def quantize_values(values: np.ndarray, enc: dict) -> np.ndarray:
    """Float values -> integers in the encoding ``enc`` (what Genie does with float32 pixels or embeddings)."""
    info = np.iinfo(enc["dtype"])
    q = np.round(np.asarray(values, np.float64) / enc["scale"]) + enc["zero_point"]
    return np.clip(q, info.min, info.max).astype(enc["dtype"])


def dequantize_values(q: np.ndarray, enc: dict) -> np.ndarray:
    """Integers in the encoding ``enc`` -> float64 values (scale * (q - zero_point))."""
    return (np.asarray(q).astype(np.float64) - enc["zero_point"]) * enc["scale"]


def write_quantized_rows(table: np.ndarray, enc: dict, out: Path, rows: int = 8192) -> float:
    """Write the float table ``table`` [N, H] (a memory map is fine) to ``out`` as raw integers in the encoding
    ``enc`` (`quantize_values`, row block by row block: the bytes of one pass over the whole table); its SQNR in
    dB. At 7B (152128 x 3584) the whole table in float64 was 4.4 GB a copy and the pass took four of them at once;
    a block of ``rows`` takes a few hundred MB."""
    signal = noise = 0.0
    with open(out, "wb") as f:
        for lo in range(0, table.shape[0], rows):
            block = np.asarray(table[lo : lo + rows], np.float32)
            q = quantize_values(block, enc)
            q.tofile(f)
            signal += float((block.astype(np.float64) ** 2).sum())
            noise += float(((block - dequantize_values(q, enc)) ** 2).sum())
    return float(10 * np.log10(signal / max(noise, 1e-30)))


def with_quantized_input(src: Path, dst: Path, enc: dict, name: str = INPUT) -> None:
    """Write ``src`` with its float input ``name`` replaced by an integer one (``enc``) and a DequantizeLinear:
    the EP compiles that into a quantized input tensor (the image encoder's pixels; the decoder's embeddings in a
    bundle, `embeds_encoding`)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    big = any(src.parent.glob(src.name + ".data"))
    model = onnx.load(str(src))
    g = model.graph
    inp = next((i for i in g.input if i.name == name), None)
    if inp is None:
        raise BackendError(f"{src.name} has no input '{name}' to quantize")
    float_name = f"vlmrun_{name}_dequantized"
    for node in g.node:
        node.input[:] = [float_name if x == name else x for x in node.input]
    dtype = {"uint8": TensorProto.UINT8, "uint16": TensorProto.UINT16}[enc["dtype"]]
    inp.type.tensor_type.elem_type = dtype
    g.initializer.extend([numpy_helper.from_array(np.asarray(enc["scale"], np.float32), f"vlmrun_{name}_scale"),
                          numpy_helper.from_array(np.asarray(enc["zero_point"], enc["dtype"]), f"vlmrun_{name}_zero_point")])
    domain = "" if enc["dtype"] == "uint8" else "com.microsoft"  # 16-bit Q/DQ before opset 21: contrib ops
    dq = helper.make_node("DequantizeLinear", [name, f"vlmrun_{name}_scale", f"vlmrun_{name}_zero_point"], [float_name],
                          name=f"vlmrun_{name}_DequantizeLinear", domain=domain)
    g.node.insert(0, dq)
    if domain and not any(o.domain == domain for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(domain, 1))
    if big:
        onnx.save_model(model, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=dst.name + ".data")
    else:
        onnx.save(model, str(dst))


def range_encoding(lo: float, hi: float, dtype: str = "uint16") -> dict:
    """The affine encoding of [lo, hi] at ``dtype`` (value = scale * (q - zero_point))."""
    top = np.iinfo(dtype).max
    scale = (hi - lo) / top
    return {"dtype": dtype, "scale": scale, "zero_point": int(round(-lo / scale)), "range": [lo, hi]}


def parse_embeds_input(value: str) -> dict | None:
    """The decoder's ``embeds_input`` option: ``float`` (None) or ``uint16:LO:HI``."""
    if value in (None, "", "float"):
        return None
    kind, _, rng = str(value).partition(":")
    try:
        lo, hi = (float(x) for x in rng.split(":"))
    except ValueError:
        lo = hi = None
    if kind != "uint16" or lo is None or not lo < 0 < hi:
        raise UsageError(f"embeds_input '{value}' is not 'float' or 'uint16:LO:HI' with LO < 0 < HI")
    return range_encoding(lo, hi)


class ImageEncoderStage(StageHandle):
    """The compiled image encoder on the local HTP: float ``pixel_values`` in (quantized here as Genie's
    ``setData`` would), ``image_features`` [1, N, hidden] out."""

    def __init__(self, session, artifact):
        self.session, self.artifact = session, artifact
        self.artifacts = (artifact,)
        self.load_s = session.load_s
        self.encoding = artifact.manifest["image_input"]

    def run(self, inputs: dict) -> dict:
        q = quantize_values(inputs[INPUT], self.encoding)
        out = self.session.run({INPUT: q})[OUTPUT]
        return {OUTPUT: np.asarray(out, np.float32).reshape(1, -1, out.shape[-1])}
