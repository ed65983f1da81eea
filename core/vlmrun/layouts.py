"""Layouts: which backend runs which stage, with per-stage options.

Presets are the named layouts plugins declare (``register_presets``; `vlmrun plugins` lists them). The built-in
plugins declare::

    reference : every stage on the reference backend (the layout others are diffed and scored against)
    hybrid    : vision, projector, embed on the NPU; the decoder on the CPU runtime
    all-npu   : every stage on the NPU

Per-stage overrides (``--vision BACKEND``) apply on top of the preset. A TOML layout file looks like::

    base = "reference"          # optional preset to start from
    [vision]
    backend = "acme_npu"
    precision = "int8"          # any other key is a per-stage option the backend declares (vlmrun.options)
    [decoder]
    backend = "acme_cpu"
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path
from typing import Mapping

import attrs

from . import plugins
from .errors import UsageError
from .stages import STAGES

REFERENCE = "reference"  # the default layout: the preset a plugin declares with ``reference=True``


@attrs.frozen
class StageAssignment:
    backend: str
    options: Mapping[str, object] = attrs.field(factory=dict)


@attrs.frozen
class Layout:
    name: str
    stages: Mapping[str, StageAssignment]
    bundle: str | None = None  # a bundle folder (``bundle:DIR``): its manifest names the backend of every stage

    def backend(self, stage: str) -> str:
        return self.stages[stage].backend

    def describe(self) -> str:
        return " ".join(f"{s}={self.stages[s].backend}" for s in STAGES)


def read_toml(path: str | Path, what: str) -> dict:
    """A TOML file as a dict, or one UsageError line saying why it cannot be read (``what`` names the file)."""
    try:
        return tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path}: {exc.strerror or exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{what} {path} is not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise UsageError(f"{what} {path} is not UTF-8 text (byte {exc.start}); save it as UTF-8") from None


def resolve(
    name: str | None = None,
    file: str | Path | None = None,
    overrides: Mapping[str, str | None] | None = None,
    options: Mapping[str, Mapping[str, object]] | None = None,
    presets: Mapping[str, "plugins.Preset"] | None = None,
) -> Layout:
    """Build a layout from a preset name (or ``bundle:DIR``), an optional TOML file, per-stage backend overrides
    and options.

    ``name`` may carry its own overrides, as every command writes a layout: ``BASE[,STAGE=BACKEND][,STAGE.KEY=VALUE]``
    (`parse_spec`; ``all-npu,decoder.context_length=256``, ``my.toml,vision=acme_npu``); ``overrides`` and ``options``
    given beside it win over them. ``presets``: the named layouts (default: those the installed plugins declare,
    `vlmrun.plugins.default`)."""
    if name and str(name).startswith(BUNDLE_PREFIX):
        return bundle_layout(str(name)[len(BUNDLE_PREFIX):], overrides, options)
    if name and "," in str(name):
        base, inline_overrides, inline_options = parse_spec(str(name))
        if is_layout_file(base):
            if file is not None:
                raise UsageError(f"layout '{name}' names a layout file and --layout-file gives another")
            base, file = None, base
        merged = {s: {**inline_options.get(s, {}), **dict((options or {}).get(s, {}))}
                  for s in {*inline_options, *(options or {})}}
        return resolve(base, file, {**inline_overrides, **{k: v for k, v in (overrides or {}).items() if v}}, merged,
                       presets)
    if name and is_layout_file(str(name)) and file is None:
        name, file = None, name
    table: dict = {}
    if file is not None:
        table = read_toml(file, "layout file")
        unknown = [k for k, v in table.items() if isinstance(v, dict) and k not in STAGES]
        if unknown:
            raise UsageError(f"layout file {file} names unknown stage(s) {unknown}; stages are {list(STAGES)}")
        for stage in STAGES:
            if stage in table and not isinstance(table[stage], dict):
                raise UsageError(f"layout file {file}: {stage} = {table[stage]!r} is not a table; write it as"
                                 f" [{stage}] with backend = \"...\" and the stage's options under it")
            if not isinstance(table.get(stage, {}).get("backend", ""), str):
                raise UsageError(f"layout file {file}: [{stage}] backend must be a plugin's name (a string)")
        for key in ("base", "name"):
            if key in table and not isinstance(table[key], str):
                raise UsageError(f"layout file {file}: {key} must be a string, not {table[key]!r}")
    if name and table.get("base") and name != table["base"]:  # one would silently win over the other
        raise UsageError(f"--layout {name} and the layout file {file}'s base = \"{table['base']}\" disagree; give"
                         " one of them")
    base = name or table.get("base") or REFERENCE
    preset = _preset(base, presets if presets is not None else plugins.default().presets)
    stages: dict[str, StageAssignment] = {}
    for stage in STAGES:
        section = dict(table.get(stage, {}))
        backend = section.pop("backend", preset.stages[stage])
        stages[stage] = StageAssignment(backend, section)
    for stage, backend in (overrides or {}).items():
        if backend:
            if stage not in STAGES:
                raise UsageError(f"unknown stage '{stage}'; stages are {list(STAGES)}")
            stages[stage] = StageAssignment(backend, stages[stage].options)
    for stage, extra in (options or {}).items():
        if stage not in STAGES:
            raise UsageError(f"unknown stage '{stage}'; stages are {list(STAGES)}")
        merged = {**stages[stage].options, **{k: v for k, v in extra.items() if v is not None}}
        stages[stage] = StageAssignment(stages[stage].backend, merged)
    label = str(table.get("name") or (Path(file).stem if file else base))
    if overrides and any(overrides.values()):
        label += "+overrides"
    return Layout(label, stages)


def _preset(name: str, presets: Mapping[str, "plugins.Preset"]) -> "plugins.Preset":
    """The preset called ``name``; ``reference`` is the role: the preset a plugin declared with ``reference=True``."""
    if name == REFERENCE:
        found = [p for p in presets.values() if p.reference]
        if not found:
            raise UsageError(f"no plugin declares the '{REFERENCE}' layout (the one others are compared against):"
                             " install the reference plugin (vlmrun-ort-reference) or name a layout")
        return found[0]
    if name not in presets:
        raise UsageError(f"unknown layout '{name}'; presets are: {', '.join(presets) or 'none'} (or use"
                         " --layout-file)")
    return presets[name]


def is_layout_file(base: str) -> bool:
    """Does a layout's base name a TOML file (``*.toml`` or a path) rather than a preset?"""
    return not base.startswith(BUNDLE_PREFIX) and (base.endswith(".toml") or os.sep in base)


