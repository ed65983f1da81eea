"""The docs' examples, checked: every command and Python snippet in README.md and docs/*.md runs, or is marked.

    .venv/bin/python scripts/docs_examples.py [PAGE.md ...] [--parse-only]     # what the test suite does
    VLMRUN_DOCS_DUMP=out.txt .venv/bin/python scripts/docs_examples.py PAGE.md  # also keep what each command printed

A page's fenced blocks, in order:

* ```` ```console ````: lines starting with ``$ `` are commands (a trailing ``\\`` continues one); the lines after a
  command, up to the next, are its expected output: each must appear, in order, among the lines the command
  prints (stdout and stderr, whitespace collapsed); ``...`` stands for any lines. The command must exit 0, unless
  the block shows ``# exit N`` after it. Commands are argument lists (``shlex``), never a shell: ``vlmrun``,
  ``python`` (the suite's interpreter) and ``curl``-free tools only.
* ```` ```python ````: run as a script; what it prints is not checked unless a ``# prints: TEXT`` comment says.
* ```` ```toml title="NAME" ````: written to NAME in the page's working folder (a layout file later commands use);
  without a title, only parsed.
* ```` ```text ```` and untagged blocks: not examples (directory trees, sample reports).

A block after ``<!-- numbers within N% -->`` (the comment lines right above a block may stack) lets each decimal
number its commands print differ from the page's by up to N% of it (figures of quantized graphs, which depend on
the CPU's floating-point kernels: AVX2 and AVX-512 machines print a few percent apart); the words, integers and
statuses around them stay exact. A block right after ``<!-- needs: WHY -->`` needs what this machine does not have (a phone over adb, the QAIRT
SDK, an AI Hub token, or a full-size build that takes a quarter of an hour): its commands are only parsed, with
vlmrun's own click parser (an unknown flag or a bad value fails) and the benchmarks' own argparse parsers. A
block after ``<!-- serve: ARGS -->`` runs with ``vlmrun serve ARGS`` listening on loopback beside it.

Each page runs in its own working folder holding ``photo.jpg`` (the demo's picture: a red circle on a blue gradient, 640x480), with
``VLMRUN_CACHE_DIR`` the caller's store, so blocks can build on earlier ones (``vlmrun bundle out/`` then
``vlmrun --bundle out/ ...``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})(\w*)\s*(.*)$")  # indented (in a list, an admonition) and ~~~ fences too
NEEDS = re.compile(r"^<!--\s*needs:\s*(.+?)\s*-->$")
SERVE = re.compile(r"^<!--\s*serve:\s*(.*?)\s*-->$")
TOLERANCE = re.compile(r"^<!--\s*numbers within\s+(\d+(?:\.\d+)?)%\s*-->$")
EXIT = re.compile(r"^#\s*exit\s+(\d+)\s*$")
PRINTS = re.compile(r"#\s*prints:\s*(.+)$")
#: programs a needs-block may name besides vlmrun and the benchmarks (only their presence is checked)
OTHER_PROGRAMS = {"pip", "ray", "adb", "export", "source", "scripts/setup.sh", ".ci/run", "mkdocs"}


@dataclass
class Block:
    page: Path
    line: int
    lang: str
    title: str | None
    text: str
    needs: str | None = None
    serve: str | None = None
    tolerance: float = 0.0  # a decimal's relative tolerance (``<!-- numbers within N% -->``)


@dataclass
class Command:
    line: int
    argv: list[str]
    expected: list[str] = field(default_factory=list)
    exit_code: int = 0


def blocks(page: Path) -> list[Block]:
    out, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang, info = m.group(1), m.group(2), m.group(3), m.group(4)
        title = re.search(r'title="([^"]+)"', info)
        marks = []  # the comment lines right above the block
        for k in range(i - 1, -1, -1):
            if lines[k].strip().startswith("<!--"):
                marks.append(lines[k].strip())
            elif lines[k].strip():
                break
        j = i + 1  # closed by the same fence (at least as long) at any indent: CommonMark's rule
        while j < len(lines) and not re.match(rf"^\s*{re.escape(fence[0])}{{{len(fence)},}}\s*$", lines[j]):
            j += 1
        body = [ln[len(indent):] if ln.startswith(indent) else ln.lstrip() for ln in lines[i + 1:j]]
        needs = next((m.group(1) for m in map(NEEDS.match, marks) if m), None)
        serve = next((m.group(1) for m in map(SERVE.match, marks) if m), None)
        tolerance = next((float(m.group(1)) / 100 for m in map(TOLERANCE.match, marks) if m), 0.0)
        out.append(Block(page, i + 1, lang, title.group(1) if title else None, "\n".join(body),
                         needs, serve, tolerance))
        i = j + 1
    return out


def commands(block: Block) -> list[Command]:
    out: list[Command] = []
    lines = block.text.splitlines()
    k = 0
    while k < len(lines):
        line = lines[k]
        if line.startswith("$ "):
            text, start = line[2:], k
            while text.endswith("\\") and k + 1 < len(lines):
                k += 1
                text = text[:-1] + " " + lines[k].strip()
            argv = shlex.split(text, comments=True)
            out.append(Command(block.line + 1 + start, argv))
        elif out:
            m = EXIT.match(line.strip())
            if m:
                out[-1].exit_code = int(m.group(1))
            elif line.strip():
                out[-1].expected.append(line)
        elif line.strip():
            raise ValueError(f"{block.page.name}:{block.line + 1 + k}: a console block's first line must be a"
                             " command ($ ...)")
        k += 1
    return out


# -- parsing only -----------------------------------------------------------------------------------------------

def parse_vlmrun(args: list[str]) -> str | None:
    """None when vlmrun's own click parser takes ``args`` (every flag known, every value of its type)."""
    import click

    from vlmrun.cli import cli

    try:
        ctx = cli.make_context("vlmrun", list(args))
        cmd, rest = cli, [*getattr(ctx, "_protected_args", []), *ctx.args]
        while rest and isinstance(cmd, click.Group):
            name, sub, rest = cmd.resolve_command(ctx, rest)
            ctx = sub.make_context(name, rest, parent=ctx)
            cmd, rest = sub, [*getattr(ctx, "_protected_args", []), *ctx.args] if isinstance(sub, click.Group) else []
        return None
    except click.exceptions.Exit:
        return None
    except click.ClickException as exc:
        message = exc.format_message()
        if "does not exist" in message:  # a file the example names, made on the machine that runs it
            return None
        return message


