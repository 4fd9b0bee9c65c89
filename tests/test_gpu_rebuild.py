"""GPU only: what one GPU can show of rebuild() on NCCL (a one-rank NCCL world; the GPU check runs it).

- Unbound default group: the registry's NCCL groups carry a collective, ``rebuild(alive=[0])``
  aborts them through torch's real ``_abort_process_group`` (gloo's group is left referenced), the
  new generation carries a collective and the old handle raises StaleGenerationError.
- Device-bound default group (``device_id``): roles are made by ncclCommSplit; rebuild() takes the
  first NCCL role spanning the world as the spine (``commgroups/rank_loss/shrink.py``) and splits every NCCL
  role of the next generation from it (real ncclCommSplit of a non-default group); where the
  machine cannot shrink, the refusal naming the capability, the registry still working.
- What this machine's torch and NCCL say about shrinking (``dist.shrink_group``, the NCCL
  backend's ``supports_shrinking``), printed for the GPU check's log.

Not shown (one GPU holds no peer to lose): an abort that frees a collective blocked on a dead
peer, and any shrink: torch's shrink_group refuses an empty exclusion list and a group of one
rank, so no shrink_group call is possible on one GPU. A one-rank role normally gets commgroups'
single-rank backend (no communicator), so these tests resolve roles as if their groups were
larger: the registry then makes real one-rank NCCL groups. Skips without CUDA or NCCL.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist

import commgroups as cg
from commgroups import torch_internals
from commgroups.backends.nccl import NcclAdapter, _nccl_version
from commgroups.errors import RebuildError, StaleGenerationError
from commgroups.generation import make as generation_make
from commgroups.generation import state as generation_state
from tests import torch_private
from tests.gpu_support import require_cuda_and_nccl

pytestmark = pytest.mark.gpu

require_cuda_and_nccl("NCCL groups to rebuild")

LAYOUT = cg.Layout(dims={"dp_shard": 1, "tp": 1},
                   roles=[cg.RoleSpec(name="dp_shard", dims=["dp_shard"]),
                          cg.RoleSpec(name="tp", dims=["tp"]),
                          cg.RoleSpec(name="checkpoint-metadata", dims="world", backend="gloo")])


def _init(device_id: torch.device | None) -> Iterator[None]:
    if dist.is_initialized():
        pytest.skip("another test left a default group initialized in this process")
    torch.cuda.set_device(0)
    if device_id is None:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                                device_id=device_id)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def nccl_world() -> Iterator[None]:
    yield from _init(None)


@pytest.fixture
def bound_nccl_world() -> Iterator[None]:
    yield from _init(torch.device("cuda", 0))


@pytest.fixture
def real_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resolve every role as if its groups had several ranks: real one-rank NCCL/gloo groups."""
    resolve = generation_make.resolve_backend

    def larger(requested: str, default_group_backend: str | None = None,
               group_size: int | None = None) -> Any:
        return resolve(requested, default_group_backend, None)

    for module in (generation_make, generation_state):  # creation and covering_role
        monkeypatch.setattr(module, "resolve_backend", larger)


