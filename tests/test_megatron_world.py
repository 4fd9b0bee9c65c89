"""Megatron-Core on registry groups, on one real 8-rank gloo world shared by every degree combination.

Each rank, for each combination (cp and ep included): creates the registry over
``megatron_layout(...)``, fills Megatron's ``ProcessGroupCollection`` with
``process_group_collection``, and checks every field against the groups Megatron itself creates for
the same degrees and order, on this world: ``HyperCommGrid.create_pg`` (dense and expert grids) and
``parallel_state.initialize_model_parallel`` (``use_mpu_process_groups``, and its gloo groups against
``distributed_optimizer_gloo_groups``). No field is the default group; two fields share a group only
where ``ALIASED_FIELDS`` says Megatron's do. Skips without megatron-core.
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from commgroups.util.local_world import run_local_world
from tests import torch_private

pytestmark = [pytest.mark.world]

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install "
                    "'commgroups[megatron]', Python 3.12): CI's megatron step runs these")

from tests.test_megatron_ranks import COMBOS, Degrees  # noqa: E402  # after the skip: needs megatron

WORLD = 8
PRELOAD = ("torch", "torch.distributed", "commgroups", "megatron.core.parallel_state",
           "megatron.core.process_groups_config", "megatron.core.hyper_comm_grid",
           "tests.test_megatron_world")


def _ranks(group: Any) -> tuple[int, ...] | None:
    import torch.distributed as dist

    return None if group is None else tuple(dist.get_process_group_ranks(group))


def _grid_groups(degrees: Degrees) -> dict[str, tuple[int, ...]]:
    """This rank's groups as Megatron's HyperCommGrid creates them (dense and expert grids)."""
    from megatron.core import parallel_state as ps
    from megatron.core.hyper_comm_grid import HyperCommGrid

    tp, pp, cp, dp, ep, expt_tp, order = degrees
    dense_sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
    expert_sizes = {"tp": expt_tp, "ep": ep, "dp": WORLD // (expt_tp * ep * pp), "pp": pp}
    full = ps.RankGenerator(tp=tp, ep=ep if cp == 1 else 1, dp=dp, pp=pp, cp=cp, order=order).order
    dense_names = [t for t in full.split("-") if t in dense_sizes]
    expert_names = [t for t in full.split("-") if t in expert_sizes]
    dense = HyperCommGrid([dense_sizes[n] for n in dense_names], dense_names)
    expert = HyperCommGrid([expert_sizes[n] for n in expert_names], expert_names)
    wanted = {"tp": (dense, "tp"), "pp": (dense, "pp"), "mp": (dense, ["tp", "pp"]),
              "cp": (dense, "cp"), "tp_cp": (dense, ["tp", "cp"]), "dp": (dense, "dp"),
              "dp_cp": (dense, ["dp", "cp"]), "tp_dp_cp": (dense, ["tp", "dp", "cp"]),
              "ep": (expert, "ep"), "expt_tp": (expert, "tp"), "tp_ep": (expert, ["tp", "ep"]),
              "tp_ep_pp": (expert, ["tp", "ep", "pp"]), "expt_dp": (expert, "dp")}
    try:
        return {field: _ranks(grid.create_pg(dims)) for field, (grid, dims) in wanted.items()}
    finally:
        dense.destroy()
        expert.destroy()


def _parallel_state_groups(degrees: Degrees) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's groups from initialize_model_parallel (fields, then its gloo groups)."""
    from megatron.core import parallel_state as ps
    from megatron.core.process_groups_config import ProcessGroupCollection

    tp, pp, cp, _dp, ep, expt_tp, order = degrees  # dp: the rest of the world, as Megatron derives it
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=expt_tp, order=order,
        create_gloo_process_groups=True)
    try:
        collection = ProcessGroupCollection.use_mpu_process_groups()
        from dataclasses import fields

        mpu = {f.name: _ranks(getattr(collection, f.name)) for f in fields(collection)
               if f.name != "hcp"}
        gloo = {"intra_dp_cp_group_gloo": _ranks(ps.get_data_parallel_group_gloo(
                    with_context_parallel=True, partial_data_parallel=True)),
                "intra_expt_dp_group_gloo": _ranks(ps.get_expert_data_parallel_group_gloo(
                    partial_expert_data_parallel=True)),
                "dp_group_gloo": _ranks(ps.get_data_parallel_group_gloo())}
        return mpu, gloo
    finally:
        ps.destroy_model_parallel()


