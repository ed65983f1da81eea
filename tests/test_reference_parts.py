"""The reference decoder part by part (ort_reference ``-o decoder.parts=N``, `vlmrun_ort_reference.streamed`): what
runs FastVLM-7B's 28 GB float32 decoder on this 24 GB machine. On the tiny model it gives the whole reference's
tokens and, within float32 rounding, its logits; holds a conversation on its kept keys; streams its parts (each
session opened when its rows come, once per prefill and once per generated token); plans its parts from the memory
budget; and serves as the reference side of ``vlmrun diff --locate``."""

from __future__ import annotations

import types

import numpy as np
import pytest

from vlmrun import GenerationSettings, Pipeline, diff
from vlmrun.diff import locate as loc
from vlmrun.errors import UsageError

from conftest import run_cli

SETTINGS = GenerationSettings(max_new_tokens=24)
FIRST = "A red circle on a blue background."


@pytest.fixture(scope="module")
def picture():
    from vlmrun.demo_image import demo_image

    return demo_image()


@pytest.fixture(scope="module")
def parts_pipe(tiny_model, store):
    return Pipeline.build(tiny_model, "reference", options={"decoder": {"parts": 2}}, store=store)


def test_the_reference_in_parts_gives_the_whole_references_tokens_and_logits(tiny_model, store, ref_pipe, parts_pipe,
                                                                              picture):
    from vlmrun_ort_reference.streamed import PartsDecoder

    dec = parts_pipe.handles["decoder"]
    assert isinstance(dec, PartsDecoder) and dec.layers == [(0, 2), (2, 3)] and dec.graphs.keep
    assert dec.context_length == 1024  # the tiny model's own context (1024 < 2048)
    whole = ref_pipe.generate(picture, "Describe the image.", SETTINGS).run()
    parts = parts_pipe.generate(picture, "Describe the image.", SETTINGS).run()
    assert parts.text == whole.text == FIRST and parts.token_ids == whole.token_ids
    # teacher forced over the prompt and the answer (88 rows: one prompt-graph call per part)
    run = diff.run("reference", "reference,decoder.parts=2", model=tiny_model, store=store, max_new_tokens=20,
                   ignore_eos=True)
    assert run.result.passed
    embeds = loc.probe_inputs("decoder", run.reference, ref_pipe.embed_tokens)
    a = ref_pipe.run_stage("decoder", embeds)["logits"]
    b = parts_pipe.run_stage("decoder", embeds)["logits"]
    assert a.shape == b.shape == (1, 68 + 20, tiny_model.vocab_size)
    np.testing.assert_allclose(b, a, atol=1e-4, rtol=0)
    assert (a.argmax(-1) == b.argmax(-1)).all()

    # three parts, streamed: every session closed after its part's rows (no memory to keep them), so a prefill
    # opens each part's prompt graph once and each generated token each part's token graph once
    three = Pipeline.build(tiny_model, "reference", options={"decoder": {"parts": 3}}, store=store)
    art = three.handles["decoder"].artifacts[0]
    streamed = PartsDecoder(art, tiny_model, keep_bytes=0)
    assert not streamed.graphs.keep and streamed.layers == [(0, 1), (1, 2), (2, 3)]
    three.handles["decoder"] = streamed
    g = three.generate(picture, "Describe the image.", SETTINGS).run()
    assert g.token_ids == whole.token_ids
    assert streamed.graphs.opened == 3 * len(whole.token_ids)  # 3 for the prefill, 3 per token fed after it
    assert streamed.graphs._open == {}


def test_a_conversation_continues_on_the_kept_keys_in_parts(ref_pipe, parts_pipe, picture):
    def converse(pipe, keep_state):
        chat = pipe.chat(settings=SETTINGS, keep_state=keep_state)
        out = []
        for i, q in enumerate(["Describe the image.", "What color is the shape?", "What shape is it?"]):
            g = chat.ask(q, image=picture if i == 0 else None).run()
            out.append((g.text, list(g.token_ids), g.timings["prefill_tokens"], g.timings["reused_tokens"]))
        return out

    kept = converse(parts_pipe, True)
    assert [t[0] for t in kept] == [FIRST, "Red.", "A circle."]
    assert [t[2:] for t in kept] == [(68, 0), (27, 87), (24, 118)]  # a follow-up feeds only its new positions
    assert [t[:2] for t in kept] == [t[:2] for t in converse(ref_pipe, True)]
    assert [t[:2] for t in kept] == [t[:2] for t in converse(parts_pipe, False)]


