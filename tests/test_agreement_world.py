"""Agreement: ranks holding different layouts always get LayoutMismatchError, on every rank.

The tests that start processes (marked ``world``); the pure ones are in ``tests/test_agreement.py``.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

import commgroups as cg
from tests.worlds import run_world

pytestmark = pytest.mark.world


BASE = cg.Layout(dims={"dp_shard": 2, "cp": 2})


def _variants() -> list[tuple[str, cg.Layout]]:
    roles = list(BASE.roles)
    cp = BASE.role("cp")
    swap = [r.model_copy(update={"backend": "gloo"}) if r.name == "cp" else r for r in roles]
    return [
        ("dims sizes", cg.Layout(dims={"dp_shard": 4, "cp": 1})),
        ("dims order", cg.Layout(dims={"cp": 2, "dp_shard": 2}, roles=[
            cg.RoleSpec(name="checkpoint-metadata", dims="world", backend="gloo")])),
        ("role dropped", cg.Layout(dims=BASE.dims, roles=roles[1:])),
        ("role added", cg.Layout(dims=BASE.dims, roles=[*roles, cg.RoleSpec(name="x", dims=["cp"])])),
        ("roles reordered", cg.Layout(dims=BASE.dims, roles=[roles[1], roles[0], *roles[2:]])),
        ("backend", cg.Layout(dims=BASE.dims, roles=swap)),
        ("options", cg.Layout(dims=BASE.dims, roles=[
            cp.model_copy(update={"options": cg.RoleOptions(nccl=cg.NcclOptions(min_ctas=2))})
            if r.name == "cp" else r for r in roles])),
        ("timeout", cg.Layout(dims=BASE.dims, roles=[
            r.model_copy(update={"timeout_s": 99.0}) if r.name == "cp" else r for r in roles])),
        ("async_and_wait", cg.Layout(dims=BASE.dims, roles=[
            r.model_copy(update={"async_and_wait": False}) if r.name == "fsdp" else r for r in roles])),
        ("explicit ranks", cg.Layout(dims=BASE.dims, roles=[
            *roles, cg.RoleSpec(name="edge", ranks=[[0, 3]])])),
    ]


def _cases(seed: int = 7) -> list[tuple[str, list[int]]]:
    rng = random.Random(seed)
    cases = []
    for name, _ in _variants():
        for _ in range(2):
            size = rng.randint(1, 3)
            cases.append((name, sorted(rng.sample(range(4), size))))
    return cases


def _agree_on_cases(rank: int, world_size: int, cases: list[tuple[str, list[int]]]) -> list[Any]:
    variants = dict(_variants())
    out: list[Any] = []
    for name, differing in cases:
        layout = variants[name] if rank in differing else BASE
        try:
            cg.GroupRegistry(layout, create_timeout_s=30).create().close()
            out.append(("created", None))
        except cg.errors.LayoutMismatchError as error:
            out.append(("mismatch", str(error)))
        except cg.errors.CommGroupsError as error:
            out.append((type(error).__name__, str(error)))
    return out


def test_every_difference_is_a_mismatch_on_every_rank() -> None:
    cases = _cases()
    results = run_world(_agree_on_cases, 4, cases, timeout=240)
    for index, (name, differing) in enumerate(cases):
        outcomes = [results[rank][index] for rank in range(4)]
        assert all(kind == "mismatch" for kind, _ in outcomes), (name, differing, outcomes)
        assert len({message for _, message in outcomes}) == 1, "same message on every rank"
        named = differing if 0 not in differing else [r for r in range(4) if r not in differing]
        assert outcomes[0][1].startswith(f"ranks {named} built a different layout"), (
            name, differing, outcomes[0][1])
