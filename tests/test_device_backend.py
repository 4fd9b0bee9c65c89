"""What ``device`` means here: the torch_npu probe of ``detect_device_backend`` (no torch_npu is
installed on these machines; it must never be installed here, see facts.md)."""

from __future__ import annotations

import sys
from collections.abc import Iterator, Sequence
from importlib.abc import MetaPathFinder
from importlib.machinery import ModuleSpec
from types import ModuleType

import pytest

from commgroups.backends.detection import detect_device_backend
from commgroups.backends.hccl import npu_available


class _Watch(MetaPathFinder):
    """Records every attempt to import torch_npu and lets it fail as on a machine without it."""

    def __init__(self) -> None:
        self.tries = 0

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> ModuleSpec | None:
        if fullname == "torch_npu":
            self.tries += 1
        return None


@pytest.fixture
def watch() -> Iterator[_Watch]:
    finder = _Watch()
    sys.meta_path.insert(0, finder)
    try:
        yield finder
    finally:
        sys.meta_path.remove(finder)


def test_with_autoload_on_an_absent_torch_npu_is_not_imported_again(watch: _Watch) -> None:
    assert "torch_npu" not in sys.modules
    assert npu_available() is False
    assert detect_device_backend() == "gloo"
    assert watch.tries == 0  # import torch would have loaded it: no sys.path walk per create()


def test_with_autoload_off_torch_npu_is_tried_and_its_absence_is_no_npu(
        watch: _Watch, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")  # a launcher's setting (test only)
    assert npu_available() is False
    assert watch.tries == 1
