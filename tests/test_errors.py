"""One input per LayoutError class: each class means what its name says, and names the field and fix.

The single-process cases build specs, read files or construct a registry (whose argument checks run
before any communicator). The cases that need ranks (agreement, world size, device meshes, explicit
rank groups) run on a real 2-rank gloo world.

Its tests that start processes are in ``tests/test_errors_world.py`` (marked ``world``).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import commgroups as cg
from commgroups import errors

ROLE = {"name": "r", "dims": ["cp"]}


def _layout(**role: Any) -> Callable[[], object]:
    """A layout with dims cp=4 and one role: ROLE updated with ``role``."""
    return lambda: cg.Layout(dims={"cp": 4}, roles=[{**ROLE, **role}])


def _parse(text: str, suffix: str) -> Callable[[], object]:
    return lambda: cg.parse_layout(text, suffix, "l" + suffix)


# (class, input that raises it, the field it names, a word of the fix)
CASES: list[tuple[type[errors.LayoutError], Callable[[], object], str, str]] = [
    (errors.LayoutError, lambda: cg.Layout(dims={"cp": 4}, roles=[{"dims": ["cp"]}]),
     "roles[0].name", "add it"),
    (errors.LayoutError, _layout(timeout_s=-1), "roles[0].timeout_s", "in that range"),
    (errors.LayoutError, lambda: cg.GroupRegistry(cg.Layout(dims={"cp": 4}), creation_mode="bogus"),
     "creation_mode", "use one of"),
    (errors.LayoutFileError, _parse("[dims\ncp = 4", ".toml"), None, "correct the syntax"),
    (errors.LayoutFileError, _parse('{"dims": {"cp": 4, "cp": 2}}', ".json"), None, "keep one"),
    (errors.LayoutFileError, _parse("dims: {cp: 4}\nroles: &r [*r]\n", ".yaml"), None,
     "remove the alias"),
    (errors.LayoutError, _layout(timeout_s=True), "roles[0].timeout_s", "in that range"),
    (errors.LayoutError, _layout(timeout_s=float("inf")), "roles[0].timeout_s", "in that range"),
    (errors.LayoutError, _layout(async_and_wait="yes"), "roles[0].async_and_wait",
     "write a boolean"),
    (errors.LayoutError, lambda: cg.GroupRegistry(cg.Layout(dims={"cp": 4}),
                                                  create_timeout_s=float("nan")),
     "create_timeout_s", "in that range"),
    (errors.InvalidSizeError, lambda: cg.Layout(dims={"a": 2**20, "b": 2}), "dims.b",
     "MAX_WORLD_SIZE"),
    (errors.LayoutFileError, _parse("[dims]", ".ini"), None, "use one of"),
    (errors.InvalidNameError, lambda: cg.Layout(dims={"1cp": 2}), "dims.1cp", "start with a letter"),
    (errors.InvalidNameError, lambda: cg.Layout(dims={"world": 2}), "dims.world", "reserved"),
    (errors.InvalidNameError, _layout(name="bad name"), "roles[0].name", "start with a letter"),
    (errors.InvalidSizeError, lambda: cg.Layout(dims={"cp": 0}), "dims.cp", ">= 1"),
    (errors.InvalidSizeError, lambda: cg.Layout(dims={"cp": 2.5}), "dims.cp", "integer"),
    (errors.EmptyDimsError, lambda: cg.Layout(dims={}), "dims", "at least one dim"),
    (errors.EmptyDimsError, _layout(dims=[]), "roles[0].dims", "world"),
    (errors.UnknownDimError, _layout(dims=["tp"]), "roles[0].dims[0]", "add 'tp' to dims"),
    (errors.DimOrderError, lambda: cg.Layout(dims={"a": 2, "b": 2}, roles=[
        {"name": "r", "dims": ["b", "a"]}]), "roles[0].dims", "use ['a', 'b']"),
    (errors.DimOrderError, lambda: cg.RoleSpec(name="r", dims=["cp", "cp"]), "dims[1]",
     "list each dim once"),
    (errors.DimOrderError, lambda: cg.Layout(dims={"a": 2, "b": 2}, views={"v": {"c": 4}}, roles=[
        {"name": "r", "dims": ["a", "c"]}]), "roles[0].dims", "from one view"),
    (errors.InvalidViewError, lambda: cg.Layout(dims={"a": 2, "b": 2}, views={"v": {"c": 3}}),
     "views.v", "equal 4"),
    (errors.InvalidViewError, lambda: cg.Layout(dims={"a": 2, "b": 2}, views={"v": {"b": 4}}),
     "views.v.b", "rename it in the view"),
    (errors.InvalidSizeError, lambda: cg.Layout(dims={"a": 4}, views={"v": {"b": 2, "c": "2"}}),
     "views.v.c", "integer"),
    (errors.InvalidNameError, lambda: cg.Layout(dims={"a": 4}, views={"dims": {"b": 4}}),
     "views.dims", "reserved name 'dims'"),
    (errors.EmptyDimsError, lambda: cg.Layout(dims={"a": 4}, views={"v": {}}), "views.v",
     "list its dims"),
    (errors.DimsOrRanksError, _layout(ranks=[[0, 1]]), "roles[0].dims", "not both"),
    (errors.DimsOrRanksError, lambda: cg.Layout(dims={"cp": 4}, roles=[{"name": "r"}]),
     "roles[0].dims", "set dims"),
    (errors.InvalidRanksError, _layout(dims=None, ranks=[[0, 1], [1, 2]]), "roles[0].ranks[1]",
     "make another role"),
    (errors.InvalidRanksError, _layout(dims=None, ranks=[[0, 4]]), "roles[0].ranks[0]",
     "use ranks 0..3"),
    (errors.InvalidRanksError, _layout(dims=None, ranks=[[-1]]), "roles[0].ranks[0]", ">= 0"),
    (errors.InvalidRanksError, _layout(dims=None, ranks=[[]]), "roles[0].ranks[0]",
     "at least one rank"),
    (errors.DuplicateRoleError, lambda: cg.Layout(dims={"cp": 4}, roles=[ROLE, ROLE]),
     "roles[1].name", "unique name"),
    (errors.UnknownBackendError, _layout(backend="mpi"), "roles[0].backend", "'gloo'"),
    (errors.UnknownFieldError, _layout(timeout=5), "roles[0].timeout", "timeout_s"),
    (errors.UnknownFieldError, _layout(options={"nccl": {"bogus": 1}}),
     "roles[0].options.nccl.bogus", "min_ctas"),
    (errors.UnknownFieldError, lambda: cg.Layout(dims={"cp": 4}, extra=1), "extra", "roles"),
    (errors.InvalidOptionError, _layout(options={"nccl": {"min_ctas": 8, "max_ctas": 2}}),
     "roles[0].options.nccl.min_ctas", "min_ctas <= max_ctas"),
    (errors.InvalidOptionError, _layout(options={"nccl": {"cga_cluster_size": 9}}),
     "roles[0].options.nccl.cga_cluster_size", "in range"),
    (errors.InvalidOptionError, _layout(backend="gloo", options={"nccl": {}}),
     "roles[0].options.nccl", "remove options"),
    (errors.InvalidOptionError, _layout(backend="hccl", options={
        "hccl": {"config": {"hccl_buffer_size": 1}}}),
     "roles[0].options.hccl.config.hccl_buffer_size", "set buffer_size_mb"),
    (errors.InvalidElasticError, lambda: cg.Layout(dims={"dp_replicate": 2, "cp": 2},
                                                   elastic={"dims": {"cp": 1}}),
     "elastic.dims.cp", "remove it"),
    (errors.InvalidElasticError, lambda: cg.Layout(dims={"dp_replicate": 2, "cp": 2},
                                                   elastic={"dims": {"dp_replicate": 3}}),
     "elastic.dims.dp_replicate", "between 1 and 2"),
    (errors.InvalidElasticError, lambda: cg.Layout(dims={"dp_replicate": 2, "cp": 2},
                                                   elastic={"dims": {"dp": 1}}),
     "elastic.dims.dp", "name a dim"),
    (errors.InvalidElasticError, lambda: cg.Layout(
        dims={"dp_replicate": 2, "cp": 2}, views={"v": {"ep": 4}},
        elastic={"dims": {"dp_replicate": 1}}), "views.v", "keep 'dp_replicate' in the view"),
    (errors.InvalidElasticError, lambda: cg.Layout(
        dims={"dp_replicate": 2, "cp": 2}, roles=[{"name": "e", "ranks": [[0, 3]]}],
        elastic={"dims": {"dp_replicate": 1}}), "elastic", "give them dims"),
    (errors.InvalidAutoDimError, lambda: cg.Layout(dims={"dp_replicate": "auto", "cp": 2}),
     "dims.dp_replicate", "cg.AutoLayout"),
    (errors.InvalidAutoDimError, lambda: cg.AutoLayout(
        dims={"dp_replicate": "auto", "dp_shard": "auto"}, elastic={"dims": {"dp_replicate": 1}}),
     "dims.dp_shard", "every dim but one"),
    (errors.InvalidAutoDimError, lambda: cg.AutoLayout(dims={"dp_replicate": "auto", "cp": 2}),
     "dims.dp_replicate", "add it to the elastic section"),
    (errors.InvalidAutoDimError, _parse(
        '[dims]\ndp_shard = "auto"\ntp = 2\n[elastic]\ndims = { dp_replicate = 1 }\n', ".toml"),
     "dims.dp_shard", "add it to the elastic section"),
    (errors.InvalidAutoDimError, lambda: cg.AutoLayout(
        dims={"dp_replicate": "auto", "dp_shard": 2}, views={"moe": {"dp_replicate": 2, "e": 2}},
        elastic={"dims": {"dp_replicate": 1}}), "views.moe", 'dp_replicate = "auto"'),
    (errors.WorldSizeMismatchError, lambda: cg.AutoLayout(
        dims={"dp_replicate": "auto", "dp_shard": 4}, elastic={"dims": {"dp_replicate": 1}},
    ).resolve(6), "dims", "multiple of 4"),
    (errors.WorldSizeMismatchError, lambda: cg.AutoLayout(
        dims={"dp_replicate": "auto", "dp_shard": 2}, elastic={"dims": {"dp_replicate": 2}},
    ).resolve(2), "elastic.dims.dp_replicate", "at least 4 ranks"),
]


@pytest.mark.parametrize(
    ("error", "make", "field", "fix"), CASES,
    ids=[f"{e.__name__}-{f}" for e, _, f, _ in CASES],
)
def test_input_raises_exactly_its_class(
    error: type[errors.LayoutError], make: Callable[[], object], field: str | None, fix: str
) -> None:
    with pytest.raises(errors.LayoutError) as info:
        make()
    assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
    assert info.value.field == field
    message = str(info.value)
    assert "fix:" in message and fix in message, message
    # Braces doubled as in an f-string, where the message is not one, read as TOML nobody can paste.
    assert "{{" not in message and "}}" not in message, message
    if field is not None:
        assert field in message


def test_unreadable_file_is_a_layout_file_error(tmp_path: Path) -> None:
    with pytest.raises(errors.LayoutFileError, match=r"cannot read.*fix: check the path"):
        cg.load_layout(tmp_path / "missing.toml")


def test_every_layout_error_class_has_a_case() -> None:
    shown = {error for error, _, _, _ in CASES}
    # raised where ranks compare layouts or meet the registry: test_rank_dependent_errors_on_a_real_world
    shown |= {errors.LayoutMismatchError, errors.WorldSizeMismatchError, errors.MeshRequestError,
              errors.MeshNotPlannedError}
    layout_errors = {
        cls for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, errors.LayoutError)
    }
    assert layout_errors == shown


def test_each_class_documents_its_inputs() -> None:
    for _, cls in inspect.getmembers(errors, inspect.isclass):
        if issubclass(cls, errors.LayoutError) and cls is not errors.LayoutError:
            assert cls.__doc__ and cls.__doc__ != errors.LayoutError.__doc__, cls