_ARGPARSE_ONLY = """
import argparse, runpy, sys
def parse_only(self, args=None, namespace=None):
    ns, extra = self.parse_known_args(args, namespace)
    if extra:
        self.error("unrecognized arguments: " + " ".join(extra))
    raise SystemExit(0)
argparse.ArgumentParser.parse_args = parse_only
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def parse_python(argv: list[str], cwd: Path) -> str | None:
    """None when the script's own argparse parser takes the arguments (the script stops right after parsing)."""
    script = (ROOT / argv[0]) if not Path(argv[0]).is_absolute() else Path(argv[0])
    if not script.is_file():
        return f"no such script: {argv[0]}"
    res = subprocess.run([sys.executable, "-c", _ARGPARSE_ONLY, str(script), *argv[1:]], capture_output=True,
                         text=True, cwd=cwd, timeout=120)
    if res.returncode != 0:
        return (res.stderr.strip().splitlines() or [f"exit {res.returncode}"])[-1]
    return None


def parse_command(argv: list[str], cwd: Path) -> str | None:
    prog = argv[0]
    if prog == "vlmrun" or prog.endswith("/vlmrun"):
        return parse_vlmrun(argv[1:])
    if prog in ("python", "python3") or prog.endswith("/python"):
        if argv[1:2] == ["-m"]:
            return parse_vlmrun(argv[3:]) if argv[2:3] == ["vlmrun.cli"] else None
        return parse_python(argv[1:], cwd)
    if prog in OTHER_PROGRAMS:
        return None
    return f"unknown program '{prog}' (vlmrun, python or one of {', '.join(sorted(OTHER_PROGRAMS))})"


# -- running ------------------------------------------------------------------------------------------------------

def _norm(s: str) -> str:
    return " ".join(s.split())


#: a printed decimal number: fixed (``25.69``, ``1.00000000``) or scientific (``2.99e-06``); integers stay exact
_DECIMAL = re.compile(r"(?<![\w.])[-+]?\d+\.\d+(?:e[-+]?\d+)?(?![\w.])|(?<![\w.])[-+]?\d+e[-+]?\d+(?![\w.])")


def _last_digit(token: str) -> float:
    """The value of one unit in the last printed digit of ``token`` (``2.99e-06``: 1e-08; ``25.7``: 0.1)."""
    mantissa, _, exp = token.lower().partition("e")
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    return 10.0 ** (int(exp or 0) - decimals)


