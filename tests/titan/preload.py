"""Imported by the forkserver torchtitan test ranks fork from (tests/titan/worlds.py): the CPU
patches applied and torchtitan imported once, before any rank exists, instead of in every rank of
every world. Each rank still calls :func:`~tests.titan.cpu.apply_cpu_patches` (a no-op then)."""

from __future__ import annotations

from tests.titan.cpu import apply_cpu_patches

apply_cpu_patches()

import torchtitan.models.llama3.config_registry  # noqa: E402
import torchtitan.models.qwen3.config_registry  # noqa: E402
import torchtitan.train  # noqa: E402
import torchtitan.trainer  # noqa: E402, F401
from torchtitan.config import ConfigManager  # noqa: E402, F401

import tests.titan.configs  # noqa: E402
import tests.titan.matrix  # noqa: E402
import tests.titan.scenario  # noqa: E402, F401
