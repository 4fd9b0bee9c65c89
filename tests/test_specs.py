"""Layout and RoleSpec validation: every bad input is a specific LayoutError naming field and fix."""

from __future__ import annotations

import doctest
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import commgroups as cg
from commgroups import errors
from commgroups.layout import layout_io, limits, specs


def test_default_roles_follow_torchtitan() -> None:
    layout = cg.Layout(dims={"dp_replicate": 2, "dp_shard": 2, "cp": 2, "tp": 1})
    roles = {r.name: r for r in layout.roles}
    assert list(roles) == ["dp_replicate", "dp_shard", "cp", "fsdp", "checkpoint-metadata"]
    assert roles["fsdp"].dims == ["dp_shard", "cp"]
    assert roles["checkpoint-metadata"].dims == "world"
    assert roles["checkpoint-metadata"].backend == "gloo"
    assert "tp" not in roles  # size-1 dims get no role


def test_seed_layout_defaults() -> None:
    layout = cg.Layout(dims={"dp_shard": 1, "cp": 4})
    assert layout.role_names == ("cp", "fsdp", "checkpoint-metadata")
    assert layout.world_size == 4


def test_explicit_roles_and_options_round_trip() -> None:
    layout = cg.Layout(
        dims={"dp_shard": 2, "cp": 2},
        roles=[
            cg.RoleSpec(name="cp", dims=["cp"], timeout_s=30,
                        options=cg.RoleOptions(nccl=cg.NcclOptions(high_priority_stream=True))),
            cg.RoleSpec(name="ckpt", dims="world", backend="gloo", async_and_wait=False),
            cg.RoleSpec(name="embed", ranks=[[0, 3]]),
        ],
    )
    again = cg.Layout.model_validate(layout.model_dump())
    assert again == layout
    assert cg.plan(again).fingerprint == cg.plan(layout).fingerprint


