"""The all-npu layout on a phone: vision, projector and embed through qnn-net-run, the decoder through the SDK's
genie-t2t-run on the phone's HTP (Genie's QnnHtp backend), all over adb. Stand-ins for adb, qnn-net-run and
genie-t2t-run (tests/standins/) follow the real flags and files; the "phone" is a local directory."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("onnxruntime_qnn")

from vlmrun import GenerationSettings, Pipeline  # noqa: E402
from vlmrun.errors import BackendError, UsageError  # noqa: E402
from vlmrun.layouts import Layout, StageAssignment  # noqa: E402
from vlmrun.sampling import Sampler  # noqa: E402
from vlmrun.stages import STAGES, DecodeRequest  # noqa: E402
from vlmrun_qualcomm import genie, genie_config, genie_t2t  # noqa: E402

STANDINS = Path(__file__).parent / "standins"
PROMPT = "What is in the picture?"
TEXT = "a red square, on the phone"
MATCHING_QAIRT = "2.51.0.251216"  # the QNN of onnxruntime-qnn 2.7.0, whose binaries qnn_htp makes by default
OLD_QAIRT = "2.42.0.251225"
RD = "/data/local/tmp/vlmrun/genie_htp"
DECODER = {"engine": "genie", "context_length": 128, "prefill_ar": 16}  # Genie: prefill AR <= hidden (tiny: 64)
SDK_FILES = ("genie-t2t-run", "libGenie.so", "libQnnHtp.so", "libQnnHtpV79Stub.so", "libQnnSystem.so",
             "libQnnHtpNetRunExtensions.so", "libQnnHtpV79Skel.so", "libc++_shared.so")
SKEL_LINE = (f'genie-t2t-run on standin-0001 exited with status 1: Failed to create the dialog. (Genie: "Failed to'
             f' create device: 1008"); the phone\'s HTP did not load libQnnHtpV79Skel.so from ADSP_LIBRARY_PATH'
             f" ({RD}): is the phone's SoC SM8750 (v79)? set --soc to the phone's SoC")


def fake_qairt(root: Path, version: str | None = MATCHING_QAIRT, skip=()) -> Path:
    """A QAIRT SDK with what a phone needs: qnn-net-run (the stand-in, run with this interpreter, which has
    onnxruntime-qnn), genie-t2t-run (the stand-in), the HTP runtime for v79 (dummies; libQnnHtp.so carries the
    version as the real one carries its build id), libGenie.so, and the SDK's own libc++_shared.so."""
    exe = root / "bin" / "aarch64-android" / "qnn-net-run"
    exe.parent.mkdir(parents=True, exist_ok=True)
    exe.write_text(f"#!/bin/sh\nexec env -u LD_LIBRARY_PATH -u ADSP_LIBRARY_PATH {sys.executable}"
                   f" {STANDINS / 'qnn-net-run'} \"$@\"\n")
    exe.chmod(0o755)
    if "genie-t2t-run" not in skip:
        (root / "bin" / "aarch64-android" / "genie-t2t-run").symlink_to(STANDINS / "genie-t2t-run")
    if version:
        (root / "sdk.yaml").write_text(f"name: qairt\nversion: {version}\n")
    libs = [f"lib/aarch64-android/{n}" for n in ("libGenie.so", "libQnnHtp.so", "libQnnHtpV79Stub.so",
                                                  "libQnnSystem.so", "libQnnHtpNetRunExtensions.so",
                                                  "libc++_shared.so")]
    for rel in libs + ["lib/hexagon-v79/unsigned/libQnnHtpV79Skel.so"]:
        if Path(rel).name in skip:
            continue
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"\x7fELF stand-in " + rel.encode() + f" QNN v{version or ''}".encode())
    return root


def layout(phone: dict, decoder_only: bool = False, **decoder) -> Layout:
    """all-npu on the phone (every stage qnn_htp, target android); ``decoder_only``: the other stages on
    ort_reference (quicker, for the decoder's faults)."""
    common = {"target": "android", "sdk_root": phone["sdk_root"], "adb": str(STANDINS / "adb")}
    stages = {}
    for s in STAGES:
        if s == "decoder":
            stages[s] = StageAssignment("qnn_htp", {**common, **DECODER, **decoder})
        elif decoder_only:
            stages[s] = StageAssignment("ort_reference", {})
        else:
            stages[s] = StageAssignment("qnn_htp", dict(common))
    return Layout("test-genie-phone", stages)


