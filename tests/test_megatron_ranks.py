"""megatron_layout's planned groups equal Megatron-Core's own, field by field, without processes.

For each degree combination and order the expected groups come from Megatron's ``RankGenerator``
exactly as ``parallel_state.initialize_model_parallel`` calls it (dense and expert generators, the
gtp_remat axis injected by Megatron's own helper) and from ``HyperCommGrid.get_rank_enum``; the
layout's groups come from ``cg.plan``. Skips without megatron-core (``pip install
'commgroups[megatron]'``; CI's megatron step has it).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install "
                    "'commgroups[megatron]', Python 3.12): CI's megatron step runs these")

from megatron.core import parallel_state as ps
from megatron.core.hyper_comm_grid import HyperCommGrid
from megatron.core.process_groups_config import ProcessGroupCollection

import commgroups as cg
from commgroups.errors import DimOrderError
from commgroups.integrations import megatron as mg

Degrees = tuple[int, int, int, int, int, int, str]  # tp, pp, cp, dp, ep, expt_tp, order

COMBOS: list[Degrees] = [
    (2, 2, 1, 2, 2, 1, "tp-cp-ep-dp-pp"),
    (1, 1, 4, 2, 2, 1, "tp-cp-ep-dp-pp"),
    (2, 1, 2, 2, 4, 1, "tp-cp-ep-dp-pp"),
    (1, 1, 8, 1, 8, 1, "tp-cp-ep-dp-pp"),
    (2, 2, 2, 1, 2, 2, "tp-cp-ep-dp-pp"),
    (2, 2, 1, 2, 1, 2, "tp-pp-dp"),
    (2, 1, 2, 2, 2, 1, "cp-tp-dp-ep-pp"),
    (1, 2, 1, 4, 4, 1, "tp-ep-dp-pp"),
]


def megatron_groups(tp: int, pp: int, cp: int, dp: int, ep: int, expt_tp: int,
                    order: str) -> dict[str, list[list[int]]]:
    """Every ProcessGroupCollection field's groups as initialize_model_parallel enumerates them."""
    world = tp * pp * cp * dp
    dense = ps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, gtp_remat=1,
                             order=ps._inject_gtp_remat_axis(order, after="tp"))
    expert = ps.RankGenerator(tp=expt_tp, ep=ep, dp=world // (expt_tp * ep * pp), pp=pp, cp=1,
                              gtp_remat=1, order=ps._inject_gtp_remat_axis(order, after="ep"))
    assert dense.get_ranks("pp") == expert.get_ranks("pp")  # Megatron's own assert
    pp_groups = dense.get_ranks("pp")
    groups = {
        "tp": dense.get_ranks("tp"), "pp": pp_groups, "mp": dense.get_ranks("tp-gtp_remat-pp"),
        "cp": dense.get_ranks("cp"), "tp_cp": dense.get_ranks("tp-cp"),
        "tp_dp_cp": dense.get_ranks("tp-gtp_remat-dp-cp"), "dp": dense.get_ranks("dp"),
        "dp_cp": dense.get_ranks("dp-cp"), "dp_cp_gtp_remat": dense.get_ranks("dp-cp"),
        "dp_cp_ag": dense.get_ranks("dp-cp"), "intra_dp_cp": dense.get_ranks("dp-cp"),
        "gtp_remat": dense.get_gtp_ranks(1),
        "embd": [ps.default_embedding_ranks(g) for g in pp_groups],
        "pos_embd": [ps.default_position_embedding_ranks(g) for g in pp_groups],
        "ep": expert.get_ranks("ep"), "expt_tp": expert.get_ranks("tp"),
        "tp_ep": expert.get_ranks("tp-ep"), "tp_ep_pp": expert.get_ranks("tp-ep-pp"),
        "tp_ep_pp_with_egtp_remat": expert.get_ranks("tp-ep-gtp_remat-pp"),
        "expt_dp": expert.get_ranks("dp"), "expt_dp_gtp_remat": expert.get_ranks("dp"),
        "expt_dp_ag": expert.get_ranks("dp"), "intra_expt_dp": expert.get_ranks("dp"),
        "expt_gtp_remat": expert.get_gtp_ranks(1),
        # one distributed-optimizer instance: the tp-ep-pp groups of all expt_dp replicas together
        "intra_dist_opt": [sorted(r for g in expert.get_ranks("tp-ep-pp") for r in g)],
    }
    return groups


