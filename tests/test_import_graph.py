"""No import cycle among commgroups' modules, counting imports inside functions (not TYPE_CHECKING).

``from commgroups.x import y`` is an edge to ``commgroups.x`` (or to ``commgroups.x.y`` when that is a
module); ``import commgroups`` / ``from commgroups import name`` is an edge to the package itself.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules() -> dict[str, Path]:
    found: dict[str, Path] = {}
    for base, package in ((ROOT / "commgroups", "commgroups"), (ROOT / "backends", "commgroups.backends")):
        for path in base.rglob("*.py"):
            relative = path.relative_to(base).with_suffix("")
            if relative.parts[0] == "backends" and package == "commgroups":
                continue  # the symlink to ../backends, scanned as commgroups.backends
            parts = [package, *relative.parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(module: str, path: Path, known: set[str]) -> set[str]:
    tree = ast.parse(path.read_text())
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    edges: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            edges.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            for alias in node.names:
                if f"{target}.{alias.name}" in known:
                    edges.add(f"{target}.{alias.name}")
                elif target in known:
                    edges.add(target)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    edges.discard(module)
    return edges


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target in graph[node]:
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            connect(node)
    return found


def test_no_import_cycle_among_commgroups_modules() -> None:
    modules = _modules()
    known = set(modules)
    graph = {name: _imports(name, path, known) for name, path in modules.items()}
    assert _cycles(graph) == []


def test_the_scan_sees_function_level_imports() -> None:
    # A guard on the guard: registry imports collectives inside a function (lazily).
    modules = _modules()
    edges = _imports("commgroups.registry", modules["commgroups.registry"], set(modules))
    assert "commgroups.collectives.role_collectives" in edges


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_package_imports_no_repository_tooling() -> None:
    # What ships must run from a wheel: neither the test tree nor tools/ (the GPU check, the
    # torchtitan benchmark scenario) is installed, so no package module may import them, even lazily.
    modules = _modules()
    offenders = []
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                targets = [node.module]
            offenders += [f"{name} imports {t}" for t in targets
                          if t.split(".")[0] in ("tests", "tools", "benchmarks")]
        text = path.read_text()
        offenders += [f"{name} names {t}" for t in ('"tests.', "'tests.", '"tools.', "'tools.")
                      if t in text]
    assert offenders == []


# Every module sits in one tier and imports only from its own tier or those before it: the
# import graph runs one way, from the clients down (design.md, "Data flow"). Rank loss has one
# home above the generation: it retires one and makes the next; creation (sockets to sever, the
# NCCL shrink spine) and the flight recorder sit below the generation that uses them.
TIERS: tuple[tuple[str, ...], ...] = (
    ("commgroups.errors", "commgroups.util", "commgroups.torch_internals", "commgroups.backends",
     "commgroups.layout", "commgroups.planning"),
    ("commgroups.creation", "commgroups.collectives", "commgroups.flight_recorder"),
    ("commgroups.generation",),
    ("commgroups.rank_loss",),
    ("commgroups.registry",),
    # Clients of the registry. flight_recorder.merge reads dumps offline (`commgroups flight`)
    # with audit's hazard rules; no module of a running job imports it.
    ("commgroups", "commgroups.__main__", "commgroups.cli", "commgroups.audit",
     "commgroups.flight_recorder.merge", "commgroups.integrations", "commgroups.demo",
     "commgroups.bench", "commgroups.commands"),
)


def _tier(name: str) -> int | None:
    """The tier of module ``name``: that of its longest listed package (None: in none)."""
    best: tuple[int, int] | None = None
    for tier, packages in enumerate(TIERS):
        for package in packages:
            inside = name == package or name.startswith(package + ".")
            if inside and package != "commgroups" and (best is None or len(package) > best[1]):
                best = (tier, len(package))
    if best is None and name == "commgroups":
        return len(TIERS) - 1
    return None if best is None else best[0]


def test_every_module_has_a_tier() -> None:
    assert sorted(name for name in _modules() if _tier(name) is None) == []


def test_no_import_runs_back_up() -> None:
    modules = _modules()
    known = set(modules)
    upward = sorted(
        f"{name} -> {target}" for name, path in modules.items()
        for target in _imports(name, path, known)
        if (_tier(target) or 0) > (_tier(name) or 0))
    assert upward == []
    # the package root holds at most 8 modules: the concepts live in sub-packages
    root = sorted(p.name for p in (ROOT / "commgroups").glob("*.py"))
    assert len(root) <= 8, root


def test_the_registry_enters_rank_loss_through_its_entry_point() -> None:
    # One home: the registry calls commgroups.rank_loss's entry point, not its parts.
    modules = _modules()
    edges = _imports("commgroups.registry", modules["commgroups.registry"], set(modules))
    assert sorted(e for e in edges if e.startswith("commgroups.rank_loss.")) == []
    assert "commgroups.rank_loss" in edges


def test_the_tier_check_sees_an_upward_import() -> None:
    # A guard on the guard: creation importing the generation would run back up.
    assert _tier("commgroups.creation.shrink") < _tier("commgroups.generation.make")  # type: ignore[operator]
    assert _tier("commgroups.flight_recorder.merge") == len(TIERS) - 1
    assert _tier("commgroups.flight_recorder.session") == 1


def test_every_integration_is_reached_from_the_package() -> None:
    """``cg.integrations.<name>`` works for every integration (megatron was missing: an
    AttributeError), each one loaded on first use (its ``__getattr__``)."""
    import pkgutil

    import commgroups as cg
    import commgroups.integrations as integrations

    names = sorted(m.name for m in pkgutil.iter_modules(integrations.__path__)
                   if m.name != "common")
    assert sorted(n for n in integrations.__all__ if n != "MissingRoleError") == names
    for name in names:
        assert getattr(cg.integrations, name).__name__ == f"commgroups.integrations.{name}"
