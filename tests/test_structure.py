"""The shape of the framework: a vendor-free core, plugins that fail loudly, options checked before any work,
inputs checked before any work, and a third-party backend installed with pip."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import run_cli
from test_plugins import make_distribution

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core" / "vlmrun"
# what the core must never import or name: Qualcomm's runtimes, tools, services and the plugins that wrap them
VENDOR = re.compile(r"genie|\badb\b|qnn|qairt|\bhtp\b|ai ?hub|qai_hub|vlmrun_qualcomm|snapdragon|hexagon", re.I)


def test_core_names_no_vendor():
    hits = []
    for path in sorted(CORE.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not VENDOR.search(line):
                continue
            hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


# the precisions and quantizers of a toolchain, which its plugins declare (``register_precisions``, their options);
# generic words (fp32, fp16, int8, float) may appear in the core's help and examples
PRECISION_WORDS = re.compile(r"\b(w4a16|w8a16|a16w8|a16w16|a8w8|w4|w8|lpbq|aimet)\b", re.I)


def test_core_names_no_plugin_precision_or_quantizer():
    hits = []
    for path in sorted(CORE.rglob("*.py")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if PRECISION_WORDS.search(line):
                hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not hits, "\n".join(hits)


def test_core_has_no_backend_flags():
    """Backend flags come from the plugins' declarations, not from the core's command modules."""
    for path in CORE.glob("cli*.py"):
        text = path.read_text()
        for flag in ("--decoder-engine", "--soc", "--quantize", "--target", "--calibration-images", "--hub-device"):
            assert f'"{flag}"' not in text, f"{path.name} hard-codes {flag}"


MISSPELT = '''
from vlmrun import hookimpl
from vlmrun.plugins import BackendInfo

@hookimpl
def describe():
    return BackendInfo("typo_npu", ("vision",), "a backend with a misspelt hook")

@hookimpl
def load_stag(backend, stage, ctx):
    return None
'''


def test_misspelt_hook_fails_that_plugin_only(tmp_path, cache_dir):
    site = make_distribution(tmp_path, "typo_backend", "typo_backend", MISSPELT, "typo_npu")
    res = run_cli(["plugins"], cache_dir, {"PYTHONPATH": str(site)})
    assert res.returncode == 0, res.stderr
    assert ("typo_npu FAILED to load: RuntimeError: implements unknown hook 'load_stag'"
            " (did you mean 'load_stage'?)") in res.stdout
    assert "ort_reference 0.1.0" in res.stdout and "Traceback" not in res.stdout + res.stderr
    # in-process: the registry records it, never raises
    sys.path.insert(0, str(site))
    try:
        from vlmrun.plugins import load

        reg = load()
        assert "typo_npu" not in reg.plugins and "unknown hook 'load_stag'" in reg.failures["typo_npu"]
        assert "ort_reference" in reg.plugins
    finally:
        sys.path.remove(str(site))
        sys.modules.pop("typo_backend", None)


def _store_is_empty(cache: Path) -> bool:
    return not cache.exists() or not any(cache.rglob("*"))


@pytest.mark.parametrize("table, expected", [
    ('backend = "qnn_htp"\nprecison = "int8"',
     "stage 'vision' (qnn_htp) has no option 'precison'; did you mean 'precision'?"),
    ('nonsense_key = 3', "stage 'vision' (ort_reference) has no option 'nonsense_key'; known here: compiler"),
    ('backend = "qnn_htp"\ncontext_length = "abc"',
     "stage 'vision' (qnn_htp) has no option 'context_length' (it applies to: decoder)"),
    ('backend = "qnn_htp"\nprecision = "int9"',
     "stage 'vision' (qnn_htp): option 'precision' must be one of fp16, int8, a16w8, w8a16, w4a16, got 'int9'"),
])
def test_bad_layout_option_is_an_error_before_any_work(tmp_path, image_path, table, expected):
    layout = tmp_path / "layout.toml"
    layout.write_text(f'base = "reference"\n[vision]\n{table}\n')
    cache = tmp_path / "empty-store"
    res = run_cli(["--image", str(image_path), "--prompt", "Hi", "--layout-file", str(layout)], cache)
    assert res.returncode == 2, res.stderr
    line = res.stderr.strip()
    assert line.startswith(f"vlmrun: error: {expected}") and "\n" not in line, line
    assert _store_is_empty(cache)


def test_bad_option_values_from_the_command_line(tmp_path, image_path):
    cache = tmp_path / "empty-store"
    cases = [
        (["--layout", "all-npu", "-o", "decoder.context_length=abc"],
         "stage 'decoder' (qnn_htp): option 'context_length' must be an integer, got 'abc'"),
        (["-o", "vison.precision=int8"], "--option 'vison.precision=int8' names unknown stage 'vison'; stages are"
                                         " vision, projector, embed, decoder (did you mean 'vision'?)"),
        (["--soc", "sm8650"], "--soc applies to no stage here (vision=ort_reference, projector=ort_reference,"
                              " embed=ort_reference, decoder=ort_reference): it is an option of"),  # qaihub, qnn_htp
        (["--vision", "qnn_htp", "--context-length", "1"],
         "stage 'decoder' (ort_reference): option 'context_length' must be at least 2, got 1"),
    ]
    for args, expected in cases:
        res = run_cli(["--image", str(image_path), "--prompt", "Hi", *args], cache)
        assert res.returncode == 2, (args, res.stderr)
        line = res.stderr.strip()
        assert line.startswith(f"vlmrun: error: {expected}") and "\n" not in line, (args, line)
    # a declared option on the right stage is accepted and typed (checked without building anything)
    from vlmrun import layouts
    from vlmrun.plugins import load

    lay = layouts.resolve("all-npu", options={"decoder": {"context_length": "256", "engine": "GENIE"}})
    checked = layouts.validate(lay, load())
    assert checked.stages["decoder"].options == {"context_length": 256, "engine": "genie"}
    assert _store_is_empty(cache)


def test_missing_image_fails_fast_and_writes_nothing(tmp_path):
    cache = tmp_path / "empty-store"
    t0 = time.perf_counter()
    res = run_cli(["--image", str(tmp_path / "nope.jpg"), "--prompt", "Hi", "--layout", "all-npu"], cache)
    seconds = time.perf_counter() - t0
    assert res.returncode == 1 and "image not found" in res.stderr and "Traceback" not in res.stderr
    assert seconds < 3.0, seconds
    assert _store_is_empty(cache)


def test_prompt_past_the_context_fails_before_any_export(tmp_path, image_path):
    cache = tmp_path / "empty-store"
    res = run_cli(["--image", str(image_path), "--prompt", "Hi", "--image-size", "256", "--context-length", "8"],
                  cache)
    assert res.returncode == 1 and "but the context holds 8" in res.stderr
    artifacts = cache / "artifacts"
    built = [p.name for p in artifacts.iterdir() if not p.name.startswith("model-")] if artifacts.exists() else []
    assert built == []  # the tiny model was built (it has the tokenizer), nothing was exported


EXAMPLE = ROOT / "examples" / "vlmrun-example-backend"


def test_third_party_backend_installed_with_pip(tmp_path, cache_dir, tiny_model, image_path):
    """The README's plugin guide: the example distribution, installed with pip, runs the vision stage with its
    own option, and gives the reference layout's tokens."""
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                    "--target", str(site), str(EXAMPLE)], check=True, capture_output=True, text=True, timeout=300)
    env = {"PYTHONPATH": str(site)}
    listing = run_cli(["plugins", "--options"], cache_dir, env)
    assert "backend example_cpu: stages vision" in listing.stdout
    assert "threads=int (vision) --threads: intra-op threads of the ONNX Runtime session [default 1]" in listing.stdout
    common = ["--image", str(image_path), "--prompt", "Describe the image.", "--image-size", "256",
              "--max-new-tokens", "6", "--ignore-eos", "--json"]
    ref = run_cli(common, cache_dir, env)
    mine = run_cli([*common, "--vision", "example_cpu", "--threads", "2"], cache_dir, env)
    assert ref.returncode == 0 and mine.returncode == 0, mine.stderr
    ref_out, mine_out = json.loads(ref.stdout), json.loads(mine.stdout)
    assert mine_out["layout"]["vision"] == "example_cpu"
    assert mine_out["token_ids"] == ref_out["token_ids"] and len(mine_out["token_ids"]) == 6
    bad = run_cli([*common, "--vision", "example_cpu", "-o", "vision.threads=0"], cache_dir, env)
    assert bad.returncode == 2
    assert "stage 'vision' (example_cpu): option 'threads' must be at least 1, got 0" in bad.stderr


