"""The Megatron integration without megatron-core or a process world: elastic layouts and the
one-seam rule (Megatron reached beyond its public API only through ``megatron_internals``). They run
on every CI leg; the argument errors that need megatron-core are in
tests/test_megatron_install_world.py (importing Megatron starts a git subprocess).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

import commgroups as cg
from commgroups.errors import InvalidElasticError
from commgroups.integrations import megatron as mg

PACKAGE = Path(mg.__file__).parent


def test_elastic_dp_shrinks_by_a_dp_replica() -> None:
    layout = mg.megatron_layout(tp=2, dp=4, ep=2, expt_tp=1, elastic_dp=2)
    assert layout.elastic is not None and dict(layout.elastic.dims) == {"dp": 2}
    assert "dp" in layout.views[mg.EXPERT_VIEW]  # the expert view shrinks with it
    result = cg.replan(layout, alive=[0, 1, 2, 3, 4, 5, 7])  # rank 6 lost
    assert result.layout.dims["dp"] == 3 and result.ranks == (0, 1, 2, 3, 4, 5)
    assert result.dropped == (7,)
    plan = cg.plan(result.layout)
    assert plan.groups("dp") == [(0, 2, 4), (1, 3, 5)] == plan.groups("expt_dp")
    assert plan.groups("tp_dp") == [(0, 1, 2, 3, 4, 5)]
    # without elastic_dp the same loss is refused, as before
    with pytest.raises(cg.errors.ReplanError):
        cg.replan(mg.megatron_layout(tp=2, dp=4), alive=[0, 1, 2, 3, 4, 5, 7])


@pytest.mark.parametrize(("kwargs", "words"), [
    ({"tp": 2, "dp": 4, "elastic_dp": 5}, "1..dp=4"),
    ({"tp": 2, "dp": 4, "elastic_dp": True}, "elastic_dp=True"),
    ({"tp": 2, "pp": 2, "dp": 2, "elastic_dp": 1}, "pp == 1"),
    ({"tp": 2, "dp": 4, "ep": 4, "expt_tp": 1, "elastic_dp": 1}, "expt_tp*ep == tp*cp"),
])
def test_bad_elastic_dp_names_field_and_fix(kwargs: dict[str, Any], words: str) -> None:
    with pytest.raises(InvalidElasticError) as raised:
        mg.megatron_layout(**kwargs)
    assert raised.value.field == "elastic_dp"
    assert words in str(raised.value) and "fix:" in str(raised.value)


def _megatron_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names if a.name.split(".")[0] == "megatron"]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "megatron":
            found.append(node.module or "")
    return found


def _private_attributes(path: Path) -> list[str]:
    """``x._name`` where x is not self: a private name reached directly."""
    return [f"{path.name}:{node.lineno} {ast.unparse(node)}"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Attribute) and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "handle"))]


def test_megatron_is_reached_only_through_megatron_internals() -> None:
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name == "megatron_internals.py":
            continue
        imports = _megatron_imports(path)
        # the package root imports Megatron's public ProcessGroupCollection, nothing else
        allowed = ["megatron.core.process_groups_config"] if path.name == "__init__.py" else []
        assert imports == allowed, (path.name, imports)
        assert _private_attributes(path) == [], path.name
