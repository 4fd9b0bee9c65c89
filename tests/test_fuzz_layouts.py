"""Property-based fuzzing of layout input: only LayoutError subclasses ever come out, naming a field."""

from __future__ import annotations

import json
from typing import Any

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import commgroups as cg
from commgroups import errors
from tests.strategies import layouts

NAMES = st.sampled_from(["dp_shard", "cp", "tp", "pp", "world", "", "1x", "a b", "fsdp", "ep"])
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 9), st.floats(allow_nan=True), st.text(max_size=5),
)
ANY = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=3)
                   | st.dictionaries(st.text(max_size=4), inner, max_size=3), max_leaves=8)

OPTION_SECTIONS = st.dictionaries(
    st.sampled_from(["nccl", "hccl", "mpi"]),
    st.one_of(
        st.dictionaries(
            st.sampled_from(["high_priority_stream", "min_ctas", "max_ctas", "cga_cluster_size",
                             "net_name", "split_share", "blocking", "buffer_size_mb",
                             "op_expansion_mode", "config", "bogus"]),
            st.one_of(SCALARS, st.dictionaries(st.text(max_size=18), SCALARS, max_size=2)),
            max_size=3,
        ),
        ANY,
    ),
    max_size=2,
)

ROLE = st.fixed_dictionaries(
    {},
    optional={
        "name": st.one_of(NAMES, SCALARS),
        "dims": st.one_of(st.just("world"), st.lists(NAMES, max_size=3), SCALARS),
        "ranks": st.one_of(st.lists(st.lists(st.integers(-1, 9), max_size=3), max_size=3), ANY),
        "backend": st.one_of(st.sampled_from(["device", "nccl", "rccl", "hccl", "gloo", "fake",
                                              "mpi"]), SCALARS),
        "timeout_s": SCALARS,
        "options": st.one_of(OPTION_SECTIONS, ANY),
        "async_and_wait": SCALARS,
        "extra": SCALARS,
    },
)

LAYOUT_DICTS = st.fixed_dictionaries(
    {},
    optional={
        "dims": st.one_of(st.dictionaries(NAMES, st.one_of(st.integers(-2, 6), SCALARS),
                                          max_size=4), ANY),
        "roles": st.one_of(st.lists(ROLE, max_size=4), ANY),
        "unknown": SCALARS,
    },
)


@st.composite
def mutated_layouts(draw: st.DrawFn) -> Any:
    """A valid layout's dict with one value replaced, removed or added somewhere inside."""
    data: Any = draw(layouts()).model_dump(mode="json")
    if draw(st.booleans()):
        data["roles"][0]["options"] = {"nccl": {"min_ctas": 2}} if draw(st.booleans()) else {
            "hccl": {"buffer_size_mb": 100, "config": {"x": 1}}}
    paths: list[tuple[Any, Any]] = []

    def collect(node: Any) -> None:
        if isinstance(node, dict):
            for key in node:
                paths.append((node, key))
                collect(node[key])
        elif isinstance(node, list):
            for index in range(len(node)):
                paths.append((node, index))
                collect(node[index])

    collect(data)
    parent, key = draw(st.sampled_from(paths))
    action = draw(st.sampled_from(["replace", "remove", "add"]))
    if action == "replace":
        parent[key] = draw(ANY)
    elif action == "remove":
        del parent[key]
    elif isinstance(parent, dict):
        parent[draw(st.text(max_size=6))] = draw(SCALARS)
    else:
        parent.append(draw(ANY))
    return data


def _check(data: Any) -> None:
    try:
        layout = cg.Layout.model_validate(data)
    except errors.LayoutError as error:
        message = str(error)
        assert error.field is not None and error.field in message, message
        assert "fix" in message, message
        return
    # what validates must plan
    plan = cg.plan(layout)
    for role in plan.role_names:
        plan.groups(role)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(LAYOUT_DICTS)
def test_layout_dicts_only_raise_layout_errors(data: dict[str, Any]) -> None:
    _check(data)


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mutated_layouts())
def test_mutated_valid_layouts_only_raise_layout_errors(data: Any) -> None:
    _check(data)


@settings(max_examples=200, deadline=None)
@given(ANY)
def test_arbitrary_values_only_raise_layout_errors(data: Any) -> None:
    _check(data)


def _serialise(data: dict[str, Any], suffix: str) -> str:
    if suffix == ".json":
        return json.dumps(data)
    if suffix in (".yaml", ".yml"):
        return yaml.safe_dump(data, sort_keys=False)
    lines = []
    for key, value in data.items():
        lines.append(f"{key} = {json.dumps(value)}")
    return "\n".join(lines)  # TOML-ish: often invalid, which is the point


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(LAYOUT_DICTS, st.sampled_from([".toml", ".yaml", ".json"]))
def test_layout_files_only_raise_layout_errors(data: dict[str, Any], suffix: str) -> None:
    try:
        text = _serialise(data, suffix)
    except (ValueError, yaml.YAMLError):
        return  # not representable in that format (NaN in JSON is fine; other oddities)
    try:
        cg.parse_layout(text, suffix, f"fuzz{suffix}")
    except errors.LayoutError as error:
        assert "fix" in str(error)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=80), st.sampled_from([".toml", ".yaml", ".yml", ".json", ".txt"]))
def test_garbage_text_only_raises_layout_errors(text: str, suffix: str) -> None:
    try:
        cg.parse_layout(text, suffix, "garbage")
    except errors.LayoutError as error:
        assert "fix" in str(error)