def parse_spec(spec: str) -> tuple[str, dict[str, str], dict[str, dict[str, str]]]:
    """``BASE[,STAGE=BACKEND][,STAGE.KEY=VALUE]...`` -> (base, {stage: backend}, {stage: {key: value}}): the one way
    every command writes a layout inline (``--layout``, ``--device``, ``-L``). BASE is a preset or a TOML file;
    values stay strings (the plugins' declarations convert them)."""
    from .options import parse_assignment

    head, *rest = [part.strip() for part in spec.split(",")]
    if not head:
        raise UsageError(f"layout '{spec}': expected BASE[,STAGE=BACKEND][,STAGE.KEY=VALUE]...")
    overrides: dict[str, str] = {}
    options: dict[str, dict[str, str]] = {}
    for part in rest:
        if not part:
            continue
        lhs, eq, value = part.partition("=")
        if not eq or not value.strip():
            raise UsageError(f"layout '{spec}': '{part}' is not STAGE=BACKEND or STAGE.KEY=VALUE")
        if "." in lhs:
            stage, key, val = parse_assignment(part)
            options.setdefault(stage, {})[key] = val
        else:
            stage = lhs.strip()
            if stage not in STAGES:
                raise UsageError(f"layout '{spec}': unknown stage '{stage}'; stages are {', '.join(STAGES)}")
            overrides[stage] = value.strip()
    return head, overrides, options


BUNDLE_PREFIX = "bundle:"
BUNDLE_MANIFEST = "vlmrun-bundle.json"  # what ``vlmrun bundle`` writes into every bundle folder


