"""Known Snapdragon SoCs: the one table the Qualcomm plugins share.

For each SoC: the QNN HTP ``soc_model`` number (what a context binary records), the HTP architecture (which
DSP skeleton library a phone needs), the marketing name, and the Qualcomm AI Hub reference device that has it.
"""

from __future__ import annotations

import attrs

from vlmrun.errors import UsageError


@attrs.frozen
class Soc:
    name: str  # e.g. "SM8750"
    soc_model: int  # QNN HTP soc_model
    arch: str  # HTP architecture, e.g. "v79"
    marketing: str = ""
    hub_device: str | None = None  # AI Hub device with this SoC (None: no hosted device known)

    @property
    def arch_number(self) -> str:
        return self.arch.lstrip("v")


SOCS: dict[str, Soc] = {
    s.name: s
    for s in (
        Soc("SM8750", 69, "v79", "Snapdragon 8 Elite", "Snapdragon 8 Elite QRD"),
        Soc("SM8650", 57, "v75", "Snapdragon 8 Gen 3", "Snapdragon 8 Gen 3 QRD"),
        Soc("SM8550", 43, "v73", "Snapdragon 8 Gen 2", "Samsung Galaxy S23 (Family)"),
        Soc("SM8475", 42, "v69", "Snapdragon 8+ Gen 1"),
        Soc("SM8450", 36, "v69", "Snapdragon 8 Gen 1"),
        Soc("SC8380XP", 60, "v73", "Snapdragon X Elite", "Snapdragon X Elite CRD"),
    )
}
DEFAULT_SOC = "SM8750"


def soc(name: str | None) -> Soc:
    """Look up ``name`` (case-insensitive; default SM8750) or raise a UsageError listing the known SoCs."""
    key = (name or DEFAULT_SOC).strip().upper()
    if key not in SOCS:
        known = ", ".join(f"{s.name} ({s.arch})" for s in SOCS.values())
        raise UsageError(f"unknown SoC '{name}'; known: {known}")
    return SOCS[key]


def by_soc_model(number: int | None) -> Soc | None:
    """The SoC whose QNN ``soc_model`` is ``number`` (as a context binary records it), if known."""
    return next((s for s in SOCS.values() if s.soc_model == number), None)
