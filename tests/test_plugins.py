"""Plugin discovery: third-party distributions via entry points, broken plugins, VLMRUN_PLUGINS, layouts."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import run_cli
from vlmrun import hookimpl

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
    # presets come from the plugins: one whose plugin is not loaded is unknown, with the presets there are; one
    # that names another plugin's backend which is not installed fails with the same clear message as a flag
    res = run_cli(["--image", str(image_path), "--prompt", "Hi", "--layout", "hybrid"], cache_dir,
                  {"VLMRUN_PLUGINS": "ort_reference"})
    assert res.returncode == 2 and "unknown layout 'hybrid'; presets are: reference " in res.stderr, res.stderr
    res = run_cli(["--image", str(image_path), "--prompt", "Hi", "--layout", "hybrid"], cache_dir,
                  {"VLMRUN_PLUGINS": "ort_reference,genie_cpu"})
    assert res.returncode == 2 and "unknown backend plugin 'qnn_htp'" in res.stderr, res.stderr


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


# -- the options every hook gets: converted, every declared default filled in, read-only --------------------------
SEEN: list[tuple[str, str, str, object]] = []  # (hook, backend, stage, options) as the spy plugin got them


class OptionsSpy:
    """A plugin that only records the options its hooks get (registered alone, beside the installed declarations)."""

    @hookimpl
    def preflight(self, backend, stage, model, options):
        SEEN.append(("preflight", backend, stage, options))

    @hookimpl
    def load_stage(self, backend, stage, ctx):
        SEEN.append(("load_stage", backend, stage, ctx.options))
        return object()

    @hookimpl
    def layer_precisions(self, backend, stage, options):
        SEEN.append(("layer_precisions", backend, stage, options))
        return []

    @hookimpl
    def compile(self, backend, request):
        SEEN.append(("compile", request.target, request.stage, request.stage_options))
        return {"files": []}


def spy_registry():
    """The installed plugins' declared options with `OptionsSpy` as the only hook implementation: what reaches a
    plugin's hooks, without running any plugin's own."""
    import pluggy

    from vlmrun import hookspecs
    from vlmrun.plugins import Registry, load

    reg = Registry(pluggy.PluginManager("vlmrun"), declared=list(load().declared))
    reg.pm.add_hookspecs(hookspecs)
    reg.pm.register(OptionsSpy(), name="spy")
    return reg


def hooks_see(reg, backend, stage, given, tmp_path) -> list[tuple[str, object]]:
    """(hook, options) for every hook that takes ``stage``'s options, called as the core calls them."""
    from vlmrun.pipeline import StageContext
    from vlmrun.store import Artifact, ArtifactStore

    SEEN.clear()
    reg.hook.preflight(backend=backend, stage=stage, model=None, options=dict(given))
    ctx = StageContext(backend, stage, None, dict(given), ArtifactStore(tmp_path / "store"), reg)
    reg.hook.load_stage(backend=backend, stage=stage, ctx=ctx)
    reg.hook.layer_precisions(backend=backend, stage=stage, options=dict(given))
    source = tmp_path / "export"
    source.mkdir(exist_ok=True)
    ctx.compiled(Artifact(source, {}), {}, "spy")
    return [(hook, opts) for hook, b, s, opts in SEEN if (b, s) == (backend, stage)]


