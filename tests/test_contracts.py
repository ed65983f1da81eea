"""Stage contracts are checked at every hand-off; quantized tensors are dequantized there."""

from __future__ import annotations

import types

import numpy as np
import pytest

from vlmrun import hookimpl
from vlmrun.errors import ContractError
from vlmrun.plugins import BackendInfo, load, mine
from vlmrun.stages import CONTRACTS, QuantizedTensor, check_tensor


def backend_module(name, vision_output):
    """An in-process plugin whose vision stage returns ``vision_output(inputs)``."""
    mod = types.ModuleType(name)

    @hookimpl
    def describe():
        return BackendInfo(name, ("vision",))

    @hookimpl
    def load_stage(backend, stage, ctx):
        return object() if mine(backend, name) else None

    @hookimpl
    def run_stage(backend, stage, handle, inputs):
        return {"image_features": vision_output(inputs)} if mine(backend, name) else None

    mod.describe, mod.load_stage, mod.run_stage = describe, load_stage, run_stage
    return mod


def test_shape_mismatch_names_tensor_and_both_backends(tiny_model, store, ref_pipe):
    from vlmrun import Pipeline

    bad = backend_module("wrongshape", lambda i: np.zeros((1, 15, tiny_model.feature_dim), np.float32))
    pipe = Pipeline.build(tiny_model, "reference", overrides={"vision": "wrongshape"}, store=store,
                          registry=load(extra=[bad]))
    prepared = pipe.prepare(_image(), "Hi")
    with pytest.raises(ContractError) as err:
        pipe.embed_prompt(prepared)
    msg = str(err.value)
    assert "'image_features' from wrongshape (vision)" in msg and "float32[1, 15, 256]" in msg
    assert "ort_reference (projector) expects float32[1, 16, 256]" in msg


def test_quantized_output_is_dequantized_at_the_boundary(tiny_model, store, ref_pipe):
    from vlmrun import Pipeline

    ref = ref_pipe.run_stage("vision", {"pixel_values": ref_pipe.prepare(_image(), "Hi").pixel_values})
    feats = ref["image_features"]
    scale = float(feats.max() - feats.min()) / 255
    offset = int(round(feats.min() / scale))
    q = np.clip(np.rint(feats / scale) - offset, 0, 255).astype(np.uint8)
    quant = backend_module("npu_uint8", lambda i: QuantizedTensor(q, scale, offset))
    pipe = Pipeline.build(tiny_model, "reference", overrides={"vision": "npu_uint8"}, store=store,
                          registry=load(extra=[quant]))
    got = pipe.run_stage("vision", {"pixel_values": np.zeros((1, 3, 256, 256), np.float32)})["image_features"]
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, (q.astype(np.float32) + offset) * scale, rtol=1e-6)
    assert np.abs(got - feats).max() <= scale * 0.51


def test_check_tensor_dtype():
    spec = CONTRACTS["embed"].inputs[0]
    with pytest.raises(ContractError, match="int32\\[1, 4\\] but embed backend expects int64"):
        check_tensor(np.zeros((1, 4), np.int32), spec, {}, "the host", "embed backend")
    assert check_tensor(np.zeros((1, 9), np.int64), spec, {}, "a", "b").shape == (1, 9)


def _image():
    from vlmrun.demo_image import demo_image

    return demo_image()


def test_filled_defaults_key_and_print_nothing_new(tmp_path):
    """Artifact keys and printed layouts come from what the layout set: the defaults filled in for the hooks change
    neither (the store finds the binaries it built before, layouts print as before)."""
    from test_plugins import spy_registry
    from vlmrun import layouts
    from vlmrun.pipeline import StageContext
    from vlmrun.store import Artifact, ArtifactStore

    reg = spy_registry()
    source = tmp_path / "export"
    source.mkdir()
    ctx = StageContext("qnn_htp", "vision", None, {"compiler": "qaihub"}, ArtifactStore(tmp_path / "store"), reg)
    assert ctx.options["calibration_samples"] == 8 and ctx.options["soc"] == "SM8750"  # what the hooks read
    key = ctx.compiled(Artifact(source, {}), {"precision": "fp16"}, "k").manifest["key"]
    # qaihub's keyed options: its device (derived, as before); calibration_samples at its default keys nothing
    assert key["compiler_options"] == {"device": "Snapdragon 8 Elite QRD"} and key["options"] == {"precision": "fp16"}
    checked = layouts.validate(layouts.resolve("all-npu", options={"decoder": {"context_length": "256"}}), load())
    assert checked.stages["decoder"].options == {"context_length": 256} and checked.stages["vision"].options == {}
    toml = layouts.layout_toml(checked)  # the backends and context_length only: no default printed
    assert toml.endswith('[decoder]\nbackend = "qnn_htp"\ncontext_length = 256\n') and toml.count(" = ") == 5
