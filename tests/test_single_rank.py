"""The single-rank backend: a 1-rank group with no communicator gives a real 1-rank group's results.

Every check runs on real multi-process gloo worlds: each rank makes its own single-rank group and a
real 1-rank gloo group, runs the same collective on the same input on both, and compares outputs,
futures and Work behaviour side by side.

Its tests that start processes are in ``tests/test_single_rank_world.py`` (marked ``world``).
"""

from __future__ import annotations

from commgroups.backends.single_rank import (
    TORCH_BACKEND,
    SingleRankAdapter,
)


def test_adapter_describes_the_backend() -> None:
    adapter = SingleRankAdapter()
    assert (adapter.name, adapter.torch_backend, adapter.supports_split) == ("single", TORCH_BACKEND,
                                                                            False)
    assert adapter.default_timeout().total_seconds() > 0
