"""commgroups.torch_internals.nccl_classes: what commgroups reads on torch's NCCL classes, checked
against the real classes of each CUDA build (recorded in tests/data/nccl_class_attrs.json, and live
on every CI leg whose torch has them: the 2.10.0 and 2.15.0 PyPI builds; 2.13.0 CPU has none).

Mocked NCCL: the fakes of ``tests/nccl_fakes.py`` have exactly the recorded attributes, so a test
cannot call what the real class lacks. Nothing here needs a GPU; nothing here ran on one.
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from commgroups import torch_internals
from commgroups.errors import BackendUnavailableError
from commgroups.torch_internals import nccl_classes
from commgroups.torch_internals.nccl_classes import (
    NCCL_ATTRIBUTES,
    NCCL_BACKEND_CLASSES,
    NOT_USED,
    RECORDED_CLASSES,
)
from tests import nccl_fakes
from tools import capture_nccl_attrs

CUDA = torch.device("cuda")
OWNER_CLASSES = {"group": ("ProcessGroup",), "backend": NCCL_BACKEND_CLASSES,
                 "options": ("ProcessGroupNCCL.Options",),
                 "config": ("ProcessGroupNCCL.NCCLConfig",)}
"""Which recorded classes each inventory owner stands for."""
HANDLED = ("fallback:", "refused:", "none needed:")


# ------------------------------------------------------------------------------ the record
def test_the_record_holds_every_checked_torch() -> None:
    versions = nccl_fakes.recorded_versions()
    assert set(torch_internals.CHECKED_VERSIONS) <= set(versions)
    assert nccl_fakes.recorded("2.13.0", "ProcessGroupNCCL") is None  # the CPU build: no NCCL
    assert nccl_fakes.recorded("2.10.0", "ProcessGroupNCCL2") is None  # added in 2.14
    for version in ("2.14.1", "2.15.0"):
        assert nccl_fakes.recorded(version, "ProcessGroupNCCL2") is not None
    data = capture_nccl_attrs.load(nccl_fakes.DATA_FILE)
    assert data["classes_read"] == list(RECORDED_CLASSES)
    assert "no NCCL class" in data["versions"]["2.13.0"]["note"]


def test_what_the_issue_says_nccl2_lacks_is_what_the_record_shows() -> None:
    """The facts the work started from (shared/facts.md), read back from the 2.15.0 record."""
    legacy = nccl_fakes.recorded("2.15.0", "ProcessGroupNCCL")
    nccl2 = nccl_fakes.recorded("2.15.0", "ProcessGroupNCCL2")
    assert legacy is not None and nccl2 is not None
    lacks = {"comm_split_count", "_set_default_timeout", "_is_initialized", "NCCLConfig",
             "_group_start", "_group_end", "_set_enable_nan_check", "get_build_nccl_version",
             "get_runtime_nccl_version", "uid"}
    assert lacks <= legacy - nccl2 and not nccl2 - legacy
    data = capture_nccl_attrs.load(nccl_fakes.DATA_FILE)
    assert data["versions"]["2.15.0"]["options_same_as_ProcessGroupNCCL"]["ProcessGroupNCCL2"]


@pytest.mark.parametrize("name", RECORDED_CLASSES)
def test_the_record_matches_the_live_classes(name: str) -> None:
    """On each CI leg: the running torch's classes are the recorded ones (the newest leg's 2.15.0
    CUDA build included). Skipped where this torch lacks the class (a CPU build)."""
    release = capture_nccl_attrs.release()
    if release not in nccl_fakes.recorded_versions():
        pytest.skip(f"torch {release} is not recorded; fix: python -m tools.capture_nccl_attrs "
                    "--write")
    live = nccl_classes.nccl_class_attributes()[name]
    recorded = nccl_fakes.recorded(release, name)
    if live is None:
        pytest.skip(f"torch {torch.__version__} has no {name} (a CPU build, or a torch older than "
                    "the class)")
    assert recorded is not None, f"torch {release} has {name}, the record says it has not"
    assert set(live) == recorded, (
        f"{name} of torch {torch.__version__}: lacks {sorted(recorded - set(live))}, adds "
        f"{sorted(set(live) - recorded)}; fix: python -m tools.capture_nccl_attrs --write")


def test_the_capture_tool_writes_and_checks_a_record(tmp_path: Any) -> None:
    """``--write`` then ``--check`` on a copy of the file: 0; after the record changes: 1."""
    target = tmp_path / "attrs.json"
    target.write_text(nccl_fakes.DATA_FILE.read_text())
    assert capture_nccl_attrs.main(["--write", "--file", str(target)]) == 0
    assert capture_nccl_attrs.main(["--check", "--file", str(target)]) == 0
    data = capture_nccl_attrs.load(target)
    assert set(nccl_fakes.recorded_versions()) <= set(data["versions"])  # others kept
    data["versions"][capture_nccl_attrs.release()]["classes"]["Backend"] = ["made_up"]
    target.write_text(__import__("json").dumps(data))
    assert capture_nccl_attrs.main(["--check", "--file", str(target)]) == 1


def test_differences_name_what_changed() -> None:
    old = {"torch": "2.15.0", "classes": {"A": ["x", "y"], "B": None}}
    new = {"torch": "2.15.0", "classes": {"A": ["y", "z"], "B": ["q"]}}
    lines = capture_nccl_attrs.differences(old, new)
    assert "A: live lacks ['x'], live adds ['z']" in lines
    assert "B: recorded absent, live present" in lines
    assert capture_nccl_attrs.differences(None, new) == ["not recorded"]
    assert capture_nccl_attrs.differences(old, old) == []


# ------------------------------------------------------------ the inventory vs the classes
def _missing(classes: dict[str, frozenset[str] | None]) -> list[str]:
    """``class.attr: why`` for every inventory attribute a present class lacks without a
    fallback or refusal that names the class."""
    problems = []
    for attribute in NCCL_ATTRIBUTES:
        for name in OWNER_CLASSES[attribute.owner]:
            attrs = classes.get(name)
            if attrs is None or attribute.name in attrs:
                continue
            handled = attribute.if_missing.startswith(HANDLED[:2])
            named = attribute.owner != "backend" or name in attribute.if_missing
            if not (handled and named):
                problems.append(f"{name}.{attribute.name}: {attribute.if_missing}")
    return problems


@pytest.mark.parametrize("version", nccl_fakes.recorded_versions())
def test_every_recorded_class_has_what_commgroups_reads_or_a_named_fallback(version: str) -> None:
    """Fails when a recorded CUDA build's class lacks an attribute commgroups reads and commgroups
    has no fallback or refusal for it naming that class."""
    classes = {name: nccl_fakes.recorded(version, name) for name in RECORDED_CLASSES}
    problems = _missing(classes)
    assert not problems, f"torch {version}: " + "; ".join(problems)


def test_the_check_catches_a_class_that_lacks_what_commgroups_reads() -> None:
    """The check above is not vacuous: a 2.15.0 ProcessGroupNCCL2 without ``options`` fails it,
    and so would one without ``comm_split_count`` if its fallback did not name the class."""
    classes = {name: nccl_fakes.recorded("2.15.0", name) for name in RECORDED_CLASSES}
    nccl2 = classes["ProcessGroupNCCL2"]
    assert nccl2 is not None
    classes["ProcessGroupNCCL2"] = nccl2 - {"options"}
    assert _missing(classes) == [
        "ProcessGroupNCCL2.options: " + next(a.if_missing for a in NCCL_ATTRIBUTES
                                              if a.name == "options")]


def test_the_live_classes_have_what_commgroups_reads_or_a_named_fallback() -> None:
    """The same check on the running torch's classes, recorded or not."""
    live = nccl_classes.nccl_class_attributes()
    if live["ProcessGroupNCCL"] is None:
        pytest.skip(f"torch {torch.__version__} has no NCCL class (a CPU build)")
    classes = {name: None if attrs is None else frozenset(attrs) for name, attrs in live.items()}
    problems = _missing(classes)
    assert not problems, f"torch {torch.__version__}: " + "; ".join(problems)