BAD: list[tuple[dict[str, Any], type[errors.LayoutError], str]] = [
    ({"dims": {}}, errors.EmptyDimsError, "dims"),
    ({"dims": {"cp": 0}}, errors.InvalidSizeError, "dims.cp"),
    ({"dims": {"cp": -2}}, errors.InvalidSizeError, "dims.cp"),
    ({"dims": {"cp": "4"}}, errors.InvalidSizeError, "dims.cp"),
    ({"dims": {"cp": 2.5}}, errors.InvalidSizeError, "dims.cp"),
    ({"dims": {"world": 2}}, errors.InvalidNameError, "dims.world"),
    ({"dims": {"1cp": 2}}, errors.InvalidNameError, "dims.1cp"),
    ({"dims": {"cp": 4}, "roles": [{"name": "cp", "dims": ["cpp"]}]},
     errors.UnknownDimError, "roles[0].dims[0]"),
    ({"dims": {"a": 2, "b": 2}, "roles": [{"name": "x", "dims": ["b", "a"]}]},
     errors.DimOrderError, "roles[0].dims"),
    ({"dims": {"a": 2}, "roles": [{"name": "x", "dims": ["a", "a"]}]},
     errors.DimOrderError, "roles[0].dims[1]"),
    ({"dims": {"cp": 4}, "roles": [{"name": "cp", "dims": ["cp"]}, {"name": "cp", "dims": "world"}]},
     errors.DuplicateRoleError, "roles[1].name"),
    ({"dims": {"cp": 4}, "roles": [{"name": "cp", "dims": []}]}, errors.EmptyDimsError, "roles[0].dims"),
    ({"dims": {"cp": 4}, "roles": [{"name": "cp"}]}, errors.DimsOrRanksError, "roles[0].dims"),
    ({"dims": {"cp": 4}, "roles": [{"name": "cp", "dims": ["cp"], "backend": "mpi"}]},
     errors.UnknownBackendError, "roles[0].backend"),
    ({"dims": {"cp": 4}, "roles": [{"name": "cp", "dims": ["cp"], "timeout": 5}]},
     errors.UnknownFieldError, "roles[0].timeout"),
    ({"dims": {"cp": 4}, "roles": [{"name": "cp", "dims": ["cp"], "options": {"nccl": {"bogus": 1}}}]},
     errors.UnknownFieldError, "roles[0].options.nccl.bogus"),
    ({"dims": {"cp": 4}, "roles": [{"name": "cp", "dims": ["cp"], "options": {"mpi": {}}}]},
     errors.UnknownFieldError, "roles[0].options.mpi"),
    ({"dims": {"cp": 4}, "roles": [{"name": "c", "dims": ["cp"], "backend": "gloo",
                                    "options": {"nccl": {}}}]},
     errors.InvalidOptionError, "roles[0].options.nccl"),
    ({"dims": {"cp": 4}, "roles": [{"name": "c", "dims": ["cp"], "backend": "nccl",
                                    "options": {"hccl": {"buffer_size_mb": 100}}}]},
     errors.InvalidOptionError, "roles[0].options.hccl"),
    ({"dims": {"cp": 4}, "roles": [{"name": "c", "dims": ["cp"], "backend": "hccl",
                                    "options": {"hccl": {"config": {"hccl_buffer_size": 1}}}}]},
     errors.InvalidOptionError, "roles[0].options.hccl.config.hccl_buffer_size"),
    ({"dims": {"cp": 4}, "roles": [{"name": "c", "dims": ["cp"],
                                    "options": {"nccl": {"min_ctas": 8, "max_ctas": 2}}}]},
     errors.InvalidOptionError, "roles[0].options.nccl.min_ctas"),
    ({"dims": {"cp": 4}, "roles": [{"name": "c", "dims": ["cp"], "ranks": [[0]]}]},
     errors.DimsOrRanksError, "roles[0].dims"),
    ({"dims": {"cp": 4}, "roles": [{"name": "c", "ranks": [[0, 1], [1, 2]]}]},
     errors.InvalidRanksError, "roles[0].ranks[1]"),
    ({"dims": {"cp": 4}, "roles": [{"name": "c", "ranks": [[0, 7]]}]},
     errors.InvalidRanksError, "roles[0].ranks[0]"),
    ({"dims": {"cp": 4}, "roles": [{"name": "bad name", "dims": ["cp"]}]},
     errors.InvalidNameError, "roles[0].name"),
    ({"dims": {"cp": 4}, "extra": 1}, errors.UnknownFieldError, "extra"),
    # Without roles, a dim named like a built-in role that is not a dim's own would name two roles.
    ({"dims": {"dp_shard": 2, "fsdp": 2}}, errors.InvalidNameError, "dims.fsdp"),
    ({"dims": {"fsdp": 4, "cp": 2}}, errors.InvalidNameError, "dims.fsdp"),
    ({"dims": {"checkpoint-metadata": 2}}, errors.InvalidNameError, "dims.checkpoint-metadata"),
    # A set's order follows the process's hash seed: ranks could disagree on the role's dims.
    ({"dims": {"cp": 4}, "roles": [{"name": "c", "dims": frozenset({"cp"})}]},
     errors.DimOrderError, "roles[0].dims"),
]


@pytest.mark.parametrize(("data", "error", "field"), BAD, ids=[f"{e.__name__}:{f}" for _, e, f in BAD])
def test_bad_input_names_field_and_fix(data: dict[str, Any], error: type[Exception], field: str) -> None:
    with pytest.raises(error) as info:
        cg.Layout(**data)
    assert info.value.field == field
    message = str(info.value)
    assert field in message
    assert "fix" in message
    # the same input through model_validate (the file path) gives the same error
    with pytest.raises(error):
        cg.Layout.model_validate(data)


def test_errors_are_layout_errors_and_value_errors() -> None:
    for _, error, _ in BAD:
        assert issubclass(error, errors.LayoutError)
        assert issubclass(error, ValueError)


def test_several_problems_are_all_reported() -> None:
    with pytest.raises(errors.LayoutError) as info:
        cg.Layout(dims={"cp": 4}, roles=[{"name": "a", "dims": ["cp"], "backend": "mpi",
                                          "timeout_s": -1}])
    assert "backend" in str(info.value) and "timeout_s" in str(info.value)


def test_role_lookup_lists_known_roles() -> None:
    layout = cg.Layout(dims={"cp": 4})
    with pytest.raises(KeyError, match="known roles: cp, fsdp, checkpoint-metadata"):
        layout.role("tp")


def test_specs_are_immutable() -> None:
    spec = cg.RoleSpec(name="cp", dims=["cp"])
    with pytest.raises(Exception):  # noqa: B017  pydantic's frozen-instance error
        spec.name = "x"  # type: ignore[misc]


