"""Restart mode's AutoLayout: one elastic dim sized "auto" by the world; pure, no torch.distributed.

Resolution, validation (each error names the field and the fix), reading files, and `commgroups plan
--world-size`. The registry side (GroupRegistry resolving with the job's world size) runs on real
worlds: tests/test_errors.py (a world the fixed dims do not divide) and tests/test_restart.py
(torchrun elastic restarts).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import commgroups as cg
from commgroups import errors
from commgroups.cli import main

LAYOUTS = Path(__file__).resolve().parent.parent / "examples" / "layouts"
"""The shipped example layouts, found from this file (the suite runs from any directory)."""

EXAMPLE = LAYOUTS / "hsdp_restart.toml"


def _auto(**fields: Any) -> cg.AutoLayout:
    return cg.AutoLayout(**{"dims": {"dp_replicate": "auto", "dp_shard": 2},
                            "elastic": {"dims": {"dp_replicate": 1}}, **fields})


def test_auto_dim_takes_the_rest_of_the_world() -> None:
    auto = _auto()
    assert auto.auto_dim == "dp_replicate" and auto.fixed_size == 2
    assert auto.minimum_world_size == 2
    for world in (2, 4, 8):
        layout = auto.resolve(world)
        assert isinstance(layout, cg.Layout) and layout.world_size == world
        assert list(layout.dims.items()) == [("dp_replicate", world // 2), ("dp_shard", 2)]
        assert layout.elastic == auto.elastic  # in-place replan still works on the result


def test_default_roles_follow_the_resolved_sizes() -> None:
    auto = _auto()
    assert "dp_replicate" in auto.resolve(4).role_names
    assert "dp_replicate" not in auto.resolve(2).role_names  # size 1: no communicator


def test_dp_shard_may_be_the_auto_dim_in_restart_mode() -> None:
    auto = cg.AutoLayout(dims={"dp_shard": "auto", "tp": 2}, elastic={"dims": {"dp_shard": 1}})
    assert auto.resolve(8).dims == {"dp_shard": 4, "tp": 2}
    assert auto.resolve(8).role("fsdp").dims == ["dp_shard"]


def test_views_follow_the_auto_dim() -> None:
    auto = _auto(views={"moe": {"dp_replicate": "auto", "efsdp": 1, "ep": 2}})
    assert auto.resolve(6).views == {"moe": {"dp_replicate": 3, "efsdp": 1, "ep": 2}}


def test_roles_and_options_are_kept() -> None:
    roles = [{"name": "fsdp", "dims": ["dp_shard"], "timeout_s": 30.0},
             {"name": "checkpoint-metadata", "dims": "world", "backend": "gloo"}]
    layout = _auto(roles=roles).resolve(4)
    assert layout.role_names == ("fsdp", "checkpoint-metadata")
    assert layout.role("fsdp").timeout_s == 30.0
    assert layout.role("checkpoint-metadata").purpose == "checkpoint"


def test_resolve_layout_takes_either_kind() -> None:
    assert cg.resolve_layout(_auto(), 4) == _auto().resolve(4)
    fixed = cg.Layout(dims={"cp": 4})
    assert cg.resolve_layout(fixed, 4) is fixed
    with pytest.raises(errors.WorldSizeMismatchError, match='"auto"') as info:
        cg.resolve_layout(fixed, 2)
    assert info.value.field == "dims"


@pytest.mark.parametrize("world", [0, -2, True, 2.0, "4"])
def test_world_size_must_be_a_rank_count(world: Any) -> None:
    with pytest.raises(errors.LayoutError, match="fix: pass an integer") as info:
        _auto().resolve(world)
    assert type(info.value) is errors.LayoutError and info.value.field == "world_size"


def test_a_world_the_fixed_dims_do_not_divide() -> None:
    auto = cg.AutoLayout(dims={"dp_replicate": "auto", "dp_shard": 2, "tp": 2},
                         elastic={"dims": {"dp_replicate": 1}})
    with pytest.raises(errors.WorldSizeMismatchError) as info:
        auto.resolve(6)
    message = str(info.value)
    assert info.value.field == "dims"
    assert "dp_shard=2 x tp=2" in message and "multiple of 4" in message and "4 or 8" in message


def test_below_the_elastic_minimum() -> None:
    auto = _auto(elastic={"dims": {"dp_replicate": 2}})
    assert auto.minimum_world_size == 4
    with pytest.raises(errors.WorldSizeMismatchError, match="below its elastic minimum 2") as info:
        auto.resolve(2)
    assert info.value.field == "elastic.dims.dp_replicate"


@pytest.mark.parametrize(("fields", "error", "field", "fix"), [
    ({"dims": {"dp_replicate": 2, "dp_shard": 2}}, errors.InvalidAutoDimError, "dims",
     'size "auto"'),
    ({"dims": {"dp_replicate": "auto", "dp_shard": "auto"}}, errors.InvalidAutoDimError,
     "dims.dp_shard", "every dim but one"),
    ({"elastic": None}, errors.InvalidAutoDimError, "dims.dp_replicate", "elastic section"),
    ({"elastic": {"dims": {"dp_shard": 1}}}, errors.InvalidAutoDimError, "dims.dp_replicate",
     "dp_replicate = 1"),
    ({"dims": {"cp": "auto", "dp_shard": 2}, "elastic": {"dims": {"cp": 1}}},
     errors.InvalidElasticError, "elastic.dims.cp", "remove it"),
    ({"elastic": {"dims": {"dp_replicate": 0}}}, errors.InvalidElasticError,
     "elastic.dims.dp_replicate", ">= 1"),
    ({"dims": {"dp_replicate": "big", "dp_shard": 2}}, errors.InvalidSizeError,
     "dims.dp_replicate", '"auto" for the one elastic dim'),
    ({"dims": {"dp_replicate": "auto", "dp_shard": True}}, errors.InvalidSizeError,
     "dims.dp_shard", "integer >= 1"),
    ({"dims": {"dp_replicate": "auto", "dp_shard": 0}}, errors.InvalidSizeError,
     "dims.dp_shard", "integer >= 1"),
    ({"views": {"v": {"dp_replicate": "auto", "e": "auto"}}}, errors.InvalidAutoDimError,
     "views.v.e", "give 'e' a size"),
    ({"views": {"v": {"e": 2}}}, errors.InvalidAutoDimError, "views.v", 'dp_replicate = "auto"'),
    ({"views": {"v": {"dp_replicate": "auto", "e": 0}}}, errors.InvalidSizeError, "views.v.e",
     "integer >= 1"),
    ({"roles": [{"name": "tp", "dims": ["tp"]}]}, errors.UnknownDimError, "roles[0].dims[0]",
     "add 'tp' to dims"),
    ({"roles": [{"name": "e", "ranks": [[0]]}]}, errors.InvalidElasticError, "elastic",
     "give them dims"),
    ({"bogus": 1}, errors.UnknownFieldError, "bogus", "remove it"),
])
def test_invalid_auto_layouts_name_the_field_and_fix(
    fields: dict[str, Any], error: type[errors.LayoutError], field: str, fix: str
) -> None:
    data = {"dims": {"dp_replicate": "auto", "dp_shard": 2},
            "elastic": {"dims": {"dp_replicate": 1}}, **fields}
    for make in (lambda: cg.AutoLayout(**data), lambda: cg.AutoLayout.model_validate(data)):
        with pytest.raises(errors.LayoutError) as info:
            make()
        assert type(info.value) is error, f"{type(info.value).__name__}: {info.value}"
        assert info.value.field == field, info.value
        assert "fix:" in str(info.value) and fix in str(info.value), info.value


def test_layout_refuses_auto_and_points_to_auto_layout() -> None:
    with pytest.raises(errors.InvalidAutoDimError, match=r"cg\.AutoLayout") as info:
        cg.Layout(dims={"dp_shard": "auto"})
    assert info.value.field == "dims.dp_shard"
    with pytest.raises(errors.InvalidAutoDimError) as info:
        cg.Layout(dims={"a": 2}, views={"v": {"a": "auto"}})
    assert info.value.field == "views.v.a"


def test_registry_needs_a_world_to_resolve_with() -> None:
    with pytest.raises(errors.RegistryStateError, match="init_process_group"):
        cg.GroupRegistry(_auto())


def test_load_layout_reads_auto_files(tmp_path: Path) -> None:
    auto = cg.load_layout(EXAMPLE)
    assert isinstance(auto, cg.AutoLayout) and auto == _auto()
    assert cg.load_layout(EXAMPLE, world_size=4) == _auto().resolve(4)
    for suffix, text in ((".json", json.dumps({"dims": {"dp_replicate": "auto", "dp_shard": 2},
                                               "elastic": {"dims": {"dp_replicate": 1}}})),
                         (".yaml", "dims: {dp_replicate: auto, dp_shard: 2}\n"
                                   "elastic: {dims: {dp_replicate: 1}}\n")):
        path = tmp_path / f"l{suffix}"
        path.write_text(text)
        assert cg.load_layout(path) == _auto()
    with pytest.raises(errors.WorldSizeMismatchError) as info:
        cg.load_layout(EXAMPLE, world_size=3)
    assert str(info.value).startswith(str(EXAMPLE)) and info.value.field == "dims"
    assert cg.load_layout(LAYOUTS / "seed_cp4.toml", world_size=4).world_size == 4


def test_every_rank_resolves_the_same_fingerprint() -> None:
    # Ranks compare plan fingerprints before creating anything: resolution must be deterministic.
    a, b = cg.load_layout(EXAMPLE, world_size=4), _auto().resolve(4)
    assert cg.plan(a).fingerprint == cg.plan(b).fingerprint


def test_cli_plan_sizes_an_auto_layout(capsys: Any) -> None:
    assert main(["plan", str(EXAMPLE), "--world-size", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["world_size"] == 4 and data["dims"] == {"dp_replicate": 2, "dp_shard": 2}
    assert main(["plan", str(EXAMPLE)]) == 2
    err = capsys.readouterr().err
    assert "--world-size" in err and "multiple of 2" in err
    assert main(["plan", str(EXAMPLE), "--world-size", "3"]) == 2
    assert "multiple of 2" in capsys.readouterr().err
    assert main(["plan", str(LAYOUTS / "seed_cp4.toml"), "--world-size", "8"]) == 2
    assert "world size is 4" in capsys.readouterr().err


def test_docstring_examples_hold() -> None:
    import doctest

    from commgroups.layout import auto_layout

    result = doctest.testmod(auto_layout, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


def test_shared_store_risk_names_the_fix() -> None:
    from commgroups.layout.auto_layout import shared_store_risk

    risky = {"TORCHELASTIC_USE_AGENT_STORE": "True", "TORCHELASTIC_MAX_RESTARTS": "3"}
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in (shared_store_risk(risky) or "")
    assert shared_store_risk({**risky, "TORCHELASTIC_MAX_RESTARTS": "0"}) is None
    assert shared_store_risk({**risky, "TORCHELASTIC_USE_AGENT_STORE": "False"}) is None
    assert shared_store_risk({}) is None