@pytest.fixture
def phone(tmp_path, monkeypatch):
    sdk = fake_qairt(tmp_path / "qairt")
    for env in ("QAIRT_SDK_ROOT", "QNN_SDK_ROOT", "ANDROID_NDK_ROOT", "ANDROID_NDK_HOME", "ANDROID_NDK",
                "STANDIN_GENIE_MODE", "STANDIN_QNN_NET_RUN_MODE", "STANDIN_HTP_ARCH", "STANDIN_GENIE_DELAY"):
        monkeypatch.delenv(env, raising=False)
    monkeypatch.setenv("STANDIN_ADB_ROOT", str(tmp_path / "phone"))
    monkeypatch.setenv("STANDIN_ADB_LOG", str(tmp_path / "adb.log"))
    monkeypatch.setenv("STANDIN_GENIE_LOG", str(tmp_path / "t2t.json"))
    monkeypatch.setenv("STANDIN_GENIE_TEXT", TEXT)
    return {"sdk_root": str(sdk), "log": tmp_path / "adb.log", "t2t": tmp_path / "t2t.json",
            "dir": tmp_path / "phone" / RD.lstrip("/"), "tmp": tmp_path}


def adb_lines(phone) -> list[str]:
    return phone["log"].read_text().splitlines() if phone["log"].exists() else []


# -- the whole layout on the phone ---------------------------------------------------------------------------
def test_all_npu_on_the_phone(phone, tiny_model, store, image_path):
    t0 = time.perf_counter()
    pipe = Pipeline.build(tiny_model, layout(phone), store=store)
    build_s = time.perf_counter() - t0
    handle = pipe.handles["decoder"]
    phone_run = handle.phone
    bins = [f"{Path(b).parent.name}/{Path(b).name}" for b in handle.ctx_bins]
    assert len(bins) == 2 and all(b.endswith("_qnn.bin") for b in bins)  # AR-16 then AR-1
    static = ([f"{RD}/{n}" for n in SDK_FILES] + [f"{RD}/{b}" for b in bins]
              + [f"{RD}/tokenizer.json", f"{RD}/embed_lut_f32.raw"])
    assert phone_run.adb.pushed == static and phone_run.adb.skipped == []

    t0 = time.perf_counter()
    gen = pipe.generate(image_path, PROMPT, GenerationSettings(max_new_tokens=32))
    pieces = list(gen)
    gen_s = time.perf_counter() - t0
    assert "".join(pieces) == TEXT and gen.text == TEXT and len(pieces) > 1  # streamed, piece by piece
    assert gen.token_ids == tiny_model.tokenizer.encode(TEXT, add_special_tokens=False).ids
    assert phone_run.adb.pushed == static + [f"{RD}/genie_config.json", f"{RD}/embeddings.raw"]

    # the exact command line, as adb got it
    line = (f"cd {RD} && env LD_LIBRARY_PATH={RD} ADSP_LIBRARY_PATH={RD} ./genie-t2t-run -c genie_config.json"
            " -e embeddings.raw -t embed_lut_f32.raw --embedding_query_output_type text --profile profile.json")
    assert phone_run.last_command == line
    assert f"-s standin-0001 shell {line}" in adb_lines(phone)
    # the other stages ran through qnn-net-run on the phone
    assert any("qnn-net-run --retrieve_context" in ln for ln in adb_lines(phone))

    # the config genie-t2t-run read: the handle's QnnHtp dialog config, paths relative to the remote directory
    on_phone = json.loads((phone["dir"] / "genie_config.json").read_text())["dialog"]
    seen = json.loads(phone["t2t"].read_text())
    assert seen["config"] == on_phone and seen["cwd"] == str(phone["dir"])
    assert seen["ld_library_path"] == seen["adsp_library_path"] == str(phone["dir"])
    assert on_phone["engine"]["backend"]["type"] == "QnnHtp" and on_phone["engine"]["n-threads"] == 3
    assert on_phone["engine"]["model"]["binary"]["ctx-bins"] == bins
    assert on_phone["tokenizer"]["path"] == "tokenizer.json" and on_phone["max-num-tokens"] == 32
    assert on_phone["context"]["size"] == 128 and on_phone["context"]["n-embd"] == tiny_model.hidden_size
    assert on_phone["embedding"] == {"version": 1, "size": tiny_model.hidden_size, "datatype": "float32"}
    for b in bins:  # the binaries on the phone are the compiled ones
        assert (phone["dir"] / b).read_bytes() == Path(handle.ctx_bins[bins.index(b)]).read_bytes()
    assert (phone["dir"] / "tokenizer.json").read_bytes() == (tiny_model.path / "tokenizer.json").read_bytes()
    lut = np.fromfile(phone["dir"] / "embed_lut_f32.raw", np.float32).reshape(tiny_model.vocab_size, -1)
    assert np.array_equal(lut, np.load(handle.lut_npy))
    # Genie got the pipeline's own spliced prompt embeddings (vision/projector/embed from the phone)
    emb = np.asarray(seen["embeddings"], np.float32).reshape(-1, tiny_model.hidden_size)
    assert np.array_equal(emb, gen.tensors["inputs_embeds"][0])

    # Genie's profile became the timings
    assert handle.last_timings == {"genie_init_ms": 120.0, "genie_query_ms": 900.0, "prompt_tokens": emb.shape[0],
                                   "prompt_tokens_per_s": 250.5, "ttft_ms": 345.678, "new_tokens": 6.0,
                                   "tokens_per_s": 12.25}
    assert gen.timings["ttft_ms"] == 345.678 and gen.timings["tokens_per_s"] == 12.25
    print(f"\n[genie phone] build {build_s:.1f} s, generate {gen_s:.1f} s; pushed {len(phone_run.adb.pushed)}")

    # a second run: what is on the phone already (same sha256) is not pushed again
    again = Pipeline.build(tiny_model, layout(phone), store=store)
    adb2 = again.handles["decoder"].phone.adb
    assert adb2.pushed == [] and adb2.skipped == static
    h2 = again.handles["decoder"]
    req = DecodeRequest(gen.tensors["inputs_embeds"], 32, Sampler(), frozenset(), again.embed_tokens, 128)
    assert tiny_model.tokenizer.decode(list(h2.phone.generate(h2, req))) == TEXT  # the decoder alone, this time
    assert adb2.pushed == [f"{RD}/genie_config.json", f"{RD}/embeddings.raw"]


