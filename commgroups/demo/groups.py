"""The communicators one demo run trains on: the registry's roles, or plain DeviceMesh groups.

Both modes expose the same :class:`JobGroups`, so the training loop is identical and the only
difference the audit can see is which communicators the work lands on.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from commgroups import torch_internals
from commgroups.errors import LayoutError
from commgroups.layout.auto_layout import AutoLayout, resolve_layout
from commgroups.layout.layout_io import load_layout
from commgroups.layout.specs import CHECKPOINT_ROLE, Layout
from commgroups.registry import GroupRegistry

from .config import DemoConfig, seed_layout

__all__ = ["JobGroups", "build_groups", "demo_layout", "is_default_group"]


def is_default_group(group: dist.ProcessGroup | None) -> bool:
    """True when ``group`` is the default (world) group; None means the default group, as in DCP."""
    if group is None:
        return True
    default = torch_internals.default_group()
    return group is default or group.group_name == default.group_name


def demo_layout(cfg: DemoConfig) -> Layout:
    """The layout the demo runs on: ``cfg.layout_path`` or the seed's for ``cfg.world_size``."""
    loaded = load_layout(cfg.layout_path) if cfg.layout_path else seed_layout(cfg.world_size)
    # An auto layout (restart mode) takes its "auto" size from the run's world size.
    layout = resolve_layout(loaded, cfg.world_size) if isinstance(loaded, AutoLayout) else loaded
    if "fsdp" not in layout.role_names:
        raise LayoutError(
            f"the demo needs an 'fsdp' role; the layout has {', '.join(layout.role_names)}; fix: add "
            '[[roles]] name = "fsdp", dims = [<the data-parallel and cp dims>]',
            field="roles",
        )
    fsdp = layout.role("fsdp")
    spans = fsdp.dims == "world" or (
        isinstance(fsdp.dims, list)
        and all(layout.dims[d] == 1 for d in layout.dims if d not in fsdp.dims)
    )
    if not spans:
        raise LayoutError(
            "the demo shards the model over the whole world (no HSDP, TP or PP), but role 'fsdp' "
            f"spans {fsdp.dims}; fix: give the other dims size 1 or list them in the fsdp role",
            field="roles",
        )
    return layout


@dataclass
class JobGroups:
    """The groups and meshes a run uses, and how to checkpoint through them."""

    mode: str
    fsdp_mesh: DeviceMesh
    fsdp_group: dist.ProcessGroup
    cp_group: dist.ProcessGroup | None
    spmd_scope: Callable[[], contextlib.AbstractContextManager[Any]]
    save: Callable[[dict[str, Any], str], Any]
    load: Callable[[dict[str, Any], str], None]
    roles: dict[str, dict[str, Any]] = field(default_factory=dict)
    role_groups: dict[str, dist.ProcessGroup] = field(default_factory=dict)
    """Role -> the group doing that role's work (for the audit's role names)."""
    exchange_group: dist.ProcessGroup | None = None
    """Where the demo gathers the audit records (a CPU group; None: the default group)."""
    registry: GroupRegistry | None = None
    close: Callable[[], None] = lambda: None

    @property
    def cp_ranks(self) -> list[int]:
        """Global ranks sharing this rank's sequence (just this rank without cp)."""
        if self.cp_group is None:
            return [dist.get_rank()]
        return dist.get_process_group_ranks(self.cp_group)


def _role_info(group: dist.ProcessGroup | None, backend: str, source: str) -> dict[str, Any]:
    ranks = (list(range(dist.get_world_size())) if group is None
             else dist.get_process_group_ranks(group))
    return {"ranks": ranks, "size": len(ranks), "backend": backend,
            "is_default_group": is_default_group(group), "source": source}