def test_doctor_keeps_native_banners_off_stdout(tmp_path):
    res = run_cli(["doctor"], tmp_path / "store")
    assert res.returncode == 0, res.stderr
    assert "LIBNATIVE" not in res.stdout
    lines = [ln for ln in res.stdout.splitlines() if ln.strip()]
    assert lines and all(ln.startswith("  [") or re.match(r"^\S+ \d+\.\d+\.\d+$", ln) for ln in lines), res.stdout


def test_root_options_before_a_subcommand_reach_it(tmp_path):
    """`vlmrun --cache-dir X store list`: the root's --cache-dir is the subcommand's too (it was ignored)."""
    from conftest import run_cli

    target = tmp_path / "elsewhere"
    r = run_cli(["--cache-dir", str(target), "store", "list"], tmp_path / "env-cache", timeout=120)
    assert r.returncode == 0, r.stderr
    assert f"no artifacts in {target}" in (r.stdout + r.stderr).lower()


def _import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports, anywhere in the file (inside functions too; not under
    ``if TYPE_CHECKING:``), for the core and every plugin package."""
    roots = [CORE, *(p for p in (ROOT / "plugins").glob("*/vlmrun_*") if (p / "__init__.py").exists())]
    files = {}
    for root in roots:
        for f in root.rglob("*.py"):
            parts = list(f.relative_to(root.parent).with_suffix("").parts)
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f

    def targets(cur: str, node) -> set[str]:
        if isinstance(node, ast.Import):
            return {a.name for a in node.names if a.name in files}
        base = cur.split(".") if files[cur].name == "__init__.py" else cur.split(".")[:-1]
        if node.level:
            base = base[: len(base) - node.level + 1]
            full = ".".join(base + ([node.module] if node.module else []))
        else:
            full = node.module or ""
        if full not in files:
            return set()
        return {f"{full}.{a.name}" if f"{full}.{a.name}" in files else full for a in node.names}

    graph = {}
    for mod, f in files.items():
        edges: set[str] = set()

        def visit(node):
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
                for child in node.orelse:
                    visit(child)
                return
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                edges.update(targets(mod, node))
            for child in ast.iter_child_nodes(node):
                visit(child)

        visit(ast.parse(f.read_text()))
        graph[mod] = edges - {mod}
    return graph


def test_no_import_circle_even_inside_functions():
    """No module of the core or of a plugin reaches itself through the project's imports, counting the imports
    placed inside functions (an import moved into a function to dodge a circle is still a circle)."""
    graph = _import_graph()
    circles = []
    for start in graph:
        seen, stack = set(), [(start, [start])]
        while stack:
            node, path = stack.pop()
            for nxt in graph[node]:
                if nxt == start:
                    circles.append(" -> ".join([*path, start]))
                elif nxt not in seen and nxt in graph:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    assert not circles, "\n".join(sorted(set(circles)))


def test_one_layout_spec_everywhere(tmp_path, image_path):
    """`BASE[,STAGE=PLUGIN][,STAGE.KEY=VALUE]`: the layout `vlmrun eval -L` takes is what the root command, `diff
    --device`, `compile` and `bundle` take too (their options checked before any work)."""
    from vlmrun import layouts
    from vlmrun.eval.engine import LayoutSpec

    spec = "all-npu,vision=ort_reference,decoder.engine=genie"
    lay = layouts.resolve(spec)
    ev = LayoutSpec.parse(spec).resolve(__import__("vlmrun.plugins", fromlist=["load"]).load())
    assert lay.stages["vision"].backend == "ort_reference" and lay.stages["decoder"].options == {"engine": "genie"}
    assert ev.stages["decoder"].options == {"engine": "genie"} and ev.stages["vision"].backend == "ort_reference"
    cache = tmp_path / "empty-store"
    bad = "reference,decoder.context_length=abc"
    want = "stage 'decoder' (ort_reference): option 'context_length' must be an integer, got 'abc'"
    for args in (["--image", str(image_path), "--prompt", "Hi", "--layout", bad], ["diff", "--device", bad],
                 ["compile", "--layout", bad], ["eval", "-L", bad, "--limit", "1"]):
        res = run_cli(args, cache)
        assert res.returncode == 2 and want in res.stderr and "Traceback" not in res.stderr, (args, res.stderr)
    assert _store_is_empty(cache)


# -- options: the core fills every declared default, so no code falls back on a default of its own ---------------------
#: the names a stage's options go by where they are read (``options``, ``opts``, ``o``, ``ctx.options``,
#: ``request.stage_options``, ``dec_opts``, ``dict(options or {})``)
OPTION_READERS = re.compile(r"^(o|opts|options|stage_options|\w+_opts|\w+_options)$")

#: Fallbacks in files whose owners were changing them when the core started filling defaults: "file:option", each a
#: read of an option the core now fills that still spells a default of its own (literal or computed). Each must read
#: the filled value plainly (or, for a default that depends on other options, its declaration becomes
#: ``default=None`` and the plugin derives it in one place). The test fails when an entry matches nothing any more:
#: the list only shrinks.
PENDING: set[str] = set()


def _defaults_declared() -> dict[str, set[str]]:
    """Option name -> the backends that declare it with a default (the core fills those in for every hook)."""
    from vlmrun.plugins import load

    out: dict[str, set[str]] = {}
    for backend, opts in load().options.by_backend.items():
        for name, o in opts.items():
            if o.default is not None:
                out.setdefault(name, set()).add(backend)
    return out


def _reader(node) -> str | None:
    """The name an options mapping goes by in ``node`` (``dict(X)`` and ``X or {}`` looked through)."""
    while True:
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict" and node.args:
            node = node.args[0]
        elif isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or):
            node = node.values[0]
        else:
            break
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return name if name and OPTION_READERS.match(name) else None


def _option_read(node) -> str | None:
    """``"name"`` when ``node`` is ``OPTIONS.get("name")`` (any arguments after the name)."""
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" and node.args
            and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
            and _reader(node.func.value)):
        return node.args[0].value
    return None


def _invented(node) -> bool:
    """Does a fallback spell a value (a literal, a constant, a call computing one), rather than read one from another
    object (``info.precision``)?"""
    if isinstance(node, ast.Constant):
        return node.value is not None
    if isinstance(node, (ast.Name, ast.Attribute)):
        name = node.id if isinstance(node, ast.Name) else node.attr
        return name.isupper()
    if isinstance(node, ast.Call):
        return True
    if isinstance(node, ast.IfExp):
        return _invented(node.body) or _invented(node.orelse)
    if isinstance(node, ast.BoolOp):
        return any(_invented(v) for v in node.values)
    if isinstance(node, ast.BinOp):
        return _invented(node.left) or _invented(node.right)
    if isinstance(node, ast.UnaryOp):
        return _invented(node.operand)
    return False


def _membership(test) -> tuple[str, bool] | None:
    """(option, whether the test is true when it is missing) for ``"name" in OPTIONS``, ``"name" not in OPTIONS``,
    ``OPTIONS.get("name") is None`` and ``... is not None``."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1):
        return None
    op, left, right = test.ops[0], test.left, test.comparators[0]
    if isinstance(op, (ast.In, ast.NotIn)) and isinstance(left, ast.Constant) and _reader(right):
        return str(left.value), isinstance(op, ast.NotIn)
    if isinstance(op, (ast.Is, ast.IsNot)) and isinstance(right, ast.Constant) and right.value is None:
        name = _option_read(left)
        return (name, isinstance(op, ast.Is)) if name else None
    return None


