"""commgroups.torch_internals: the one place private torch is reached, proven on the running torch.

Every supported torch (2.10 to the newest release, one CI leg each) runs this file: the naming
prediction is compared with the names torch actually registers on a real 4-rank gloo world, ``auto``
creation must take the local path there, and commgroups must emit no deprecation warning.

The scan here keeps the quarantine: ``commgroups/`` and ``backends/`` reach private torch only through
``commgroups.torch_internals``, ``tests/`` only through ``tests/torch_private.py``.

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
# Private torch names held as data, each with its reason: async-and-wait lists torch's deprecated
# ``_all_gather_base`` / ``_reduce_scatter_base`` among the functions it wraps where the running
# torch has them (looked up by name at patch time); the call-site tests feed a module name to the
# plumbing matcher, never importing it.
TORCH_NAMES_AS_DATA = {
    ("commgroups/collectives/async_wait.py", "_all_gather_base"),
    ("commgroups/collectives/async_wait.py", "_reduce_scatter_base"),
    ("tests/test_call_sites.py", "torch.distributed.tensor._redistribute"),
}
TORCH_PACKAGES = ("torch", "torch_npu")
TESTS_EXEMPT = ("torch_private.py", "test_torch_internals.py", "test_torch_internals_world.py")
"""The tests' one place for private torch, and the tests of commgroups.torch_internals itself."""


# ------------------------------------------------------------------------- one module only


def _package_files() -> list[pathlib.Path]:
    files = [p for p in sorted((ROOT / "commgroups").rglob("*.py"))
             if p.relative_to(ROOT).parts[:2] != ("commgroups", "backends")]  # symlink to backends/
    return files + sorted((ROOT / "backends").glob("*.py"))


def _test_files() -> list[pathlib.Path]:
    return [p for p in sorted((ROOT / "tests").rglob("*.py")) if p.name not in TESTS_EXEMPT]


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


def _root(node: ast.expr) -> tuple[str | None, bool]:
    """The name an expression starts from, and whether it is a plain dotted name (``a.b.c``)."""
    dotted = True
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript)):
        dotted = dotted and isinstance(node, ast.Attribute)
        node = node.func if isinstance(node, ast.Call) else node.value
    return (node.id, dotted) if isinstance(node, ast.Name) else (None, False)


def _torch_private_names() -> frozenset[str]:
    """The private names of the torch objects whose privates get reached (c10d, DeviceMesh, ...).

    A string equal to one of them (``NAME = "_abort_process_group"``, then ``getattr(c10d, NAME)``)
    is a private torch use spelled as a string.
    """
    import torch
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.device_mesh import DeviceMesh

    holders: list[object] = [torch, dist, c10d, torch.utils, dist.ProcessGroup, dist.Work,
                             DeviceMesh, getattr(torch._C, "_distributed_c10d", None)]
    return frozenset(n for h in holders if h is not None for n in dir(h) if _private(n))


def _torch_path(text: str) -> bool:
    """``text`` is a dotted path into torch with a private part (a patch or import target)."""
    parts = text.split(".")
    return (len(parts) > 1 and parts[0] in TORCH_PACKAGES and all(p.isidentifier() for p in parts)
            and any(_private(p) for p in parts))


_ATTR_CALLS = ("getattr", "hasattr", "setattr", "delattr", "object")  # object: mock.patch.object


