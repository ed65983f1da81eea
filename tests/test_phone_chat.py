"""Conversations on a phone: Genie's dialog state kept there between turns by genie-app's dialog commands (the
decoder through Genie on the phone's HTP, qnn_htp engine genie with ``--target android``). Each turn is one genie-app
script that restores the state the previous turn saved, queries only the turn's new rows and saves the new state.
Stand-ins for adb, genie-app and genie-t2t-run (tests/standins/) enforce the tools' files and script lines; with
``STANDIN_GENIE_TEXT=@model`` both Genie stand-ins answer with tokens that follow from every row the dialog holds
(tests/standins/genie_model.py), so a continued conversation equals the one computed from scratch only when the
state on the phone holds exactly the conversation. A bundle on a phone keeps its conversation in Genie's pipeline the
same way (genie-app's ``pipeline restore`` / ``pipeline save``; the stand-in's pipeline holds what its inputs and
answers added), and every phone path streams its answer as the tool prints it ($STANDIN_GENIE_DELAY)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime_qnn")

from vlmrun import GenerationSettings, Pipeline  # noqa: E402
from vlmrun.errors import BackendError  # noqa: E402
from vlmrun_qualcomm.genie_app import dialog_script  # noqa: E402

from test_genie_phone import RD, STANDINS, layout, phone  # noqa: E402,F401 (the phone fixture)

QUESTIONS = ["Describe the image.", "What color is the shape?", "What shape is it?"]
SETTINGS = GenerationSettings(max_new_tokens=8)


@pytest.fixture
def chat_phone(phone, monkeypatch):  # noqa: F811
    """The phone with the SDK's genie-app, both Genie stand-ins answering from what the dialog holds."""
    (Path(phone["sdk_root"]) / "bin" / "aarch64-android" / "genie-app").symlink_to(STANDINS / "genie-app")
    monkeypatch.setenv("STANDIN_GENIE_TEXT", "@model")
    monkeypatch.setenv("STANDIN_GENIE_APP_LOG", str(phone["tmp"] / "app.json"))
    return phone


@pytest.fixture
def chat_pipe(chat_phone, tiny_model, store):
    return Pipeline.build(tiny_model, layout(chat_phone, decoder_only=True, context_length=256), store=store)


def app_script(where) -> list[str]:
    return json.loads((where["tmp"] / "app.json").read_text())["script"]


def converse(pipe, image, keep_state=True, questions=QUESTIONS, where=None):
    chat = pipe.chat(settings=SETTINGS, keep_state=keep_state)
    turns, scripts = [], []
    for i, q in enumerate(questions):
        g = chat.ask(q, image=image if i == 0 else None).run()
        turns.append(g)
        if where is not None:
            scripts.append(app_script(where))
    return chat, turns, scripts


def script_of(d: str, n: int, restore: int | None = None) -> list[str]:
    return dialog_script(f"{d}/genie_config.json", f"{d}/turn_{n}.raw", "embed_lut_f32.raw", f"{d}/turn_{n}",
                         f"{d}/turn_{restore}" if restore else None).splitlines()


