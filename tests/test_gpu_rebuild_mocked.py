"""The GPU/NPU paths of rebuild() on the CPU: NCCL abort, the shrink capability, HCCL abort.

NCCL and HCCL cannot run here, so each test mocks only the NCCL/HCCL piece, and says so in its
name: the c10d call that aborts (``_abort_process_group``), what a group's backend answers to
``supports_shrinking``, or whether the default group is bound to an NCCL device. Everything
else (adapters, the registry's retire and refusal paths, commgroups' torch_internals) is the real
code. What these do not show, the GPU check runs on one GPU (``tests/test_gpu_rebuild.py``):
a real one-rank NCCL abort during a rebuild and the machine's real shrink answer.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import commgroups as cg
from commgroups import generation as generation_module
from commgroups import registry as registry_module
from commgroups import torch_internals
from commgroups.backends.gloo import GlooAdapter
from commgroups.backends.hccl import HcclAdapter
from commgroups.backends.nccl import NcclAdapter
from commgroups.backends.rccl import RcclAdapter
from commgroups.creation.role_groups import CreatedRole, CreationContext, create_role_group
from commgroups.errors import GroupCreationError, RebuildError, StaleGenerationError
from commgroups.generation import Generation, GenerationRequest
from commgroups.rank_loss.shrink import Spine
from commgroups.registry import RegistryState

BOUND_NCCL = CreationContext(default_backend="nccl", device_bound=True, accelerator=True)


def _aborts_recorded(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Replace c10d's abort (NCCL/HCCL only) with a recorder; returns what it was called with."""
    calls: list[Any] = []
    monkeypatch.setattr(c10d, "_abort_process_group", calls.append)
    return calls


def _backend_answers(monkeypatch: pytest.MonkeyPatch, answer: bool | None) -> list[Any]:
    """Make every group's backend answer ``supports_shrinking`` with ``answer`` (None: unknown)."""
    asked: list[Any] = []

    def supports(group: Any, device: torch.device) -> bool | None:
        asked.append(device)
        return answer

    monkeypatch.setattr(torch_internals, "backend_supports_shrinking", supports)
    return asked


# ------------------------------------------------------------------------------ capability flags
def test_capability_flags() -> None:
    assert NcclAdapter.aborts and RcclAdapter.aborts and HcclAdapter.aborts
    assert not GlooAdapter.aborts  # gloo's abort frees no blocked collective: left referenced
    assert NcclAdapter.supports_split and not HcclAdapter.supports_split


def test_shrink_needs_torch_shrink_group_and_the_backend_mocked_nccl(
        monkeypatch: pytest.MonkeyPatch) -> None:
    group = SimpleNamespace(bound_device_id=torch.device("cuda", 3))
    asked = _backend_answers(monkeypatch, True)
    assert NcclAdapter().shrink_blocker(group) is None and NcclAdapter().shrinks(group)
    assert asked[0] == torch.device("cuda", 3)  # the bound device, as torch's shrink_group reads it

    _backend_answers(monkeypatch, False)
    blocker = NcclAdapter().shrink_blocker(group)
    assert blocker is not None and "supports_shrinking=False" in blocker and "2.27" in blocker

    asked = _backend_answers(monkeypatch, None)
    unbound = SimpleNamespace(bound_device_id=None)
    blocker = NcclAdapter().shrink_blocker(unbound)
    assert blocker is not None and "cannot tell" in blocker and asked == [torch.device("cuda")]

    _backend_answers(monkeypatch, True)
    monkeypatch.delattr(dist, "shrink_group")
    blocker = NcclAdapter().shrink_blocker(group)
    assert blocker is not None and "no torch.distributed.shrink_group" in blocker


def test_gloo_and_hccl_never_shrink() -> None:
    for adapter in (GlooAdapter(), HcclAdapter()):
        blocker = adapter.shrink_blocker(object())
        assert blocker is not None and adapter.name in blocker and not adapter.shrinks(object())


