"""The layout commgroups derives for torchtitan, and a given layout checked against the degrees.

Pure planning: needs neither torchtitan nor torch.distributed.

Its tests that start processes are in ``tests/test_torchtitan_layout_world.py`` (marked ``world``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

import commgroups as cg
from commgroups.errors import InvalidSizeError, UnknownDimError
from commgroups.integrations.torchtitan import (
    TitanDegrees,
    fit_titan_layout,
    resolve_layout,
    titan_layout,
)
from commgroups.integrations.torchtitan.layout import derived_roles
from commgroups.layout.specs import checkpoint_role, default_roles, dim_roles

CP4 = TitanDegrees(pp=1, dp_replicate=1, dp_shard=1, cp=4, tp=1, ep=1)


def test_cp4_layout_names_every_torchtitan_mesh() -> None:
    layout = titan_layout(CP4)
    assert list(layout.dims.items()) == [("pp", 1), ("dp_replicate", 1), ("dp_shard", 1),
                                         ("cp", 4), ("tp", 1)]
    roles = {r.name: r for r in layout.roles}
    assert roles["fsdp"].dims == ["dp_shard", "cp"]
    assert roles["loss"].dims == ["dp_replicate", "dp_shard", "cp"]
    assert roles["batch"].dims == roles["dp"].dims == ["dp_replicate", "dp_shard"]
    assert roles["cp"].dims == ["cp"]
    assert roles[cg.CHECKPOINT_ROLE].backend == "gloo"
    assert roles[cg.CHECKPOINT_ROLE].purpose == "checkpoint"
    assert "efsdp" not in roles and not layout.views
    plan = cg.plan(layout)
    assert plan.groups("cp") == [(0, 1, 2, 3)]


def test_derived_and_built_in_roles_share_one_definition() -> None:
    """torchtitan's roles start with the built-in per-dim roles and end with the built-in
    checkpoint role; the built-in roles are unchanged."""
    degrees = TitanDegrees(pp=2, dp_replicate=1, dp_shard=2, cp=1, tp=2, ep=1)
    roles = derived_roles(degrees)
    per_dim = dim_roles(degrees.dense)
    assert [r.name for r in per_dim] == ["pp", "dp_shard", "tp"]
    assert roles[:len(per_dim)] == per_dim
    assert roles[-1] == checkpoint_role()
    built_in = default_roles({"dp_shard": 2, "cp": 2})
    assert [(r.name, r.dims) for r in built_in] == [
        ("dp_shard", ["dp_shard"]), ("cp", ["cp"]), ("fsdp", ["dp_shard", "cp"]),
        ("checkpoint-metadata", "world")]
    assert built_in[-1] == checkpoint_role()


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


def test_given_layout_keeps_role_settings_and_gets_missing_roles() -> None:
    given = cg.Layout(dims={"cp": 4},  # size-1 dims may be left out
                      roles=[cg.RoleSpec(name="cp", dims=["cp"], timeout_s=60)])
    layout = fit_titan_layout(given, CP4)
    assert list(layout.dims) == ["pp", "dp_replicate", "dp_shard", "cp", "tp"]
    assert layout.role("cp").timeout_s == 60
    assert {"fsdp", "loss", "batch", "dp", cg.CHECKPOINT_ROLE} <= set(layout.role_names)


def test_size_one_dims_a_role_names_need_not_be_listed(tmp_path: Path) -> None:
    """fsdp spans dp_shard x cp; with dp_shard = 1 the file lists cp only."""
    path = tmp_path / "layout.toml"
    path.write_text('[dims]\ncp = 4\n\n[[roles]]\nname = "fsdp"\n'
                    'dims = ["dp_shard", "cp"]\ntimeout_s = 90\n')
    with pytest.raises(UnknownDimError):  # as a plain commgroups layout it is incomplete
        cg.load_layout(path)
    layout = fit_titan_layout(path, CP4)
    assert layout.role("fsdp").dims == ["dp_shard", "cp"]
    assert layout.role("fsdp").timeout_s == 90
    assert layout.dims == CP4.dense


def test_layout_as_a_dict() -> None:
    given = {"dims": {"cp": 4},
             "roles": [{"name": "loss", "dims": ["dp_replicate", "dp_shard", "cp"],
                        "async_and_wait": False}]}
    layout = fit_titan_layout(given, CP4)
    assert layout.role("loss").async_and_wait is False
    assert layout.role("cp").async_and_wait is True
    assert given == {"dims": {"cp": 4},  # the caller's dict is left as it was
                     "roles": [{"name": "loss", "dims": ["dp_replicate", "dp_shard", "cp"],
                                "async_and_wait": False}]}


def test_given_layout_file(tmp_path: Path) -> None:
    path = tmp_path / "layout.toml"
    path.write_text('[dims]\ndp_shard = 2\ncp = 2\n\n[[roles]]\nname = "fsdp"\n'
                    'dims = ["dp_shard", "cp"]\nasync_and_wait = false\n')
    layout = fit_titan_layout(path, TitanDegrees(pp=1, dp_replicate=1, dp_shard=2, cp=2, tp=1, ep=1))
    assert layout.role("fsdp").async_and_wait is False


def test_one_switch_turns_async_and_wait_off_for_every_role() -> None:
    given = cg.Layout(dims={"cp": 4}, roles=[cg.RoleSpec(name="cp", dims=["cp"],
                                                         async_and_wait=True)])
    for layout in (fit_titan_layout(None, CP4, async_and_wait=False),
                   fit_titan_layout(given, CP4, async_and_wait=False)):
        assert len(layout.roles) > 4
        assert not any(role.async_and_wait for role in layout.roles), layout.roles
    assert all(role.async_and_wait for role in fit_titan_layout(None, CP4).roles)


def test_disagreeing_layout_shows_both_factorizations_whole() -> None:
    """Not the first mismatching dim: the whole of both, and a launch fix that can work."""
    with pytest.raises(InvalidSizeError) as info:
        fit_titan_layout(cg.Layout(dims={"dp_shard": 2, "cp": 2}), CP4)
    message = str(info.value)
    # The given dims (dp_shard=2, cp=2) as the whole factorization, size-1 dims as 1.
    assert "layout dims pp=1 x dp_replicate=1 x dp_shard=2 x cp=2 x tp=1 (4 ranks)" in message
    assert "torchtitan's parallelism pp=1 x dp_replicate=1 x dp_shard=1 x cp=4 x tp=1 (4 ranks)" \
        in message
    assert "set the layout's dims to { cp = 4 }" in message
    # Both differing degrees in one launch line (a fix of dp_shard alone would give 8 ranks).
    assert ("--parallelism.data_parallel_shard_degree 2 --parallelism.context_parallel_degree 2"
            in message)
    assert info.value.field == "dims"


def test_disagreeing_world_size_says_no_launch_option_can_match() -> None:
    with pytest.raises(InvalidSizeError, match=r"covers 8 ranks, the job 4, so no launch option"):
        fit_titan_layout({"dims": {"dp_shard": 2, "cp": 4}}, CP4)


def test_layout_role_or_dim_unlike_torchtitans() -> None:
    wrong_role = cg.Layout(dims={"cp": 4}, roles=[cg.RoleSpec(name="fsdp", dims=["cp"])])
    with pytest.raises(UnknownDimError, match=r"'fsdp' spans \['cp'\].*\['dp_shard', 'cp'\]"):
        fit_titan_layout(wrong_role, CP4)
    with pytest.raises(UnknownDimError, match="not a torchtitan dim"):
        fit_titan_layout(cg.Layout(dims={"cp": 2, "sp": 2}), CP4)
    with pytest.raises(TypeError, match="a dict or a layout file path"):
        fit_titan_layout(42, CP4)  # type: ignore[arg-type]


def test_resolve_layout_is_the_old_name_of_fit_titan_layout() -> None:
    assert resolve_layout is fit_titan_layout
    assert resolve_layout(None, CP4) == fit_titan_layout(None, CP4)
    assert resolve_layout is not cg.resolve_layout  # that one sizes an AutoLayout by the world