def test_a_phone_keeps_the_conversation_between_turns(chat_phone, chat_pipe, image_path):
    device = chat_phone
    chat, kept, scripts = converse(chat_pipe, image_path, where=device)
    assert chat.keeps_state
    _, scratch, _ = converse(chat_pipe, image_path, keep_state=False)
    # the same tokens as the conversation computed from scratch (genie-t2t-run over every row, each turn)
    assert [(g.text, g.token_ids) for g in kept] == [(g.text, g.token_ids) for g in scratch]
    assert len({g.text for g in kept}) == 3 and all(g.token_ids for g in kept)  # answers that follow the history
    state = chat.kept.state
    d = state.dir
    # turn 1: a new dialog; turn n: restores turn n-1's state and queries only the turn's new rows
    assert scripts == [script_of(d, 1), script_of(d, 2, 1), script_of(d, 3, 2)]
    on_phone = device["dir"] / d
    for n, g in enumerate(kept, start=1):
        rows = np.fromfile(on_phone / f"turn_{n}.raw", np.float32).reshape(-1, chat_pipe.model.hidden_size)
        assert rows.shape[0] == g.timings["prefill_tokens"] and np.array_equal(rows, g.tensors["inputs_embeds"][0])
        assert json.loads((on_phone / f"turn_{n}" / "dialog.json").read_text())["n-past"] == \
            g.timings["prefill_tokens"] + g.timings["reused_tokens"] + len(g.token_ids)
    assert [g.timings["reused_tokens"] for g in kept][0] == 0 and all(g.timings["reused_tokens"] > 0 for g in kept[1:])
    assert all(g.timings["reused_tokens"] == 0 for g in scratch)
    assert state.length == chat.tokens and [n for n, _ in state.saves] == [
        g.timings["prefill_tokens"] + g.timings["reused_tokens"] + len(g.token_ids) for g in kept]
    assert state.device_bytes > 0 and chat.kept.nbytes > state.rows.nbytes
    # an undo: the next turn restores the state saved before the undone turn, the rows after it fed again
    chat.undo()
    again = chat.ask("How many shapes are there?").run()
    assert app_script(device) == script_of(d, 4, 2)
    assert not (on_phone / "turn_3").exists()  # the undone turn's state is gone from the phone
    fresh, want, _ = converse(chat_pipe, image_path, keep_state=False,
                              questions=QUESTIONS[:2] + ["How many shapes are there?"])
    assert (again.text, again.token_ids) == (want[-1].text, want[-1].token_ids)
    chat.reset()
    assert not on_phone.exists() and state.length == 0


def test_a_saved_state_gone_from_the_phone_is_a_clear_error(chat_phone, chat_pipe, image_path):
    import shutil

    chat, kept, _ = converse(chat_pipe, image_path, questions=QUESTIONS[:2])
    d = chat.kept.state.dir
    shutil.rmtree(chat_phone["dir"] / d / "turn_2")  # the phone's /data/local/tmp was cleared
    with pytest.raises(BackendError) as err:
        chat.ask(QUESTIONS[2]).run()
    msg = str(err.value)
    assert "\n" not in msg and msg == (
        f"genie-app on standin-0001: Failed to restore. (script line 3) (dialog restore {d}/turn_2): the dialog"
        f" state saved on the phone after an earlier turn is gone from {RD}; the next turn starts the conversation"
        " from its beginning")
    # the next turn starts a new dialog with every row of the conversation, and answers as from scratch
    again = chat.ask(QUESTIONS[2]).run()
    assert app_script(chat_phone) == script_of(d, 4)
    _, scratch, _ = converse(chat_pipe, image_path, keep_state=False)
    assert (again.text, again.token_ids) == (scratch[-1].text, scratch[-1].token_ids)
    assert again.timings["prefill_tokens"] == again.prepared.input_ids.shape[1]


