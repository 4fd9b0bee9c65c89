"""A rank loss on a Megatron job whose parallel_state is the registry: after the rebuild, Megatron
answers with the new generation, and the old groups fail loudly. One real 8-rank gloo world.

``megatron_layout(tp=2, dp=4, ep=2, expt_tp=1, elastic_dp=2)`` is created and installed in
``parallel_state``; rank 6 dies for good. The even survivors call a bare ``registry.rebuild(alive)``
(``parallel_state`` follows through ``registry.on_rebuilt``, no ``refresh()``); the odd ones call
``handle.rebuild(alive)``. dp shrinks to 3 (rank 6's replica, ranks 6 and 7,
goes; rank 7 is dropped and uninstalls). On the six members every ``parallel_state`` global is
the new generation's group of its role, a fresh ``process_group_collection(registry)`` holds the
groups Megatron's own ``RankGenerator`` gives for tp=2 x dp=3, a collective on the new dp group
works, and one on a group ``parallel_state`` handed out before the loss raises (no hang). Skips
without megatron-core.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.worlds import connected_barrier, run_world

pytestmark = [pytest.mark.world]

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install "
                    "'commgroups[megatron]', Python 3.12): CI's megatron step runs these")

WORLD = 8
VICTIM = 6
ROLE_TIMEOUT_S = 3.0
DEGREES = (2, 1, 1, 4, 2, 1, "tp-cp-ep-dp-pp")  # tp, pp, cp, dp, ep, expt_tp, order


def _ranks(group: Any) -> tuple[int, ...] | None:
    import torch.distributed as dist

    return None if group is None else tuple(dist.get_process_group_ranks(group))


def _lose_a_rank_and_rebuild(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    import commgroups as cg
    from commgroups.integrations import megatron as mg
    from commgroups.integrations.megatron import install
    from tests.test_megatron_ranks import megatron_groups

    tp, pp, cp, dp, ep, expt_tp, order = DEGREES
    layout = mg.megatron_layout(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, expt_tp=expt_tp, order=order,
                                elastic_dp=2, timeout_s=ROLE_TIMEOUT_S)
    registry = cg.GroupRegistry(layout, create_timeout_s=30).create()
    handle = mg.install_parallel_state(registry)
    old_tp, old_dp = ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()
    old_collection = mg.process_group_collection(registry)
    connected_barrier(registry, rank, world, victim=VICTIM)  # rank 6 is gone for good

    started = time.monotonic()
    alive = [r for r in range(world) if r != VICTIM]
    if rank % 2:  # the handle's rebuild
        report = handle.rebuild(alive, timeout=2 * ROLE_TIMEOUT_S + 6)
    else:  # a bare registry.rebuild, as in the guide's loop: parallel_state follows by itself
        report = registry.rebuild(alive, timeout=2 * ROLE_TIMEOUT_S + 6)
    result: dict[str, Any] = {"place": report.place, "generation": registry.generation,
                              "rebuild_s": time.monotonic() - started, "problems": []}
    problems: list[str] = result["problems"]
    if report.place != "member":
        if handle.installed:  # a rank left out is uninstalled by the rebuild
            problems.append("the dropped rank's handle is still installed")
        handle.uninstall()
        if ps.get_tensor_model_parallel_group(check_initialized=False) is not None:
            problems.append("the dropped rank's parallel_state still holds groups")
        registry.close()
        return result

    result["handle_generation"] = handle.generation
    # Every global: the new generation's group of its role (member-only roles: None elsewhere).
    for name, role in install.STATE_ROLES.items():
        value = getattr(ps, name)
        want = None if role is None else registry.group(role)
        if value is not want:
            problems.append(f"{name} is not the new {role} group")
    for name, role in install.RANK_LISTS.items():
        if tuple(getattr(ps, name)) != registry.ranks(role):
            problems.append(f"{name} {getattr(ps, name)} vs the new {role} ranks")
    if ps.get_tensor_model_parallel_group() is old_tp:
        problems.append("get_tensor_model_parallel_group() still answers the old group")
    # A fresh collection: the groups Megatron's RankGenerator gives for the smaller world.
    expected = megatron_groups(tp, pp, cp, len(registry.members) // (tp * pp * cp), ep, expt_tp,
                               order)
    collection = mg.process_group_collection(registry)
    for field in mg.FIELD_ROLES:
        got = _ranks(getattr(collection, field))
        if got is not None and list(got) not in [sorted(g) for g in expected[field]]:
            problems.append(f"collection.{field} {got} is not one of Megatron's {expected[field]}")
        if getattr(collection, field) is getattr(old_collection, field):
            problems.append(f"collection.{field} is the old generation's group")
    # The new dp group carries a collective; a group handed out before the loss fails loudly.
    total = torch.tensor([float(rank)])
    dist.all_reduce(total, group=ps.get_data_parallel_group())
    result["dp_sum"], result["dp_ranks"] = float(total.item()), registry.ranks("dp")
    result["tp_size"], result["dp_size"] = (ps.get_tensor_model_parallel_world_size(),
                                            ps.get_data_parallel_world_size())
    for name, old in (("tp", old_tp), ("dp", old_dp)):
        started = time.monotonic()
        try:
            dist.all_reduce(torch.ones(1), group=old)
            problems.append(f"an all_reduce on the old {name} group succeeded")
        except Exception as error:  # what torch raises for a destroyed or severed group
            result[f"old_{name}_error"] = f"{type(error).__name__}: {str(error)[:120]}"
        result[f"old_{name}_s"] = time.monotonic() - started
    ps.destroy_model_parallel()  # uninstalls and closes the registry
    result["closed"] = registry.state.value
    return result


def test_rebuild_moves_parallel_state_to_the_new_generation() -> None:
    results = run_world(_lose_a_rank_and_rebuild, WORLD, timeout=120, expect_errors=True)
    assert isinstance(results[VICTIM], TimeoutError)  # it never reported: it is gone
    members = [0, 1, 2, 3, 4, 5]
    for rank in [r for r in range(WORLD) if r != VICTIM]:
        result = results[rank]
        assert isinstance(result, dict), f"rank {rank}: {result}"
        assert not result["problems"], f"rank {rank}: " + "\n".join(result["problems"])
        assert result["generation"] == 1
        if rank not in members:
            assert result["place"] == "dropped"
            continue
        assert result["place"] == "member" and result["handle_generation"] == 1
        assert result["tp_size"] == 2 and result["dp_size"] == 3
        assert result["dp_ranks"] == tuple(members[rank % 2::2])
        assert result["dp_sum"] == float(sum(members[rank % 2::2]))
        assert "old_tp_error" in result and "old_dp_error" in result
        assert result["old_tp_s"] < ROLE_TIMEOUT_S + 2 and result["old_dp_s"] < ROLE_TIMEOUT_S + 2
        assert result["closed"] == "closed"
    print({r: {k: v for k, v in results[r].items() if k.startswith(("old_", "rebuild"))}
           for r in (0, 1)})
