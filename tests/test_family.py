"""The FastVLM family (issue 32) on tiny models: the 1.5B / 7B attention shape and the family's checkpoints.

* A decoder with the 1.5B head size (128) and GQA ratio (12 query heads over 2 KV heads), exported in the parts
  form as torch writes a graph above 2 GiB (every tensor in its own file beside the graph, named after it): the
  prompt and token graphs of a part keep their own constants (the internal error of issue 32), their logits match
  torch, and the w4a16 quantized part still answers (onnxruntime's QDQ model on the CPU).
* The sizes table of ``vlmrun make-tiny --size`` and the sharded bf16 Apple-layout writer: tensor by tensor,
  shards of a bounded size, an index; a tiny model written that way loads through the checkpoint detection and
  answers like the original.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import cosine, run_cli

pytest.importorskip("torch")
pytest.importorskip("onnxruntime")

#: Qwen2-1.5B's attention at tiny width: 12 query heads and 2 KV heads of 128 (hidden 128, so q_proj is
#: [1536, 128]): the head size and GQA ratio of FastVLM-1.5B (7B: 28 / 4 heads of 128)
GQA128 = {"hidden_size": 128, "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 128,
          "num_hidden_layers": 2, "max_window_layers": 2, "intermediate_size": 256}
AR, CTX = 8, 32


def _torch_external_file(name: str) -> str:
    """The file torch's exporter names a tensor's external data after (export.cpp ``GetExternalFileName``)."""
    return "".join("_" if c in '\\/:?"<>|' else c for c in name)


def exporter_above_2gib(real_export):
    """``torch.onnx.export`` as the legacy exporter writes a graph above 2 GiB (torch/csrc/jit/serialization/
    export.cpp): every tensor of more than 1024 elements, initializer or Constant, in its own file beside the
    graph, named after the tensor, replacing any file of that name. Only the size threshold is faked here."""
    import onnx
    from onnx import numpy_helper

    def export(module, args, f, *rest, **kw):
        real_export(module, args, f, *rest, **kw)
        proto = onnx.load(f)
        folder = Path(f).parent
        named = [(t, t.name) for t in proto.graph.initializer]
        named += [(n.attribute[0].t, n.output[0]) for n in proto.graph.node if n.op_type == "Constant"
                  and n.attribute[0].type == onnx.AttributeProto.TENSOR]
        for tensor, name in named:
            if int(np.prod(tensor.dims or [1])) <= 1024:
                continue
            data = numpy_helper.to_array(tensor).tobytes()
            file = _torch_external_file(name)
            (folder / file).write_bytes(data)
            dims, dtype = list(tensor.dims), tensor.data_type
            tensor.Clear()
            tensor.name, tensor.data_type = name, dtype
            tensor.dims.extend(dims)
            tensor.data_location = onnx.TensorProto.EXTERNAL
            entry = tensor.external_data.add()
            entry.key, entry.value = "location", file
        onnx.save(proto, f)

    return export


@pytest.fixture(scope="module")
def gqa128(tmp_path_factory):
    """A random tiny FastVLM with head size 128 and 12 / 2 heads (64 x 64 images: one image token)."""
    from vlmrun.fastvlm_files import fastvlm_processor
    from vlmrun.model import FastVLMModel
    from vlmrun.tiny import build_model

    out = tmp_path_factory.mktemp("gqa128")
    model, tokenizer = build_model(image_size=64, text=GQA128)
    model.save_pretrained(out)
    fastvlm_processor(tokenizer, 64).save_pretrained(out)
    tokenizer.save_pretrained(out)
    m = FastVLMModel.open(out)
    assert (m.head_dim, m.num_heads, m.num_kv_heads) == (128, 12, 2)
    return m


@pytest.fixture(scope="module")
def parts_above_2gib(gqa128, tmp_path_factory):
    """The parts form (two parts of one layer) of `gqa128`, exported as torch writes graphs above 2 GiB."""
    import torch
    from vlmrun.stages import ExportForm
    from vlmrun_ort_reference.decoder_parts import export_parts

    out = tmp_path_factory.mktemp("parts")
    form = ExportForm.of("decoder", "decoder/parts", ar=AR, ctx=CTX, layers="1,1", rmsnorm="safe")
    real = torch.onnx.export
    mp = pytest.MonkeyPatch()
    mp.setattr(torch.onnx, "export", exporter_above_2gib(real))
    try:
        manifest = export_parts(gqa128, form, out)
    finally:
        mp.undo()
    return out, manifest


def _prompt_feeds(model, embeds):
    """Feeds of a prompt graph for ``embeds`` [1,AR,H] at positions 0..AR-1, nothing in the past."""
    import torch

    lm = model.load_torch().model.language_model
    half = model.head_dim // 2
    with torch.no_grad():
        cos, sin = lm.rotary_emb(torch.zeros(1), torch.arange(AR)[None])
    mask = np.full((1, AR, CTX), -65504.0, np.float32)
    mask[0, :, CTX - AR:] = np.triu(np.full((AR, AR), -65504.0, np.float32), 1)
    return {"inputs_embeds": embeds, "attention_mask": mask,
            "position_ids_cos": cos[..., :half].numpy()[None].astype(np.float32),
            "position_ids_sin": sin[..., :half].numpy()[None].astype(np.float32)}


def _run_parts(out: Path, desc: dict, feeds: dict, kind: str = "prompt", files=None) -> np.ndarray:
    """Chain the parts' ``kind`` graphs on onnxruntime's CPU (``files``: other graphs per part); the logits."""
    import onnxruntime as ort

    got = dict(feeds)
    for p in desc["parts"]:
        path = files[p["index"]] if files else out / p["graphs"][kind]["file"]
        s = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        ins = {i.name: got[i.name] if i.name in got else np.zeros(i.shape, np.float32) for i in s.get_inputs()}
        got.update(zip([o.name for o in s.get_outputs()], s.run(None, ins)))
    return got["logits"]


def _torch_logits(model, embeds: np.ndarray) -> np.ndarray:
    import torch

    fvlm = model.load_torch()
    with torch.no_grad():
        h = fvlm.model.language_model(inputs_embeds=torch.from_numpy(embeds)).last_hidden_state
        return fvlm.lm_head(h).numpy()


def test_head_size_128_parts_keep_each_graphs_constants_above_2gib(gqa128, parts_above_2gib):
    """Issue 32's internal error: the prompt and token graphs of a part, written above 2 GiB, each keep their own
    zeros of past_key [KV,1,D,C-T] (same tensor name, another C-T; in the part's one weights file, where the
    weights they share are stored once); both load and the prompt graph's logits match torch."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo

    out, manifest = parts_above_2gib
    desc = json.loads((out / "parts.json").read_text())
    for p in desc["parts"]:
        data = f"part{p['index']}_of_{len(desc['parts'])}.onnx.data"  # the part's graphs share one weights file
        for kind, rows in (("prompt", AR), ("token", 1)):
            g = p["graphs"][kind]
            assert g["files"] == [g["file"], data]  # the files each graph is made of, listed
            proto = onnx.load(str(out / g["file"]), load_external_data=False)
            external = [t for t in proto.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
            assert external and {ExternalDataInfo(t).location for t in external} == {data}
            onnx.load(str(out / g["file"]))  # the data matches every shape (the error raised here)
    assert sorted(f.name for f in out.iterdir()) == sorted(manifest["files"])  # no stray per-tensor files
    rng = np.random.default_rng(0)
    embeds = (rng.standard_normal((1, AR, gqa128.hidden_size)) * 0.02).astype(np.float32)
    got = _run_parts(out, desc, _prompt_feeds(gqa128, embeds))
    want = _torch_logits(gqa128, embeds)
    assert cosine(got, want) > 0.9999
    assert np.array_equal(got.argmax(-1), want.argmax(-1))


def test_head_size_128_w4a16_part_answers_on_the_cpu(gqa128, parts_above_2gib, tmp_path):
    """Each part quantized w4a16 (onnxruntime's recipe, the bundle's default) from the external-data graphs;
    the QDQ parts chained on the CPU give the float parts' logits to within 4-bit weight noise (cosine)."""
    pytest.importorskip("vlmrun_qnn_htp")
    from vlmrun_qnn_htp.quantizer import quantize
    from vlmrun_qnn_htp.recipe import Recipe

    out, _ = parts_above_2gib
    desc = json.loads((out / "parts.json").read_text())
    rng = np.random.default_rng(1)
    embeds = (rng.standard_normal((1, AR, gqa128.hidden_size)) * 0.02).astype(np.float32)
    feeds = _prompt_feeds(gqa128, embeds)
    float_logits = _run_parts(out, desc, feeds)
    qdq, calib = {}, dict(feeds)
    for p in desc["parts"]:  # calibrate part k on part k-1's float outputs
        import onnxruntime as ort

        src = out / p["graphs"]["prompt"]["file"]
        s = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
        part_feeds = {i.name: calib[i.name] if i.name in calib else np.zeros(i.shape, np.float32)
                      for i in s.get_inputs()}
        calib.update(zip([o.name for o in s.get_outputs()], s.run(None, part_feeds)))
        qdq[p["index"]] = tmp_path / f"part{p['index']}.qdq.onnx"
        facts = quantize(src, qdq[p["index"]], [part_feeds], Recipe(precision="w4a16"), tmp_path)
        assert facts["weights"].startswith("QInt4")
    got = _run_parts(out, desc, feeds, files=qdq)
    # measured 0.92 (random weights at 4 bits per channel; tests/test_npu_decoder.py accepts 0.7 for w4a16)
    assert cosine(got, float_logits) > 0.85


def _external(path: Path) -> dict[str, tuple[str, int, int]]:
    """{tensor name: (file, offset, length)} of the tensors ``path`` keeps outside it (Constant values too)."""
    import onnx
    from onnx.external_data_helper import ExternalDataInfo

    from vlmrun.onnx_files import tensors

    proto = onnx.load(str(path), load_external_data=False)
    return {t.name: (ExternalDataInfo(t).location, ExternalDataInfo(t).offset or 0, ExternalDataInfo(t).length)
            for t, _ in tensors(proto.graph) if t.data_location == onnx.TensorProto.EXTERNAL}


def test_a_parts_graphs_share_one_copy_of_its_weights_above_2gib(parts_above_2gib):
    """The prompt and token graphs of a part keep their weights in one file, ``part{k}_of_{P}.onnx.data``: the
    part's weights once, plus the token graph's own zeros of another past length; `graph_files` finds it."""
    import os

    from vlmrun.onnx_files import graph_files

    out, manifest = parts_above_2gib
    desc = json.loads((out / "parts.json").read_text())
    P = len(desc["parts"])
    assert sorted(f for f in manifest["files"] if f.endswith(".data")) == [f"part{k}_of_{P}.onnx.data"
                                                                           for k in range(1, P + 1)]
    for p in desc["parts"]:
        data = f"part{p['index']}_of_{P}.onnx.data"
        prompt, token = (out / p["graphs"][k]["file"] for k in ("prompt", "token"))
        assert [p["graphs"][k]["files"] for k in ("prompt", "token")] == [[prompt.name, data], [token.name, data]]
        assert graph_files(prompt) == [prompt, out / data] and graph_files(token) == [token, out / data]
        pt, tt = _external(prompt), _external(token)
        assert {f for f, _, _ in [*pt.values(), *tt.values()]} == {data}
        ranges = {(o, n) for _, o, n in [*pt.values(), *tt.values()]}
        size = os.stat(out / data).st_size
        assert size == sum(n for _, n in ranges)  # every byte is some tensor's, each stored once
        shared = {(o, n) for _, o, n in pt.values()} & {(o, n) for _, o, n in tt.values()}
        weights = sum(n for name, (_, _, n) in pt.items() if name.startswith("layers.") or "MatMul" in name)
        assert weights > 0 and sum(n for _, n in shared) >= weights  # the prompt graph's weights: shared
        both = sum(n for _, _, n in pt.values()) + sum(n for _, _, n in tt.values())
        assert size < 0.6 * both  # each graph had its own copy before


def test_a_part_exported_with_its_weights_outside_answers_as_inside(gqa128, tmp_path, monkeypatch):
    """Below 2 GiB torch writes the weights inside the graph; a graph above the external-data threshold (0.5B)
    moves them out, into its part's one file: the prompt and token graphs give exactly the logits of the graphs
    that keep them inside."""
    from vlmrun.onnx_files import graph_files
    from vlmrun.stages import ExportForm
    from vlmrun_ort_reference import part_weights
    from vlmrun_ort_reference.decoder_parts import export_parts

    form = ExportForm.of("decoder", "decoder/parts", ar=AR, ctx=CTX, layers="1,1", rmsnorm="safe")
    inside, outside = tmp_path / "inside", tmp_path / "outside"
    inside.mkdir()
    outside.mkdir()
    export_parts(gqa128, form, inside)
    monkeypatch.setattr(part_weights, "EXTERNAL_DATA_THRESHOLD", 0)
    export_parts(gqa128, form, outside)
    assert not list(inside.glob("*.data"))
    desc = json.loads((outside / "parts.json").read_text())
    for p in desc["parts"]:
        for kind in ("prompt", "token"):
            path = outside / p["graphs"][kind]["file"]
            assert graph_files(path) == [path, outside / f"part{p['index']}_of_2.onnx.data"]
            assert len(_external(path)) >= 4  # the attention and MLP weights moved out
    rng = np.random.default_rng(2)
    embeds = (rng.standard_normal((1, AR, gqa128.hidden_size)) * 0.02).astype(np.float32)
    feeds = _prompt_feeds(gqa128, embeds)
    assert np.array_equal(_run_parts(outside, desc, feeds), _run_parts(inside, desc, feeds))
    one = {"inputs_embeds": embeds[:, -1:], "attention_mask": feeds["attention_mask"][:, -1:],
           **{n: feeds[n][:, :, -1:] for n in ("position_ids_cos", "position_ids_sin")}}
    assert np.array_equal(_run_parts(outside, desc, one, "token"), _run_parts(inside, desc, one, "token"))


# -- sizes and the sharded Apple-layout writer --------------------------------------------------------------------
def test_sizes_table_has_apples_dimensions():
    from vlmrun.family import SIZES, checkpoint_bytes

    dims = {n: (s.hidden, s.layers, s.heads, s.kv_heads, s.intermediate, s.vocab_rows, s.tie, s.head_dim)
            for n, s in SIZES.items()}
    assert dims["0.5b"] == (896, 24, 14, 2, 4864, 151936, True, 64)
    assert dims["1.5b"] == (1536, 28, 12, 2, 8960, 151936, True, 128)
    assert dims["7b"] == (3584, 28, 28, 4, 18944, 152064, False, 128)
    assert dims["tiny"][:5] == (64, 2, 4, 2, 128)  # today's make-tiny
    # bf16 bytes: 1.5B's 1.54B decoder + 126M tower; 7B's 7.6B decoder (untied lm_head) + tower
    assert 3.3e9 < checkpoint_bytes(SIZES["1.5b"]) < 3.6e9 and 15.3e9 < checkpoint_bytes(SIZES["7b"]) < 15.6e9


def test_shards_are_planned_in_order_and_bounded():
    import torch
    from vlmrun.checkpoint_shards import TensorSpec, plan_shards

    specs = [TensorSpec(f"t{i}", (n,), torch.bfloat16, lambda: None) for i, n in enumerate([10, 10, 30, 5, 5])]
    # bf16: 20, 20, 60, 10, 10 bytes
    assert [[s.name for s in shard] for shard in plan_shards(specs, 40)] == [["t0", "t1"], ["t2"], ["t3", "t4"]]
    assert [[s.name for s in shard] for shard in plan_shards(specs, 8)] == [[f"t{i}"] for i in range(5)]


def test_random_writer_streams_apple_shards_that_load(tmp_path, store):
    """The writer of the real sizes, at tiny dimensions with head size 128 and 12 / 2 heads: bf16 shards of at
    most the asked size, an index naming each tensor once, Apple's names and config; the checkpoint detection
    converts it and the model's image embeddings and token embeddings carry signal of the same size."""
    import dataclasses

    import torch
    from safetensors import safe_open
    from vlmrun import checkpoints
    from vlmrun.family import SIZES, write_random_apple
    from vlmrun.model import FastVLMModel

    size = dataclasses.replace(SIZES["tiny"], name="gqa128", hidden=128 * 12, heads=12, kv_heads=2, layers=1,
                               intermediate=256, vocab_rows=448)
    made = []
    out = write_random_apple(tmp_path / "apple", size, image_size=64, shard_bytes=1_000_000,
                             on_bytes=made.append)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[-1].endswith(f"-of-{len(shards):05d}.safetensors")
    assert sum(made) == index["metadata"]["total_size"]
    seen = {}
    for shard in shards:
        with safe_open(str(out / shard), framework="pt") as f:
            keys = list(f.keys())
            for k in keys:
                seen[k] = f.get_slice(k).get_dtype()
        assert len(keys) == 1 or (out / shard).stat().st_size < 1_000_000 + 2**16  # a big tensor alone
    assert set(seen) == set(index["weight_map"]) and "model.mm_projector.0.weight" in seen
    assert {d for k, d in seen.items() if "vision_tower" not in k} == {"BF16"}
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["model_type"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["torch_dtype"]) == ("llava_qwen2", 1536, 12, 2, "bfloat16")
    assert checkpoints.detect_format(out) == checkpoints.APPLE
    m = FastVLMModel.open(out, store)
    assert (m.head_dim, m.num_heads, m.num_kv_heads, m.num_layers) == (128, 12, 2, 1)
    fvlm = m.load_torch()
    with torch.no_grad():
        image = fvlm.get_image_features(pixel_values=torch.rand(1, 3, 64, 64)).pooler_output
    assert 0.01 < float(image.std()) < 0.04  # calibrated to the token embeddings' 0.02
    # the embedding rows past the tokenizer's are 0; dense_vocab makes every row random (a real lm_head's bytes)
    rows = {}
    for dense in (False, True):
        out = write_random_apple(tmp_path / f"apple-{dense}", size, image_size=64, dense_vocab=dense)
        index = json.loads((out / "model.safetensors.index.json").read_text())
        name = next(k for k in index["weight_map"] if k.endswith("embed_tokens.weight"))
        with safe_open(str(out / index["weight_map"][name]), framework="pt") as f:
            rows[dense] = int((f.get_tensor(name).float().abs().sum(1) > 0).sum())
    assert rows[True] == 448 and rows[False] < 448


def test_default_model_in_apple_sharded_bf16_answers_like_the_default(ref_pipe, store, tmp_path):
    """The shipped default model written by the same writer (Apple's layout, bf16, several shards) loads through
    the checkpoint detection and gives the default's tokens on the demo picture (bf16 rounds the float16 weights:
    the tokens must still be equal, the logits are not compared)."""
    import torch
    from vlmrun import Pipeline, checkpoints
    from vlmrun.checkpoint_to_apple import save_as_apple
    from vlmrun.cli import DEMO_PROMPT
    from vlmrun.demo_image import DEMO_ANSWER, demo_image
    from vlmrun.generation import GenerationSettings
    from vlmrun.model import DEFAULT_MODEL_DIR, FastVLMModel

    out = save_as_apple(DEFAULT_MODEL_DIR, tmp_path / "apple", dtype=torch.bfloat16, shard_bytes=400_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not (out / "model.safetensors").exists()
    assert checkpoints.detect_format(out) == checkpoints.APPLE
    picture = tmp_path / "demo.png"
    demo_image().save(picture)
    settings = GenerationSettings(max_new_tokens=24)
    want = ref_pipe.generate(picture, DEMO_PROMPT, settings).run()
    pipe = Pipeline.build(FastVLMModel.open(out, store), "reference", store=store)
    got = pipe.generate(picture, DEMO_PROMPT, settings).run()
    assert want.text.strip() == DEMO_ANSWER
    assert got.token_ids == want.token_ids


def test_make_tiny_sizes_errors_are_one_line(tmp_path, monkeypatch):
    from vlmrun.errors import UsageError
    from vlmrun.family import SIZES, check_target, size_named

    with pytest.raises(UsageError, match="unknown model size '3b'; expected one of tiny, 0.5b, 1.5b, 7b"):
        size_named("3b")
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(UsageError, match="exists and is not empty"):
        check_target(tmp_path / "full", SIZES["7b"])
    import shutil

    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10**12, 10**12 - 10**9, 10**9))
    with pytest.raises(UsageError, match=r"needs 15\d{9} bytes \(15\.\d GB\) free on its disk, which has 1000000000"):
        check_target(tmp_path / "new", SIZES["7b"])


