"""The parts form's follow-up prompt graph (qnn_htp ``followup_ar``, default 32): a second, small prompt graph per
part beside the AR-128 and AR-1 graphs, so that a conversation's next turn (20-30 new positions) costs one AR-32 call
instead of an AR-128 one; compiled into the same artifact, run by the host parts engine for the rows it covers, and
shipped in a bundle for Genie's pipeline. The tokens are those of the conversation computed from scratch."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import numpy as np
import pytest
from vlmrun import GenerationSettings

pytest.importorskip("onnxruntime_qnn")

from vlmrun_qnn_htp.genie_engine import GenieLayoutDecoder
from vlmrun_qualcomm.parts import followup_ar

SETTINGS = GenerationSettings(max_new_tokens=32)
QUESTIONS = ["Describe the image.", "What color is the shape?"]


class Rows:
    """A fake graph of ``ar`` rows: records the calls, answers zeros in the Genie layout."""

    def __init__(self, facts, ar, calls):
        self.facts, self.ar, self.calls = facts, ar, calls

    def run(self, feeds):
        f, T = self.facts, feeds["attention_mask"].shape[1]
        assert T == self.ar
        self.calls.append(self.ar)
        out = {"logits": np.zeros((1, T, f.vocab), np.float32)}
        for i in range(f.layers):
            out[f"past_key_{i}_out"] = np.zeros((f.kv_heads, 1, f.head_dim, T), np.float32)
            out[f"past_value_{i}_out"] = np.zeros((f.kv_heads, 1, T, f.head_dim), np.float32)
        return out


def fake_decoder(ars, ctx=512, min_chunk=2):
    facts = SimpleNamespace(kv_heads=1, head_dim=4, layers=1, hidden=8, vocab=5, rope_theta=10000.0)
    calls: list[int] = []
    dec = GenieLayoutDecoder({ar: Rows(facts, ar, calls) for ar in ars}, ctx, facts, min_chunk=min_chunk)
    return dec, calls


def prefill_calls(dec, calls, n_past: int, rows: int) -> list[int]:
    dec.reset()
    dec.n_past = n_past
    calls.clear()
    dec.prefill(np.zeros((1, rows, dec.facts.hidden), np.float32))
    return list(calls)


def test_the_host_engine_picks_the_smallest_prompt_graph_that_covers_the_rows_left():
    dec, calls = fake_decoder((128, 32, 1))
    assert prefill_calls(dec, calls, 0, 68) == [128]  # a first turn: one AR-128 call, as before
    assert prefill_calls(dec, calls, 87, 27) == [32]  # a follow-up: one AR-32 call instead of an AR-128 one
    assert prefill_calls(dec, calls, 0, 32) == [32]
    assert prefill_calls(dec, calls, 0, 150) == [128, 32]  # the chunk past AR-128 by the small graph
    assert prefill_calls(dec, calls, 0, 1) == [1]
    assert prefill_calls(dec, calls, 470, 27) == [32]  # AR-128 no longer fits the context; AR-32 does
    assert dec.steps == {1: 1, 32: 4, 128: 2}  # the calls per AR, counted by the engine
    # one prompt graph: what the engine did before (calibration drives one AR at a time with min_chunk 1)
    dec, calls = fake_decoder((128, 1))
    assert prefill_calls(dec, calls, 87, 27) == [128]
    dec, calls = fake_decoder((32, 1), min_chunk=1)
    assert prefill_calls(dec, calls, 0, 33) == [32, 32]


def test_the_follow_up_ar_is_below_the_prompt_ar_or_none():
    from vlmrun_qnn_htp import stage_options

    assert [followup_ar(a, 128) for a in (32, 64, 127, 128, 200, 0, None, 1)] == [32, 64, 127, 0, 0, 0, 0, 0]
    assert followup_ar(32, 16) == 0  # a prompt graph of 16 rows needs no smaller one
    o = stage_options("decoder", {"decoder_form": "parts"})
    assert (o["prefill_ar"], o["followup_ar"]) == (128, 32)  # on by default in the parts form
    assert stage_options("decoder", {"decoder_form": "parts", "followup_ar": 0})["followup_ar"] == 0


def test_the_parts_artifact_holds_a_follow_up_graph_per_part_named_for_genie(npu_pipe):
    h = npu_pipe.handles["decoder"]
    d = h.artifact.manifest["decoder_parts"]
    ctx, P = d["ctx"], d["count"]
    assert (d["followup_ar"], d["weight_sharing"]) == (32, False) and d["ar"] > 32  # the emulator: a graph a binary
    for p in d["parts"]:
        k = p["index"]
        assert sorted(p["graphs"]) == ["followup", "prompt", "token"]  # a manifest read back has sorted keys
        assert {kind: g["ar"] for kind, g in p["graphs"].items()} == {"prompt": d["ar"], "token": 1, "followup": 32}
        g = p["graphs"]["followup"]  # Genie's scheme: a prompt graph of AR-32, grouped as (32, CL)
        assert re.fullmatch(rf"prompt_ar32_cl{ctx}_0*_{k}_of_{P}", g["name"]), g["name"]
        assert g["binary"] == f"part{k}_of_{P}_followup_qnn.bin" and g["binary"] in d["binaries_in_order"]
        assert g["name"].encode() in (h.artifact.path / g["binary"]).read_bytes()
        shape = {t["name"]: t["shape"] for t in g["inputs"]}
        assert shape["attention_mask"] == [1, 32, ctx]
    assert set(d["graph_bytes"]) == {"prompt", "token", "followup"}
    assert set(d["graph_compile_s"]) == {"prompt", "token", "followup"}
    # one export holds the three graphs of every part (their weights, when outside the graphs, in one file a part)
    src = h.artifact.path.parent / h.artifact.manifest["key"]["source"]
    desc = json.loads((src / "parts.json").read_text())
    assert json.loads((src / "manifest.json").read_text())["form"].startswith("decoder/parts[ar=128,ctx=")
    assert "followup=32" in json.loads((src / "manifest.json").read_text())["form"]
    for p in desc["parts"]:
        g = p["graphs"]["followup"]
        assert (g["ar"], g["file"]) == (32, f"part{p['index']}_of_{P}_followup.onnx")
        assert g["name"] == f"prompt_ar32_cl{ctx}_{p['index']}_of_{P}"  # Genie's name (padded when compiled)
    assert not [a for a in h.artifact.path.parent.iterdir() if "decoder_parts_ar_32" in a.name]  # no second export


def test_a_weight_shared_part_holds_its_three_graphs_in_one_binary(tiny_model, store, npu_pipe):
    """The phone form: a part's prompt, token and follow-up graphs in one context binary (compiled here, not
    loaded: the emulator cannot), from the same graphs as the emulator's one-graph-a-binary compile."""
    from vlmrun import Pipeline, layouts
    from vlmrun_qualcomm.manifest import describe_ctx_onnx

    pipe = Pipeline.build(tiny_model, layouts.resolve("all-npu", options={"decoder": {"weight_sharing": "on"}}),
                          store=store, stages=("decoder",))
    art = pipe.handles["decoder"].artifact
    d = art.manifest["decoder_parts"]
    P = d["count"]
    assert (d["weight_sharing"], d["graphs_per_binary"], d["followup_ar"]) == (True, 3, 32)
    assert d["binaries_in_order"] == [f"part{k}_of_{P}_qnn.bin" for k in range(1, P + 1)]
    unshared = npu_pipe.handles["decoder"].artifact.manifest["decoder_parts"]["parts"]
    for p, twin in zip(d["parts"], unshared):
        data = (art.path / p["binaries"][0]).read_bytes()
        for kind, g in p["graphs"].items():
            assert g["binary"] == p["binaries"][0] and g["name"].encode() in data, (kind, g["name"])
            info = describe_ctx_onnx(art.path / g["wrapper"])
            assert info["graphs"] == [g["name"]] and info["binaries"] == p["binaries"]
        assert p["source_sha256"] == twin["source_sha256"]  # the same three graphs as the emulator's binaries
    assert set(p["graphs"]) == {"prompt", "token", "followup"}


