"""What qnn_htp makes of one stage's options, read once where a hook gets them (`StagePlan.of`), then handed down.

A `StagePlan` holds what determines the stage's binaries (``opts``, `.options.stage_options`: precision, SoC,
form, engine, recipe, ...; what keys the artifacts) and where and how they run (`Runtime`: target, timeouts, the
phone's adb and SDK). The modules below the hooks (`.parts_run`, `.genie_phone`, `.probe`, `.bundle_run`,
`.bundle_phone`, ...) read the plan, never the raw options. Both are built from the filled options
(`.options.fill`): the core's `vlmrun.options.StageOptions` as the hooks get them, or a plain mapping filled from
qnn_htp's declarations, so no default is spelled here.
"""

from __future__ import annotations

import types
from typing import Mapping

import attrs

from vlmrun_qualcomm import socs
from vlmrun_qualcomm.runtime import DeviceRuntime

from . import recipe as recipe_mod
from .options import NAME, fill, stage_options


@attrs.frozen(kw_only=True)
class Runtime(DeviceRuntime):
    """Where and how a stage's binaries run (the options a bundle still takes, `.bundle_phone.RUNTIME_OPTIONS`): the
    shared `vlmrun_qualcomm.runtime.DeviceRuntime` fields (target, timeout, device, adb, sdk_root, ndk_root), and

    :ivar adb_timeout: seconds for one adb transfer or command.
    :ivar native_outputs: qnn-net-run's ``--use_native_output_files`` (phone).
    """

    adb_timeout: float
    native_outputs: bool = False

    @classmethod
    def of(cls, stage: str, options: Mapping[str, object] | None) -> "Runtime":
        """The runtime options of ``stage`` (filled, `.options.fill`, when they are not yet)."""
        o = fill(stage, options)
        return cls(target=str(o["target"]).lower(), timeout=float(o["timeout"]), adb_timeout=float(o["adb_timeout"]),
                   device=o["device"], adb=o["adb"], sdk_root=o["sdk_root"], ndk_root=o.get("ndk_root"),
                   native_outputs=bool(o["native_outputs"]))


def _frozen(opts: Mapping) -> Mapping:
    return types.MappingProxyType(dict(opts))


@attrs.frozen
class StagePlan:
    """One stage as qnn_htp compiles and runs it (see the module docstring).

    :ivar stage: the stage name.
    :ivar opts: the normalised options that determine the binaries (`.options.stage_options`, read-only): what
        `.options.compiled_artifact` keys and `.options.forms` exports.
    :ivar soc: the `vlmrun_qualcomm.socs.Soc` compiled for.
    :ivar compiler: the plugin that compiles the stage (``qnn_htp`` unless ``compiler`` names another).
    :ivar runtime: where and how the binaries run (`Runtime`).
    """

    stage: str
    opts: Mapping[str, object] = attrs.field(converter=_frozen)
    soc: socs.Soc
    compiler: str
    runtime: Runtime

    @classmethod
    def of(cls, stage: str, options: Mapping[str, object] | None) -> "StagePlan":
        """The plan of ``stage``'s options (the hooks' filled ones, or a plain mapping: `.options.fill`);
        UsageError for bad values."""
        o = fill(stage, options)
        opts = stage_options(stage, o)
        return cls(stage=stage, opts=opts, soc=socs.soc(opts["soc"]), compiler=str(o["compiler"] or NAME),
                   runtime=Runtime.of(stage, o))

    @property
    def precision(self) -> str:
        return str(self.opts["precision"])

    @property
    def form(self) -> str:
        """The decoder's form (``fixed`` or ``parts``); ``fixed`` for the other stages."""
        return str(self.opts["decoder_form"]) if self.stage == "decoder" else "fixed"

    @property
    def engine(self) -> str | None:
        """The decoder's engine (``host`` or ``genie``); None for the other stages."""
        return str(self.opts["engine"]) if self.stage == "decoder" else None

    @property
    def target(self) -> str:
        return self.runtime.target

    @property
    def toolchain(self) -> str:
        return str(self.opts["toolchain"])

    @property
    def recipe(self) -> recipe_mod.Recipe | None:
        """How the stage's graphs are quantized (None at fp16)."""
        return recipe_mod.from_key(self.opts)

    @property
    def compiled_here(self) -> bool:
        """qnn_htp compiles the stage itself (no ``--compiler`` naming another plugin)."""
        return self.compiler == NAME
