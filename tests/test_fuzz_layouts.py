"""Property-based fuzzing of layout input: only LayoutError subclasses ever come out, naming a field."""

from __future__ import annotations

import contextlib
import io
import json
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import commgroups as cg
from commgroups import errors
from commgroups.cli import main
from tests.strategies import layouts

LAYOUTS = Path(__file__).resolve().parent.parent / "examples" / "layouts"
"""The shipped example layouts, found from this file (the suite runs from any directory)."""

# Layout validation is pydantic alone: CI runs it on the main torch leg only.
pytestmark = [pytest.mark.version_independent, pytest.mark.heavy]

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


# ------------------------------------------------------------------------------------------------
# Hostile input: what a careful SRE tries (issue 19). Every class below once escaped the LayoutError
# family or ground for minutes; each must now be a LayoutError naming the fix within a second.
# Inputs that escaped are kept as files in tests/data/fuzz_corpus/, named <ExpectedClass>__<what>.

CORPUS = Path(__file__).parent / "data" / "fuzz_corpus"
CORPUS_FILES = sorted(CORPUS.iterdir())
# Every input is accepted or refused within this much CPU time (an upper bound, never a lower one;
# CPU rather than wall time: the test machine is shared, its wall clock says little).
FAST_S = 1.0


def _refused_fast(make: Any) -> errors.LayoutError | errors.ArgumentError | None:
    """Run ``make()``; return its LayoutError or ArgumentError (None if it validated), checking it
    took < FAST_S."""
    started = time.process_time()
    try:
        make()
        caught = None
    except (errors.LayoutError, errors.ArgumentError) as error:
        caught = error
        assert "fix" in str(error), str(error)
    assert time.process_time() - started < FAST_S, f"took {time.process_time() - started:.2f}s"
    return caught


def test_corpus_is_kept() -> None:
    assert len(CORPUS_FILES) >= 30, "the corpus only grows: add every input that ever escaped"


@pytest.mark.parametrize("path", CORPUS_FILES, ids=[p.name for p in CORPUS_FILES])
def test_corpus_input_raises_its_class_fast(path: Path) -> None:
    expected = getattr(errors, path.name.split("__")[0])
    error = _refused_fast(lambda: cg.load_layout(path))
    assert type(error) is expected, f"{type(error).__name__}: {error}"


@pytest.mark.parametrize("path", CORPUS_FILES, ids=[p.name for p in CORPUS_FILES])
def test_corpus_through_the_cli_is_one_line(path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("commgroups: error: ") and "fix" in err, err
    assert "Traceback" not in err


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(LAYOUT_DICTS, st.sampled_from([".toml", ".yaml", ".json"]),
       st.lists(st.sampled_from(["--rank", "--max-groups", "--json", "--device", "--measured"]),
                max_size=3, unique=True), st.integers(-2**40, 2**40))
def test_cli_prints_one_line_or_a_plan(tmp_path_factory: pytest.TempPathFactory,
                                       data: dict[str, Any], suffix: str, flags: list[str],
                                       number: int) -> None:
    try:
        text = _serialise(data, suffix)
    except (ValueError, yaml.YAMLError):
        return
    path = tmp_path_factory.mktemp("cli") / f"layout{suffix}"
    path.write_text(text)
    argv = ["plan", str(path)]
    for flag in flags:
        argv += {"--json": ["--json"], "--device": ["--device", "hccl"],
                 "--measured": ["--measured", str(path)]}.get(flag, [flag, str(number)])
    out, err = io.StringIO(), io.StringIO()
    started = time.process_time()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main(argv)
    assert time.process_time() - started < 2 * FAST_S
    if status == 0:
        assert out.getvalue() and not err.getvalue()
    else:
        assert status == 2, err.getvalue()
        assert err.getvalue().count("\n") == 1 and "fix" in err.getvalue(), err.getvalue()


@pytest.mark.parametrize("argv", [
    ["demo", "--world-size", "100000"], ["demo", "--world-size", "0"], ["demo", "--steps", "0"],
    ["demo", "--timeout", "nan"], ["demo", "--timeout", "inf"], ["demo", "--timeout", "1e10"],
    ["plan", str(LAYOUTS / "seed_cp4.toml"), "--rank", "4"],
    ["plan", str(LAYOUTS / "seed_cp4.toml"), "--max-groups", "100000000"],
    ["plan", str(LAYOUTS / "seed_cp4.toml"), "--measured", str(LAYOUTS.parent)],
    ["audit", "no/such/dir"],
], ids=lambda argv: " ".join(argv))
def test_bad_cli_arguments_are_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    started = time.process_time()
    assert main(argv) == 2  # refused before any process starts
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("commgroups: error: ") and "fix" in err, err
    assert time.process_time() - started < FAST_S
