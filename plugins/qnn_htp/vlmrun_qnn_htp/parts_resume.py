"""A decoder's parts kept as they are made, so that a compile stopped part-way starts again from what it made.

A big decoder's parts take hours (a FastVLM-7B bundle: ten parts of about eight minutes each after the calibration
feeds): a compile killed by the machine (out of memory, a restart), stopped with Ctrl-C or failing on one part
would otherwise start again from the first. `MadeParts` keeps, in the artifact's state directory of the store
(``state/ARTIFACT/made-parts/``, the artifact named by its full key: the same model, export, options and plugin
versions), the calibration feeds once all of them are recorded (``feeds/`` and ``feeds.json``) and each part once
it is made (``partK/``: its binaries and wrappers, hard links where the file system allows, and ``made.json``,
written last). The next compile of the same artifact takes them instead of making them again: the same bytes, as
a part's making depends only on its job. A part whose files are missing or not of their recorded size is made
again. ``--rebuild`` starts from nothing; a finished compile removes the folder (its artifact is in the store).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from vlmrun.atomic import link_or_copy, write_text_atomic

RESUME_DIR = "made-parts"
MADE = "made.json"


def _write_json(path: Path, data) -> None:
    """Written whole or not at all (a rename): a file half-written by a killed compile is never read."""
    write_text_atomic(path, json.dumps(data, sort_keys=True))


class MadeParts:
    """The parts (and calibration feeds) an earlier, stopped compile of the same artifact made; ``root`` None:
    nothing is kept (a compile without a store)."""

    def __init__(self, root: Path | None):
        self.root = root

    @classmethod
    def for_compile(cls, context, rebuild: bool = False) -> "MadeParts":
        try:
            state = Path(context.state_dir()) if context is not None else None
        except NotImplementedError:  # a compile context without a store
            state = None
        if state is None:
            return cls(None)
        root = state / RESUME_DIR
        if rebuild:
            shutil.rmtree(root, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
        return cls(root)

    # -- calibration feeds -------------------------------------------------------------------------------------------

    def feeds(self) -> tuple[dict, str] | None:
        """({(part, kind): path}, label) of the feeds an earlier compile recorded, all of them intact; else None."""
        if self.root is None or not (self.root / "feeds.json").is_file():
            return None
        recorded = json.loads((self.root / "feeds.json").read_text())
        out = {}
        for key, (name, size) in recorded["files"].items():
            path = self.root / "feeds" / name
            if not path.is_file() or path.stat().st_size != size:
                return None
            part, kind = key.split(":")
            out[(int(part), kind)] = str(path)
        return out, recorded["label"]

    def feeds_dir(self, fallback: Path) -> Path:
        """Where the feeds are recorded: a fresh ``feeds.partial/`` to keep (``fallback`` when nothing is kept)."""
        if self.root is None:
            return fallback
        partial = self.root / "feeds.partial"
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir()
        return partial

    def keep_feeds(self, feeds: dict, label: str) -> dict:
        """The feeds recorded into `feeds_dir` (and their calibration's ``label``), kept: the same dict with their
        kept paths."""
        if self.root is None or not feeds:
            return feeds
        done = self.root / "feeds"
        shutil.rmtree(done, ignore_errors=True)
        os.replace(self.root / "feeds.partial", done)
        kept = {key: str(done / Path(path).name) for key, path in feeds.items()}
        _write_json(self.root / "feeds.json", {
            "label": label,
            "files": {f"{k}:{kind}": [Path(p).name, Path(p).stat().st_size] for (k, kind), p in kept.items()}})
        return kept

    # -- parts ------------------------------------------------------------------------------------------------------

    def part_dir(self, index: int) -> str | None:
        """Where `keep` puts part ``index`` (a string: it travels in a picklable job); None when nothing is kept."""
        return None if self.root is None else str(self.root / f"part{index}")

    def made(self, index: int, out_dir: Path) -> dict | None:
        """Part ``index``'s result (as `make_part` returned it) with its files linked into ``out_dir``, when an
        earlier compile made it and its files are intact; else None."""
        if self.root is None:
            return None
        d = self.root / f"part{index}"
        if not (d / MADE).is_file():
            return None
        made = json.loads((d / MADE).read_text())
        if any(not (d / n).is_file() or (d / n).stat().st_size != size for n, size in made["files"].items()):
            return None
        for name in made["files"]:
            link_or_copy(d / name, Path(out_dir) / name)
        return made["result"]

    def done(self) -> None:
        """The compile finished: nothing left to resume."""
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)


def keep(part_dir: str | None, result: dict, out_dir: Path) -> None:
    """Keep a part just made (``result``: `make_part`'s, its files in ``out_dir``) in ``part_dir``; ``made.json``
    last, so that a part is either whole there or not at all."""
    if part_dir is None:
        return
    d = Path(part_dir)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    names = [*result["entry"]["binaries"], *result["wrappers"]]
    for name in names:
        link_or_copy(Path(out_dir) / name, d / name)
    _write_json(d / MADE, {"files": {n: (d / n).stat().st_size for n in names}, "result": result})