@pytest.mark.parametrize("version, name", nccl_fakes.nccl_backends(
    "ProcessGroupNCCL2", "ProcessGroupNCCLLazy"))
def test_what_nccl2_lacks_is_read_with_a_fallback_or_listed_as_unused(version: str,
                                                                       name: str) -> None:
    """Each attribute ProcessGroupNCCL has and ProcessGroupNCCL2 (or the lazy variant) lacks is
    either in the inventory with a fallback naming the class, or in NOT_USED with the reason."""
    legacy, other = nccl_fakes.recorded(version, "ProcessGroupNCCL"), nccl_fakes.recorded(version, name)
    assert legacy is not None and other is not None
    read = {a.name: a for a in NCCL_ATTRIBUTES if a.owner == "backend"}
    unexplained = []
    for attr in sorted(legacy - other):
        if attr in read:
            assert read[attr].if_missing.startswith("fallback:") and name in read[attr].if_missing
            assert version in read[attr].if_missing, (attr, read[attr].if_missing)
        elif not NOT_USED.get(attr):
            unexplained.append(attr)
    assert not unexplained, (f"torch {version}'s {name} lacks {unexplained}, which "
                             "nccl_classes.NOT_USED does not explain")


def test_not_used_lists_only_what_some_recorded_class_lacks() -> None:
    lacking: set[str] = set()
    for version, name in nccl_fakes.nccl_backends("ProcessGroupNCCL2", "ProcessGroupNCCLLazy"):
        legacy, other = (nccl_fakes.recorded(version, "ProcessGroupNCCL"),
                         nccl_fakes.recorded(version, name))
        assert legacy is not None and other is not None
        lacking |= legacy - other
    stale = set(NOT_USED) - lacking
    assert not stale, f"NOT_USED names attributes no recorded class lacks: {sorted(stale)}"
    read = {a.name for a in NCCL_ATTRIBUTES if a.owner == "backend"}
    assert not read & set(NOT_USED), "an attribute is both read and listed as not used"


