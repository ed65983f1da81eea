"""Per-stage options: plugins declare them, the core checks every layout against the declarations.

A plugin declares the options of its backends in the ``register_options`` hook (pytest's ``pytest_addoption``
is the model)::

    @vlmrun.hookimpl
    def register_options(register):
        register(Option("acme_npu", "threads", int, default=4, minimum=1, help="worker threads"))
        register(Option("acme_npu", "precision", str, choices=("fp16", "int8"), flag="--precision",
                        help="numeric precision"))

An option is a key of a stage's table in a layout file (``[vision] threads = 2``), a generic
``--option vision.threads=2`` on the command line, or, when it declares a ``flag``, that flag
(``--precision int8``, applied to every stage whose backend or compiler declares the option).

Before any export or compile, `vlmrun.layouts.validate` checks each stage's options against what the stage's
backend (and its ``compiler``, when another plugin compiles for it) declares, plus the core's own options below
(`OptionTable.check`): an unknown key, a value of the wrong type or outside its choices is one
`vlmrun.errors.UsageError` naming the key, the stage and the closest known option.

Every hook that takes a stage's options then gets them as a `StageOptions` (`OptionTable.fill`): the checked values
with every declared option present, its declared default filled in when the layout does not set it, read-only.
A plugin reads ``options["timeout"]``, never ``options.get("timeout", 300)``: the default lives in the declaration
only. ``options.given`` holds what the layout set, which is what keys artifacts and what layouts print.
"""

from __future__ import annotations

import difflib
import types
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import attrs

from .errors import UsageError
from .stages import STAGES

TYPES = {str: "a string", int: "an integer", float: "a number", bool: "true or false", Path: "a path"}
CORE = "vlmrun"  # the owner of the options every backend takes


@attrs.frozen
class Option:
    """One per-stage option of a backend.

    :ivar backend: the backend that reads it (``vlmrun`` for the core's own options).
    :ivar name: the layout key (``snake_case``).
    :ivar type: ``str``, ``int``, ``float``, ``bool`` or ``pathlib.Path``; values are converted to it.
    :ivar choices: the allowed values (compared case-insensitively for strings), or ``None``.
    :ivar stages: the stages it applies to (``None``: every stage the backend runs).
    :ivar default: what the backend uses when the option is not given: shown in help and filled in for every hook
        (`StageOptions`). ``None`` when there is no single value: the option is then filled in as ``None`` and the
        plugin derives it in one place from the other options (its help says how, e.g. "default: 128 for the
        parts form, else 64").
    :ivar flag: a command-line flag for it (``--precision``); several backends may declare the same flag.
    :ivar minimum: the smallest allowed value of a number.
    :ivar keyed: the value changes what this plugin compiles: when it compiles for another backend
        (``--compiler``), the stage's value keys the compiled artifact (a device, a toolchain version).
    :ivar key: for a keyed option whose default depends on other options: ``key(stage options) -> value``, the
        value the compiler will really use (given or not), which keys the artifact instead of the raw one (a
        device named explicitly and the same device picked from the SoC key alike).
    """

    backend: str
    name: str
    type: type = str
    choices: tuple | None = attrs.field(default=None, converter=lambda c: tuple(c) if c is not None else None)
    stages: tuple[str, ...] | None = attrs.field(default=None,
                                                 converter=lambda s: tuple(s) if s is not None else None)
    default: object = None
    help: str = ""
    flag: str | None = None
    minimum: float | None = None
    keyed: bool = False
    key: object = attrs.field(default=None, eq=False, repr=False)

    def applies_to(self, stage: str) -> bool:
        return self.stages is None or stage in self.stages

    def convert(self, value: object, where: str) -> object:
        """``value`` as this option's type (strings from ``--option`` are parsed), or a UsageError."""
        want = self.type
        what = f"one of {', '.join(map(str, self.choices))}" if self.choices else TYPES.get(want, want.__name__)
        bad = UsageError(f"{where}: option '{self.name}' must be {what}, got {value!r}")
        try:
            if want is bool:
                if isinstance(value, bool):
                    out = value
                elif str(value).strip().lower() in ("1", "true", "yes", "on"):
                    out = True
                elif str(value).strip().lower() in ("0", "false", "no", "off"):
                    out = False
                else:
                    raise bad
            elif want is int:
                if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                    raise bad
                out = int(str(value).strip()) if isinstance(value, str) else int(value)
            elif want is float:
                if isinstance(value, bool):
                    raise bad
                out = float(value)
            elif want is Path:
                if not isinstance(value, (str, Path)) or not str(value):
                    raise bad
                out = str(Path(value).expanduser())
            else:
                if not isinstance(value, (str, int, float)) or isinstance(value, bool):
                    raise bad
                out = str(value)
        except (TypeError, ValueError):
            raise bad from None
        if self.choices is not None:
            folded = {str(c).lower(): c for c in self.choices}
            key = str(out).lower()
            if key not in folded:
                raise bad
            out = folded[key]
        if self.minimum is not None and isinstance(out, (int, float)) and out < self.minimum:
            raise UsageError(f"{where}: option '{self.name}' must be at least {self.minimum:g}, got {out!r}")
        return out


