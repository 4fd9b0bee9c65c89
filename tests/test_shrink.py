"""commgroups.creation.shrink on the CPU: rebuild() on a device-bound default group shrinks the spine
(the world role's group) and splits every device role from it, NCCL mocked.

NCCL cannot run here, so only the NCCL piece is mocked (see the section comment below); the registry,
the shrink module, replan and c10d's group tables are the real code. The rest of the GPU/NPU paths
of rebuild() on the CPU (aborts, capability flags, refusals) is in tests/test_gpu_rebuild_mocked.py;
the one-GPU check is tests/test_gpu_rebuild.py.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

import commgroups as cg
from commgroups import registry as registry_module
from commgroups.backends.gloo import GlooAdapter
from commgroups.backends.nccl import NcclAdapter
from commgroups.creation.role_groups import CreatedRole, create_role_group
from commgroups.creation.shrink import Spine
from commgroups.errors import GroupCreationError, RebuildError, StaleGenerationError
from commgroups.generation import make as generation_make
from commgroups.generation import state as generation_state
from tests.test_gpu_rebuild_mocked import BOUND_NCCL, _aborts_recorded, _backend_answers

# ------------------------------------------------------------- shrink path (bound default group)
# One process plays rank RANK of an 8-rank fake-backend world. Only NCCL is mocked: the default
# group is reported bound to a CUDA device (so device roles are NCCL splits of it), the NCCL
# adapter skips its CUDA check, every group's backend is a fake ProcessGroupNCCL2 (the recorded
# attributes of torch 2.15.0's class) answering supports_shrinking=True, and
# torch's shrink_group / split_group are replaced by recorders that check their arguments as
# torch does and make fake-backend groups over the ranks a real NCCL call would give. The
# registry, the shrink module, replan and c10d's group tables are the real code.

WORLD = 8
SHRINK_ABORT = 1  # torch's distributed_c10d.SHRINK_ABORT (NCCL_SHRINK_ABORT)


def _shrink_layout() -> cg.Layout:
    """HSDP-like: dp_replicate=4 x cp=2, replicas elastic; a device role over the world (the
    spine), two device roles with several groups, a gloo-like role with non-members."""
    return cg.Layout(
        dims={"dp_replicate": 4, "cp": 2}, elastic={"dims": {"dp_replicate": 1}},
        roles=[cg.RoleSpec(name="cp", dims=["cp"], timeout_s=45),
               cg.RoleSpec(name="meta", dims=["cp"], backend="gloo"),
               cg.RoleSpec(name="world", dims="world"),
               cg.RoleSpec(name="dp_replicate", dims=["dp_replicate"])])


class _MockedNccl(NcclAdapter):
    """The NCCL adapter without its CUDA check (mocked NCCL); everything else is the real one."""

    def check_available(self) -> None:
        """No CUDA here: the NCCL calls themselves are mocked."""


class NcclRecorder:
    """What the mocked shrink_group / split_group / new_group were called with, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, Any]] = []
        self.shrinks: list[dict[str, Any]] = []
        self.splits: list[dict[str, Any]] = []
        self.fail_shrink: str | None = None

    def splits_from(self, parent: Any) -> dict[str, list[list[int]]]:
        """group_desc -> split_ranks of the splits made from ``parent``."""
        return {c["group_desc"]: c["split_ranks"] for c in self.splits if c["parent"] is parent}


