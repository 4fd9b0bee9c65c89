"""Agreement: ranks holding different layouts always get LayoutMismatchError, on every rank.

Its tests that start processes are in ``tests/test_agreement_world.py`` (marked ``world``).
"""

from __future__ import annotations

from commgroups.creation.agreement import describe_differences


def test_describe_differences_names_paths() -> None:
    lines = describe_differences({"dims": [["cp", 4]], "roles": [{"name": "cp"}]},
                                 {"dims": [["cp", 2]], "roles": [{"name": "tp"}]}, ("a", "b"))
    assert lines == ["dims[0][1]: a has 4, b has 2", "roles[0].name: a has 'cp', b has 'tp'"]
