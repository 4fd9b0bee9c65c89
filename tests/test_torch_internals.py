"""commgroups.torch_internals: the one place private torch is reached, proven on the running torch.

Every supported torch (2.10 to the newest release, one CI leg each) runs this file: the naming
prediction is compared with the names torch actually registers on a real 4-rank gloo world, ``auto``
creation must take the local path there, and commgroups must emit no deprecation warning.
"""

from __future__ import annotations

import ast
import pathlib
import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist

import commgroups as cg
from commgroups import torch_internals
from commgroups.registry import GroupRegistry
from commgroups.torch_internals.version import torch_version
from tests.worlds import run_world

ROOT = pathlib.Path(__file__).resolve().parent.parent
TORCH = torch_version()
# torch 2.14 salts hashed group names with _world.group_count, which grows with every group ever
# made (until the default group is destroyed): a layout re-created after close() gets new names.
# Before 2.14 the salt is len(_world.pg_names), which falls back when groups are destroyed.
NAMES_NEVER_REPEAT = TORCH >= (2, 14, 0)

# Privates of other libraries, reached on purpose (not torch): spmd_types has no getter for the dist
# module it calls (see commgroups/integrations/spmd.py).
NOT_TORCH = {("commgroups/integrations/spmd.py", "_dist")} | {
    # torchtitan's ParallelDims privates, reached in torchtitan's own seam (its own scan:
    # tests/test_titan_internals.py).
    ("commgroups/integrations/torchtitan/titan_internals.py", attr)
    for attr in ("_world_mesh", "_global_meshes", "_single_axis_meshes", "_spmd_meshes",
                 "_multi_axis_meshes", "_validate_meshes")}
TORCH_PACKAGES = ("torch", "torch_npu")


# ------------------------------------------------------------------------- one module only


def _package_files() -> list[pathlib.Path]:
    files = [p for p in sorted((ROOT / "commgroups").rglob("*.py"))
             if p.relative_to(ROOT).parts[:2] != ("commgroups", "backends")]  # symlink to backends/
    return files + sorted((ROOT / "backends").glob("*.py"))


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_names(trees: dict[pathlib.Path, ast.Module]) -> set[str]:
    """Names commgroups defines itself: its functions, classes, variables, self attributes, modules."""
    own: set[str] = set()
    for path, tree in trees.items():
        own.add(path.stem)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(node.name)
            elif isinstance(node, ast.arg):
                own.add(node.arg)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                own.add(node.id)
            elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
                  and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                own.add(node.attr)
    return own


def _root(node: ast.expr) -> str | None:
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def private_torch_uses(files: list[pathlib.Path]) -> list[str]:
    """``path:line: code`` for every private torch attribute or module reached in ``files``.

    Flags: imports of a private torch (or torch_npu) module or name; ``x._name`` and
    ``getattr(x, "_name")`` where ``_name`` is not one of commgroups' own names and ``x`` is not a
    module of another library (``sys``, ``spmd_types``): a foreign private attribute is presumed
    torch's, so an unknown one fails rather than slips through.
    """
    trees = {path: ast.parse(path.read_text(), str(path)) for path in files}
    own = _own_names(trees)
    found: list[str] = []
    for path, tree in trees.items():
        where = path.relative_to(ROOT).as_posix()
        modules: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    modules[(alias.asname or alias.name).split(".")[0]] = alias.name
                    parts = alias.name.split(".")
                    if parts[0] in TORCH_PACKAGES and any(_private(p) for p in parts):
                        found.append(f"{where}:{node.lineno}: import {alias.name}")
            elif isinstance(node, ast.ImportFrom) and node.module:
                parts = node.module.split(".")
                for alias in node.names:
                    modules[alias.asname or alias.name] = node.module
                names = [alias.name for alias in node.names]
                if parts[0] in TORCH_PACKAGES and (any(_private(p) for p in parts)
                                                   or any(_private(n) for n in names)):
                    found.append(f"{where}:{node.lineno}: from {node.module} import {names}")
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and _private(node.attr):
                attr, base = node.attr, node.value
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                  and node.func.id in ("getattr", "hasattr", "setattr") and len(node.args) >= 2
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                  and _private(node.args[1].value)):
                attr, base = node.args[1].value, node.args[0]
            else:
                continue
            root = _root(base)
            if attr in own or root in ("self", "cls") or (where, attr) in NOT_TORCH:
                continue
            module = modules.get(root or "")
            if module is not None and module.split(".")[0] not in TORCH_PACKAGES:
                continue  # another library's (or the standard library's) private
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)[:100]}")
    return found


