"""commgroups.integrations.torchtitan.titan_internals: the one seam with torchtitan.

The package imports torchtitan (and tyro, torchtitan's command line) only there and touches no
private torchtitan name anywhere else; every copied signature is compared with the installed
torchtitan's; each function names the torchtitan versions it was checked on.
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import pathlib
from datetime import timedelta
from typing import Any

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torchtitan") is None,
    reason="torchtitan is not installed (pip install 'commgroups[torchtitan]')",
)

ROOT = pathlib.Path(__file__).resolve().parent.parent
SEAM = "commgroups/integrations/torchtitan/titan_internals.py"
FOREIGN = ("torchtitan", "tyro")
# Where the names commgroups could reach into live in torchtitan (its classes we subclass and the
# modules we import from).
TITAN_MODULES = ("torchtitan.trainer", "torchtitan.distributed.parallel_dims",
                 "torchtitan.distributed.utils", "torchtitan.components.checkpointer.base",
                 "torchtitan.components.checkpointer.dcp", "torchtitan.tools.utils")


def _package_files() -> list[pathlib.Path]:
    return [p for p in sorted((ROOT / "commgroups").rglob("*.py"))
            if p.relative_to(ROOT).parts[:2] != ("commgroups", "backends")]


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def titan_private_names() -> set[str]:
    """Private names torchtitan defines in :data:`TITAN_MODULES`: functions, methods, class
    fields, ``self._x`` attributes, module globals."""
    names: set[str] = set()
    for module in TITAN_MODULES:
        spec = importlib.util.find_spec(module)
        assert spec is not None and spec.origin, module
        tree = ast.parse(pathlib.Path(spec.origin).read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
    return {n for n in names if _private(n)}


def _reaches_private(node: ast.AST, privates: set[str]) -> bool:
    if isinstance(node, ast.Attribute):
        return node.attr in privates
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
            and node.func.id in ("getattr", "hasattr", "setattr", "delattr")
            and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant)
            and node.args[1].value in privates)


def torchtitan_uses(files: list[pathlib.Path], privates: set[str]) -> list[str]:
    """``path:line: code`` for each torchtitan (or tyro) import and each use of a private
    torchtitan name (attribute, getattr/setattr/hasattr string) in ``files``."""
    found: list[str] = []
    for path in files:
        where = path.relative_to(ROOT).as_posix() if path.is_relative_to(ROOT) else str(path)
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] in FOREIGN:
                        found.append(f"{where}:{node.lineno}: import {alias.name}")
            elif isinstance(node, ast.ImportFrom) and node.module:
                if node.module.split(".")[0] in FOREIGN:
                    found.append(f"{where}:{node.lineno}: from {node.module} import ...")
            elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
                  and node.value.split(".")[0] in FOREIGN and " " not in node.value
                  and "." in node.value):
                found.append(f"{where}:{node.lineno}: module name {node.value!r}")
            elif _reaches_private(node, privates):
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)[:100]}")
    return found


def test_torchtitan_only_through_titan_internals() -> None:
    privates = titan_private_names()
    assert {"_single_axis_meshes", "_validate_meshes", "_world_mesh"} <= privates
    files = [p for p in _package_files() if p.relative_to(ROOT).as_posix() != SEAM]
    uses = torchtitan_uses(files, privates)
    assert not uses, ("torchtitan reached outside " + SEAM + " (add it there, with the versions "
                      "it was checked on):\n" + "\n".join(uses))


def test_the_scan_catches_torchtitan_uses(tmp_path: pathlib.Path) -> None:
    """The scan above fails on each kind of use (else it proves nothing)."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import importlib\n"
        "from torchtitan.trainer import Trainer\n"
        "import torchtitan.distributed.utils as du\n"
        "import tyro\n"
        "def f(pd):\n"
        "    importlib.import_module('torchtitan.components.checkpoint')\n"
        "    getattr(pd, '_global_meshes')\n"
        "    return pd._single_axis_meshes, pd._validate_meshes()\n"
    )
    text = "\n".join(torchtitan_uses([probe], titan_private_names()))
    for needle in ("torchtitan.trainer", "torchtitan.distributed.utils", "import tyro",
                   "'torchtitan.components.checkpoint'", "'_global_meshes'",
                   "pd._single_axis_meshes", "pd._validate_meshes"):
        assert needle in text, (needle, text)


def test_every_function_names_the_versions_it_was_checked_on() -> None:
    from commgroups.integrations.torchtitan import titan_internals as seam

    assert seam.CHECKED_VERSIONS == ("0.3.0", "main@b5bcd76")
    for name in seam.__all__:
        value = getattr(seam, name)
        if not inspect.isfunction(value):
            continue
        doc = value.__doc__ or ""
        assert all(v in doc for v in seam.CHECKED_VERSIONS), f"{name}: names no checked version"


