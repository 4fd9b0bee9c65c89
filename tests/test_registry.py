"""The GroupRegistry on real multi-process gloo worlds: dedicated groups, meshes, agreement, close.

Its tests that start processes are in ``tests/test_registry_world.py`` (marked ``world``).
"""

from __future__ import annotations

import pytest

import commgroups as cg
from commgroups import errors


def test_registry_usage_errors_without_a_world() -> None:
    registry = cg.GroupRegistry(cg.Layout(dims={"cp": 4}))
    with pytest.raises(errors.RegistryNotCreatedError, match="create"):
        registry.group("cp")
    with pytest.raises(KeyError, match="known roles"):
        registry.group("tp")
    with pytest.raises(errors.RegistryStateError, match="init_process_group"):
        registry.create()
    with pytest.raises(errors.ArgumentError, match="creation"):
        cg.GroupRegistry(cg.Layout(dims={"cp": 4}), creation_mode="fastest")
    with pytest.raises(TypeError, match="Layout"):
        cg.GroupRegistry({"dims": {"cp": 4}})  # type: ignore[arg-type]
    for name in ("", "a/b", 3):
        with pytest.raises(errors.ArgumentError, match="name: a barrier's name") as caught:
            registry.store_barrier(name)  # type: ignore[arg-type]
        assert caught.value.field == "name"
    with pytest.raises(errors.RegistryNotCreatedError, match="create"):
        registry.store_barrier("set_pg_timeouts")
