"""``vlmrun doctor`` for qaihub: the ``qai-hub`` client, its configuration, and whether the hub answers and
accepts the token (one quick request)."""

from __future__ import annotations

import os

from vlmrun.errors import VlmrunError
from vlmrun.plugins import Check
from vlmrun_qualcomm import socs

from . import hub as hubmod
from .errors import HubAuthError, HubUnreachable

DOCTOR_NETWORK_TIMEOUT_S = 5.0


def hub_checks() -> list[Check]:
    """The client, its configuration, and whether the hub answers and accepts the token (one quick request)."""
    checks = []
    try:
        import qai_hub

        checks.append(Check("qai-hub client", True, str(getattr(qai_hub, "__version__", "?"))))
    except Exception as exc:
        return [Check("qai-hub client", False, f"not importable: {hubmod.one_line(exc)}")]
    path = hubmod.config_path()
    if not path.is_file():
        checks.append(Check("AI Hub configuration", False,
                            f"{path} not found (qai-hub configure --api_token ..., or QAIHUB_CLIENT_INI)"))
        return checks
    hub = hubmod.Hub(network_timeout=DOCTOR_NETWORK_TIMEOUT_S, out=open(os.devnull, "w"))
    try:
        try:
            api_url = hub.api_url
        except VlmrunError as exc:
            checks.append(Check("AI Hub configuration", False, str(exc)))
            return checks
        checks.append(Check("AI Hub configuration", True, f"{path}: api_url {api_url}, token set"))
        try:
            devices = hub.devices()
        except HubAuthError:
            checks.append(Check("AI Hub token", False, f"rejected by {api_url} (HTTP 401): check api_token in {path}"))
        except HubUnreachable as exc:
            checks.append(Check("AI Hub connection", False, str(exc)))
        except VlmrunError as exc:
            checks.append(Check("AI Hub connection", False, str(exc)))
        else:
            names = {d.name for d in devices}
            default = socs.soc(None).hub_device
            checks.append(Check("AI Hub connection", True,
                                f"{api_url} answered, token accepted, {len(names)} devices"
                                f" (default {default!r} {'listed' if default in names else 'NOT listed'})"))
    finally:
        hub.out.close()
    return checks
