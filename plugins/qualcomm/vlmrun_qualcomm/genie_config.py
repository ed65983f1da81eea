"""Genie's dialog config, generated from the model's own config (`GenieModel`), with the sampler from vlmrun's
sampling settings. Shared by the plugins that decode through Genie (`qnn_htp` engine `genie` and `genie_cpu`).

The config (root `"dialog"`, as `genie-t2t-run` and `GenieDialogConfig_createFromJson` read it):

    {"dialog": {"version": 1, "type": "basic", "max-num-tokens": N,
                "context": {"version": 1, "size", "n-vocab", "bos-token", "eos-token", "pad-token", "n-embd"},
                "sampler": {"version": 1, "seed", "temp", "top-k", "top-p", "greedy"},
                "tokenizer": {"version": 1, "path": "tokenizer.json"},
                "embedding": {"version": 1, "size": H, "datatype": "float32"},          (embedding input)
                "engine": {"version": 1, "n-threads", "backend": {...}, "model": {...}}}}
"""

from __future__ import annotations

import os
from typing import Mapping, Sequence

import attrs

from vlmrun.errors import UsageError
from vlmrun.sampling import SamplingSettings

BACKENDS = ("QnnHtp", "QnnGenAiTransformer")


# -- model facts and configs ----------------------------------------------------------------------------------
@attrs.frozen
class GenieModel:
    """What a Genie config needs to know about the LLM, read from the model's own config."""

    vocab: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    rope_theta: float
    bos: int
    eos: tuple[int, ...]
    pad: int
    max_context: int

    @classmethod
    def from_config(cls, config: Mapping, extra_eos: Sequence[int] = ()) -> "GenieModel":
        """From a checkpoint's `config.json` dict (native `fast_vlm` with `text_config`, or a bare LLM)."""
        text = dict(config.get("text_config") or config)

        def pick(key, default=None):
            for src in (text, config):
                if src.get(key) is not None:
                    return src[key]
            return default

        try:
            hidden = int(text["hidden_size"])
            heads = int(text["num_attention_heads"])
            vocab = int(text["vocab_size"])
            layers = int(text["num_hidden_layers"])
        except KeyError as exc:
            raise UsageError(f"the model config has no {exc.args[0]}: cannot generate a Genie config") from None
        eos_raw = pick("eos_token_id")
        eos = [eos_raw] if isinstance(eos_raw, int) else list(eos_raw or [])
        eos += [int(e) for e in extra_eos if int(e) not in eos]
        if not eos:
            raise UsageError("the model config has no eos_token_id: cannot generate a Genie config")
        bos = pick("bos_token_id", eos[0])
        pad = pick("pad_token_id", bos)
        rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
        theta = float(rope.get("rope_theta") or text.get("rope_theta") or 10000.0)
        return cls(
            vocab=vocab, hidden=hidden, layers=layers, heads=heads,
            kv_heads=int(text.get("num_key_value_heads") or heads),
            head_dim=int(text.get("head_dim") or hidden // heads),
            rope_theta=theta, bos=int(bos), eos=tuple(int(e) for e in eos), pad=int(pad),
            max_context=int(text.get("max_position_embeddings") or 32768),
        )

    @classmethod
    def from_model(cls, model) -> "GenieModel":
        """From a `vlmrun.model.FastVLMModel` (its config plus the stop ids of its generation config)."""
        facts = cls.from_config(model.config)
        extra = sorted(set(model.stop_ids) - set(facts.eos))
        return attrs.evolve(facts, eos=facts.eos + tuple(extra)) if extra else facts


def sampler_config(settings: SamplingSettings, vocab: int) -> dict:
    """Genie's sampler section from vlmrun's sampling settings (top-k 0 = off = the whole vocabulary).

    Greedy is written as `greedy: true` AND `top-k: 1`: Genie's `greedy` flag alone did not give the
    argmax on the HTP emulator (it picked a token whose logit was not the largest)."""
    s = settings or SamplingSettings()
    return {
        "version": 1,
        "seed": int(s.seed),
        "temp": float(s.temperature) if not s.greedy else 1.0,
        "top-k": 1 if s.greedy else (int(s.top_k) if s.top_k > 0 else int(vocab)),
        "top-p": float(s.top_p),
        "greedy": bool(s.greedy),
    }


def dialog_config(
    facts: GenieModel,
    backend: str,
    *,
    tokenizer: str | os.PathLike,
    context_size: int,
    sampling: SamplingSettings = SamplingSettings(),
    max_new_tokens: int = 64,
    ctx_bins: Sequence[str | os.PathLike] = (),
    model_bin: str | os.PathLike | None = None,
    embeddings: bool = True,
    eos: Sequence[int] | None = None,
    n_threads: int | None = None,
    kv_quantization: bool = False,
) -> dict:
    """A Genie dialog config for `backend` ("QnnHtp": `ctx_bins`; "QnnGenAiTransformer": `model_bin`).

    Every model number comes from `facts` (the model's own config), never a constant. `eos` overrides the
    stop tokens (e.g. the request's). `embeddings` declares float32 embedding input of width n-embd.
    """
    if backend not in BACKENDS:
        raise UsageError(f"Genie backend '{backend}' is not one of {', '.join(BACKENDS)}")
    ctx = int(context_size)
    if ctx < 2 or ctx > facts.max_context:
        raise UsageError(f"Genie context size {ctx} is outside 2..{facts.max_context} (the model's maximum)")
    stops = [int(e) for e in (facts.eos if eos is None else eos)]
    context = {
        "version": 1,
        "size": ctx,
        "n-vocab": facts.vocab,
        "bos-token": facts.bos,
        "eos-token": stops[0] if len(stops) == 1 else stops,
        "pad-token": facts.pad,
    }
    if embeddings:
        context["n-embd"] = facts.hidden
    threads = int(n_threads or min(6, os.cpu_count() or 1))
    if backend == "QnnHtp":
        if not ctx_bins:
            raise UsageError("a QnnHtp Genie config needs the context binaries (ctx-bins)")
        be = {
            "version": 1,
            "type": "QnnHtp",
            "QnnHtp": {
                "version": 1,
                "spill-fill-bufsize": 0,
                "use-mmap": False,
                "mmap-budget": 0,
                "poll": False,
                "cpu-mask": "0xe0",
                "kv-dim": facts.head_dim,
                "allow-async-init": False,
            },
        }
        model = {
            "version": 1,
            "type": "binary",
            "binary": {"version": 1, "ctx-bins": [str(b) for b in ctx_bins]},
            "positional-encoding": {"type": "rope", "rope-dim": facts.head_dim // 2, "rope-theta": facts.rope_theta},
        }
    else:
        if not model_bin:
            raise UsageError("a QnnGenAiTransformer Genie config needs the composer's model bin")
        be = {
            "version": 1,
            "type": "QnnGenAiTransformer",
            "QnnGenAiTransformer": {
                "version": 1,
                "use-mmap": False,
                "kv-quantization": bool(kv_quantization),
                "n-logits": 1,
                "n-layer": facts.layers,
                "n-embd": facts.hidden,
                "n-heads": facts.heads,
                "n-kv-heads": facts.kv_heads,
                "model-input": "embeddings" if embeddings else "tokens",
            },
        }
        model = {"version": 1, "type": "library", "library": {"version": 1, "model-bin": str(model_bin)}}
    dialog = {
        "version": 1,
        "type": "basic",
        "max-num-tokens": int(max_new_tokens),
        "context": context,
        "sampler": sampler_config(sampling, facts.vocab),
        "tokenizer": {"version": 1, "path": str(tokenizer)},
        "engine": {"version": 1, "n-threads": threads, "backend": be, "model": model},
    }
    if embeddings:
        dialog["embedding"] = {"version": 1, "size": facts.hidden, "datatype": "float32"}
    return {"dialog": dialog}
