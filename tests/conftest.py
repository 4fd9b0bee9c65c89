"""Shared fixtures (fake-backend worlds) and the ``world`` mark's safety net.

Every test file that starts other processes (a gloo world through :mod:`tests.worlds` or
:func:`commgroups.util.local_world.run_local_world`, a subprocess, the demo or the bench) says so
itself: ``pytestmark = pytest.mark.world``. Where a module also has pure tests, its process tests
are in ``tests/test_<module>_world.py`` (tests/README.md). ``pytest -m "not world"``
(``make test-fast``) is then the pure-logic tier. The mark is kept honest at run time: a test
without it that starts a process fails, naming itself.
"""

from __future__ import annotations

import ast
import functools
import multiprocessing.process
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

WORLD_MARK = "world"
TORCH_DEPENDENT_MARK = "torch_dependent"
VERSION_INDEPENDENT_MARK = "version_independent"

TORCH_FACING_IMPORTS = (
    "torch.distributed", "torch.testing", "commgroups.torch_internals", "commgroups.backends",
    "backends", "tests.torch_private", "tests.nccl_fakes", "tests.worlds", "tests.gloo_support",
    "torchtitan", "spmd_types", "megatron",
)
"""Imports through which a test file reaches torch's distributed runtime, torch's private names or
a client framework built on them (tests/README.md, "Which tests run on every torch")."""

TORCH_WORLD_FIXTURES = frozenset({"fake_world", "one_rank", "titan_worlds"})
"""Fixtures that make a torch world in the test's own process (fake backend, one gloo rank)."""


@functools.cache
def _imports_torch_facing(path: Path) -> bool:
    """Whether the test file at ``path`` imports one of :data:`TORCH_FACING_IMPORTS`."""
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
        else:
            continue
        if any(name == facing or name.startswith(facing + ".")
               for name in names for facing in TORCH_FACING_IMPORTS):
            return True
    return False


def is_torch_dependent(item: pytest.Item) -> bool:
    """The rule that picks the tests CI's extra torch legs run (tests/README.md): a test whose
    outcome can depend on torch's version. Not ``version_independent``, and it starts processes
    (``world``: they run torch.distributed), makes a torch world in process (a fixture of
    :data:`TORCH_WORLD_FIXTURES`), or its file imports a name of :data:`TORCH_FACING_IMPORTS`."""
    if item.get_closest_marker(VERSION_INDEPENDENT_MARK):
        return False
    if item.get_closest_marker(WORLD_MARK):
        return True
    if TORCH_WORLD_FIXTURES & set(getattr(item, "fixturenames", ())):
        return True
    return _imports_torch_facing(Path(str(item.path)))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test the rule of :func:`is_torch_dependent` picks ``torch_dependent``."""
    for item in items:
        if is_torch_dependent(item):
            item.add_marker(TORCH_DEPENDENT_MARK)


def _font_cache_probe(args: Any) -> bool:
    """matplotlib runs ``fc-list`` when it builds its font cache (first font use on a machine, or
    with a fresh MPLCONFIGDIR): the machine's cache state starts it, not the test."""
    argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args)
    return bool(argv) and os.path.basename(os.fsdecode(argv[0])) == "fc-list"


@pytest.fixture(autouse=True)
def _unmarked_tests_start_no_process(request: pytest.FixtureRequest,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A test not marked ``world`` may not start a process (matplotlib's font-cache probe aside)."""
    if request.node.get_closest_marker(WORLD_MARK):
        return
    name = request.node.nodeid
    message = (f"{name} starts a process but is not marked {WORLD_MARK!r}: move it to a file marked "
               "`pytestmark = pytest.mark.world` (tests/README.md)")
    popen_init = subprocess.Popen.__init__

    def refuse_start(*args: Any, **kwargs: Any) -> None:
        raise AssertionError(message)

    def refuse_popen(self: subprocess.Popen[Any], args: Any, *rest: Any, **kwargs: Any) -> None:
        if _font_cache_probe(args):
            popen_init(self, args, *rest, **kwargs)
            return
        raise AssertionError(message)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse_start)
    monkeypatch.setattr(subprocess.Popen, "__init__", refuse_popen)


@pytest.fixture
def fake_world() -> Iterator[object]:
    """Factory: init a fake-backend default group of any size in this process; torn down after."""
    from tests import torch_private

    FakeStore = torch_private.fake_store()  # registers backend "fake"

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


@pytest.fixture(scope="module")
def one_rank() -> Iterator[dist.ProcessGroup]:
    """A real 1-rank gloo world in this process, with one dedicated gloo group (pure tests that
    need a real group without starting processes: async-and-wait, the flight recorder)."""
    if dist.is_initialized():
        pytest.skip("another test left a default group initialized in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield dist.new_group([0], backend="gloo")
    finally:
        dist.destroy_process_group()
