"""``compile`` for genie_cpu: the Qwen2 weights -> the SDK's genai-transformer composer -> a model bin, plus the
float32 LUT and tokenizer.json Genie needs beside it.

The composer (``bin/x86_64-linux-clang/qnn-genai-transformer-composer``) is a Python tool of the QAIRT SDK: it
imports ``qti.aisw.genai`` from the SDK's ``lib/python``, so it runs in the SDK's environment (``QNN_SDK_ROOT``,
``PYTHONPATH``, as ``bin/envsetup.sh`` sets them). Qwen2 is not in its built-in architectures: it gets a
``--config_file`` describing the architecture and the tensor names, generated here from the checkpoint's config
(the keys of the FastVLM hand-off's ``genai_fastvlm_config.json``). ``--dump_lut`` writes the embedding table
``LUT.bin`` (float32 [vocab, hidden], the ``-t`` file) and ``--export_tokenizer_json`` the ``tokenizer.json``,
both next to ``--outfile``, as the hand-off's ``05_build_genai_decoder_bin.sh`` uses them::

    qnn-genai-transformer-composer --model QWEN2_DIR --config_file composer_config.json --outfile model.bin
        --dump_lut --export_tokenizer_json [--quantize Z8|Q4]
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from vlmrun import procs
from vlmrun.checkpoint_stream import ShardedWeights
from vlmrun.errors import BackendError, UsageError

from vlmrun_qualcomm.sdk import Sdk

QUANTIZE = {"none": None, "z8": "Z8", "q4": "Q4"}
PREFIX = "model.language_model."
ACTIVATIONS = {"silu": "SiLU", "swish": "SiLU", "gelu": "GeLU", "gelu_new": "GeLU", "relu": "ReLU"}
LUT_NAME = "LUT.bin"  # what --dump_lut writes next to --outfile


def quantize_option(value) -> str:
    q = str(value or "none").lower()
    if q not in QUANTIZE:
        raise UsageError(f"quantize '{value}' is not one of {', '.join(QUANTIZE)} (genie_cpu)")
    return q


def write_qwen2_dir(model, out: Path) -> tuple[Path, list[str]]:
    """The FastVLM checkpoint's language model as a plain Qwen2 checkpoint (what the composer reads), and the
    names of the tensors written."""
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    text = dict(model.text_config)
    cfg = {**text, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if cfg.get(key) is None and model.config.get(key) is not None:
            cfg[key] = model.config[key]
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    tensors: dict[str, np.ndarray] = {}
    weights = ShardedWeights(model.path)  # shards, or a converted checkpoint's source shards, one tensor at a time
    for key in sorted(weights.files):
        if key.startswith(PREFIX):
            tensors["model." + key[len(PREFIX):]] = _as_float32(weights.read(key))
        elif key == "lm_head.weight":
            tensors[key] = _as_float32(weights.read(key))
    if "model.embed_tokens.weight" not in tensors:
        raise BackendError(f"{model.path} has no language_model.embed_tokens.weight: not a FastVLM checkpoint?")
    tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"])  # tied embeddings
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()},
              str(out / "model.safetensors"))
    shutil.copy(model.path / "tokenizer.json", out / "tokenizer.json")
    return out, sorted(tensors)


def _as_float32(tensor) -> np.ndarray:
    return tensor.float().numpy()


def composer_config(text: dict, tensor_names, context: int, name: str = "fastvlm-qwen2") -> dict:
    """The composer's ``--config_file`` for a Qwen2 checkpoint, every number from its ``config.json``.

    Keys as in the FastVLM hand-off's ``genai_fastvlm_config.json`` (a "generic" pre-norm, gated-MLP, RMS-norm,
    RoPE transformer; HF's rotate-half rotary layout is "SoA"; ``rope_scaling`` carries rope theta;
    ``rope_num_rotations`` the rotary dimension). Biases are listed only when the checkpoint has them."""
    names = set(tensor_names)
    try:
        hidden, heads = int(text["hidden_size"]), int(text["num_attention_heads"])
        layers, vocab, ffn = int(text["num_hidden_layers"]), int(text["vocab_size"]), int(text["intermediate_size"])
    except KeyError as exc:
        raise UsageError(f"the model config has no {exc.args[0]}: cannot describe it to the composer") from None
    act = str(text.get("hidden_act") or "silu").lower()
    if act not in ACTIVATIONS:
        raise UsageError(f"the composer config has no activation for hidden_act '{act}'")
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta") or text.get("rope_theta") or 10000.0)
    head_dim = int(text.get("head_dim") or hidden // heads)
    cfg = {
        "general.name": name,
        "general.architecture": "generic",
        "general.tokenizer": "none",
        "general.quantization_version": 1,
        "general.alignment": 32,
        "size.vocabulary": vocab,
        "size.context": int(context),
        "size.embedding": hidden,
        "size.feedforward": ffn,
        "architecture.num_decoders": layers,
        "architecture.num_heads": heads,
        "architecture.num_kv_heads": int(text.get("num_key_value_heads") or heads),
        "architecture.connector": "sequential_pre_layer_normalization",
        "architecture.gating": "gated",
        "operation.normalization": "RMS-norm",
        "operation.normalization_epsilon": float(text.get("rms_norm_eps") or 1e-6),
        "operation.activation": ACTIVATIONS[act],
        "operation.positional_embedding": "RoPE",
        "operation.rope_complex_organization": "SoA",
        "operation.rope_num_rotations": head_dim,
        "operation.rope_scaling": theta,
        "tensor.layer_name": "model.layers.(\\d+).",
        "tensor.embedding_token_weight": {"name": "model.embed_tokens.weight"},
    }
    per_layer = [
        ("attention_normalization_weight", "input_layernorm.weight", False),
        ("attention_q_weight", "self_attn.q_proj.weight", True),
        ("attention_q_bias", "self_attn.q_proj.bias", False),
        ("attention_k_weight", "self_attn.k_proj.weight", True),
        ("attention_k_bias", "self_attn.k_proj.bias", False),
        ("attention_v_weight", "self_attn.v_proj.weight", True),
        ("attention_v_bias", "self_attn.v_proj.bias", False),
        ("attention_output_weight", "self_attn.o_proj.weight", True),
        ("feedforward_normalization_weight", "post_attention_layernorm.weight", False),
        ("feedforward_gate_weight", "mlp.gate_proj.weight", True),
        ("feedforward_up_weight", "mlp.up_proj.weight", True),
        ("feedforward_output_weight", "mlp.down_proj.weight", True),
    ]
    for key, tensor, transposed in per_layer:
        if f"model.layers.0.{tensor}" not in names:
            if tensor.endswith(".bias"):
                continue
            raise BackendError(f"the Qwen2 weights lack model.layers.0.{tensor}: cannot describe them to the composer")
        cfg[f"tensor.{key}"] = {"name": tensor, **({"transposed": True} if transposed else {})}
    cfg["tensor.output_normalization_weight"] = {"name": "model.norm.weight"}
    cfg["tensor.output_weight"] = {"name": "lm_head.weight", "transposed": True}
    return cfg


def composer_argv(composer: str, model_dir: Path, config_file: Path, outfile: Path, quantize: str,
                  python: str | None = None) -> list[str]:
    argv = ([str(python)] if python else []) + [
        str(composer), "--model", str(model_dir), "--config_file", str(config_file), "--outfile", str(outfile),
        "--dump_lut", "--export_tokenizer_json"]
    if QUANTIZE[quantize]:
        argv += ["--quantize", QUANTIZE[quantize]]
    return argv


def compile_decoder(model, source, plan, out_dir: Path) -> dict:
    """The model bin of ``model`` composed into ``out_dir`` as ``plan`` (a `.options.DecoderPlan`) says."""
    out_dir = Path(out_dir)
    quantize = plan.quantize
    sdk = Sdk.find(plan.sdk_root)
    composer = sdk.tools("local")["composer"]
    if composer is None:
        sdk.require("local")  # raises the one-line error
    context = plan.context_length
    timeout = plan.compose_timeout
    work = Path(tempfile.mkdtemp(prefix="vlmrun-genie-compose-"))
    try:
        qwen, names = write_qwen2_dir(model, work / "qwen2")
        cfg_path = work / "composer_config.json"
        cfg_path.write_text(json.dumps(composer_config(model.text_config, names, context), indent=1))
        composed = work / "out"
        composed.mkdir()
        argv = composer_argv(str(composer), qwen, cfg_path, composed / "model.bin", quantize, plan.composer_python)
        t0 = time.perf_counter()
        res = procs.run(argv, timeout=timeout, what="the genai-transformer composer", cwd=composed,
                        env=sdk.env(), hint="raise the compose_timeout option")
        seconds = time.perf_counter() - t0
        if res.returncode != 0:
            lines = [ln for ln in (res.stderr + "\n" + res.stdout).splitlines() if ln.strip()]
            err = next((ln for ln in reversed(lines) if "error" in ln.lower()), lines[-1] if lines else "no message")
            raise BackendError(f"the genai-transformer composer failed (exit {res.returncode}): {err.strip()}")
        lut = _take_outputs(model, composed, out_dir, np.load(source.file("embed_lut_f32.npy"), mmap_mode="r"))
        cfg_copy = out_dir / "composer_config.json"
        shutil.copy(cfg_path, cfg_copy)
        display = {str(qwen): "<qwen2 dir>", str(cfg_path): "composer_config.json",
                   str(composed / "model.bin"): "model.bin"}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {
        "files": ["model.bin", "embed_lut_f32.raw", "embed_lut_f32.npy", "tokenizer.json", "composer_config.json"],
        "quantize": quantize,
        "context_length": context,
        "sdk_version": sdk.version(),
        "composer": Path(str(composer)).name,
        "composer_argv": [Path(a).name if a == str(composer) else display.get(a, a) for a in argv],
        "compile_s": round(seconds, 3),
        "lut": {"vocab": int(lut.shape[0]), "hidden": int(lut.shape[1]), "dtype": "float32", "from": "--dump_lut"},
        "binary_bytes": {"model.bin": (out_dir / "model.bin").stat().st_size},
    }


def _take_outputs(model, composed: Path, out_dir: Path, reference: np.ndarray) -> np.ndarray:
    """Move the composer's model.bin, LUT.bin (--dump_lut) and tokenizer.json (--export_tokenizer_json) into the
    artifact, checking each (the LUT must be float32 [vocab, hidden] and equal the model's embedding table)."""
    missing = [n for n in ("model.bin", LUT_NAME, "tokenizer.json") if not (composed / n).is_file()]
    if missing:
        raise BackendError(f"the genai-transformer composer exited 0 but wrote no {', '.join(missing)}"
                           f" (asked with --outfile, --dump_lut, --export_tokenizer_json)")
    if (composed / "model.bin").stat().st_size == 0:
        raise BackendError("the genai-transformer composer wrote an empty model.bin")
    V, H = model.vocab_size, model.hidden_size
    size = (composed / LUT_NAME).stat().st_size
    if size != V * H * 4:
        raise BackendError(f"the composer's {LUT_NAME} is {size} bytes, not float32 [{V}, {H}] ({V * H * 4} bytes)")
    lut = np.fromfile(composed / LUT_NAME, dtype=np.float32).reshape(V, H)
    # Genie embeds generated tokens with this table and vlmrun's embed stage the prompt: they must agree
    ref = np.asarray(reference, np.float32)
    if ref.shape != lut.shape or np.abs(lut - ref).max() > 1e-2 * max(float(np.abs(ref).max()), 1e-12):
        raise BackendError(f"the composer's {LUT_NAME} is not the model's embedding table (shape {list(lut.shape)},"
                           f" expected {list(ref.shape)}); check the composer config's tensor.embedding_token_weight")
    shutil.move(str(composed / "model.bin"), out_dir / "model.bin")
    shutil.move(str(composed / LUT_NAME), out_dir / "embed_lut_f32.raw")
    shutil.move(str(composed / "tokenizer.json"), out_dir / "tokenizer.json")
    np.save(out_dir / "embed_lut_f32.npy", lut)  # the libGenie worker's token-to-embedding table
    return lut
