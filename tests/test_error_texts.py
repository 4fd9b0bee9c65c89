"""No error text is over 300 characters, and every one names its fix.

Each error is raised through a real call (the tables of ``tests/test_errors.py``,
``tests/test_specs.py``, ``tests/test_megatron_layout.py`` and the cases below); the reasoning
behind an error lives in ``docs/guide.md``, not in its text. The cases that need ranks are in
``tests/test_error_texts_world.py``.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

import commgroups as cg
from commgroups import errors
from tests import test_errors, test_megatron_layout, test_specs

MAX_CHARS = 300


def check_text(error: BaseException) -> None:
    """The contract of every commgroups error text: short, and a fix named."""
    text = str(error)
    assert len(text) <= MAX_CHARS, f"{type(error).__name__} ({len(text)} chars): {text}"
    assert "fix:" in text, f"{type(error).__name__} names no fix: {text}"


def _raised(make: Callable[[], object]) -> BaseException:
    try:
        make()
    except errors.CommGroupsError as error:
        return error
    raise AssertionError(f"{make} raised nothing")


def _many_bad_roles() -> object:
    """Twenty roles, each wrong in three ways: the message lists what fits and counts the rest."""
    return cg.Layout(dims={"cp": 4}, roles=[
        {"name": f"role{i}", "dims": ["cp"], "backend": "mpi", "timeout_s": -1, "bogus": 1}
        for i in range(20)])


def _titan_mismatch() -> object:
    from commgroups.integrations.torchtitan import TitanDegrees, fit_titan_layout

    big = TitanDegrees(pp=2, dp_replicate=2, dp_shard=64, cp=4, tp=8, ep=8)
    return fit_titan_layout({"dims": {"pp": 4, "dp_replicate": 4, "dp_shard": 16, "cp": 8,
                                      "tp": 4}}, big)


def _titan_fit(layout: Any) -> object:
    from commgroups.integrations.torchtitan import fit_titan_layout

    return fit_titan_layout(layout, _titan_degrees())


def _titan_world_mismatch() -> object:
    return _titan_fit({"dims": {"dp_shard": 2, "cp": 4}})


def _dcp() -> Any:
    from commgroups.integrations import dcp

    return dcp


def _missing_role() -> object:
    from commgroups.integrations.common import role_group

    registry = cg.GroupRegistry(cg.Layout(dims={"cp": 4}))
    return role_group(registry, "checkpoint-metadata-for-a-very-long-purpose", "DCP through "
                      "the registry", '[[roles]] name = "checkpoint-metadata", dims = "world"')


LONG = "a" * 64  # the longest name a layout allows (MAX_NAME_LENGTH)

PURE: dict[str, Callable[[], object]] = {
    "several problems": lambda: cg.Layout(dims={"cp": 4}, roles=[
        {"name": "a", "dims": ["cp"], "backend": "mpi", "timeout_s": -1}]),
    "sixty problems": _many_bad_roles,
    "unknown field, long name": lambda: cg.Layout(dims={LONG: 4}, roles=[
        {"name": LONG, "dims": [LONG], "timeoutt": 1}]),
    "unknown option": lambda: cg.Layout(dims={"cp": 4}, roles=[
        {"name": "r", "dims": ["cp"], "options": {"nccl": {"bogus": 1}}}]),
    "unknown dim, sixteen dims": lambda: cg.Layout(
        dims={f"data_parallel_dim_{i}": 1 for i in range(16)},
        roles=[{"name": "a-long-role-name", "dims": ["context_parallel_dim"]}]),
    "view mismatch": lambda: cg.Layout(dims={"a": 2, "b": 2}, views={"v": {"b": 4}}),
    "deep nesting": lambda: cg.Layout.model_validate(
        {"dims": {"cp": 4}, "roles": [{"name": "r", "dims": ["cp"],
                                       "options": {"x": [[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]}}]}),
    "replan, may not shrink": lambda: cg.replan(cg.Layout(dims={"dp_replicate": 2, "cp": 4}),
                                                alive=[0, 1, 2, 3, 4, 6, 7]),
    "replan, below minimum": lambda: cg.replan(
        cg.Layout(dims={"dp_replicate": 2, "cp": 4}, elastic={"dims": {"dp_replicate": 2}}),
        alive=[0, 1, 2, 3, 4, 6, 7]),
    "replan, outside": lambda: cg.replan(
        cg.Layout(dims={"dp_replicate": 2, "dp_shard": 2}, elastic={"dims": {"dp_replicate": 1}}),
        alive=[0, *range(4, 40)]),
    "replan, nobody": lambda: cg.replan(
        cg.Layout(dims={"dp_replicate": 2, "dp_shard": 2}, elastic={"dims": {"dp_replicate": 1}}),
        alive=[]),
    "auto world": lambda: cg.AutoLayout(dims={"dp_replicate": "auto", "dp_shard": 4},
                                        elastic={"dims": {"dp_replicate": 1}}).resolve(6),
    "auto world size type": lambda: cg.AutoLayout(
        dims={"dp_replicate": "auto", "dp_shard": 4},
        elastic={"dims": {"dp_replicate": 1}}).resolve("8"),  # type: ignore[arg-type]
    "auto without a world": lambda: cg.GroupRegistry(cg.AutoLayout(
        dims={"dp_replicate": "auto", "dp_shard": 4}, elastic={"dims": {"dp_replicate": 1}})),
    "not created": lambda: cg.GroupRegistry(cg.Layout(dims={"cp": 4})).group("cp"),
    "create without a world": lambda: cg.GroupRegistry(cg.Layout(dims={"cp": 4})).create(),
    "missing role": _missing_role,
    "titan mismatch": _titan_mismatch,
    "titan mismatch, launch fix": lambda: _titan_fit(cg.Layout(dims={"dp_shard": 2, "cp": 2})),
    "titan world mismatch": lambda: _titan_world_mismatch(),
    "missing file": lambda: cg.load_layout("/no/such/dir/" + "x" * 80 + ".toml"),
    "audit dir": lambda: cg.audit.merge_dir("/no/such/audit/dir"),
    "dcp switch": lambda: _dcp().use_default_group({"COMMGROUPS_DCP_DEFAULT_GROUP": "maybe"}),
    "dcp two groups": lambda: _dcp().save({}, checkpoint_id="/tmp/x", registry=cg.GroupRegistry(
        cg.Layout(dims={"cp": 4})), process_group=object()),
}


def _titan_degrees() -> Any:
    """torchtitan degrees for 4 ranks, cp over all of them."""
    from commgroups.integrations.torchtitan import TitanDegrees

    degrees = TitanDegrees(pp=1, dp_replicate=1, dp_shard=1, cp=4, tp=1, ep=1)
    assert degrees.world_size == 4
    return degrees


@pytest.mark.parametrize("name", list(PURE))
def test_pure_error_texts(name: str) -> None:
    check_text(_raised(PURE[name]))


@pytest.mark.parametrize("case", test_errors.CASES, ids=lambda c: getattr(c, "__name__", None))
def test_layout_error_table(case: tuple[Any, ...]) -> None:
    check_text(_raised(case[1]))


@pytest.mark.parametrize("case", test_errors.ARGUMENT_CASES, ids=[c[1] for c in
                                                                   test_errors.ARGUMENT_CASES])
def test_argument_error_table(case: tuple[Any, ...]) -> None:
    check_text(_raised(case[0]))


@pytest.mark.parametrize("case", test_specs.BAD, ids=[f"{e.__name__}:{f}" for _, e, f in test_specs.BAD])
def test_spec_table(case: tuple[Any, ...]) -> None:
    check_text(_raised(lambda: cg.Layout(**case[0])))


@pytest.mark.parametrize("kwargs", [case[0] for case in test_megatron_layout.BAD_DEGREES], ids=str)
def test_megatron_table(kwargs: dict[str, Any]) -> None:
    from commgroups.integrations import megatron

    check_text(_raised(lambda: megatron.megatron_layout(**kwargs)))


def test_registry_errors_on_a_fake_world(fake_world: Callable[..., None]) -> None:
    """States, membership and threads on one process playing rank 0 of 4."""
    fake_world(4)
    layout = cg.Layout(dims={"cp": 4}, roles=[
        cg.RoleSpec(name="cp", dims=["cp"]), cg.RoleSpec(name="edge", ranks=[[3]])])
    found: list[BaseException] = [_raised(lambda: cg.GroupRegistry(cg.Layout(dims={"cp": 8}))
                                          .create())]
    registry = cg.GroupRegistry(layout).create()
    found.append(_raised(registry.create))
    found.append(_raised(lambda: registry.group("edge")))
    found.append(_raised(lambda: registry.ranks("edge")))
    found.append(_raised(lambda: registry.device_mesh("edge")))
    found.append(_raised(lambda: registry.device_mesh(["cp", "cp"])))
    found.append(_raised(lambda: registry.device_mesh(["cp", "edge"])))
    found.append(_raised(lambda: registry.set_timeout(0)))
    found.append(_raised(lambda: registry.rebuild(alive=[0, 1, 2, 3, 9])))
    handle = registry.collectives("cp")

    def other_thread() -> None:
        import torch

        found.append(_raised(lambda: handle.all_reduce(torch.ones(1))))

    thread = threading.Thread(target=other_thread, name="a-worker-thread-with-a-long-name" * 2)
    thread.start()
    thread.join()
    registry.close()
    found.append(_raised(lambda: registry.group("cp")))
    found.append(_raised(registry.create))
    found.append(_raised(lambda: handle.all_reduce(__import__("torch").ones(1))))
    kinds = {type(error).__name__ for error in found}
    assert {"WorldSizeMismatchError", "RegistryStateError", "NotAMemberError", "MeshRequestError",
            "DimOrderError", "ArgumentError", "ConcurrentRoleUseError", "RebuildError",
            "RegistryClosedError"} <= kinds, kinds
    for error in found:
        check_text(error)


def test_unknown_mesh_axis_names_a_fix(fake_world: Callable[..., None]) -> None:
    fake_world(4)
    with cg.GroupRegistry(cg.Layout(dims={"cp": 4})) as registry:
        check_text(_raised(lambda: registry.device_mesh("tp")))
