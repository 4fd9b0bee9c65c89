"""The audit's analysis alone: pure inputs (per-rank recordings as dicts and JSON files), each hazard
rule on its own, merging per-rank files, the call-site rule, and proof that none of it imports torch.

No process group and no torch.distributed: like the planner's tests, the inputs are plain data.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from importlib.util import find_spec
from pathlib import Path
from typing import Any

import pytest

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
from commgroups.audit.merge import AuditFileError, load_dir, merge, merge_dir
from commgroups.audit.records import (
    FILE_FORMAT,
    CollectiveRecord,
    group_sort_key,
    rank_file_name,
    rank_span,
)
from commgroups.cli import main
from commgroups.util.call_sites import PLUMBING_MODULES, call_site, is_plumbing

REPO = Path(__file__).resolve().parents[1]
AUDIT_PACKAGE = REPO / "commgroups" / "audit"
# The analysis: everything in commgroups/audit but the recorder, which observes live collectives.
ANALYSIS_MODULES = ("records", "hazards", "report", "merge")
# The call-site helper the analysis and the registry share (commgroups.util.call_sites): held to
# the analysis modules' rule too.
CALL_SITES = REPO / "commgroups" / "util" / "call_sites.py"


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


def test_bad_directories_are_named(tmp_path: Path) -> None:
    with pytest.raises(AuditFileError, match="no such directory"):
        merge_dir(tmp_path / "missing")
    with pytest.raises(AuditFileError, match="no rank"):
        merge_dir(tmp_path)
    (tmp_path / "rank00000.json").write_text("{not json")
    with pytest.raises(AuditFileError, match="cannot read"):
        merge_dir(tmp_path)
    (tmp_path / "rank00000.json").write_text(json.dumps({"format": "other"}))
    with pytest.raises(AuditFileError, match="not a commgroups audit file"):
        merge_dir(tmp_path)
    (tmp_path / "rank00000.json").write_text(json.dumps(_rank_data(0, [])))
    (tmp_path / "rank00001.json").write_text(json.dumps(_rank_data(0, [])))
    with pytest.raises(AuditFileError, match="more than one file"):
        merge_dir(tmp_path)
    assert main(["audit", str(tmp_path / "missing")]) == 2




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


# -------------------------------------------------------------------- merging per-rank files
def _write_run(directory: Path, datas: list[dict[str, Any]]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for data in datas:
        (directory / rank_file_name(data["rank"])).write_text(json.dumps(data))


def test_merge_of_per_rank_files(tmp_path: Path) -> None:
    # each rank: a blocking and an async call on cp's group 1, and one async call on the default group
    datas = [_rank_data(rank, [_rec("c10d.allreduce_", False), _rec("c10d.allreduce_", True),
                               _rec("c10d.allreduce_", True, group="0")]) for rank in (1, 0)]
    _write_run(tmp_path, datas)
    assert [d["rank"] for d in load_dir(tmp_path)] == [0, 1]
    report = merge_dir(tmp_path)
    assert report.ranks == (0, 1) and report.world_size == 2 and not report.ok
    groups = report.summary["groups"]
    assert groups["1"] == {"ranks": [0, 1], "backend": "gloo", "default": False, "roles": ["cp"],
                           "calls": 4, "blocking": 2, "async": 2}
    assert (groups["0"]["calls"], groups["0"]["default"]) == (2, True)
    assert [(h.kind, h.ranks) for h in report.hazards] == [
        ("aliasing", (0, 1)), ("mixed_streams", (0, 1))]
    assert report == merge(sorted(datas, key=lambda d: d["rank"]))
    text = report.render().splitlines()
    assert text[0] == "audit: 2 rank file(s), world size 2; calls per group, summed over ranks:"
    assert text[1] == "  group 0 (default group) roles=- backend=gloo calls=2 blocking=0 async=2"
    assert text[2] == "  group 1 roles=cp backend=gloo calls=4 blocking=2 async=2"
    assert text[3] == "2 hazard(s):"
    assert text[4].startswith("- [error] aliasing on group 0 (ranks 0,1): 1 collective(s) ran")
    assert text[5].startswith("- [warning] mixed_streams on group 1 (ranks 0,1): one communicator")
    data = json.loads(json.dumps(report.to_dict()))
    assert data["ok"] is False and data["ranks"] == [0, 1]
    assert [h["kind"] for h in data["hazards"]] == ["aliasing", "mixed_streams"]


def test_merge_of_a_clean_run_and_bad_entries(tmp_path: Path) -> None:
    clean = [_rank_data(rank, [_rec("c10d.allreduce_", True)]) for rank in range(2)]
    report = merge(clean)
    assert report.ok and report.render().endswith("no hazards found")
    with pytest.raises(AuditFileError, match="rank data #1: not a commgroups audit file"):
        merge([clean[0], {"format": "other"}])
    assert clean[0]["format"] == FILE_FORMAT


# ------------------------------------------------------------------------ the call-site rule
def _frame_chain(modules: list[str]) -> str:
    """call_site() seen through one function per module name, outermost first.

    Each function is compiled with its module's name in its globals and a file name derived from
    it, the way an imported module's frames carry them.
    """
    below: Any = call_site
    for module in reversed(modules):
        namespace: dict[str, Any] = {"__name__": module, "below": below}
        exec(compile("def hop():\n    return below()\n", f"/src/{module.replace('.', '/')}.py",
                     "exec"), namespace)
        below = namespace["hop"]
    result: str = below()
    return result


def test_call_site_is_the_first_frame_outside_the_plumbing() -> None:
    chain = ["torchtitan.train", "commgroups.integrations.fsdp", "torch.distributed.fsdp",
             "typing_extensions", "torch.distributed.distributed_c10d", "commgroups.audit.recorder"]
    assert _frame_chain(chain) == "/src/torchtitan/train.py:2 in hop"
    # an application built on commgroups is a caller like any other: no special case for the demo
    assert _frame_chain(["commgroups.demo.train", "commgroups.collectives.role_collectives",
                         "torch.distributed"]
                        ).startswith("/src/commgroups/demo/train.py:")
    assert _frame_chain(["spmd_types._collectives", "torch.distributed"]).startswith(
        "/src/spmd_types/_collectives.py:")
    # with nothing but plumbing inside, the test itself is the caller
    assert _frame_chain(["torch.x", "commgroups.registry"]).startswith(__file__)


def test_is_plumbing_matches_whole_module_prefixes() -> None:
    assert is_plumbing("torch") and is_plumbing("torch.distributed.tensor._redistribute")
    assert is_plumbing("commgroups.backends.nccl") and is_plumbing("commgroups.audit.recorder")
    assert not is_plumbing("torchtitan.train")  # a prefix of the name, not of the module path
    assert not is_plumbing("commgroups.demo.train") and not is_plumbing("commgroups.bench.run")
    assert not is_plumbing("__main__")
    assert is_plumbing("mylib.wrappers", ("mylib",))


def test_every_plumbing_prefix_names_an_existing_module() -> None:
    # a module renamed or removed on main must be renamed here too, or its frames become callers
    missing = [prefix for prefix in PLUMBING_MODULES if find_spec(prefix) is None]
    assert missing == []


# -------------------------------------------------------------------------- no torch, no cycle
def _imports(path: Path) -> set[str]:
    """Every module ``path`` imports, inside functions too (TYPE_CHECKING blocks excluded)."""
    tree = ast.parse(path.read_text())
    type_checking = {id(node) for block in ast.walk(tree) if isinstance(block, ast.If)
                     and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                     for node in ast.walk(block)}
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in type_checking:
            continue
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            found |= {f"{node.module}.{alias.name}" for alias in node.names}
        elif (isinstance(node, ast.Call) and ast.unparse(node.func) == "importlib.import_module"
              and node.args and isinstance(node.args[0], ast.Constant)):
            found.add(str(node.args[0].value))
    return found


def test_audit_modules_form_no_cycle_and_the_analysis_never_reaches_the_recorder() -> None:
    modules = {("commgroups.audit" if p.stem == "__init__" else f"commgroups.audit.{p.stem}"): p
               for p in AUDIT_PACKAGE.glob("*.py")}
    assert {f"commgroups.audit.{name}" for name in ANALYSIS_MODULES} <= modules.keys()
    edges = {name: {m for m in _imports(path) if m in modules and m != name}
             for name, path in modules.items()}
    for name in ANALYSIS_MODULES:
        imported = _imports(modules[f"commgroups.audit.{name}"])
        assert not {m for m in imported if m == "torch" or m.startswith("torch.")}, name
        assert "commgroups.audit.recorder" not in imported and "commgroups" not in imported, name
    shared = _imports(CALL_SITES)
    assert not {m for m in shared if m == "torch" or m.startswith("torch.")}
    assert not {m for m in shared if m == "commgroups" or m.startswith("commgroups.")}
    assert "commgroups.audit.recorder" in edges["commgroups.audit"]  # lazily, for record()
    # depth-first search for a cycle
    state: dict[str, int] = {}

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for target in sorted(edges[name]):
            assert state.get(target) != 1, f"import cycle: {' -> '.join([*path, target])}"
            if target not in state:
                visit(target, [*path, target])
        state[name] = 2

    for name in sorted(modules):
        if name not in state:
            visit(name, [name])


_BLOCK_TORCH = textwrap.dedent("""
    import importlib.abc, sys, types

    class BlockTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "torch" or name.startswith("torch."):
                raise ImportError(f"blocked: the audit's analysis imported {name}")
            return None

    sys.meta_path.insert(0, BlockTorch())
    # commgroups/__init__ imports the registry (and torch): load the package's modules without it,
    # as the planner's torch-free test does
    package = types.ModuleType("commgroups")
    package.__path__ = [sys.argv[1]]
    sys.modules["commgroups"] = package
