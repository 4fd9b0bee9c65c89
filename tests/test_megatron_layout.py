"""megatron_layout without Megatron: dims, views and roles from the degrees, and the errors for bad ones.

These run on every CI leg (no megatron-core needed); tests/test_megatron_ranks.py compares the same
layouts with Megatron's own RankGenerator where megatron-core is installed.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest

import commgroups as cg
from commgroups.errors import DimOrderError, InvalidSizeError, LayoutError, UnknownDimError
from commgroups.integrations import megatron as mg


def test_dims_are_the_order_reversed_with_gtp_remat_after_tp() -> None:
    layout = mg.megatron_layout(tp=2, pp=2, dp=2, ep=2, expt_tp=1)
    assert list(layout.dims.items()) == [("pp", 2), ("dp", 2), ("cp", 1), ("gtp_remat", 1), ("tp", 2)]
    assert list(layout.views[mg.EXPERT_VIEW].items()) == [
        ("expt_pp", 2), ("expt_dp", 2), ("expt_gtp_remat", 1), ("ep", 2), ("expt_tp", 1)]
    layout = mg.megatron_layout(tp=2, cp=2, dp=2, order="cp-tp-dp")
    assert list(layout.dims) == ["pp", "dp", "gtp_remat", "tp", "cp"]  # unlisted size-1 pp, ep appended


def test_every_field_has_a_role_alias_or_reason() -> None:
    layout = mg.megatron_layout(tp=2, cp=2, dp=2)
    for field, role in mg.FIELD_ROLES.items():
        assert role in layout.role_names, field
    assert not set(mg.FIELD_ROLES) & set(mg.UNFILLED_FIELDS)
    assert set(mg.ALIASED_FIELDS) == {f for f, r in mg.FIELD_ROLES.items() if f != r}
    for role in (*mg.GLOO_ROLES, cg.CHECKPOINT_ROLE):
        assert layout.role(role).backend == "gloo"
    assert {r.backend for r in layout.roles if r.name not in (*mg.GLOO_ROLES, cg.CHECKPOINT_ROLE)} == {
        "device"}


def test_all_gather_groups_off_and_timeouts() -> None:
    layout = mg.megatron_layout(dp=4, all_gather_groups=False, timeout_s=60.0)
    assert "dp_cp_ag" not in layout.role_names and "expt_dp_ag" not in layout.role_names
    assert {role.timeout_s for role in layout.roles} == {60.0}


def test_embedding_groups_are_first_and_last_stage() -> None:
    plan = cg.plan(mg.megatron_layout(pp=4, dp=2))
    assert plan.groups("pp") == [(0, 2, 4, 6), (1, 3, 5, 7)]
    assert plan.groups("embd") == [(0, 6), (1, 7)]
    assert plan.groups("pos_embd") == [(0,), (1,)]


# (degrees, the error, its field, words of the message); tests/test_error_texts.py reads it too.
BAD_DEGREES: list[tuple[dict[str, Any], type[LayoutError], str, str]] = [
    ({"tp": 0}, InvalidSizeError, "tp", "tp=<int >= 1>"),
    ({"dp": True}, InvalidSizeError, "dp", "dp=True"),
    ({"cp": "2"}, InvalidSizeError, "cp", "cp='2'"),
    ({"expt_tp": -1}, InvalidSizeError, "expt_tp", "expt_tp=-1"),
    ({"dp": 2, "ep": 4}, InvalidSizeError, "ep", "expt_tp*ep divides"),
    ({"dp": 2, "order": "tp-cp-xp-dp-pp"}, UnknownDimError, "order", "'xp'"),
    ({"dp": 2, "order": "tp-dp-tp-pp"}, DimOrderError, "order", "more than once"),
    ({"dp": 2, "pp": 2, "order": "tp-dp"}, DimOrderError, "order", "add pp to order"),
    ({"dp": 2, "pp": 2, "tp": 2, "ep": 2, "expt_tp": 2, "order": "tp-pp-dp-ep-cp"}, DimOrderError,
     "order", "end order in pp"),
    ({"order": 3}, DimOrderError, "order", "not a string"),
]


@pytest.mark.parametrize(("kwargs", "error", "field", "words"), BAD_DEGREES)
def test_bad_degrees_name_field_and_fix(kwargs: dict[str, Any], error: type[LayoutError],
                                        field: str, words: str) -> None:
    with pytest.raises(error) as raised:
        mg.megatron_layout(**kwargs)
    assert isinstance(raised.value, LayoutError)
    assert raised.value.field == field
    assert words in str(raised.value) and "fix:" in str(raised.value)


@pytest.mark.skipif(importlib.util.find_spec("megatron") is not None,
                    reason="megatron-core is installed here: the missing-import message is not reachable")
def test_missing_megatron_names_the_extra() -> None:
    with pytest.raises(mg.MegatronUnavailableError, match=r"pip install 'commgroups\[megatron\]'"):
        mg.process_group_collection(None)  # type: ignore[arg-type]  # raises before using it
