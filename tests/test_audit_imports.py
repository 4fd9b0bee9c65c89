"""The audit's analysis half imports no torch and forms no import cycle; it (and the CLI) runs with
torch blocked.

No process group and no torch.distributed: the inputs are plain data.

Its tests that start processes are in ``tests/test_audit_imports_world.py`` (marked ``world``).
"""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
AUDIT_PACKAGE = REPO / "commgroups" / "audit"
# The analysis: everything in commgroups/audit but the recorder, which observes live collectives.
ANALYSIS_MODULES = ("records", "hazards", "report", "merge")
# The call-site helper the analysis and the registry share (commgroups.util.call_sites): held to
# the analysis modules' rule too.
CALL_SITES = REPO / "commgroups" / "util" / "call_sites.py"


# -------------------------------------------------------------------------- no torch, no cycle
def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, inside functions too (TYPE_CHECKING blocks excluded)."""
    tree = ast.parse(path.read_text())
    type_checking = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                     and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                     for node in ast.walk(block)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in type_checking:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif (isinstance(node, ast.Call) and ast.unparse(node.func) == "importlib.import_module"
              and node.args and isinstance(node.args[0], ast.Constant)):
            found.add(str(node.args[0].value))
    return found


def test_audit_modules_form_no_cycle_and_the_analysis_never_reaches_the_recorder() -> None:
    modules = {("commgroups.audit" if p.stem == "__init__" else f"commgroups.audit.{p.stem}"): p
               for p in AUDIT_PACKAGE.glob("*.py")}
    assert {f"commgroups.audit.{name}" for name in ANALYSIS_MODULES} <= modules.keys()
    edges = {name: {m for m in _imports(path) if m in modules and m != name}
             for name, path in modules.items()}
    for name in ANALYSIS_MODULES:
        imported = _imports(modules[f"commgroups.audit.{name}"])
        assert not {m for m in imported if m == "torch" or m.startswith("torch.")}, name
        assert "commgroups.audit.recorder" not in imported and "commgroups" not in imported, name
    shared = _imports(CALL_SITES)
    assert not {m for m in shared if m == "torch" or m.startswith("torch.")}
    assert not {m for m in shared if m == "commgroups" or m.startswith("commgroups.")}
    assert "commgroups.audit.recorder" in edges["commgroups.audit"]  # lazily, for record()
    # depth-first search for a cycle
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(edges[name]):
            assert state.get(target) != 1, f"import cycle: {' -> '.join([*path, target])}"
            if target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(modules):
        if name not in state:
            visit(name, [name])
