"""commgroups.layout.limits: each bound on layout input refuses what exceeds it, fast, naming the fix.

Property-based, like tests/test_fuzz_layouts.py (whose corpus and one-second rule these share): deep
values, YAML alias expansion, timeouts, world sizes, duplicate keys and odd names.
"""

from __future__ import annotations

import json
import math
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import commgroups as cg
from commgroups import errors
from commgroups.layout import limits
from tests.test_fuzz_layouts import FAST_S, _refused_fast

pytestmark = pytest.mark.version_independent


def _nested(depth: int, leaf: Any, kind: str) -> Any:
    for _ in range(depth):
        leaf = [leaf] if kind == "list" else {"k": leaf}
    return leaf


@settings(max_examples=60, deadline=None)
@given(st.integers(15, 5000), st.sampled_from(["list", "dict"]),
       st.sampled_from(["timeout_s", "options", "dims", "ranks", "name"]))
def test_deep_python_values_are_refused(depth: int, kind: str, field: str) -> None:
    role = {"name": "cp", "dims": ["cp"], field: _nested(depth, 1, kind)}
    if field == "ranks":
        role.pop("dims")
    error = _refused_fast(lambda: cg.Layout.model_validate({"dims": {"cp": 4}, "roles": [role]}))
    assert error is not None and error.field and error.field.startswith("roles[0]"), error


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 12), st.integers(2, 12), st.integers(0, 3))
def test_yaml_alias_expansion_is_bounded(levels: int, width: int, recursive: int) -> None:
    """Billion-laughs documents of any shape, some with an alias to a value that holds it."""
    lines = ["l0: &l0 [" + ", ".join(["x"] * width) + "]"]
    for level in range(1, levels + 1):
        lines.append(f"l{level}: &l{level} [" + ", ".join([f"*l{level - 1}"] * width) + "]")
    if recursive == 1:
        lines.append("r: &r [*r]")
    lines.append("dims: {cp: 2}")
    error = _refused_fast(lambda: cg.parse_layout("\n".join(lines) + "\n", ".yaml"))
    assert error is not None  # unknown top-level keys at least
    if recursive == 1:
        assert isinstance(error, errors.LayoutFileError), error
    elif width ** (levels + 1) > limits.MAX_LAYOUT_NODES:
        assert "aliases expand" in str(error), error


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.floats(), st.booleans(), st.integers(-10, 10**12), st.text(max_size=4),
                 st.sampled_from([1e10, 1e300, 1e-9, 0.001, float("inf"), float("nan")])))
def test_timeouts_are_real_or_refused(value: Any) -> None:
    error = _refused_fast(lambda: cg.RoleSpec(name="cp", dims=["cp"], timeout_s=value))
    good = (not isinstance(value, (bool, str)) and math.isfinite(value)
            and limits.MIN_TIMEOUT_S <= value <= limits.MAX_TIMEOUT_S)
    assert (error is None) == good, (value, error)
    registry_error = _refused_fast(lambda: cg.GroupRegistry(cg.Layout(dims={"cp": 4}),
                                                            create_timeout_s=value))
    assert (registry_error is None) == good, (value, registry_error)


@pytest.mark.parametrize("value", [10**400, -(10**400), 2**1024], ids=["1e400", "-1e400", "2**1024"])
def test_ints_past_float_range_are_argument_errors(value: int) -> None:
    """Too big for a float: refused as any timeout out of range is, not with OverflowError."""
    for check in (lambda: limits.check_timeout(value, "create_timeout_s"),
                  lambda: cg.GroupRegistry(cg.Layout(dims={"cp": 4}), create_timeout_s=value)):
        with pytest.raises(errors.ArgumentError) as info:
            check()
        assert info.value.field == "create_timeout_s"
        assert "fix:" in str(info.value) and len(str(info.value)) <= 300, str(info.value)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 2**64), min_size=1, max_size=40))
def test_world_sizes_are_bounded_and_plan_fast(sizes: list[int]) -> None:
    dims = {f"d{i}": size for i, size in enumerate(sizes)}
    started = time.process_time()
    try:
        plan = cg.plan(cg.Layout(dims=dims))
    except errors.LayoutError as error:
        assert type(error) is errors.InvalidSizeError, error
        assert "fix" in str(error)
    else:
        assert plan.world_size <= limits.MAX_WORLD_SIZE and len(dims) <= limits.MAX_DIMS
        summary = plan.to_dict(rank=plan.world_size - 1)
        assert len(json.dumps(summary)) < 10_000_000
    assert time.process_time() - started < 2 * FAST_S


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(["json", "yaml"]), st.sampled_from(["dims", "roles", "cp", "name"]))
def test_duplicate_keys_are_refused(fmt: str, key: str) -> None:
    if fmt == "json":
        inner = {"dims": '{"cp": 4}', "roles": "[]", "cp": "4", "name": '"x"'}[key]
        text = ('{"dims": {"cp": 4, "cp": 4}}' if key == "cp" else
                f'{{"dims": {{"cp": 4}}, "{key}": {inner}, "{key}": {inner}}}')
    else:
        text = "dims: {cp: 4, cp: 4}\n" if key == "cp" else f"dims: {{cp: 4}}\n{key}: 1\n{key}: 1\n"
    error = _refused_fast(lambda: cg.parse_layout(text, f".{fmt}"))
    assert isinstance(error, errors.LayoutFileError) and "twice" in str(error), error


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=8).map(lambda s: "cp" + s), st.sampled_from(["dim", "role"]))
def test_odd_names_are_refused(name: str, where: str) -> None:
    data = ({"dims": {name: 1, "tp": 4}} if where == "dim" else
            {"dims": {"cp": 4}, "roles": [{"name": name, "dims": ["cp"]}]})
    error = _refused_fast(lambda: cg.Layout.model_validate(data))
    valid = all(c.isascii() and (c.isalnum() or c in "_-") for c in name)
    assert (error is None) == valid, (name, error)
    if error is not None:
        assert type(error) is errors.InvalidNameError and "\n" not in error.field, error
