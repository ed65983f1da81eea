"""Hub devices: a device name or ``key:value`` attributes found among the hub's devices, the SoC vlmrun knows it
by, and the checks that a binary compiled on it is for the SoC asked for (before any upload, and once the hub
says what it built)."""

from __future__ import annotations

import difflib
import re

import attrs

from vlmrun.errors import BackendError, UsageError
from vlmrun_qualcomm import socs

from . import hub as hubmod
from .options import NAME


@attrs.frozen
class HubDevice:
    """A device as the hub describes it, with the SoC vlmrun knows it by (None: not in the SoC table)."""

    spec: str  # what was asked for (a name or attributes)
    name: str  # the (first) matching device
    chipset: str | None
    arch: str | None  # HTP architecture from the hexagon attribute, e.g. "v79"
    soc: socs.Soc | None


def _attributes(spec: str) -> list[str] | None:
    """``chipset:...,os:android`` -> attribute list; a device name -> None."""
    if re.match(r"^[a-z_]+:", spec):
        return [a.strip() for a in spec.split(",") if a.strip()]
    return None


def make_device(spec: str):
    """The client's ``Device`` for ``spec`` (a name, or ``key:value`` attributes)."""
    import qai_hub

    attrs_ = _attributes(spec)
    return qai_hub.Device(attributes=attrs_) if attrs_ else qai_hub.Device(spec)


def _attr(device, key: str) -> str | None:
    return next((a.split(":", 1)[1] for a in device.attributes if a.startswith(key + ":")), None)


def resolve_device(hub: hubmod.Hub, spec: str) -> HubDevice:
    """Find ``spec`` among the hub's devices and tell its SoC; a UsageError (one line) when the hub has none."""
    devices = hub.devices()
    wanted = _attributes(spec)
    if wanted:
        found = [d for d in devices if all(a in d.attributes for a in wanted)]
    else:
        found = [d for d in devices if d.name == spec]
    if not found:
        names = sorted({d.name for d in devices})
        close = difflib.get_close_matches(spec, names, n=3, cutoff=0.5)
        hint = (f"did you mean {' or '.join(repr(c) for c in close)}?" if close
                else f"it offers {len(names)} devices, e.g. {', '.join(repr(n) for n in names[:3])}")
        raise UsageError(f"Qualcomm AI Hub ({hub.api_url}) has no device {spec!r}; {hint}"
                         " (`qai-hub list-devices` lists them)")
    d = found[0]
    chipset, hexagon = _attr(d, "chipset"), _attr(d, "hexagon")
    arch = f"v{hexagon.lstrip('vV')}" if hexagon else None
    soc = None
    by_name = {x.name: x for x in devices}
    for s in socs.SOCS.values():  # the SoC whose reference device has the same chipset
        ref = by_name.get(s.hub_device or "")
        if chipset and ref is not None and _attr(ref, "chipset") == chipset:
            soc = s
            break
    if soc is None and arch:  # else the only SoC with that HTP architecture
        same = [s for s in socs.SOCS.values() if s.arch == arch]
        soc = same[0] if len(same) == 1 else None
    return HubDevice(spec, d.name, chipset, arch, soc)


def check_device_soc(dev: HubDevice, want: socs.Soc | None) -> None:
    """A UsageError when ``dev`` cannot run a binary for ``want`` (checked before anything is uploaded)."""
    if want is None:
        return
    if dev.soc is not None and dev.soc.name != want.name:
        ref = f' (e.g. "{want.hub_device}")' if want.hub_device else ""
        raise UsageError(f"AI Hub device {dev.spec!r} has a {dev.soc.marketing} ({dev.soc.name}, {dev.soc.arch}) but"
                         f" the binary is for {want.name} ({want.marketing}); add --soc {dev.soc.name}, or choose a"
                         f" {want.name} device{ref}")
    if dev.soc is None and dev.arch and dev.arch != want.arch:
        raise UsageError(f"AI Hub device {dev.spec!r} (chipset {dev.chipset or '?'}) has an HTP {dev.arch} but the"
                         f" binary is for {want.name} ({want.arch}); choose a device with that SoC or change --soc")


def built_for(dev: HubDevice, want: socs.Soc | None, soc_model, what: str) -> tuple[socs.Soc | None, int | None]:
    """(the SoC, its soc_model number) that the hub's binary metadata (``soc_model``) says ``what`` was built for;
    BackendError when that is not ``want``, the SoC asked for."""
    soc_model_n = int(soc_model) if soc_model and str(soc_model).isdigit() else None
    got = socs.by_soc_model(soc_model_n) or dev.soc
    if want is not None and got is not None and got.name != want.name:
        raise BackendError(f"AI Hub device {dev.name!r} built {what} for {got.name}/{got.arch} but {want.name} was"
                           f" asked for; choose a device with that SoC (--device) or --soc {got.name}")
    return want or got, soc_model_n


def expected_soc(options: dict, target: str) -> socs.Soc | None:
    """The SoC the binary must be for: qnn_htp's ``soc`` (default SM8750); for hosted runs the device's own
    unless ``soc`` was given."""
    if target == NAME and not options.get("soc"):
        return None
    return socs.soc(options.get("soc"))
