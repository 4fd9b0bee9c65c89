"""commgroups.creation.descriptor_table: which descriptor number a growth ahead of creation
takes (the growth itself, in a fresh process: tests/test_descriptor_table_world.py)."""

from __future__ import annotations

import doctest

from commgroups.creation import descriptor_table
from commgroups.creation.descriptor_table import growth_target


def test_the_docstring_examples_hold() -> None:
    result = doctest.testmod(descriptor_table)
    assert result.attempted >= 3 and result.failed == 0


def test_the_target_fits_the_new_descriptors_and_stays_under_the_limit() -> None:
    assert growth_target(range(59), 38, 64, None) == 96
    assert growth_target(range(59), 5, 64, None) is None  # 63 fits a table of 64 (0..63)
    assert growth_target(range(59), 6, 64, None) == 64  # the first number that does not
    assert growth_target({0, 1, 2, 500}, 100, 512, 4096) is None  # 497 holes fill first
    assert growth_target({0, 1, 2, 500}, 510, 512, 4096) == 513
    assert growth_target(range(501), 100, 512, 4096) == 600
    assert growth_target(range(501), 100, 512, 510) is None  # capped at 509: it fits already
    assert growth_target(range(59), 500, 64, 256) == 255
    assert growth_target((), 70, 64, None) == 69
