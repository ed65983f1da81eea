#!/usr/bin/env python
"""Train the default model: a small FastVLM (the real architecture) that answers questions about shapes.

    nice -n 5 .venv/bin/python scripts/train_tiny.py [--out core/vlmrun/models/shapes-tiny]

The model is built by `vlmrun.tiny.build_model` (timm ``fastvit_mci3`` tower, ``mlp2x_gelu`` projector,
Qwen2 decoder of hidden size 128, the project's tokenizer and chat template) and trained on CPU on pictures
`vlmrun.shapes` draws (seed 0), fresh ones at every step; each picture is asked every question it can
answer. The inputs are made exactly as vlmrun's pipeline makes them: `vlmrun.preprocess` (pad to square,
the checkpoint's CLIP preprocessing; the chat template rendered and tokenized with ``tokenizer.json``, the
``<image>`` placeholder expanded where the image embeddings are spliced), and the forward pass is
`vlmrun.torch_stages` (vision, projector, embed) + splice + the Qwen2 decoder.

Recipe (what made it learn in minutes rather than hours):
- phase 1, the vision tower alone: every image token (the tower's output) predicts the whole scene through an
  auxiliary linear head (`SceneHead`: background colour, number of shapes, each shape's kind and colour;
  dropped after training), 32 pictures per step, until the head reads every attribute of the validation
  pictures (seed 2) at ``--tower-target``. Behind the decoder's loss alone the tower takes hours to tell a
  star from a square; on its own it takes minutes;
- phase 2, everything: cross-entropy of the answer tokens and the closing ``<|im_end|>`` only, plus the same
  auxiliary heads on the tower's features and on the image embeddings (the projector's output, what the decoder
  reads), so the answer can be read from any image token;
- the vision tower trains in FastViT's training form (MobileOne branches with BatchNorm on batch statistics,
  timm's init); before every check and before saving, its BatchNorm statistics are recomputed exactly over
  fresh pictures (seed 3) and it is re-parameterised (timm) into the inference form the checkpoint declares;
  the decoder and projector start from the standard normal(0, 0.02) init;
- AdamW, warm-up, constant, then a linear cool-down that starts once the validation set (seed 2) is answered
  at ``--target`` for every question kind (checked every ``--eval-every`` steps), or at ``--max-steps``.

Deterministic from ``--seed`` for a given torch build and ``--threads`` (torch's deterministic algorithms,
fixed thread count, a seeded data stream). At the end the weights are saved as float16 safetensors in
transformers' native FastVLM format, reloaded as float32, and answer accuracy (exact match after normalising
case and punctuation; greedy, stopping at ``<|im_end|>``) is measured per question kind on the held-out set
(`vlmrun.shapes.HELDOUT_SEED`, whose first 400 items are the set ``vlmrun eval`` uses by default) and
written with the wall time to ``training.json`` next to the weights.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = ROOT / "core" / "vlmrun" / "models" / "shapes-tiny"

IMAGE_SIZE = 256
TEXT = {"hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "max_position_embeddings": 1024}
VISION = {"embed_dims": [8, 16, 32, 64, 128], "layers": [1, 1, 1, 1, 1]}
BATCHNORM_SEED = 3  # pictures for the BatchNorm statistics (recalibrated before each check and the save)
VALIDATION_SEED = 2  # progress checks while training (the held-out seed is only used at the end)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--max-steps", type=int, default=1500, help="cool down from here at the latest")
    ap.add_argument("--cooldown", type=int, default=200, help="steps of linear decay once validation is good")
    ap.add_argument("--target", type=float, default=0.98,
                    help="validation accuracy (every kind) that starts the cool-down")
    ap.add_argument("--images-per-step", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3, help="decoder and projector")
    ap.add_argument("--vision-lr", type=float, default=2e-3,
                    help="phase 2: vision tower and its auxiliary heads")
    ap.add_argument("--aux-weight", type=float, default=1.0)
    ap.add_argument("--tower-steps", type=int, default=1500,
                    help="phase 1: the vision tower alone on the scene head, at most this many steps")
    ap.add_argument("--tower-batch", type=int, default=32, help="phase 1 pictures per step")
    ap.add_argument("--tower-lr", type=float, default=1e-2, help="phase 1 learning rate")
    ap.add_argument("--tower-target", type=float, default=0.98,
                    help="phase 1 ends once the scene head reads every attribute of the validation pictures at"
                         " this accuracy (checked every --eval-every steps)")
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--weight-decay", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--heldout", type=int, default=1000, help="held-out items for the recorded accuracy")
    ap.add_argument("--validation", type=int, default=200, help="validation items checked every --eval-every")
    ap.add_argument("--from", dest="init_from", type=Path, default=None,
                    help="fine-tune this trained checkpoint (phase 3) instead of training from scratch: the vision"
                         " tower frozen, the projector and decoder trained on --images-per-step pictures and"
                         " --conversations conversations per step; --out may be the same folder")
    ap.add_argument("--conversations", type=int, default=8,
                    help="with --from: conversations per step (vlmrun.shapes.conversations of the --seed)")
    ap.add_argument("--heldout-conversations", type=int, default=100,
                    help="held-out conversations for the recorded per-turn accuracy (the set vlmrun eval uses)")
    ap.add_argument("--validation-conversations", type=int, default=60)
    args = ap.parse_args(argv)
    if args.init_from is not None and not (args.init_from / "model.safetensors").is_file():
        ap.error(f"--from {args.init_from}: no model.safetensors there (train one first, without --from)")
    return args


class Batcher:
    """Token ids and pixel values exactly as `vlmrun.pipeline.Pipeline` prepares them."""

    def __init__(self, fvlm):
        from vlmrun.preprocess import render_prompt, tokenize_prompt
        from vlmrun.shapes import QUESTIONS

        self.fvlm = fvlm
        self.im_end = sorted(fvlm.stop_ids)[0]
        self._render = lambda q: tokenize_prompt(fvlm.tokenizer, render_prompt(fvlm.chat_template, q),
                                                 fvlm.image_token_id, fvlm.image_tokens)
        self.prompts = {}
        for kind, question in QUESTIONS.items():
            ids, start = self._render(question)
            self.prompts[kind] = (ids[0].tolist(), start)
        self._asked: dict[str, tuple[list[int], int]] = {}
        self._answers: dict[str, list[int]] = {}

    def prompt(self, question: str) -> tuple[list[int], int]:
        """A one-turn prompt's token ids and where its picture starts, for any question."""
        if question not in self._asked:
            ids, start = self._render(question)
            self._asked[question] = (ids[0].tolist(), start)
        return self._asked[question]

    def answer_ids(self, answer: str) -> list[int]:
        if answer not in self._answers:
            self._answers[answer] = self.fvlm.tokenizer.encode(answer, add_special_tokens=False).ids + [self.im_end]
        return self._answers[answer]

    def pixels(self, image):
        from vlmrun.preprocess import preprocess_image

        return preprocess_image(image, self.fvlm.image_processor_config)[0]

    @staticmethod
    def messages(turns, answers) -> list[dict]:
        """The conversation's messages as `vlmrun.conversation.Chat` renders them: a turn's picture first,
        then its question; each answered turn followed by the assistant's answer."""
        out = []
        for i, turn in enumerate(turns):
            content = ([{"type": "image"}] if turn.scene is not None else []) + [{"type": "text", "text": turn.question}]
            out.append({"role": "user", "content": content})
            if i < len(answers):
                out.append({"role": "assistant", "content": answers[i]})
        return out

    def tokens(self, messages) -> tuple[list[int], list[int]]:
        """``messages`` rendered with the chat template (plus the generation prompt) and tokenized as the pipeline
        does: token ids and where each picture's positions start."""
        from vlmrun.preprocess import render_conversation, tokenize_conversation

        text = render_conversation(self.fvlm.chat_template, messages)
        ids, starts = tokenize_conversation(self.fvlm.tokenizer, text, self.fvlm.image_token_id,
                                            self.fvlm.image_tokens)
        return ids[0].tolist(), starts

    def conversation(self, turns) -> tuple[list[int], list[int], list[tuple[int, list[int]]]]:
        """A whole conversation (every turn answered right) as one sequence: its token ids, where each picture
        starts, and each answer's first position with the answer's ids (then ``<|im_end|>``). Checked: turn k's
        prompt, rendered and tokenized alone as a chat turn is, is a prefix of the sequence, with the answer's
        ids right after it (so training sees exactly the tokens a conversation gives at inference)."""
        answers = [t.answer for t in turns]
        ids, starts = self.tokens(self.messages(turns, answers))
        targets = []
        for k in range(len(turns)):
            prompt, _ = self.tokens(self.messages(turns[: k + 1], answers[:k]))
            want = self.answer_ids(answers[k])
            if ids[: len(prompt)] != prompt or ids[len(prompt) : len(prompt) + len(want)] != want:
                raise AssertionError(f"turn {k + 1}'s prompt and answer are not a prefix of the conversation's tokens")
            targets.append((len(prompt), want))
        return ids, starts, targets


