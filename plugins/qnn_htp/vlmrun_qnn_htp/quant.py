"""int8 for the HTP: static QDQ with the QNN-aware recipe (see reference/qualcomm.md).

* ``qnn_preprocess_model(fuse_layernorm=True)`` (fuses Erf sequences into Gelu, which the HTP takes in QDQ)
* ``get_qnn_qdq_config(per_channel=True, weight_type=QInt8, MinMax)``
* LayerNormalization gamma as asymmetric uint8 (the only form the HTP accepted)
* Softmax outputs at 16 bits (8-bit Softmax zeroes attention over many keys)

``precision``: ``int8`` = a8w8 with 16-bit Softmax; ``a16w8`` = 16-bit activations, 8-bit weights.
Calibration: images from a folder (preprocessed like real inputs) or, when none is given, random data that
the manifest labels ``"calibration": "random"``.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numpy as np

from vlmrun.errors import UsageError

IMAGE_SUFFIXES = {".jpg", ".jpeg", ".png", ".bmp", ".webp", ".gif", ".tif", ".tiff"}
RANDOM_SAMPLES = 4


def calibration_files(folder: str | Path | None) -> list[Path]:
    if not folder:
        return []
    d = Path(folder).expanduser()
    if not d.is_dir():
        raise UsageError(f"--calibration-images {folder} is not a directory")
    files = sorted(p for p in d.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file())
    if not files:
        raise UsageError(f"--calibration-images {folder} holds no images ({', '.join(sorted(IMAGE_SUFFIXES))})")
    return files


def calibration_digest(folder: str | Path | None) -> str | None:
    """A digest of the calibration images (part of the artifact key), or None for random calibration."""
    files = calibration_files(folder)
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


def calibration_samples(stage: str, model, folder, seed: int = 0) -> tuple[list[dict], str]:
    """Input feeds for calibrating ``stage`` and a label saying where they came from."""
    files = calibration_files(folder)
    rng = np.random.default_rng(seed)
    if stage == "vision":
        if files:
            from vlmrun.preprocess import load_image, preprocess_image

            feeds = [{"pixel_values": preprocess_image(load_image(f), model.image_processor_config)} for f in files]
            return feeds, f"images:{len(files)}"
        S = model.image_size
        return ([{"pixel_values": rng.random((1, 3, S, S), dtype=np.float32)} for _ in range(RANDOM_SAMPLES)],
                "random")
    if stage == "projector":
        if files:
            feats = _vision_features_cpu(model, files)
            return [{"image_features": f} for f in feats], f"images:{len(files)} (through the fp32 vision stage)"
        shape = (1, model.image_tokens, model.feature_dim)
        return [{"image_features": rng.standard_normal(shape).astype(np.float32)} for _ in range(RANDOM_SAMPLES)], \
            "random"
    raise UsageError(f"int8 is not available for stage '{stage}' yet (vision and projector only); use --precision fp16")


def _vision_features_cpu(model, files):
    """Vision features of the calibration images from the torch model (fp32, CPU)."""
    import torch

    from vlmrun.preprocess import load_image, preprocess_image

    tower = model.load_torch().model.vision_tower.eval()
    out = []
    with torch.no_grad():
        for f in files:
            pv = torch.from_numpy(preprocess_image(load_image(f), model.image_processor_config))
            out.append(tower(pv, return_dict=True).last_hidden_state.flatten(2).transpose(1, 2).numpy())
    return out


class _Reader:
    def __init__(self, feeds):
        self._it = iter(feeds)

    def get_next(self):
        return next(self._it, None)

    def rewind(self):  # some ORT versions call it
        pass


def quantize_qdq(src: Path, dst: Path, feeds: list[dict], precision: str, work: Path) -> dict:
    """Write a QDQ model of ``src`` to ``dst``; return the quantization facts for the manifest."""
    import onnx
    from onnxruntime.quantization import CalibrationMethod, QuantType, quantize
    from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config, qnn_preprocess_model

    pre = work / "preprocessed.onnx"
    model_in = pre if qnn_preprocess_model(str(src), str(pre), fuse_layernorm=True) else src
    proto = onnx.load(str(model_in))
    inits = {i.name for i in proto.graph.initializer}
    overrides: dict[str, list[dict]] = {}
    for node in proto.graph.node:
        if node.op_type == "LayerNormalization" and len(node.input) > 1 and node.input[1] in inits:
            overrides[node.input[1]] = [{"quant_type": QuantType.QUInt8, "symmetric": False}]
        if node.op_type == "Softmax" and precision == "int8":
            overrides[node.output[0]] = [{"quant_type": QuantType.QUInt16}]
    act = QuantType.QUInt16 if precision == "a16w8" else QuantType.QUInt8
    config = get_qnn_qdq_config(
        str(model_in), _Reader(feeds), calibrate_method=CalibrationMethod.MinMax, activation_type=act,
        weight_type=QuantType.QInt8, per_channel=True, init_overrides=overrides or None,
    )
    import logging

    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # onnxruntime.quantization warns through the root logger ("consider pre-processing")
    try:
        quantize(str(model_in), str(dst), config)
    finally:
        root.setLevel(level)
    return {"activation": act.name, "weights": "QInt8 per-channel", "softmax": "QUInt16" if precision == "int8"
            else act.name, "layernorm_gamma": "QUInt8 asymmetric", "io_quant": io_quant(dst)}


def io_quant(path: Path) -> dict:
    """Scale/offset (QNN convention, offset = -zero_point) of the Q/DQ pairs at the graph inputs and outputs."""
    import onnx
    from onnx import numpy_helper

    m = onnx.load(str(path))
    inits = {i.name: numpy_helper.to_array(i) for i in m.graph.initializer}
    consts = {}
    for n in m.graph.node:
        if n.op_type == "Constant":
            consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    vals = {**inits, **consts}
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