@pytest.fixture
def nccl(monkeypatch: pytest.MonkeyPatch, fake_world: Any, request: pytest.FixtureRequest
         ) -> NcclRecorder:
    """A fake world of 8 as rank ``request.param`` (default 0) with NCCL mocked (see above)."""
    rank = getattr(request, "param", 0)
    fake_world(WORLD, rank=rank)
    recorder = NcclRecorder()
    real_new_group = dist.new_group
    monkeypatch.setattr(registry_module.CreationContext, "detect", classmethod(
        lambda cls: BOUND_NCCL))
    from commgroups.backends.fake import FakeAdapter

    def resolve(requested: str, default_backend: str | None = None,
                group_size: int | None = None, device_backend: str | None = None) -> Any:
        return _MockedNccl() if requested == "device" else FakeAdapter()  # gloo: plays gloo

    for module in (generation_make, generation_state):  # creation and covering_role
        monkeypatch.setattr(module, "resolve_backend", resolve)
    _backend_answers(monkeypatch, True)

    def new_group(ranks: Any = None, **kwargs: Any) -> Any:
        recorder.events.append(("new_group", kwargs.get("group_desc")))
        return real_new_group(ranks, **{**kwargs, "backend": "fake"})

    def split_group(parent_pg: Any = None, split_ranks: Any = None, timeout: Any = None,
                    pg_options: Any = None, group_desc: Any = None) -> Any:
        parent = parent_pg if parent_pg is not None else dist.group.WORLD
        recorder.splits.append({"parent": parent_pg, "split_ranks": split_ranks,
                                "timeout": timeout, "group_desc": group_desc})
        recorder.events.append(("split", group_desc))
        members = dist.get_process_group_ranks(parent)  # group rank -> global rank
        flat = [r for ranks in split_ranks for r in ranks]
        assert len(flat) == len(set(flat)) and all(0 <= r < len(members) for r in flat), \
            f"split_ranks {split_ranks} are not disjoint group ranks of a {len(members)}-rank parent"
        mine = next((ranks for ranks in split_ranks if parent.rank() in ranks), None)
        return None if mine is None else real_new_group([members[r] for r in mine],
                                                        backend="fake")

    def shrink_group(ranks_to_exclude: list[int], group: Any = None, shrink_flags: int = 0,
                     pg_options: Any = None) -> Any:
        recorder.shrinks.append({"excluded": list(ranks_to_exclude), "group": group,
                                 "flags": shrink_flags, "options": pg_options})
        recorder.events.append(("shrink", None))
        if recorder.fail_shrink:
            raise RuntimeError(recorder.fail_shrink)
        target = group if group is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(target)
        # torch's own checks (_validate_and_process_excluded_ranks)
        assert ranks_to_exclude and all(0 <= r < len(ranks) for r in ranks_to_exclude)
        assert target.rank() not in ranks_to_exclude, "an excluded rank called shrink_group"
        remaining = [r for i, r in enumerate(ranks) if i not in set(ranks_to_exclude)]
        shrunk = real_new_group(remaining, backend="fake")
        dist.destroy_process_group(target)  # torch's shrink_group destroys the parent
        return shrunk

    monkeypatch.setattr(dist, "new_group", new_group)
    monkeypatch.setattr(dist, "split_group", split_group)
    monkeypatch.setattr(dist, "shrink_group", shrink_group)
    return recorder


def test_rebuild_shrinks_the_world_role_and_splits_every_device_role_mocked_nccl(
        nccl: NcclRecorder, monkeypatch: pytest.MonkeyPatch) -> None:
    aborted = _aborts_recorded(monkeypatch)
    registry = cg.GroupRegistry(_shrink_layout(), create_timeout_s=3600).create()
    try:
        assert {r: registry.creation_method(r) for r in registry.role_names} == {
            "cp": "split", "meta": "local", "world": "split", "dp_replicate": "split"}
        assert all(c["parent"] is None for c in nccl.splits)  # generation 0: from the default
        world0, cp0, dpr0 = (registry.group(r) for r in ("world", "cp", "dp_replicate"))
        meta0 = registry.group("meta")
        stale = registry.collectives("cp")
        nccl.events.clear()

        # Rank 3 dies: replica 1 (ranks 2, 3) leaves; rank 2 is dropped (no spares).
        report = registry.rebuild(alive=[0, 1, 2, 4, 5, 6, 7])
        assert report.place == "member" and registry.generation == 1
        assert registry.members == (0, 1, 4, 5, 6, 7) and report.dropped == (2,)

        # One shrink, of the world role's group (never the default group), SHRINK_ABORT,
        # excluding the world group's ranks of 2 and 3 (its group ranks 2 and 3).
        assert len(nccl.shrinks) == 1
        shrink = nccl.shrinks[0]
        assert shrink["group"] is world0 and shrink["group"] is not dist.group.WORLD
        assert shrink["excluded"] == [2, 3] and shrink["flags"] == SHRINK_ABORT
        # ... with a copy of the default group's backend options (a fake ProcessGroupNCCL2 of
        # torch 2.15.0 here, whose options property is c10d Backend's: tests/nccl_fakes.py).
        assert type(shrink["options"]).__name__ == "FakeProcessGroupNCCLOptions"
        spine = registry._recovery.spine
        assert spine is not None and spine.ranks == (0, 1, 4, 5, 6, 7)
        assert dist.get_process_group_ranks(spine.group) == [0, 1, 4, 5, 6, 7]

        # Every device role split from the shrunk spine, in the spine's group ranks.
        assert nccl.splits_from(spine.group) == {
            "cp": [[0, 1], [2, 3], [4, 5]],            # global (0,1), (4,5), (6,7)
            "world": [[0, 1, 2, 3, 4, 5]],
            "dp_replicate": [[0, 2, 4], [1, 3, 5]],     # global (0,4,6), (1,5,7)
        }
        assert [c["timeout"] for c in nccl.splits if c["group_desc"] == "cp"][-1] == \
            timedelta(seconds=45)
        # The gloo-like role first (member-only; declared after cp), then the shrink, then the
        # splits.
        assert nccl.events == [("new_group", "meta"), ("shrink", None), ("split", "cp"),
                               ("split", "world"), ("split", "dp_replicate")]

        # The old NCCL groups were aborted, except the world group (shrink_group consumed it);
        # gloo's was left alone.
        assert aborted == [cp0, dpr0]
        assert not any(g is world0 or g is meta0 for g in aborted)

        for role in registry.role_names:
            group = registry.group(role)
            assert group is not dist.group.WORLD and group is not spine.group
            assert tuple(dist.get_process_group_ranks(group)) == registry.ranks(role)
            assert 2 not in registry.ranks(role) and 3 not in registry.ranks(role)
        assert registry.creation_method("world") == "split"
        with pytest.raises(StaleGenerationError) as caught:
            stale.all_reduce(torch.ones(2))
        assert "cp" in str(caught.value)
        registry.collectives("cp").all_reduce(torch.ones(2))

        # A mesh over the rebuilt groups: its dim group comes from the spine too.
        registry.device_mesh("dp_replicate")
        assert nccl.splits[-1]["parent"] is spine.group

        # A second loss (rank 5: replica (4, 5) leaves) shrinks the spine itself.
        nccl.events.clear()
        first_spine = spine.group
        registry.rebuild(alive=[0, 1, 4, 6, 7])
        assert registry.members == (0, 1, 6, 7) and registry.generation == 2
        assert nccl.shrinks[-1]["group"] is first_spine and nccl.shrinks[-1]["excluded"] == [2, 3]
        second = registry._recovery.spine
        assert second is not None and second.ranks == (0, 1, 6, 7)
        assert nccl.splits_from(second.group)["dp_replicate"] == [[0, 2], [1, 3]]
    finally:
        registry.close()
    assert registry._recovery.spine is None


