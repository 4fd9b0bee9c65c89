"""The control plane's store cost per rank does not grow with the job: the product's loss report,
answers and check-in for simulated ranks (commgroups.bench.control_plane) against one real
TCPStore server, at two sizes eight times apart."""

from __future__ import annotations

import pytest

from commgroups.bench import control_plane
from commgroups.bench.progress import NullProgress

pytestmark = pytest.mark.world


def test_check_in_requests_per_rank_do_not_grow_with_the_world() -> None:
    tables, summary = control_plane.run([128, 1024], 0.5, NullProgress(), idle_max=8)
    (table,) = tables
    per_rank = [float(row[table.columns.index("check-in req/rank")]) for row in table.rows]
    bytes_per_rank = [float(row[table.columns.index("check-in bytes/rank")].replace(",", ""))
                      for row in table.rows]
    assert per_rank[1] <= per_rank[0] + 0.5, per_rank  # O(1) requests per rank
    assert bytes_per_rank[1] <= 1.5 * bytes_per_rank[0], bytes_per_rank  # O(1) bytes per rank
    # Decided once the lost rank left the report unanswered for dead_after_s (1 s), not later.
    assert all(0.9 < seconds < 30 for seconds in summary["control_plane_check_in_s"].values())