# ---------------------------------------------- what the functions really read (mocked NCCL)
def _served(monkeypatch: pytest.MonkeyPatch, backend: Any) -> Any:
    """A fake group whose backend lookup gives ``backend``."""
    nccl_fakes.serve_backends(monkeypatch, lambda group, device: backend)
    return nccl_fakes.fake_group()


@pytest.mark.parametrize("version, name", nccl_fakes.nccl_backends())
def test_the_inventory_is_what_the_functions_read_mocked_nccl(
        monkeypatch: pytest.MonkeyPatch, version: str, name: str) -> None:
    """Every function of nccl_classes run on fakes of each recorded NCCL class: the attributes it
    touched are exactly the inventory's (a new read that is not listed fails here)."""
    seen: dict[str, set[str]] = {owner: set() for owner in OWNER_CLASSES}

    backend = nccl_fakes.fake_backend(version, name, supports_shrinking=True)
    if "comm_split_count" in nccl_fakes.recorded(version, name):  # type: ignore[operator]
        backend.comm_split_count = lambda: 2
    start = len(nccl_fakes.touched(backend))  # what the test itself gave the fake
    with monkeypatch.context() as patch:
        group = _served(patch, backend)
        torch_internals.backend_supports_shrinking(group, CUDA)
        torch_internals.backend_options_copy(group, CUDA)
        torch_internals.nccl_comm_split_count(group)
        assert torch_internals.nccl_backend_class(group) == f"Fake{name}"
    seen["backend"] |= set(nccl_fakes.touched(backend)[start:])

    patch_cls = nccl_fakes.fake_class("ProcessGroupNCCL", version)
    monkeypatch.setattr(dist, "ProcessGroupNCCL", patch_cls, raising=False)
    fields = {"cga_cluster_size": 2, "min_ctas": 1, "max_ctas": 8, "net_name": "IB",
              "split_share": 1, "blocking": 0}
    options = torch_internals.nccl_options(True, fields)
    torch_internals.set_options_timeout(options, timedelta(seconds=5))
    seen["options"] |= set(nccl_fakes.touched(options))
    seen["config"] |= set(nccl_fakes.touched(options.config))

    # The one reader of ProcessGroup._get_backend, on a fake ProcessGroup of the same torch.
    getter = next(a.name for a in NCCL_ATTRIBUTES if a.owner == "group")
    real_group = nccl_fakes.fake_group(version, **{getter: lambda device: backend})
    start = len(nccl_fakes.touched(real_group))
    assert nccl_classes.group_backend(real_group, CUDA) is backend
    seen["group"] |= set(nccl_fakes.touched(real_group)[start:])

    for owner, names in seen.items():
        listed = {a.name for a in NCCL_ATTRIBUTES if a.owner == owner}
        if owner == "backend" and "comm_split_count" not in nccl_fakes.recorded(version, name):  # type: ignore[operator]
            listed -= {"comm_split_count"}  # not touched: the class lacks it (the fallback)
        assert names == listed, (owner, sorted(names ^ listed))