def as_set(groups: list[list[int]] | list[tuple[int, ...]]) -> set[tuple[int, ...]]:
    for group in groups:
        assert list(group) == sorted(group)  # Megatron enumerates ascending: same group rank order
    return {tuple(group) for group in groups}


def planned(layout: cg.Layout) -> dict[str, set[tuple[int, ...]]]:
    plan = cg.plan(layout)
    return {field: as_set(plan.groups(role)) for field, role in mg.FIELD_ROLES.items()}


def test_field_table_covers_megatrons_collection() -> None:
    from dataclasses import fields

    defined = {f.name for f in fields(ProcessGroupCollection)}
    assert set(mg.FIELD_ROLES) | set(mg.UNFILLED_FIELDS) == defined


@pytest.mark.parametrize("degrees", COMBOS, ids=lambda d: "-".join(map(str, d)))
def test_every_field_matches_rank_generator(degrees: Degrees) -> None:
    tp, pp, cp, dp, ep, expt_tp, order = degrees
    layout = mg.megatron_layout(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, expt_tp=expt_tp, order=order)
    expected = megatron_groups(*degrees)
    got = planned(layout)
    for field in mg.FIELD_ROLES:
        assert got[field] == as_set(expected[field]), field
    plan = cg.plan(layout)
    assert plan.groups("dp-gloo") == plan.groups("dp")
    assert plan.groups("dp_cp-gloo") == plan.groups("dp_cp")
    assert plan.groups("expt_dp-gloo") == plan.groups("expt_dp")


@pytest.mark.parametrize("degrees", COMBOS, ids=lambda d: "-".join(map(str, d)))
def test_dense_fields_match_hyper_comm_grid(degrees: Degrees, monkeypatch: pytest.MonkeyPatch) -> None:
    tp, pp, cp, dp, ep, expt_tp, order = degrees
    monkeypatch.setenv("WORLD_SIZE", str(tp * pp * cp * dp))  # HyperCommGrid's no-process path
    sizes = {"tp": tp, "cp": cp, "dp": dp, "pp": pp}
    names = [t for t in ps.RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order).order.split("-")
             if t in sizes]
    grid = HyperCommGrid([sizes[n] for n in names], names)
    got = planned(mg.megatron_layout(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, expt_tp=expt_tp, order=order))
    for field, dims in {"tp": "tp", "pp": "pp", "cp": "cp", "dp": "dp", "mp": ["tp", "pp"],
                        "tp_cp": ["tp", "cp"], "dp_cp": ["dp", "cp"],
                        "tp_dp_cp": ["tp", "dp", "cp"]}.items():
        assert got[field] == as_set(grid.get_rank_enum(dims)), field


def _sweep(world: int) -> Iterator[Degrees]:
    divisors = [d for d in range(1, world + 1) if world % d == 0]
    orders = ["tp-cp-ep-dp-pp", "tp-pp-dp-cp-ep", "pp-dp-cp-ep-tp", "cp-ep-tp-dp-pp"]
    for tp, pp, cp in itertools.product(divisors, repeat=3):
        if world % (tp * pp * cp):
            continue
        dp = world // (tp * pp * cp)
        for ep, expt_tp in itertools.product(divisors, repeat=2):
            if world % (ep * expt_tp * pp) == 0:
                for order in orders:
                    yield tp, pp, cp, dp, ep, expt_tp, order


def test_sweep_of_16_ranks_matches_or_refuses_as_megatron() -> None:
    """Every factorization of 16 ranks with every valid ep/expt_tp, four orders: the same groups, or
    a DimOrderError where Megatron's initialize_model_parallel asserts."""
    checked = refused = 0
    for tp, pp, cp, dp, ep, expt_tp, order in _sweep(16):
        expt_dp = 16 // (expt_tp * ep * pp)
        try:
            expected = megatron_groups(tp, pp, cp, dp, ep, expt_tp, order)
            megatron_ok = order.endswith("pp") or pp == 1 or expt_dp == dp
        except AssertionError:
            megatron_ok = False
        if not megatron_ok:
            with pytest.raises(DimOrderError):
                mg.megatron_layout(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, expt_tp=expt_tp, order=order)
            refused += 1
            continue
        got = planned(mg.megatron_layout(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, expt_tp=expt_tp,
                                         order=order))
        for field in mg.FIELD_ROLES:
            assert got[field] == as_set(expected[field]), (tp, pp, cp, dp, ep, expt_tp, order, field)
        checked += 1
    assert checked > 500 and refused > 0