def test_make_tiny_cli_refuses_bad_sizes_and_formats(tmp_path):
    for args, msg in ((["--size", "3b"], "unknown model size '3b'"),
                      (["--size", "7b", "--format", "native"], "tiny and 0.5b only"),
                      (["--size", "1.5b", "--full-size"], "--full-size is --size 0.5b"),
                      (["--format", "gguf"], "unknown --format 'gguf'")):
        res = run_cli(["make-tiny", str(tmp_path / "m"), *args], tmp_path)
        assert res.returncode == 2 and res.stderr.strip().count("\n") == 0 and msg in res.stderr, res.stderr


# --------------------------------------------------------------------------------------------------------------
# streaming export (issue 32): each part from only the tensors it needs, read from the shards that hold them

PARTS = {"ar": AR, "ctx": CTX, "layers": "1,1", "rmsnorm": "safe"}


@pytest.fixture(scope="module")
def apple_tiny(tmp_path_factory):
    """Today's tiny model (64 x 64 images) in Apple's layout, bf16, in shards of at most 40 kB (a layer spans
    several; the embedding and the vision tower's big tensors have shards of their own), opened: it streams."""
    from vlmrun.family import write_tiny_apple
    from vlmrun.model import FastVLMModel
    from vlmrun.store import ArtifactStore

    root = tmp_path_factory.mktemp("apple-tiny")
    src = write_tiny_apple(root / "apple", image_size=64, shard_bytes=40_000)
    model = FastVLMModel.open(src, ArtifactStore(root / "store"))
    assert model.streams and len(_shards(model.path)) > 10
    return model