def _model(layers, hidden, heads, kv_heads, mlp, vocab):
    return types.SimpleNamespace(num_layers=layers, hidden_size=hidden, num_heads=heads, num_kv_heads=kv_heads,
                                 head_dim=hidden // heads, vocab_size=vocab, text_config={"intermediate_size": mlp})


QWEN2_7B = _model(28, 3584, 28, 4, 18944, 152064)
QWEN2_05B = _model(24, 896, 14, 2, 4864, 151936)


def test_parts_are_planned_from_the_memory_budget(monkeypatch):
    from vlmrun.checkpoint_stream import export_peak_bytes
    from vlmrun_ort_reference.streamed import head_bytes, layer_bytes, plan_layers

    assert layer_bytes(QWEN2_7B) == 4 * 233_057_792  # Qwen2-7B: 28 layers of 233.1M parameters
    assert head_bytes(QWEN2_7B) == 4 * (152064 * 3584 + 3584)
    monkeypatch.setenv("VLMRUN_MEMORY_BUDGET_GB", "14")
    assert plan_layers(QWEN2_05B, 0) == [24]  # 1.98 GB of float32 weights: one part, today's whole session
    plan = plan_layers(QWEN2_7B, 0)
    assert plan == [3] * 9 + [1]  # 3 layers (2.8 GB) fit beside 4 copies, the lm_head (2.2 GB) only with 1
    for k, n in enumerate(plan):
        weights = n * layer_bytes(QWEN2_7B) + (head_bytes(QWEN2_7B) if k == len(plan) - 1 else 0)
        assert export_peak_bytes(weights) <= 14e9
    assert plan_layers(QWEN2_7B, 5) == [6, 6, 6, 5, 5]  # given: even, the first ones a layer more
    monkeypatch.setattr("vlmrun_ort_reference.streamed.physical_memory", lambda: 24 * 2**30)
    assert plan_layers(QWEN2_05B, 1) == [24]
    with pytest.raises(UsageError, match=r"^the reference decoder in one session holds 28\.3 GB of float32 weights,"
                                         r" more than this machine's 25\.8 GB of memory; run it part by part: -o"
                                         r" decoder\.parts=0"):
        plan_layers(QWEN2_7B, 1)
    with pytest.raises(UsageError, match="at most 28 parts"):
        plan_layers(QWEN2_7B, 29)
    monkeypatch.setenv("VLMRUN_MEMORY_BUDGET_GB", "4")
    with pytest.raises(UsageError, match=r"needs about 13\.52 GB for its part with one layer and the lm_head"):
        plan_layers(QWEN2_7B, 0)


def test_locate_names_the_drifting_layer_against_the_reference_in_parts(tiny_model, store):
    """The reference side of --locate in parts (every part's probe graph, part by part); the device a backend that
    perturbs decoder.layer1 (test_locate's)."""
    from test_locate import PROMPT, perturb_module, registry_with

    run = diff.run("reference,decoder.parts=2", diff.Side("reference", {"decoder": "perturb"}), prompt=PROMPT,
                   model=tiny_model, store=store, registry=registry_with(perturb_module("decoder.layer1")),
                   max_new_tokens=6, ignore_eos=True)
    ref = run.pipelines["reference"]
    assert type(ref.handles["decoder"]).__name__ == "PartsDecoder" and not run.result.passed
    found = loc.locate(ref, run.pipelines["device"], "decoder", run.reference, run.result.thresholds)
    assert [p.name for p in found.points] == ["decoder.layer0", "decoder.layer1", "decoder.layer2", "decoder.norm",
                                              "decoder.lm_head"]
    assert found.located == "decoder.layer1" and found.largest_drop.name == "decoder.layer1"
    assert found.points[0].metrics["sqnr_db"] > 100  # the part graphs compute the whole reference's layer 0
    assert -15 < found.points[1].metrics["sqnr_db"] < -8
    assert not found.isolated and any("does not take injected inputs" in n for n in found.notes)


def test_the_cli_takes_parts_and_refuses_more_parts_than_layers(cache_dir, image_path):
    r = run_cli(["-o", "decoder.parts=3", "--image", str(image_path), "--prompt", "Describe the image."], cache_dir)
    assert r.returncode == 0 and r.stdout.strip() == FIRST, r.stderr
    r = run_cli(["-o", "decoder.parts=4", "--image", str(image_path), "--prompt", "Describe the image."], cache_dir)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1] == ("vlmrun: error: decoder.parts 4: the model's decoder has 3 layers,"
                                                 " so at most 3 parts")
    assert "Traceback" not in r.stderr
