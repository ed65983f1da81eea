"""Perplexity of a held-out text through a bundle's own Genie text generator (libGenie's GenieAccuracy), the
device-side check that needs no host-side logits.

On a phone (stand-ins for adb and genie-app, which enforce the tool's script grammar and the accuracy config's
schema): BundlePhone.perplexity pushes the text, the configs and an ``accuracy`` script, and returns the value
genie-app wrote; a refused accuracy config and a text shorter than the context are one BackendError line each.

Not in the suite: the emulator run (vlmrun_qualcomm.genie_accuracy.perplexity). Measured 2026-11-26 on the tiny
model's bundle (2 windows of 512 tokens of chat turns): Genie 62108 against 69513 from the reference decoder over
the same windows, the rope-theta-100 bundle 75044 (not clearly apart on a model that learned only the answers), and
the worker stalled in 2 runs of about 12 until its timeout: see docs/bundles.md.
"""

from __future__ import annotations

import json
import random

import pytest

pytest.importorskip("onnxruntime_qnn")

from test_bundle import edit_json, phone, phone_bundle, phone_options  # noqa: E402,F401  (fixtures)

from vlmrun import Pipeline  # noqa: E402
from vlmrun.errors import BackendError  # noqa: E402

CTX = 512


def heldout_text(model, min_tokens: int) -> str:
    """Chat turns (question, caption answer) of generated scenes, as the model's template renders them, without
    the image placeholder (text only), until ``min_tokens`` tokens."""
    from vlmrun import shapes
    from vlmrun.preprocess import render_prompt

    rng, text = random.Random(shapes.HELDOUT_SEED), ""
    while len(model.tokenizer.encode(text, add_special_tokens=False).ids) < min_tokens:
        scene = shapes.random_scene(rng)
        kind = rng.choice(scene.kinds())
        turn = render_prompt(model.chat_template, shapes.QUESTIONS[kind]).replace("<image>\n", "")
        text += turn + scene.answer(kind) + "<|im_end|>\n"
    return text


def test_the_phone_computes_perplexity_with_genie_app(phone, phone_bundle, tiny_model, store,  # noqa: F811
                                                      monkeypatch):
    from vlmrun import layouts
    from vlmrun_qualcomm.genie_accuracy import accuracy_script

    monkeypatch.setenv("STANDIN_GENIE_PPL", "3.25")
    pipe = Pipeline.build(tiny_model, layouts.resolve(f"bundle:{phone_bundle}", options=phone_options(phone)),
                          store=store)
    run = pipe.handles["decoder"].runtime.phone
    gen = json.loads((phone_bundle / "text-generator.json").read_text())
    text = heldout_text(tiny_model, CTX + 20)
    assert run.perplexity(text, gen) == 3.25

    rd = f"/data/local/tmp/vlmrun/bundles/{phone_bundle.name}"
    log = json.loads((phone["tmp"] / "app.json").read_text())
    assert log["argv"] == ["-s", "query/script.txt"] and log["cwd"].endswith(rd)
    assert log["script"] == accuracy_script("query/text-generator.json", "query/dataset.txt", "query/accuracy.json",
                                            "query/perplexity.json").splitlines()
    assert "accuracy create accuracy accuracyConfig node textGenerator" in log["script"]
    qdir = phone["root"] / rd.lstrip("/") / "query"
    assert (qdir / "dataset.txt").read_text() == text
    assert json.loads((qdir / "accuracy.json").read_text()) == {"dataset": "query/dataset.txt", "type": "perplexity"}
    assert json.loads((qdir / "text-generator.json").read_text()) == gen

    # a bad accuracy config line: one BackendError line with Genie's reason
    import vlmrun_qualcomm.genie_accuracy as ga

    good = ga.accuracy_config
    monkeypatch.setattr(ga, "accuracy_config", lambda d: {"dataset": d, "type": "perplexity", "bogus": 1})
    with pytest.raises(BackendError) as ei:
        run.perplexity(text, gen)
    msg = str(ei.value)
    assert "\n" not in msg and "Unknown config key: bogus" in msg, msg
    # a text shorter than a context window: genie-app's failing line
    monkeypatch.setattr(ga, "accuracy_config", good)
    with pytest.raises(BackendError) as ei:
        run.perplexity("A red circle.", gen)
    assert "shorter than the context" in str(ei.value) and "\n" not in str(ei.value)
