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
    (errors.LayoutFileError, _parse("[dims\ncp = 4", ".toml"), None, "correct the syntax"),
    (errors.LayoutFileError, _parse('{"dims": {"cp": 4, "cp": 2}}', ".json"), None, "keep one"),
    (errors.LayoutFileError, _parse("dims: {cp: 4}\nroles: &r [*r]\n", ".yaml"), None,
     "remove the alias"),
    (errors.LayoutError, _layout(timeout_s=True), "roles[0].timeout_s", "in that range"),
    (errors.LayoutError, _layout(timeout_s=float("inf")), "roles[0].timeout_s", "in that range"),
    (errors.LayoutError, _layout(async_and_wait="yes"), "roles[0].async_and_wait",
     "write a boolean"),
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

# A bad argument to the registry is an ArgumentError, not a LayoutError: (input, its field, a word of
# the fix). The CLI's options: tests/test_cli_plan.py.
ARGUMENT_CASES: list[tuple[Callable[[], object], str, str]] = [
    (lambda: cg.GroupRegistry(cg.Layout(dims={"cp": 4}), creation_mode="bogus"),
     "creation_mode", "use one of"),
    (lambda: cg.GroupRegistry(cg.Layout(dims={"cp": 4}), create_timeout_s=float("nan")),
     "create_timeout_s", "in that range"),
    (lambda: cg.GroupRegistry(cg.Layout(dims={"cp": 4}), create_timeout_s="300"),
     "create_timeout_s", "give seconds"),
    (lambda: cg.GroupRegistry(cg.Layout(dims={"cp": 4}), meshes=[[3]]),  # type: ignore[list-item]
     "meshes", "device_mesh('fsdp')"),
]


@pytest.mark.parametrize(("make", "field", "fix"), ARGUMENT_CASES,
                         ids=[f for _, f, _ in ARGUMENT_CASES])
def test_bad_argument_is_an_argument_error(make: Callable[[], object], field: str, fix: str) -> None:
    with pytest.raises(errors.ArgumentError) as info:
        make()
    assert not isinstance(info.value, errors.LayoutError), info.value
    assert isinstance(info.value, ValueError)  # callers catching ValueError keep working
    assert info.value.field == field
    message = str(info.value)
    assert "fix:" in message and fix in message and field in message, message


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


ROOT = Path(__file__).resolve().parents[1]
# Where each moved class was defined before it moved into commgroups.errors: the old path still works.
MOVED = {
    "commgroups.audit.merge": ("AuditFileError",),
    "commgroups.integrations": ("MissingRoleError",),
    "commgroups.integrations.common": ("MissingRoleError",),
    "commgroups.integrations.dcp": ("IncompleteCheckpointError", "CheckpointExistsError"),
    "commgroups.integrations.megatron": ("MegatronUnavailableError",),
    "commgroups.integrations.torchtitan.titan_internals": ("TitanSeamError",),
    "commgroups.commands.bench": ("BenchDependencyError",),
    "commgroups.util.local_world": ("WorldInitError",),
    "commgroups.bench.world": ("WorldFailed",),
}


def _exception_classes_defined_outside_errors() -> list[str]:
    """Every class of the package, outside errors.py, whose bases make it an exception.

    Read from the source (every module, the optional integrations too, without importing them):
    a class is an exception when a base is a builtin exception or, by name, another exception
    class of the package or of commgroups.errors.
    """
    import ast
    import builtins

    known = {name for name, value in vars(builtins).items()
             if isinstance(value, type) and issubclass(value, BaseException)}
    known |= {name for name, value in vars(errors).items()
              if isinstance(value, type) and issubclass(value, BaseException)}
    classes: list[tuple[str, ast.ClassDef]] = []
    for base in (ROOT / "commgroups", ROOT / "backends"):
        for path in sorted(base.rglob("*.py")):
            if path.relative_to(ROOT).parts[:2] in (("commgroups", "backends"),
                                                    ("commgroups", "errors.py")):
                continue  # the symlink to ../backends (scanned as backends/), and errors itself
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.ClassDef):
                    classes.append((f"{path.relative_to(ROOT)}:{node.lineno} {node.name}", node))
    found: list[str] = []
    grew = True
    while grew:  # a fixpoint: an exception may derive from one defined later in the walk
        grew = False
        for where, node in classes:
            bases = {b.id if isinstance(b, ast.Name) else b.attr if isinstance(b, ast.Attribute)
                     else "" for b in node.bases}
            if where not in found and bases & known:
                found.append(where)
                known.add(node.name)
                grew = True
    return sorted(found)


def test_every_exception_class_is_defined_in_commgroups_errors() -> None:
    assert _exception_classes_defined_outside_errors() == []
    for name in errors.__all__:
        cls = getattr(errors, name)
        assert inspect.isclass(cls) and issubclass(cls, BaseException), name
    defined = {name for name, cls in inspect.getmembers(errors, inspect.isclass)
               if issubclass(cls, BaseException) and cls.__module__ == errors.__name__}
    assert defined == set(errors.__all__)


def test_moved_exceptions_keep_their_old_import_paths() -> None:
    import importlib

    for module, names in MOVED.items():
        if module.startswith("commgroups.integrations.torchtitan"):
            pytest.importorskip("torchtitan")
        loaded = importlib.import_module(module)
        for name in names:
            assert getattr(loaded, name) is getattr(errors, name), (module, name)


def test_one_class_for_a_registry_that_was_not_created() -> None:
    """The registry's lookups, the audit and torchtitan raise it; old ``except`` clauses hold."""
    registry = cg.GroupRegistry(cg.Layout(dims={"cp": 4}))
    with pytest.raises(errors.RegistryNotCreatedError, match=r"fix: call registry\.create"):
        registry.group("cp")
    with pytest.raises(ValueError, match="no groups yet"), cg.audit.record(registry):
        pass
    with pytest.raises(errors.RegistryNotCreatedError, match=r"fix: call registry\.create"), \
            cg.audit.record(registry):
        pass
    assert issubclass(errors.RegistryNotCreatedError, errors.RegistryStateError)
    assert issubclass(errors.RegistryNotCreatedError, RuntimeError)
    assert issubclass(errors.TitanSeamError, errors.CommGroupsError)
    assert issubclass(errors.TitanSeamError, RuntimeError)


def test_errors_with_keyword_fields_pickle_whole() -> None:
    """An error raised in a worker process reaches its parent with its fields (multiprocessing
    pickles it; the default would call ``cls(message)`` and drop role, op, seq, field)."""
    import pickle

    from commgroups.errors import LayoutError, RoleHangError, StaleGenerationError

    hang = RoleHangError("role 'cp': all_reduce #3 timed out", role="cp", op="all_reduce", seq=3,
                         flight={"behind": [2]})
    back = pickle.loads(pickle.dumps(hang))
    assert type(back) is RoleHangError and str(back) == str(hang)
    assert (back.role, back.op, back.seq, back.flight) == ("cp", "all_reduce", 3, {"behind": [2]})
    stale = pickle.loads(pickle.dumps(StaleGenerationError("x", role=None, generation=2)))
    assert stale.generation == 2 and stale.role is None
    assert pickle.loads(pickle.dumps(LayoutError("bad", field="dims"))).field == "dims"
