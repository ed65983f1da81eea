"""The AIMET engine of `vlmrun_qnn_htp.quantizer.quantize` (``quantizer = "aimet"``).

AIMET-ONNX (``aimet-onnx``, the optional extra ``vlmrun-qnn-htp[aimet]``) is the toolkit Qualcomm quantizes its
HTP LLMs and VLMs with. This engine:

1. builds a ``QuantizationSimModel`` of the (preprocessed) float graph with the package's v79 HTP config (per-channel
   Conv / MatMul / Gemm weights, LayerNorm gamma asymmetric), changed in one place: ``MatmulAdd`` out of
   ``supergroup_pass_list`` (else no quantizer
   sits between a MatMul and its bias Add, onnxruntime fuses them into a Gemm the QNN EP refuses: "Unsupported
   nodes in QNN EP ... Gemm", then "QNN.graphAddNode() failed ... 'Dequantize'");
2. weights at the recipe's bits (``param_type``), activations at 16 bits (8 at int8, Softmax kept at 16);
   LPBQ (``set_lpbq_for_params``, MatMul and Gemm: AIMET types the layers with a bias as Gemm);
3. per-layer overrides: ``keep_fp`` nodes' quantizers disabled, ``keep_a16w16`` at 16 bits, ``keep_w8`` /
   ``keep_w4`` weights at 8 / 4 bits per channel (not blockwise);
4. Sequential MSE (``apply_seq_mse``) or AdaRound (``apply_adaround``) on the weights, then
   ``compute_encodings`` on the calibration feeds;
5. exports with ``to_onnx_qdq(export_int32_bias=True, prequantize_constants=True)``: the one shape of AIMET's
   export that onnxruntime-qnn 2.7.0 compiles with LPBQ (integer weights behind a DequantizeLinear; the EP builds
   QNN_QUANTIZATION_ENCODING_BLOCKWISE_EXPANSION weights from it).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from vlmrun.errors import BackendError, UsageError

from .recipe import AIMET_EXTRA, Recipe

CONFIG = "htp_quantsim_config_v79.json"
LPBQ_OPS = {"MatMul", "Gemm"}


def htp_config(work: Path) -> Path:
    """AIMET's v79 HTP config without the MatmulAdd supergroup (module docstring)."""
    import aimet_onnx

    root = Path(aimet_onnx.__file__).parent
    found = next(root.rglob(CONFIG), None)
    if found is None:
        raise BackendError(f"aimet-onnx {_version()} ships no {CONFIG} (the HTP v79 config vlmrun quantizes with);"
                           f" reinstall it: {AIMET_EXTRA}")
    cfg = json.loads(found.read_text())
    cfg["supergroup_pass_list"] = [s for s in cfg.get("supergroup_pass_list", []) if s != "MatmulAdd"]
    out = work / "aimet_htp_v79.json"
    out.write_text(json.dumps(cfg, indent=1))
    return out


def _version() -> str:
    from importlib.metadata import version

    try:
        return version("aimet-onnx")
    except Exception:
        return "?"


#: AIMET's log areas (``aimet_onnx.common.utils.AimetLogger.LogAreas``): it logs every step at INFO
LOG_AREAS = ("Quant", "Utils", "SeqMse", "AdaRound", "ConnectedGraph", "ModelPreparer", "LayerOutputs",
             "MixedPrecision", "QuantAnalyzer", "BatchNormFolding", "LlmTopology")


def quiet_logs() -> None:
    for name in LOG_AREAS:
        logging.getLogger(name).setLevel(logging.WARNING)


