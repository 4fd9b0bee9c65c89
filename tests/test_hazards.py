"""commgroups.audit.hazards: every hazard rule, alone and through find_hazards, on pure inputs.

The inputs are per-rank recordings as dicts (``_rank_data``, ``_rec``: the other audit analysis tests
build theirs with them too).

No process group and no torch.distributed: like the planner's tests, the inputs are plain data.
"""

from __future__ import annotations

from typing import Any

from commgroups.audit.hazards import (
    aliasing_hazards,
    default_group_hazards,
    device_on_gloo_hazards,
    find_hazards,
    foreign_group_hazards,
    mixed_stream_hazards,
    off_purpose_hazards,
    sequence_mismatch_hazards,
    uncounted_hazards,
)


def _rank_data(rank: int, records: list[dict[str, Any]], *, backend: str = "gloo",
               roles: dict[str, str] | None = None) -> dict[str, Any]:
    return {"format": "commgroups-audit/1", "rank": rank, "world_size": 2, "default_group": "0",
            "groups": {"0": {"ranks": [0, 1], "backend": backend, "default": True, "roles": []},
                       "1": {"ranks": [0, 1], "backend": backend, "default": False,
                             "roles": ["cp"]}},
            "roles": roles or {"cp": "1"}, "role_ranks": {"cp": [0, 1]}, "records": records}


def _rec(op: str, async_op: bool | None, *, group: str = "1", device: str = "cpu",
         stream: int | str = "cpu") -> dict[str, Any]:
    exec_stream = None if async_op is None else (
        f"group:{group}" if async_op else (f"{device}/stream:{stream}" if device != "cpu" else "cpu"))
    return {"index": 0, "op": op, "group": group, "group_seq": 1, "roles": ["cp"],
            "async_op": async_op, "stream": stream, "device": device, "exec_stream": exec_stream,
            "shapes": [[4]], "dtypes": ["float32"], "caller": "train.py:1 in step"}


def test_mixed_streams_on_nccl_is_an_error() -> None:
    records = [_rec("c10d.allreduce_", False, device="cuda:0", stream=7),
               _rec("c10d._allgather_base_", True, device="cuda:0", stream=7)]
    hazards = find_hazards([_rank_data(0, records, backend="nccl")])
    assert [(h.kind, h.severity) for h in hazards] == [("mixed_streams", "error")]
    # blocking calls from two caller streams, no async call: still two streams on one communicator
    records = [_rec("c10d.allreduce_", False, device="cuda:0", stream=7),
               _rec("c10d.allreduce_", False, device="cuda:0", stream=9)]
    assert [h.kind for h in find_hazards([_rank_data(0, records, backend="nccl")])] == [
        "mixed_streams"]
    # all async, or p2p without a flag: nothing
    records = [_rec("c10d.allreduce_", True), _rec("c10d.send", None)]
    assert find_hazards([_rank_data(0, records)]) == []


def test_default_group_doing_a_roles_work() -> None:
    data = _rank_data(0, [_rec("c10d.allgather_", False, group="0")])
    [hazard] = find_hazards([data])
    assert hazard.kind == "aliasing" and hazard.roles == ("cp",)
    assert "dedicated group over the same ranks" in hazard.message


def test_uneven_ops_compare_op_and_dtype_only() -> None:
    a = _rec("c10d.allgather_", True)
    b = dict(a, shapes=[[1], [2]])  # uneven lists legitimately differ per rank
    assert find_hazards([_rank_data(0, [a]), _rank_data(1, [b])]) == []
    c = dict(_rec("c10d.allreduce_", True), shapes=[[8]])
    d = _rec("c10d.allreduce_", True)
    [hazard] = find_hazards([_rank_data(0, [c]), _rank_data(1, [d])])
    assert hazard.kind == "sequence_mismatch"


