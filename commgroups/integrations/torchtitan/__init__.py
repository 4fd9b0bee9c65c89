"""torchtitan through commgroups: every mesh, FSDP2, spmd_types and DCP on a GroupRegistry.

::

    # my_configs.py
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from commgroups.integrations.torchtitan import with_registry

    def llama3_debug():
        return with_registry(llama3_debugmodel())      # or with_registry(cfg, layout="layout.toml")

then ``torchrun --nproc-per-node 4 -m torchtitan.train --module my_configs --config llama3_debug
--parallelism.context_parallel_degree 4 ...``. Every torchtitan name the integration uses goes
through :mod:`.titan_internals` (with the torchtitan versions it was checked on). Needs
``pip install 'commgroups[torchtitan]'``; ``import commgroups`` never imports torchtitan, and
:mod:`.layout` (the derived layout) needs none.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from commgroups.integrations.torchtitan.layout import (
    TitanDegrees,
    fit_titan_layout,
    resolve_layout,
    titan_layout,
)

if TYPE_CHECKING:
    from commgroups.integrations.torchtitan.trainer import RegistryTrainer

__all__ = ["RegistryTrainer", "TitanDegrees", "fit_titan_layout", "resolve_layout", "titan_layout",
           "with_registry"]


def with_registry(config: Any, *, layout: Any = None, audit: Any = None,
                  async_and_wait: bool = True) -> Any:
    """See :func:`commgroups.integrations.torchtitan.trainer.with_registry` (imports torchtitan).

    ``layout``: a Layout, dict or layout file (None: derived from the parallelism degrees);
    ``audit``: a directory, True (``<dump_folder>/commgroups-audit``) or None
    (``COMMGROUPS_AUDIT_DIR`` when set); ``async_and_wait=False`` turns it off for every role.
    """
    from commgroups.integrations.torchtitan.trainer import with_registry as build

    return build(config, layout=layout, audit=audit, async_and_wait=async_and_wait)


def __getattr__(name: str) -> object:
    if name == "RegistryTrainer":
        from commgroups.integrations.torchtitan.trainer import RegistryTrainer

        return RegistryTrainer
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