def _fallback(node) -> tuple[str, ast.AST] | None:
    """(option, fallback) when ``node`` reads an option with a default of its own: ``OPTIONS.get("name", F)``,
    ``OPTIONS.get("name") or F``, ``OPTIONS["name"] if "name" in OPTIONS else F`` (and its mirror images)."""
    if isinstance(node, ast.Call) and len(node.args) == 2 and (name := _option_read(node)):
        return name, node.args[1]
    if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and (name := _option_read(node.values[0])):
        return name, node.values[1]
    if isinstance(node, ast.IfExp) and (test := _membership(node.test)):
        name, missing_is_true = test
        return name, node.body if missing_is_true else node.orelse
    return None


def option_fallbacks() -> list[tuple[str, int, str, str]]:
    """(file, line, option, fallback) for every read in the core and the plugins of an option declared with a
    default that spells a default of its own."""
    defaults = _defaults_declared()
    files = [*sorted(CORE.rglob("*.py")), *sorted((ROOT / "plugins").glob("*/vlmrun_*/**/*.py"))]
    found = []
    for f in files:
        for node in ast.walk(ast.parse(f.read_text())):
            hit = _fallback(node)
            if hit and hit[0] in defaults and _invented(hit[1]):
                found.append((str(f.relative_to(ROOT)), node.lineno, hit[0], ast.unparse(hit[1])))
    return found


