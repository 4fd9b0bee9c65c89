"""The rule that picks the tests CI's extra torch legs run (tests/README.md, "Which tests run on
every torch"), as ``tests/conftest.py`` computes it at collection."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TORCH_DEPENDENT_MARK, VERSION_INDEPENDENT_MARK, _imports_torch_facing

TESTS = Path(__file__).resolve().parent


def _marked(request: pytest.FixtureRequest) -> dict[str, set[bool]]:
    """Test file name -> whether its collected tests carry the torch_dependent mark."""
    by_file: dict[str, set[bool]] = {}
    for item in request.session.items:
        by_file.setdefault(item.path.name, set()).add(
            item.get_closest_marker(TORCH_DEPENDENT_MARK) is not None)
    return by_file


@pytest.mark.parametrize(("name", "facing"), [
    ("test_torch_internals.py", True),     # commgroups.torch_internals
    ("test_creation.py", True),            # a backend adapter
    ("test_registry_fake.py", True),       # torch.distributed, tests.torch_private
    ("test_specs.py", False),              # layout validation only
    ("test_plan.py", False),               # pure planning
    ("test_hazards.py", False),            # the audit reading made-up records
])
def test_a_files_imports_decide_whether_it_faces_torch(name: str, facing: bool) -> None:
    assert _imports_torch_facing(TESTS / name) is facing


def test_process_worlds_run_on_every_torch_and_version_independent_files_do_not(
        request: pytest.FixtureRequest) -> None:
    marked = _marked(request)
    for path in sorted(TESTS.glob("test_*.py")):
        text = path.read_text()
        if path.name not in marked:
            continue  # not selected in this session (-k, -m, one file)
        if "pytest.mark.version_independent" in text:
            assert marked[path.name] == {False}, path.name
        elif "pytest.mark.world" in text and "pytestmark" in text:
            assert marked[path.name] == {True}, path.name


def test_a_pure_test_with_a_torch_world_fixture_is_torch_dependent(
        request: pytest.FixtureRequest) -> None:
    items = [item for item in request.session.items if "fake_world" in item.fixturenames
             and not item.get_closest_marker(VERSION_INDEPENDENT_MARK)]
    assert all(item.get_closest_marker(TORCH_DEPENDENT_MARK) for item in items)