def private_torch_uses(files: list[pathlib.Path], known: set[str] | None = None) -> list[str]:
    """``path:line: code`` for every private torch attribute or module reached in ``files``.

    Flags: imports of a private torch (or torch_npu) module or name; ``x._name`` and
    ``getattr(x, "_name")`` (``setattr``, ``monkeypatch.setattr``, ``mock.patch.object`` ...) where
    ``_name`` is not one of commgroups' own names and ``x`` is not a module of another library
    (``sys``, ``spmd_types``; a value returned by a call is never a module): a foreign private
    attribute is presumed torch's, so an unknown one fails rather than slips through. String forms:
    a dotted path into torch with a private part (``"torch.distributed._x"``) and a string equal to
    a private name of c10d, ``torch.distributed``, ProcessGroup or DeviceMesh.

    ``known``: names defined elsewhere (commgroups' own, for the tests); each file then adds only its
    own names to them. Without it, the names every file of ``files`` defines count for all.
    """
    trees = {path: ast.parse(path.read_text(), str(path)) for path in files}
    shared = _own_names(trees) if known is None else known
    torch_names = _torch_private_names()
    found: list[str] = []
    for path, tree in trees.items():
        where = path.relative_to(ROOT).as_posix()
        own = shared if known is None else shared | _own_names({path: tree})
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
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = node.value
                if (_torch_path(text) or (text in torch_names and text not in own)) and (
                        (where, text) not in TORCH_NAMES_AS_DATA):
                    found.append(f"{where}:{node.lineno}: {text!r}")
                continue
            if isinstance(node, ast.Attribute) and _private(node.attr):
                attr, base = node.attr, node.value
            elif (isinstance(node, ast.Call) and len(node.args) >= 2
                  and (node.func.id if isinstance(node.func, ast.Name) else
                       node.func.attr if isinstance(node.func, ast.Attribute) else "") in _ATTR_CALLS
                  and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str)
                  and _private(node.args[1].value)):
                attr, base = node.args[1].value, node.args[0]
            else:
                continue
            root, dotted = _root(base)
            if attr in own or root in ("self", "cls") or (where, attr) in NOT_TORCH:
                continue
            module = modules.get(root or "")
            if dotted and module is not None and module.split(".")[0] not in TORCH_PACKAGES:
                continue  # another library's (or the standard library's) private
            found.append(f"{where}:{node.lineno}: {ast.unparse(node)[:100]}")
    return sorted(set(found), key=lambda line: (line.split(":")[0], int(line.split(":")[1])))


def test_private_torch_only_in_torch_internals() -> None:
    """commgroups/ and backends/ reach private torch through the commgroups.torch_internals package only."""
    files = [p for p in _package_files() if p.parent.name != "torch_internals"]
    uses = private_torch_uses(files)
    assert not uses, ("private torch used outside commgroups.torch_internals (add a function "
                      "there, with the versions it was checked on):\n" + "\n".join(uses))


def _commgroups_names() -> set[str]:
    files = _package_files()
    return _own_names({path: ast.parse(path.read_text(), str(path)) for path in files})


def test_tests_reach_private_torch_only_through_torch_private() -> None:
    """tests/ reaches private torch through tests/torch_private.py only (string forms included)."""
    uses = private_torch_uses(_test_files(), known=_commgroups_names())
    assert not uses, ("private torch used in tests outside tests/torch_private.py (add a function "
                      "there, or reuse commgroups.torch_internals):\n" + "\n".join(uses))


PROBE = (
    "import torch.distributed as dist\n"
    "import torch.distributed.distributed_c10d as c10d\n"
    "from torch.distributed import _functional_collectives\n"
    "import torch.testing._internal.distributed.fake_pg\n"
    "from commgroups.torch_internals import default_group\n"
    "NAME = '_abort_process_group'\n"
    "def f(work, mesh, monkeypatch):\n"
    "    dist.distributed_c10d._get_default_store()\n"
    "    getattr(dist.distributed_c10d, '_world')\n"
    "    monkeypatch.setattr(c10d, '_resolve_process_group', f)\n"
    "    monkeypatch.setattr('torch.distributed.distributed_c10d._set_pg_timeout', f)\n"
    "    default_group()._get_sequence_number_for_group()\n"
    "    return work._source_rank(), mesh._flatten('x')\n"
)
PROBE_NEEDLES = ("_functional_collectives", "fake_pg", "_get_default_store", "'_world'",
                 "'_resolve_process_group'", "_set_pg_timeout", "'_abort_process_group'",
                 "_get_sequence_number_for_group", "_source_rank", "_flatten")


def test_the_check_catches_private_torch(tmp_path: pathlib.Path) -> None:
    """The scan fails on each kind of private use, in the package and in the tests (else it proves
    nothing)."""
    for folder, known in (("commgroups", None), ("tests", _commgroups_names())):
        module = ROOT / folder / "_probe_private_use.py"
        module.write_text(PROBE)
        try:
            uses = private_torch_uses([module], known=known)
        finally:
            module.unlink()
        text = "\n".join(uses)
        for needle in PROBE_NEEDLES:
            assert needle in text, (folder, needle, text)
        assert torch_internals.__file__ not in text


def test_torch_private_reuses_torch_internals() -> None:
    """Where commgroups.torch_internals has the function, the tests call that very one."""
    from tests import torch_private

    shared = set(torch_private.__all__) & set(torch_internals.__all__)
    assert {"default_group", "default_store", "group_sequence_number", "op_schema"} <= shared
    for name in shared:
        assert getattr(torch_private, name) is getattr(torch_internals, name), name
    assert torch_private.abort_target()[0] is dist.distributed_c10d
    assert torch_private.abort_target()[1] in _torch_private_names()


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