def bundle_manifest(folder: str | Path) -> dict:
    """The manifest of a bundle folder, or one UsageError line saying why it is not one."""
    import json

    path = Path(folder).expanduser()
    mf = path / BUNDLE_MANIFEST
    if not mf.is_file():
        raise UsageError(f"{path} is not a vlmrun bundle (no {BUNDLE_MANIFEST}); write one with: vlmrun bundle {path}")
    try:
        m = json.loads(mf.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"{mf} cannot be read ({exc}); write the bundle again") from None
    if not isinstance(m, dict) or not m.get("backend"):
        raise UsageError(f"{mf} names no backend; write the bundle again")
    files = m.get("files")  # every bundle's record of its files (name -> sha256 and bytes): what is checked and run
    if not isinstance(files, dict) or not files or not all(
            isinstance(v, dict) and isinstance(v.get("sha256"), str) and isinstance(v.get("bytes"), int)
            for v in files.values()):
        raise UsageError(f"{mf} has no record of its files (files: name -> sha256 and bytes); it was not written by"
                         " vlmrun bundle, or was edited: write the bundle again")
    root = path.resolve()
    outside = [n for n in files if Path(n).is_absolute() or not (root / n).resolve().is_relative_to(root)]
    if outside:  # what is pushed is the folder: a file outside it would be missing on the device
        raise UsageError(f"{mf} lists {outside[0]}, outside the bundle's folder; a bundle holds its files itself:"
                         " write the bundle again")
    return m


def bundle_layout(folder: str, overrides=None, options=None) -> Layout:
    """The layout of a bundle: every stage on the backend its manifest names, the folder in ``Layout.bundle``.
    A bundle runs as it was written: stage backend overrides are refused; options reach the backend, which accepts
    only those that choose where and how the bundle runs (a device, a timeout), not how it was compiled."""
    if overrides and any(overrides.values()):
        raise UsageError("a bundle runs as it was written: drop the --STAGE backend overrides (write another bundle"
                         " from a layout instead)")
    backend = str(bundle_manifest(folder)["backend"])
    path = str(Path(folder).expanduser().resolve())
    stages = {s: StageAssignment(backend, {k: v for k, v in (options or {}).get(s, {}).items() if v is not None})
              for s in STAGES}
    return Layout(f"{BUNDLE_PREFIX}{folder}", stages, bundle=path)


def validate(layout: Layout, registry, stages=STAGES) -> Layout:
    """Check ``layout`` before any work starts: every stage's backend (and compiler) is installed and runs the
    stage, and every option is one the backend, its compiler or the core declares, with a value of the
    declared type and choices. Returns the layout with the option values converted to their types: the given ones
    only, which is what keys artifacts and what a layout prints (the hooks get them with every declared default
    filled in: `vlmrun.options.OptionTable.fill`)."""
    table = registry.options
    checked = dict(layout.stages)
    for stage in stages:
        assignment = layout.stages[stage]
        registry.require_stage(assignment.backend, stage)
        compiler = assignment.options.get("compiler")
        if compiler:
            registry.backend(str(compiler))
        checked[stage] = StageAssignment(assignment.backend,
                                         table.check(stage, assignment.backend, assignment.options))
    return Layout(layout.name, checked, layout.bundle)


def layout_snippet(stage: str, backend: str, options: Mapping[str, object]) -> str:
    """Layout-TOML lines for ``stage`` with ``options``."""
    lines = [f"[{stage}]", f'backend = "{backend}"']
    for k, v in options.items():
        if isinstance(v, bool):
            val = "true" if v else "false"
        elif isinstance(v, (int, float)):
            val = str(v)
        else:
            val = '"' + str(v).replace("\\", "\\\\").replace('"', '\\"') + '"'
        lines.append(f"{k} = {val}")
    return "\n".join(lines)


def layout_toml(layout) -> str:
    """A whole layout as a layout file (every stage's backend and options)."""
    return "\n\n".join(layout_snippet(s, a.backend, a.options) for s, a in layout.stages.items()) + "\n"
