"""Loading plugins: entry points of group ``vlmrun``, built-ins loaded the same way.

``VLMRUN_PLUGINS`` (comma-separated names) restricts which entry points are loaded; unset means all.
A plugin that raises on import, implements a hook that does not exist (a misspelt name: pluggy's
``check_pending``) or fails to describe itself or its options is recorded in `Registry.failures` with one
line and skipped, never fatal; ``vlmrun plugins`` shows it.

`Registry.hook` calls the hooks. The hooks that take one stage's ``options`` argument (`STAGE_OPTION_HOOKS`) get
them filled and frozen there (`Registry.stage_options`), whoever calls them; ``load_stage`` and ``load_probe`` get
them the same way in ``ctx.options`` (`vlmrun.pipeline.StageContext`).
"""

from __future__ import annotations

import importlib.metadata
import difflib
import os
from types import MappingProxyType
from typing import Iterable, Mapping

import attrs
import pluggy

from . import hookspecs
from .errors import UsageError
from .options import Option, OptionTable, StageOptions
from .stages import STAGES

ENTRY_POINT_GROUP = "vlmrun"
ENV_PLUGINS = "VLMRUN_PLUGINS"
#: the hooks with ``backend``, ``stage`` and ``options`` arguments: `Registry.hook` fills their options
STAGE_OPTION_HOOKS = frozenset({"preflight", "layer_precisions"})


@attrs.frozen
class BackendInfo:
    """What a plugin says about one backend it provides (returned by the ``describe`` hook)."""

    name: str
    stages: tuple[str, ...]
    summary: str = ""
    precision: str = "fp32"  # the numeric precision its stages run at unless a layout option says otherwise
    # several generations may run at once on its loaded stages (thread-safe handles, no single device to share);
    # ``vlmrun serve`` runs one request at a time on a layout with any backend that does not say so
    concurrent: bool = False


@attrs.frozen
class Preset:
    """A named layout a plugin declares (``register_presets``): the backend of every stage."""

    name: str
    stages: Mapping[str, str] = attrs.field(converter=lambda m: MappingProxyType(dict(m)))
    summary: str = ""
    reference: bool = False  # the layout others are diffed and scored against (the core's ``reference``)
    #: the stage options ``vlmrun tune`` starts from on this preset when no layout is given (``{"decoder":
    #: {"precision": ...}}``: each quantized stage at its cheapest precision); one plugin declares them
    tune: Mapping[str, Mapping[str, object]] | None = attrs.field(
        default=None, converter=lambda m: None if m is None else MappingProxyType(
            {s: MappingProxyType(dict(o)) for s, o in dict(m).items()}))

    @property
    def tune_spec(self) -> str | None:
        """The layout ``vlmrun tune`` starts from, written as every command takes one (``NAME,STAGE.KEY=V,...``);
        ``None`` when the preset declares no tune start."""
        if self.tune is None:
            return None
        return ",".join([self.name, *(f"{s}.{k}={v}" for s, o in self.tune.items() for k, v in o.items())])

    def __attrs_post_init__(self):
        if set(self.stages) != set(STAGES):
            raise RuntimeError(f"preset '{self.name}' must name a backend for each of {', '.join(STAGES)};"
                               f" it names {', '.join(self.stages) or 'none'}")
        unknown = sorted(set(self.tune or {}) - set(STAGES))
        if unknown:
            raise RuntimeError(f"preset '{self.name}' sets options of unknown stage(s) {', '.join(unknown)}")


@attrs.frozen
class Precision:
    """A precision a backend builds at (``register_precisions``), with the default thresholds a diff judges a
    device at that precision by: the SQNR (dB) and cosine floors of every tensor checkpoint, the decoder's top-1
    agreement, top-5 overlap and mean KL ceiling under teacher forcing, and ``generation``: the share of the
    reference's free-running tokens the device must match (``None``: reported, not checked). ``like``: judged as
    another declared precision (an alias, e.g. two spellings of one recipe). A layout is judged by the most lenient
    precision among its stages: the lowest SQNR floor, then the lowest cosine floor."""

    name: str
    sqnr_db: float | None = None
    cosine: float | None = None
    top1: float | None = None
    top5: float | None = None
    kl: float | None = None
    generation: float | None = None
    like: str | None = None
    summary: str = ""

    def __attrs_post_init__(self):
        floors = {"sqnr_db": self.sqnr_db, "cosine": self.cosine, "top1": self.top1, "top5": self.top5, "kl": self.kl}
        if self.like is not None:
            given = [k for k, v in floors.items() if v is not None]
            if given:
                raise RuntimeError(f"precision '{self.name}' is judged like '{self.like}' and cannot set"
                                   f" {', '.join(given)}")
            return
        missing = [k for k, v in floors.items() if v is None]
        if missing:  # a check without floors would pass any device: every threshold is declared
            raise RuntimeError(f"precision '{self.name}' declares no {', '.join(missing)}: every threshold must be"
                               " given (or like=another declared precision)")

    @property
    def leniency(self) -> tuple[float, float]:
        """Sorts the strictest first (highest floors)."""
        return (-(self.sqnr_db or 0.0), -(self.cosine or 0.0))


