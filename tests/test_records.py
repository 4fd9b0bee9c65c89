"""commgroups.audit.records: the record schema round-trips through JSON; file names, group order, spans."""

from __future__ import annotations

import json

from commgroups.audit.records import (
    CollectiveRecord,
    group_sort_key,
    rank_file_name,
    rank_span,
)


# ------------------------------------------------------------------------------ the schema
def test_record_schema_round_trips_through_json() -> None:
    rec = CollectiveRecord(0, "c10d.allreduce_", "1", 1, ("cp",), False, "cpu", "cpu", "cpu",
                           ((4,), (2, 3)), ("float32",), "train.py:12 in step")
    data = json.loads(json.dumps(rec.to_dict()))
    assert data["shapes"] == [[4], [2, 3]] and data["roles"] == ["cp"]
    assert CollectiveRecord(**{**data, "roles": ("cp",), "shapes": ((4,), (2, 3)),
                               "dtypes": ("float32",)}) == rec
    assert rank_file_name(3) == "rank00003.json" and rank_file_name(12345) == "rank12345.json"
    assert sorted(["x", "10", "2", "0"], key=group_sort_key) == ["0", "2", "10", "x"]
    assert (rank_span([3, 1, 2]), rank_span([0, 2]), rank_span([1, 0])) == ("1..3", "0,2", "0,1")