@pytest.fixture
def aborted(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The groups torch's real ``_abort_process_group`` is called on (it still runs)."""
    calls: list[Any] = []
    target = torch_private.abort_target()
    real = getattr(*target)

    def spy(group: Any = None) -> None:
        calls.append(group)
        real(group)

    monkeypatch.setattr(*target, spy)
    return calls


def test_rebuild_on_a_one_rank_nccl_world(nccl_world: None, real_groups: None,
                                          aborted: list[Any]) -> None:
    registry = cg.GroupRegistry(LAYOUT, create_timeout_s=60).create()
    try:
        assert registry.backend("tp") == "nccl" and registry.backend("dp_shard") == "nccl"
        old_handle = registry.collectives("tp")
        old_nccl = [registry.group("tp"), registry.group("dp_shard")]
        gloo = registry.group("checkpoint-metadata")
        x = torch.full((8,), 3.0, device="cuda")
        old_handle.all_reduce(x)
        torch.cuda.synchronize()
        assert torch.equal(x.cpu(), torch.full((8,), 3.0))

        report = registry.rebuild(alive=[0], timeout=30)
        print(f"\nrebuild on one NCCL rank: generation {report.generation}, seconds "
              f"{ {k: round(v, 3) for k, v in report.seconds.items()} }, aborted {len(aborted)}")
        assert report.place == "member" and registry.generation == 1
        # Each old NCCL group went through torch's real abort (which drops it from c10d's
        # tables); the gloo group was left referenced, never aborted.
        assert all(any(g is old for g in aborted) for old in old_nccl), aborted
        assert not any(g is gloo for g in aborted)
        assert all(old not in torch_private.live_groups() for old in old_nccl)

        new_group = registry.group("tp")
        assert all(new_group is not old for old in old_nccl)
        assert registry.backend("tp") == "nccl"
        y = torch.full((8,), 2.0, device="cuda")
        registry.collectives("tp").all_reduce(y)
        registry.collectives("dp_shard").all_reduce(y)
        torch.cuda.synchronize()
        assert torch.equal(y.cpu(), torch.full((8,), 2.0))
        with pytest.raises(StaleGenerationError):
            old_handle.all_reduce(x)
    finally:
        registry.close()


def test_bound_rebuild_splits_every_nccl_role_from_the_spine(
        bound_nccl_world: None, real_groups: None, aborted: list[Any],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The half of the shrink path one GPU can run: with the default group bound, rebuild() takes
    the world role's NCCL group as the spine and splits every NCCL role of the next generation
    from it (real ncclCommSplit). Nothing is shrunk: a one-rank world loses nobody, and torch's
    shrink_group refuses an empty exclusion and a group of one rank. Where this machine cannot
    shrink, the refusal instead, before anything is retired."""
    registry = cg.GroupRegistry(LAYOUT, create_timeout_s=60).create()
    try:
        assert registry.creation_method("tp") == "split"  # ncclCommSplit of the bound default
        spine = registry.group("dp_shard")  # the first NCCL role spanning the (one-rank) world
        blocker = NcclAdapter().shrink_blocker(spine)
        if blocker is not None:
            with pytest.raises(RebuildError) as caught:
                registry.rebuild(alive=[0], timeout=30)
            print(f"\nbound rebuild refused (this machine cannot shrink): {caught.value}")
            assert "needs shrink_group, which this job lacks" in str(caught.value)
            assert aborted == [] and registry.generation == 0  # refused before retiring
            x = torch.ones(4, device="cuda")
            registry.collectives("tp").all_reduce(x)
            torch.cuda.synchronize()
            assert torch.equal(x.cpu(), torch.ones(4))
            return

        shrinks: list[Any] = []
        splits: list[tuple[Any, Any, Any]] = []
        real_split = dist.split_group

        def split_spy(*args: Any, **kwargs: Any) -> Any:
            splits.append((kwargs.get("parent_pg"), kwargs.get("split_ranks"),
                           kwargs.get("group_desc")))
            return real_split(*args, **kwargs)

        monkeypatch.setattr(dist, "shrink_group", lambda *a, **k: shrinks.append((a, k)))
        monkeypatch.setattr(dist, "split_group", split_spy)
        old_tp, old_handle = registry.group("tp"), registry.collectives("tp")
        report = registry.rebuild(alive=[0], timeout=30)
        print(f"\nbound rebuild from the spine: generation {report.generation}, splits "
              f"{[(desc, ranks) for _, ranks, desc in splits]}, seconds "
              f"{ {k: round(v, 3) for k, v in report.seconds.items()} }")
        assert report.place == "member" and registry.generation == 1
        assert shrinks == []
        assert {desc: (parent is spine, ranks) for parent, ranks, desc in splits} == {
            "dp_shard": (True, [[0]]), "tp": (True, [[0]])}
        # tp's old group aborted through torch's real abort; the spine kept (it is shrunk, or
        # split from, at the next rebuild), never aborted.
        assert any(g is old_tp for g in aborted) and not any(g is spine for g in aborted)
        for role in ("tp", "dp_shard"):
            group = registry.group(role)
            assert group is not spine and group is not old_tp
            assert group is not torch_internals.default_group()
        y = torch.full((8,), 2.0, device="cuda")
        registry.collectives("tp").all_reduce(y)
        registry.collectives("dp_shard").all_reduce(y)
        torch.cuda.synchronize()
        assert torch.equal(y.cpu(), torch.full((8,), 2.0))
        with pytest.raises(StaleGenerationError):
            old_handle.all_reduce(y)
    finally:
        registry.close()


def test_shrink_capability_of_this_machine(bound_nccl_world: None) -> None:
    default = torch_internals.default_group()
    dist.all_reduce(torch.ones(1, device="cuda"))  # the default communicator exists now
    device = torch.device("cuda", 0)
    supports = torch_internals.backend_supports_shrinking(default, device)
    blocker = NcclAdapter().shrink_blocker(default)
    print(f"\nshrink capability: torch {torch.__version__}, NCCL {_nccl_version()}, "
          f"dist.shrink_group exists: {callable(getattr(dist, 'shrink_group', None))}, "
          f"default group's NCCL backend supports_shrinking: {supports}, "
          f"commgroups' blocker: {blocker or 'none (this job could shrink)'}")
    assert callable(getattr(dist, "shrink_group", None))  # torch >= 2.10
    assert supports is not None  # the NCCL backend answers (True from NCCL 2.27)
    assert (blocker is None) == supports
