"""``with_registry`` as a torchtitan user calls it: the config it returns and its switches.

Needs torchtitan (no process group; the timeout test: a 1-rank gloo world in this process).
Skipped only when torchtitan is not installed.

Its tests that start processes are in ``tests/test_torchtitan_config_world.py`` (marked ``world``).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan is not installed (pip install 'commgroups[torchtitan]')",
)


def _stock() -> Any:
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    return llama3_debugmodel()


def _objects(value: Any, seen: dict[int, str], path: str) -> None:
    """Every mutable object reachable from ``value`` (dataclasses, lists, dicts, sets): id -> path."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        seen[id(value)] = path
        for f in dataclasses.fields(value):
            _objects(getattr(value, f.name), seen, f"{path}.{f.name}")
    elif isinstance(value, (list, dict, set)):
        seen[id(value)] = path
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            _objects(item, seen, f"{path}[{key!r}]")


def test_returned_config_shares_no_sub_config_with_its_input() -> None:
    from commgroups.integrations.torchtitan import with_registry

    stock = _stock()
    ours = with_registry(stock)
    theirs: dict[int, str] = {}
    _objects(stock, theirs, "config")
    mine: dict[int, str] = {}
    _objects(ours, mine, "config")
    shared = sorted(theirs[i] for i in set(theirs) & set(mine))
    assert not shared, f"shared with the input: {shared}"
    assert len(theirs) > 20  # the walk reached the sub-configs
    # Changing the result leaves the input as it was (a second with_registry call sees stock).
    before = stock.parallelism.context_parallel_degree
    ours.parallelism.context_parallel_degree = before + 3
    ours.training.steps += 1
    assert stock.parallelism.context_parallel_degree == before
    assert with_registry(stock).training.steps == stock.training.steps
    # Every field value is kept (copies: compared by repr, functools.partial compares by identity).
    for f in dataclasses.fields(stock):
        if f.name not in ("parallelism", "training"):
            mine, theirs = repr(getattr(ours, f.name)), repr(getattr(stock, f.name))
            assert mine.removeprefix("Registry") == theirs, f.name


def test_with_registry_repeats_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    """torchtitan validated the config once (and warned once); with_registry warns nothing more,
    however often it is called."""
    import logging

    from commgroups.integrations.torchtitan import with_registry

    with caplog.at_level(logging.INFO):
        stock = _stock()
    said = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert said, "expected torchtitan's own warning about this debug config"
    caplog.clear()
    with caplog.at_level(logging.INFO):
        config = stock
        for _ in range(3):
            config = with_registry(config)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_layout_takes_a_dict_a_file_or_a_layout(tmp_path: Path) -> None:
    import commgroups as cg
    from commgroups.errors import LayoutFileError
    from commgroups.integrations.torchtitan import with_registry

    layout = {"dims": {"cp": 4}, "roles": [{"name": "cp", "dims": ["cp"], "timeout_s": 30}]}
    config = with_registry(_stock(), layout=layout)
    assert config.commgroups_layout == layout and config.commgroups_layout is not layout
    path = tmp_path / "layout.toml"
    path.write_text('[dims]\ncp = 4\n\n[[roles]]\nname = "fsdp"\ndims = ["dp_shard", "cp"]\n')
    assert with_registry(_stock(), layout=path).commgroups_layout == str(path)
    as_object = with_registry(_stock(), layout=cg.Layout(dims={"cp": 4}))
    assert as_object.commgroups_layout["dims"] == {"cp": 4}
    bad = tmp_path / "bad.toml"
    bad.write_text("[dims\n")
    with pytest.raises(LayoutFileError):  # syntax: at with_registry time, not on every rank
        with_registry(_stock(), layout=bad)
    with pytest.raises(TypeError, match="a dict or a layout file path"):
        with_registry(_stock(), layout=42)


def test_audit_switch(tmp_path: Path) -> None:
    from commgroups.integrations.torchtitan import with_registry
    from commgroups.integrations.torchtitan.trainer import audit_directory

    assert with_registry(_stock()).commgroups_audit is None
    assert with_registry(_stock(), audit=True).commgroups_audit is True
    assert with_registry(_stock(), audit=tmp_path).commgroups_audit == str(tmp_path)
    with pytest.raises(TypeError, match="directory, True or None"):
        with_registry(_stock(), audit=3)
    env = {"COMMGROUPS_AUDIT_DIR": "/from/env"}
    assert audit_directory(None, "out", {}) is None
    assert audit_directory(None, "out", env) == Path("/from/env")
    assert audit_directory(None, "out", {"COMMGROUPS_AUDIT_DIR": ""}) is None
    assert audit_directory(True, "out", env) == Path("out/commgroups-audit")
    assert audit_directory("/given", "out", env) == Path("/given")
    assert audit_directory(False, "out", env) is None  # off, even with the variable set


