"""The docs cannot lie: every example in README.md and docs/*.md runs (or, marked as needing hardware, parses with
vlmrun's own parser); a wrong flag in an example fails the checker; the site builds strictly and renders in a real
headless browser; the README fits in 120 lines and opens with the two commands .ci/run uses; every command's --help
points to its page."""

from __future__ import annotations

import functools
import html
import json
import re
import shlex
import shutil
import subprocess
import sys
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import docs_examples  # noqa: E402

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_fits_a_screen_and_opens_with_the_two_commands():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 120
    assert lines[2:6] == [
        "```bash",
        "scripts/setup.sh && .venv/bin/vlmrun demo                 # run FastVLM on the tiny default model",
        "scripts/setup.sh && .venv/bin/python -m pytest            # run the whole test suite",
        "```"]
    ci = (ROOT / ".ci" / "run").read_text()
    assert "scripts/setup.sh" in ci and ".venv/bin/python -m pytest" in ci


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_examples_run(page, cache_dir, ref_pipe, tmp_path):
    errors = docs_examples.check_page(page, tmp_path / "work", cache_dir)
    assert not errors, "\n".join(errors)


def test_every_page_is_in_the_site_and_every_example_block_is_checked():
    import yaml

    nav = json.dumps(yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"])
    for page in (ROOT / "docs").glob("*.md"):
        assert f'"{page.name}"' in nav, f"{page.name} is not in mkdocs.yml's nav"
        for block in docs_examples.blocks(page):
            assert block.lang in ("console", "python", "toml", "json", "text", ""), (page.name, block.line, block.lang)
        # a section included from another page (pymdownx.snippets) is checked there: it must exist in a checked page
        for name, section in re.findall(r'^--8<-- "([^":]+):(\w+)"$', page.read_text(), re.M):
            source = (ROOT / name).read_text()
            assert ROOT / name in PAGES, (page.name, name)
            assert f"--8<-- [start:{section}]" in source and f"--8<-- [end:{section}]" in source, (page.name, name)


# -- the checker itself ---------------------------------------------------------------------------------------------

def _page(tmp_path, text: str) -> Path:
    page = tmp_path / "page.md"
    page.write_text(text)
    return page


def test_a_wrong_flag_in_an_example_fails(tmp_path, cache_dir, ref_pipe):
    page = _page(tmp_path, "# p\n\n```console\n$ vlmrun eval --limt 2\n```\n")
    errors = docs_examples.check_page(page, tmp_path / "w", cache_dir)
    assert len(errors) == 1 and "vlmrun eval --limt 2: exit 2" in errors[0] and "--limt" in errors[0], errors
    # the same flag in a block marked as needing hardware: parsed by vlmrun's own parser, still caught
    page = _page(tmp_path, "# p\n\n<!-- needs: a phone -->\n```console\n$ vlmrun --target android --limt 2\n```\n")
    errors = docs_examples.check_page(page, tmp_path / "w", cache_dir)
    assert len(errors) == 1 and "No such option" in errors[0] and "--limt" in errors[0], errors
    # a bad value, a benchmark's own flag
    page = _page(tmp_path, "# p\n\n<!-- needs: time -->\n```console\n$ vlmrun eval --limit zero\n"
                           "$ python benchmarks/tune.py --itemz 3\n$ python benchmarks/tune.py --items 3 --full-size\n```\n")
    errors = docs_examples.check_page(page, tmp_path / "w", cache_dir)
    assert len(errors) == 2, errors
    assert "'zero' is not a valid integer" in errors[0] and "unrecognized arguments: --itemz 3" in errors[1], errors


def test_printed_output_and_exit_codes_are_checked(tmp_path, cache_dir, ref_pipe):
    page = _page(tmp_path, "# p\n\n```console\n$ vlmrun --image photo.jpg --prompt 'Describe the image.'\n"
                           "A blue square on a red background.\n```\n")
    errors = docs_examples.check_page(page, tmp_path / "w", cache_dir)
    assert len(errors) == 1 and "expected output line not printed" in errors[0], errors
    page = _page(tmp_path, "# p\n\n```console\n$ vlmrun --image nothere.jpg --prompt 'Describe the image.'\n```\n")
    errors = docs_examples.check_page(page, tmp_path / "w", cache_dir)
    assert len(errors) == 1 and "exit 1 (expected 0): vlmrun: error: image not found: nothere.jpg" in errors[0]
    page = _page(tmp_path, "# p\n\n```python\nimport vlmrun\nprint(vlmrun.__version__)  # prints: 9.9.9\n```\n")
    errors = docs_examples.check_page(page, tmp_path / "w", cache_dir)
    assert len(errors) == 1 and "'9.9.9'" in errors[0], errors
    page = _page(tmp_path, "# p\n\n```bash\nvlmrun demo\n```\n")
    errors = docs_examples.check_page(page, tmp_path / "w", cache_dir)
    assert len(errors) == 1 and "write commands as ```console" in errors[0], errors


# -- --help ---------------------------------------------------------------------------------------------------------

def test_every_command_help_points_to_its_page():
    from click.testing import CliRunner

    from vlmrun.cli import DOCS_PAGES, cli

    assert set(DOCS_PAGES) == {"", *cli.commands}
    for name, page in DOCS_PAGES.items():
        res = CliRunner().invoke(cli, [*([name] if name else []), "--help"], prog_name="vlmrun")
        assert res.exit_code == 0, res.output
        assert f"Docs: docs/{page}" in " ".join(res.output.split()), name
        assert (ROOT / "docs" / page).is_file()


# -- the site ---------------------------------------------------------------------------------------------------------

HARNESS = """<!DOCTYPE html><html><head><title>harness</title></head><body><pre id="out">pending</pre><script>
const pages = PAGES; const results = {}; let i = 0;
function next() {
  if (i >= pages.length) { document.getElementById('out').textContent = JSON.stringify(results); return; }
  const f = document.createElement('iframe'); f.style.width = '1280px'; f.style.height = '900px';
  f.onload = () => setTimeout(() => {
    const d = f.contentDocument, art = d.querySelector('article');
    const imgs = Array.from(d.querySelectorAll('article img'));
    results[pages[i]] = {
      title: d.title, h1: art && art.querySelector('h1') ? art.querySelector('h1').textContent : null,
      nav: d.querySelectorAll('nav.md-nav a.md-nav__link').length, code: d.querySelectorAll('article pre code').length,
      tables: d.querySelectorAll('article table').length, width: art ? art.getBoundingClientRect().width : 0,
      images: imgs.map(im => [im.getAttribute('src'), im.naturalWidth, im.naturalHeight]),
      styled: getComputedStyle(d.body).fontFamily};
    f.remove(); i++; next(); }, 500);
  f.src = pages[i]; document.body.appendChild(f);
}
next();
</script></body></html>"""


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    out = tmp_path_factory.mktemp("site") / "site"
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(ROOT / "mkdocs.yml"), "-d",
                          str(out)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def test_site_builds_strictly_with_the_api_reference(site):
    api = (site / "api" / "index.html").read_text()
    for name in ("vlmrun.Pipeline", "vlmrun.hookspecs.load_stage", "vlmrun.hookspecs.layer_precisions",
                 "vlmrun.tune.tune"):
        assert f'id="{name}"' in api, name
    # a broken link fails the strict build
    broken = site.parent / "broken"
    shutil.copytree(ROOT / "docs", broken / "docs")
    shutil.copy(ROOT / "README.md", broken / "README.md")  # index.md includes its tour
    (broken / "docs" / "eval.md").write_text((broken / "docs" / "eval.md").read_text() + "\n[gone](nosuch.md)\n")
    cfg = (ROOT / "mkdocs.yml").read_text().replace("paths: [core]", f"paths: [{ROOT / 'core'}]")
    (broken / "mkdocs.yml").write_text(cfg)
    res = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(broken / "site")],
                         capture_output=True, text=True, timeout=600, cwd=broken)
    assert res.returncode != 0 and "nosuch.md" in res.stderr