def test_every_declared_option_reaches_the_hooks_with_its_default(tmp_path):
    """For each installed backend and each stage it runs, ``preflight``, ``load_stage`` (``ctx.options``),
    ``layer_precisions`` and ``compile`` (``request.stage_options``) get every option the backend and the core
    declare, at its declared default when the layout does not set it, read-only, with ``given`` empty."""
    from vlmrun.options import StageOptions
    from vlmrun.plugins import load

    real, reg = load(), spy_registry()
    checked = 0
    for info in real.backends().values():
        for stage in info.stages:
            declared = real.options.for_stage(info.name, stage)
            want = {name: o.default for name, o in declared.items()}
            seen = hooks_see(reg, info.name, stage, {}, tmp_path)
            assert [hook for hook, _ in seen] == ["preflight", "load_stage", "layer_precisions", "compile"]
            for hook, opts in seen:
                assert isinstance(opts, StageOptions) and dict(opts) == want, (info.name, stage, hook)
                assert dict(opts.given) == {}
                with pytest.raises(TypeError):
                    opts["compiler"] = "x"  # type: ignore[index]
            checked += 1
    assert checked >= 10  # ort_reference, qnn_htp, qaihub, genie_cpu: every stage each runs
    # what the declarations say, as a plugin reads it
    assert hooks_see(reg, "qnn_htp", "vision", {}, tmp_path)[0][1]["timeout"] == 600.0
    assert hooks_see(reg, "qaihub", "embed", {}, tmp_path)[1][1]["embed_seq"] == 32


def test_given_options_win_and_are_told_apart(tmp_path):
    """A value the layout sets reaches every hook as set, and ``options.given`` holds exactly what was set."""
    reg = spy_registry()
    for hook, opts in hooks_see(reg, "qnn_htp", "decoder", {"timeout": 5.0, "precision": "a16w8"}, tmp_path):
        assert (opts["timeout"], opts["precision"], opts["soc"]) == (5.0, "a16w8", "SM8750"), hook
        assert dict(opts.given) == {"timeout": 5.0, "precision": "a16w8"}, hook


def test_presets_come_from_the_plugins_and_the_reference_is_a_role():
    from vlmrun.errors import UsageError
    from vlmrun.layouts import resolve
    from vlmrun.plugins import Preset, load

    reg = load()
    assert {n: (p.stages["vision"], p.stages["decoder"], p.reference) for n, p in reg.presets.items()} == {
        "reference": ("ort_reference", "ort_reference", True), "all-npu": ("qnn_htp", "qnn_htp", False),
        "hybrid": ("qnn_htp", "genie_cpu", False)}
    # the default layout is whichever preset declares the reference role, whatever its name
    mine = {"golden": Preset("golden", dict.fromkeys(("vision", "projector", "embed", "decoder"), "acme"),
                             reference=True)}
    assert resolve(None, presets=mine).backend("decoder") == "acme"
    assert resolve("reference", presets=mine).backend("vision") == "acme"
    with pytest.raises(UsageError, match="no plugin declares the 'reference' layout"):
        resolve(None, presets={})
    with pytest.raises(UsageError, match="unknown layout 'all-npu'; presets are: golden"):
        resolve("all-npu", presets=mine)


def test_a_preset_must_name_every_stage_and_one_name_one_plugin():
    import types

    from vlmrun import hookimpl
    from vlmrun.plugins import BackendInfo, Preset, load

    def plugin(name, presets):
        mod = types.ModuleType(name)
        mod.describe = hookimpl(lambda: BackendInfo(name, ("vision",)))
        mod.register_presets = hookimpl(lambda register: [register(p) for p in presets()])
        return mod

    reg = load(only="", extra=[plugin("half", lambda: [Preset("half", {"vision": "half"})])])
    assert "must name a backend for each of vision, projector, embed, decoder" in reg.failures["half"]
    every = dict.fromkeys(("vision", "projector", "embed", "decoder"), "one")
    reg = load(only="", extra=[plugin("one", lambda: [Preset("fast", every)]),
                               plugin("two", lambda: [Preset("fast", every)])])
    assert "one" in reg.plugins and reg.presets["fast"].stages["vision"] == "one"
    assert reg.failures["two"] == "RuntimeError: preset 'fast' is already declared by another plugin"