def test_backend_supports_shrinking_reads_the_backend_property() -> None:
    class Group:
        def __init__(self, backend: object) -> None:
            self.backend = backend

        def _get_backend(self, device: torch.device) -> object:
            if self.backend is None:
                raise RuntimeError(f"no backend for {device}")
            return self.backend

    check = torch_internals.backend_supports_shrinking
    cuda = torch.device("cuda")
    assert check(Group(SimpleNamespace(supports_shrinking=True)), cuda) is True  # type: ignore[arg-type]
    assert check(Group(SimpleNamespace(supports_shrinking=False)), cuda) is False  # type: ignore[arg-type]
    assert check(Group(SimpleNamespace()), cuda) is None  # type: ignore[arg-type]
    assert check(Group(None), cuda) is None  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------- aborts
def test_nccl_abort_goes_through_c10d_mocked_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _aborts_recorded(monkeypatch)
    group = object()
    NcclAdapter().abort(group)
    assert calls == [group]


def test_hccl_abort_goes_through_c10d_without_torch_npu_mocked_hccl(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _aborts_recorded(monkeypatch)
    group = object()
    HcclAdapter().abort(group)
    assert calls == [group]
    assert "torch_npu" not in sys.modules  # aborting imports nothing of torch_npu


def test_a_failing_abort_is_logged_not_raised_mocked_nccl(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    def refuse(group: Any) -> None:
        raise RuntimeError("NCCL communicator was aborted already")

    monkeypatch.setattr(c10d, "_abort_process_group", refuse)
    NcclAdapter().abort(object())
    assert "aborting" in caplog.text and "aborted already" in caplog.text


def _registry(roles: dict[str, CreatedRole], layout: cg.Layout | None = None) -> cg.GroupRegistry:
    """A registry in the state create() leaves on rank 0 of 2, holding ``roles`` (no torch world)."""
    registry = cg.GroupRegistry(layout or cg.Layout(dims={"tp": 2}))
    registry._rank = 0
    request = GenerationRequest(number=0, layout=registry.layout, plan=registry.plan, rank=0,
                                mode="auto", create_timeout_s=300.0,
                                context=CreationContext(default_backend="gloo", device_bound=False))
    registry._current = Generation(request=request, roles=roles)
    registry._state = RegistryState.CREATED
    return registry


def test_retire_aborts_nccl_and_hccl_groups_and_leaves_gloo_mocked_nccl_hccl(
        monkeypatch: pytest.MonkeyPatch) -> None:
    calls = _aborts_recorded(monkeypatch)
    nccl, hccl, gloo = object(), object(), object()
    registry = _registry({
        "tp": CreatedRole(nccl, "all_ranks", NcclAdapter(), [nccl]),  # type: ignore[arg-type]
        "npu": CreatedRole(hccl, "all_ranks", HcclAdapter(), [hccl]),  # type: ignore[arg-type]
        "checkpoint-metadata": CreatedRole(gloo, "local", GlooAdapter(), [gloo]),  # type: ignore[arg-type]
    })
    registry._retire()
    assert calls == [nccl, hccl]  # gloo: kept referenced, never aborted nor destroyed
    assert registry._state == "retired"
    assert [r.group for r in registry._retired[-1].roles.values()] == [nccl, hccl, gloo]


# ------------------------------------------------------------------------ bound default group
def _bound_split_registry(monkeypatch: pytest.MonkeyPatch) -> cg.GroupRegistry:
    """A registry whose tp role was split from a device-bound NCCL default group (mocked)."""
    monkeypatch.setattr(registry_module.CreationContext, "detect", classmethod(
        lambda cls: BOUND_NCCL))
    monkeypatch.setattr(torch_internals, "default_group",
                        lambda: SimpleNamespace(bound_device_id=torch.device("cuda", 0)))
    split = object()
    return _registry({"tp": CreatedRole(split, "split", NcclAdapter(), [split])})  # type: ignore[arg-type]


def test_bound_rebuild_names_the_missing_shrink_capability_mocked_nccl(
        monkeypatch: pytest.MonkeyPatch) -> None:
    registry = _bound_split_registry(monkeypatch)
    _backend_answers(monkeypatch, False)
    calls = _aborts_recorded(monkeypatch)
    with pytest.raises(RebuildError) as caught:
        registry.rebuild(alive=[0])
    message = str(caught.value)
    assert "role 'tp'" in message and "ncclCommSplit" in message
    assert "needs shrink_group, which this job lacks" in message
    assert "supports_shrinking=False" in message and "NCCL >= 2.27" in message
    assert "without device_id" in message and "restart mode" in message
    # Refused before the check-in: nothing retired, nothing aborted, the registry still usable.
    assert registry._state == "created" and calls == []


def test_bound_rebuild_without_a_world_role_names_the_fix_mocked_nccl(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """This torch and NCCL can shrink, but no device role spans the world: refused, nothing
    shrunk (least of all the default group), the message naming the role to add."""
    monkeypatch.setattr(registry_module.CreationContext, "detect", classmethod(
        lambda cls: BOUND_NCCL))
    default = SimpleNamespace(bound_device_id=torch.device("cuda", 0))
    monkeypatch.setattr(torch_internals, "default_group", lambda: default)
    asked = _backend_answers(monkeypatch, True)
    calls = _aborts_recorded(monkeypatch)
    shrunk: list[Any] = []
    monkeypatch.setattr(dist, "shrink_group", lambda *a, **k: shrunk.append((a, k)))
    cp, dpr = object(), object()
    registry = _registry({
        "cp": CreatedRole(cp, "split", NcclAdapter(), [cp]),  # type: ignore[arg-type]
        "dp_replicate": CreatedRole(dpr, "split", NcclAdapter(), [dpr]),  # type: ignore[arg-type]
    }, cg.Layout(
        dims={"dp_replicate": 2, "cp": 2}, elastic={"dims": {"dp_replicate": 1}},
        roles=[cg.RoleSpec(name="cp", dims=["cp"]),
               cg.RoleSpec(name="dp_replicate", dims=["dp_replicate"])]))
    with pytest.raises(RebuildError) as caught:
        registry.rebuild(alive=[0, 1])
    message = str(caught.value)
    assert "role 'cp'" in message and "can shrink" in message
    assert "no role here spans the world on nccl" in message
    assert "cg.RoleSpec(name='world', dims='world')" in message
    assert "renumbering every rank" in message  # why the default group is not shrunk instead
    assert "restart mode" in message and "without device_id" in message
    assert asked == [torch.device("cuda", 0)]  # the capability was asked of the default group
    assert shrunk == [] and calls == [] and registry._state == "created"


def test_unbound_nccl_is_not_refused_mocked_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry_module.CreationContext, "detect", classmethod(
        lambda cls: CreationContext(default_backend="nccl", device_bound=False, accelerator=True)))
    group = object()
    registry = _registry({"tp": CreatedRole(group, "local", NcclAdapter(), [group])})  # type: ignore[arg-type]
    registry._check_rebuildable()  # no refusal: new groups need no split of the default group


# ------------------------------------------------------------- shrink path (bound default group)
# One process plays rank RANK of an 8-rank fake-backend world. Only NCCL is mocked: the default
# group is reported bound to a CUDA device (so device roles are NCCL splits of it), the NCCL
# adapter skips its CUDA check, every group's backend answers supports_shrinking=True, and
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

    monkeypatch.setattr(generation_module, "resolve_backend", resolve)
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
                                 "flags": shrink_flags})
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
        spine = registry._spine
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
        second = registry._spine
        assert second is not None and second.ranks == (0, 1, 6, 7)
        assert nccl.splits_from(second.group)["dp_replicate"] == [[0, 2], [1, 3]]
    finally:
        registry.close()
    assert registry._spine is None


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
    assert any(g is world0 for g in aborted) and registry._spine is None
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
