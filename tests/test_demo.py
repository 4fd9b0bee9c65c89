"""``commgroups demo`` end to end: the registry run is clean and exact, the DeviceMesh baseline is not.

The pure half: a layout without an fsdp role is refused, torchrun is detected, the report renders
hazards. The runs of the real command (subprocesses of 4 gloo processes, one under torchrun) are in
``tests/test_demo_world.py`` (marked ``world``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from commgroups.demo.launch import under_torchrun
from commgroups.demo.report import render


def test_layout_without_fsdp_role_is_refused(tmp_path: Path) -> None:
    layout = tmp_path / "nofsdp.toml"
    layout.write_text('[dims]\ncp = 4\n\n[[roles]]\nname = "cp"\ndims = ["cp"]\n')
    from commgroups.demo.config import DemoConfig
    from commgroups.demo.groups import demo_layout
    from commgroups.errors import LayoutError

    with pytest.raises(LayoutError, match="'fsdp' role"):
        demo_layout(DemoConfig(layout_path=str(layout)))


def test_torchrun_detection() -> None:
    assert under_torchrun({"TORCHELASTIC_RUN_ID": "x"})
    assert under_torchrun({"RANK": "0", "WORLD_SIZE": "4", "MASTER_ADDR": "h", "MASTER_PORT": "1"})
    assert not under_torchrun({"RANK": "0"})


def test_report_renders_hazards() -> None:
    result = {
        "mode": "devicemesh", "world_size": 4, "layout": {"dp_shard": 1, "cp": 4}, "steps": 1,
        "elapsed_s": 1.0, "roles": {"cp": {"ranks": [0, 1, 2, 3], "backend": "gloo",
                                           "is_default_group": True, "source": "mesh['cp']"}},
        "aliases_of_default_group": 1, "aliased_roles": ["cp"], "losses": [4.0],
        "checkpoint_roundtrip": "exact", "audit": "on",
        "hazards": [{"kind": "aliasing", "message": "cp runs on the default group"}],
    }
    text = render(result)
    assert "baseline" in text and "YES" in text and "aliasing: cp runs on the default group" in text


def test_bad_options_are_argument_errors(capsys: pytest.CaptureFixture[str]) -> None:
    """Checked before anything is spawned; an ArgumentError (the layout is fine), exit 2."""
    from commgroups.cli import build_parser, main
    from commgroups.errors import ArgumentError, LayoutError

    for argv, field in ((["--steps", "0"], "--steps"), (["--timeout", "0"], "--timeout")):
        args = build_parser().parse_args(["demo", *argv])
        with pytest.raises(ArgumentError) as info:
            args.run(args)
        assert not isinstance(info.value, LayoutError) and info.value.field == field
        assert main(["demo", *argv]) == 2
        assert field in capsys.readouterr().err