def _shards(path: Path) -> dict[str, str]:
    """Native weight name -> the name of the shard it is read from (the source's, for a converted checkpoint)."""
    from vlmrun.checkpoint_stream import ShardedWeights

    return {k: Path(f).name for k, f in ShardedWeights(path).files.items()}


def _part_files(path: Path, lo: int, hi: int, last: bool) -> set[str]:
    """The shards holding part ``lo..hi-1``'s weights (a tied lm_head is the embedding)."""
    from vlmrun.checkpoint_stream import decoder_weights

    prefixes = decoder_weights(lo, hi, last) + (("model.language_model.embed_tokens.weight",) if last else ())
    return {f for k, f in _shards(path).items() if k.startswith(prefixes)}


def test_streamed_parts_answer_like_the_whole_model_export(apple_tiny, tmp_path, monkeypatch):
    """The decoder parts of a sharded bf16 Apple checkpoint, exported part by part from the shards, give the
    logits and greedy tokens of the same weights exported from the whole model loaded by ``from_pretrained``."""
    from vlmrun.model import FastVLMModel
    from vlmrun.stages import ExportForm
    from vlmrun_ort_reference.decoder_parts import export_parts

    form = ExportForm.of("decoder", "decoder/parts", **PARTS)
    for name in ("whole", "streamed"):
        (tmp_path / name).mkdir()
    # the whole model from transformers' from_pretrained: the conversion that copies the weights
    from vlmrun.checkpoints import convert_apple_to_native

    copied = convert_apple_to_native(apple_tiny.source, tmp_path / "copied")
    whole = FastVLMModel(copied, apple_tiny.source, apple_tiny.source_layout, stream=False)
    export_parts(whole, form, tmp_path / "whole")
    loaded = []
    monkeypatch.setattr(FastVLMModel, "load_torch", lambda self: loaded.append(self) or None)
    export_parts(apple_tiny, form, tmp_path / "streamed")
    monkeypatch.undo()
    assert loaded == [] and "_torch_part" not in apple_tiny.__dict__  # never whole, and freed
    desc = json.loads((tmp_path / "streamed" / "parts.json").read_text())
    rng = np.random.default_rng(0)
    embeds = (rng.standard_normal((1, AR, whole.hidden_size)) * 0.02).astype(np.float32)
    feeds = _prompt_feeds(whole, embeds)
    want = _run_parts(tmp_path / "whole", desc, feeds)
    got = _run_parts(tmp_path / "streamed", desc, feeds)
    assert cosine(got, want) > 0.9999 and np.abs(got - want).max() < 1e-4
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_default_model_streams_its_stages_and_answers_like_the_default(ref_pipe, store, tmp_path, monkeypatch):
    """The shipped default model in Apple's sharded bf16 layout: every stage of the reference layout exported
    from its own weights only (the whole model is never loaded) gives the default's tokens on the demo picture."""
    import torch
    from vlmrun import Pipeline
    from vlmrun.checkpoint_to_apple import save_as_apple
    from vlmrun.cli import DEMO_PROMPT
    from vlmrun.demo_image import demo_image
    from vlmrun.generation import GenerationSettings
    from vlmrun.model import DEFAULT_MODEL_DIR, FastVLMModel
    from vlmrun.store import ArtifactStore

    out = save_as_apple(DEFAULT_MODEL_DIR, tmp_path / "apple", dtype=torch.bfloat16, shard_bytes=400_000)
    picture = tmp_path / "demo.png"
    demo_image().save(picture)
    settings = GenerationSettings(max_new_tokens=24)
    want = ref_pipe.generate(picture, DEMO_PROMPT, settings).run()
    model = FastVLMModel.open(out, store)
    assert model.streams
    monkeypatch.setattr(FastVLMModel, "load_torch", lambda self: pytest.fail("loaded the whole model"))
    pipe = Pipeline.build(model, "reference", store=ArtifactStore(tmp_path / "store"))
    got = pipe.generate(picture, DEMO_PROMPT, settings).run()
    assert got.token_ids == want.token_ids


