"""Shared fixtures (fake-backend worlds) and the automatic ``world`` marker.

Every test that starts other processes (a gloo world through :mod:`tests.worlds` or
:func:`commgroups.util.local_world.run_local_world`, a subprocess, the demo or the bench) is marked
``world`` at collection, found by reading the code it runs: the test function, the fixtures it uses
and, transitively, the test-tree functions they call. ``pytest -m "not world"`` (``make test-fast``)
is then the pure-logic tier. The detector is kept honest at run time: an unmarked test that starts
a process fails, naming itself.
"""

from __future__ import annotations

import inspect
import multiprocessing.process
import subprocess
import types
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch.distributed as dist

WORLD_MARK = "world"

# Modules whose use means a process is started.
_SPAWNING_MODULES = frozenset({"subprocess", "multiprocessing", "torch.multiprocessing"})
# Package entry points that start processes (tests call them; they are not walked).
_SPAWNING_CALLABLES = frozenset({
    "commgroups.util.local_world.run_local_world",
    "commgroups.bench.world.run_world",
    "commgroups.bench.runner.run_bench",
    "commgroups.demo.launch.launch",
    "tools.gpu_check.orchestrate.run_check",
    "tools.gpu_check.orchestrate._run",
})
# The CLI starts processes for these sub-commands only.
_SPAWNING_COMMANDS = frozenset({"demo", "bench"})


def _qualified(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', '')}"


def _codes(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _codes(const)


def _spawns(fn: Callable[..., Any], seen: set[int]) -> bool:
    """Whether ``fn`` (a test-tree function) starts a process, directly or through callees."""
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if code is None or id(code) in seen:
        return False
    seen.add(id(code))
    namespace = getattr(fn, "__globals__", {})
    for part in _codes(code):
        strings = {c for c in part.co_consts if isinstance(c, str)}
        names = set(part.co_names)
        # Imports inside the function: `import subprocess`, `from commgroups.bench import run_bench`.
        if names & _SPAWNING_MODULES:
            return True
        for target in _SPAWNING_CALLABLES:
            module, _, callable_name = target.rpartition(".")
            if callable_name in names and any(module.startswith(n) for n in names if "." in n):
                return True
        for name in part.co_names:
            value = namespace.get(name)
            if value is None:
                continue
            if isinstance(value, types.ModuleType):
                if value.__name__ in _SPAWNING_MODULES:
                    return True
                continue
            qualified = _qualified(value)
            if qualified in _SPAWNING_CALLABLES:
                return True
            if qualified == "commgroups.cli.main" and strings & _SPAWNING_COMMANDS:
                return True
            if (isinstance(value, types.FunctionType)
                    and value.__module__.split(".")[0] == "tests" and _spawns(value, seen)):
                return True
    return False


def _fixture_functions(item: pytest.Item) -> Iterator[Callable[..., Any]]:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return
    for name in item.fixturenames:  # type: ignore[attr-defined]
        for definition in info.name2fixturedefs.get(name, ()):
            func = definition.func
            # The test tree's own fixtures, not pytest's nor the guard below (it names subprocess).
            if (getattr(func, "__module__", "").split(".")[0] == "tests"
                    and func.__name__ != "_unmarked_tests_start_no_process"):
                yield func


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.get_closest_marker(WORLD_MARK):
            continue
        function = getattr(item, "function", None)
        seen: set[int] = set()
        candidates = [function] if function is not None else []
        candidates += list(_fixture_functions(item))
        if any(_spawns(fn, seen) for fn in candidates):
            item.add_marker(WORLD_MARK)


@pytest.fixture(autouse=True)
def _unmarked_tests_start_no_process(request: pytest.FixtureRequest,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the detector honest: a test it did not mark ``world`` may not start a process."""
    if request.node.get_closest_marker(WORLD_MARK):
        return
    name = request.node.nodeid

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(
            f"{name} starts a process but was not marked {WORLD_MARK!r}: teach "
            "tests/conftest.py's detector about the call (or mark the test explicitly)")

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse)


@pytest.fixture
def fake_world() -> Iterator[object]:
    """Factory: init a fake-backend default group of any size in this process; torn down after."""
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  registers backend "fake"
    from torch.testing._internal.distributed.fake_pg import FakeStore

    def init(world_size: int, rank: int = 0) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    yield init
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.fixture(scope="session")
def titan_worlds(request: pytest.FixtureRequest,
                 tmp_path_factory: pytest.TempPathFactory) -> object:
    """The session's torchtitan worlds (tests/titan/worlds.py): each (world, spmd backend) trains
    once, every job the selected tests ask for, on first use."""
    from tests.titan.worlds import TitanWorlds, jobs_of

    return TitanWorlds(jobs_of(request.session.items), tmp_path_factory)