# -- genie_cpu on a phone (Genie's QnnGenAiTransformer CPU backend) --------------------------------------------
@pytest.fixture
def cpu_phone(tmp_path, monkeypatch):
    from test_genie import NDK_ENVS, fake_ndk, fake_sdk

    sdk = fake_sdk(tmp_path / "sdk", android=True)
    for env in (*NDK_ENVS, "QNN_SDK_ROOT", "PYTHONPATH", "STANDIN_GENIE_MODE"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("QAIRT_SDK_ROOT", str(sdk))
    monkeypatch.setenv("ANDROID_NDK_ROOT", str(fake_ndk(tmp_path / "ndk")))
    monkeypatch.setenv("VLMRUN_ADB", str(STANDINS / "adb"))
    monkeypatch.setenv("STANDIN_ADB_ROOT", str(tmp_path / "device"))
    monkeypatch.setenv("STANDIN_GENIE_TEXT", "@model")
    monkeypatch.setenv("STANDIN_GENIE_APP_LOG", str(tmp_path / "app.json"))
    return {"sdk": sdk, "tmp": tmp_path, "dir": tmp_path / "device" / "data/local/tmp/vlmrun/genie"}


def test_genie_cpu_on_a_phone_keeps_the_conversation_with_genie_app(cpu_phone, tiny_model, store, image_path):
    from test_genie import layout as cpu_layout

    lay = cpu_layout("genie_cpu", target="android", context_length=256)
    pipe = Pipeline.build(tiny_model, lay, store=store)
    assert pipe.handles["decoder"].no_state.endswith("has no bin/aarch64-android/genie-app: each turn of a"
                                                     " conversation runs from the start")
    chat = pipe.chat(settings=SETTINGS)
    assert not chat.keeps_state  # without the SDK's genie-app: every turn from the start (genie-t2t-run)
    (cpu_phone["sdk"] / "bin" / "aarch64-android" / "genie-app").symlink_to(STANDINS / "genie-app")
    pipe = Pipeline.build(tiny_model, lay, store=store)
    handle = pipe.handles["decoder"]
    assert handle.no_state == ""
    chat, kept, scripts = converse(pipe, image_path, where=cpu_phone)
    _, scratch, _ = converse(pipe, image_path, keep_state=False)
    assert chat.keeps_state and [(g.text, g.token_ids) for g in kept] == [(g.text, g.token_ids) for g in scratch]
    d = chat.kept.state.dir
    assert scripts == [script_of(d, 1), script_of(d, 2, 1), script_of(d, 3, 2)]
    assert all(g.timings["reused_tokens"] > 0 for g in kept[1:])
    cfg = json.loads((cpu_phone["dir"] / d / "genie_config.json").read_text())["dialog"]
    assert cfg["engine"]["backend"]["type"] == "QnnGenAiTransformer"
    assert cfg["engine"]["model"]["library"]["model-bin"] == "model.bin"
    assert cfg["tokenizer"]["path"] == "tokenizer.json"
    assert (cpu_phone["dir"] / "genie-app").is_file()
    # an undo restores the state saved before the undone turn
    chat.undo()
    again = chat.ask("How many shapes are there?").run()
    assert app_script(cpu_phone) == script_of(d, 4, 2)
    _, want, _ = converse(pipe, image_path, keep_state=False, questions=QUESTIONS[:2] + ["How many shapes are there?"])
    assert (again.text, again.token_ids) == (want[-1].text, want[-1].token_ids)


# -- answers stream from the phone -------------------------------------------------------------------------------
STREAMED = "a red square on the phone today"
DELAY = 0.4  # seconds between the stand-ins' words


def timed_pieces(gen) -> tuple[list[str], float, float]:
    """The generation's text pieces, when the first arrived and when the last did (seconds from the start)."""
    import time

    t0, first, pieces = time.perf_counter(), None, []
    for piece in gen:
        first = first if first is not None else time.perf_counter() - t0
        pieces.append(piece)
    return pieces, first, time.perf_counter() - t0


def test_a_phone_dialog_streams_its_answer(chat_phone, chat_pipe, image_path, monkeypatch):
    monkeypatch.setenv("STANDIN_GENIE_TEXT", STREAMED)
    monkeypatch.setenv("STANDIN_GENIE_DELAY", str(DELAY))
    chat = chat_pipe.chat(settings=GenerationSettings(max_new_tokens=16))
    pieces, first, total = timed_pieces(chat.ask("Describe the image.", image=image_path))
    assert "".join(pieces).strip() == STREAMED and len(pieces) >= 2
    assert total - first > 3 * DELAY  # the first words reached the caller while genie-app was still generating
    assert app_script(chat_phone)[-4].startswith("dialog embeddingQuery")  # through genie-app's dialog


# -- a bundle on a phone: the conversation kept in Genie's pipeline (genie-app's pipeline save/restore) ---------
@pytest.fixture
def bundle_on_phone(tmp_path, monkeypatch):
    from test_genie_phone import fake_qairt

    sdk = fake_qairt(tmp_path / "qairt")
    (sdk / "bin" / "aarch64-android" / "genie-app").symlink_to(STANDINS / "genie-app")
    for env in ("QAIRT_SDK_ROOT", "QNN_SDK_ROOT", "STANDIN_HTP_ARCH", "STANDIN_GENIE_DELAY"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("STANDIN_ADB_ROOT", str(tmp_path / "phone"))
    monkeypatch.setenv("STANDIN_GENIE_APP_LOG", str(tmp_path / "app.json"))
    monkeypatch.setenv("STANDIN_GENIE_TEXT", "@model")
    return {"sdk_root": str(sdk), "adb": str(STANDINS / "adb"), "root": tmp_path / "phone", "tmp": tmp_path}


@pytest.fixture
def bundle_pipe(bundle_on_phone, phone_bundle, tiny_model, store):  # noqa: F811 (the fixture)
    from vlmrun import layouts

    from test_bundle import phone_options

    return Pipeline.build(tiny_model, layouts.resolve(f"bundle:{phone_bundle}", options=phone_options(
        bundle_on_phone)), store=store)


from test_bundle import phone_bundle  # noqa: E402,F401 (the bundle written for a phone, a module fixture)


def app_log(where) -> dict:
    return json.loads((where["tmp"] / "app.json").read_text())


def test_a_bundle_on_a_phone_keeps_the_conversation_in_its_pipeline(bundle_on_phone, bundle_pipe, image_path):
    logs = []
    chat = bundle_pipe.chat(settings=SETTINGS)
    kept = []
    for i, q in enumerate(QUESTIONS):
        kept.append(chat.ask(q, image=image_path if i == 0 else None).run())
        logs.append(app_log(bundle_on_phone))
    assert chat.keeps_state
    _, scratch, _ = converse(bundle_pipe, image_path, keep_state=False)
    # the same tokens as the conversation computed from scratch (the whole history through genie-app, each turn)
    assert [(g.text, g.token_ids) for g in kept] == [(g.text, g.token_ids) for g in scratch]
    assert len({g.text for g in kept}) == 3 and all(g.token_ids for g in kept)
    state = chat.kept.runtime
    d, rd = state.dir, bundle_on_phone["root"] / bundle_pipe.handles["decoder"].runtime.phone.rd.lstrip("/")
    tok = bundle_pipe.model.tokenizer
    for n, (g, log) in enumerate(zip(kept, logs), start=1):
        script = log["script"]
        assert script[-5] == f"pipeline save GeniePipeline {d}/turn_{n}"
        assert (f"pipeline restore GeniePipeline {d}/turn_{n - 1}" in script) == (n > 1)
        sets = [ln.split()[-1] for ln in script if ln.startswith("node set textFile")]
        new = "".join((rd / f).read_text() for f in sets)
        if n == 1:  # the picture and the text around it
            assert any(ln.startswith("node set image") for ln in script) and len(sets) == 2
            assert g.timings["reused_tokens"] == 0
        else:  # only the turn's new text: the previous turn's prompt and answer are restored, never fed again
            before = kept[n - 2]
            assert not any(ln.startswith("node set image") for ln in script) and len(sets) == 1
            assert g.prepared.prompt_text == before.prepared.prompt_text + before.text + new
            assert log["executed"] == [{"restored": logs[n - 2]["executed"][0]["restored"] + logs[n - 2][
                "executed"][0]["fed"] + len(before.text), "fed": len(new)}]
            assert g.timings["prefill_tokens"] == len(tok.encode(new, add_special_tokens=False).ids)
            assert g.timings["reused_tokens"] == g.prepared.input_ids.shape[1] - g.timings["prefill_tokens"] > 0
        assert (rd / d / f"turn_{n}" / "pipeline.json").is_file()
    assert all(g.timings["reused_tokens"] == 0 for g in scratch)
    assert [p for _, p, _ in state.saves] == [f"{d}/turn_{n}" for n in (1, 2, 3)] and chat.kept.nbytes > 0
    # an undo: the next turn restores the state saved before the undone turn; the undone turn's state is removed
    chat.undo()
    again = chat.ask("How many shapes are there?").run()
    assert f"pipeline restore GeniePipeline {d}/turn_2" in app_log(bundle_on_phone)["script"]
    assert not (rd / d / "turn_3").exists()
    _, want, _ = converse(bundle_pipe, image_path, keep_state=False,
                          questions=QUESTIONS[:2] + ["How many shapes are there?"])
    assert (again.text, again.token_ids) == (want[-1].text, want[-1].token_ids)
    assert again.timings["reused_tokens"] == kept[2].timings["reused_tokens"]
    chat.reset()
    assert not (rd / d).exists()


def test_a_pipeline_state_gone_from_the_phone_is_a_clear_error(bundle_on_phone, bundle_pipe, image_path):
    import shutil

    chat, kept, _ = converse(bundle_pipe, image_path, questions=QUESTIONS[:2])
    state = chat.kept.runtime
    rd = bundle_pipe.handles["decoder"].runtime.phone.rd
    shutil.rmtree(bundle_on_phone["root"] / rd.lstrip("/") / state.dir / "turn_2")  # /data/local/tmp was cleared
    with pytest.raises(BackendError) as err:
        chat.ask(QUESTIONS[2]).run()
    msg = str(err.value)
    line = next(n for n, ln in enumerate(app_log(bundle_on_phone)["script"], 1) if ln.startswith("pipeline restore"))
    assert "\n" not in msg and msg == (
        f"genie-app on standin-0001: Failed to restore. (script line {line}) (pipeline restore {state.dir}/turn_2):"
        f" the pipeline state saved on the phone after an earlier turn is gone from {rd}; the next turn starts the"
        " conversation from its beginning")
    # the next turn starts the pipeline from nothing with the whole conversation, and answers as from scratch
    again = chat.ask(QUESTIONS[2]).run()
    assert not any(ln.startswith("pipeline restore") for ln in app_log(bundle_on_phone)["script"])
    _, scratch, _ = converse(bundle_pipe, image_path, keep_state=False)
    assert (again.text, again.token_ids) == (scratch[-1].text, scratch[-1].token_ids)
    assert again.timings["reused_tokens"] == 0


def test_a_bundle_on_a_phone_streams_its_answer(bundle_on_phone, bundle_pipe, image_path, monkeypatch):
    monkeypatch.setenv("STANDIN_GENIE_TEXT", STREAMED)
    monkeypatch.setenv("STANDIN_GENIE_DELAY", str(DELAY))
    settings = GenerationSettings(max_new_tokens=16)
    for gen in (bundle_pipe.generate(image_path, "Describe the image.", settings),  # one request, from the start
                bundle_pipe.chat(settings=settings).ask("Describe the image.", image=image_path)):  # a conversation
        pieces, first, total = timed_pieces(gen)
        assert "".join(pieces) == STREAMED and len(pieces) >= 2
        assert total - first > 3 * DELAY  # the first words arrived while genie-app was still generating


def test_a_genie_app_without_pipeline_save_recomputes_each_turn(bundle_on_phone, bundle_pipe, image_path,
                                                                 monkeypatch):
    monkeypatch.setenv("STANDIN_GENIE_APP_OLD", "1")  # genie-app refuses pipeline save / restore
    with pytest.warns(RuntimeWarning, match=r"refuses `pipeline save` \(a genie-app older than the command\)"):
        chat, kept, _ = converse(bundle_pipe, image_path)
    _, scratch, _ = converse(bundle_pipe, image_path, keep_state=False)
    assert [(g.text, g.token_ids) for g in kept] == [(g.text, g.token_ids) for g in scratch]
    assert chat.kept.runtime.no_state and all(g.timings["reused_tokens"] == 0 for g in kept)
    assert not any(ln.startswith("pipeline save") for ln in app_log(bundle_on_phone)["script"])


# -- which kept state a turn may continue (`Turn.continues`) ------------------------------------------------------
def test_a_kept_state_is_continued_only_by_a_longer_text_with_the_same_picture():
    from vlmrun_qnn_htp.bundle_run import Turn

    image = "<image>"
    held = ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n<image>\nDescribe the"
            " image.<|im_end|>\n<|im_start|>assistant\n a red square")
    more = "<|im_end|>\n<|im_start|>user\nWhat color is it?<|im_end|>\n<|im_start|>assistant\n"

    def turn(text: str, picture: str = "pic-a") -> Turn:
        return Turn(text, picture, {}, "{}", image)

    assert turn(held + more).continues(held, "pic-a")  # extends the held text, the same picture: continued
    assert turn(held + "!").continues(held, "pic-a")  # one character more is something new to feed
    assert not turn(held).continues(held, "pic-a")  # an exact repeat: nothing new to feed
    assert not turn(held[:-len(" a red square")] + " a blue circle" + more).continues(held, "pic-a")  # diverges
    assert not turn(held[:-5]).continues(held, "pic-a")  # shorter than what the state holds
    assert not turn(held + more, "pic-b").continues(held, "pic-a")  # the placeholder held another picture
    assert not turn(held + more, "pic-b").continues(held, None)  # ... or one nobody recorded
    text_only = held.replace("<image>\n", "")
    assert image not in text_only
    for picture in ("pic-a", "pic-b"):  # no placeholder held: the picture is not in the state, whatever it is
        assert turn(text_only + more, picture).continues(text_only, None)
        assert turn(text_only + more, picture).continues(text_only, "pic-a")
        assert not turn(text_only, picture).continues(text_only, None)


@pytest.fixture(scope="module")
def second_picture():
    import random

    from vlmrun.shapes import random_scene

    return random_scene(random.Random(7), n_shapes=1).render()


def test_a_bundle_on_a_phone_restores_no_state_of_another_picture_or_that_holds_the_whole_turn(
        bundle_on_phone, bundle_pipe, image_path, second_picture):
    """A saved state whose text the turn extends is restored only when it holds the turn's picture and leaves
    something to feed: the same conversation with another first picture starts from nothing (the picture pushed
    again), and a request whose text is exactly what a state holds (a turn's prompt and its answer) restores the
    newer state it strictly extends, never that one."""
    from vlmrun.conversation import KeptState, Picture, plan_turn
    from vlmrun.preprocess import tokenize_conversation
    from vlmrun.stages import RequestRun

    pipe, model = bundle_pipe, bundle_pipe.model
    chat = pipe.chat(settings=SETTINGS)
    kept, logs = [], []
    for i, q in enumerate(QUESTIONS[:2]):
        kept.append(chat.ask(q, image=image_path if i == 0 else None).run())
        logs.append(app_log(bundle_on_phone))
    state = chat.kept.runtime
    d, rd = state.dir, bundle_on_phone["root"] / pipe.handles["decoder"].runtime.phone.rd.lstrip("/")
    held = {p: h for h, p, _ in state.saves}
    assert list(held) == [f"{d}/turn_1", f"{d}/turn_2"]
    assert held[f"{d}/turn_2"] == kept[1].prepared.prompt_text + kept[1].text

    # 1. the same conversation text, another first picture: it extends both saved states' text, but their image
    # placeholder holds the first picture; nothing is restored and the new picture goes in with the whole text
    other = Picture.of(second_picture, model.image_processor_config)
    assert other.key != chat.pictures[0].key
    messages = chat.messages + [{"role": "user", "content": [{"type": "text", "text": QUESTIONS[2]}]}]
    plan = plan_turn(pipe, messages, [other])
    assert all(plan.text.startswith(h) for h in held.values())
    got = pipe.generate_turn(plan, chat.kept, SETTINGS).run()
    log = app_log(bundle_on_phone)
    script = log["script"]
    assert not any(ln.startswith("pipeline restore") for ln in script)
    images = [ln.split()[-1] for ln in script if ln.startswith("node set image")]
    assert len(images) == 1 and (rd / images[0]).read_bytes() == np.ascontiguousarray(
        other.pixel_values, np.float32).tobytes()  # the other picture's pixels, pushed this turn
    fed = "".join((rd / ln.split()[-1]).read_text() for ln in script if ln.startswith("node set textFile"))
    assert fed == plan.text.replace("<image>", "")  # the whole conversation's text, fed again
    assert log["executed"][0]["restored"] == 0 and script[-5] == f"pipeline save GeniePipeline {d}/turn_3"
    assert got.timings["reused_tokens"] == 0 and got.timings["prefill_tokens"] == plan.input_ids.shape[1]
    scratch = pipe.generate_turn(plan, KeptState(None), SETTINGS).run()  # the same turn computed from scratch
    assert got.token_ids and (got.text, got.token_ids) == (scratch.text, scratch.token_ids)
    same_picture = plan_turn(pipe, messages, [chat.pictures[0]])
    first = pipe.generate_turn(same_picture, KeptState(None), SETTINGS).run()
    assert first.token_ids != got.token_ids  # the stand-in's answer does depend on the picture

    # 2. a request whose text is exactly what turn 2's state holds (its prompt and its answer): that state has
    # nothing left to feed, so the newest state it strictly extends (turn 1's) is restored and the rest fed
    text = held[f"{d}/turn_2"]
    ids, starts = tokenize_conversation(model.tokenizer, text, model.image_token_id, model.image_tokens)
    request = RequestRun(pixel_values=kept[0].prepared.pixel_values, input_ids=ids, image_start=starts[0],
                         prompt_text=text, max_new_tokens=SETTINGS.max_new_tokens, sampling=SETTINGS.sampling,
                         stop_ids=model.stop_ids)
    tokens = list(state.run(request))
    log = app_log(bundle_on_phone)
    script = log["script"]
    assert [ln for ln in script if ln.startswith("pipeline restore")] == [f"pipeline restore GeniePipeline {d}/turn_1"]
    new = "".join((rd / ln.split()[-1]).read_text() for ln in script if ln.startswith("node set textFile"))
    assert new and text == held[f"{d}/turn_1"] + new  # what turn 1's state lacks, the answer of turn 2 with it
    assert not any(ln.startswith("node set image") for ln in script)
    assert log["executed"] == [{"restored": logs[1]["executed"][0]["restored"], "fed": len(new)}]
    assert state.reused == kept[1].timings["reused_tokens"] < ids.shape[1]
    fresh = pipe.new_kept_state()  # the same request from nothing, on a conversation of its own
    try:
        assert tokens and tokens == list(fresh.runtime.run(request))
        assert not any(ln.startswith("pipeline restore") for ln in app_log(bundle_on_phone)["script"])
    finally:
        fresh.close()

    # 3. turn 2 asked again: its own state holds its answer and is never restored (it is dropped), turn 1's is
    again = pipe.generate_turn(kept[1].plan, chat.kept, SETTINGS).run()
    script = app_log(bundle_on_phone)["script"]
    assert [ln for ln in script if ln.startswith("pipeline restore")] == [f"pipeline restore GeniePipeline {d}/turn_1"]
    assert not (rd / d / "turn_2").exists()
    assert (again.text, again.token_ids) == (kept[1].text, kept[1].token_ids)
    chat.reset()
    assert not (rd / d).exists()
