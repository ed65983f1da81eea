"""The tiny FastVLM's weight init: variance-preserving, seeded, and chosen so every stage carries signal.

timm's default init (layer scales of 1e-5) makes the vision tower's output about 1e-26, so every numeric
comparison would pass trivially. Here the vision features have a std of O(0.1..1), the projector is scaled so
image embeddings have the std of the text token embeddings, and greedy generation does not collapse into one
repeated token. `vlmrun.tiny.build_model` calls these on a model whose weights are all NaN, so a weight they miss
is caught; `vlmrun.family` uses the same rules for its larger sizes.

torch is imported inside the functions only.
"""

from __future__ import annotations

import math


def init_projector(model, gen, image_size: int, embed_std: float) -> None:
    """Initialise the projector, then scale ``linear_2`` so image embeddings have the token embeddings' std
    (``embed_std``), measured on one random picture through the (already initialised) vision tower."""
    import torch

    projector = model.model.multi_modal_projector
    with torch.no_grad():
        _init_linear(projector.linear_1, gen, 1.0 / math.sqrt(projector.linear_1.in_features))
        _init_linear(projector.linear_2, gen, 1.0 / math.sqrt(projector.linear_2.in_features))
        pixels = torch.rand((1, 3, image_size, image_size), generator=gen)
        embeds = model.get_image_features(pixel_values=pixels).pooler_output
        scale = _quantize_scale(embed_std / float(embeds.std()))
        projector.linear_2.weight.mul_(scale)
        projector.linear_2.bias.mul_(scale)


def init_vision(timm_model, gen) -> None:
    """Variance-preserving re-init of the FastViTHD tower (timm's init scales every residual branch by 1e-5)."""
    import torch
    from torch import nn

    def normal_(t, std):
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32) * std)

    def uniform_(t, lo, hi):
        t.copy_(lo + (hi - lo) * torch.rand(t.shape, generator=gen, dtype=torch.float32))

    # residual branches are scaled by 1/sqrt(blocks in the stage) so deep stages (24 blocks) do not blow up
    depth_of = {}
    for si, stage in enumerate(timm_model.stages):
        for name, _ in stage.named_modules():
            depth_of[f"stages.{si}.{name}" if name else f"stages.{si}"] = len(stage.blocks)

    with torch.no_grad():
        for name, mod in timm_model.named_modules():
            if isinstance(mod, nn.Conv2d):
                w = mod.weight
                fan_in = w[0].numel()
                k_h, k_w = w.shape[-2:]
                identity_like = (
                    name.endswith("token_mixer.reparam_conv") or name.endswith("pos_emb.reparam_conv")
                ) and mod.groups == mod.in_channels == mod.out_channels
                if identity_like:
                    # RepMixer / conditional positional encoding fold "x + f(x)" into one depthwise conv
                    normal_(w, 0.5 / math.sqrt(fan_in))
                    w[:, 0, k_h // 2, k_w // 2] += 1.0
                else:
                    normal_(w, 1.0 / math.sqrt(fan_in))
                if mod.bias is not None:
                    normal_(mod.bias, 0.02)
            elif isinstance(mod, nn.Linear):
                normal_(mod.weight, 1.0 / math.sqrt(mod.in_features))
                if mod.bias is not None:
                    normal_(mod.bias, 0.02)
            elif isinstance(mod, nn.modules.batchnorm._BatchNorm):
                uniform_(mod.weight, 0.8, 1.2)
                normal_(mod.bias, 0.05)
                normal_(mod.running_mean, 0.05)
                uniform_(mod.running_var, 0.8, 1.2)
            elif isinstance(mod, nn.LayerNorm):  # LayerNorm2d
                mod.weight.copy_(1.0 + 0.05 * torch.randn(mod.weight.shape, generator=gen))
                normal_(mod.bias, 0.05)
            elif hasattr(mod, "gamma") and isinstance(mod.gamma, nn.Parameter):  # LayerScale2d
                stage_name = name.rsplit(".blocks.", 1)[0]
                scale = 1.0 / math.sqrt(depth_of.get(stage_name, 1))
                uniform_(mod.gamma, 0.5 * scale, 1.0 * scale)


def _init_linear(linear, gen, std: float, bias_std: float = 0.02) -> None:
    import torch

    linear.weight.copy_(torch.randn(linear.weight.shape, generator=gen) * std)
    if linear.bias is not None:
        linear.bias.copy_(torch.randn(linear.bias.shape, generator=gen) * bias_std)


def _init_text(lm, gen, n_tokens: int, embed_std: float) -> None:
    """Qwen2 init that makes greedy decoding depend on the context (not just echo the last token)."""
    import torch

    with torch.no_grad():
        emb = lm.embed_tokens.weight
        emb.zero_()  # rows past the tokenizer (vocabulary padding) stay 0, so they never win the argmax
        emb[:n_tokens].copy_(torch.randn((n_tokens, emb.shape[1]), generator=gen) * embed_std)
        # q/k gain 2: sharp, content-dependent attention. Residual branches (v, o, down) gain 2 * sqrt(2 / layers)
        # (2 for the tiny model, 0.58 for 24 layers): the layers dominate the tied token embedding in the residual
        # stream without swamping each other. With gain 1 everywhere greedy decoding just echoes one token.
        resid = 2.0 * math.sqrt(2.0 / len(lm.layers))
        for layer in lm.layers:
            attn, mlp = layer.self_attn, layer.mlp
            for lin, gain in (
                (attn.q_proj, 2.0), (attn.k_proj, 2.0), (attn.v_proj, resid), (attn.o_proj, resid),
                (mlp.gate_proj, 1.0), (mlp.up_proj, 1.0), (mlp.down_proj, resid),
            ):  # fmt: skip
                _init_linear(lin, gen, gain / math.sqrt(lin.in_features))
            for norm in (layer.input_layernorm, layer.post_attention_layernorm):
                norm.weight.copy_(1.0 + 0.05 * torch.randn(norm.weight.shape, generator=gen))
        lm.norm.weight.copy_(1.0 + 0.05 * torch.randn(lm.norm.weight.shape, generator=gen))


def _quantize_scale(x: float) -> float:
    """Round a calibration factor to a 1/16-octave grid so float noise cannot change the saved bytes."""
    return 2.0 ** (round(16.0 * math.log2(x)) / 16.0)