def test_private_torch_only_in_torch_internals() -> None:
    """commgroups/ and backends/ reach private torch through the commgroups.torch_internals package only."""
    files = [p for p in _package_files() if p.parent.name != "torch_internals"]
    uses = private_torch_uses(files)
    assert not uses, ("private torch used outside commgroups.torch_internals (add a function "
                      "there, with the versions it was checked on):\n" + "\n".join(uses))


def test_the_check_catches_private_torch(tmp_path: pathlib.Path) -> None:
    """The grep above fails on each kind of private use (else it proves nothing)."""
    module = ROOT / "commgroups" / "_probe_private_use.py"
    module.write_text(
        "import torch.distributed as dist\n"
        "from torch.distributed import _functional_collectives\n"
        "import torch.testing._internal.distributed.fake_pg\n"
        "def f(work, mesh):\n"
        "    dist.distributed_c10d._get_default_store()\n"
        "    getattr(dist.distributed_c10d, '_world')\n"
        "    return work._source_rank(), mesh._flatten('x')\n"
    )
    try:
        uses = private_torch_uses([module])
    finally:
        module.unlink()
    text = "\n".join(uses)
    for needle in ("_functional_collectives", "fake_pg", "_get_default_store", "'_world'",
                   "_source_rank", "_flatten"):
        assert needle in text, (needle, text)
    assert torch_internals.__file__ not in text


def test_every_function_names_the_versions_it_was_checked_on() -> None:
    """Each public function's docstring names the torch versions it was run on (or says it was not)."""
    for name in torch_internals.__all__:
        value = getattr(torch_internals, name)
        if not callable(value) or name in ("TorchDispatchMode", "tree_leaves", "GroupCall"):
            continue
        doc = value.__doc__ or ""
        checked = all(v.rsplit(".", 1)[0] in doc for v in torch_internals.CHECKED_VERSIONS)
        assert checked or "NOT CHECKED" in doc, f"{name}: docstring must name the checked versions"


# --------------------------------------------------------------------- on a real gloo world


def _regular() -> cg.Layout:
    return cg.Layout(dims={"dp_shard": 2, "cp": 2})  # built-in roles: dp_shard, cp, fsdp, ckpt


def names_worker(rank: int, world: int) -> dict[str, Any]:
    """Predict the names of a mixed sequence of new_group calls, make them, compare; twice (the
    second time from the state the first left: groups are kept, so no name can come back)."""
    out: dict[str, Any] = {}
    pairs = [[0, 1], [2, 3]]
    mine = next(g for g in pairs if rank in g)
    columns = [[0, 2], [1, 3]]
    column = next(g for g in columns if rank in g)
    calls = [
        *(torch_internals.GroupCall(tuple(g), local=False, member=rank in g) for g in pairs),
        torch_internals.GroupCall(tuple(column), local=True, member=True),
        torch_internals.GroupCall(tuple(range(world)), local=True, member=True),
    ]
    kept: list[dist.ProcessGroup] = []
    for attempt in ("first", "second"):
        before = torch_internals.group_naming_state(world), torch_internals.registered_group_names()
        predicted = torch_internals.predict_group_names(calls, world)
        after = torch_internals.group_naming_state(world), torch_internals.registered_group_names()
        out["untouched"] = out.get("untouched", True) and before == after
        made: list[dist.ProcessGroup | None] = []
        for g in pairs:
            group = dist.new_group(g)
            made.append(group if g == mine else None)
        made.append(dist.new_group(column, use_local_synchronization=True))
        made.append(dist.new_group(list(range(world)), use_local_synchronization=True))
        actual = [g.group_name if isinstance(g, dist.ProcessGroup) else None for g in made]
        out[attempt] = {"predicted": predicted, "actual": actual,
                        "member": [c.member for c in calls]}
        kept.extend(g for g in made if isinstance(g, dist.ProcessGroup))
    # The groups stay until the world ends: destroyed, torch < 2.14 could hand their names to
    # later groups, whose rendezvous would meet the stale keys (local_worker runs next).
    return out


