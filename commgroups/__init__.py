"""commgroups: a communicator-management layer for PyTorch distributed training.

One :class:`GroupRegistry` owns every process group a job uses: a dedicated group per role (fsdp, cp,
checkpoint-metadata, ...), never the default group, each with its own backend, options and timeout.

    import commgroups as cg
    layout = cg.load_layout("layout.toml")
    with cg.GroupRegistry(layout) as registry:
        cp_group = registry.group("cp")
"""

from commgroups import audit, errors, integrations
from commgroups.collectives.async_wait import AsyncWaitDist, async_and_wait_scope
from commgroups.collectives.role_collectives import RoleCollectives
from commgroups.layout.auto_layout import AutoLayout, resolve_layout
from commgroups.layout.layout_io import load_layout, parse_layout
from commgroups.layout.specs import (
    CHECKPOINT_ROLE,
    ElasticSpec,
    HcclOptions,
    Layout,
    NcclOptions,
    RoleOptions,
    RoleSpec,
    default_roles,
)
from commgroups.planning.plan import Plan, RolePlan, plan
from commgroups.rank_loss.rebuild_report import RebuildReport
from commgroups.rank_loss.replan import Replan, replan
from commgroups.registry import GroupRegistry

__all__ = [
    "CHECKPOINT_ROLE",
    "AsyncWaitDist",
    "AutoLayout",
    "ElasticSpec",
    "GroupRegistry",
    "HcclOptions",
    "Layout",
    "NcclOptions",
    "Plan",
    "RebuildReport",
    "RoleOptions",
    "RolePlan",
    "RoleCollectives",
    "Replan",
    "RoleSpec",
    "async_and_wait_scope",
    "audit",
    "default_roles",
    "errors",
    "integrations",
    "load_layout",
    "parse_layout",
    "plan",
    "replan",
    "resolve_layout",
]

__version__ = "0.1.0"