@pytest.fixture
def decoder_pipe(phone, tiny_model, store):
    """The decoder alone on the phone (other stages on ort_reference)."""
    return Pipeline.build(tiny_model, layout(phone, decoder_only=True), store=store)


def test_tokens_stream_while_genie_runs(phone, decoder_pipe, image_path, monkeypatch):
    monkeypatch.setenv("STANDIN_GENIE_DELAY", "0.4")  # per word, 6 words
    t0 = time.perf_counter()
    gen = decoder_pipe.generate(image_path, PROMPT, GenerationSettings(max_new_tokens=32))
    first = None
    pieces = []
    for piece in gen:
        first = first if first is not None else time.perf_counter() - t0
        pieces.append(piece)
    total = time.perf_counter() - t0
    assert "".join(pieces) == TEXT
    assert total - first > 1.0  # the first words reached the caller while genie-t2t-run was still generating


def test_missing_skel_on_the_phone_is_one_line(phone, decoder_pipe, image_path):
    (phone["dir"] / "libQnnHtpV79Skel.so").unlink()  # ADSP_LIBRARY_PATH no longer holds it
    with pytest.raises(BackendError) as err:
        decoder_pipe.generate(image_path, PROMPT, GenerationSettings(max_new_tokens=8)).run()
    assert str(err.value) == SKEL_LINE
    assert decoder_pipe.handles["decoder"].last_timings == {}


