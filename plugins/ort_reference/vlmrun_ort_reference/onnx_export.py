"""torch -> ONNX export of FastVLM stages (legacy TorchScript exporter, opset 17).

Graph forms (``ExportForm.kind``):

``vision``        pixel_values [1,3,S,S] -> image_features [1,N,F]
``projector``     image_features [1,N,F] -> image_embeds [1,N,H]
``embed``         input_ids int64 [1,T] -> inputs_embeds [1,T,H]   (``seq`` param: static T for NPUs)
``embed/lut``     no graph: the token-embedding table as float32 [V,H] and int8 [V,H] with a scale
``decoder/kv``    growing KV cache (ONNX Runtime): inputs_embeds [1,T,H], attention_mask int64 [1,P+T],
                  position_ids int64 [1,T], past_key_i/past_value_i [1,KV,P,D]
                  -> logits [1,T,V], present_key_i/present_value_i [1,KV,P+T,D]
``decoder/fixed`` fixed KV for NPUs, params ``ar`` (N), ``ctx`` (C) and ``rmsnorm``: inputs_embeds [1,N,H],
                  attention_mask float32 additive [1,1,N,C] (0 or -65504), position_ids int32 [1,N],
                  past_key_i/past_value_i [1,KV,C-N,D] -> logits [1,N,V], new_key_i/new_value_i [1,KV,N,D]
``decoder/genie`` Genie's I/O layout (QnnHtp engine), params ``ar`` (N), ``ctx`` (C), ``rmsnorm``, ``input``
                  ("embeds" or "ids"): inputs_embeds [1,N,H] (or input_ids int32 [1,N]), attention_mask f32
                  additive [1,N,C], position_ids_cos/position_ids_sin [1,1,N,D/2], past_key_i_in [KV,1,D,C-N],
                  past_value_i_in [KV,1,C-N,D] -> logits [1,N,V], past_key_i_out [KV,1,D,N], past_value_i_out
                  [KV,1,N,D]
``decoder/parts`` Qualcomm's shipping form: the decoder split into parts of layers, each a prompt (AR-N) and a
                  token (AR-1) graph in the ``decoder/genie`` layout, all in one artifact (`.decoder_parts`)

The decoder is written out explicitly over the checkpoint's own Qwen2 modules (same weights, same math as
transformers' eager attention) with a precomputed rotary cos/sin table looked up by position, which keeps the
graph free of dynamic ``Range``-based rope and makes the fixed-KV form static.

RMSNorm (param ``rmsnorm``; default ``safe`` for ``decoder/fixed`` and ``decoder/genie``, ``plain`` for
``decoder/kv``): ``plain`` is transformers' Qwen2RMSNorm, ``x * rsqrt(mean(x^2) + eps)`` with fp32 casts. NPUs
run those casts in fp16, where ``x^2`` overflows once |x| > 256 (65504 is fp16's largest value), and real Qwen2
checkpoints carry "massive activations" (single residual channels in the hundreds to thousands on the first token
and on delimiters). ``safe`` divides each row by its largest |x| before squaring (`safe_rms_norm`): the
same result in fp32 (to rounding), no overflow in fp16.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from vlmrun.checkpoint_keys import NATIVE_EMBED
from vlmrun.checkpoint_stream import DECODER_WEIGHTS, STAGE_WEIGHTS

from .probe_names import decoder_probe_outputs, inject_input
from .torch_common import (EXTERNAL_DATA_THRESHOLD, MASK_MIN, OPSET, RMSNORMS, import_torch, rms_norm_of,  # noqa: F401
                           safe_rms_norm)


def stage_weights(form) -> tuple[str, ...] | None:
    """The native weight-name prefixes the graph of ``form`` holds (what a streamed export reads,
    `vlmrun.model.FastVLMModel.load_torch_part`); ``None`` for a form this module does not build."""
    if form.kind in ("vision", "projector", "embed"):
        return STAGE_WEIGHTS[form.kind]
    if form.kind == "vision/encoder":
        return STAGE_WEIGHTS["vision"] + STAGE_WEIGHTS["projector"]
    if form.kind in ("decoder/kv", "decoder/fixed", "decoder/genie"):
        return DECODER_WEIGHTS  # the whole decoder: its wrappers hold the language model
    return None


def build_wrapper(model, form):
    """The torch module, example inputs, names and dynamic axes for ``form``."""
    torch, _ = import_torch()
    from vlmrun.torch_stages import EmbedStage, ProjectorStage, VisionStage

    prefixes = stage_weights(form)
    if prefixes is None:
        return None
    fvlm = model.load_torch_part(prefixes, f"exporting {form.label()}")
    S = model.image_size

    if form.kind == "vision":
        return VisionStage(fvlm), (torch.zeros(1, 3, S, S),), ["pixel_values"], ["image_features"], None

    if form.kind == "vision/encoder":  # Genie's image encoder: vision tower + projector in one graph
        class ImageEncoder(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.vision, self.projector = VisionStage(fvlm), ProjectorStage(fvlm)

            def forward(self, pixel_values):
                return self.projector(self.vision(pixel_values))

        return ImageEncoder(), (torch.zeros(1, 3, S, S),), ["pixel_values"], ["image_features"], None

    if form.kind == "projector":
        ex = (torch.zeros(1, model.image_tokens, model.feature_dim),)
        return ProjectorStage(fvlm), ex, ["image_features"], ["image_embeds"], None

    if form.kind == "embed":
        seq = form.get("seq")
        ex = (torch.zeros(1, int(seq or 7), dtype=torch.int64),)
        axes = None if seq else {"input_ids": {1: "seq"}, "inputs_embeds": {1: "seq"}}
        return EmbedStage(fvlm), ex, ["input_ids"], ["inputs_embeds"], axes

    if form.kind in ("decoder/kv", "decoder/fixed"):
        return _decoder_wrapper(model, fvlm, form)

    if form.kind == "decoder/genie":
        return _genie_decoder_wrapper(model, fvlm, form)

    return None


def _decoder_wrapper(model, fvlm, form):
    torch, F = import_torch()
    nn = torch.nn
    lm = fvlm.model.language_model
    L, KV, D, H = model.num_layers, model.num_kv_heads, model.head_dim, model.hidden_size
    nh = model.num_heads
    fixed = form.kind == "decoder/fixed"
    ctx = int(form.get("ctx") or 0)
    ar = int(form.get("ar") or 1)
    table_len = ctx if fixed else model.max_context
    norm = rms_norm_of(form)
    probe = bool(form.get("probe"))  # probes.py: the hidden state after every layer and the final norm as outputs
    inject = probe and bool(form.get("inject"))  # probes.py: and inputs added to each of them
    with torch.no_grad():
        pos = torch.arange(table_len)[None]
        cos, sin = lm.rotary_emb(torch.zeros(1, dtype=torch.float32), pos)
    cos_table, sin_table = cos[0].float().contiguous(), sin[0].float().contiguous()

    def rotate_half(x):
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = lm
            self.lm_head = fvlm.lm_head
            self.register_buffer("cos_table", cos_table, persistent=False)
            self.register_buffer("sin_table", sin_table, persistent=False)

        def forward(self, inputs_embeds, attention_mask, position_ids, *past):
            past, deltas = (past[: 2 * L], past[2 * L :]) if inject else (past, ())
            T = inputs_embeds.shape[1]
            cos = F.embedding(position_ids, self.cos_table)[:, None]  # [1,1,T,D]
            sin = F.embedding(position_ids, self.sin_table)[:, None]
            if fixed:
                mask = attention_mask  # additive [1,1,N,C]
            else:
                P = past[0].shape[2]
                q_pos = torch.arange(T, device=inputs_embeds.device) + P
                k_pos = torch.arange(P + T, device=inputs_embeds.device)
                allowed = (k_pos[None, :] <= q_pos[:, None]) & (attention_mask[0][None, :] > 0)
                mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]
            h = inputs_embeds
            outs, hidden = [], []
            for i, layer in enumerate(self.lm.layers):
                attn = layer.self_attn
                x = norm(layer.input_layernorm, h)
                q = attn.q_proj(x).view(1, T, nh, D).transpose(1, 2)
                k = attn.k_proj(x).view(1, T, KV, D).transpose(1, 2)
                v = attn.v_proj(x).view(1, T, KV, D).transpose(1, 2)
                q = q * cos + rotate_half(q) * sin
                k = k * cos + rotate_half(k) * sin
                k_all = torch.cat([past[2 * i], k], dim=2)
                v_all = torch.cat([past[2 * i + 1], v], dim=2)
                rep = nh // KV
                k_rep = k_all.repeat_interleave(rep, dim=1) if rep > 1 else k_all
                v_rep = v_all.repeat_interleave(rep, dim=1) if rep > 1 else v_all
                scores = torch.matmul(q, k_rep.transpose(2, 3)) * attn.scaling + mask
                probs = torch.softmax(scores.float(), dim=-1)
                o = torch.matmul(probs, v_rep).transpose(1, 2).reshape(1, T, nh * D)
                h = h + attn.o_proj(o)
                h = h + layer.mlp(norm(layer.post_attention_layernorm, h))
                if inject:
                    h = h + deltas[i]
                hidden.append(h)
                if fixed:
                    outs += [k, v]
                else:
                    outs += [k_all, v_all]
            normed = norm(self.lm.norm, h)
            if inject:
                normed = normed + deltas[L]
            logits = self.lm_head(normed)
            return (logits, *outs, *hidden, normed) if probe else (logits, *outs)

    kv_in = [n for i in range(L) for n in (f"past_key_{i}", f"past_value_{i}")]
    prefix = "new" if fixed else "present"
    kv_out = [n for i in range(L) for n in (f"{prefix}_key_{i}", f"{prefix}_value_{i}")]
    if fixed:
        past_len = ctx - ar
        ex = (
            torch.zeros(1, ar, H),
            torch.zeros(1, 1, ar, ctx),
            torch.zeros(1, ar, dtype=torch.int32),
            *[torch.zeros(1, KV, past_len, D) for _ in kv_in],
        )
        axes = None
    else:
        seq, past_len = 5, 3
        ex = (
            torch.zeros(1, seq, H),
            torch.ones(1, past_len + seq, dtype=torch.int64),
            torch.arange(past_len, past_len + seq)[None],
            *[torch.zeros(1, KV, past_len, D) for _ in kv_in],
        )
        axes = {"inputs_embeds": {1: "seq"}, "attention_mask": {1: "total"}, "position_ids": {1: "seq"},
                "logits": {1: "seq"}}
        axes.update({n: {2: "past"} for n in kv_in})
        axes.update({n: {2: "total"} for n in kv_out})
    names_in = ["inputs_embeds", "attention_mask", "position_ids", *kv_in]
    extra = []
    if probe:
        extra = [graph for _, graph in decoder_probe_outputs(L)]
        if inject:
            names_in += [inject_input(name) for name, _ in decoder_probe_outputs(L)]
            ex = (*ex, *[torch.zeros_like(ex[0]) for _ in range(L + 1)])
        if axes is not None:
            axes.update({n: {1: "seq"} for n in extra + names_in[3 + 2 * L:]})
    return Decoder(), ex, names_in, ["logits", *kv_out, *extra], axes


def _genie_decoder_wrapper(model, fvlm, form):
    """The decoder in Genie's QnnHtp I/O layout (see the module docstring): the host (Genie) owns the KV cache,
    the additive mask and the rotary cos/sin (half head_dim, HF's rotate_half convention)."""
    torch, F = import_torch()
    nn = torch.nn
    lm = fvlm.model.language_model
    L, KV, D, H = model.num_layers, model.num_kv_heads, model.head_dim, model.hidden_size
    nh = model.num_heads
    rep = nh // KV
    ctx = int(form.get("ctx"))
    ar = int(form.get("ar") or 1)
    by_ids = str(form.get("input") or "embeds") == "ids"
    half = D // 2
    norm = rms_norm_of(form)

    class GenieDecoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.lm = lm
            self.lm_head = fvlm.lm_head

        def forward(self, x, attention_mask, cos, sin, *past):
            h = F.embedding(x.long(), self.lm.embed_tokens.weight) if by_ids else x
            T = h.shape[1]
            mask = attention_mask[:, None]  # [1,1,T,C] broadcast over [KV,rep,T,C]

            def rope(t):  # t [.., T, D]; cos/sin [1,1,T,D/2]
                a, b = t[..., :half], t[..., half:]
                return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

            outs = []
            for i, layer in enumerate(self.lm.layers):
                attn = layer.self_attn
                xn = norm(layer.input_layernorm, h)
                q = rope(attn.q_proj(xn).view(1, T, nh, D).transpose(1, 2))  # [1,nh,T,D]
                k = rope(attn.k_proj(xn).view(1, T, KV, D).transpose(1, 2))  # [1,KV,T,D]
                v = attn.v_proj(xn).view(1, T, KV, D).transpose(1, 2)  # [1,KV,T,D]
                k_out = k.permute(1, 0, 3, 2)  # [KV,1,D,T]
                v_out = v.permute(1, 0, 2, 3)  # [KV,1,T,D]
                k_all = torch.cat([past[2 * i], k_out], dim=3)  # [KV,1,D,C]
                v_all = torch.cat([past[2 * i + 1], v_out], dim=2)  # [KV,1,C,D]
                qg = q.view(KV, rep, T, D)
                scores = torch.matmul(qg, k_all) * attn.scaling + mask  # [KV,rep,T,C]
                probs = torch.softmax(scores.float(), dim=-1)
                o = torch.matmul(probs, v_all).reshape(1, nh, T, D).transpose(1, 2).reshape(1, T, nh * D)
                h = h + attn.o_proj(o)
                h = h + layer.mlp(norm(layer.post_attention_layernorm, h))
                outs += [k_out, v_out]
            logits = self.lm_head(norm(self.lm.norm, h))
            return (logits, *outs)

    past_len = ctx - ar
    kv_in, ex_kv = [], []
    for i in range(L):
        kv_in += [f"past_key_{i}_in", f"past_value_{i}_in"]
        ex_kv += [torch.zeros(KV, 1, D, past_len), torch.zeros(KV, 1, past_len, D)]
    kv_out = [n for i in range(L) for n in (f"past_key_{i}_out", f"past_value_{i}_out")]
    first = torch.zeros(1, ar, dtype=torch.int32) if by_ids else torch.zeros(1, ar, H)
    ex = (first, torch.zeros(1, ar, ctx), torch.ones(1, 1, ar, half), torch.zeros(1, 1, ar, half), *ex_kv)
    names_in = ["input_ids" if by_ids else "inputs_embeds", "attention_mask", "position_ids_cos",
                "position_ids_sin", *kv_in]
    return GenieDecoder(), ex, names_in, ["logits", *kv_out], None


def export_lut(model, out_dir: Path) -> dict:
    """Token-embedding table: float32 [V,H] and symmetric int8 with scale = max|x| / 127."""
    from safetensors import safe_open

    table = None
    if model.streams:  # the embedding rows alone, from their shard
        table = model.read_weight(NATIVE_EMBED).numpy()
    for f in [] if table is not None else sorted(model.path.glob("*.safetensors")):
        with safe_open(str(f), framework="numpy") as st:
            for key in st.keys():
                if key.endswith("language_model.embed_tokens.weight"):
                    table = st.get_tensor(key)
    if table is None:  # e.g. bf16 weights numpy cannot read: go through torch
        torch, _ = import_torch()
        table = model.load_torch().get_input_embeddings().weight.detach().float().numpy()
    table = np.ascontiguousarray(table, dtype=np.float32)
    scale = float(np.abs(table).max() / 127.0) or 1.0
    q = np.clip(np.rint(table / scale), -127, 127).astype(np.int8)
    np.save(out_dir / "embed_lut_f32.npy", table)
    np.save(out_dir / "embed_lut_int8.npy", q)
    meta = {"vocab": table.shape[0], "hidden": table.shape[1], "int8_scale": scale, "int8_offset": 0}
    (out_dir / "embed_lut.json").write_text(json.dumps(meta))
    return {"files": ["embed_lut_f32.npy", "embed_lut_int8.npy", "embed_lut.json"], **meta}
