"""Layout files: TOML, YAML and JSON give the same layout; bad files give LayoutFileError."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import commgroups as cg
from commgroups import errors

LAYOUTS = Path(__file__).resolve().parent.parent / "examples" / "layouts"
"""The shipped example layouts, found from this file (the suite runs from any directory)."""

TOML = """
[dims]
dp_shard = 2
cp = 2

[[roles]]
name = "cp"
dims = ["cp"]
timeout_s = 60
[roles.options.nccl]
high_priority_stream = true

[[roles]]
name = "checkpoint-metadata"
dims = "world"
backend = "gloo"
"""

DATA = {
    "dims": {"dp_shard": 2, "cp": 2},
    "roles": [
        {"name": "cp", "dims": ["cp"], "timeout_s": 60,
         "options": {"nccl": {"high_priority_stream": True}}},
        {"name": "checkpoint-metadata", "dims": "world", "backend": "gloo"},
    ],
}


def test_three_formats_agree(tmp_path: Path) -> None:
    import yaml

    (tmp_path / "l.toml").write_text(TOML)
    (tmp_path / "l.json").write_text(json.dumps(DATA))
    (tmp_path / "l.yaml").write_text(yaml.safe_dump(DATA, sort_keys=False))
    layouts = [cg.load_layout(tmp_path / n) for n in ("l.toml", "l.json", "l.yaml")]
    assert layouts[0] == layouts[1] == layouts[2]
    assert cg.plan(layouts[0]).fingerprint == cg.plan(layouts[2]).fingerprint


@pytest.mark.parametrize("name", ["seed_cp4.toml", "hsdp_2x2.yaml", "llm_8x8x2.json"])
def test_shipped_examples_load(name: str) -> None:
    layout = cg.load_layout(LAYOUTS / name)
    assert cg.plan(layout).world_size == layout.world_size


@pytest.mark.parametrize(
    ("name", "text", "error"),
    [
        ("l.toml", "[dims\ncp = 4", errors.LayoutFileError),
        ("l.json", "{", errors.LayoutFileError),
        ("l.yaml", "dims: [1, 2", errors.LayoutFileError),
        ("l.yaml", "- 1\n- 2\n", errors.LayoutFileError),
        ("l.ini", "[dims]", errors.LayoutFileError),
        ("l.toml", "[dims]\ncp = 0\n", errors.InvalidSizeError),
        ("l.json", '{"dims": {"cp": 2}, "roles": [{"name": "x", "dims": ["tp"]}]}',
         errors.UnknownDimError),
    ],
)
def test_bad_files(tmp_path: Path, name: str, text: str, error: type[Exception]) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(error) as info:
        cg.load_layout(path)
    assert str(path) in str(info.value)
    assert "fix" in str(info.value)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(errors.LayoutFileError, match="cannot read"):
        cg.load_layout(tmp_path / "nope.toml")


def test_dim_order_is_part_of_equality() -> None:
    roles = [cg.RoleSpec(name="all", dims="world")]
    a = cg.Layout(dims={"dp_shard": 2, "cp": 2}, roles=roles)
    b = cg.Layout(dims={"cp": 2, "dp_shard": 2}, roles=roles)
    assert a != b
    assert cg.plan(a).fingerprint != cg.plan(b).fingerprint


@pytest.mark.parametrize("text", ["?", "{? : 1}", "dims: {? : 2}", "roles: [{? : 2}]"])
def test_yaml_keys_that_are_not_names_raise_a_layout_error(text: str) -> None:
    # YAML's complex/null keys once reached pydantic as keyword arguments: a bare TypeError.
    with pytest.raises(cg.errors.UnknownFieldError, match="is not a name"):
        cg.parse_layout(text, ".yaml")
