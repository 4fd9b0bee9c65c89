"""The audit's analysis half imports no torch and forms no import cycle; it (and the CLI) runs with
torch blocked.

No process group and no torch.distributed: the inputs are plain data.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

from tests.test_hazards import _rank_data, _rec
from tests.test_merge import _write_run

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


_BLOCK_TORCH = textwrap.dedent("""
    import importlib.abc, sys, types

    class BlockTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"blocked: the audit's analysis imported {name}")
            return None

    sys.meta_path.insert(0, BlockTorch())
    # commgroups/__init__ imports the registry (and torch): load the package's modules without it,
    # as the planner's torch-free test does
    package = types.ModuleType("commgroups")
    package.__path__ = [sys.argv[1]]
    sys.modules["commgroups"] = package
""")


def _run_without_torch(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _BLOCK_TORCH + textwrap.dedent(code),
                           str(REPO / "commgroups"), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def test_analysis_and_cli_run_with_torch_blocked(tmp_path: Path) -> None:
    _write_run(tmp_path, [_rank_data(rank, [_rec("c10d.allreduce_", True, group="0")])
                          for rank in range(2)])
    library = _run_without_torch("""
        import json
        import commgroups.audit as audit
        report = audit.merge_dir(sys.argv[2])
        hazards = audit.find_hazards(audit.load_dir(sys.argv[2]))
        try:
            audit.record
            recorder = "imported"
        except ImportError as error:  # the torch half, asked for by name, needs torch
            recorder = str(error)
        torch = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        print(json.dumps({"kinds": [h.kind for h in report.hazards], "local": len(hazards),
                          "text": report.render(), "recorder": recorder, "torch": torch}))
    """, str(tmp_path))
    assert library.returncode == 0, library.stderr
    out = json.loads(library.stdout)
    assert out["kinds"] == ["aliasing"] and out["local"] == 1 and out["torch"] == []
    assert "aliasing on group 0 (ranks 0,1)" in out["text"]
    assert out["recorder"].startswith("blocked: the audit's analysis imported torch")
    cli = _run_without_torch("""
        from commgroups.cli import main
        sys.exit(main(["audit", sys.argv[2], "--json"]))
    """, str(tmp_path))
    assert cli.returncode == 1, cli.stderr  # 1: hazards found
    assert json.loads(cli.stdout)["hazards"][0]["kind"] == "aliasing"