def test_site_renders_in_a_headless_browser(site):
    browser = shutil.which("chromium-headless-shell") or shutil.which("chromium")
    assert browser, "Chromium is not installed (apt-get install chromium-headless-shell; .ci/run installs it)"
    pages = ["index.html", "getting-started/index.html", "tune/index.html", "measured/index.html", "api/index.html"]
    (site / "harness.html").write_text(HARNESS.replace("PAGES", json.dumps(pages)))
    handler = functools.partial(SimpleHTTPRequestHandler, directory=str(site))
    handler.log_message = lambda *a, **k: None
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/harness.html"
        res = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=30000",
                              "--dump-dom", url], capture_output=True, text=True, timeout=180)
    finally:
        server.shutdown()
    m = re.search(r'<pre id="out">(.*?)</pre>', res.stdout, re.S)
    assert m and m.group(1) != "pending", res.stdout[-2000:] + res.stderr[-2000:]
    got = json.loads(html.unescape(m.group(1)))
    assert got["index.html"]["title"] == "vlmrun" and got["index.html"]["h1"].startswith("vlmrun")
    assert got["tune/index.html"]["title"].startswith("Tune") and got["measured/index.html"]["title"].startswith("Measured")
    for page, r in got.items():
        assert r["nav"] >= 15, (page, r)  # the navigation rendered, every page in it
        assert r["width"] > 300, (page, r)  # the article laid out
        assert "Roboto" in r["styled"] or "sans" in r["styled"], (page, r)  # the theme's CSS applied
    assert got["getting-started/index.html"]["code"] >= 2 and got["getting-started/index.html"]["tables"] >= 1
    plots = [im for im in got["measured/index.html"]["images"] if im[0].endswith(".png")]
    assert plots and all(w > 100 and h > 100 for _, w, h in plots), got["measured/index.html"]["images"]


