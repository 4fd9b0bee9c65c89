"""No error text is over 300 characters, and every one names its fix: the errors that need ranks.

The rank-dependent cases of ``tests/test_errors_world.py``, ranks that disagree on many fields, and a
rank that skips ``create()``, on a real 2-rank gloo world (marked ``world``); the pure cases are in
``tests/test_error_texts.py``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

import commgroups as cg
from commgroups import errors
from tests.test_error_texts import MAX_CHARS
from tests.test_errors_world import _ranked
from tests.worlds import run_world

pytestmark = pytest.mark.world


def _texts(rank: int, world_size: int) -> dict[str, str]:
    """'ClassName|message' of every error, by case; the cases of test_errors_world first."""
    out = {name: text.split("|", 1)[0] + "|" + text.split("|", 2)[-1]
           for name, text in _ranked(rank, world_size).items() if text != "no error"}

    def attempt(name: str, action: Callable[[], object]) -> None:
        try:
            action()
            out[name] = "no error"
        except errors.CommGroupsError as error:
            out[name] = f"{type(error).__name__}|{error}"

    # Twelve roles whose timeouts differ by rank: more differences than a short text can list.
    many = cg.Layout(dims={"cp": 2}, roles=[
        cg.RoleSpec(name=f"role-{i}", dims=["cp"], timeout_s=rank + i + 1) for i in range(12)])
    attempt("many differences", lambda: cg.GroupRegistry(many).create())
    # Rank 1 skips this create(): rank 0 names it after create_timeout_s.
    if rank == 0:
        attempt("skipped create", lambda: cg.GroupRegistry(cg.Layout(dims={"cp": 2}),
                                                           create_timeout_s=2).create())
    return out


def test_rank_dependent_error_texts() -> None:
    results = run_world(_texts, 2, timeout=120)
    assert "timeout_s" in results[0]["many differences"] and "more" in results[0]["many differences"]
    assert results[0]["skipped create"].startswith("AgreementTimeoutError|")
    assert "never arrived: [1]" in results[0]["skipped create"]
    for out in results:
        assert out["many differences"].startswith("LayoutMismatchError|"), out
        for name, text in out.items():
            kind, _, message = text.partition("|")
            assert len(message) <= MAX_CHARS, f"{name}: {kind} ({len(message)} chars): {message}"
            assert "fix:" in message, f"{name}: {kind}: {message}"