def _rank_checks(rank: int, world_size: int, post: Any, combos: list[Degrees]) -> dict[str, Any]:
    import torch.distributed as dist

    import commgroups as cg
    from commgroups.integrations import megatron as mg

    problems: list[str] = []
    seconds: dict[str, float] = {}
    unfilled_seen: set[str] = set()
    for degrees in combos:
        tp, pp, cp, dp, ep, expt_tp, order = degrees
        name = "-".join(map(str, degrees))
        start = time.monotonic()
        layout = mg.megatron_layout(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, expt_tp=expt_tp, order=order)
        with cg.GroupRegistry(layout) as registry:
            collection = mg.process_group_collection(registry)
            gloo = mg.distributed_optimizer_gloo_groups(registry)
            ours = {field: _ranks(getattr(collection, field)) for field in mg.FIELD_ROLES}
            ours_gloo = {key: _ranks(group) for key, group in gloo.items()}
            for field in mg.UNFILLED_FIELDS:
                if getattr(collection, field) is None:
                    unfilled_seen.add(field)
            owners: dict[int, str] = {}
            for field, role in mg.FIELD_ROLES.items():
                group = getattr(collection, field)
                if group is None:
                    if field not in ("embd", "pos_embd"):
                        problems.append(f"{name}: {field} is None")
                    continue
                if group is dist.group.WORLD or group is torch_private.default_group():
                    problems.append(f"{name}: {field} is the default group")
                source = field if field not in mg.ALIASED_FIELDS else role
                if id(group) in owners and owners[id(group)] != source:
                    problems.append(f"{name}: {field} shares {owners[id(group)]}'s group")
                owners.setdefault(id(group), source)
            for key, group in gloo.items():
                # a one-rank group runs on commgroups' single-rank backend (no communicator)
                if group.size() > 1 and dist.get_backend(group) != "gloo":
                    problems.append(f"{name}: {key} is not gloo")
        seconds[name + " registry"] = time.monotonic() - start

        start = time.monotonic()
        grid = _grid_groups(degrees)
        seconds[name + " grid"] = time.monotonic() - start
        for field, ranks in grid.items():
            if ours[field] != ranks:
                problems.append(f"{name}: {field} {ours[field]} vs HyperCommGrid {ranks}")

        start = time.monotonic()
        mpu, mpu_gloo = _parallel_state_groups(degrees)
        seconds[name + " parallel_state"] = time.monotonic() - start
        for field, ranks in mpu.items():
            if field in ("dp_cp_ag", "expt_dp_ag", "inter_dist_opt"):
                continue  # None in use_mpu_process_groups (no create_all_gather_groups; 1 instance)
            if ours.get(field, "missing") != ranks:
                problems.append(f"{name}: {field} {ours.get(field)} vs parallel_state {ranks}")
        for key, ranks in mpu_gloo.items():
            if ours_gloo[key] != ranks:
                problems.append(f"{name}: {key} {ours_gloo[key]} vs parallel_state {ranks}")
        # the all-gather twins: dp_cp's and expt_dp's ranks, their own groups
        if ours["dp_cp_ag"] != mpu["dp_cp"] or ours["expt_dp_ag"] != mpu["expt_dp"]:
            problems.append(f"{name}: all-gather groups' ranks differ from dp_cp / expt_dp")
    return {"problems": problems, "seconds": seconds, "unfilled_none": sorted(unfilled_seen)}


def test_collection_matches_megatron_on_8_gloo_ranks() -> None:
    start = time.monotonic()
    reports = run_local_world(_rank_checks, WORLD, COMBOS, timeout_s=240.0, preload=PRELOAD)
    failures = {r: rep.traceback for r, rep in reports.items() if not rep.ok}
    assert not failures, "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
    assert sorted(reports) == list(range(WORLD))
    problems = [p for r in range(WORLD) for p in reports[r].value["problems"]]
    assert not problems, "\n".join(problems)
    assert all(reports[r].value["unfilled_none"] == ["hcp", "inter_dist_opt"] for r in range(WORLD))
    timings = reports[0].value["seconds"]
    print(f"8-rank world, {len(COMBOS)} combinations: {time.monotonic() - start:.1f}s; rank 0: "
          + ", ".join(f"{k} {v:.2f}s" for k, v in timings.items()))
