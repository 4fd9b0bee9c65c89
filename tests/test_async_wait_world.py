"""AsyncWaitDist and the async_and_wait_scope() scope: what they patch, restore and issue.

In-process checks use a real 1-rank gloo world; spmd_types' raw blocking paths are checked on a real
4-rank gloo world, observed at the c10d op level through the audit recorder.

The tests that start processes (marked ``world``); the pure ones are in ``tests/test_async_wait.py``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import commgroups as cg
from tests.gloo_support import NO_ALL_TO_ALL, all_to_all_or_note
from tests.test_async_wait import _async_flags
from tests.worlds import run_world

LAYOUTS = Path(__file__).resolve().parent.parent / "examples" / "layouts"
"""The shipped example layouts, found from this file (the suite runs from any directory)."""

pytestmark = pytest.mark.world


SEED = str(LAYOUTS / "seed_cp4.toml")


# ------------------------------------------------------------- spmd_types on 4 gloo ranks
def _spmd_paths(spmd: Any, pg: dist.ProcessGroup, rank: int) -> dict[str, list[Any]]:
    """spmd_types' collectives that 0.3.x still issues as raw blocking torch.distributed calls."""
    from spmd_types.types import P, R, S, V

    out: dict[str, list[Any]] = {}
    x = torch.arange(8.0) + 100 * rank
    inplace = x.clone()
    spmd.all_reduce(inplace, pg, src=P, dst=R, inplace=True)
    out["all_reduce_inplace"] = inplace.tolist()
    out["all_gather_stack"] = spmd.all_gather(x[:2], pg, src=V, dst=R).tolist()
    # gloo's allgather needs equal sizes: equal split_sizes still take the uneven (list) path
    out["all_gather_uneven"] = spmd.all_gather(x[:2], pg, src=S(0), dst=R,
                                               split_sizes=[2, 2, 2, 2]).tolist()
    out["reduce_scatter_stack"] = spmd.reduce_scatter(x[:4].reshape(4, 1), pg, src=P,
                                                      dst=V).tolist()
    out["reduce_scatter_uneven"] = spmd.reduce_scatter(x, pg, src=P, dst=S(0),
                                                       split_sizes=[1, 2, 3, 2]).tolist()
    out["all_to_all_stack"] = all_to_all_or_note(
        lambda: spmd.all_to_all(x[:4].reshape(4, 1), pg, src=V, dst=V).tolist())
    # gloo's alltoall (list form) needs equal sizes too: equal split sizes, the uneven path
    out["all_to_all_uneven"] = all_to_all_or_note(
        lambda: spmd.all_to_all(x, pg, src=V, dst=V, input_split_sizes=[2] * 4,
                                output_split_sizes=[2] * 4).tolist())
    return out


def _spmd_world(rank: int, world: int) -> dict[str, Any]:
    import spmd_types as spmd

    registry = cg.GroupRegistry(cg.load_layout(SEED)).create()
    try:
        pg = registry.group("cp")
        result: dict[str, Any] = {"version": getattr(spmd, "__version__", None)}
        with cg.audit.record(registry) as rec:
            result["raw"] = _spmd_paths(spmd, pg, rank)
        result["raw_calls"] = _async_flags(rec)
        spmd.set_dist(cg.AsyncWaitDist())
        try:
            with cg.audit.record(registry) as rec:
                result["set_dist"] = _spmd_paths(spmd, pg, rank)
        finally:
            spmd.set_dist(None)
        result["set_dist_calls"] = _async_flags(rec)
        result["callers"] = sorted({r.caller.split(":")[0].rsplit("/", 1)[-1] for r in rec.records})
        with cg.audit.record(registry) as rec, cg.async_and_wait_scope():
            result["scope"] = _spmd_paths(spmd, pg, rank)
        result["scope_calls"] = _async_flags(rec)
        result["dist_after"] = spmd._dist.dist is dist
        return result
    finally:
        registry.close()


@pytest.fixture(scope="module")
def spmd_results() -> list[dict[str, Any]]:
    """One 4-rank gloo world for every spmd_types check."""
    pytest.importorskip("spmd_types")
    return run_world(_spmd_world, 4)


def test_spmd_raw_paths_are_blocking_without_the_async_and_wait(
    spmd_results: list[dict[str, Any]],
) -> None:
    # the baseline: these are the calls that race FSDP on NCCL; the observation sees them blocking
    for result in spmd_results:
        blocking = [op for op, async_op in result["raw_calls"] if async_op is False]
        ran = [path for path, value in result["raw"].items() if value != NO_ALL_TO_ALL]
        assert len(ran) >= 5 and len(blocking) >= len(ran), (ran, blocking)  # one+ per path


@pytest.mark.parametrize("variant", ["set_dist", "scope"])
def test_spmd_through_the_async_and_wait_issues_nothing_blocking(
    spmd_results: list[dict[str, Any]], variant: str,
) -> None:
    for result in spmd_results:
        calls = result[f"{variant}_calls"]
        assert len(calls) == len(result["raw_calls"]) >= 7
        assert [op for op, _ in calls] == [op for op, _ in result["raw_calls"]]
        assert [op for op, async_op in calls if async_op is not True] == []
        assert result[variant] == result["raw"]  # same numbers


def test_spmd_results_are_right(spmd_results: list[dict[str, Any]]) -> None:
    r0, r2 = spmd_results[0]["set_dist"], spmd_results[2]["set_dist"]
    total = [600.0 + 4 * i for i in range(8)]  # sum over ranks of arange(8) + 100 * rank
    assert r0["all_reduce_inplace"] == total
    assert r0["all_gather_stack"] == [[100.0 * r, 100.0 * r + 1] for r in range(4)]
    assert r0["all_gather_uneven"] == [v for r in range(4) for v in (100.0 * r, 100.0 * r + 1)]
    assert r2["reduce_scatter_stack"] == [total[2]]
    assert r2["reduce_scatter_uneven"] == total[3:6]
    assert spmd_results[0]["dist_after"]  # set_dist(None) put torch.distributed back


def test_spmd_all_to_all_is_right(spmd_results: list[dict[str, Any]]) -> None:
    r2 = spmd_results[2]["set_dist"]
    if r2["all_to_all_stack"] == NO_ALL_TO_ALL:
        pytest.skip(f"torch {torch.__version__}: {NO_ALL_TO_ALL}")
    assert r2["all_to_all_stack"] == [[100.0 * r + 2] for r in range(4)]
    assert r2["all_to_all_uneven"] == [v for r in range(4) for v in (100.0 * r + 4, 100.0 * r + 5)]


def test_spmd_caller_is_spmd_types(spmd_results: list[dict[str, Any]]) -> None:
    # the first frame outside torch and commgroups is spmd_types' own
    assert spmd_results[0]["callers"] == ["_collectives.py"]
