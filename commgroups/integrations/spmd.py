"""spmd_types on the registry: axis names resolve to dedicated groups, every collective async-and-wait.

spmd_types resolves an axis name through its *current mesh* and issues collectives on its *dist
module*. In spmd-types 0.2.3 every collective is a raw blocking call (``async_op=False``); in 0.3.x
stack/uneven all_gather and reduce_scatter, in-place all_reduce and all_to_all still are. On NCCL
(torch >= 2.8) a blocking collective runs on the caller's stream while FSDP's async ones run on the
group's stream: on a shared communicator the two race. :func:`activate` closes both doors::

    from commgroups.integrations.spmd import activate
    with activate(registry, mesh_dims=["cp"]):
        k_full = spmd_types.all_gather(k, "cp", src=V, dst=R)   # on registry.group("cp"), async+wait

Inside the scope spmd_types' current mesh is ``registry.device_mesh(mesh_dims)`` and its dist module
is ``commgroups.collectives.async_wait.AsyncWaitDist()``; on exit both are restored (also on
error). Functional
collectives (``torch.ops._c10d_functional``) do not go through the dist module; they are async by
construction. Works with spmd-types 0.2.3 and 0.3.x, which share ``set_current_mesh`` (a thread-local
stack) and ``set_dist`` (a module-level reference, ``spmd_types._dist.dist``).

The dist module is process-wide in spmd_types, so do not run two scopes in different threads at once.
Backward passes run on the caller's thread on CPU and inside the scope when ``loss.backward()`` is
called inside it; call it inside.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import TYPE_CHECKING, Any

from commgroups.torch_internals.version import require_torch

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from commgroups.registry import GroupRegistry

__all__ = ["activate", "current_dist"]

logger = logging.getLogger(__name__)


def _import_spmd_types() -> Any:
    require_torch((2, 10), "commgroups.integrations.spmd (spmd-types)",
                  "every spmd-types release imports torch.distributed._local_tensor, new in 2.10")
    try:
        import spmd_types
        import spmd_types._dist  # the patchable dist reference, present since 0.2.x
    except ImportError as error:
        raise ImportError(
            "commgroups.integrations.spmd needs spmd-types (>= 0.2.3); fix: pip install "
            "'commgroups[spmd]' or pip install spmd-types"
        ) from error
    return spmd_types


def current_dist() -> Any:
    """The module spmd_types issues its raw collectives on right now (torch.distributed by default).

    spmd_types has a setter (``set_dist``) but no getter; ``spmd_types._dist.dist`` is the attribute
    it reads on every call (its documented patch point), in 0.2.3 and 0.3.x alike.
    """
    return _import_spmd_types()._dist.dist


@contextmanager
def activate(
    registry: GroupRegistry,
    mesh_dims: str | Sequence[str] | None,
    *,
    async_and_wait: bool = True,
) -> Iterator[DeviceMesh | None]:
    """Make spmd_types use the registry: its current mesh and (by default) an async-and-wait dist.

    Args:
        registry: a created GroupRegistry.
        mesh_dims: what to mesh, as ``registry.device_mesh`` takes it: layout dims in layout order
            (each becomes a named axis on that dim's dedicated group) or one role name. None:
            dist-only, for callers that own spmd_types' current mesh themselves (torchtitan sets
            it from registry meshes it was handed): only the dist module changes.
        async_and_wait: replace spmd_types' dist module with ``AsyncWaitDist()`` (issue async,
            wait at once). Leave on; off only mirrors the plain-DeviceMesh behaviour for
            comparisons.

    Yields:
        The DeviceMesh spmd_types now resolves axis names through (None when dist-only).

    Example::

        with activate(registry, ["cp"]):          # axis "cp" is registry.group("cp")
            out = spmd_types.all_gather(x, "cp", src=V, dst=R)
        with activate(registry, None):            # the caller's mesh, async-and-wait dist
            trainer.train()
    """
    spmd_types = _import_spmd_types()
    mesh: DeviceMesh | None = None
    if mesh_dims is not None:
        dims = [mesh_dims] if isinstance(mesh_dims, str) else list(mesh_dims)
        mesh = registry.device_mesh(dims[0] if len(dims) == 1 else dims)
    replacement: Any = None
    if async_and_wait:
        from commgroups.collectives.async_wait import AsyncWaitDist

        replacement = AsyncWaitDist()
    previous = current_dist()
    with spmd_types.set_current_mesh(mesh) if mesh is not None else nullcontext():
        if replacement is not None:
            spmd_types.set_dist(replacement)
        logger.debug("spmd_types: mesh %s, dist %s", mesh, type(current_dist()).__name__)
        try:
            yield mesh
        finally:
            # Restore exactly what was there (a caller's own wrapper too), not torch.distributed.
            spmd_types.set_dist(previous)
