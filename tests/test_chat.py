"""Conversations (``Pipeline.chat``, ``vlmrun chat``): the history rendered whole, the decoder's state kept between
turns so that a follow-up prefills only its new tokens, and the same tokens as the conversation computed from
scratch, on the reference (ONNX Runtime's past KV), on all-npu (the HTP emulator's parts engine: KV in host buffers)
and in a bundle (Genie's pipeline, which answers each turn from the start).

The default model was trained on conversations too ("Describe the image." -> "A red circle on a blue background.",
"What color is the shape?" -> "Red.", "What shape is it?" -> "A circle."); these tests hold every way of computing a
turn to the tokens of the same turn computed from scratch, and to those answers.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time

import numpy as np
import pytest

from vlmrun import GenerationSettings
from vlmrun.conversation import KeptStates, plan_turn
from vlmrun.errors import InputError, UsageError

from conftest import run_cli

FIRST = "A red circle on a blue background."
QUESTIONS = ["Describe the image.", "What color is the shape?", "What shape is it?"]
SETTINGS = GenerationSettings(max_new_tokens=32)


def converse(pipe, picture, keep_state=True, questions=QUESTIONS):
    chat = pipe.chat(settings=SETTINGS, keep_state=keep_state)
    turns = []
    for i, q in enumerate(questions):
        g = chat.ask(q, image=picture if i == 0 else None).run()
        turns.append((g.text, list(g.token_ids), g.timings["prefill_tokens"], g.timings["reused_tokens"],
                      int(g.prepared.input_ids.shape[1])))
    return chat, turns


@pytest.fixture(scope="module")
def picture():
    from vlmrun.demo_image import demo_image

    return demo_image()


@pytest.fixture(scope="module")
def second_picture():
    import random

    from vlmrun.shapes import random_scene

    scene = random_scene(random.Random(7), n_shapes=1)
    return scene.render()


@pytest.mark.parametrize("layout", ["reference", "all-npu"])
def test_a_follow_up_prefills_only_its_new_tokens_and_gives_the_tokens_computed_from_scratch(
        layout, ref_pipe, npu_pipe, picture):
    pipe = ref_pipe if layout == "reference" else npu_pipe
    chat, kept = converse(pipe, picture)
    assert chat.keeps_state
    _, scratch = converse(pipe, picture, keep_state=False)
    assert [t[:2] for t in kept] == [t[:2] for t in scratch]  # text and token ids, turn by turn
    assert kept[0][0] == FIRST
    # turn 1 prefills its whole prompt; a follow-up only what its kept state lacks: the closing of the answer and
    # the new user turn (the state holds the prompt and every answer token but the last, the unfed <|im_end|>)
    # every answer token the model wrote is the tokenizer's spelling of its text: turn 1's (87 = 68 + 19), turn 2's
    # "Red." (118 = 87 + 27 + 4)
    assert [t[:1] for t in kept] == [(FIRST,), ("Red.",), ("A circle.",)]
    assert [t[2:4] for t in kept] == [(68, 0), (27, 87), (24, 118)]
    for (text, ids, prefill, reused, total), (_, prev_ids, _, _, prev_total) in zip(kept[1:], kept):
        assert prev_total < reused <= prev_total + len(prev_ids) - 1 and prefill == total - reused
    assert all(t[3] == 0 and t[2] == t[4] for t in scratch)  # from scratch: every position, every turn
    assert chat.tokens == kept[-1][4] + len(kept[-1][1]) - 1


def test_undo_regenerate_and_a_diverging_history_match_a_fresh_conversation(ref_pipe, picture):
    chat, _ = converse(ref_pipe, picture)
    chat.undo()
    again = chat.ask("How many shapes are there?").run()
    fresh = ref_pipe.chat(settings=SETTINGS, keep_state=False)
    fresh.ask(QUESTIONS[0], image=picture).run()
    fresh.ask(QUESTIONS[1]).run()
    want = fresh.ask("How many shapes are there?").run()
    assert again.token_ids == want.token_ids and again.text == want.text
    # kept from the divergence on: everything up to the new user turn's text
    assert again.timings["reused_tokens"] > 68 and again.timings["prefill_tokens"] < 30
    redo = chat.regenerate()
    redo.run()
    assert redo.token_ids == want.token_ids and len(chat.messages) == 6
    chat.undo(), chat.undo(), chat.undo()
    with pytest.raises(UsageError, match="nothing to undo"):
        chat.undo()
    chat.reset()
    assert chat.ask(QUESTIONS[0], image=picture).run().text == FIRST


def test_a_picture_in_a_later_turn_and_a_second_picture(ref_pipe, picture, second_picture):
    for keep in (True, False):
        chat = ref_pipe.chat(settings=SETTINGS, keep_state=keep)
        a = chat.ask("Hello.").run()  # a text-only first turn: no vision at all
        assert "vision_ms" not in a.timings
        b = chat.ask("What shape is it?", image=picture).run()
        c = chat.ask("And this one?", image=second_picture).run()
        d = chat.ask("What color is the background?").run()
        assert "vision_ms" in b.timings and "vision_ms" in c.timings and "vision_ms" not in d.timings  # once each
        got = [g.token_ids for g in (a, b, c, d)]
        if keep:
            kept = got
            assert c.timings["reused_tokens"] > b.prepared.input_ids.shape[1]
        else:
            assert got == kept
    prompt = chat.messages[-2]
    assert chat.pictures[1].key != chat.pictures[0].key and prompt["role"] == "user"
    assert c.prepared.prompt_text.count("<image>") == 2


def test_two_conversations_interleaved_keep_their_own_state(ref_pipe, picture, second_picture):
    solo = []
    for pic in (picture, second_picture):
        _, turns = converse(ref_pipe, pic)
        solo.append([t[1] for t in turns])
    a, b = ref_pipe.chat(settings=SETTINGS), ref_pipe.chat(settings=SETTINGS)
    got = {0: [], 1: []}
    for i, q in enumerate(QUESTIONS):
        for n, (chat, pic) in enumerate(((a, picture), (b, second_picture))):
            got[n].append(chat.ask(q, image=pic if i == 0 else None).run().token_ids)
    assert got[0] == solo[0] and got[1] == solo[1]


def test_past_the_context_is_an_error_with_the_counts_and_the_conversation_stays(ref_pipe, picture):
    chat = ref_pipe.chat(settings=SETTINGS)
    chat.ask(QUESTIONS[0], image=picture).run()
    with pytest.raises(InputError, match=r"the conversation is \d+ tokens \(16 of them image\) but the context holds"
                                         r" 1024; undo a turn"):
        chat.ask("word " * 1000)
    assert len(chat.messages) == 2  # nothing was added
    assert chat.ask(QUESTIONS[1]).run().text == converse(ref_pipe, picture)[1][1][0]
    with pytest.raises(InputError, match="an empty turn"):
        chat.ask("  ")


def test_a_stopped_answer_stays_as_far_as_it_got_and_the_state_agrees(ref_pipe, picture):
    chat = ref_pipe.chat(settings=SETTINGS)
    gen = chat.ask(QUESTIONS[0], image=picture)
    pieces = [next(gen), next(gen)]
    gen.close()
    assert chat.messages[-1] == {"role": "assistant", "content": "".join(pieces)}
    follow = chat.ask(QUESTIONS[1]).run()
    fresh = ref_pipe.chat(settings=SETTINGS, keep_state=False)
    fresh.messages = [dict(m) for m in chat.messages[:2]]
    fresh.pictures = list(chat.pictures)
    fresh._asks = [QUESTIONS[0]]
    assert fresh.ask(QUESTIONS[1]).run().token_ids == follow.token_ids


def test_kept_states_are_taken_by_the_conversation_they_extend_and_bounded(ref_pipe, picture, second_picture):
    from vlmrun.conversation import Picture

    cfg = ref_pipe.model.image_processor_config
    states = KeptStates(ref_pipe, max_count=2)
    conv = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTIONS[0]}]}]
    plan = plan_turn(ref_pipe, conv, [Picture.of(picture, cfg)])
    kept = states.take(plan.keys)
    assert kept.keys == [] and len(states) == 0
    gen = ref_pipe.generate_turn(plan, kept, SETTINGS).run()
    states.put(kept)
    follow = conv + [{"role": "assistant", "content": gen.text}, {"role": "user", "content": QUESTIONS[1]}]
    plan2 = plan_turn(ref_pipe, follow, [Picture.of(picture, cfg)])
    other = plan_turn(ref_pipe, conv, [Picture.of(second_picture, cfg)])
    assert states.take(other.keys).keys == [] and len(states) == 1  # another picture: not this conversation's
    taken = states.take(plan2.keys)
    assert taken is kept and len(states) == 0  # out of the cache while its turn runs
    assert ref_pipe.generate_turn(plan2, taken, SETTINGS).run().timings["reused_tokens"] == 87
    for _ in range(3):
        states.put(states.take([]))  # new, empty states: nothing to keep
    assert len(states) == 0
    for pic in (picture, second_picture, picture):
        k = states.take([])
        ref_pipe.generate_turn(plan_turn(ref_pipe, conv, [Picture.of(pic, cfg)]), k, SETTINGS).run()
        states.put(k)
    assert len(states) == 2  # least recently used out
    small = KeptStates(ref_pipe, max_count=8, max_bytes=states.nbytes // 2)
    for k in list(states._entries.values()):
        small.put(k)
    assert len(small) == 1


def test_vlmrun_chat_scripted_prints_each_answer(cache_dir, image_path, tmp_path):
    r = run_cli(["chat", "--image", str(image_path), "--prompt", QUESTIONS[0], "--prompt", QUESTIONS[1],
                 "--prompt", "/undo", "--prompt", "How many shapes are there?", "--timings"], cache_dir)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [FIRST, "Red.", "One."]
    assert "(prefilled 68 tokens, reused 0;" in r.stderr and "(undone; 1 turns left)" in r.stderr
    script = tmp_path / "turns.jsonl"
    script.write_text("\n".join(json.dumps(t) for t in [
        {"prompt": QUESTIONS[0], "image": str(image_path)}, {"prompt": QUESTIONS[1]}]) + "\n")
    r = run_cli(["chat", "--script", str(script), "--json"], cache_dir)
    assert r.returncode == 0, r.stderr
    turns = [json.loads(line) for line in r.stdout.splitlines()]
    assert [t["text"] for t in turns] == [FIRST, "Red."] and turns[1]["prefill_tokens"] == 27
    script.write_text('{"question": "x"}\n')
    r = run_cli(["chat", "--script", str(script)], cache_dir)
    assert r.returncode != 0 and "turns.jsonl:1: a turn is" in r.stderr and "Traceback" not in r.stderr


def test_vlmrun_chat_on_all_npu_and_a_bundle(cache_dir, image_path, npu_pipe, bundle_dir):
    for args in (["--layout", "all-npu"], ["--bundle", str(bundle_dir)]):
        r = run_cli(["chat", *args, "--image", str(image_path), "--prompt", QUESTIONS[0], "--prompt", QUESTIONS[1],
                     "--json"], cache_dir)
        assert r.returncode == 0, r.stderr
        turns = [json.loads(line) for line in r.stdout.splitlines()]
        assert turns[0]["text"] == FIRST and turns[1]["text"] == "Red."
        # the parts engine's KV buffers; Genie's pipeline executed again without reset, fed the new text only
        assert turns[1]["reused_tokens"] == 87 and turns[1]["prefill_tokens"] == 27


class Pty:
    """``vlmrun chat`` on a pseudo-terminal, as a person runs it."""

    def __init__(self, args, cache_dir):
        import pty

        self.master, slave = pty.openpty()
        env = {**os.environ, "VLMRUN_CACHE_DIR": str(cache_dir), "TERM": "dumb", "COLUMNS": "200"}
        def controlling_terminal():  # a session of its own whose terminal is the pty: Ctrl-C there is SIGINT
            import fcntl
            import signal
            import termios

            signal.signal(signal.SIGINT, signal.SIG_DFL)  # a background job's ignored SIGINT is not inherited
            os.setsid()
            fcntl.ioctl(0, termios.TIOCSCTTY, 0)

        self.proc = subprocess.Popen([sys.executable, "-m", "vlmrun.cli", "chat", *args], stdin=slave, stdout=slave,
                                     stderr=slave, env=env, close_fds=True, preexec_fn=controlling_terminal)
        os.close(slave)
        self.seen = ""

    def read_until(self, text: str, timeout: float = 120) -> str:
        end = time.time() + timeout
        while text not in self.seen:
            left = end - time.time()
            if left <= 0:
                raise AssertionError(f"no {text!r} within {timeout} s; the terminal shows:\n{self.seen}")
            r, _, _ = select.select([self.master], [], [], left)
            if r:
                try:
                    self.seen += os.read(self.master, 4096).decode(errors="replace")
                except OSError:
                    break
        out, _, self.seen = self.seen.partition(text)
        return out + text

    def send(self, data: str):
        os.write(self.master, data.encode())

    def close(self):
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        os.close(self.master)


def test_vlmrun_chat_interactive_streams_takes_commands_and_survives_ctrl_c(cache_dir, image_path, npu_pipe):
    # all-npu: the emulator's ~0.1 s a token keeps the answer going while Ctrl-C arrives (the reference's 400 tokens
    # can all be written before a loaded machine's test reads the first sentence)
    t = Pty(["--layout", "all-npu", "--image", str(image_path), "--max-new-tokens", "400", "--ignore-eos"], cache_dir)
    try:
        t.read_until("> ")
        t.send(QUESTIONS[0] + "\n")
        t.read_until(FIRST)  # streamed, then more tokens (eos ignored)
        t.send("\x03")  # Ctrl-C: the answer stops, the session stays
        t.read_until("[stopped]")
        t.read_until("> ")
        t.send("/undo\n")  # the stopped answer was a turn: undone, none left
        t.read_until("(undone; 0 turns left)")
        t.send(f"/image {image_path}\n")
        t.read_until("goes with the next question")
        t.send("/nonsense\n")
        t.read_until("unknown command /nonsense")
        t.read_until("> ")
        # at the prompt: a fresh line. Python sees a SIGINT that lands before readline blocks only at the next key,
        # as any readline program: give it the moment a person would
        time.sleep(1.0)
        t.send("\x03")
        t.read_until("> ")
        t.send("/image /no/such.png\n")
        t.read_until("image not found: /no/such.png")
        t.read_until("> ")
        time.sleep(1.0)  # as for Ctrl-C: a control key typed before readline reads the terminal can be flushed
        t.send("\x04")  # Ctrl-D leaves
        assert t.proc.wait(60) == 0
    finally:
        t.close()


def test_a_bundle_keeps_its_conversation_in_genies_pipeline(bundle_dir, tiny_model, store, picture):
    """Genie's pipeline stays alive between turns and continues from its KV cache: a turn feeds only its new text
    (which starts with the end token Genie sampled and did not feed), and answers as the conversation from scratch;
    a turn that does not extend it (an undo, an answer held in other tokens than its text's) starts the pipeline
    again; a turn stopped at its budget keeps it; a conversation is about one picture."""
    from vlmrun import Pipeline

    pipe = Pipeline.build(tiny_model, f"bundle:{bundle_dir}", store=store)
    chat, kept = converse(pipe, picture)
    _, scratch = converse(pipe, picture, keep_state=False)
    assert [t[:2] for t in kept] == [t[:2] for t in scratch] and kept[0][0] == FIRST
    # every turn continues Genie's pipeline (an answer held in other tokens than its text's would start it again:
    # test_a_bundle_turn_held_in_other_tokens_than_its_texts_spelling_starts_genie_again)
    assert [t[:1] for t in kept] == [(FIRST,), ("Red.",), ("A circle.",)]
    assert [t[2:4] for t in kept] == [(68, 0), (27, 87), (24, 118)] and all(t[3] == 0 for t in scratch)
    assert chat.kept.runtime.session.alive and chat.kept.nbytes > 0
    chat.undo()
    again = chat.ask("How many shapes are there?").run()
    assert again.timings["reused_tokens"] == 0  # an undo: Genie's state is past it, the pipeline starts again
    short = chat.ask("Describe the image.", settings=GenerationSettings(max_new_tokens=3)).run()
    assert short.stopped_by == "max_new_tokens" and chat.kept.runtime.session.alive
    follow = chat.ask("How many shapes are there?", settings=GenerationSettings(max_new_tokens=3)).run()
    assert follow.timings["reused_tokens"] > short.prepared.input_ids.shape[1]  # kept past a budget stop
    chat.reset()
    assert chat.kept.runtime.session is None  # the worker is gone
    with pytest.raises(InputError, match="a bundle's runtime answers a conversation about one picture"):
        chat.ask("Hello.")


def test_the_state_contract_of_each_engine(ref_pipe, npu_pipe, picture):
    """A state truncated to a prefix and fed the rest gives the logits of the whole sequence fed at once."""
    from vlmrun.stages import DecodeRequest
    from vlmrun.sampling import Sampler, SamplingSettings

    for pipe in (ref_pipe, npu_pipe):
        embeds = pipe.embed_prompt(pipe.prepare(picture, QUESTIONS[0]))
        rows = {}
        for name, cut in (("whole", None), ("resumed", 40)):
            state = pipe.decoder_state()
            got = []
            req = lambda e: DecodeRequest(  # noqa: E731
                inputs_embeds=e, max_new_tokens=1, sampler=Sampler(SamplingSettings()), stop_ids=frozenset(),
                embed_tokens=pipe.embed_tokens, context_length=pipe.context_length, on_logits=got.append)
            if cut is None:
                list(state.decode(req(embeds)))
            else:
                list(state.decode(req(embeds[:, :cut + 10])))
                assert state.length == cut + 10 and state.truncate(cut) and state.length == cut
                got.clear()
                list(state.decode(req(embeds[:, cut:])))
            assert state.length == embeds.shape[1] and state.nbytes > 0
            rows[name] = got[-1]
        # fp16 on the emulator: the same rows up to the chunking of the prefill (other AR-N calls, other sums)
        np.testing.assert_allclose(rows["resumed"], rows["whole"], atol=0.05 if pipe is npu_pipe else 1e-4)
        assert rows["resumed"].argmax() == rows["whole"].argmax()


def test_genies_dialog_keeps_the_conversation_in_its_worker(tiny_model, store, picture):
    """Engine genie: the dialog stays alive in its worker between turns (its KV cache); a turn feeds its new rows;
    an answer spelled otherwise by the tokenizer (or an undo) replays the kept rows into a new dialog, from the
    divergence on computed again: every turn the tokens of the conversation computed from scratch."""
    from vlmrun import Pipeline, layouts

    pipe = Pipeline.build(tiny_model, layouts.resolve("all-npu", options={"decoder": {"engine": "genie"}}),
                          store=store)
    chat, kept = converse(pipe, picture)
    _, scratch = converse(pipe, picture, keep_state=False)
    assert [t[:2] for t in kept] == [t[:2] for t in scratch] and kept[0][0] == FIRST
    # Genie hands out no end token: the answer tokens it wrote were all fed (19 of turn 1, 4 of turn 2)
    assert len(kept[0][1]) == 19 and [t[2:4] for t in kept] == [(68, 0), (27, 87), (24, 118)]
    state = chat.kept.state
    assert state.session.alive and state.length == chat.tokens
    # an undo: Genie cannot cut its cache; the kept rows up to the divergence are replayed into a new dialog (counted
    # as prefilled), and the turn is the one computed from scratch
    chat.undo()
    again = chat.ask("How many shapes are there?").run()
    fresh = pipe.chat(settings=SETTINGS, keep_state=False)
    fresh.ask(QUESTIONS[0], image=picture).run(), fresh.ask(QUESTIONS[1]).run()
    want = fresh.ask("How many shapes are there?").run()
    assert again.token_ids == want.token_ids and again.text == "One."
    assert again.timings["prefill_tokens"] == again.prepared.input_ids.shape[1] and state.length == chat.tokens
    chat.reset()
    assert state.session is None and state.length == 0


def test_a_bundle_turn_held_in_other_tokens_than_its_texts_spelling_starts_genie_again(tiny_model):
    """What a bundle's kept pipeline holds after a turn: the prompt and the answer as text when Genie wrote the
    answer in the tokenizer's own spelling of it; else nothing (a re-rendered history would hold other tokens than
    Genie's cache: the next turn starts the pipeline again, as a recompute from scratch sees it)."""
    from types import SimpleNamespace

    from vlmrun_qnn_htp.bundle_run import BundleConversation

    tok = tiny_model.tokenizer
    conv = BundleConversation(SimpleNamespace(model=tiny_model, last_timings={}))
    req = SimpleNamespace(input_ids=np.zeros((1, 10), np.int64))
    whole = tok.encode("A circle.", add_special_tokens=False).ids
    conv._after("<prompt>", "A circle.", whole, req, 0.0, None)
    assert conv.held == "<prompt>A circle." and conv.length == 10 + len(whole)
    letters = [i for ch in "A circle." for i in tok.encode(ch, add_special_tokens=False).ids]
    assert letters != whole  # the same text, written letter by letter
    conv._after("<prompt>", "A circle.", letters, req, 0.0, None)
    assert conv.held == "" and conv.length == 10 + len(letters)