def same_line(want: str, got: str, tolerance: float = 0.0) -> bool:
    """``got`` prints ``want``: the same text, each decimal number within one unit of its last printed digit (a
    value on a rounding boundary, 2.985e-06, prints 2.98e-06 or 2.99e-06 from one run to the next), or within
    ``tolerance`` of it (relative; a block's ``<!-- numbers within N% -->``)."""
    if want == got:
        return True
    w_nums, g_nums = _DECIMAL.findall(want), _DECIMAL.findall(got)
    if not w_nums or len(w_nums) != len(g_nums) or _DECIMAL.split(want) != _DECIMAL.split(got):
        return False
    return all(abs(float(a) - float(b)) <= max(_last_digit(a) * (1 + 1e-6), tolerance * abs(float(a)))
               for a, b in zip(w_nums, g_nums))


def check_output(expected: list[str], printed: str, tolerance: float = 0.0) -> str | None:
    """None when every expected line appears, in order, among the printed lines (``...`` = any lines; `same_line`
    lets a decimal number's last printed digit differ by one, or by ``tolerance`` of it)."""
    got = [_norm(x) for x in printed.splitlines()]
    pos = 0
    for want in expected:
        w = _norm(want)
        if w == "...":
            continue
        while pos < len(got) and not same_line(w, got[pos], tolerance):
            pos += 1
        if pos == len(got):
            return f"expected output line not printed (in this order): {want.strip()!r}"
        pos += 1
    return None


def environment(cache_dir: Path | None) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    if cache_dir is not None:
        env["VLMRUN_CACHE_DIR"] = str(cache_dir)
    return env


def run_command(cmd: Command, cwd: Path, env: dict, timeout: float, tolerance: float = 0.0) -> str | None:
    argv = list(cmd.argv)
    if argv[:2] == ["pip", "install"] and len(argv) == 3 and argv[2].startswith("./examples/"):
        return install_example(argv[2], cwd, env)
    if argv[0] in ("python", "python3"):
        argv[0] = sys.executable
    elif argv[0] == "vlmrun":
        argv = [sys.executable, "-m", "vlmrun.cli", *argv[1:]]
    else:
        return f"only vlmrun and python commands run here, not '{argv[0]}' (mark the block <!-- needs: ... -->)"
    start = time.monotonic()
    try:
        res = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return f"did not finish in {timeout:.0f} s"
    seconds = time.monotonic() - start
    printed = res.stdout + "\n" + res.stderr
    if os.environ.get("VLMRUN_DOCS_DUMP"):  # what each command printed, to update a page's expected lines
        with open(os.environ["VLMRUN_DOCS_DUMP"], "a") as dump:
            dump.write(f"=== line {cmd.line}: {shlex.join(cmd.argv)} (exit {res.returncode}, {seconds:.1f} s)\n"
                       f"{printed}\n")
    if res.returncode != cmd.exit_code:
        tail = " | ".join((res.stderr.strip() or res.stdout.strip()).splitlines()[-3:])
        return f"exit {res.returncode} (expected {cmd.exit_code}): {tail}"
    return failure_shown(cmd, printed) or check_output(cmd.expected, printed, tolerance)


def failure_shown(cmd: Command, printed: str) -> str | None:
    """An example may fail on purpose (``# exit N``), but as vlmrun promises: never an internal error or a
    traceback, and with a line saying why (``vlmrun: ...``, or a diff's ``FAIL`` verdict). None when so."""
    lines = [ln.strip() for ln in printed.splitlines()]
    bad = next((ln for ln in lines if ln.startswith("Traceback (most recent call last)") or "internal error" in ln),
               None)
    if bad:
        return f"printed {bad!r}: a bug, not the failure the page shows"
    if cmd.exit_code and not any(ln.startswith(("vlmrun: ", "FAIL")) for ln in lines):
        return f"exit {cmd.exit_code} as expected, but no line says why (vlmrun: ... or FAIL ...)"
    return None


def install_example(path: str, cwd: Path, env: dict) -> str | None:
    """``pip install ./examples/X``: a copy of the repository's example installed into the page's own folder
    (``_site``, put on ``PYTHONPATH`` for the page's later commands), never into the suite's environment."""
    src = ROOT / path
    if not src.is_dir():
        return f"no such example: {path}"
    copy, site = cwd / "_examples" / src.name, cwd / "_site"
    shutil.copytree(src, copy, dirs_exist_ok=True)
    res = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                          "--target", str(site), str(copy)], capture_output=True, text=True, env=env, timeout=600)
    if res.returncode != 0:
        return f"pip install failed: {' | '.join(res.stderr.strip().splitlines()[-2:])}"
    env["PYTHONPATH"] = str(site) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return None


