"""`commgroups plan` and `python -m commgroups plan` from the repository root.

Its tests that start processes are in ``tests/test_cli_plan_world.py`` (marked ``world``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from commgroups.cli import main

LAYOUTS = Path(__file__).resolve().parent.parent / "examples" / "layouts"
"""The shipped example layouts, found from this file (the suite runs from any directory)."""


def test_plan_text(capsys: object) -> None:
    assert main(["plan", str(LAYOUTS / "llm_8x8x2.json"), "--rank", "77"]) == 0
    out = capsys.readouterr().out  # type: ignore[attr-defined]
    assert "world size 128" in out
    assert "rank 77 (pp=1, dp_shard=1, cp=1, tp=1): 5 communicators" in out
    assert "pp: [13, 77]" in out
    assert "tp: [76, 77, 78, 79]" in out


def test_plan_json(capsys: object) -> None:
    assert main(["plan", str(LAYOUTS / "seed_cp4.toml"), "--rank", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)  # type: ignore[attr-defined]
    assert data["world_size"] == 4
    assert [r["name"] for r in data["roles"]] == ["fsdp", "cp", "checkpoint-metadata"]
    assert all(r["rank_group"] == [0, 1, 2, 3] for r in data["roles"])
    assert len(data["fingerprint"]) == 64


def test_a_closed_stdout_ends_the_command_quietly(monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """`commgroups plan ... | head -1`: the reader went away, as for any filter; not "internal error
    ... this is a bug" (exit 3). Stdout is a pipe whose reader is closed; the output is larger
    than its buffer, so the write itself fails."""
    read, write = os.pipe()
    os.close(read)
    stdout = open(write, "w")  # noqa: SIM115  closed below, after main
    monkeypatch.setattr(sys, "stdout", stdout)
    try:
        status = main(["plan", str(LAYOUTS / "llm_8x8x2.json"), "--json"])
    finally:
        monkeypatch.undo()
        stdout.close()
    assert status == 141  # 128 + SIGPIPE, what the shell shows for a filter stopped this way
    assert capsys.readouterr().err == ""


def test_plan_bad_layout_exits_2(tmp_path: object, capsys: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "bad.toml"
    path.write_text("[dims]\ncp = 0\n")
    assert main(["plan", str(path)]) == 2
    assert "dims.cp" in capsys.readouterr().err  # type: ignore[attr-defined]


def test_bad_options_are_argument_errors(tmp_path: object, capsys: object) -> None:
    """An option outside its range is an ArgumentError (the layout is fine); the CLI exits 2."""
    from pathlib import Path

    import pytest

    from commgroups.cli import build_parser
    from commgroups.errors import ArgumentError, LayoutError

    auto = Path(str(tmp_path)) / "auto.toml"
    auto.write_text('[dims]\ndp_shard = "auto"\n[elastic]\ndims = { dp_shard = 1 }\n')
    cases = [
        (["examples/layouts/seed_cp4.toml", "--rank", "4"], "--rank", "use 0..3"),
        (["examples/layouts/seed_cp4.toml", "--max-groups", "-1"], "--max-groups", "fix:"),
        ([str(auto)], "--world-size", "pass --world-size N"),
        (["examples/layouts/seed_cp4.toml", "--measured", str(auto) + ".missing"], "--measured",
         "fix:"),
    ]
    parser = build_parser()
    for argv, field, fix in cases:
        args = parser.parse_args(["plan", *argv])
        with pytest.raises(ArgumentError) as info:
            args.run(args)
        assert not isinstance(info.value, LayoutError)
        assert info.value.field == field and fix in str(info.value), str(info.value)
        assert main(["plan", *argv]) == 2
        assert field in capsys.readouterr().err  # type: ignore[attr-defined]