def build_sim(model_in: Path, feeds: list[dict], recipe: Recipe, work: Path, nodes: dict | None = None,
              big: bool = False):
    """The calibrated ``QuantizationSimModel`` of ``model_in`` under ``recipe`` (steps 1-4 of the module
    docstring) and its facts; ``nodes``: ``{per-layer option: node names}``."""
    try:
        import aimet_onnx
        import onnx
        from aimet_onnx.quantsim import QuantizationSimModel, set_lpbq_for_params
    except ImportError:
        raise UsageError(f"quantizer = \"aimet\" needs AIMET-ONNX, which is not installed: {AIMET_EXTRA}") from None
    nodes = nodes or {}
    quiet_logs()
    model = onnx.load(str(model_in))
    param = f"int{recipe.weight_bits}"
    act = f"int{recipe.activation_bits}"
    # a graph near protobuf's 2 GB limit: AIMET keeps its sessions' weights as external data under ``path``
    sim = QuantizationSimModel(model, param_type=param, activation_type=act, quant_scheme="min_max",
                               config_file=str(htp_config(work)), path=str(work / "aimet-sim") if big else None)
    del model
    facts: dict = {"activation": f"{'uint16' if recipe.activation_bits == 16 else 'uint8'} (AIMET {act})"}
    ops = {op.name: op for op in sim.connected_graph.ordered_ops}
    if recipe.activation_bits == 8:  # 8-bit Softmax zeroes attention over many keys: 16 bits, as onnxruntime's path
        soft = [o.name for op in ops.values() if op.type == "Softmax" for o in op.outputs]
        sim.set_tensor_precision(soft, "int16", strict=False)
        facts["softmax"] = "uint16"
    keep_fp, wide = set(nodes.get("keep_fp", ())), set(nodes.get("keep_a16w16", ()))
    w8, w4 = set(nodes.get("keep_w8", ())), set(nodes.get("keep_w4", ()))
    for name in keep_fp | wide | w8 | w4:
        op = ops.get(name)
        if op is None:
            continue
        _, outs, params = sim.get_op_quantizers(op)
        if name in keep_fp:
            for q in (*outs, *params.values()):
                q.enabled = False
        elif name in wide:
            for q in outs:
                q.set_bitwidth(16)
            if params.get("weight") is not None:
                params["weight"].set_bitwidth(16)
        elif params.get("weight") is not None:
            params["weight"].set_bitwidth(8 if name in w8 else 4)
    if recipe.weight_scheme == "lpbq":
        include = {n for n, op in ops.items() if op.type in LPBQ_OPS and n not in keep_fp | wide | w8 | w4}
        include = {n for n in include if sim.get_op_quantizers(ops[n])[2].get("weight") is not None}
        set_lpbq_for_params(sim, recipe.weight_bits, recipe.block_size, nodes_to_include=include)
        facts["lpbq"] = {"block_size": recipe.block_size, "weights": len(include)}
    if recipe.algorithm == "seq_mse":
        aimet_onnx.apply_seq_mse(sim, feeds, num_candidates=recipe.seq_mse_candidates)
        facts["algorithm"] = f"Sequential MSE ({recipe.seq_mse_candidates} candidates)"
    elif recipe.algorithm == "adaround":
        aimet_onnx.apply_adaround(sim, feeds, num_iterations=recipe.adaround_iterations)
        facts["algorithm"] = f"AdaRound ({recipe.adaround_iterations} iterations)"
    else:
        facts["algorithm"] = "min-max"
    sim.compute_encodings(feeds)
    for option in ("keep_w8", "keep_w4"):
        if nodes.get(option):
            facts[f"_{option}"] = {"weights": sum(1 for n in nodes[option] if n in ops)}
    if wide:
        facts["_keep_a16w16"] = {"nodes_in_sim": sum(1 for n in wide if n in ops)}
    return sim, facts


def quantize_aimet(model_in: Path, dst: Path, feeds: list[dict], recipe: Recipe, work: Path, nodes: dict,
                   big: bool) -> dict:
    """Write AIMET's QDQ model of ``model_in`` to ``dst`` (module docstring); the facts for the manifest."""
    import onnx

    from .memory import release_memory

    sim, facts = build_sim(model_in, feeds, recipe, work, nodes, big)
    sim.session = None  # the export needs the encodings, not the calibration session (its own copy of the weights)
    release_memory(big)
    qdq = sim.to_onnx_qdq(export_int32_bias=True, prequantize_constants=True)
    del sim
    if big:
        onnx.save_model(qdq, str(dst), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=Path(dst).name + ".data")
    else:
        onnx.save(qdq, str(dst))
    facts["weights"] = (f"int{recipe.weight_bits} " + (f"LPBQ (block {recipe.block_size}, per-channel scale)"
                                                       if recipe.weight_scheme == "lpbq" else "per-channel")
                        + " symmetric")
    facts["engine"] = f"aimet-onnx {_version()}"
    return facts


def simulate(model_in: Path, feeds: list[dict], recipe: Recipe, work: Path, nodes: dict | None = None) -> list[dict]:
    """AIMET's simulated outputs of ``model_in`` under ``recipe`` for each feed (what tests and benchmarks hold the
    emulator's outputs against)."""
    sim, _ = build_sim(model_in, feeds, recipe, work, nodes)
    names = [o.name for o in sim.session.get_outputs()]
    out = []
    for f in feeds:
        res = dict(zip(names, sim.session.run(names, f)))
        out.append({k[: -len("_updated")] if k.endswith("_updated") else k: v for k, v in res.items()})
    return out
