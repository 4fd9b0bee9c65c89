"""FSDP2 on the registry's fsdp role: same training as on a plain mesh (losses equal), on its own group.

Its tests that start processes are in ``tests/test_fsdp_world.py`` (marked ``world``).
"""

from __future__ import annotations

import pytest
from torch import nn

from commgroups import GroupRegistry, Layout, RoleSpec
from commgroups.integrations import MissingRoleError
from commgroups.integrations.fsdp import (
    fully_shard_on_role,
)


def test_missing_fsdp_role_names_the_fix() -> None:
    registry = GroupRegistry(Layout(dims={"cp": 4}, roles=[RoleSpec(name="cp", dims=["cp"])]))
    with pytest.raises(MissingRoleError, match=r"'fsdp'.*fix:"):
        fully_shard_on_role(nn.Linear(2, 2), registry)
