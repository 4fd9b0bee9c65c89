"""Config functions as a user writes them (``--module tests.titan.configs --config ...``)."""

from __future__ import annotations

from typing import Any

from commgroups.integrations.torchtitan import with_registry


def llama3_registry() -> Any:
    """torchtitan's llama3 debug model through commgroups."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    return with_registry(llama3_debugmodel())


def moe_registry() -> Any:
    """torchtitan's MoE debug model through commgroups."""
    import importlib

    from tests.titan.run import STOCK_MODULES

    module, name = STOCK_MODULES["moe"]
    return with_registry(getattr(importlib.import_module(module), name)())