def test_missing_sdk_pieces_are_named_before_any_work(phone, tiny_model, tmp_path, monkeypatch):
    from vlmrun.store import ArtifactStore

    store = ArtifactStore(tmp_path / "cache")
    no_skel = fake_qairt(tmp_path / "no-skel", skip=("libQnnHtpV79Skel.so",))
    with pytest.raises(BackendError) as err:
        Pipeline.build(tiny_model, layout({**phone, "sdk_root": str(no_skel)}, decoder_only=True), store=store)
    assert str(err.value) == (
        "the QAIRT SDK lacks lib/hexagon-v79/unsigned/libQnnHtpV79Skel.so, needed for the Genie decoder on a phone"
        f" (--decoder-engine genie --target android) (HTP v79); looked in {no_skel} (the sdk_root option)")
    bare = fake_qairt(tmp_path / "bare", skip=("genie-t2t-run", "libGenie.so", "libQnnHtpV79Stub.so",
                                               "libc++_shared.so"))
    with pytest.raises(BackendError) as err:
        Pipeline.build(tiny_model, layout({**phone, "sdk_root": str(bare)}, decoder_only=True), store=store)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(
        "the QAIRT SDK lacks bin/aarch64-android/genie-t2t-run, lib/aarch64-android/libGenie.so,"
        " lib/aarch64-android/libQnnHtpV79Stub.so, libc++_shared.so (from the Android NDK: set ANDROID_NDK_ROOT),")
    assert store.builds == [] and not phone["log"].exists()  # preflight: no export, no compile, no adb


def test_binary_newer_than_the_phone_sdk_is_refused_before_any_push(phone, tiny_model, tmp_path):
    from vlmrun.store import ArtifactStore

    old = fake_qairt(tmp_path / "old", OLD_QAIRT)
    with pytest.raises(BackendError) as err:
        Pipeline.build(tiny_model, layout({**phone, "sdk_root": str(old)}, decoder_only=True),
                       store=ArtifactStore(tmp_path / "cache"))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("decoder: the context binary was built with QNN 2.51")
    assert f"QAIRT {OLD_QAIRT}" in msg and not phone["log"].exists()


def test_host_engine_on_a_phone_says_use_genie(phone, tiny_model, store):
    with pytest.raises(UsageError) as err:
        Pipeline.build(tiny_model, layout(phone, decoder_only=True, engine="host"), store=store)
    assert str(err.value) == ("the decoder's host engine cannot run on a phone (qnn-net-run runs one graph per call);"
                              " use --decoder-engine genie: Genie's genie-t2t-run decodes on the phone's HTP")


def test_generated_error_text_is_text_and_context_is_checked_first(phone, decoder_pipe, image_path, monkeypatch):
    from vlmrun.errors import InputError

    text = "Error: Failed to create device: 1008 is what the sign says"
    monkeypatch.setenv("STANDIN_GENIE_TEXT", text)
    gen = decoder_pipe.generate(image_path, PROMPT, GenerationSettings(max_new_tokens=64)).run()
    assert gen.text == text  # errors come from stderr and the exit status, never from the generated text
    phone["t2t"].unlink()
    emb = gen.tensors["inputs_embeds"]
    P = emb.shape[1]
    handle = decoder_pipe.handles["decoder"]
    too_many = DecodeRequest(emb, 128 - P + 1, Sampler(), frozenset(), decoder_pipe.embed_tokens, 128)
    with pytest.raises(InputError, match=rf"the prompt \({P} tokens\) plus {129 - P} new tokens do not fit the Genie"
                                         r" context of 128 tokens"):
        list(handle.phone.generate(handle, too_many))
    assert not phone["t2t"].exists()  # genie-t2t-run never started


# -- the genie-t2t-run stand-in's QnnHtp contract --------------------------------------------------------------
@pytest.fixture
def htp_files(tmp_path, tiny_model):
    facts = genie_config.GenieModel.from_model(tiny_model)
    cfg = genie_config.dialog_config(facts, "QnnHtp", tokenizer="t.json", context_size=128,
                                     ctx_bins=["m/a_qnn.bin", "m/b_qnn.bin"])
    (tmp_path / "c.json").write_text(json.dumps(cfg))
    genie.write_embeddings(tmp_path / "e.raw", np.ones((1, 3, facts.hidden), np.float32))
    genie.write_lut(tmp_path / "l.raw", np.zeros((facts.vocab, facts.hidden), np.float32))
    (tmp_path / "m").mkdir()
    for name in ("m/a_qnn.bin", "m/b_qnn.bin", *[f"lib/{n}" for n in SDK_FILES[1:]]):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(b"stand-in")
    return tmp_path


