"""install_parallel_state on one real 8-rank gloo world: Megatron's getters answer from the registry.

Each rank, for each degree combination: runs Megatron's own ``initialize_model_parallel`` and calls
every getter of :data:`~commgroups.integrations.megatron.install.COVERED_GETTERS` (each argument
variant), then ``destroy_model_parallel``; then creates a registry over ``megatron_layout`` with the
same degrees, installs it, calls the same getters and compares answer by answer (groups by their
ranks; none may be the default group). The refused getters raise ``MissingRoleError`` naming
themselves. Then the leak count: torch's live groups before and after 10 cycles of create, install
and ``destroy_model_parallel()`` (every other one after ``registry.close()``), against Megatron's
own initialize/destroy cycle (which leaks 20 groups a cycle here, Megatron-LM #6897).
Skips without megatron-core.
"""

from __future__ import annotations

import inspect
import time
from pathlib import Path
from typing import Any

import pytest

import commgroups as cg
from commgroups.errors import ArgumentError, RegistryStateError
from commgroups.integrations import megatron as mg
from commgroups.util.local_world import run_local_world
from tests import torch_private

pytestmark = [pytest.mark.world]

pytest.importorskip("megatron.core", reason="megatron-core is not installed (pip install "
                    "'commgroups[megatron]', Python 3.12): CI's megatron step runs these")

WORLD = 8
PRELOAD = ("torch", "torch.distributed", "commgroups", "megatron.core.parallel_state",
           "commgroups.integrations.megatron", "tests.test_megatron_install_world")

# tp, pp, cp, dp, ep, expt_tp, order, virtual pipeline size
COMBOS: list[tuple[int, int, int, int, int, int, str, int | None]] = [
    (2, 2, 1, 2, 2, 1, "tp-cp-ep-dp-pp", 2),
    (2, 1, 2, 2, 2, 2, "tp-cp-ep-dp-pp", None),
]

_BOOLS = (False, True)
CALLS: list[tuple[str, dict[str, Any]]] = [
    *[("get_amax_reduction_group", {"with_context_parallel": c, "tp_only_amax_red": t})
      for c in _BOOLS for t in _BOOLS],
    *[(name, {"with_context_parallel": c, "with_gtp_remat": g, "partial_data_parallel": p})
      for name in ("get_data_parallel_group", "get_data_parallel_rank",
                   "get_data_parallel_world_size")
      for c in _BOOLS for g in _BOOLS for p in _BOOLS if c or not p],
    *[("get_data_parallel_group_gloo", {"with_context_parallel": c, "partial_data_parallel": p})
      for c in _BOOLS for p in _BOOLS if c or not p],
    *[("get_data_parallel_src_rank", {"with_context_parallel": c}) for c in _BOOLS],
    *[(name, {"with_gtp_remat": g, "partial_expert_data_parallel": p})
      for name in ("get_expert_data_parallel_group", "get_expert_data_parallel_rank",
                   "get_expert_data_parallel_world_size") for g in _BOOLS for p in _BOOLS],
    *[("get_expert_data_parallel_group_gloo", {"partial_expert_data_parallel": p}) for p in _BOOLS],
    *[("get_expert_tensor_model_pipeline_parallel_group", {"with_egtp_remat": e}) for e in _BOOLS],
    *[("get_tensor_and_data_parallel_group", {"with_context_parallel": c}) for c in _BOOLS],
    ("get_embedding_group", {"check_initialized": False}),
    ("get_position_embedding_group", {"check_initialized": False}),
    *[(name, {}) for name in (
        "get_context_parallel_global_ranks", "get_context_parallel_group",
        "get_context_parallel_rank", "get_context_parallel_world_size",
        "get_expert_gtp_weight_remat_global_ranks", "get_expert_gtp_weight_remat_group",
        "get_expert_gtp_weight_remat_rank", "get_expert_gtp_weight_remat_world_size",
        "get_expert_model_parallel_group", "get_expert_model_parallel_rank",
        "get_expert_model_parallel_src_rank", "get_expert_model_parallel_world_size",
        "get_expert_tensor_and_model_parallel_group", "get_expert_tensor_and_model_parallel_rank",
        "get_expert_tensor_and_model_parallel_world_size", "get_expert_tensor_parallel_group",
        "get_expert_tensor_parallel_rank", "get_expert_tensor_parallel_world_size",
        "get_global_memory_buffer", "get_gtp_weight_remat_global_ranks",
        "get_gtp_weight_remat_group", "get_gtp_weight_remat_rank", "get_gtp_weight_remat_world_size",
        "get_intra_distributed_optimizer_instance_group", "get_model_parallel_group",
        "get_model_parallel_src_rank", "get_pipeline_model_parallel_first_rank",
        "get_pipeline_model_parallel_group", "get_pipeline_model_parallel_last_rank",
        "get_pipeline_model_parallel_next_rank", "get_pipeline_model_parallel_prev_rank",
        "get_pipeline_model_parallel_rank", "get_pipeline_model_parallel_world_size",
        "get_tensor_and_context_parallel_group", "get_tensor_and_context_parallel_rank",
        "get_tensor_and_context_parallel_world_size", "get_tensor_model_parallel_group",
        "get_tensor_model_parallel_rank", "get_tensor_model_parallel_src_rank",
        "get_tensor_model_parallel_world_size", "get_virtual_pipeline_model_parallel_rank",
        "get_virtual_pipeline_model_parallel_world_size", "get_all_ranks", "is_initialized",
        "is_pipeline_first_stage", "is_pipeline_last_stage", "is_rank_in_embedding_group",
        "is_rank_in_position_embedding_group", "model_parallel_is_initialized")],
]