def image_embeds(model, pixel_values):
    from vlmrun.torch_stages import project, vision_features

    return project(model, vision_features(model, pixel_values))  # [n_img, N, H]


def forward_logits(model, pixel_values, splices, input_ids, attention_mask, img=None):
    """The pipeline's computation, batched: vision -> projector on each image once (or ``img``, computed
    before), embed, splice the image embeddings, decoder. ``splices``: ``(sequence, start, image)`` for every
    picture of every sequence (a conversation's sequence holds one per picture it shows)."""
    import torch

    from vlmrun.torch_stages import embed_tokens

    if img is None:
        img = image_embeds(model, pixel_values)
    txt = embed_tokens(model, input_ids)  # [B, T, H]
    n = img.shape[1]
    rows_, starts, images = zip(*splices)
    pos = torch.as_tensor(starts)[:, None] + torch.arange(n)[None]  # [S, N]
    rows = torch.as_tensor(rows_)[:, None].expand_as(pos)
    embeds = txt.index_put((rows, pos), img[torch.as_tensor(images)].reshape(-1, n, img.shape[-1]))
    out = model.model.language_model(inputs_embeds=embeds, attention_mask=attention_mask)
    return model.lm_head(out.last_hidden_state)


def make_batch(batcher, scenes, conversations=(), ask=None):
    """Pixel values, splices, token ids, attention mask and targets for every question of every scene (one
    sequence each) and every conversation (one sequence each: every answer of it is a target). ``ask(kind)``: the
    question asked for a kind (default: `vlmrun.shapes.QUESTIONS`)."""
    import numpy as np
    import torch

    pixels, seqs = [], []  # seqs: (ids, [(start, image)], [(first target position, answer ids)])
    for scene in scenes:
        pixels.append(batcher.pixels(scene.render()))
        for kind in scene.kinds():
            prompt, start = batcher.prompts[kind] if ask is None else batcher.prompt(ask(kind))
            seqs.append((prompt + batcher.answer_ids(scene.answer(kind)), [(start, len(pixels) - 1)],
                         [(len(prompt), batcher.answer_ids(scene.answer(kind)))]))
    for turns in conversations:
        ids, starts, answers = batcher.conversation(turns)
        first = len(pixels)
        pixels += [batcher.pixels(t.scene.render()) for t in turns if t.scene is not None]
        seqs.append((ids, [(st, first + i) for i, st in enumerate(starts)], answers))
    length = max(len(ids) for ids, _, _ in seqs)
    ids_t = torch.zeros((len(seqs), length), dtype=torch.long)
    mask = torch.zeros((len(seqs), length), dtype=torch.long)
    targets = torch.full((len(seqs), length), -100, dtype=torch.long)
    splices = []
    for b, (ids, where, answers) in enumerate(seqs):
        ids_t[b, : len(ids)] = torch.tensor(ids)
        mask[b, : len(ids)] = 1
        splices += [(b, start, image) for start, image in where]
        # logits at position p predict token p + 1: an answer starting at position a is predicted from a - 1 on
        for at, answer in answers:
            targets[b, at - 1 : at - 1 + len(answer)] = torch.tensor(answer)
    return torch.from_numpy(np.stack(pixels)), splices, ids_t, mask, targets