def test_async_and_wait_switch() -> None:
    from commgroups.integrations.torchtitan import with_registry

    assert with_registry(_stock()).commgroups_async_and_wait is True
    off = with_registry(_stock(), async_and_wait=False)
    assert off.commgroups_async_and_wait is False
    assert with_registry(off).commgroups_async_and_wait is False  # wrapping again keeps it off


def test_config_fields_are_not_command_line_options() -> None:
    """torchtitan's command line still parses; commgroups' fields are not offered there."""
    from torchtitan.config import ConfigManager

    config = ConfigManager().parse_args(["--module", "tests.titan.configs", "--config",
                                         "llama3_registry", "--training.steps", "7"])
    assert config.training.steps == 7
    assert config.commgroups_audit is None and config.commgroups_async_and_wait is True
    with pytest.raises(SystemExit):
        ConfigManager().parse_args(["--module", "tests.titan.configs", "--config",
                                    "llama3_registry", "--commgroups_audit", "x"])


def test_spmd_types_async_and_wait_follows_the_compute_roles_only() -> None:
    """The trainer installs spmd_types' async-and-wait dist where a compute role asks for it;
    the checkpoint role (async-and-wait on by default, no spmd_types traffic) does not count."""
    from types import SimpleNamespace

    pytest.importorskip("spmd_types")
    from commgroups.integrations.torchtitan.trainer import RegistryTrainer, current_dist

    def trainer(compute_on: bool) -> Any:
        roles = [SimpleNamespace(name="cp", async_and_wait=compute_on, purpose="compute"),
                 SimpleNamespace(name="fsdp", async_and_wait=False, purpose="compute"),
                 SimpleNamespace(name="checkpoint-metadata", async_and_wait=True,
                                 purpose="checkpoint")]
        return SimpleNamespace(
            registry=SimpleNamespace(layout=SimpleNamespace(roles=roles)), model_parts=[],
            parallel_dims=SimpleNamespace(spmd_backend="spmd_types"),
            _wants_replica_scope=lambda: False, fsdp_async_wait_modules=0)

    before = current_dist()
    off = trainer(compute_on=False)
    RegistryTrainer._install_async_and_wait(off)
    assert not getattr(off, "_spmd_dist_set", False) and current_dist() is before
    on = trainer(compute_on=True)
    RegistryTrainer._install_async_and_wait(on)
    try:
        assert on._spmd_dist_set and current_dist() is not before
    finally:
        import spmd_types

        spmd_types.set_dist(on._spmd_dist_before)


def test_the_timeout_change_after_step_one_is_stocks_only(
        one_rank: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """torchtitan shortens its meshes' groups and the default group after step 1 (stock's
    set_pg_timeouts); the checkpoint role (an async save's exchange waits for the slowest
    writer) and a role whose layout set timeout_s keep theirs."""
    from datetime import timedelta
    from types import SimpleNamespace

    import commgroups as cg
    from commgroups.integrations.torchtitan import trainer as trainer_module
    from commgroups.integrations.torchtitan.layout import TitanDegrees, fit_titan_layout

    degrees = TitanDegrees(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=1, ep=1)
    layout = fit_titan_layout({"roles": [
        {"name": "checkpoint-metadata", "dims": "world", "backend": "gloo", "timeout_s": 3600},
        {"name": "cp", "dims": ["cp"], "timeout_s": 600}]}, degrees)
    changed: list[Any] = []
    monkeypatch.setattr(trainer_module, "set_group_timeout",
                        lambda group, timeout: changed.append((group, timeout)))
    short = timedelta(seconds=100)
    with cg.GroupRegistry(layout) as registry:
        untouched = registry.timeout("batch")
        dim_mesh = registry.device_mesh(["dp_shard", "cp"])["dp_shard"]  # no role over [dp_shard]
        meshes = {"fsdp": registry.device_mesh("fsdp"), "loss": registry.device_mesh("loss"),
                  "cp": registry.device_mesh("cp"), "dp_shard": dim_mesh}
        parallel_dims = SimpleNamespace(get_all_one_dimensional_meshes=lambda: meshes)
        trainer_module.RegistryTrainer._set_pg_timeouts(
            SimpleNamespace(registry=registry), short, parallel_dims)
        assert registry.timeout("fsdp") == short and registry.timeout("loss") == short
        assert registry.timeout("checkpoint-metadata") == timedelta(hours=1)
        assert registry.timeout("cp") == timedelta(minutes=10)
        assert registry.timeout("batch") == untouched  # no mesh of torchtitan's given: as stock
        default = trainer_module.default_group()
        assert changed == [(dim_mesh.get_group(), short), (default, short)]
