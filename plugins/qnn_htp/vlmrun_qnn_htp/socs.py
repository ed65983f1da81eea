"""Known Snapdragon SoCs: the QNN ``soc_model`` number and HTP architecture of each."""

from __future__ import annotations

import attrs

from vlmrun.errors import UsageError


@attrs.frozen
class Soc:
    name: str  # e.g. "SM8750"
    soc_model: int  # QNN HTP soc_model
    arch: str  # HTP architecture, e.g. "v79"
    marketing: str = ""

    @property
    def arch_number(self) -> str:
        return self.arch.lstrip("v")


SOCS: dict[str, Soc] = {
    s.name: s
    for s in (
        Soc("SM8750", 69, "v79", "Snapdragon 8 Elite"),
        Soc("SM8650", 57, "v75", "Snapdragon 8 Gen 3"),
        Soc("SM8550", 43, "v73", "Snapdragon 8 Gen 2"),
        Soc("SM8475", 42, "v69", "Snapdragon 8+ Gen 1"),
        Soc("SM8450", 36, "v69", "Snapdragon 8 Gen 1"),
        Soc("SC8380XP", 60, "v73", "Snapdragon X Elite"),
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
