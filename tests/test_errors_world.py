"""One input per LayoutError class: each class means what its name says, and names the field and fix.

The single-process cases build specs, read files or construct a registry (whose argument checks run
before any communicator). The cases that need ranks (agreement, world size, device meshes, explicit
rank groups) run on a real 2-rank gloo world.

The tests that start processes (marked ``world``); the pure ones are in ``tests/test_errors.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

import commgroups as cg
from commgroups import errors
from tests.worlds import run_world

pytestmark = pytest.mark.world


def _ranked(rank: int, world_size: int) -> dict[str, str]:
    """Each rank-dependent LayoutError, as 'ClassName|field|message' per case."""
    out: dict[str, str] = {}

    def attempt(name: str, action: Callable[[], object]) -> None:
        try:
            action()
            out[name] = "no error"
        except errors.CommGroupsError as error:
            out[name] = f"{type(error).__name__}|{getattr(error, 'field', None)}|{error}"

    mine = cg.Layout(dims={"cp": 2}, roles=[cg.RoleSpec(name="cp", dims=["cp"], timeout_s=rank + 1)])
    attempt("mismatch", lambda: cg.GroupRegistry(mine).create())
    attempt("world", lambda: cg.GroupRegistry(cg.Layout(dims={"cp": 4})).create())
    # Restart mode: the "auto" dim is sized by the world, on every rank alike, before any group.
    attempt("auto_world", lambda: cg.GroupRegistry(cg.AutoLayout(
        dims={"dp_shard": "auto", "tp": 4}, elastic={"dims": {"dp_shard": 1}})))
    layout = cg.Layout(dims={"a": 2, "b": 1}, roles=[
        cg.RoleSpec(name="a", dims=["a"], backend="gloo"),
        cg.RoleSpec(name="edge", ranks=[[0]], backend="gloo"),
    ])
    with cg.GroupRegistry(layout) as registry:
        attempt("mesh_unknown", lambda: registry.device_mesh("tp"))
        attempt("mesh_ranks", lambda: registry.device_mesh("edge"))
        attempt("not_member", lambda: registry.group("edge"))
        attempt("mesh_order", lambda: registry.device_mesh(["a", "a"]))  # a dim twice
        attempt("mesh_type", lambda: registry.device_mesh(3))  # type: ignore[arg-type]
    # A dim no role covers has a group only when a declared mesh planned one: lookups never create.
    bare = cg.Layout(dims={"a": 2}, roles=[cg.RoleSpec(name="w", dims="world", backend="gloo")])
    with cg.GroupRegistry(bare) as registry:
        attempt("mesh_not_planned", lambda: registry.device_mesh("a"))
    with cg.GroupRegistry(bare, meshes=[["a"]]) as registry:
        attempt("mesh_planned", lambda: registry.device_mesh("a"))
    return out


def test_rank_dependent_errors_on_a_real_world() -> None:
    results = run_world(_ranked, 2)
    for rank, out in enumerate(results):
        assert out["mismatch"].startswith("LayoutMismatchError|"), out["mismatch"]
        assert "timeout_s" in out["mismatch"]
        assert out["world"].startswith("WorldSizeMismatchError|"), out["world"]
        assert "fix" in out["world"]
        assert out["auto_world"].startswith("WorldSizeMismatchError|dims|"), out["auto_world"]
        assert "multiple of 4" in out["auto_world"]
        assert out["mesh_unknown"].startswith("UnknownDimError|dims|"), out["mesh_unknown"]
        assert out["mesh_ranks"].startswith("MeshRequestError|dims|"), out["mesh_ranks"]
        assert "fix" in out["mesh_ranks"]
        assert out["mesh_order"].startswith("DimOrderError|dims|"), out["mesh_order"]
        assert out["mesh_type"].startswith("ArgumentError|dims_or_role|"), out["mesh_type"]
        assert out["mesh_not_planned"].startswith("MeshNotPlannedError|meshes|"), out
        assert "fix: declare the mesh" in out["mesh_not_planned"]
        assert out["mesh_planned"] == "no error", out["mesh_planned"]
        expected = "no error" if rank == 0 else "NotAMemberError|None|"
        assert out["not_member"].startswith(expected), out["not_member"]