@pytest.mark.parametrize("module", [specs, layout_io], ids=lambda m: m.__name__)
def test_docstring_examples_hold(module: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Example sections (what rank 0..3 get, default roles, ...) are run, so they stay true.

    From the repository root, as the examples say (their layout paths are relative to it), whatever
    directory the suite runs from."""
    monkeypatch.chdir(Path(__file__).resolve().parent.parent)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_a_dim_named_like_a_builtin_role_is_refused_at_any_size() -> None:
    """The error is about the dim the user wrote (not about roles[2], which they never wrote), and
    an AutoLayout is refused when built, not once a bigger world resolves it (dp_shard = 1 there
    makes no built-in fsdp, dp_shard = 2 does)."""
    with pytest.raises(errors.InvalidNameError) as info:
        cg.Layout(dims={"dp_shard": 2, "fsdp": 2})
    assert info.value.field == "dims.fsdp"
    assert "declared twice" not in str(info.value) and "rename the dim" in str(info.value)
    with pytest.raises(errors.InvalidNameError) as info:
        cg.AutoLayout(dims={"dp_shard": "auto", "fsdp": 2}, elastic={"dims": {"dp_shard": 1}})
    assert info.value.field == "dims.fsdp"
    # No clash, no error: fsdp alone is its own dim's role; declared roles are the user's.
    assert cg.Layout(dims={"fsdp": 2, "tp": 2}).role_names == ("fsdp", "tp", "checkpoint-metadata")
    declared = cg.Layout(dims={"dp_shard": 2, "fsdp": 2}, roles=[{"name": "fsdp", "dims": ["fsdp"]}])
    assert declared.role_names == ("fsdp",)


@pytest.mark.parametrize("dims", [{"dp_shard", "cp"}, frozenset({"dp_shard", "cp"})],
                         ids=["set", "frozenset"])
def test_a_set_of_role_dims_is_refused_whatever_the_hash_seed(dims: Any) -> None:
    """Refused on every rank alike, not out of order under some PYTHONHASHSEEDs only."""
    with pytest.raises(errors.DimOrderError) as info:
        cg.Layout(dims={"dp_shard": 2, "cp": 2}, roles=[{"name": "fsdp", "dims": dims}])
    assert info.value.field == "roles[0].dims" and "give a list" in str(info.value)
    text = "dims: {dp_shard: 2, cp: 2}\nroles:\n  - name: fsdp\n    dims: !!set {dp_shard, cp}\n"
    with pytest.raises(errors.DimOrderError, match="give a list"):
        cg.parse_layout(text, ".yaml")


def test_with_dims_refuses_a_name_that_is_not_a_dim() -> None:
    layout = cg.Layout(dims={"dp_shard": 2, "cp": 2})
    with pytest.raises(errors.UnknownDimError) as info:
        layout.with_dims(dp_shrad=4)  # misspelt: would have added a dim and doubled the world
    assert info.value.field == "dims.dp_shrad"
    assert "dp_shard, cp" in str(info.value) and "fix:" in str(info.value)
    assert layout.with_dims(cp=4).dims == {"dp_shard": 2, "cp": 4}


def test_json_text_is_checked_as_a_mapping_is() -> None:
    """model_validate_json raises the LayoutError model_validate does, never pydantic's own."""
    with pytest.raises(errors.InvalidSizeError) as info:
        cg.Layout.model_validate_json('{"dims": {"cp": 0}}')
    assert info.value.field == "dims.cp"
    with pytest.raises(errors.LayoutFileError, match="not valid JSON"):
        cg.Layout.model_validate_json('{"dims": ')
    with pytest.raises(errors.LayoutError, match="MAX_LAYOUT_NODES"):
        groups = ", ".join(["[0]"] * (limits.MAX_LAYOUT_NODES // 2 + 1))
        cg.Layout.model_validate_json(
            f'{{"dims": {{"cp": 4}}, "roles": [{{"name": "c", "ranks": [{groups}]}}]}}')
    assert cg.Layout.model_validate_json('{"dims": {"cp": 4}}') == cg.Layout(dims={"cp": 4})
    with pytest.raises(errors.InvalidSizeError):
        cg.Layout.model_validate_strings({"dims": {"cp": "0"}})