# -- measured figures ---------------------------------------------------------------------------------------------

def _table_after(text: str, heading: str) -> list[dict]:
    """The first Markdown table after ``heading``: its rows as dicts of header -> cell."""
    lines = text[text.index(heading):].splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("|"))
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    head, body = rows[0], rows[2:]
    return [dict(zip(head, r)) for r in body]


def test_measured_qnn_htp_figures_hold(tmp_path):
    """benchmarks/qnn_htp.py reruns in seconds: its sizes within 2% and cosines within 0.003 of the page's."""
    res = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "qnn_htp.py"), "--cache-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-2000:]
    got = json.loads(res.stdout)["stages"]
    rows = {r["stage"]: r for r in _table_after((ROOT / "docs" / "measured.md").read_text(),
                                                 "## qnn_htp on the HTP v79 emulator")}
    measured = {
        "vision fp16": (sum(got["vision"]["binary_bytes"].values()), None),
        "vision int8": (got["vision"]["int8"]["binary_bytes"], got["vision"]["int8"]["cosine_vs_cpu"]),
        "vision a16w8": (got["vision"]["a16w8"]["binary_bytes"], got["vision"]["a16w8"]["cosine_vs_cpu"]),
        "projector fp16": (sum(got["projector"]["binary_bytes"].values()), None),
        "embed fp16 (seq 32)": (sum(got["embed"]["binary_bytes"].values()), None),
        "decoder fp16 (prompt + token)": (sum(got["decoder"]["binary_bytes"].values()), None),
    }
    assert set(measured) == set(rows)
    for stage, (size, cos) in measured.items():
        assert size == pytest.approx(int(rows[stage][".bin bytes"]), rel=0.02), stage
        if cos is not None:
            assert cos == pytest.approx(float(rows[stage]["cosine vs CPU"]), abs=0.003), stage