@pytest.mark.parametrize("nccl", [2], indirect=True)
def test_a_rank_left_out_never_calls_shrink_group_mocked_nccl(
        nccl: NcclRecorder, monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 2 survives rank 3 but the smaller layout drops it: it must not call shrink_group
    (torch forbids an excluded rank to), and it aborts its copy of the world group."""
    aborted = _aborts_recorded(monkeypatch)
    registry = cg.GroupRegistry(_shrink_layout(), create_timeout_s=3600).create()
    world0 = registry.group("world")
    report = registry.rebuild(alive=[0, 1, 2, 4, 5, 6, 7])
    assert report.place == "dropped" and nccl.shrinks == []
    assert any(g is world0 for g in aborted) and registry._recovery.spine is None
    registry.close()


def test_a_failed_shrink_leaves_a_clear_refusal_mocked_nccl(
        nccl: NcclRecorder, monkeypatch: pytest.MonkeyPatch) -> None:
    _aborts_recorded(monkeypatch)
    registry = cg.GroupRegistry(_shrink_layout(), create_timeout_s=3600).create()
    nccl.fail_shrink = "ncclCommShrink: remote process exited"
    with pytest.raises(GroupCreationError) as caught:
        registry.rebuild(alive=[0, 1, 2, 4, 5, 6, 7])
    assert "ncclCommShrink" in str(caught.value) and registry._state == "retired"
    with pytest.raises(RebuildError) as again:
        registry.rebuild(alive=[0, 1, 4, 5, 6, 7])
    message = str(again.value)
    assert "shrink_group failed" in message and "restart mode" in message
    assert len(nccl.shrinks) == 1  # the second attempt refused before trying again
    registry.close()


def test_every_ranks_creation_of_a_partial_group_is_refused_while_the_spine_serves() -> None:
    """Mocked NCCL: a local role that fell back to every-ranks creation would send its
    non-members into a split of the dead default communicator; the spine refuses it."""
    plan = cg.plan(_shrink_layout())
    spine = Spine(group=object(), ranks=tuple(range(WORLD)), adapter=NcclAdapter(),  # type: ignore[arg-type]
                  source="role 'world'")
    make = spine.creator(GlooAdapter())
    with pytest.raises(GroupCreationError) as caught:
        make(plan, plan.role("meta"), GlooAdapter(), plan.role("meta").spec.options, 10.0, 0,
             "all_ranks", group_desc="meta")
    assert "role 'meta'" in str(caught.value) and "every rank" in str(caught.value)
    assert spine.creator(NcclAdapter()) == spine.split
    owned = Spine(group=object(), ranks=(0,), adapter=NcclAdapter(),  # type: ignore[arg-type]
                  source="role 'world'", owner=CreatedRole(None, "split", NcclAdapter()))
    assert owned.creator(NcclAdapter()) is create_role_group  # not taken over: nothing routed
