"""The layout commgroups derives for torchtitan, and a given layout checked against the degrees.

Pure planning: needs neither torchtitan nor torch.distributed.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import commgroups as cg
from commgroups.errors import InvalidSizeError, LayoutError, UnknownDimError
from commgroups.integrations.torchtitan import TitanDegrees, resolve_layout, titan_layout


def parallelism(**degrees: int) -> SimpleNamespace:
    base = {"pipeline_parallel_degree": 1, "data_parallel_replicate_degree": 1,
            "data_parallel_shard_degree": -1, "context_parallel_degree": 1,
            "tensor_parallel_degree": 1, "expert_parallel_degree": 1}
    return SimpleNamespace(spmd_backend="spmd_types", **{**base, **degrees})


def test_cp4_layout_names_every_torchtitan_mesh() -> None:
    degrees = TitanDegrees.from_parallelism(parallelism(context_parallel_degree=4), 4)
    assert degrees.dp_shard == 1  # -1 took the remaining ranks
    layout = titan_layout(degrees)
    assert list(layout.dims.items()) == [("pp", 1), ("dp_replicate", 1), ("dp_shard", 1),
                                         ("cp", 4), ("tp", 1)]
    roles = {r.name: r for r in layout.roles}
    assert roles["fsdp"].dims == ["dp_shard", "cp"]
    assert roles["loss"].dims == ["dp_replicate", "dp_shard", "cp"]
    assert roles["batch"].dims == roles["dp"].dims == ["dp_replicate", "dp_shard"]
    assert roles["cp"].dims == ["cp"]
    assert roles[cg.CHECKPOINT_ROLE].backend == "gloo"
    assert "efsdp" not in roles and not layout.views
    plan = cg.plan(layout)
    assert plan.groups("cp") == [(0, 1, 2, 3)]


def test_expert_parallel_view() -> None:
    degrees = TitanDegrees(pp=1, dp_replicate=1, dp_shard=2, cp=2, tp=1, ep=2)
    layout = titan_layout(degrees)
    assert layout.views["sparse"] == {"pp": 1, "dp_replicate": 1, "efsdp": 2, "ep": 2}
    plan = cg.plan(layout)
    assert plan.groups("ep") == [(0, 1), (2, 3)]
    assert plan.groups("efsdp") == [(0, 2), (1, 3)]


def test_partial_dtensor_has_no_dp_role() -> None:
    layout = titan_layout(TitanDegrees(pp=1, dp_replicate=1, dp_shard=2, cp=2, tp=1, ep=1,
                                       spmd_backend="partial_dtensor"))
    assert "dp" not in layout.role_names


@pytest.mark.parametrize(("degrees", "world", "error"), [
    ({"context_parallel_degree": 4, "data_parallel_shard_degree": 2}, 4, InvalidSizeError),
    ({"context_parallel_degree": 0}, 4, InvalidSizeError),
    ({"data_parallel_shard_degree": 4, "expert_parallel_degree": 3}, 4, InvalidSizeError),
])
def test_bad_degrees(degrees: dict[str, int], world: int, error: type[LayoutError]) -> None:
    with pytest.raises(error, match="fix:"):
        TitanDegrees.from_parallelism(parallelism(**degrees), world)


def test_given_layout_keeps_role_settings_and_gets_missing_roles() -> None:
    degrees = TitanDegrees(pp=1, dp_replicate=1, dp_shard=1, cp=4, tp=1, ep=1)
    given = cg.Layout(dims={"cp": 4},  # size-1 dims may be left out
                      roles=[cg.RoleSpec(name="cp", dims=["cp"], timeout_s=60)])
    layout = resolve_layout(given, degrees)
    assert list(layout.dims) == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]
    assert layout.role("cp").timeout_s == 60
    assert {"fsdp", "loss", "batch", "dp", cg.CHECKPOINT_ROLE} <= set(layout.role_names)


def test_given_layout_file(tmp_path: pytest.TempPathFactory) -> None:
    path = tmp_path / "layout.toml"  # type: ignore[operator]
    path.write_text('[dims]\ndp_shard = 2\ncp = 2\n\n[[roles]]\nname = "fsdp"\n'
                    'dims = ["dp_shard", "cp"]\nasync_and_wait = false\n')
    layout = resolve_layout(path, TitanDegrees(pp=1, dp_replicate=1, dp_shard=2, cp=2, tp=1, ep=1))
    assert layout.role("fsdp").async_and_wait is False


def test_disagreeing_layout_names_both_sides() -> None:
    degrees = TitanDegrees(pp=1, dp_replicate=1, dp_shard=1, cp=4, tp=1, ep=1)
    with pytest.raises(InvalidSizeError, match=r"layout dims.dp_shard=2 but torchtitan's "
                       r"parallelism.data_parallel_shard_degree gives dp_shard=1") as info:
        resolve_layout(cg.Layout(dims={"dp_shard": 2, "cp": 2}), degrees)
    assert info.value.field == "dims.dp_shard"
    wrong_role = cg.Layout(dims={"cp": 4}, roles=[cg.RoleSpec(name="fsdp", dims=["cp"])])
    with pytest.raises(UnknownDimError, match=r"'fsdp' spans \['cp'\].*\['dp_shard', 'cp'\]"):
        resolve_layout(wrong_role, degrees)
    with pytest.raises(UnknownDimError, match="not a torchtitan dim"):
        resolve_layout(cg.Layout(dims={"cp": 2, "sp": 2}), degrees)


def test_importing_commgroups_never_imports_torchtitan() -> None:
    import subprocess
    import sys

    code = ("import sys, commgroups, commgroups.integrations.torchtitan as t; "
            "t.titan_layout(t.TitanDegrees(pp=1, dp_replicate=1, dp_shard=2, cp=2, tp=1, ep=1)); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torchtitan', 'tyro')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