# ------------------------------------------------------------- fallbacks and refusals (mocked)
@pytest.mark.parametrize("version, name", nccl_fakes.nccl_backends())
def test_comm_split_count_falls_back_where_the_class_lacks_it_mocked_nccl(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, version: str,
        name: str) -> None:
    """ProcessGroupNCCL counts its splits; ProcessGroupNCCL2 has no comm_split_count: None and
    a log line naming the class and torch, never an AttributeError."""
    backend = nccl_fakes.fake_backend(version, name)
    has = "comm_split_count" in nccl_fakes.recorded(version, name)  # type: ignore[operator]
    if has:
        backend.comm_split_count = lambda: 3
    group = _served(monkeypatch, backend)
    with caplog.at_level(logging.DEBUG, logger=nccl_classes.__name__):
        count = torch_internals.nccl_comm_split_count(group)
    if has:
        assert count == 3 and name == "ProcessGroupNCCL"
    else:
        assert count is None and name in ("ProcessGroupNCCL2", "ProcessGroupNCCLLazy")
        assert f"Fake{name}" in caplog.text and "no comm_split_count" in caplog.text
        assert torch.__version__ in caplog.text


def test_comm_split_count_without_a_cuda_backend_is_unknown_mocked_nccl(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def none(group: Any, device: torch.device) -> Any:
        raise RuntimeError(f"No backend type associated with device type {device}")

    nccl_fakes.serve_backends(monkeypatch, none)
    assert torch_internals.nccl_comm_split_count(nccl_fakes.fake_group()) is None
    assert torch_internals.nccl_backend_class(nccl_fakes.fake_group()) is None


@pytest.mark.parametrize("version, name", nccl_fakes.nccl_backends())
def test_options_copy_on_every_nccl_class_mocked_nccl(monkeypatch: pytest.MonkeyPatch,
                                                       version: str, name: str) -> None:
    """``options`` is c10d Backend's on 2.14.1 and 2.15.0 (ProcessGroupNCCL's own on 2.10): every
    recorded NCCL class gives a copy, never the object itself."""
    backend = nccl_fakes.fake_backend(version, name)
    group = _served(monkeypatch, backend)
    copied = torch_internals.backend_options_copy(group, CUDA)
    assert copied is not None and copied is not backend.options
    assert type(copied) is type(backend.options)


def test_nccl_options_refuses_a_config_field_this_torch_lacks_mocked_nccl(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """torch 2.10.0's NCCL config has no comm_name (2.14.1 added it): a clear refusal naming the
    field and the version, not pybind's AttributeError."""
    monkeypatch.setattr(dist, "ProcessGroupNCCL", nccl_fakes.fake_class("ProcessGroupNCCL",
                                                                        "2.10.0"), raising=False)
    assert "comm_name" not in nccl_fakes.recorded("2.10.0", "ProcessGroupNCCL.NCCLConfig")  # type: ignore[operator]
    with pytest.raises(BackendUnavailableError) as caught:
        torch_internals.nccl_options(False, {"comm_name": "cp"})
    message = str(caught.value)
    assert "options.nccl.comm_name" in message and torch.__version__ in message
    assert "fix:" in message and len(message) <= 300
    options = torch_internals.nccl_options(False, {"split_share": 1})  # what 2.10 has works
    assert options.config.split_share == 1 and options.is_high_priority_stream is False


def test_nccl_options_without_nccl_refuses_mocked_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    """A build without NCCL (the 2.13.0 CPU leg as it is): BackendUnavailableError."""
    monkeypatch.delattr(dist, "ProcessGroupNCCL", raising=False)
    with pytest.raises(BackendUnavailableError, match=r"no ProcessGroupNCCL\.Options"):
        torch_internals.nccl_options(True)


def test_nccl2_takes_the_options_commgroups_builds() -> None:
    """commgroups builds ProcessGroupNCCL.Options for every NCCL role; torch's nccl2 creator
    accepts only that class, which is ProcessGroupNCCL2's own Options on 2.14.1 and 2.15.0."""
    data = capture_nccl_attrs.load(nccl_fakes.DATA_FILE)
    for version in ("2.14.1", "2.15.0"):
        assert data["versions"][version]["options_same_as_ProcessGroupNCCL"][
            "ProcessGroupNCCL2"] is True
        assert (nccl_fakes.fake_class("ProcessGroupNCCL2", version).Options
                is nccl_fakes.fake_class("ProcessGroupNCCL", version).Options)
