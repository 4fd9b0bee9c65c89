"""commgroups.util.role_table: the registry's describe() table, before creation (no groups)."""

from __future__ import annotations

from commgroups import GroupRegistry, Layout
from commgroups.planning.plan import plan
from commgroups.util.role_table import LiveRole, role_table


def test_a_registry_not_created_describes_its_requested_backends() -> None:
    layout = Layout(dims={"dp_shard": 2, "cp": 2})
    text = GroupRegistry(layout).describe()
    lines = text.splitlines()
    assert lines[0].startswith("GroupRegistry: world 4 (dp_shard=2, cp=2)") and "state new" in lines[0]
    cp = next(line for line in lines if line.startswith("cp "))
    assert "device" in cp and "default" in cp and cp.rstrip().endswith("-")


def test_a_live_role_shows_its_resolved_backend_timeout_and_this_ranks_group() -> None:
    layout = Layout(dims={"dp_shard": 2, "cp": 2})
    live = {name: LiveRole("gloo", "local", 60.0) for name in layout.role_names}
    text = role_table(layout, plan(layout), 2, "created", live)
    cp = next(line for line in text.splitlines() if line.startswith("cp "))
    assert "gloo" in cp and "local" in cp and "60s" in cp and "2,3" in cp.replace(" ", "")
