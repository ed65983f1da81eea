"""Massive activations planted in a built FastVLM: the few huge residual-stream values real LLMs carry on the first
token and on delimiters (Sun et al. 2024, "Massive Activations in Large Language Models"), which overflow fp16.

``vlmrun make-tiny --massive-activations`` (`vlmrun.tiny.make_tiny` with ``massive_activations=True``) plants them
in the tiny model, so fp16 safety can be tested without a real checkpoint. torch is imported inside the function
only.
"""

from __future__ import annotations

from typing import Any

from vlmrun.tiny_tokenizer import _CORPUS
from vlmrun.tiny_weights import _quantize_scale

#: Planted residual-stream values (3 channels) on the first token (``<|im_start|>``, ``<|endoftext|>``) and on
#: delimiters (newline and period tokens, ``<|im_end|>``), each scaled by a seeded factor in [0.9, 1.1]. Real
#: LLMs carry such outliers (Sun et al. 2024, "Massive Activations in Large Language Models"); fp16 squares
#: overflow above 256.
MASSIVE_FIRST = (2600.0, -1500.0, 700.0)
MASSIVE_DELIMITER = (900.0, -550.0, 250.0)
_FIRST_TOKENS = ("<|endoftext|>", "<|im_start|>")
_DELIMITER_SYMBOLS = frozenset("Ċč.")  # byte-level BPE spells "\n" as "Ċ" and "\r" as "č"


def plant_massive_activations(model, tokenizer, seed: int = 0) -> dict[str, Any]:
    """Plant "massive activations" in a built model's weights (in place) and return where they are.

    As in real LLMs, layer 0's MLP writes a few residual channels in the hundreds to thousands (see
    `MASSIVE_FIRST`, `MASSIVE_DELIMITER`) on the first token and on delimiter tokens, and they ride the
    residual stream through every later layer; other tokens are untouched. How: two hidden channels are reserved
    as token-class markers (1.0 in the embedding rows of the first-token / delimiter tokens, 0 elsewhere, and
    nothing else writes them before layer 0's MLP: layer 0's o_proj and the projector's output rows are zeroed;
    the final norm ignores them, so they do not leak into the tied lm_head). One layer-0 MLP neuron per class
    reads its marker (silu(g z) * g z) and writes the planted values through down_proj. ``g`` is calibrated on a
    chat prompt so the median marker row reaches the nominal values (the others land within a factor of ~2).
    Deterministic from ``seed`` (which channels, markers and neurons come from its own generator; the
    calibration gain is rounded to a 1/16-octave grid). The fp32 model stays sane: these rows act as attention
    sinks, as in real models.
    """
    import torch

    gen = torch.Generator().manual_seed(int(seed) * 1_000_003 + 17)
    lm = model.model.language_model
    hidden, inter = lm.config.hidden_size, lm.config.intermediate_size
    vocab = tokenizer.get_vocab()
    first_ids = sorted(vocab[t] for t in _FIRST_TOKENS if t in vocab)
    delim_ids = sorted({i for t, i in vocab.items() if t and set(t) <= _DELIMITER_SYMBOLS} | {vocab["<|im_end|>"]})
    n = len(MASSIVE_FIRST)
    perm = torch.randperm(hidden, generator=gen).tolist()
    markers, channels = perm[:2], perm[2 : 2 + n]
    neurons = torch.randperm(inter, generator=gen)[:2].tolist()
    jitter = (0.9 + 0.2 * torch.rand((2, n), generator=gen)).tolist()
    layer, proj = lm.layers[0], model.model.multi_modal_projector.linear_2
    emb, mlp = lm.embed_tokens.weight, layer.mlp
    classes = list(zip(("first", "delimiter"), markers, neurons, (first_ids, delim_ids),
                       (MASSIVE_FIRST, MASSIVE_DELIMITER), jitter))
    with torch.no_grad():
        for _, t, _, ids, _, _ in classes:
            emb[:, t] = 0.0
            emb[ids, t] = 1.0
            layer.self_attn.o_proj.weight[t, :] = 0.0
            proj.weight[t, :] = 0.0
            proj.bias[t] = 0.0
            lm.norm.weight[t] = 0.0
        # what each marker reads at layer 0's MLP input on a chat prompt
        text = tokenizer.apply_chat_template([{"role": "user", "content": _CORPUS.splitlines()[0]}], tokenize=False,
                                             add_generation_prompt=True)
        ids = torch.tensor([tokenizer(text)["input_ids"]])
        seen = {}
        hook = layer.post_attention_layernorm.register_forward_hook(lambda m, i, o: seen.update(x=o[0]))
        try:
            lm(input_ids=ids)
        finally:
            hook.remove()
        act = float(torch.nn.functional.silu(torch.tensor(10.0))) * 10.0  # silu(g z) * g z at the median z
        for _, t, j, tids, values, jit in classes:
            z = float(seen["x"][torch.isin(ids[0], torch.tensor(tids)), t].median())
            g = _quantize_scale(10.0 / z)
            for w in (mlp.gate_proj.weight, mlp.up_proj.weight):
                w[j, :] = 0.0
                w[j, t] = g
            mlp.down_proj.weight[:, j] = 0.0
            for c, v, f in zip(channels, values, jit):
                mlp.down_proj.weight[c, j] = v * f / act
    return {"channels": channels, "markers": markers, "first_token_ids": first_ids, "delimiter_ids": delim_ids}