""")


def _run_without_torch(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _BLOCK_TORCH + textwrap.dedent(code),
                           str(REPO / "commgroups"), *args],
                          capture_output=True, text=True, cwd=REPO, timeout=120)


def test_analysis_and_cli_run_with_torch_blocked(tmp_path: Path) -> None:
    _write_run(tmp_path, [_rank_data(rank, [_rec("c10d.allreduce_", True, group="0")])
                          for rank in range(2)])
    library = _run_without_torch("""
        import json
        import commgroups.audit as audit
        report = audit.merge_dir(sys.argv[2])
        hazards = audit.find_hazards(audit.load_dir(sys.argv[2]))
        try:
            audit.record
            recorder = "imported"
        except ImportError as error:  # the torch half, asked for by name, needs torch
            recorder = str(error)
        torch = sorted(m for m in sys.modules if m == "torch" or m.startswith("torch."))
        print(json.dumps({"kinds": [h.kind for h in report.hazards], "local": len(hazards),
                          "text": report.render(), "recorder": recorder, "torch": torch}))
    """, str(tmp_path))
    assert library.returncode == 0, library.stderr
    out = json.loads(library.stdout)
    assert out["kinds"] == ["aliasing"] and out["local"] == 1 and out["torch"] == []
    assert "aliasing on group 0 (ranks 0,1)" in out["text"]
    assert out["recorder"].startswith("blocked: the audit's analysis imported torch")
    cli = _run_without_torch("""
        from commgroups.cli import main
        sys.exit(main(["audit", sys.argv[2], "--json"]))
    """, str(tmp_path))
    assert cli.returncode == 1, cli.stderr  # 1: hazards found
    assert json.loads(cli.stdout)["hazards"][0]["kind"] == "aliasing"


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