def test_a_printed_number_may_differ_in_its_last_digit_only():
    """A value on a rounding boundary prints either way from one run to the next (diff.md's KL mean 2.985e-06 as
    2.98e-06 or 2.99e-06); anything more is a wrong example."""
    line = "top-1 agreement 8/8 (1.000), top-5 overlap 0.950, KL mean 2.99e-06 max 1.12e-05, SQNR 25.7 dB, 100.0%"
    same = docs_examples.same_line
    assert same(line, line.replace("2.99e-06", "2.98e-06")) and same(line, line.replace("1.000", "0.999"))
    assert same(line, line.replace("25.7", "25.8")) and same(line, line.replace("100.0%", "99.9%"))
    for wrong in (("2.99e-06", "2.97e-06"), ("2.99e-06", "2.99e-05"), ("8/8", "7/8"), ("1.000", "0.998"),
                  ("25.7", "25.5"), ("100.0%", "99.0%"), ("SQNR", "sqnr"), (", 100.0%", "")):
        assert not same(line, line.replace(*wrong)), wrong


def test_a_block_marked_numbers_within_lets_its_decimals_differ_by_that_much_and_no_more(tmp_path):
    """``<!-- numbers within 10% -->`` (stacked with other marks): a quantized graph's figures printed on another CPU
    pass; a figure 11% off, an integer off by one or a changed status word does not."""
    line = "decoder logits 1x8x448 1.907 0.224 0.05196 0.99866381 25.7 FAIL sqnr_db 25.69 < 30, 8/8"
    same = docs_examples.same_line
    got = "decoder logits 1x8x448 1.907 0.2147 0.04951 0.99878477 26.1 FAIL sqnr_db 26.11 < 30, 8/8"
    assert same(line, got, 0.10) and not same(line, got)
    for wrong in (("0.224", "0.198"), ("8/8", "7/8"), ("FAIL", "pass"), ("< 30", "< 31"), ("1x8x448", "1x9x448")):
        assert not same(line, line.replace(*wrong), 0.10), wrong
    page = _page(tmp_path, "# p\n\n<!-- numbers within 10% -->\n<!-- needs: a phone -->\n```console\n"
                           "$ vlmrun --version\n```\n\n```console\n$ vlmrun --version\n```\n")
    marked, plain = docs_examples.blocks(page)
    assert (marked.tolerance, marked.needs, plain.tolerance, plain.needs) == (0.10, "a phone", 0.0, None)


def test_indented_and_tilde_fences_are_examples_too(tmp_path):
    """A block inside a list or an admonition (indented) or fenced with ~~~ is an example the checker runs."""
    page = _page(tmp_path, "# p\n\n1. first:\n\n    ```console\n    $ vlmrun --version\n    ```\n\n"
                           "~~~console\n$ vlmrun --nosuch\n~~~\n\n!!! note\n    ````python\n    print(1)\n    ````\n")
    found = docs_examples.blocks(page)
    assert [(b.lang, b.text) for b in found] == [("console", "$ vlmrun --version"), ("console", "$ vlmrun --nosuch"),
                                                ("python", "print(1)")]
    errors = docs_examples.check_page(page, tmp_path / "w", None, parse_only=True)
    assert len(errors) == 1 and "vlmrun --nosuch" in errors[0], errors


@pytest.mark.parametrize("code, want", [
    ("import sys; print('vlmrun: internal error: KeyError: x'); sys.exit(1)", "a bug, not the failure the page shows"),
    ("import sys; sys.stderr.write('Traceback (most recent call last):\\n'); sys.exit(1)", "a bug, not the failure"),
    ("raise SystemExit(1)", "exit 1 as expected, but no line says why"),
    ("import sys; print('vlmrun: error: image not found: x.jpg'); sys.exit(1)", None),
    ("import sys; print('FAIL: likely culprit: decoder'); sys.exit(1)", None),
])
def test_an_expected_failure_must_be_the_one_shown_not_any(tmp_path, code, want):
    """``# exit 1`` after a command whose expected output is only ``...`` passed any failure, an internal error
    included: the failure must be a one-line error or a verdict, never a traceback."""
    page = _page(tmp_path, f"# p\n\n```console\n$ python -c {shlex.quote(code)}\n...\n# exit 1\n```\n")
    errors = docs_examples.check_page(page, tmp_path / "w", None)
    if want is None:
        assert errors == []
    else:
        assert len(errors) == 1 and want in errors[0], errors