def _registry_groups(layout: Layout) -> JobGroups:
    from commgroups.integrations import dcp as cg_dcp
    from commgroups.integrations.fsdp import fsdp_mesh
    from commgroups.integrations.spmd import activate

    registry = GroupRegistry(layout).create()
    try:
        mesh = fsdp_mesh(registry)
        cp_group = None
        if "cp" in registry.role_names and len(registry.ranks("cp")) > 1:
            cp_group = registry.group("cp")
        if CHECKPOINT_ROLE not in registry.role_names:
            cg_dcp.checkpoint_group(registry)  # raises MissingRoleError naming the fix
    except BaseException:
        registry.close()
        raise

    def scope() -> contextlib.AbstractContextManager[Any]:
        if cp_group is None:
            return contextlib.nullcontext()
        return activate(registry, ["cp"])

    roles = {
        name: _role_info(registry.group(name), registry.resolved_backend(name), "GroupRegistry")
        for name in registry.role_names
    }
    return JobGroups(
        mode="registry",
        fsdp_mesh=mesh,
        fsdp_group=registry.group("fsdp"),
        cp_group=cp_group,
        spmd_scope=scope,
        save=lambda state, path: cg_dcp.save(state, checkpoint_id=path, registry=registry),
        load=lambda state, path: cg_dcp.load(state, checkpoint_id=path, registry=registry),
        roles=roles,
        role_groups={name: registry.group(name) for name in registry.role_names},
        exchange_group=registry.group(CHECKPOINT_ROLE),
        registry=registry,
        close=registry.close,
    )


def _devicemesh_groups(layout: Layout) -> JobGroups:
    """What a job without commgroups does (torchtitan's pattern): one init_device_mesh, flattened."""
    from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
    from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
    from torch.distributed.device_mesh import init_device_mesh

    names = tuple(layout.dims)
    mesh = init_device_mesh("cpu", tuple(layout.dims.values()), mesh_dim_names=names)
    fsdp_dims = layout.role("fsdp").dims
    dims = names if fsdp_dims == "world" else tuple(fsdp_dims or ())
    fsdp_mesh = mesh[dims[0]] if len(dims) == 1 else torch_internals.flatten_mesh(mesh[dims], "fsdp")
    cp_group = mesh.get_group("cp") if layout.dims.get("cp", 1) > 1 else None
    backend = str(dist.get_backend())

    @contextlib.contextmanager
    def scope() -> Iterator[None]:
        if cp_group is None:
            yield
            return
        spmd_types: Any = importlib.import_module("spmd_types")
        with spmd_types.set_current_mesh(mesh):  # spmd_types' own dist: blocking collectives
            yield

    roles = {"fsdp": _role_info(fsdp_mesh.get_group(), backend, "mesh._flatten()"
                                if len(dims) > 1 else f"mesh[{dims[0]!r}]")}
    if cp_group is not None:
        roles["cp"] = _role_info(cp_group, backend, "mesh['cp']")
    # torchtitan's synchronous save and loads pass no process_group: the default group.
    roles[CHECKPOINT_ROLE] = _role_info(None, backend, "dcp default (process_group=None)")
    role_groups = {"fsdp": fsdp_mesh.get_group(),
                   CHECKPOINT_ROLE: torch_internals.default_group()}
    if cp_group is not None:
        role_groups["cp"] = cp_group
    return JobGroups(
        mode="devicemesh",
        fsdp_mesh=fsdp_mesh,
        fsdp_group=fsdp_mesh.get_group(),
        cp_group=cp_group,
        spmd_scope=scope,
        save=lambda state, path: dcp_save(state, checkpoint_id=path),
        load=lambda state, path: dcp_load(state, checkpoint_id=path),
        roles=roles,
        role_groups=role_groups,
    )


def build_groups(cfg: DemoConfig, layout: Layout) -> JobGroups:
    """The groups for ``cfg.mode``: collective, call on every rank."""
    if cfg.baseline == "devicemesh":
        return _devicemesh_groups(layout)
    if cfg.baseline is not None:
        raise ValueError(f"unknown baseline {cfg.baseline!r}; fix: use --baseline devicemesh")
    return _registry_groups(layout)