@attrs.frozen
class Check:
    """One line of ``vlmrun doctor``."""

    name: str
    ok: bool
    detail: str = ""


@attrs.frozen
class PluginRecord:
    name: str
    version: str
    module: str
    backends: tuple[BackendInfo, ...]
    hooks: tuple[str, ...]


def mine(backend: str, name: str) -> bool:
    """True when a hook call for ``backend`` is meant for the plugin providing ``name``."""
    return backend == name


@attrs.define
class Registry:
    """The loaded plugins: a pluggy manager plus what each plugin said about itself."""

    pm: pluggy.PluginManager
    plugins: dict[str, PluginRecord] = attrs.field(factory=dict)
    failures: dict[str, str] = attrs.field(factory=dict)
    declared: list[Option] = attrs.field(factory=list)
    presets: dict[str, Preset] = attrs.field(factory=dict)
    precisions: dict[str, Precision] = attrs.field(factory=dict)

    @property
    def options(self) -> OptionTable:
        """Every declared per-stage option (the core's and each backend's)."""
        return OptionTable.of(self.declared)

    @property
    def hook(self) -> "HookRelay":
        """The hooks, called by name (``registry.hook.load_stage(backend=..., stage=..., ctx=...)``)."""
        return HookRelay(self)

    def stage_options(self, backend: str, stage: str, options) -> StageOptions:
        """``options`` of ``stage`` on ``backend`` as its hooks read them: every declared default filled in,
        read-only (`vlmrun.options.OptionTable.fill`)."""
        return self.options.fill(stage, backend, options)

    def backends(self) -> dict[str, BackendInfo]:
        return {b.name: b for p in self.plugins.values() for b in p.backends}

    def backend(self, name: str) -> BackendInfo:
        """The backend called ``name``, or a UsageError that lists what is installed."""
        backends = self.backends()
        if name in backends:
            return backends[name]
        if name in self.failures:
            raise UsageError(f"plugin '{name}' is installed but failed to load: {self.failures[name]}")
        raise UsageError(f"unknown backend plugin '{name}'; installed: {self.describe_installed()}")

    def require_stage(self, name: str, stage: str) -> None:
        info = self.backend(name)
        if stage not in info.stages:
            raise UsageError(
                f"backend '{name}' does not support stage '{stage}' (it supports: {', '.join(info.stages)});"
                f" installed: {self.describe_installed()}"
            )

    def describe_installed(self) -> str:
        backends = self.backends()
        if not backends:
            return f"none (install a plugin such as vlmrun-ort-reference, or check {ENV_PLUGINS})"
        # by name: the order entry points are found in follows how the packages were installed
        return "; ".join(f"{b.name} ({', '.join(b.stages)})" for b in sorted(backends.values(), key=lambda b: b.name))


class HookRelay:
    """`Registry.hook`: pluggy's hook relay, except that the hooks in `STAGE_OPTION_HOOKS` get their ``options``
    filled and frozen (`Registry.stage_options`) for the ``backend`` and ``stage`` they are called with."""

    def __init__(self, registry: Registry):
        self._registry = registry

    def __getattr__(self, name: str):
        caller = getattr(self._registry.pm.hook, name)
        return FilledOptionsCaller(caller, self._registry) if name in STAGE_OPTION_HOOKS else caller


class FilledOptionsCaller:
    """A pluggy hook caller whose ``options`` argument reaches the plugins filled; anything else is the caller's."""

    def __init__(self, caller, registry: Registry):
        self._caller = caller
        self._registry = registry

    def __call__(self, **kwargs):
        options = self._registry.stage_options(kwargs["backend"], kwargs["stage"], kwargs.get("options"))
        return self._caller(**{**kwargs, "options": options})

    def __getattr__(self, name: str):
        return getattr(self._caller, name)


def _allowed(env: str | None) -> set[str] | None:
    if env is None:
        return None
    return {n.strip() for n in env.split(",") if n.strip()}


