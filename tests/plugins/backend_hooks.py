"""User backends that describe themselves through the metadata hooks of docs/backends.md (retrain.backend.capabilities)."""

from __future__ import annotations

from typing import Any, ClassVar

from retrain.backend.base import Capabilities
from retrain.backend.capabilities import OptionSpec

# module-level hooks: apply to every class here that declares none of its own
RETRAIN_BACKEND_OPTION_SCHEMA = {
    "transport": {"value_type": str, "default": "filesystem", "choices": ["filesystem", "zmq"]},
    "port": {"type": "int", "default": 5555, "validator": lambda port: 0 < port < 65536},
}


def retrain_backend_capabilities() -> dict[str, bool]:
    return {"preserves_token_advantages": True, "reports_sync_loss": True}


class ModuleHookedBackend:
    """Declares nothing on the class: the module's hooks describe it."""


class ClassHookedBackend:
    """Declares on the class, overriding the module."""

    retrain_backend_capabilities: ClassVar[Capabilities] = Capabilities(
        reports_sync_loss=False, preserves_token_advantages=False, resume_runtime_dependent=True
    )
    RETRAIN_BACKEND_OPTION_SCHEMA: ClassVar[dict[str, Any]] = {
        "depth": OptionSpec(name="depth", type="int", default=2, help="how deep")
    }


class WrongCapabilityKeyBackend:
    RETRAIN_BACKEND_CAPABILITIES: ClassVar[dict[str, bool]] = {"preserves_token_advantage": True}  # a typo