@contextlib.contextmanager
def serving(args: str, cwd: Path, env: dict):
    import urllib.request

    words = shlex.split(args)
    argv = [sys.executable, "-m", "vlmrun.cli", "serve", *words]
    port = words[words.index("--port") + 1] if "--port" in words else "8000"
    proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 600
        while time.time() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"vlmrun serve {args} exited with {proc.returncode}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except OSError:
                time.sleep(0.5)
        else:
            raise RuntimeError(f"vlmrun serve {args} did not answer /health within 600 s")
        yield
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def check_block(block: Block, workdir: Path, env: dict, parse_only: bool, timeout: float) -> list[str]:
    where = f"{block.page.name}:{block.line}"
    errors: list[str] = []
    if block.lang == "console":
        try:
            cmds = commands(block)
        except ValueError as exc:
            return [str(exc)]
        if not cmds:
            return [f"{where}: a console block with no command"]
        for cmd in cmds:
            if block.needs or parse_only:
                err = parse_command(cmd.argv, workdir)
            else:
                with serving(block.serve, workdir, env) if block.serve else contextlib.nullcontext():
                    err = run_command(cmd, workdir, env, timeout, block.tolerance)
            if err:
                errors.append(f"{block.page.name}:{cmd.line}: {shlex.join(cmd.argv)}: {err}")
    elif block.lang == "python":
        try:
            compile(block.text, where, "exec")
        except SyntaxError as exc:
            return [f"{where}: python does not compile: {exc}"]
        if block.needs or parse_only:
            return []
        script = workdir / f"_block_{block.line}.py"
        script.write_text(block.text)
        with serving(block.serve, workdir, env) if block.serve else contextlib.nullcontext():
            try:
                res = subprocess.run([sys.executable, script.name], cwd=workdir, env=env, capture_output=True,
                                     text=True, timeout=timeout)
            except subprocess.TimeoutExpired:
                return [f"{where}: python block did not finish in {timeout:.0f} s"]
        if res.returncode != 0:
            return [f"{where}: python block failed: {' | '.join(res.stderr.strip().splitlines()[-2:])}"]
        wants = [m.group(1) for m in map(PRINTS.search, block.text.splitlines()) if m]
        err = check_output(wants, res.stdout, block.tolerance)
        if err:
            errors.append(f"{where}: {err}")
    elif block.lang in ("toml", "json"):
        try:
            if block.lang == "toml":
                tomllib.loads(block.text)
            elif (block.title or "").endswith(".jsonl"):
                for line in filter(str.strip, block.text.splitlines()):
                    json.loads(line)
            else:
                json.loads(block.text)
        except (tomllib.TOMLDecodeError, ValueError) as exc:
            return [f"{where}: {block.lang.upper()} does not parse: {exc}"]
        if block.title:
            (workdir / block.title).parent.mkdir(parents=True, exist_ok=True)
            (workdir / block.title).write_text(block.text + "\n")
    elif block.lang in ("bash", "sh", "shell"):
        if block.page.name == "README.md" and block.line <= 5:
            return []  # the README's two commands: setup + demo, setup + the suite; .ci/run runs them
        errors.append(f"{where}: a {block.lang} block: write commands as ```console with '$ ' prompts")
    return errors


def prepare_workdir(workdir: Path) -> Path:
    from vlmrun.demo_image import demo_image

    workdir.mkdir(parents=True, exist_ok=True)
    demo_image().save(workdir / "photo.jpg", quality=95)  # the demo's red circle on a blue gradient
    return workdir


def check_page(page: Path, workdir: Path, cache_dir: Path | None, parse_only: bool = False,
               timeout: float = 900) -> list[str]:
    env = environment(cache_dir)
    prepare_workdir(workdir)
    errors = []
    for block in blocks(page):
        errors += check_block(block, workdir, env, parse_only, timeout)
    return errors


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="Check the docs' examples (see the module docstring).")
    ap.add_argument("pages", nargs="*", type=Path)
    ap.add_argument("--parse-only", action="store_true", help="Only parse the commands, run nothing.")
    ap.add_argument("--cache-dir", type=Path, default=None)
    args = ap.parse_args(argv)
    failed = 0
    for page in args.pages or pages():
        work = Path(os.environ.get("TMPDIR", "/tmp")) / f"vlmrun-docs-{page.stem}"
        shutil.rmtree(work, ignore_errors=True)
        errors = check_page(page, work, args.cache_dir, args.parse_only)
        for e in errors:
            print(e)
        print(f"{page.name}: {'ok' if not errors else f'{len(errors)} failing'}", file=sys.stderr)
        failed += len(errors)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