def test_a_part_reads_only_its_shards(apple_tiny, tmp_path):
    """Part 2 alone exports with every shard it does not need replaced by garbage (and gives the bytes of the
    whole export's part 2); a part that needs a garbage or missing shard fails with one line naming it."""
    import shutil

    from vlmrun.errors import InputError
    from vlmrun.model import FastVLMModel
    from vlmrun.stages import ExportForm
    from vlmrun_ort_reference.decoder_parts import export_parts

    form = ExportForm.of("decoder", "decoder/parts", **PARTS)
    for name in ("all", "two", "one", "again"):
        (tmp_path / name).mkdir()
    export_parts(apple_tiny, form, tmp_path / "all")
    # a copy of the Apple source, opened into a store of its own: the converted checkpoint reads its shards
    from vlmrun.store import ArtifactStore

    src = Path(shutil.copytree(apple_tiny.source, tmp_path / "apple"))
    ckpt = FastVLMModel.open(src, ArtifactStore(tmp_path / "store")).path
    needed = _part_files(ckpt, 1, 2, True)
    others = set(_shards(ckpt).values()) - needed - {"vlmrun_vocab.safetensors"}
    assert needed and len(others) > len(needed)
    for name in others:
        (src / name).write_bytes(b"not a safetensors file")
    model = FastVLMModel(ckpt, src, "llava_qwen2")
    manifest = export_parts(model, form, tmp_path / "two", only=2)
    assert manifest["files"] == ["part2_of_2_prompt.onnx", "part2_of_2_token.onnx", "parts.json"]
    for name in manifest["files"][:2]:
        assert (tmp_path / "two" / name).read_bytes() == (tmp_path / "all" / name).read_bytes()
    with pytest.raises(InputError, match=r"^cannot read shard .*model-\d{5}-of-\d{5}\.safetensors \(") as err:
        export_parts(model, form, tmp_path / "one", only=1)
    assert "\n" not in str(err.value) and Path(str(err.value).split()[3]).name in others
    gone = sorted(needed - {"vlmrun_vocab.safetensors"})[0]
    (src / gone).unlink()
    with pytest.raises(InputError, match=f"^shard {src / gone} is missing; the converted model {ckpt} reads ") as err:
        export_parts(model, form, tmp_path / "again", only=2)
    assert "\n" not in str(err.value) and "put it back, or open the model from where it is now" in str(err.value)


