"""The supported torch range is one fact: pyproject, README and commgroups.torch_internals.version agree."""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

from commgroups.errors import TorchVersionError
from commgroups.torch_internals.version import SUPPORTED_FROM, parse_version, require_torch, torch_version

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_pyproject_and_readme_declare_the_supported_floor() -> None:
    floor = ".".join(map(str, SUPPORTED_FROM[:2]))
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.findall(r'"torch>=([0-9.]+)"', pyproject) == [floor]
    assert f"torch >= {floor}" in (ROOT / "README.md").read_text()


def test_the_running_torch_is_supported() -> None:
    assert torch_version() >= SUPPORTED_FROM, torch.__version__


def test_a_feature_needing_a_newer_torch_names_the_version_and_why() -> None:
    require_torch(SUPPORTED_FROM[:2], "anything", "the floor")  # the floor always passes
    with pytest.raises(TorchVersionError, match=r"needs torch >= 99\.0 \(because\).*pip install"):
        require_torch((99, 0), "a future feature", "because")


def test_parse_version() -> None:
    assert parse_version("2.15.0+cu132") == (2, 15, 0)
    assert parse_version("2.10.0a0+git1234") == (2, 10, 0)
    assert parse_version("2.14") == (2, 14, 0)
    assert parse_version("2.10.0rc1") == (2, 10, 0)  # a release candidate of 2.10.0, not 2.10.1