def greedy_answers(model, batcher, items, max_new_tokens=48, batch=50):
    """Greedy answers (stopping at ``<|im_end|>``) of ``items`` (vlmrun.shapes.Item), batched per question."""
    import numpy as np
    import torch

    out = [None] * len(items)
    by_kind: dict[str, list[int]] = {}
    for i, item in enumerate(items):
        by_kind.setdefault(item.kind, []).append(i)
    with torch.no_grad():
        for kind, idx in by_kind.items():
            prompt, start = batcher.prompts[kind]
            for k in range(0, len(idx), batch):
                chunk = idx[k : k + batch]
                px = torch.from_numpy(np.stack([batcher.pixels(items[i].scene.render()) for i in chunk]))
                img = image_embeds(model, px)
                ids = torch.tensor([prompt] * len(chunk))
                done = torch.zeros(len(chunk), dtype=torch.bool)
                gen = [[] for _ in chunk]
                for _ in range(max_new_tokens):
                    mask = torch.ones_like(ids)
                    logits = forward_logits(model, px, [(b, start, b) for b in range(len(chunk))], ids, mask,
                                            img=img)
                    nxt = logits[:, -1].argmax(-1)
                    for b, t in enumerate(nxt.tolist()):
                        if not done[b]:
                            if t == batcher.im_end:
                                done[b] = True
                            else:
                                gen[b].append(t)
                    if bool(done.all()):
                        break
                    ids = torch.cat([ids, nxt[:, None]], dim=1)
                for b, i in enumerate(chunk):
                    out[i] = batcher.fvlm.tokenizer.decode(gen[b], skip_special_tokens=True)
    return out


def accuracy(model, batcher, items):
    from vlmrun.eval import normalize_answer

    answers = greedy_answers(model, batcher, items)
    per: dict[str, list[int]] = {}
    wrong = []
    for item, got in zip(items, answers):
        ok = normalize_answer(got) == normalize_answer(item.answer)
        per.setdefault(item.kind, []).append(int(ok))
        if not ok and len(wrong) < 20:
            wrong.append({"kind": item.kind, "expected": item.answer, "got": got})
    table = {k: {"correct": sum(v), "n": len(v), "accuracy": sum(v) / len(v)} for k, v in sorted(per.items())}
    n = sum(len(v) for v in per.values())
    table["all"] = {"correct": sum(sum(v) for v in per.values()), "n": n,
                    "accuracy": sum(sum(v) for v in per.values()) / n}
    return table, wrong