def test_memory_budget_below_one_layer_stops_before_writing(apple_tiny, tmp_path, monkeypatch):
    """``VLMRUN_MEMORY_BUDGET_GB`` below what one layer's export needs: one line naming the size, exit 2 from the
    CLI, and nothing written (no graph in the artifact store, an empty output directory)."""
    from vlmrun.errors import UsageError
    from vlmrun.stages import ExportForm
    from vlmrun_ort_reference.decoder_parts import export_parts

    monkeypatch.setenv("VLMRUN_MEMORY_BUDGET_GB", "0.5")
    out = tmp_path / "parts"
    out.mkdir()
    with pytest.raises(UsageError, match=r"^exporting decoder part 1 of 2 \(layers 0-0\) needs about 1\.07 GB of"
                                         r" memory, more than the budget VLMRUN_MEMORY_BUDGET_GB=0\.5 GB; one decoder"
                                         r" layer alone needs 1\.07 GB: raise the budget to at least that"):
        export_parts(apple_tiny, ExportForm.of("decoder", "decoder/parts", **PARTS), out)
    assert list(out.iterdir()) == []
    cache = tmp_path / "cache"
    res = run_cli(["export", "--model", str(apple_tiny.source), "--stage", "decoder"], cache,
                  env_extra={"VLMRUN_MEMORY_BUDGET_GB": "0.5"})
    errors = [line for line in res.stderr.splitlines() if line.startswith("vlmrun:")]
    assert res.returncode == 2 and len(errors) == 1, res.stderr  # one line (after the step's progress line)
    assert "GB of memory, more than the budget VLMRUN_MEMORY_BUDGET_GB=0.5 GB" in res.stderr and "one decoder layer alone needs" in res.stderr
    assert list(cache.rglob("*.onnx")) == []


