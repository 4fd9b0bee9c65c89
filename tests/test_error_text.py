"""commgroups.util.error_text: texts that list values stay within the bound and count the rest.

The bound held by every error commgroups raises: ``tests/test_error_texts.py``.
"""

from __future__ import annotations

from commgroups.util.error_text import MAX_ERROR_CHARS, first_fitting, fit_lines, listed


def test_listed_cuts_and_counts() -> None:
    assert listed(["dp", "cp", "tp"]) == "dp, cp, tp"
    assert listed(["dp", "cp", "tp"], width=6) == "dp, cp, ... (3 in all)"
    assert listed(["dp", "cp", "tp"], width=6, count=False) == "dp, cp, ..."
    assert listed([]) == ""


def test_first_fitting_takes_the_fullest_that_fits() -> None:
    assert first_fitting("x" * (MAX_ERROR_CHARS + 1), "short", "shorter") == "short"
    assert first_fitting("x" * 400, "y" * 350) == "y" * 350  # none fits: the last, the shortest


def test_fit_lines_keeps_head_and_tail_and_names_what_it_left_out() -> None:
    lines = [f"roles[{i}].timeout_s: a timeout is seconds, got {-i}" for i in range(40)]
    text = fit_lines("invalid Layout:\n  ", lines, "; fix: see above",
                     names=[f"roles[{i}].timeout_s" for i in range(40)])
    assert len(text) <= MAX_ERROR_CHARS, len(text)
    assert text.startswith("invalid Layout:\n  roles[0].timeout_s") and text.endswith("; fix: see above")
    shown = text.count("a timeout is seconds")
    assert 1 < shown < 40 and f"(and {40 - shown} more: roles[{shown}].timeout_s" in text, text
    assert fit_lines("h: ", ["one line"], " t") == "h: one line t"


def test_fit_lines_cuts_a_first_line_that_cannot_fit() -> None:
    text = fit_lines("head: ", ["x" * 1000, "y"], "; fix: z")
    assert len(text) <= MAX_ERROR_CHARS and text.startswith("head: xxx") and text.endswith("; fix: z")
    assert "x ...\n  (and 1 more)" in text
    # A line's own fix survives the cut: what is cut is the value it quotes.
    text = fit_lines("invalid Layout: ", ["dims: got " + "v" * 1000 + "; fix: give a mapping"])
    assert len(text) <= MAX_ERROR_CHARS and text.endswith("vvv ...; fix: give a mapping"), text
