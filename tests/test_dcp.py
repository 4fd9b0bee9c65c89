"""DCP save/load/async_save through the registry: every plan and metadata exchange on the checkpoint group.

Observed at the c10d op level: :class:`C10dRecorder` (a TorchDispatchMode) sees every
``torch.ops.c10d.*`` and ``torch.ops._c10d_functional.*`` op the calling thread dispatches, with the
ProcessGroup it runs on and its ``async_op`` (verified on torch 2.13: ``dist.gather_object`` and
friends reach ``c10d.gather_``/``scatter_``/``broadcast_``/``allgather_`` with a ScriptObject that
``ProcessGroup.unbox`` turns back into the group). async_save runs its exchange on a worker thread that
a dispatch mode cannot see, so it is observed through the groups' c10d sequence numbers instead.

Its tests that start processes are in ``tests/test_dcp_world.py`` (marked ``world``).
"""

from __future__ import annotations

import pytest

from commgroups import CHECKPOINT_ROLE, GroupRegistry, Layout, RoleSpec
from commgroups.integrations import MissingRoleError
from commgroups.integrations import dcp as cg_dcp


def test_registry_without_checkpoint_role_names_the_fix() -> None:
    registry = GroupRegistry(Layout(dims={"cp": 4}, roles=[RoleSpec(name="cp", dims=["cp"])]))
    with pytest.raises(MissingRoleError) as info:
        cg_dcp.save({}, checkpoint_id="unused", registry=registry)
    message = str(info.value)
    assert CHECKPOINT_ROLE in message and "fix:" in message and 'backend = "gloo"' in message


@pytest.mark.parametrize(
    ("value", "expected"),
    [("", False), ("0", False), ("off", False), ("1", True), ("true", True), (" YES ", True)],
)
def test_switch_values(value: str, expected: bool) -> None:
    assert cg_dcp.use_default_group({cg_dcp.DEFAULT_GROUP_ENV: value}) is expected
    assert cg_dcp.use_default_group({}) is False


def test_switch_rejects_unknown_values() -> None:
    with pytest.raises(ValueError, match="not understood"):
        cg_dcp.use_default_group({cg_dcp.DEFAULT_GROUP_ENV: "2"})
