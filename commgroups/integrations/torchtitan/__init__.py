"""torchtitan through commgroups: every mesh, FSDP2, spmd_types and DCP on a GroupRegistry.

::

    # my_configs.py
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from commgroups.integrations.torchtitan import with_registry

    def llama3_debug():
        return with_registry(llama3_debugmodel())      # or with_registry(cfg, layout="layout.toml")

then ``torchrun --nproc-per-node 4 -m torchtitan.train --module my_configs --config llama3_debug
--parallelism.context_parallel_degree 4 ...``. Needs ``pip install 'commgroups[torchtitan]'``;
``import commgroups`` never imports torchtitan, and :mod:`.layout` (the derived layout) needs none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from commgroups.integrations.torchtitan.layout import TitanDegrees, resolve_layout, titan_layout

if TYPE_CHECKING:
    from commgroups.integrations.torchtitan.trainer import RegistryTrainer

__all__ = ["RegistryTrainer", "TitanDegrees", "resolve_layout", "titan_layout", "with_registry"]


def with_registry(config: Any, *, layout: Any = None) -> Any:
    """See :func:`commgroups.integrations.torchtitan.trainer.with_registry` (imports torchtitan)."""
    from commgroups.integrations.torchtitan.trainer import with_registry as build

    return build(config, layout=layout)


def __getattr__(name: str) -> object:
    if name == "RegistryTrainer":
        from commgroups.integrations.torchtitan.trainer import RegistryTrainer

        return RegistryTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