def _answer(value: Any) -> Any:
    """A getter's answer in comparable form: a group by its ranks, a buffer by its type."""
    import torch.distributed as dist

    if isinstance(value, dist.ProcessGroup):
        return ("group", tuple(dist.get_process_group_ranks(value)))
    if isinstance(value, list):
        return tuple(value)
    if value is None or isinstance(value, (bool, int, str)):
        return value
    return ("object", type(value).__name__)


def _ask_every_getter() -> tuple[dict[str, Any], list[str]]:
    """Every call of CALLS on parallel_state: answers by call, and groups that are the default."""
    from megatron.core import parallel_state as ps

    answers: dict[str, Any] = {}
    default = []
    for name, kwargs in CALLS:
        key = f"{name}({', '.join(f'{k}={v}' for k, v in kwargs.items())})"
        value = getattr(ps, name)(**kwargs)
        answers[key] = _answer(value)
        if value is not None and value is torch_private.default_group():
            default.append(key)
    return answers, default


def _megatron_answers(combo: tuple[Any, ...]) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    tp, pp, cp, _dp, ep, expt_tp, order, virtual = combo
    ps.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp,
        expert_model_parallel_size=ep, expert_tensor_parallel_size=expt_tp, order=order,
        virtual_pipeline_model_parallel_size=virtual, create_gloo_process_groups=True)
    try:
        return _ask_every_getter()[0]
    finally:
        ps.destroy_model_parallel()


def _leak_cycles(layout: Any, cycles: int) -> int:
    """torch's live groups after ``cycles`` of create, install, a getter, teardown, minus before.

    Odd cycles close the registry before ``destroy_model_parallel()``, even ones leave it to it.
    """
    from megatron.core import parallel_state as ps

    import commgroups as cg
    from commgroups.integrations import megatron as mg

    before = len(torch_private.live_groups())
    for cycle in range(cycles):
        registry = cg.GroupRegistry(layout, heartbeat_s=None).create()
        handle = mg.install_parallel_state(registry)
        assert ps.get_tensor_model_parallel_group() is registry.group("tp")
        if cycle % 2:
            registry.close()
        ps.destroy_model_parallel()  # closes the registry (on_destroy="close")
        assert not handle.installed and registry.state.value == "closed"
        assert ps.get_tensor_model_parallel_group(check_initialized=False) is None
    return len(torch_private.live_groups()) - before


