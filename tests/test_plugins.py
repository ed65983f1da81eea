"""Plugin discovery: third-party distributions via entry points, broken plugins, VLMRUN_PLUGINS, layouts."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import run_cli

THIRD_PARTY = '''
"""A third-party backend living outside the repository: runs the vision stage with its own ORT session."""
import numpy as np
import onnxruntime as ort
from vlmrun import hookimpl
from vlmrun.plugins import BackendInfo, mine
from vlmrun.stages import ExportForm

NAME = "acme_npu"
CALLS = []

@hookimpl
def describe():
    return BackendInfo(NAME, ("vision",), "test backend")

@hookimpl
def load_stage(backend, stage, ctx):
    if not mine(backend, NAME):
        return None
    art = ctx.exported(ExportForm.of("vision"))
    return ort.InferenceSession(str(art.file()), providers=["CPUExecutionProvider"])

@hookimpl
def run_stage(backend, stage, handle, inputs):
    if not mine(backend, NAME):
        return None
    CALLS.append(stage)
    with open(__file__ + ".calls", "a") as f:
        f.write(stage + "\\n")
    (out,) = handle.run(None, {"pixel_values": inputs["pixel_values"]})
    return {"image_features": out}
'''


def make_distribution(root: Path, dist: str, module: str, source: str, ep_name: str) -> Path:
    """Write an installed-looking distribution (module + dist-info with entry points) under ``root``."""
    (root / f"{module}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist}-0.3.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.3.0\n")
    (info / "entry_points.txt").write_text(f"[vlmrun]\n{ep_name} = {module}\n")
    return root


@pytest.fixture(scope="module")
def plugin_path(tmp_path_factory):
    root = tmp_path_factory.mktemp("site")
    make_distribution(root, "acme_npu_backend", "acme_npu_backend", THIRD_PARTY, "acme_npu")
    make_distribution(root, "broken_backend", "broken_backend", "raise RuntimeError('boom at import')\n", "broken")
    return root


@pytest.fixture
def on_sys_path(plugin_path, monkeypatch):
    monkeypatch.syspath_prepend(str(plugin_path))
    yield plugin_path
    for mod in ("acme_npu_backend", "broken_backend"):
        sys.modules.pop(mod, None)


def test_third_party_plugin_is_discovered_and_runs_a_stage(on_sys_path, tiny_model, store, image_path):
    from vlmrun import GenerationSettings, Pipeline
    from vlmrun.plugins import load

    reg = load()
    assert "acme_npu" in reg.plugins and reg.plugins["acme_npu"].version == "0.3.0"
    assert reg.plugins["acme_npu"].backends[0].stages == ("vision",)
    assert "broken" in reg.failures and "boom at import" in reg.failures["broken"]
    pipe = Pipeline.build(tiny_model, "reference", overrides={"vision": "acme_npu"}, store=store, registry=reg)
    gen = pipe.generate(image_path, "Hi", GenerationSettings(max_new_tokens=5, ignore_eos=True)).run()
    assert sys.modules["acme_npu_backend"].CALLS == ["vision"]
    assert len(gen.token_ids) == 5


def test_cli_runs_third_party_backend_and_survives_broken_plugin(plugin_path, cache_dir, tiny_model, image_path):
    env = {"PYTHONPATH": str(plugin_path)}
    calls = plugin_path / "acme_npu_backend.py.calls"
    calls.unlink(missing_ok=True)
    res = run_cli(["--image", str(image_path), "--prompt", "Hi", "--image-size", "256", "--vision", "acme_npu",
                   "--max-new-tokens", "4", "--json"], cache_dir, env)
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["layout"]["vision"] == "acme_npu" and out["layout"]["decoder"] == "ort_reference"
    assert calls.read_text() == "vision\n"
    listing = run_cli(["plugins"], cache_dir, env)
    assert listing.returncode == 0
    assert "acme_npu 0.3.0" in listing.stdout and "ort_reference" in listing.stdout
    assert "broken FAILED to load: RuntimeError: boom at import" in listing.stdout


def test_unknown_plugin_and_missing_stage_are_rejected_before_work(plugin_path, cache_dir, image_path):
    env = {"PYTHONPATH": str(plugin_path)}
    res = run_cli(["--image", str(image_path), "--prompt", "Hi", "--vision", "nosuch"], cache_dir, env)
    assert res.returncode == 2
    assert "unknown backend plugin 'nosuch'" in res.stderr and "ort_reference (vision" in res.stderr
    assert "Traceback" not in res.stderr
    res = run_cli(["--image", str(image_path), "--prompt", "Hi", "--decoder", "acme_npu"], cache_dir, env)
    assert res.returncode == 2
    assert "backend 'acme_npu' does not support stage 'decoder' (it supports: vision)" in res.stderr
    res = run_cli(["--image", str(image_path), "--prompt", "Hi", "--vision", "broken"], cache_dir, env)
    assert res.returncode == 2 and "failed to load: RuntimeError: boom at import" in res.stderr
    # presets that name plugins which are not installed fail with the same clear message
    res = run_cli(["--image", str(image_path), "--prompt", "Hi", "--layout", "hybrid"], cache_dir,
                  {"VLMRUN_PLUGINS": "ort_reference"})
    assert res.returncode == 2 and "unknown backend plugin 'qnn_htp'" in res.stderr


def test_env_var_restricts_loaded_plugins(on_sys_path):
    from vlmrun.plugins import load

    reg = load(only="acme_npu")
    assert list(reg.plugins) == ["acme_npu"] and reg.failures == {}
    assert list(load(only="").plugins) == []


def test_layout_file_and_overrides(tmp_path):
    from vlmrun.errors import UsageError
    from vlmrun.layouts import resolve

    f = tmp_path / "mine.toml"
    f.write_text('base = "all-npu"\n[decoder]\nbackend = "ort_reference"\ncontext_length = 256\n')
    lay = resolve(None, f, {"vision": "acme_npu"})
    assert lay.backend("vision") == "acme_npu" and lay.backend("projector") == "qnn_htp"
    assert lay.backend("decoder") == "ort_reference" and lay.stages["decoder"].options == {"context_length": 256}
    f.write_text("[visoin]\nbackend = 'x'\n")
    with pytest.raises(UsageError, match="unknown stage"):
        resolve(None, f)
    with pytest.raises(UsageError, match="unknown layout 'fast'"):
        resolve("fast")
    f.write_text("base = [")
    with pytest.raises(UsageError, match="not valid TOML"):
        resolve(None, f)