def test_precisions_come_from_the_plugins_with_their_thresholds():
    """A precision and the diff's default thresholds at it are a plugin's declaration (``register_precisions``):
    shared vocabularies may repeat one, a different declaration under a taken name or an alias to nothing fails
    that plugin; a layout is judged by its most lenient declared precision."""
    import types

    import attrs

    from vlmrun import hookimpl
    from vlmrun.diff import thresholds as th
    from vlmrun.errors import UsageError
    from vlmrun.plugins import BackendInfo, Precision, load

    def plugin(name, precisions):
        mod = types.ModuleType(name)
        mod.describe = hookimpl(lambda: BackendInfo(name, ("vision",)))
        mod.register_precisions = hookimpl(lambda register: [register(p) for p in precisions])
        return mod

    q8 = Precision("q8", sqnr_db=20.0, cosine=0.99, top1=0.8, top5=0.7, kl=0.1)
    q4 = Precision("q4", sqnr_db=12.0, cosine=0.95, top1=0.5, top5=0.5, kl=0.3)
    reg = load(only="", extra=[plugin("acme", [q8, q4, Precision("q8x", like="q8")]), plugin("acme2", [q8]),
                               plugin("clash", [attrs.evolve(q8, sqnr_db=25.0)]),
                               plugin("dangling", [Precision("q2", like="q1")])])
    assert set(reg.plugins) == {"acme", "acme2"}
    assert reg.failures["clash"] == ("RuntimeError: precision 'q8' is already declared by another plugin with other"
                                     " thresholds")
    assert reg.failures["dangling"] == ("RuntimeError: precision 'q2' is judged like 'q1', which no plugin declares"
                                        " as a precision of its own")
    assert th.precisions(reg) == ("fp32", "q8", "q4")  # strictest first; an alias has no thresholds of its own
    t = th.thresholds_for("q8x", {"decoder": {"kl_mean": None}}, registry=reg)
    assert t["vision"] == {"sqnr_db": 20.0, "cosine": 0.99} and "kl_mean" not in t["decoder"]
    assert t["decoder"]["top1_agreement"] == 0.8 and "match_fraction" not in t["generation"]
    assert th.thresholds_for("fp32", registry=reg)["generation"]["match_fraction"] == 1.0  # the core's own
    assert th.infer_precision({"vision": {"precision": "q8x"}, "decoder": {"precision": "q4"}}, reg) == "q4"
    assert th.infer_precision({"vision": {"precision": "q8x"}, "decoder": {}}, reg) == "q8"
    assert th.infer_precision({"vision": {"precision": "nine"}}, reg) == "fp32"
    with pytest.raises(UsageError, match="^unknown precision 'w4a16'; the installed plugins declare fp32, q8, q4, q8x"):
        th.check_precision("w4a16", reg)
    # a precision without every floor would pass any device: refused when it is declared
    with pytest.raises(RuntimeError, match="precision 'q0' declares no cosine, top1, top5, kl: every threshold"):
        Precision("q0", sqnr_db=10.0)
    with pytest.raises(RuntimeError, match="judged like 'q8' and cannot set sqnr_db"):
        Precision("q8y", sqnr_db=10.0, like="q8")
    # the installed plugins: the precisions and floors the diff used to hard-code
    assert th.precisions() == ("fp32", "fp16", "w8a16", "int8", "w4a16")
    assert th.thresholds_for("a16w8") == th.thresholds_for("int8")


def test_tune_starts_where_a_plugin_says():
    from vlmrun.errors import UsageError
    from vlmrun.plugins import Preset, load
    from vlmrun.tune.search import default_base

    assert default_base(load()) == "all-npu,vision.precision=int8,projector.precision=int8,decoder.precision=w4a16"
    every = dict.fromkeys(("vision", "projector", "embed", "decoder"), "acme")
    assert Preset("p", every, tune={"decoder": {"precision": "q4"}}).tune_spec == "p,decoder.precision=q4"
    assert Preset("p", every).tune_spec is None
    with pytest.raises(RuntimeError, match="sets options of unknown stage"):
        Preset("p", every, tune={"vison": {"precision": "q4"}})
    with pytest.raises(UsageError, match="no installed plugin declares a layout for vlmrun tune to start from"):
        default_base(load(only=""))
