"""commgroups.torch_internals: the one place private torch is reached, proven on the running torch.

Every supported torch (2.10 to the newest release, one CI leg each) runs this file: the naming
prediction is compared with the names torch actually registers on a real 4-rank gloo world, ``auto``
creation must take the local path there, and commgroups must emit no deprecation warning.

Its tests that start processes are in ``tests/test_torch_internals_world.py`` (marked ``world``).
"""

from __future__ import annotations

import ast
import pathlib

import torch.distributed as dist

from commgroups import torch_internals
from commgroups.torch_internals.version import torch_version

ROOT = pathlib.Path(__file__).resolve().parent.parent
TORCH = torch_version()

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


def test_public_set_timeout_arrives_in_2_14() -> None:
    """set_group_timeout's docstring claim: the public setter exists exactly from 2.14 on."""
    assert hasattr(dist, "set_timeout") == (TORCH >= (2, 14, 0))