def converse(pipe, keep: bool) -> list[tuple]:
    """`QUESTIONS` as one conversation about the demo picture (state kept between turns, or each turn from
    scratch): per turn the text, the token ids, the prefilled rows and the prompt-graph calls per AR."""
    from vlmrun.demo_image import demo_image

    h = pipe.handles["decoder"]
    chat = pipe.chat(settings=SETTINGS, keep_state=keep)
    out = []
    for i, q in enumerate(QUESTIONS):
        before = h.calls_per_ar
        g = chat.ask(q, image=demo_image() if i == 0 else None).run()
        after = h.calls_per_ar
        calls = {ar: after[ar] - before.get(ar, 0) for ar in after if ar > 1}
        out.append((g.text, list(g.token_ids), g.timings["prefill_tokens"], calls))
    return out


def test_a_follow_up_runs_through_the_small_graph_with_the_tokens_from_scratch(npu_pipe):
    h = npu_pipe.handles["decoder"]
    kept, scratch = converse(npu_pipe, True), converse(npu_pipe, False)
    ar = h.artifact.manifest["decoder_parts"]["ar"]
    assert ar >= 68  # the default AR-128 (capped at the hidden size, 128): a first turn in one call
    assert [t[:2] for t in kept] == [t[:2] for t in scratch]  # the same text and tokens, turn by turn
    assert [t[0] for t in kept] == ["A red circle on a blue background.", "Red."]
    assert [t[2] for t in kept] == [68, 27]
    assert kept[0][3] == {ar: 1, 32: 0}  # turn 1: 68 rows, one AR-128 call
    assert kept[1][3] == {ar: 0, 32: 1}  # the follow-up: 27 rows, one AR-32 call
    assert scratch[1][3] == {ar: 1, 32: 0}  # from scratch the second turn is 118 rows: AR-128