def test_no_fallback_for_a_declared_default():
    """Every option declared with a default reaches the hooks filled in (`vlmrun.options.OptionTable.fill`), so no
    code reads one with a fallback of its own (``options.get("timeout", 300)``, ``opts.get("prefill_ar") or
    DEFAULT_PREFILL_AR``, ``o["x"] if "x" in o else 1``): one that differs from the declaration would silently win."""
    found = option_fallbacks()
    new = [f"{path}:{line}: {name} falls back on {src}" for path, line, name, src in found
           if f"{path}:{name}" not in PENDING]
    assert not new, "read the filled value instead:\n" + "\n".join(new)
    stale = sorted(PENDING - {f"{path}:{name}" for path, _, name, _ in found})
    assert not stale, "fixed: drop from PENDING:\n" + "\n".join(stale)


def test_the_fallback_finder_sees_each_form():
    """The finder itself: each way of writing a fallback is found, a plain read and a backend's own value are not."""
    src = '''
def f(options, opts, o, ctx, info):
    a = options.get("timeout", 300)
    b = int(opts.get("prefill_ar") or DEFAULT_PREFILL_AR)
    c = o["timeout"] if "timeout" in o else 1.0
    d = 2 if "timeout" not in dict(ctx.options or {}) else ctx.options["timeout"]
    e = LIMIT if o.get("parts") is None else o["parts"]
    g = opts["timeout"]
    h = opts.get("precision") or info.precision
    k = manifest.get("timeout", 300)
'''
    hits = [_fallback(n) for n in ast.walk(ast.parse(src))]
    got = sorted((name, ast.unparse(fb)) for name, fb in filter(None, hits) if _invented(fb))
    assert got == [("parts", "LIMIT"), ("prefill_ar", "DEFAULT_PREFILL_AR"), ("timeout", "1.0"), ("timeout", "2"),
                   ("timeout", "300")]


def test_every_module_a_test_may_skip_without_is_installed():
    """Tests skip (``pytest.importorskip``) where onnxruntime-qnn, torch, qai-hub ... cannot be imported, so a suite
    run without one passed with a quarter of its tests skipped. The README's test command installs them all
    (scripts/setup.sh): here each must import, so such a run fails, naming what is missing."""
    import importlib

    names = sorted({m for f in Path(__file__).parent.glob("test_*.py")
                    for m in re.findall(r"importorskip\(\"([\w.]+)\"\)", f.read_text())})
    assert "onnxruntime_qnn" in names and "torch" in names  # the scan finds the guards
    missing = []
    for name in names:
        try:
            importlib.import_module(name)
        except Exception as exc:  # an ImportError, or a native library that does not load (libatomic1)
            missing.append(f"{name} ({type(exc).__name__}: {exc})")
    assert not missing, f"tests would skip without: {'; '.join(missing)}; run scripts/setup.sh"