def _rank_checks(rank: int, world_size: int, post: Any) -> dict[str, Any]:
    from megatron.core import parallel_state as ps

    import commgroups as cg
    from commgroups.errors import MissingRoleError, RegistryStateError
    from commgroups.integrations import megatron as mg
    from commgroups.integrations.megatron import install

    problems: list[str] = []
    seconds: dict[str, float] = {}
    for combo in COMBOS:
        tp, pp, cp, dp, ep, expt_tp, order, virtual = combo
        name = "-".join(map(str, combo))
        start = time.monotonic()
        expected = _megatron_answers(combo)
        seconds[name + " megatron"] = time.monotonic() - start
        start = time.monotonic()
        layout = mg.megatron_layout(tp=tp, pp=pp, cp=cp, dp=dp, ep=ep, expt_tp=expt_tp, order=order)
        registry = cg.GroupRegistry(layout, heartbeat_s=None).create()
        handle = mg.install_parallel_state(registry, virtual_pipeline_model_parallel_size=virtual)
        got, default = _ask_every_getter()
        problems += [f"{name}: {key} is the default group" for key in default]
        problems += [f"{name}: {key}: registry {got[key]} vs Megatron {expected[key]}"
                     for key in expected if got[key] != expected[key]]
        for getter in install.REFUSED_GETTERS:
            try:
                getattr(ps, getter)(group_size=3) if "hybrid" in getter else getattr(ps, getter)()
                problems.append(f"{name}: {getter} answered")
            except MissingRoleError as error:
                if getter not in str(error) or "fix:" not in str(error):
                    problems.append(f"{name}: {getter}'s refusal does not name it: {error}")
        # dp*cp is the one hybrid size the registry has: Megatron's own answer, the dp_cp group
        if ps.get_hybrid_data_context_parallel_groups(group_size=dp * cp) is not registry.group(
                "dp_cp"):
            problems.append(f"{name}: hybrid groups of size dp*cp are not dp_cp's group")
        try:  # a second install, or initialize_model_parallel's groups: refused, nothing changed
            mg.install_parallel_state(registry)
            problems.append(f"{name}: a second install was accepted")
        except RegistryStateError as error:
            if "destroy_model_parallel" not in str(error):
                problems.append(f"{name}: second install's error names no fix: {error}")
        # Megatron's own code reading the globals: its TP all-reduce runs on the registry's tp group
        import torch
        from megatron.core.tensor_parallel import mappings

        with cg.audit.record(registry) as recorder:
            reduced = mappings.reduce_from_tensor_model_parallel_region(torch.full((2,), float(rank)))
        ops = sorted({(r.op, r.roles) for r in recorder.records})
        if ops != [("c10d.allreduce_", ("tp",))] or reduced.tolist() != [float(sum(
                registry.ranks("tp")))] * 2:
            problems.append(f"{name}: Megatron's TP reduce ran {ops} -> {reduced.tolist()}")
        handle.uninstall()  # the registry stays: close it ourselves
        if ps.get_data_parallel_group.__module__ != ps.__name__ or any(
                getattr(ps, g).__module__ != ps.__name__ for g in install.REFUSED_GETTERS):
            problems.append(f"{name}: uninstall left a replaced function")
        leftover = [n for n in (*install.STATE_ROLES, *install.RANK_LISTS)
                    if getattr(ps, n) is not None]
        problems += [f"{name}: uninstall left {n} set" for n in leftover]
        registry.close()
        seconds[name + " registry"] = time.monotonic() - start

    # initialize_model_parallel's groups in place: install is refused and changes nothing
    ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)
    theirs = ps.get_tensor_model_parallel_group()
    layout = mg.megatron_layout(tp=2, dp=4)
    registry = cg.GroupRegistry(layout, heartbeat_s=None).create()
    try:
        mg.install_parallel_state(registry)
        problems.append("install over initialize_model_parallel was accepted")
    except RegistryStateError:
        pass
    if ps.get_tensor_model_parallel_group() is not theirs:
        problems.append("a refused install changed parallel_state")
    ps.destroy_model_parallel()
    registry.close()
    plain = cg.GroupRegistry(cg.Layout(dims={"dp_shard": 8}), heartbeat_s=None).create()
    try:  # a layout that is not megatron_layout's: the missing roles named, nothing written
        mg.install_parallel_state(plain)
        problems.append("install over a non-Megatron layout was accepted")
    except MissingRoleError as error:
        if "megatron_layout" not in str(error) or ps.is_initialized():
            problems.append(f"non-Megatron layout: {error}")
    plain.close()

    start = time.monotonic()
    leaks = {"registry_10_cycles": _leak_cycles(layout, 10)}
    seconds["10 registry cycles"] = time.monotonic() - start
    start = time.monotonic()
    before = len(torch_private.live_groups())
    for _ in range(3):
        ps.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=True)
        ps.destroy_model_parallel()
    leaks["megatron_per_cycle"] = (len(torch_private.live_groups()) - before) // 3
    seconds["3 megatron cycles"] = time.monotonic() - start
    return {"problems": problems, "leaks": leaks, "seconds": seconds, "calls": len(CALLS)}