def _t2t(d: Path, **env):
    argv = genie_t2t.t2t_argv(str(STANDINS / "genie-t2t-run"), "c.json", embedding_file="e.raw", lut="l.raw",
                              output_type="text")
    base = {"LD_LIBRARY_PATH": str(d / "lib"), "ADSP_LIBRARY_PATH": str(d / "lib"), "STANDIN_ON_DEVICE": "1"}
    return genie_t2t.run_t2t(argv, timeout=30, cwd=d, env={**base, **env})


def test_standin_enforces_the_htp_runtime(htp_files, monkeypatch):
    monkeypatch.setenv("STANDIN_GENIE_TEXT", "ok then")
    monkeypatch.delenv("STANDIN_HTP_ARCH", raising=False)
    assert _t2t(htp_files).text == "ok then"
    # FastRPC splits ADSP_LIBRARY_PATH on ";", not ":"
    assert _t2t(htp_files, ADSP_LIBRARY_PATH=f"/vendor/lib/rfsa/adsp;{htp_files / 'lib'}").text == "ok then"
    with pytest.raises(BackendError, match=r'status 1: Failed to create the dialog\. \(Genie: "Failed to create'
                                           r' device: 1008"\)$'):
        _t2t(htp_files, ADSP_LIBRARY_PATH=f"/vendor/lib/rfsa/adsp:{htp_files / 'lib'}")
    # a v75 phone needs the v75 Stub and Skel
    with pytest.raises(BackendError, match=r'\(Genie: "Failed to load libQnnHtpV75Stub\.so"\)$'):
        _t2t(htp_files, STANDIN_HTP_ARCH="75")
    (htp_files / "m" / "b_qnn.bin").unlink()
    with pytest.raises(BackendError, match=r'\(Genie: "Could not open context binary m/b_qnn\.bin"\)$'):
        _t2t(htp_files)
    (htp_files / "lib" / "libQnnHtp.so").unlink()
    with pytest.raises(BackendError, match=r'Unable to load backend\. dlerror\(\): dlopen failed: library'
                                           r' "libQnnHtp\.so" not found"\)$'):
        _t2t(htp_files)


def test_retokenizer_gives_the_final_ids_whatever_the_chunks(tiny_model):
    from vlmrun_qnn_htp.genie_phone import Retokenizer

    tok = tiny_model.tokenizer
    for text in ("a red square, on the phone", "end.\n\nNext (word) 123 4567 it's  two  spaces\tand tab",
                 "[END] inside [EN and ] 日本語 🙂 ok", "x"):
        r, got = Retokenizer(tok), []
        for i in range(1, len(text) + 1):
            got += r.stable(text[:i])
        got += r.final(text)
        assert got == tok.encode(text, add_special_tokens=False).ids


# -- the CLI ----------------------------------------------------------------------------------------------------
def test_cli_all_npu_genie_on_the_phone(phone, cache_dir, image_path, tmp_path):
    from conftest import run_cli

    lay = tmp_path / "phone.toml"
    lay.write_text('base = "all-npu"\n[decoder]\ncontext_length = 128\nprefill_ar = 16\n')
    env = {k: os.environ[k] for k in ("STANDIN_ADB_ROOT", "STANDIN_ADB_LOG", "STANDIN_GENIE_TEXT")}
    env.update(QAIRT_SDK_ROOT=phone["sdk_root"], VLMRUN_ADB=str(STANDINS / "adb"))
    res = run_cli(["--layout-file", str(lay), "--decoder-engine", "genie", "--target", "android", "--image-size",
                   "256", "--image", str(image_path), "--prompt", "Hi", "--max-new-tokens", "16", "--json"],
                  cache_dir, env)
    assert res.returncode == 0, res.stderr[-2000:]
    out = json.loads(res.stdout)
    assert out["text"] == TEXT and set(out["layout"].values()) == {"qnn_htp"}
    assert out["timings"]["ttft_ms"] == 345.678
    assert any(f"shell cd {RD} && env LD_LIBRARY_PATH={RD}" in ln for ln in adb_lines(phone))


