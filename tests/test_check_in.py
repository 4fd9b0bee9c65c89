"""commgroups.rank_loss.check_in, pure: the check-in window's default (the world's check-ins are in
tests/test_check_in_world.py)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from commgroups.layout.specs import Layout, RoleSpec
from commgroups.rank_loss.check_in import check_in_window, window_slack_s
from tests.test_rebuild import hsdp_layout


def _layout(*timeouts: float | None) -> Layout:
    layout = hsdp_layout()
    roles = [RoleSpec(**{**role.model_dump(), "timeout_s": timeout})
             for role, timeout in zip(layout.roles, [*timeouts, *[None] * len(layout.roles)],
                                      strict=False)]
    return layout.model_copy(update={"roles": roles})


def test_the_default_window_outlasts_the_longest_role_timeout() -> None:
    # A rank whose collective could not be interrupted reaches rebuild() one role timeout after it
    # issued it: a window of exactly that length, started by an earlier reporter, ends first.
    assert check_in_window(None, _layout(3.0), {}, 60) == timedelta(seconds=5)
    assert check_in_window(None, _layout(3.0, 600.0), {}, 60) == timedelta(seconds=900)
    assert check_in_window(None, _layout(1.0), {"fsdp": timedelta(seconds=10)}, 60) == timedelta(
        seconds=15)
    for timeout in (0.5, 3.0, 10.0, 600.0):
        assert window_slack_s(timeout) >= max(2.0, timeout / 2)


def test_without_role_timeouts_the_window_is_create_timeout() -> None:
    assert check_in_window(None, _layout(), {}, 42) == timedelta(seconds=42)


def test_an_explicit_window_is_taken_as_given_and_validated() -> None:
    assert check_in_window(1.5, _layout(3.0), {}, 60) == timedelta(seconds=1.5)
    assert check_in_window(timedelta(seconds=7), _layout(3.0), {}, 60) == timedelta(seconds=7)
    with pytest.raises(ValueError, match="timeout"):
        check_in_window(-1, _layout(3.0), {}, 60)