def test_copied_signatures_match_the_installed_torchtitan() -> None:
    from commgroups.integrations.torchtitan import titan_internals as seam
    from commgroups.integrations.torchtitan.checkpoint import RegistryCheckpointManager

    seam.require_parameters(seam.CheckpointManager.dcp_save, seam.DCP_SAVE_PARAMETERS, "dcp_save")
    seam.require_parameters(seam.CheckpointManager.dcp_load, seam.DCP_LOAD_PARAMETERS, "dcp_load")
    import torchtitan.distributed.utils as dist_utils

    seam.require_parameters(dist_utils.set_pg_timeouts, seam.SET_PG_TIMEOUTS_PARAMETERS,
                            "set_pg_timeouts")
    # commgroups' overrides take the same parameters as what they override.
    for name, expected in (("dcp_save", seam.DCP_SAVE_PARAMETERS),
                           ("dcp_load", seam.DCP_LOAD_PARAMETERS)):
        seam.require_parameters(getattr(RegistryCheckpointManager, name), expected, name)


def test_a_changed_signature_fails_loudly() -> None:
    from commgroups.integrations.torchtitan import titan_internals as seam

    def set_pg_timeouts(timeout: timedelta, parallel_dims: Any, *, barrier: bool = True) -> None:
        """torchtitan's function with one more parameter."""

    with pytest.raises(seam.TitanSeamError, match=r"takes \('timeout', 'parallel_dims', "
                       r"'barrier'\).*copies \('timeout', 'parallel_dims'\).*0\.3\.0"):
        seam.require_parameters(set_pg_timeouts, seam.SET_PG_TIMEOUTS_PARAMETERS, "set_pg_timeouts")


def test_set_pg_timeouts_replaced_only_inside_the_block() -> None:
    import torchtitan.distributed.utils as dist_utils

    from commgroups.integrations.torchtitan import titan_internals as seam

    calls: list[tuple[timedelta, Any]] = []

    def replacement(timeout: timedelta, parallel_dims: Any) -> None:
        calls.append((timeout, parallel_dims))

    original = dist_utils.set_pg_timeouts
    with seam.replaced_set_pg_timeouts(replacement):
        dist_utils.set_pg_timeouts(timeout=timedelta(seconds=5), parallel_dims="pd")
    assert dist_utils.set_pg_timeouts is original
    assert calls == [(timedelta(seconds=5), "pd")]


def test_a_job_wrapping_trainer_train_keeps_the_seam(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job's own wrapper around Trainer.train (no functools.wraps) does not hide torchtitan's call
    of set_pg_timeouts: the seam reads Trainer.train as torchtitan ships it."""
    import torchtitan.distributed.utils as dist_utils
    from torchtitan.trainer import Trainer

    from commgroups.integrations.torchtitan import titan_internals as seam

    shipped = Trainer.train

    def counted_train(self: Any, *args: Any, **kwargs: Any) -> Any:  # a job's profiler or counter
        return shipped(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "train", counted_train)
    assert "set_pg_timeouts(" not in inspect.getsource(Trainer.train)  # what the old check read
    source = seam.shipped_train_source()
    assert source is not None and source.startswith("def train(self")
    assert "dist_utils.set_pg_timeouts(" in source

    def replacement(timeout: timedelta, parallel_dims: Any) -> None:
        pass

    with seam.replaced_set_pg_timeouts(replacement):
        assert dist_utils.set_pg_timeouts is replacement
    assert dist_utils.set_pg_timeouts is not replacement


def test_a_trainer_without_the_call_fails_loudly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torchtitan's shipped Trainer.train does not call set_pg_timeouts (or is gone: ""),
    the replacement is refused instead of silently never running."""
    import torchtitan.distributed.utils as dist_utils

    from commgroups.integrations.torchtitan import titan_internals as seam

    original = dist_utils.set_pg_timeouts
    monkeypatch.setattr(seam, "shipped_train_source", lambda: "")
    with (pytest.raises(seam.TitanSeamError, match=r"no longer calls dist_utils\.set_pg_timeouts"),
          seam.replaced_set_pg_timeouts(lambda timeout, parallel_dims: None)):
        pass
    assert dist_utils.set_pg_timeouts is original


def test_canonical_checkpoint_module() -> None:
    """The seam imports torchtitan's checkpointer package, not the 0.3.0 shim main removed."""
    text = (ROOT / SEAM).read_text()
    assert "torchtitan.components.checkpointer import" in text
    assert "torchtitan.components.checkpoint import" not in text
