"""Config functions as a user writes them (``--module tests.titan.configs --config ...``)."""

from __future__ import annotations

import dataclasses
from typing import Any

from commgroups.integrations.torchtitan import with_registry


def llama3_registry() -> Any:
    """torchtitan's llama3 debug model through commgroups."""
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    return with_registry(llama3_debugmodel())


MOE_LAYERS = 2
"""Layers of the MoE debug model the tests train (torchtitan's has 8)."""


def qwen3_moe_small() -> Any:
    """torchtitan's MoE debug model (qwen3: 64 experts, top 8) with its first ``MOE_LAYERS``
    layers: the same blocks and expert parallelism, a quarter of the ~300M parameters, which on
    CPU cost minutes per training and gigabytes per rank. The stock side of the MoE tests trains
    this config as a user's own config function; the commgroups side wraps it."""
    from torchtitan.models.qwen3.config_registry import qwen3_moe_debug

    config = qwen3_moe_debug()
    model = config.model_spec.model
    model = dataclasses.replace(model, layers=list(model.layers[:MOE_LAYERS]))
    config.model_spec = dataclasses.replace(config.model_spec, model=model)
    return config


def moe_registry() -> Any:
    """The MoE model of :func:`qwen3_moe_small` through commgroups."""
    import importlib

    from tests.titan.run import STOCK_MODULES

    module, name = STOCK_MODULES["moe"]
    return with_registry(getattr(importlib.import_module(module), name)())