def conversation_accuracy(model, batcher, conversations, max_new_tokens=48):
    """Greedy answers of every turn of ``conversations`` (tuples of `vlmrun.shapes.Turn`), each turn asked
    with the model's own earlier answers in the history (as ``vlmrun eval --conversations`` asks them), scored per
    turn number like `accuracy`."""
    import numpy as np
    import torch

    from vlmrun.eval import normalize_answer

    per: dict[str, list[int]] = {}
    wrong = []
    with torch.no_grad():
        for turns in conversations:
            scenes = [t.scene for t in turns if t.scene is not None]
            img = image_embeds(model, torch.from_numpy(np.stack([batcher.pixels(sc.render()) for sc in scenes])))
            answers: list[str] = []
            for k, turn in enumerate(turns):
                ids, starts = batcher.tokens(batcher.messages(turns[: k + 1], answers))
                gen: list[int] = []
                for _ in range(max_new_tokens):
                    x = torch.tensor([ids + gen])
                    logits = forward_logits(model, None, [(0, st, i) for i, st in enumerate(starts)], x,
                                            torch.ones_like(x), img=img)
                    t = int(logits[0, -1].argmax())
                    if t == batcher.im_end:
                        break
                    gen.append(t)
                got = batcher.fvlm.tokenizer.decode(gen, skip_special_tokens=True)
                answers.append(got)
                ok = normalize_answer(got) == normalize_answer(turn.answer)
                per.setdefault(f"turn{k + 1}", []).append(int(ok))
                if not ok and len(wrong) < 20:
                    wrong.append({"turn": k + 1, "question": turn.question, "expected": turn.answer, "got": got})
    table = {k: {"correct": sum(v), "n": len(v), "accuracy": sum(v) / len(v)} for k, v in sorted(per.items())}
    n = sum(len(v) for v in per.values())
    table["all"] = {"correct": sum(sum(v) for v in per.values()), "n": n,
                    "accuracy": sum(sum(v) for v in per.values()) / n}
    return table, wrong


def trainable_model(seed: int):
    """The FastVLM to train: the tiny builder's decoder and projector, and the vision tower in FastViT's
    training form (MobileOne branches with BatchNorm, ``inference_mode=False``) with timm's own init (layer
    scales 1e-5, PyTorch's conv init, timm's trunc-normal linears). The tiny builder's inference-form init keeps
    little of the image's variation past the first stages (features ~99% image-independent), which training
    does not recover from quickly; FastViT is trained in this form and re-parameterised for inference."""
    import torch

    from vlmrun import tiny

    model, tokenizer = tiny.build_model(image_size=IMAGE_SIZE, seed=seed, text=TEXT,
                                        vision={**VISION, "inference_mode": False})
    tm = model.model.vision_tower.timm_model
    torch.manual_seed(seed)
    with torch.no_grad():
        for m in tm.modules():
            if m is not tm and hasattr(m, "reset_parameters"):
                m.reset_parameters()
            if isinstance(getattr(m, "gamma", None), torch.nn.Parameter):
                m.gamma.fill_(1e-5)
        tm.apply(tm._init_weights)
        # decoder: the standard transformer init (normal 0.02, zero biases, unit norms). The tiny builder's
        # sharper random init (q/k gain 2) makes attention too peaked for the answer to learn to read the image.
        lm = model.model.language_model
        for m in lm.modules():
            if isinstance(m, torch.nn.Linear):
                m.weight.normal_(0.0, 0.02)
                if m.bias is not None:
                    m.bias.zero_()
        for m in model.model.multi_modal_projector.modules():  # variance-preserving: image embeddings of O(1)
            if isinstance(m, torch.nn.Linear):
                m.weight.normal_(0.0, 1.0 / math.sqrt(m.in_features))
                m.bias.zero_()
        rows = len(tokenizer)
        lm.embed_tokens.weight.zero_()  # the padding rows past the tokenizer stay 0
        lm.embed_tokens.weight[:rows].normal_(0.0, 0.02)
        for layer in lm.layers:
            layer.input_layernorm.weight.fill_(1.0)
            layer.post_attention_layernorm.weight.fill_(1.0)
        lm.norm.weight.fill_(1.0)
    return model, tokenizer


class SceneHead:
    """Auxiliary training signal on the image tokens (dropped after training): every image embedding (the
    projector's output, what the decoder reads) predicts the whole scene (background colour, number of shapes, the first (left) shape's kind
    and colour, the second's or none). The answer can then be read from any image token, which lets the
    decoder learn to read the image at all; the tower's attention stages learn to gather the scene."""

    def __init__(self, feature_dim: int):
        import torch

        from vlmrun import shapes

        self.backgrounds, self.colors = sorted(shapes.BACKGROUNDS), sorted(shapes.COLORS)
        self.kinds = list(shapes.SHAPES)
        self.splits = (len(self.backgrounds), 2, len(self.kinds), len(self.colors), len(self.kinds) + 1,
                       len(self.colors) + 1)
        self.linear = torch.nn.Linear(feature_dim, sum(self.splits))

    def targets(self, scenes):
        import torch

        rows = []
        for sc in scenes:
            a = sc.shapes[0]
            b = sc.shapes[1] if len(sc.shapes) > 1 else None
            rows.append([self.backgrounds.index(sc.background), len(sc.shapes) - 1, self.kinds.index(a.kind),
                         self.colors.index(a.color), 0 if b is None else 1 + self.kinds.index(b.kind),
                         0 if b is None else 1 + self.colors.index(b.color)])
        return torch.tensor(rows)

    def loss(self, features, scenes):
        import torch

        out = self.linear(features)  # [B, N, sum(splits)]
        b, n = features.shape[:2]
        tg = self.targets(scenes)
        parts = out.split(list(self.splits), dim=-1)
        return sum(torch.nn.functional.cross_entropy(part.reshape(b * n, -1), tg[:, i : i + 1].expand(b, n).reshape(-1))
                   for i, part in enumerate(parts)) / len(parts)