def test_the_bundle_ships_the_follow_up_graphs_to_genie(bundle_dir):
    m = json.loads((bundle_dir / "vlmrun-bundle.json").read_text())
    gen = json.loads((bundle_dir / "text-generator.json").read_text())["text-generator"]
    bins = gen["engine"]["model"]["binary"]["ctx-bins"]
    P = m["decoder"]["parts"]
    assert m["decoder"]["followup_ar"] == 32
    assert [b for b in bins if "followup" in b] == [f"part{k}_of_{P}_followup.bin" for k in range(1, P + 1)]
    assert bins == m["decoder"]["files"] and all(b in m["files"] for b in bins)
    meta = json.loads((bundle_dir / "metadata.json").read_text())["model_files"]
    for k in range(1, P + 1):
        (name, graph), = meta[f"part{k}_of_{P}_followup.bin"]["graphs"].items()
        assert re.fullmatch(rf"prompt_ar32_cl{m['context_length']}_0*_{k}_of_{P}", name), name
        assert graph["inputs"]["attention_mask"]["shape"] == [1, 32, m["context_length"]]


def test_a_quantized_follow_up_graph_is_calibrated_on_its_own_calls(tiny_model, store):
    """w8a16: the follow-up graphs get calibration feeds of their own (the host loop through the float AR-32 graphs),
    and the quantized conversation's follow-up goes through them with the tokens computed from scratch."""
    from vlmrun import Pipeline, layouts

    pipe = Pipeline.build(tiny_model, layouts.resolve("all-npu", options={"decoder": {"precision": "w8a16"}}),
                          store=store)
    h = pipe.handles["decoder"]
    m = h.artifact.manifest
    assert (m["precision"], m["decoder_parts"]["followup_ar"]) == ("w8a16", 32)
    feeds = re.search(r"(\d+) prompt / (\d+) token / (\d+) follow-up feeds per part", m["quantization"]["calibration"])
    assert feeds and int(feeds.group(3)) > 0, m["quantization"]["calibration"]
    kept, scratch = converse(pipe, True), converse(pipe, False)
    assert [t[1] for t in kept] == [t[1] for t in scratch]
    assert kept[1][3].get(32) == 1  # the follow-up: one call of the quantized AR-32 graph