def test_parts_are_planned_from_the_memory_budget(monkeypatch):
    """``parts = 0`` with ``VLMRUN_MEMORY_BUDGET_GB`` set: the fewest parts whose every part's estimated peak
    (export, or quantization in its child: `memory.QUANTIZE_COPIES` copies of its float32 weights) is within the
    budget; without a budget the binary limit's plan as before; a given ``parts`` is the user's; a budget no split
    meets is one line naming the size needed (at 7B the untied lm_head alone is 2.18 GB in float32: 14 GB plans
    3-layer parts and a last part of one layer and the lm_head, 13 GB is short by the estimate)."""
    from types import SimpleNamespace

    from vlmrun.errors import UsageError
    from vlmrun.family import SIZES
    from vlmrun_qnn_htp.memory import part_peak_bytes
    from vlmrun_qnn_htp.options import parts_plan, stage_options
    from vlmrun_qualcomm.parts import split_layers

    def model(name):
        s = SIZES[name]
        return SimpleNamespace(hidden_size=s.hidden, num_heads=s.heads, num_kv_heads=s.kv_heads, head_dim=s.head_dim,
                               vocab_size=s.vocab_rows, num_layers=s.layers,
                               text_config={"intermediate_size": s.intermediate})

    opts = stage_options("decoder", {"precision": "w4a16", "context_length": 1024})
    monkeypatch.delenv("VLMRUN_MEMORY_BUDGET_GB", raising=False)
    assert parts_plan(model("0.5b"), opts)["layers"] == [24] and parts_plan(model("1.5b"), opts)["layers"] == [28]
    monkeypatch.setenv("VLMRUN_MEMORY_BUDGET_GB", "14")
    for name, want in (("0.5b", [24]), ("1.5b", [16, 12]), ("7b", [3] * 9 + [1])):
        m = model(name)
        layers = parts_plan(m, opts)["layers"]
        assert layers == want, name
        peaks = [part_peak_bytes(m, "onnxruntime", n, i == len(layers) - 1) for i, n in enumerate(layers)]
        assert max(peaks) <= 14e9
        if len(layers) > 1:
            fewer = split_layers(m, "w4a16", len(layers) - 1)  # the fewest: one part less is over the budget
            assert max(part_peak_bytes(m, "onnxruntime", n, i == len(fewer) - 1) for i, n in enumerate(fewer)) > 14e9
    assert part_peak_bytes(model("0.5b"), "aimet", 24, True) > 14e9  # AIMET's simulation still needs parts there
    fp16 = stage_options("decoder", {"precision": "fp16", "decoder_form": "parts", "context_length": 1024})
    assert parts_plan(model("0.5b"), fp16)["layers"] == [17, 7]  # fp16: the binary limit asks 2 parts already
    given = stage_options("decoder", {"precision": "w4a16", "context_length": 1024, "parts": 2})
    assert len(parts_plan(model("1.5b"), given)["layers"]) == 2  # the user's count (its export checks the budget)
    monkeypatch.setenv("VLMRUN_MEMORY_BUDGET_GB", "13")
    with pytest.raises(UsageError) as err:  # 7B: the last part, one layer and the 2.18 GB lm_head (its export)
        parts_plan(model("7b"), opts)
    assert str(err.value) == ("exporting the decoder needs about 13.52 GB of memory for its largest part even at one"
                              " layer a part (the last, with the lm_head), more than the budget"
                              " VLMRUN_MEMORY_BUDGET_GB=13 GB; raise the budget to at least that")