# -- the genie-app stand-in's dialog contract (what keeps a conversation on the phone: test_phone_chat.py) -------
def _app(d: Path, script: str, **env):
    import subprocess

    (d / "s.txt").write_text(script)
    base = {"LD_LIBRARY_PATH": str(d / "lib"), "ADSP_LIBRARY_PATH": str(d / "lib"), "STANDIN_ON_DEVICE": "1",
            "STANDIN_GENIE_TEXT": "ok then"}
    return subprocess.run([sys.executable, str(STANDINS / "genie-app"), "-s", "s.txt"], cwd=d, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **base, **env})


def test_standin_genie_app_dialogs_save_and_restore_like_genie(htp_files):
    from vlmrun_qualcomm.genie_app import app_errors, dialog_script

    (htp_files / "t.json").write_text("{}")
    first = _app(htp_files, dialog_script("c.json", "e.raw", "l.raw", "conv/turn_1"))
    assert first.returncode == 0 and first.stderr == "" and "[BEGIN]: ok then[END]" in first.stdout
    saved = json.loads((htp_files / "conv" / "turn_1" / "dialog.json").read_text())
    assert saved == {"n-past": 3 + 2}  # the 3 rows fed and both answer tokens (each fed back; the end token not)
    again = _app(htp_files, dialog_script("c.json", "e.raw", "l.raw", "conv/turn_2", "conv/turn_1"))
    assert app_errors(again.stderr) == [] and json.loads((htp_files / "conv/turn_2/dialog.json").read_text()) == {
        "n-past": 5 + 3 + 2}
    # a restore of a directory no `dialog save` wrote: the failing line on stderr (in red), and the script goes on
    gone = _app(htp_files, dialog_script("c.json", "e.raw", "l.raw", "conv/turn_3", "conv/nowhere"))
    assert gone.returncode == 0 and "[BEGIN]: ok then[END]" in gone.stdout
    assert gone.stderr.startswith("\x1b[91m") and app_errors(gone.stderr) == ["Failed to restore. (script line 3)"]
    # nothing to save yet; an embeddings file that is no whole number of rows; the script's grammar
    bad = _app(htp_files, "dialog config create c c.json\ndialog create d c\ndialog save d x\n"
                          "dialog embeddingQuery d l.raw\ndialog restore d\nnode bogus\n")
    assert app_errors(bad.stderr) == ["Failed to save. (script line 3)",
                                      "Ill-formatted command: dialog embeddingQuery d l.raw. (script line 4)",
                                      "Ill-formatted command: dialog restore d. (script line 5)",
                                      "Unknown command: node bogus (script line 6)"]
    (htp_files / "e.raw").write_bytes(b"\0" * 6)
    assert app_errors(_app(htp_files, dialog_script("c.json", "e.raw", "l.raw", "conv/t4")).stderr) == [
        "Embedding file doesn't exists or is in bad shape. (script line 3)", "Failed to save. (script line 4)"]


def test_answer_pieces_follow_the_output_and_hold_back_a_mark_in_the_making():
    out = "log line\n[BEGIN]: a red [square] [E" + "ND] [END]\n\nbye"
    for size in (1, 2, 3, 7, len(out)):
        chunks = [out[i:i + size] for i in range(0, len(out), size)]
        pieces = list(genie_t2t.answer_pieces(chunks))
        assert "".join(pieces) == genie_t2t.split_t2t_stdout(out)[0] == "a red [square] [END] "
        so_far = ["".join(pieces[: k + 1]) for k in range(len(pieces))]
        assert all("a red [square] [END] ".startswith(t) for t in so_far)  # never text a later chunk takes back
    # what streamed before an [ABORT] or a cut-off output is the text split_t2t_stdout reads
    assert "".join(genie_t2t.answer_pieces(["[BEGIN]: ab", "c[AB", "ORT]"])) == "abc"
    assert "".join(genie_t2t.answer_pieces(["no begin here"])) == ""