def _version_of(ep: importlib.metadata.EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return dist.version if dist is not None else "?"


def load(extra: Iterable[object] = (), only: str | None = None) -> Registry:
    """Build a registry from installed entry points (plus ``extra`` plugin objects, for embedding).

    :param only: comma-separated plugin names to load; defaults to ``$VLMRUN_PLUGINS`` (all when unset).
    """
    pm = pluggy.PluginManager("vlmrun")
    pm.add_hookspecs(hookspecs)
    registry = Registry(pm)
    allowed = _allowed(only if only is not None else os.environ.get(ENV_PLUGINS))
    seen: set[str] = set()
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        if ep.name in seen or (allowed is not None and ep.name not in allowed):
            continue
        seen.add(ep.name)
        try:
            module = ep.load()
            _register(registry, module, ep.name, _version_of(ep))
        except Exception as exc:  # a broken plugin must not break the others
            registry.failures[ep.name] = _one_line(exc)
    for plugin in extra:
        name = getattr(plugin, "__name__", type(plugin).__name__)
        try:
            _register(registry, plugin, name, "?")
        except Exception as exc:
            registry.failures[name] = _one_line(exc)
    return registry


def _one_line(exc: BaseException) -> str:
    if isinstance(exc, pluggy.PluginValidationError):  # its detail (which arguments) is on later lines
        return "; ".join(ln.strip() for ln in str(exc).splitlines() if ln.strip())
    return f"{type(exc).__name__}: {exc}".splitlines()[0]


def _unknown_hooks(pm: pluggy.PluginManager, plugin: object) -> list[str]:
    return sorted(c.name for c in pm.get_hookcallers(plugin) or [] if not c.has_spec())


def _register(registry: Registry, plugin: object, name: str, version: str) -> None:
    pm = registry.pm
    pm.register(plugin, name=name)
    try:
        unknown = _unknown_hooks(pm, plugin)
        if unknown:
            specs = [n for n in dir(hookspecs) if getattr(getattr(hookspecs, n), "vlmrun_spec", None) is not None]
            close = difflib.get_close_matches(unknown[0], specs, n=1)
            raise RuntimeError(f"implements unknown hook '{unknown[0]}'"
                               + (f" (did you mean '{close[0]}'?)" if close else f"; hooks are {', '.join(specs)}"))
        pm.check_pending()
        impl = getattr(plugin, "describe", None)
        try:
            result = impl() if impl is not None else None
        except Exception as exc:
            raise RuntimeError(f"describe() failed: {exc}") from exc
        infos = tuple(result if isinstance(result, (list, tuple)) else ([result] if result else []))
        declared: list[Option] = []
        opts_impl = getattr(plugin, "register_options", None)
        if opts_impl is not None:
            try:
                opts_impl(declared.append)
            except Exception as exc:
                raise RuntimeError(f"register_options() failed: {exc}") from exc
        mine_ = {b.name for b in infos}
        for o in declared:
            if not isinstance(o, Option) or o.backend not in mine_:
                raise RuntimeError(f"register_options() declared {o!r}, not an Option of its own backends"
                                   f" ({', '.join(sorted(mine_)) or 'none'})")
        presets = _declared_presets(plugin, registry)
        precisions = _declared_precisions(plugin, registry)
    except BaseException:
        pm.unregister(plugin)
        raise
    registry.presets.update({p.name: p for p in presets})
    registry.precisions.update({p.name: p for p in precisions})
    stages_of = {b.name: b.stages for b in infos}
    registry.declared.extend(o if o.stages is not None else attrs.evolve(o, stages=stages_of[o.backend])
                             for o in declared)
    hooks = tuple(sorted(h.name for h in pm.get_hookcallers(plugin) or []))
    registry.plugins[name] = PluginRecord(name, version, getattr(plugin, "__name__", name), infos, hooks)


def _registered(plugin: object, hook: str, cls: type) -> list:
    """What ``plugin``'s registration hook ``hook`` hands its ``register`` (each a ``cls``); [] without the hook."""
    impl = getattr(plugin, hook, None)
    found: list = []
    if impl is None:
        return found
    try:
        impl(found.append)
    except Exception as exc:
        raise RuntimeError(f"{hook}() failed: {exc}") from exc
    for x in found:
        if not isinstance(x, cls):
            raise RuntimeError(f"{hook}() declared {x!r}, not a vlmrun.plugins.{cls.__name__}")
    return found


def _declared_presets(plugin: object, registry: Registry) -> list[Preset]:
    """The presets ``plugin`` declares (``register_presets``); a name another plugin took is an error."""
    presets = _registered(plugin, "register_presets", Preset)
    for p in presets:
        if p.name in registry.presets:
            raise RuntimeError(f"preset '{p.name}' is already declared by another plugin")
    return presets


def _declared_precisions(plugin: object, registry: Registry) -> list[Precision]:
    """The precisions ``plugin`` declares (``register_precisions``). Plugins sharing a vocabulary may declare the
    same precision; declaring a name another plugin gave other thresholds is an error, and so is an alias
    (``like``) to a precision nobody declared."""
    declared = _registered(plugin, "register_precisions", Precision)
    known = {**registry.precisions}
    for p in declared:
        if p.name in known and known[p.name] != p:
            raise RuntimeError(f"precision '{p.name}' is already declared by another plugin with other thresholds")
        known[p.name] = p
    for p in declared:
        if p.like is not None and (p.like not in known or known[p.like].like is not None):
            raise RuntimeError(f"precision '{p.name}' is judged like '{p.like}', which no plugin declares as a"
                               " precision of its own")
    return declared


_default: Registry | None = None


def default() -> Registry:
    """The installed plugins, loaded once per process (the commands' registry: their declared options become
    flags, their presets the layouts ``--layout`` names)."""
    global _default
    if _default is None:
        _default = load()
    return _default