def test_getters_answer_from_the_registry_and_nothing_leaks() -> None:
    start = time.monotonic()
    reports = run_local_world(_rank_checks, WORLD, timeout_s=240.0, preload=PRELOAD)
    failures = {r: rep.traceback for r, rep in reports.items() if not rep.ok}
    assert not failures, "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failures.items()))
    assert sorted(reports) == list(range(WORLD))
    problems = [f"rank {r}: {p}" for r in range(WORLD) for p in reports[r].value["problems"]]
    assert not problems, "\n".join(problems[:40])
    for r in range(WORLD):
        leaks = reports[r].value["leaks"]
        assert leaks["registry_10_cycles"] == 0, (r, leaks)
        assert leaks["megatron_per_cycle"] > 0, (r, leaks)  # the count sees a leak where there is one
    print(f"8-rank world: {time.monotonic() - start:.1f}s; {reports[0].value['calls']} getter calls "
          f"per combination; leaks (groups) {reports[0].value['leaks']}; rank 0: "
          + ", ".join(f"{k} {v:.2f}s" for k, v in reports[0].value["seconds"].items()))


def test_every_getter_is_covered_or_refused() -> None:
    from megatron.core import parallel_state as ps

    from commgroups.integrations.megatron import install

    getters = {name for name, fn in inspect.getmembers(ps, inspect.isfunction)
               if fn.__module__ == ps.__name__
               and name.startswith(("get_", "is_", "model_parallel_is"))}
    assert getters - {"get_nccl_options"} == set(install.COVERED_GETTERS) | set(
        install.REFUSED_GETTERS)
    assert {name for name, _ in CALLS} == set(install.COVERED_GETTERS)  # the world asks each one
    assert not set(install.COVERED_GETTERS) & set(install.REFUSED_GETTERS)


# Argument errors, raised before any group exists or parallel_state changes (in this file: importing
# Megatron starts a git subprocess, which only world-marked files may).
def test_install_refuses_bad_arguments_before_touching_parallel_state() -> None:
    from megatron.core import parallel_state as ps

    registry = cg.GroupRegistry(mg.megatron_layout(tp=2, dp=4))  # not created: no process group
    with pytest.raises(ArgumentError, match=r"on_destroy='keep'.*fix:") as raised:
        mg.install_parallel_state(registry, on_destroy="keep")
    assert raised.value.field == "on_destroy"
    with pytest.raises(ArgumentError, match="virtual_pipeline_model_parallel_size=0"):
        mg.install_parallel_state(registry, virtual_pipeline_model_parallel_size=0)
    with pytest.raises(ArgumentError, match="needs pp > 1"):
        mg.install_parallel_state(registry, virtual_pipeline_model_parallel_size=2)
    with pytest.raises(RegistryStateError, match=r"created registry.*fix: call registry.create"):
        mg.install_parallel_state(registry)
    assert ps.get_tensor_model_parallel_group(check_initialized=False) is None
    assert ps.destroy_model_parallel.__module__ == ps.__name__  # nothing replaced


def test_checkpoint_refuses_bad_arguments_before_any_exchange(tmp_path: Path) -> None:
    from commgroups.integrations.megatron import checkpoint

    registry = cg.GroupRegistry(mg.megatron_layout(dp=2))  # not created
    with pytest.raises(ArgumentError, match="not a directory") as raised:
        checkpoint.save({}, tmp_path / "missing", registry=registry)
    assert raised.value.field == "checkpoint_dir"
    with pytest.raises(ArgumentError, match="thread_count"):
        checkpoint.save({}, tmp_path, registry=registry, thread_count=0)
    with pytest.raises(ArgumentError, match="process_group comes from registry="):
        checkpoint.load({}, tmp_path, registry=registry, process_group=None)
    with pytest.raises(ArgumentError, match="verify_integrity=True broadcasts on the default"):
        checkpoint.load({}, tmp_path, registry=registry, verify_integrity=True)
    with pytest.raises(cg.errors.MissingRoleError, match="metadata"):
        checkpoint.save({}, tmp_path, registry=registry, role="metadata")


def test_internals_refuse_names_this_megatron_lacks() -> None:
    from commgroups.errors import MegatronUnavailableError
    from commgroups.integrations.megatron import megatron_internals as internals

    assert internals.megatron_version().startswith("0.19.")
    assert set(internals.checkpoint_names()) == set(internals.SAVE_NAMES)
    with pytest.raises(MegatronUnavailableError, match=r"has no _NO_SUCH_GROUP"):
        internals.set_state({"_TENSOR_MODEL_PARALLEL_GROUP": None, "_NO_SUCH_GROUP": None})