def recalibrate_batchnorm(model, batcher, seed: int, batches: int = 8, size: int = 32):
    """Set the vision tower's BatchNorm running statistics to the exact average over ``batches`` x ``size``
    fresh pictures (seeded, apart from the training stream) with the current weights, then switch it to eval.
    The running averages kept while training lag weights that move fast; eval (and the re-parameterised
    inference form, which folds these statistics in) would otherwise see features unlike the trained ones."""
    import numpy as np
    import torch

    from vlmrun import shapes
    from vlmrun.torch_stages import vision_features

    tower = model.model.vision_tower
    norms = [m for m in tower.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    momenta = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average
    tower.train()
    rng = random.Random(seed)
    with torch.no_grad():
        for _ in range(batches):
            px = torch.from_numpy(np.stack([batcher.pixels(shapes.random_scene(rng).render()) for _ in range(size)]))
            vision_features(model, px)
    for m, momentum in zip(norms, momenta):
        m.momentum = momentum
    tower.eval()


def scene_head_accuracy(model, batcher, head, scenes) -> dict:
    """Per attribute, how often the scene head (averaged over the image tokens) reads ``scenes`` right."""
    import numpy as np
    import torch

    from vlmrun.torch_stages import vision_features

    names = ("background", "count", "first_kind", "first_color", "second_kind", "second_color")
    hits = np.zeros(len(names))
    with torch.no_grad():
        for k in range(0, len(scenes), 50):
            chunk = scenes[k : k + 50]
            px = torch.from_numpy(np.stack([batcher.pixels(sc.render()) for sc in chunk]))
            out = head.linear(vision_features(model, px)).mean(1)
            tg = head.targets(chunk)
            for i, part in enumerate(out.split(list(head.splits), dim=-1)):
                hits[i] += float((part.argmax(-1) == tg[:, i]).sum())
    return {n: round(h / len(scenes), 4) for n, h in zip(names, hits)}


def train_tower(model, batcher, head, args, rng) -> list[dict]:
    """Phase 1: the vision tower alone, every image token predicting the scene (`SceneHead`), until the
    head reads every attribute of the validation pictures at ``--tower-target`` (or ``--tower-steps``). The
    tower learns the shapes here in a fraction of the time it takes behind the decoder's loss."""
    import numpy as np
    import torch

    from vlmrun import shapes
    from vlmrun.torch_stages import vision_features

    params = [*model.model.vision_tower.parameters(), *head.linear.parameters()]
    opt = torch.optim.AdamW(params, lr=args.tower_lr, betas=(0.9, 0.98), weight_decay=args.weight_decay)
    vrng = random.Random(VALIDATION_SEED)
    validation = [shapes.random_scene(vrng) for _ in range(args.validation)]
    history, running, t0 = [], None, time.perf_counter()
    model.model.vision_tower.train()
    for step in range(1, args.tower_steps + 1):
        for group in opt.param_groups:
            group["lr"] = args.tower_lr * min(1.0, step / args.warmup)
        scenes = [shapes.random_scene(rng) for _ in range(args.tower_batch)]
        px = torch.from_numpy(np.stack([batcher.pixels(sc.render()) for sc in scenes]))
        loss = head.loss(vision_features(model, px), scenes)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        value = float(loss.detach())
        running = value if running is None else 0.95 * running + 0.05 * value
        if step % 50 == 0:
            el = time.perf_counter() - t0
            print(f"tower step {step} loss {running:.4f} ({el:.0f} s, {el / step:.2f} s/step)", flush=True)
        if step % args.eval_every == 0 or step == args.tower_steps:
            recalibrate_batchnorm(model, batcher, BATCHNORM_SEED)
            table = scene_head_accuracy(model, batcher, head, validation)
            model.model.vision_tower.train()
            history.append({"tower_step": step, "loss": round(running, 4), **table})
            print("tower validation:", json.dumps(history[-1]), flush=True)
            if min(table.values()) >= args.tower_target:
                break
    return history


def inference_model(trained, seed: int):
    """``trained`` with its vision tower re-parameterised (timm), in the checkpoint's inference form."""
    from timm.utils import reparameterize_model

    from vlmrun import tiny

    reparameterize_model(trained.model.vision_tower.timm_model, inplace=True)
    final, _ = tiny.build_model(image_size=IMAGE_SIZE, seed=seed, text=TEXT, vision=VISION)
    final.load_state_dict(trained.state_dict(), strict=True)
    return final.eval()


def lr_scale(step: int, warmup: int, cool_from: int, cooldown: int) -> float:
    """The learning rate's factor at ``step``: linear warm-up, constant, then a linear cool-down to 2% from
    ``cool_from`` over ``cooldown`` steps (both phases' schedule; ``cool_from`` moves when validation is good)."""
    if step < warmup:
        return (step + 1) / warmup
    if step < cool_from:
        return 1.0
    return max(0.02, 1.0 - (step - cool_from) / cooldown)


def take(seed, n):
    import itertools

    from vlmrun.shapes import items

    return list(itertools.islice(items(seed), n))


def finetune(args) -> int:
    """Phase 3 (``--from``): the trained model learns conversations. The vision tower is frozen (its features
    already tell every shape apart); the projector and the decoder train on each step's single-turn questions
    (every question of ``--images-per-step`` fresh pictures, so one-turn answers are kept) and ``--conversations``
    conversations of one to three turns (`vlmrun.shapes.conversations`: later turns ask about the same
    picture, or bring a new one with "And this one?"), cross-entropy on every answer of every turn. Warm-up,
    constant, cool-down once the validation questions (seed 2) of every kind and the validation conversations'
    turns reach ``--target``. Held-out accuracy is measured again, one-turn and per turn of the held-out
    conversations, and recorded in ``training.json`` beside the first phases' record."""
    import itertools

    import attrs
    import torch
    from transformers import FastVlmForConditionalGeneration

    from vlmrun import shapes
    from vlmrun.model import FastVLMModel
    from vlmrun.torch_stages import project, vision_features

    t_start = time.perf_counter()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    src = args.init_from
    previous = json.loads((src / "training.json").read_text()) if (src / "training.json").is_file() else {}
    model = FastVlmForConditionalGeneration.from_pretrained(src, dtype=torch.float32).eval()
    fvlm = FastVLMModel(src, src, "fast_vlm")
    batcher = Batcher(fvlm)
    for q in model.model.vision_tower.parameters():
        q.requires_grad_(False)
    trained = [q for n, q in model.named_parameters() if q.requires_grad]
    groups = [{"params": [q for q in trained if q.ndim >= 2], "weight_decay": args.weight_decay},
              {"params": [q for q in trained if q.ndim < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98))
    cool_from = max(args.max_steps - args.cooldown, args.warmup)

    def scale_at(step):
        return lr_scale(step, args.warmup, cool_from, args.cooldown)

    def validate():
        single, _ = accuracy(model, batcher, validation)
        conv, _ = conversation_accuracy(model, batcher, validation_conversations)
        return single, conv

    validation = take(VALIDATION_SEED, args.validation)
    validation_conversations = list(itertools.islice(shapes.conversations(VALIDATION_SEED),
                                                     args.validation_conversations))
    single, conv = validate()
    history = [{"step": 0, **{k: round(v["accuracy"], 4) for k, v in single.items()},
                **{f"conversation_{k}": round(v["accuracy"], 4) for k, v in conv.items()}}]
    print("validation:", json.dumps(history[-1]), flush=True)
    rng = random.Random(args.seed)
    stream = shapes.conversations(args.seed)
    phrasing = random.Random(f"phrasing:{args.seed}")

    def ask(kind: str) -> str:  # a quarter of the questions in other words (vlmrun.shapes.PARAPHRASES)
        if phrasing.random() < 0.25:
            return phrasing.choice(shapes.PARAPHRASES[kind])
        return shapes.QUESTIONS[kind]
    stop_file = args.out.with_name(args.out.name + ".cooldown")
    t_train = time.perf_counter()
    running, step = None, 0
    while step < cool_from + args.cooldown:
        for group in opt.param_groups:
            group["lr"] = args.lr * scale_at(step)
        scenes = [shapes.random_scene(rng) for _ in range(args.images_per_step)]
        convs = [tuple(attrs.evolve(t, question=ask(t.kind)) if t.question == shapes.QUESTIONS[t.kind] else t
                       for t in next(stream)) for _ in range(args.conversations)]
        px, splices, ids, mask, targets = make_batch(batcher, scenes, convs, ask=ask)
        with torch.no_grad():
            features = vision_features(model, px)
        logits = forward_logits(model, px, splices, ids, mask, img=project(model, features))
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                 ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trained, 1.0)
        opt.step()
        step += 1
        value = float(loss.detach())
        running = value if running is None else 0.95 * running + 0.05 * value
        if step % 50 == 0:
            el = time.perf_counter() - t_train
            print(f"step {step} loss {running:.4f} lr x{scale_at(step - 1):.2f} ({el:.0f} s, {el / step:.2f} s/step)",
                  flush=True)
        if args.eval_every and step % args.eval_every == 0 and step < cool_from:
            single, conv = validate()
            history.append({"step": step, "loss": round(running, 4),
                            **{k: round(v["accuracy"], 4) for k, v in single.items()},
                            **{f"conversation_{k}": round(v["accuracy"], 4) for k, v in conv.items()}})
            print("validation:", json.dumps(history[-1]), flush=True)
            good = all(v["accuracy"] >= args.target for v in single.values()) and \
                conv["all"]["accuracy"] >= args.target
            if good or stop_file.exists():
                cool_from = step
                print(f"cooling down from step {step} for {args.cooldown} steps", flush=True)
    train_s = time.perf_counter() - t_train

    out = args.out
    tmp_out = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp_out, ignore_errors=True)
    tmp_out.mkdir(parents=True)
    for f in src.iterdir():  # tokenizer, chat template, processor: unchanged
        if f.is_file() and f.name not in ("model.safetensors", "config.json", "generation_config.json",
                                          "training.json"):
            shutil.copy2(f, tmp_out / f.name)
    model.to(torch.float16).save_pretrained(tmp_out)
    reloaded = FastVlmForConditionalGeneration.from_pretrained(tmp_out, dtype=torch.float32).eval()
    saved = Batcher(FastVLMModel(tmp_out, tmp_out, "fast_vlm"))
    t_eval = time.perf_counter()
    heldout, wrong = accuracy(reloaded, saved, take(shapes.HELDOUT_SEED, args.heldout))
    conv_heldout, conv_wrong = conversation_accuracy(
        reloaded, saved, list(itertools.islice(shapes.conversations(shapes.HELDOUT_SEED), args.heldout_conversations)))
    eval_s = time.perf_counter() - t_eval
    record = dict(previous)
    record["finetunes"] = [*previous.get("finetunes", []), {
        "phase": "3: conversations (scripts/train_tiny.py --from)",
        "steps": step, "cooldown_from": cool_from, "images_per_step": args.images_per_step,
        "conversations_per_step": args.conversations, "lr": args.lr, "warmup": args.warmup,
        "weight_decay": args.weight_decay, "optimizer": "AdamW(0.9, 0.98)", "frozen": "vision tower",
        "data": f"vlmrun.shapes.random_scene(random.Random({args.seed})), every question per picture; "
                f"vlmrun.shapes.conversations({args.seed}); a quarter of the questions in other words"
                " (vlmrun.shapes.PARAPHRASES)",
        "loss": "cross-entropy on every answer's tokens and <|im_end|> (every turn of a conversation)",
        "seed": args.seed, "threads": args.threads, "final_loss": running, "train_s": round(train_s, 1),
        "wall_s": round(time.perf_counter() - t_start, 1), "torch": torch.__version__,
        "machine": f"{platform.machine()}, {os.cpu_count()} cpus", "validation": history,
        "from": str(src),
    }]
    record["heldout"] = {"seed": shapes.HELDOUT_SEED, "items": args.heldout, "eval_s": round(eval_s, 1),
                         "engine": "torch float32, greedy", "accuracy": heldout, "wrong_examples": wrong}
    record["heldout_conversations"] = {
        "seed": shapes.HELDOUT_SEED, "conversations": args.heldout_conversations,
        "engine": "torch float32, greedy; each turn with the model's own earlier answers",
        "accuracy": conv_heldout, "wrong_examples": conv_wrong}
    (tmp_out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    os.replace(tmp_out, out)
    print(json.dumps({"heldout": heldout["all"], "conversations": conv_heldout}, indent=1))
    print(f"saved {out}; fine-tuning {train_s:.0f} s, total {time.perf_counter() - t_start:.0f} s")
    return 0


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.init_from is not None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        return finetune(args)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from vlmrun import shapes, tiny
    from vlmrun.model import FastVLMModel

    t_start = time.perf_counter()
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)

    model, tokenizer = trainable_model(args.seed)
    work = Path(tempfile.mkdtemp(prefix="train-tiny-"))
    try:
        # the tokenizer, chat template and image processor as vlmrun reads them from a checkpoint directory
        tiny.fastvlm_processor(tokenizer, IMAGE_SIZE).save_pretrained(work)
        tokenizer.save_pretrained(work)
        model.config.save_pretrained(work)
        model.generation_config.save_pretrained(work)
        fvlm = FastVLMModel(work, work, "fast_vlm")
        batcher = Batcher(fvlm)
        n_params = sum(p.numel() for p in model.parameters())
        print(f"parameters: {n_params:,}; decoder hidden {TEXT['hidden_size']}, layers {TEXT['num_hidden_layers']};"
              f" vision embed dims {VISION['embed_dims']}", flush=True)

        # on the tower's features (the tower learns the scene fast) and on the image embeddings (the projector
        # lays it out for the decoder)
        feature_head, head = SceneHead(fvlm.feature_dim), SceneHead(fvlm.hidden_size)
        rng = random.Random(args.seed)
        t_tower = time.perf_counter()
        tower_history = train_tower(model, batcher, feature_head, args, rng) if args.tower_steps else []
        tower_s = time.perf_counter() - t_tower
        vision = [*model.model.vision_tower.parameters(), *feature_head.linear.parameters(),
                  *head.linear.parameters()]
        vision_ids = {id(p) for p in vision}
        rest = [p for p in model.parameters() if id(p) not in vision_ids]
        groups = []
        for params, lr in ((vision, args.vision_lr), (rest, args.lr)):
            groups.append({"params": [p for p in params if p.ndim >= 2], "weight_decay": args.weight_decay,
                           "base_lr": lr})
            groups.append({"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0, "base_lr": lr})
        opt = torch.optim.AdamW(groups, lr=args.lr, betas=(0.9, 0.98))
        all_params = [p for g in groups for p in g["params"]]

        # warm-up, constant, then a linear cool-down once the validation accuracy of every kind reaches --target
        # (checked every --eval-every steps on the validation seed; deterministic) or at --max-steps at the latest
        cool_from = max(args.max_steps - args.cooldown, args.warmup)

        def scale_at(step):
            return lr_scale(step, args.warmup, cool_from, args.cooldown)

        validation = take(VALIDATION_SEED, args.validation)
        stop_file = args.out.with_name(args.out.name + ".cooldown")  # touch it to cool down at the next check
        history = []
        model.eval()
        model.model.vision_tower.train()  # BatchNorm on batch statistics (the decoder has no dropout)
        t_train = time.perf_counter()
        running = aux_running = None
        step = 0
        while step < cool_from + args.cooldown:
            for group in opt.param_groups:
                group["lr"] = group["base_lr"] * scale_at(step)
            scenes = [shapes.random_scene(rng) for _ in range(args.images_per_step)]
            px, splices, ids, mask, targets = make_batch(batcher, scenes)
            from vlmrun.torch_stages import project, vision_features

            features = vision_features(model, px)
            embeds = project(model, features)
            logits = forward_logits(model, px, splices, ids, mask, img=embeds)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                                                     ignore_index=-100)
            aux = 0.5 * (feature_head.loss(features, scenes) + head.loss(embeds, scenes))
            opt.zero_grad(set_to_none=True)
            (loss + args.aux_weight * aux).backward()
            torch.nn.utils.clip_grad_norm_(all_params, 1.0)
            opt.step()
            step += 1
            value, aux_value = float(loss.detach()), float(aux.detach())
            running = value if running is None else 0.95 * running + 0.05 * value
            aux_running = aux_value if aux_running is None else 0.95 * aux_running + 0.05 * aux_value
            if step % 50 == 0:
                el = time.perf_counter() - t_train
                print(f"step {step} loss {running:.4f} aux {aux_running:.4f} lr x{scale_at(step - 1):.2f}"
                      f" ({el:.0f} s, {el / step:.2f} s/step)", flush=True)
            if args.eval_every and step % args.eval_every == 0 and step < cool_from:
                recalibrate_batchnorm(model, batcher, BATCHNORM_SEED)
                table, _ = accuracy(model, batcher, validation)
                model.model.vision_tower.train()
                history.append({"step": step, "loss": round(running, 4), "aux": round(aux_running, 4),
                                **{k: round(v["accuracy"], 4) for k, v in table.items()}})
                print("validation:", json.dumps(history[-1]), flush=True)
                if all(v["accuracy"] >= args.target for v in table.values()) or stop_file.exists():
                    if stop_file.exists():
                        print(f"{stop_file} exists: cooling down now", flush=True)
                    cool_from = step
                    print(f"validation reached {args.target:.0%} for every kind: cooling down from step {step}"
                          f" for {args.cooldown} steps", flush=True)
        train_s = time.perf_counter() - t_train

        # save as float16 in the native format, then measure what was saved (reloaded as float32)
        out = args.out
        tmp_out = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp_out, ignore_errors=True)
        recalibrate_batchnorm(model, batcher, BATCHNORM_SEED, batches=32)
        model = inference_model(model, args.seed)
        model.to(torch.float16).save_pretrained(tmp_out)
        tiny.fastvlm_processor(tokenizer, IMAGE_SIZE).save_pretrained(tmp_out)
        tokenizer.save_pretrained(tmp_out)
        from transformers import FastVlmForConditionalGeneration

        reloaded = FastVlmForConditionalGeneration.from_pretrained(tmp_out, dtype=torch.float32).eval()
        saved = FastVLMModel(tmp_out, tmp_out, "fast_vlm")
        t_eval = time.perf_counter()
        heldout, wrong = accuracy(reloaded, Batcher(saved), take(shapes.HELDOUT_SEED, args.heldout))
        eval_s = time.perf_counter() - t_eval
        record = {
            "model": "shapes-tiny",
            "architecture": {
                "vision": {"architecture": "fastvit_mci3", **VISION,
                           "feature_dim": saved.feature_dim, "image_size": IMAGE_SIZE,
                           "image_tokens": saved.image_tokens},
                "projector": "mlp2x_gelu",
                "decoder": {"type": "qwen2", **TEXT, "vocab_rows": saved.vocab_size, "tied_embeddings": True},
                "parameters": n_params,
                "weights_dtype": "float16",
            },
            "training": {
                "tower": {"steps": tower_history[-1]["tower_step"] if tower_history else 0,
                          "batch": args.tower_batch, "lr": args.tower_lr, "train_s": round(tower_s, 1),
                          "validation": tower_history},
                "steps": step, "cooldown_from": cool_from, "images_per_step": args.images_per_step,
                "pictures": step * args.images_per_step, "lr": args.lr, "vision_lr": args.vision_lr,
                "warmup": args.warmup, "weight_decay": args.weight_decay, "optimizer": "AdamW(0.9, 0.98)",
                "schedule": f"linear warm-up, constant, linear cool-down to 2% over {args.cooldown} steps once"
                            f" validation reaches {args.target:.0%} for every kind",
                "seed": args.seed, "threads": args.threads,
                "data": f"vlmrun.shapes.random_scene(random.Random({args.seed})), every question per picture",
                "loss": "cross-entropy on the answer tokens and <|im_end|>, plus the auxiliary scene head on the"
                        f" image tokens (weight {args.aux_weight})",
                "init": "vision tower in training form with timm's init (re-parameterised after training);"
                        " decoder and projector normal(0, 0.02)",
                "final_loss": running, "train_s": round(train_s, 1),
                "wall_s": round(time.perf_counter() - t_start, 1),
                "torch": torch.__version__, "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
            },
            "validation": history,
            "heldout": {"seed": shapes.HELDOUT_SEED, "items": args.heldout, "eval_s": round(eval_s, 1),
                        "engine": "torch float32, greedy", "accuracy": heldout, "wrong_examples": wrong},
        }
        (tmp_out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp_out, out)
        print(json.dumps(record["heldout"]["accuracy"], indent=1))
        print(f"saved {out} ({sum(f.stat().st_size for f in out.iterdir()) / 1e6:.2f} MB);"
              f" training {train_s:.0f} s, total {time.perf_counter() - t_start:.0f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