# The options the core itself reads, valid on every backend.
CORE_OPTIONS = (
    Option(CORE, "compiler", str, help="plugin that compiles this stage's binaries (default: the stage's backend)",
           flag="--compiler"),
    Option(CORE, "context_length", int, stages=("decoder",), minimum=2, flag="--context-length",
           help="decoder context length: prompt plus generated tokens (default: the backend's or the model's)"),
)


@attrs.frozen(eq=False)
class StageOptions(Mapping[str, object]):
    """One stage's options as every hook reads them: read-only, each declared option present.

    As a mapping: every option the stage's backend, its compiler and the core declare, with the value the layout
    gave (converted by `OptionTable.check`) or else its declared default (``None`` for an option declared without
    one), plus any given key the declarations do not name (a plugin's own, through ``ctx.compiled``'s caller).
    ``given`` is what the layout set: what keys artifacts, what layouts and manifests print, and what a plugin
    asks when it must know whether the user chose a value (``"block_size" in options.given``).

    Compare it with a dict as a dict (``==``); copy it with ``dict(options)`` to change it.
    """

    _values: dict = attrs.field(converter=dict)
    _given: dict = attrs.field(converter=dict)

    @property
    def given(self) -> Mapping[str, object]:
        """The options the layout set (a read-only view)."""
        return types.MappingProxyType(self._given)

    def __getitem__(self, name: str) -> object:
        return self._values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"StageOptions({self._values!r}, given={self._given!r})"


@attrs.define
class OptionTable:
    """Every declared option, by backend."""

    by_backend: dict[str, dict[str, Option]] = attrs.field(factory=dict)

    @classmethod
    def of(cls, options: Iterable[Option]) -> "OptionTable":
        table = cls()
        for o in (*CORE_OPTIONS, *options):
            table.by_backend.setdefault(o.backend, {})[o.name] = o
        return table

    def for_stage(self, backend: str, stage: str, compiler: str | None = None) -> dict[str, Option]:
        """The options a stage on ``backend`` (compiled by ``compiler``) takes: core, backend, then compiler."""
        out = {n: o for n, o in self.by_backend.get(CORE, {}).items() if o.applies_to(stage)}
        for owner in (compiler, backend):
            if owner and owner != CORE:
                out.update({n: o for n, o in self.by_backend.get(owner, {}).items() if o.applies_to(stage)})
        return out

    def flags(self) -> dict[str, list[Option]]:
        """Command-line flag -> the options declaring it (one flag may be declared by several backends)."""
        out: dict[str, list[Option]] = {}
        for opts in self.by_backend.values():
            for o in opts.values():
                if o.flag:
                    out.setdefault(o.flag, []).append(o)
        return out

    def check(self, stage: str, backend: str, options: Mapping[str, object]) -> dict[str, object]:
        """``options`` of one stage converted to their declared types; UsageError for an unknown or bad one."""
        compiler = options.get("compiler")
        known = self.for_stage(backend, stage, str(compiler) if compiler else None)
        owners = f"{backend}" + (f" compiled by {compiler}" if compiler and compiler != backend else "")
        out = {}
        for key, value in options.items():
            where = f"stage '{stage}' ({owners})"
            if key not in known:
                raise UsageError(f"{where} has no option '{key}'{self._hint(key, known, stage)}")
            out[key] = known[key].convert(value, where)
        return out

    def fill(self, stage: str, backend: str, options: Mapping[str, object] | None) -> StageOptions:
        """``options`` of one stage (as `check` returns them) with every declared option of ``backend`` (and its
        ``compiler``, and the core) filled in at its declared default when not given: what every hook reads.
        A `StageOptions` already is filled, and comes back as it is."""
        if isinstance(options, StageOptions):
            return options
        given = dict(options or {})
        compiler = given.get("compiler")
        declared = self.for_stage(backend, stage, str(compiler) if compiler else None)
        return StageOptions({**{name: o.default for name, o in declared.items()}, **given}, given)

    def _hint(self, key: str, known: Mapping[str, Option], stage: str) -> str:
        close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
        if close:
            return f"; did you mean '{close[0]}'?"
        elsewhere = sorted({s for opts in self.by_backend.values() for o in opts.values() if o.name == key
                            for s in (o.stages or STAGES) if s != stage})
        if elsewhere:
            return f" (it applies to: {', '.join(elsewhere)}); known here: {', '.join(sorted(known)) or 'none'}"
        return f"; known here: {', '.join(sorted(known)) or 'none'}"


def parse_assignment(spec: str) -> tuple[str, str, str]:
    """``STAGE.KEY=VALUE`` (from ``--option``) as (stage, key, value); UsageError when malformed."""
    lhs, sep, value = spec.partition("=")
    stage, dot, key = lhs.strip().partition(".")
    if not sep or not dot or not key:
        raise UsageError(f"--option '{spec}' is not STAGE.KEY=VALUE (e.g. vision.precision=int8)")
    if stage not in STAGES:
        close = difflib.get_close_matches(stage, STAGES, n=1)
        raise UsageError(f"--option '{spec}' names unknown stage '{stage}'; stages are {', '.join(STAGES)}"
                         + (f" (did you mean '{close[0]}'?)" if close else ""))
    return stage, key.strip(), value.strip()