def _names_then_local(rank: int, world: int) -> dict[str, Any]:
    # Both checks in one 4-rank world. Names first, on torch's fresh counters; its groups stay
    # live, so the registry's groups after them get names never used here before.
    return {"names": names_worker(rank, world), "local": local_worker(rank, world)}


@pytest.fixture(scope="module")
def gloo_results() -> list[dict[str, Any]]:
    return run_world(_names_then_local, 4, timeout=180)


def test_predicted_names_match_torch(gloo_results: list[dict[str, Any]]) -> None:
    """torch's own naming code, run on a copy of its counters, predicts the names it registers."""
    results = [result["names"] for result in gloo_results]
    for rank, result in enumerate(results):
        assert result["untouched"], f"rank {rank}: predicting names moved torch's own counters"
        for attempt in ("first", "second"):
            predicted, actual = result[attempt]["predicted"], result[attempt]["actual"]
            assert predicted is not None, f"torch {torch.__version__}: names not predictable"
            for member, guess, name in zip(result[attempt]["member"], predicted, actual):
                if member:
                    assert guess == name, (rank, attempt, predicted, actual)


def local_worker(rank: int, world: int) -> dict[str, Any]:
    """auto creation of a regular layout, twice (re-created after close), plus set_timeout."""
    out: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for attempt in ("first", "again"):
            registry = GroupRegistry(_regular(), creation_mode="auto", create_timeout_s=60).create()
            out[attempt] = {role: registry.creation_method(role) for role in registry.role_names}
            registry.set_timeout(120, "cp")
            tensor = torch.tensor([float(rank)])
            registry.collectives("cp").all_reduce(tensor)
            out[f"{attempt}-sum"] = tensor.item()
            registry.close()
    out["warnings"] = [f"{w.category.__name__}: {w.message} ({w.filename}:{w.lineno})"
                       for w in caught
                       if issubclass(w.category, (DeprecationWarning, FutureWarning))]
    return out


def test_auto_takes_the_local_path_and_warns_nothing(gloo_results: list[dict[str, Any]]) -> None:
    """4 gloo ranks, regular layout: auto is local; after close() again local where names never
    repeat (torch >= 2.14), else all_ranks (a reused name would hang); no deprecation warnings."""
    results = [result["local"] for result in gloo_results]
    again = "local" if NAMES_NEVER_REPEAT else "all_ranks"
    for rank, result in enumerate(results):
        assert set(result["first"].values()) == {"local"}, (rank, result["first"])
        assert set(result["again"].values()) == {again}, (rank, torch.__version__, result["again"])
        expected = float(sum(cg.plan(_regular()).group_of("cp", rank) or ()))
        assert result["first-sum"] == result["again-sum"] == expected
        assert result["warnings"] == [], result["warnings"]


def test_public_set_timeout_arrives_in_2_14() -> None:
    """set_group_timeout's docstring claim: the public setter exists exactly from 2.14 on."""
    assert hasattr(dist, "set_timeout") == (TORCH >= (2, 14, 0))
