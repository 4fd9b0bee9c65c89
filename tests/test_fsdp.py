"""FSDP2 on the registry's fsdp role: same training as on a plain mesh (losses equal), on its own group.

Its tests that start processes are in ``tests/test_fsdp_world.py`` (marked ``world``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard

from commgroups import GroupRegistry, Layout, RoleSpec
from commgroups.integrations import MissingRoleError
from commgroups.integrations.fsdp import (
    fully_shard_on_role,
    install_async_and_wait_comms,
)

FSDP2_REFUSAL = ("set_custom_all_gather is not supported with multiple param groups (from "
                 "per-param mesh via shard_placement_fn).")
"""FSDP2's (torch 2.13) ValueError on a module with several parameter groups."""


def test_missing_fsdp_role_names_the_fix() -> None:
    registry = GroupRegistry(Layout(dims={"cp": 4}, roles=[RoleSpec(name="cp", dims=["cp"])]))
    with pytest.raises(MissingRoleError, match=r"'fsdp'.*fix:"):
        fully_shard_on_role(nn.Linear(2, 2), registry)


# ------------------------------------------------------------------ installing the custom comms
@pytest.fixture
def registry(one_rank: dist.ProcessGroup) -> Iterator[GroupRegistry]:
    """A created 1-rank registry with the fsdp role (async-and-wait on, its default)."""
    layout = Layout(dims={"dp_shard": 1, "cp": 1},
                    roles=[RoleSpec(name="fsdp", dims=["dp_shard", "cp"])])
    with GroupRegistry(layout) as made:
        yield made


class Comms:
    """What FSDP2's public custom-comm setters were given, per module; ``refused`` modules get
    FSDP2's own refusal (several parameter groups: per-parameter meshes), as torch 2.13 raises
    it, before anything changes. A 1-rank FSDP2 issues no all-gather, so the setters are what
    a test can see."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, refused: tuple[nn.Module, ...] = ()) -> None:
        self.got: dict[int, list[str]] = {}
        self.refused = {id(module) for module in refused}
        real_gather = FSDPModule.set_custom_all_gather
        real_scatter = FSDPModule.set_custom_reduce_scatter

        def set_custom_all_gather(module: FSDPModule, comm: Any) -> None:
            if id(module) in self.refused:
                raise ValueError(FSDP2_REFUSAL)
            self.got.setdefault(id(module), []).append(type(comm).__name__)
            real_gather(module, comm)

        def set_custom_reduce_scatter(module: FSDPModule, comm: Any) -> None:
            self.got.setdefault(id(module), []).append(type(comm).__name__)
            real_scatter(module, comm)

        monkeypatch.setattr(FSDPModule, "set_custom_all_gather", set_custom_all_gather)
        monkeypatch.setattr(FSDPModule, "set_custom_reduce_scatter", set_custom_reduce_scatter)

    def of(self, module: nn.Module) -> list[str]:
        return self.got.get(id(module), [])


ASYNC_WAIT = ["AsyncWaitAllGather", "AsyncWaitReduceScatter"]


def test_modules_fsdp2_refuses_custom_comms_for_are_skipped_with_one_warning(
        registry: GroupRegistry, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A module sharded over several meshes (shard_placement_fn, MoE) keeps FSDP2's comms; the
    others get async-and-wait's, and the count says how many did, not a raw ValueError half-way."""
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.Linear(2, 2))
    mesh = registry.device_mesh("fsdp")
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    comms = Comms(monkeypatch, refused=(model[0], model[2]))
    with caplog.at_level("WARNING", logger="commgroups.integrations.fsdp"):
        assert install_async_and_wait_comms(model) == 2
    assert comms.of(model) == ASYNC_WAIT and comms.of(model[1]) == ASYNC_WAIT
    assert comms.of(model[0]) == [] and comms.of(model[2]) == []
    warned = [r.getMessage() for r in caplog.records if "several meshes" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("2 FSDP modules"), warned

    # fully_shard_on_role: the module is sharded and stays so, on FSDP2's own comms.
    caplog.clear()
    single = nn.Linear(2, 2)
    comms.refused.add(id(single))
    with caplog.at_level("WARNING", logger="commgroups.integrations.fsdp"):
        assert fully_shard_on_role(single, registry) is single
    assert isinstance(single, FSDPModule) and comms.of(single) == []
    assert any("several meshes" in r.getMessage() for r in caplog.records)


def test_a_list_of_modules_gets_the_comms_on_each(
        registry: GroupRegistry, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """fully_shard takes a list (one group sharded together): each module of it gets the comms
    the role asks for, not none in silence."""
    comms = Comms(monkeypatch)
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    parts = [model[0], model[1]]
    assert fully_shard_on_role(parts, registry) is parts
    assert comms.of(model[0]) == ASYNC_WAIT and comms.of(model[1]) == ASYNC_WAIT
    assert install_async_and_wait_comms(parts, recurse=False) == 2
    plain = nn.Linear(2, 2)  # never sharded: nothing to install, and said so
    with caplog.at_level("WARNING", logger="commgroups.integrations.fsdp"):
        assert install_async_and_wait_comms(plain, recurse=False) == 0
    assert any("not an FSDP module" in r.getMessage() for r in caplog.records)
    assert comms.of(plain) == []