# ------------------------------------------------------------------- each hazard rule alone
def test_aliasing_role_on_the_default_group_is_one_hazard_for_every_rank() -> None:
    datas = [_rank_data(rank, [_rec("c10d.allreduce_", True, group="0")], roles={"cp": "0"})
             for rank in (0, 1)]
    [hazard] = aliasing_hazards(datas)
    assert (hazard.kind, hazard.severity, hazard.group) == ("aliasing", "error", "0")
    assert hazard.roles == ("cp",) and hazard.ranks == (0, 1)
    assert "run on the default group 0 (1 call(s)" in hazard.message
    assert hazard.details == {"calls": 1, "first_caller": "train.py:1 in step"}
    # the other rules see nothing here: one stream, same sequences
    assert mixed_stream_hazards(datas) == [] and sequence_mismatch_hazards(datas) == []


def test_aliasing_needs_work_on_the_default_group_or_a_role_there() -> None:
    clean = _rank_data(0, [_rec("c10d.allreduce_", False)])  # on the role's own group 1
    assert aliasing_hazards([clean]) == []
    # a default group over other ranks than the role's: not the role's work
    other = _rank_data(0, [_rec("c10d.allreduce_", True, group="0")])
    other["role_ranks"] = {"cp": [0]}
    assert aliasing_hazards([other]) == []
    # no torch.distributed world when recording: no default group to alias
    alone = dict(clean, default_group=None)
    assert aliasing_hazards([alone]) == []


def test_mixed_streams_on_gloo_is_a_latent_warning() -> None:
    records = [_rec("c10d._allgather_base_", False), _rec("c10d.allreduce_", True),
               _rec("c10d.allreduce_", True)]
    [hazard] = mixed_stream_hazards([_rank_data(0, records), _rank_data(1, records)])
    assert (hazard.kind, hazard.severity, hazard.group, hazard.roles) == (
        "mixed_streams", "warning", "1", ("cp",))
    assert hazard.ranks == (0, 1) and "latent on gloo" in hazard.message
    assert hazard.details["streams"] == {"cpu": 1, "group:1": 2}
    assert hazard.details["blocking_ops"] == {"c10d._allgather_base_": 1}
    assert hazard.details["blocking_callers"] == ["train.py:1 in step"]
    # async calls from any number of callers share the group's stream: nothing
    assert mixed_stream_hazards([_rank_data(0, records[1:])]) == []


def test_sequence_mismatch_names_the_first_divergence_only() -> None:
    a = [_rec("c10d.allreduce_", True), _rec("c10d.broadcast_", True)]
    b = [_rec("c10d.allreduce_", True), _rec("c10d.allreduce_", True), _rec("c10d.barrier", True)]
    [hazard] = sequence_mismatch_hazards([_rank_data(0, a), _rank_data(1, b)])
    assert hazard.group == "1" and hazard.ranks == (0, 1) and hazard.roles == ("cp",)
    assert hazard.details == {"index": 1, "calls_per_rank": {0: 2, 1: 3}}
    assert "call #2" in hazard.message and "ranks 0: c10d.broadcast_" in hazard.message
    # a rank that stopped early: its missing call is "nothing"
    [hazard] = sequence_mismatch_hazards([_rank_data(0, a[:1]), _rank_data(1, a)])
    assert "ranks 0: nothing" in hazard.message


def test_sequence_check_skips_point_to_point_and_single_ranks() -> None:
    send = [_rec("c10d.send", None), _rec("c10d.allreduce_", True)]
    recv = [_rec("c10d.recv_", None), _rec("c10d.allreduce_", True)]
    assert sequence_mismatch_hazards([_rank_data(0, send), _rank_data(1, recv)]) == []
    odd = [_rec("c10d.broadcast_", True)]
    assert sequence_mismatch_hazards([_rank_data(0, odd)]) == []
    assert find_hazards([_rank_data(0, odd)]) == []  # one rank: no cross-rank check at all
    assert [h.kind for h in find_hazards([_rank_data(0, odd), _rank_data(1, send)])] == [
        "sequence_mismatch"]


