"""``compile`` for genie_cpu: the Qwen2 weights -> the SDK's genai-transformer composer -> a model bin, plus the
float32 LUT and tokenizer.json Genie needs beside it."""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from vlmrun import procs
from vlmrun.errors import BackendError, UsageError

from vlmrun_qualcomm.sdk import Sdk

QUANTIZE = {"none": None, "z8": "Z8", "q4": "Q4"}
PREFIX = "model.language_model."


def quantize_option(value) -> str:
    q = str(value or "none").lower()
    if q not in QUANTIZE:
        raise UsageError(f"quantize '{value}' is not one of {', '.join(QUANTIZE)} (genie_cpu)")
    return q


def write_qwen2_dir(model, out: Path) -> Path:
    """The FastVLM checkpoint's language model as a plain Qwen2 checkpoint (what the composer reads)."""
    from safetensors import safe_open
    from safetensors.numpy import save_file

    out.mkdir(parents=True, exist_ok=True)
    text = dict(model.text_config)
    cfg = {**text, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if cfg.get(key) is None and model.config.get(key) is not None:
            cfg[key] = model.config[key]
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    tensors: dict[str, np.ndarray] = {}
    for f in sorted(model.path.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="numpy") as st:
                for key in st.keys():
                    if key.startswith(PREFIX):
                        tensors["model." + key[len(PREFIX):]] = st.get_tensor(key)
                    elif key == "lm_head.weight":
                        tensors[key] = st.get_tensor(key)
        except TypeError:  # bf16: numpy cannot hold it, go through torch
            from safetensors.torch import load_file

            for key, t in load_file(str(f)).items():
                if key.startswith(PREFIX):
                    tensors["model." + key[len(PREFIX):]] = t.float().numpy()
                elif key == "lm_head.weight":
                    tensors[key] = t.float().numpy()
    if "model.embed_tokens.weight" not in tensors:
        raise BackendError(f"{model.path} has no language_model.embed_tokens.weight: not a FastVLM checkpoint?")
    tensors.setdefault("lm_head.weight", tensors["model.embed_tokens.weight"])  # tied embeddings
    save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, str(out / "model.safetensors"))
    shutil.copy(model.path / "tokenizer.json", out / "tokenizer.json")
    return out


def composer_argv(composer: str, model_dir: Path, outfile: Path, quantize: str) -> list[str]:
    argv = [str(composer), "--model", str(model_dir), "--outfile", str(outfile)]
    if QUANTIZE[quantize]:
        argv += ["--quantize", QUANTIZE[quantize]]
    return argv


def compile_decoder(model, source, options: dict, out_dir: Path) -> dict:
    out_dir = Path(out_dir)
    quantize = quantize_option(options.get("quantize"))
    sdk = Sdk.find(options.get("sdk_root"))
    composer = sdk.tools("local")["composer"]
    if composer is None:
        sdk.require("local")  # raises the one-line error
    timeout = float(options.get("compose_timeout") or 3600)
    work = Path(tempfile.mkdtemp(prefix="vlmrun-genie-compose-"))
    try:
        qwen = write_qwen2_dir(model, work / "qwen2")
        argv = composer_argv(str(composer), qwen, out_dir / "model.bin", quantize)
        t0 = time.perf_counter()
        res = procs.run(argv, timeout=timeout, what="the genai-transformer composer", cwd=work,
                        hint="raise the compose_timeout option")
        seconds = time.perf_counter() - t0
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if res.returncode != 0:
        lines = [ln for ln in (res.stderr + "\n" + res.stdout).splitlines() if ln.strip()]
        err = next((ln for ln in lines if "error" in ln.lower()), lines[-1] if lines else "no message")
        raise BackendError(f"the genai-transformer composer failed (exit {res.returncode}): {err.strip()}")
    if not (out_dir / "model.bin").is_file() or (out_dir / "model.bin").stat().st_size == 0:
        raise BackendError("the genai-transformer composer exited 0 but wrote no model.bin")
    lut = np.load(source.file("embed_lut_f32.npy"), mmap_mode="r")
    np.save(out_dir / "embed_lut_f32.npy", np.asarray(lut, np.float32))
    np.asarray(lut, np.float32).tofile(out_dir / "embed_lut_f32.raw")
    shutil.copy(model.path / "tokenizer.json", out_dir / "tokenizer.json")
    return {
        "files": ["model.bin", "embed_lut_f32.raw", "embed_lut_f32.npy", "tokenizer.json"],
        "quantize": quantize,
        "composer": Path(str(composer)).name,
        "composer_argv": [Path(argv[0]).name] + [
            "<qwen2 dir>" if a == str(qwen) else ("model.bin" if a == str(out_dir / "model.bin") else a)
            for a in argv[1:]],
        "compile_s": round(seconds, 3),
        "lut": {"vocab": int(lut.shape[0]), "hidden": int(lut.shape[1]), "dtype": "float32"},
        "binary_bytes": {"model.bin": (out_dir / "model.bin").stat().st_size},
    }