def test_a_device_command_streams_its_stdout_and_keeps_its_timeout(phone, tmp_path):
    from vlmrun_qualcomm.adb import Adb

    adb = Adb.connect(adb=str(STANDINS / "adb"))
    script = "for w in one two three; do printf '%s ' $w; sleep 0.4; done; echo oops >&2; exit 3"
    run = adb.stream(["sh", "-c", script], timeout=30, what="a device command")
    t0, seen = time.perf_counter(), []
    for text in run:
        seen.append((text, time.perf_counter() - t0))
    assert "".join(t for t, _ in seen) == run.stdout == "one two three "
    assert len(seen) >= 2 and seen[-1][1] - seen[0][1] > 0.6  # piece by piece, as the command printed them
    assert run.stderr == "oops\n" and run.returncode == 3  # a non-zero exit is the caller's to judge
    slow = adb.stream(["sleep", "30"], timeout=1, what="a device command", hint="raise the timeout option")
    with pytest.raises(BackendError, match=r"^a device command timed out after 1 s \(killed\); raise the timeout"
                                           r" option$"):
        list(slow)


def test_standin_genie_app_pipelines_save_and_restore_like_genie_app(htp_files):
    from vlmrun_qnn_htp.bundle_phone import turn_script
    from vlmrun_qualcomm.genie_app import app_errors

    d = htp_files
    (d / "img-enc-htp.json").write_text(json.dumps({"image-encoder": {}}))
    (d / "text-encoder.json").write_text(json.dumps({"text-encoder": {"lut": {"lut-path": "l.raw"}}}))
    (d / "gen.json").write_text(json.dumps({"text-generator": {"embedding": {"type": "lut", "lut-path": "l.raw"},
                                                               "max-num-tokens": 8}}))
    (d / "a.txt").write_text("Hello")
    (d / "b.txt").write_text(" again")
    (d / "p.raw").write_bytes(b"\0" * 16)
    log = d / "app.json"
    first = _app(d, turn_script("gen.json", [("text", "a.txt"), ("image", "p.raw")], "conv/turn_1"),
                 STANDIN_GENIE_APP_LOG=str(log))
    assert first.returncode == 0 and app_errors(first.stderr) == [] and "[BEGIN]: ok then[END]" in first.stdout
    assert json.loads(log.read_text())["executed"] == [{"restored": 0, "fed": 5 + 8}]  # 5 characters, the picture
    assert json.loads((d / "conv" / "turn_1" / "pipeline.json").read_text()) == {"n-values": 5 + 8 + 7}
    again = _app(d, turn_script("gen.json", [("text", "b.txt")], "conv/turn_2", "conv/turn_1"),
                 STANDIN_GENIE_APP_LOG=str(log))
    assert app_errors(again.stderr) == [] and json.loads(log.read_text())["executed"] == [
        {"restored": 5 + 8 + 7, "fed": 6}]  # the restored state, then only the new text
    # a restore of a directory no `pipeline save` wrote: the failing line on stderr (in red), the script goes on
    script = turn_script("gen.json", [("text", "b.txt")], "conv/turn_3", "conv/nowhere")
    gone = _app(d, script)
    line = script.splitlines().index("pipeline restore GeniePipeline conv/nowhere") + 1
    assert gone.returncode == 0 and "[BEGIN]: ok then[END]" in gone.stdout and gone.stderr.startswith("\x1b[91m")
    assert app_errors(gone.stderr) == [f"Failed to restore. (script line {line})"]
    bad = _app(d, "pipeline config create c\npipeline create P c\npipeline save P x\npipeline restore P\n"
                  "pipeline save Q x\npipeline reset P\n")
    assert app_errors(bad.stderr) == ["Failed to save. (script line 3)",
                                      "Ill-formatted command: pipeline restore P. (script line 4)",
                                      "Pipeline does not exist: Q (script line 5)"]
    script = turn_script("gen.json", [("text", "a.txt")], "conv/t5")
    old = _app(d, script, STANDIN_GENIE_APP_OLD="1")  # a genie-app older than pipeline save / restore
    line = script.splitlines().index("pipeline save GeniePipeline conv/t5") + 1
    assert app_errors(old.stderr) == [f"Ill-formatted command: pipeline save GeniePipeline conv/t5. (script line"
                                      f" {line})"]
    assert "[BEGIN]: ok then[END]" in old.stdout  # the answer all the same