def _isolation_data(records: list[dict[str, Any]], *, sequence: dict[str, list[int]] | None = None,
                    registry: bool = True) -> dict[str, Any]:
    """Rank 0 of 4: default group 0; registry groups 1 (tp, compute) and 2 (checkpoint)."""
    return {"format": "commgroups-audit/1", "rank": 0, "world_size": 4, "default_group": "0",
            "groups": {"0": {"ranks": [0, 1, 2, 3], "backend": "gloo", "default": True,
                             "roles": []},
                       "1": {"ranks": [0, 1], "backend": "gloo", "default": False, "roles": ["tp"]},
                       "2": {"ranks": [0, 1, 2, 3], "backend": "gloo", "default": False,
                             "roles": ["checkpoint-metadata"]},
                       "9": {"ranks": [0, 2], "backend": "gloo", "default": False, "roles": []}},
            "roles": {"tp": "1", "checkpoint-metadata": "2"},
            "role_ranks": {"tp": [0, 1], "checkpoint-metadata": [0, 1, 2, 3]},
            "purposes": {"tp": "compute", "checkpoint-metadata": "checkpoint"},
            "registry_groups": ["1", "2"] if registry else None,
            "sequence": sequence or {}, "records": records}


def _dcp(rec: dict[str, Any], inside: bool) -> dict[str, Any]:
    return {**rec, "in_checkpoint": inside}


def test_checkpoint_group_outside_dcp_is_off_purpose() -> None:
    inside = _dcp(_rec("c10d.allgather_", False, group="2"), True)
    outside = _dcp(_rec("_c10d_functional.all_reduce", True, group="2"), False)
    assert off_purpose_hazards([_isolation_data([inside])]) == []
    [hazard] = off_purpose_hazards([_isolation_data([inside, outside, outside])])
    assert (hazard.kind, hazard.severity, hazard.roles) == ("off_purpose", "error",
                                                            ("checkpoint-metadata",))
    assert hazard.details["calls"] == 2 and "checkpoint-metadata" in hazard.message
    # a compute role's traffic is its purpose, inside DCP or not
    assert off_purpose_hazards([_isolation_data([_dcp(_rec("c10d.allreduce_", True), False)])]) == []
    # files written before purposes existed: nothing to judge
    old = _isolation_data([outside])
    del old["purposes"]
    assert off_purpose_hazards([old]) == []


def test_device_tensors_on_gloo_are_named() -> None:
    cuda = _rec("_c10d_functional.all_reduce", True, group="2", device="cuda:0", stream=7)
    [hazard] = device_on_gloo_hazards([_isolation_data([cuda, _rec("c10d.allreduce_", True)])])
    assert (hazard.kind, hazard.group, hazard.details["devices"]) == ("device_on_gloo", "2",
                                                                      {"cuda:0": 1})
    assert "checkpoint-metadata" in hazard.message
    assert device_on_gloo_hazards([_isolation_data([_rec("c10d.allreduce_", True)])]) == []


def test_default_and_foreign_groups_are_named_with_a_registry_only() -> None:
    on_default, on_foreign = _rec("c10d.allreduce_", True, group="0"), _rec("c10d.allreduce_",
                                                                            True, group="9")
    data = _isolation_data([on_default, on_foreign])
    # checkpoint-metadata spans the default group's ranks: aliasing names that one
    assert [h.kind for h in aliasing_hazards([data])] == ["aliasing"]
    assert default_group_hazards([data]) == []
    [foreign] = foreign_group_hazards([data])
    assert (foreign.group, foreign.severity) == ("9", "warning")
    no_world_role = {**data, "role_ranks": {"tp": [0, 1]}, "roles": {"tp": "1"}}
    [default] = default_group_hazards([no_world_role])
    assert (default.kind, default.group, default.details["calls"]) == ("default_group", "0", 1)
    without_registry = _isolation_data([on_default, on_foreign], registry=False)
    assert default_group_hazards([without_registry]) == foreign_group_hazards(
        [without_registry]) == []


def test_a_group_count_that_disagrees_is_uncounted() -> None:
    two = [_rec("c10d.allreduce_", True), _rec("c10d.allreduce_", True)]
    assert uncounted_hazards([_isolation_data(two, sequence={"1": [5, 7]})]) == []
    [hazard] = uncounted_hazards([_isolation_data(two, sequence={"1": [5, 9], "2": [0, 0]})])
    assert (hazard.kind, hazard.roles, hazard.details) == ("uncounted", ("tp",),
                                                           {"recorded": 2, "counted": 4})
    assert "could not see" in hazard.message
