"""Every private torch attribute commgroups touches, each behind one small function.

torch's public API does not cover everything commgroups needs (the default store, how c10d names
groups, FSDP2's default comm classes, ...). Those private attributes change between releases, so they
are reached from this module only (``tests/test_torch_internals.py`` fails on any other use in
``commgroups/`` or ``backends/``). Each function says which torch versions it was checked on and what
it does where the attribute is missing; public APIs are used first where a version has them.

Checked versions: the CI legs 2.10.0, 2.13.0 (CPU) and 2.15.0 (a PyPI build, run on CPU); 2.14.1, not a
CI leg, once (a PyPI build, on CPU), except where a function says NOT CHECKED.
"""

from __future__ import annotations

import logging
import sys
import types
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed import Store  # type: ignore[attr-defined]  # re-exported at runtime

# Re-exported: the dispatch-mode base class and pytree helper the audit recorder needs. Both live in
# private modules on every checked version (2.10-2.15); torch has no public home for them.
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

# NCCL's classes (ProcessGroupNCCL, ProcessGroupNCCL2): their own module, with the inventory of what
# commgroups reads on them.
from .nccl_classes import (
    backend_options_copy,
    backend_supports_shrinking,
    group_backend,
    nccl_backend_class,
    nccl_comm_split_count,
    nccl_options,
    set_options_timeout,
)

__all__ = [
    "CHECKED_VERSIONS",
    "backend_options_copy",
    "backend_plugin",
    "clear_flatten_mapping",
    "cuda_sync_events_config",
    "device_backend_autoload_enabled",
    "functional_collective_ops",
    "nccl_comm_split_count",
    "nccl_backend_class",
    "nccl_options",
    "group_backend",
    "install_error_backends",
    "privateuse1_backend_name",
    "work_from_future",
    "GroupCall",
    "TorchDispatchMode",
    "default_group",
    "abort_group",
    "backend_supports_shrinking",
    "default_store",
    "custom_op_body",
    "defers_to_subclass",
    "op_schema",
    "devicemesh_rows",
    "flatten_mesh",
    "fsdp_default_comm_classes",
    "flight_trace_entries",
    "functional_all_reduce",
    "group_naming_state",
    "group_sequence_counter",
    "group_sequence_number",
    "has_reconfigure",
    "hccl_process_group_class",
    "import_fake_backend",
    "predict_group_names",
    "reconfigure_group",
    "reconfigure_handle",
    "recv_source_rank",
    "register_flattened_mesh",
    "registered_group_names",
    "resolve_group_name",
    "set_group_timeout",
    "set_options_timeout",
    "shrink_abort_flag",
    "supports_reconfigure",
    "tree_leaves",
    "torchcomms_enabled",
    "wait_slice",
]

logger = logging.getLogger(__name__)

CHECKED_VERSIONS: tuple[str, ...] = ("2.10.0", "2.13.0", "2.14.1", "2.15.0")
"""The torch releases the functions here were checked on: the CI legs (2.10.0, 2.13.0, 2.15.0) run
every one; 2.14.1 (not a CI leg) was checked once, except where a docstring says NOT CHECKED."""


# ----------------------------------------------------------------------------- default group
def default_group() -> dist.ProcessGroup:
    """The default (world) process group.

    Public ``torch.distributed.group.WORLD`` on 2.10, 2.13, 2.14.1, 2.15.0; listed here so the
    callers that used ``distributed_c10d._get_default_group`` have one replacement.

    Raises:
        RuntimeError: the default group is not initialized (call ``init_process_group`` first).
    """
    group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise RuntimeError(
            "the default process group is not initialized; fix: call "
            "torch.distributed.init_process_group() (or run under torchrun) first"
        )
    return group


def default_store() -> Store:
    """The store the default group rendezvoused on (commgroups keeps its agreement keys there).

    ``distributed_c10d._get_default_store()``: private and present on 2.10, 2.13, 2.14.1, 2.15.0;
    torch has no public getter. No fallback: without it ranks cannot agree, so its absence is an error.
    """
    store: Store = c10d._get_default_store()
    return store


def abort_group(group: dist.ProcessGroup) -> None:
    """Abort ``group``'s communicators without its peers (NCCL: ``ncclCommAbort``).

    ``distributed_c10d._abort_process_group(group)``: private, present on 2.10, 2.13, 2.14.1 and
    2.15.0. For a non-default group it calls ``ProcessGroup.abort()``, which aborts every backend
    the group holds through the C++ ``Backend::abort()``, then drops the group from c10d's tables
    (read in the 2.10, 2.13 and 2.15 sources). torch documents it for NCCL; ProcessGroupHCCL
    (torch_npu) overrides ``abort()`` too, which is NOT CHECKED here (no torch_npu, see
    ``backends/hccl.py``). Failures are logged, never raised: the group is being thrown away
    after a rank loss.
    """
    abort = getattr(c10d, "_abort_process_group", None)
    if not callable(abort):
        logger.warning("this torch has no _abort_process_group: %s is left alone", group)
        return
    try:
        abort(group)
    except (RuntimeError, ValueError) as error:
        logger.warning("aborting %s failed: %s", group, error)


def shrink_abort_flag() -> int | None:
    """The ``shrink_flags`` value that makes ``shrink_group`` abort the parent's work first.

    ``distributed_c10d.SHRINK_ABORT`` (NCCL's ``NCCL_SHRINK_ABORT``, 0x01): a module constant that
    ``torch.distributed`` does not re-export, present with value 1 on 2.10, 2.13 and 2.15.0 (read
    in their sources and imported); 2.14.1 NOT CHECKED (no venv of it here). NCCL documents it for
    error recovery, where the parent may be hung on a dead peer. None where torch lacks it.
    """
    flag = getattr(c10d, "SHRINK_ABORT", None)
    return flag if isinstance(flag, int) else None


# ---------------------------------------------------------------------------------- timeouts
def set_group_timeout(group: dist.ProcessGroup, timeout: timedelta) -> None:
    """Set ``group``'s timeout for collectives issued from now on (the group's backends in place).

    Public ``torch.distributed.set_timeout(timeout, group)`` where it exists (2.14.1, 2.15.0; there the
    private ``_set_pg_timeout`` is a deprecated alias that warns); ``distributed_c10d._set_pg_timeout``
    on 2.10 and 2.13, which have no public setter.
    """
    public = getattr(dist, "set_timeout", None)
    if callable(public):
        public(timeout, group)
    else:
        c10d._set_pg_timeout(timeout, group)


# ------------------------------------------------------------------------------- group names
def resolve_group_name(name: str) -> dist.ProcessGroup:
    """The live ProcessGroup c10d registered under ``name`` (functional collectives name groups).

    ``distributed_c10d._resolve_process_group``: private, present on 2.10, 2.13, 2.14.1, 2.15.0.
    No fallback (the audit cannot attribute a functional collective without it).
    """
    resolve: Callable[[str], dist.ProcessGroup] = c10d._resolve_process_group  # type: ignore[attr-defined,assignment]
    return resolve(name)


def registered_group_names() -> set[str] | None:
    """Names of the groups this rank has registered (is a member of), default group included.

    ``distributed_c10d._world.pg_names`` (a ProcessGroup -> name dict) on 2.10, 2.13, 2.14.1, 2.15.0.
    None where that table is missing (callers then treat names as unknown and stay safe).
    """
    world = getattr(c10d, "_world", None)
    names = getattr(world, "pg_names", None)
    if not isinstance(names, dict):
        return None
    return {str(name) for name in names.values()}


def group_naming_state(world_size: int) -> str | None:
    """A digest of the state c10d names member-only groups from (equal state: equal names).

    Asks torch itself: ``distributed_c10d._hash_ranks_to_str(range(world_size))`` is the name torch
    would give a member-only group over every rank right now. Its salt is ``len(_world.pg_names)``
    on 2.10 and 2.13 and ``_world.group_count`` on 2.14.1 and 2.15.0; commgroups need not know which.
    None where the function is missing.
    """
    hash_ranks = getattr(c10d, "_hash_ranks_to_str", None)
    if not callable(hash_ranks):
        return None
    return str(hash_ranks(list(range(world_size))))


@dataclass(frozen=True)
class GroupCall:
    """One ``new_group`` call this rank is about to make, for :func:`predict_group_names`."""

    ranks: tuple[int, ...]
    """The group's global ranks."""
    local: bool
    """``use_local_synchronization=True`` (member-only creation: a hashed name)."""
    member: bool
    """This rank is in ``ranks`` (members register the group under its name)."""


class _NamingState:
    """A copy of the two counters c10d's ``_world`` names groups from, advanced by torch's own code.

    Only these attributes exist: if a torch release reads anything else to name a group, the
    prediction fails (AttributeError) instead of guessing.
    """

    __slots__ = ("group_count", "pg_names")

    def __init__(self, group_count: int, pg_names: dict[Any, str]) -> None:
        self.group_count = group_count
        self.pg_names = pg_names


def _rebind(fn: Callable[..., Any], namespace: dict[str, Any]) -> Callable[..., Any]:
    return types.FunctionType(fn.__code__, namespace, fn.__name__, fn.__defaults__, None)


def _names_read(code: types.CodeType) -> set[str]:
    """The global (and attribute) names ``code`` and the code nested in it read."""
    names = set(code.co_names)
    for constant in code.co_consts:
        if isinstance(constant, types.CodeType):
            names |= _names_read(constant)
    return names


def _shadow_namespace(module: types.ModuleType, *functions: types.FunctionType) -> dict[str, Any]:
    """The globals ``functions`` read from ``module``, copied: a name they do not read is not
    there (copying c10d's whole namespace cost ``create()`` 0.1-0.2 ms on a process's first
    call). Builtins resolve as in the module."""
    names = set().union(*(_names_read(fn.__code__) for fn in functions))
    source = vars(module)
    namespace = {name: source[name] for name in names if name in source}
    namespace["__builtins__"] = source["__builtins__"]
    return namespace


def next_counter_name() -> str | None:
    """The name torch would give the next group made by every rank (``new_group`` without
    ``use_local_synchronization``): ``str(_world.group_count)`` on 2.10, 2.13, 2.14.1 and 2.15.0, read
    through :func:`predict_group_names` (torch's own naming code). Ranks whose answers differ cannot
    make such a group together: each would wait for the others under its own name. None where
    torch's naming cannot be predicted.
    """
    names = predict_group_names([GroupCall((0,), local=False, member=True)], 1)
    return names[0] if names else None


def predict_group_names(calls: Sequence[GroupCall], world_size: int) -> list[str] | None:
    """The names c10d will give the groups of ``calls`` (made in order by this rank), without making them.

    Runs torch's own ``distributed_c10d._process_group_name`` and ``_hash_ranks_to_str`` (the code,
    not a copy of the formula) against a copy of the counters they read (``_world.group_count`` and
    ``_world.pg_names``), adding each group to the copy of ``pg_names`` on its members as
    ``new_group`` does. torch 2.14 changed the salt of hashed names from ``len(pg_names)`` to
    ``group_count`` (which also counts calls a rank is not a member of); both are followed because
    torch's code decides. Checked on 2.10, 2.13, 2.14.1 and 2.15.0 by
    ``tests/test_torch_internals_world.py::test_predicted_names_match_torch`` (predicted ==
    registered names).

    Returns None (the caller must then not rely on names) where the functions or counters are
    missing, are wrapped, read state this copy lacks, or where the copy does not reproduce torch's
    current name for a probe group.
    """
    name_fn = getattr(c10d, "_process_group_name", None)
    hash_fn = getattr(c10d, "_hash_ranks_to_str", None)
    world = getattr(c10d, "_world", None)
    if not (isinstance(name_fn, types.FunctionType) and isinstance(hash_fn, types.FunctionType)):
        return None
    for fn in (name_fn, hash_fn):
        # A decorated or closure-carrying function could call the real one and move torch's own
        # counters; only plain module functions are rebound.
        if hasattr(fn, "__wrapped__") or fn.__code__.co_freevars or fn.__globals__ is not vars(c10d):
            return None
    try:
        state = _NamingState(int(world.group_count), dict(world.pg_names))  # type: ignore[union-attr]
    except (AttributeError, TypeError, ValueError):
        return None
    namespace = _shadow_namespace(c10d, name_fn, hash_fn)
    namespace["_world"] = state
    shadow_hash = _rebind(hash_fn, namespace)
    namespace["_hash_ranks_to_str"] = shadow_hash
    shadow_name = _rebind(name_fn, namespace)
    probe = list(range(world_size))
    try:
        # Only hashed names (member-only groups) go through the hash; a counter name does not,
        # and skipping the probe spares next_counter_name sha1's first use (0.1 ms in create()).
        if any(call.local for call in calls) and shadow_hash(probe) != hash_fn(probe):
            return None
        names: list[str] = []
        for call in calls:
            name = str(shadow_name(list(call.ranks), use_hashed_name=call.local))
            if call.member:
                state.pg_names[object()] = name
            names.append(name)
    except (AttributeError, TypeError, KeyError):
        return None
    return names


def torchcomms_enabled() -> bool:
    """Whether torch routes new_group through TorchComms (``split_group``; no member-only mode).

    ``distributed_c10d._use_torchcomms_enabled()`` where present (2.13, 2.14.1, 2.15.0); False on
    versions without it (2.10), which have no TorchComms path.
    """
    check = getattr(c10d, "_use_torchcomms_enabled", None)
    return bool(check()) if callable(check) else False


def device_backend_autoload_enabled() -> bool:
    """Whether ``import torch`` loaded the installed device extensions (``torch.backends`` entry
    points, e.g. torch_npu): ``torch._is_device_backend_autoload_enabled()`` (read on 2.10, 2.13
    and 2.15.0: ``TORCH_DEVICE_BACKEND_AUTOLOAD`` unset or ``1``; 2.14.1 NOT CHECKED, no venv of
    it this time). False where it is missing: the caller then cannot tell an extension is absent
    from its not being imported.
    """
    check = getattr(torch, "_is_device_backend_autoload_enabled", None)
    return bool(check()) if callable(check) else False


# ------------------------------------------------------------------------------ reconfigure
def has_reconfigure() -> bool:
    """Whether this torch has the reconfigure API at all (no process group needed).

    ``distributed_c10d._supports_reconfigure``, ``_get_reconfigure_handle`` and ``_reconfigure``, all
    three: 2.15.0 has them (read and run), 2.10 and 2.13 have none; 2.14.1 NOT CHECKED.
    """
    return all(callable(getattr(c10d, name, None))
               for name in ("_supports_reconfigure", "_get_reconfigure_handle", "_reconfigure"))


def supports_reconfigure(group: dist.ProcessGroup | None = None) -> bool:
    """Whether ``group`` (None: the default group) can be reconfigured onto a new set of peers.

    ``distributed_c10d._supports_reconfigure(group)``: private and experimental, present on 2.15.0
    (read and run), absent on 2.10 and 2.13; 2.14.1 NOT CHECKED (facts say it has it; no venv of it
    here). On 2.15.0 it reports the backend's capability, not the regime: every gloo group answers
    True, made with or without ``init_process_group(enable_reconfigure=True)``, ``new_group``
    included (measured, ``benchmarks/reconfigure.py``). False where torch lacks it, where the default
    group is not initialized, or where the query raises: never raises itself.
    """
    probe = getattr(c10d, "_supports_reconfigure", None)
    if not callable(probe):
        return False
    try:
        if group is None and not dist.is_initialized():
            return False
        return bool(probe(group))
    except Exception as error:  # a backend without the capability may raise instead of saying no
        logger.debug("_supports_reconfigure(%s) raised: %s", group, error)
        return False


def reconfigure_handle(group: dist.ProcessGroup | None = None) -> str:
    """This rank's opaque reconfigure handle for ``group`` (exchange it out of band).

    ``distributed_c10d._get_reconfigure_handle(group)``: 2.15.0 only (absent on 2.10 and 2.13; 2.14.1
    NOT CHECKED). On 2.15.0's
    gloo it reads ``gloo:<group rank>:<uuid of the last reconfigure, -1 before>:<group rank>:
    <store host>:<store port>``; treat it as opaque. Call only where :func:`supports_reconfigure`
    said True.
    """
    get_handle: Callable[..., Any] = getattr(c10d, "_get_reconfigure_handle")  # noqa: B009
    return str(get_handle(group))


def reconfigure_group(group: dist.ProcessGroup | None, *, uuid: int, handles: Sequence[str],
                      timeout: timedelta | None = None) -> None:
    """Rebuild ``group``'s communicator in place on the peers ``handles`` name, and wait for it.

    ``distributed_c10d._reconfigure(uuid=, handles=, group=, timeout=)``: 2.15.0 only (absent on
    2.10 and 2.13; 2.14.1 NOT CHECKED). Every rank of the new set calls it with the same fresh
    ``uuid`` and the same handle list (its order gives the new group ranks). On 2.15.0's gloo,
    measured (``benchmarks/reconfigure.py``): the call blocks until every listed peer called it, then
    takes 20-65 ms (4 and 8 ranks); a collective this rank had blocked on the old peers then raises
    "Connection closed by peer", 20-200 ms later, whichever thread made the call.

    torch's own tables are NOT updated: ``group.rank()`` and ``group.size()`` are the new ones, but
    ``dist.get_rank(group)``, ``get_process_group_ranks`` and every rooted collective's global
    ``src``/``dst`` still use the old membership (a broadcast from a survivor's global rank fails
    "invalid root rank"), and DeviceMesh keeps the old ranks. Use it only where the membership's
    order is kept, or the group is addressed by group rank alone.
    """
    reconfigure: Callable[..., Any] = getattr(c10d, "_reconfigure")  # noqa: B009  (2.15 only)
    reconfigure(uuid=uuid, handles=list(handles), group=group, timeout=timeout).wait()


# ------------------------------------------------------------------------------------ works
_SLICE_RAN_OUT = "Operation timed out!"


def wait_slice(work: Any, seconds: float) -> bool:
    """Wait at most ``seconds`` for ``work``: True once it finished, False if the slice ran out
    (the work goes on: a later wait resumes it); the work's own failure raises as ``wait()`` does.

    ``Work.wait(timeout)`` is public, but what a slice that runs out does is not: on gloo it raises
    ``RuntimeError("Operation timed out!")`` and leaves the work running, its result intact
    (checked on 2.10, 2.13 and 2.15: a 2-rank all_reduce whose peer came 1 s late, waited in
    0.2 s slices, summed right; one whose peer never came finished at its own 5 s timeout).
    NOT CHECKED on 2.14.1, nor on NCCL, whose ``wait(timeout)`` may abort the communicator:
    callers use it on gloo only.
    """
    try:
        work.wait(timedelta(seconds=seconds))
    except RuntimeError as error:
        if str(error).strip() == _SLICE_RAN_OUT:
            return False
        raise
    return True


# -------------------------------------------------------------------------------------- p2p
def recv_source_rank(work: Any) -> int:
    """The group rank an any-source ``irecv``'s Work received from.

    ``Work._source_rank()``: the only way c10d exposes it (2.10, 2.13, 2.14.1, 2.15.0). No fallback.
    """
    return int(work._source_rank())


# --------------------------------------------------------------------------------- dispatcher
def op_schema(func: Any) -> Any:
    """The ``torch._C.FunctionSchema`` of an ``OpOverload`` (name and arguments of a dispatched op).

    ``OpOverload._schema`` on 2.10, 2.13, 2.14.1, 2.15.0; no public accessor. No fallback.
    """
    return func._schema


def custom_op_body(func: Any, args: Sequence[Any]) -> Callable[..., Any] | None:
    """The Python function a ``torch.library.custom_op`` runs for ``args``, or None.

    A custom op is opaque to a dispatch mode: the mode sees the op, and the op's body then runs
    with the mode popped, so the collectives inside it are invisible (torch's context parallel
    all-gathers FlexAttention's K/V inside ``cplib::flex_cp_allgather``). Calling the body from the
    mode's ``__torch_dispatch__`` instead (below autograd, as the dispatcher would) lets the mode see
    them. ``torch._library.custom_ops._maybe_get_opdef`` and ``CustomOpDef._backend_fns`` (device
    type -> function, None for every device): private on 2.10, 2.13 and 2.15 (2.14.1 not checked).
    None for ops defined another way, or where the attributes are missing.
    """
    try:
        from torch._library.custom_ops import _maybe_get_opdef

        opdef = _maybe_get_opdef(func)
    except (ImportError, AttributeError, TypeError, ValueError):
        return None
    backends = getattr(opdef, "_backend_fns", None)
    if not isinstance(backends, dict) or not backends:
        return None
    devices = {t.device.type for t in tree_leaves(list(args)) if isinstance(t, torch.Tensor)}
    device = devices.pop() if len(devices) == 1 else None
    body = backends.get(device, backends.get(None))
    return body if callable(body) else None


def defers_to_subclass(types: Sequence[type]) -> bool:
    """Whether a dispatch mode should let a tensor subclass among ``types`` run first.

    A mode's ``__torch_dispatch__`` sees an op on DTensors *before* DTensor desugars it, and the
    collectives DTensor then issues run with the mode popped: invisible. Returning NotImplemented
    for such ops lets the subclass run under the mode, so its collectives reach the mode (torch's own
    ``CommDebugMode`` does this for DTensor). Here: every traceable wrapper subclass
    (``torch.utils._python_dispatch.is_traceable_wrapper_subclass_type``, private on 2.10, 2.13,
    2.14.1, 2.15.0: DTensor, AsyncCollectiveTensor, ...) except the ones compile's own modes own
    (FakeTensor, FunctionalTensor), which have no meaning outside their mode.
    """
    if not types:  # plain tensors only: the common case, decided without imports
        return False
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass_type

    return any(
        t is not torch.Tensor and is_traceable_wrapper_subclass_type(t)
        and not issubclass(t, (FakeTensor, FunctionalTensor))
        for t in types
    )


def group_sequence_number(group: dist.ProcessGroup) -> int | None:
    """How many collectives (and point-to-point ops) ``group`` has run on this rank, or None.

    ``ProcessGroup._get_sequence_number_for_group()`` (2.10, 2.13, 2.14.1, 2.15.0): gloo and NCCL
    count every collective, functional ones, barriers, send and recv included; the fake backend and
    Python-implemented groups (commgroups' single-rank backend) raise, and then there is no count.
    """
    try:
        return int(group._get_sequence_number_for_group())  # type: ignore[attr-defined]
    except (RuntimeError, AttributeError, NotImplementedError, ValueError, TypeError):
        return None


def flight_trace_entries(groups: dict[str, str], limit: int = 64, call_sites: bool = True
                         ) -> list[dict[str, Any]]:
    """The newest ``limit`` entries per group of torch's own flight recorders on ``groups``, each
    with its role and (``call_sites``) call site; ``groups`` maps c10d group names to role names.

    torch keeps two recorders: the generic one, ``torch._C._distributed_c10d._dump_fr_trace``
    (from 2.8, every build; 2.13's gloo records into it by default, 2000 entries,
    ``TORCH_FR_BUFFER_SIZE`` sets the size, 0 turns it off), and ProcessGroupNCCL's own,
    ``_dump_nccl_trace`` (CUDA builds; torch 2.15's default ``ProcessGroupNCCL2`` records
    only from pytorch#192233). Both are read as their pickles with stack traces (the frames give
    each entry its ``caller``: the first frame outside torch and commgroups); their ``_json``
    forms, which carry no frames, where the pickle form is missing or fails. Each is skipped
    where missing or failing. They see every call on a group, plain, functional (DTensor) and
    object collectives included. Run on 2.13.0 (CPU: the generic recorder); NOT CHECKED here on
    2.10, 2.14.1, 2.15.0 (no wheel of them on this machine) nor on CUDA.
    """
    import json
    import pickle

    from commgroups.util.call_sites import FileModules, call_site_of

    module = torch._C._distributed_c10d
    out: list[dict[str, Any]] = []
    files = FileModules()
    for name in ("_dump_fr_trace", "_dump_nccl_trace"):
        data: Any = None
        dump = getattr(module, name, None)
        if dump is not None:
            try:
                # torch's own pickle of its own records, made in this process: not foreign input.
                data = pickle.loads(dump(includeStackTraces=call_sites))
            except (RuntimeError, ValueError, TypeError, pickle.UnpicklingError) as error:
                logger.debug("torch's flight recorder %s failed: %s", name, error)
        dump_json = getattr(module, name + "_json", None)
        if data is None and dump_json is not None:
            try:
                data = json.loads(dump_json())
            except (RuntimeError, ValueError, TypeError) as error:
                logger.debug("torch's flight recorder %s_json failed: %s", name, error)
        if not isinstance(data, dict):
            continue
        per_group: dict[str, list[dict[str, Any]]] = {}
        for entry in data.get("entries", []):
            where = entry.get("process_group") or ["", ""]
            role = groups.get(str(where[0]))
            if role is None:
                continue
            per_group.setdefault(str(where[0]), []).append({
                "role": role, "group": str(where[0]), "op": str(entry.get("profiling_name", "")),
                "group_seq": entry.get("collective_seq_id"), "state": entry.get("state"),
                "input_sizes": entry.get("input_sizes"), "input_dtypes": entry.get("input_dtypes"),
                "time_created_s": (entry.get("time_created_ns") or 0) / 1e9,
                "thread": entry.get("thread_name"), "recorder": name,
                "frames": entry.get("frames") or [],
            })
        for entries in per_group.values():
            for kept in entries[-limit:]:  # call sites only for what is kept: 2000 entries a ring
                frames = kept.pop("frames")
                kept["caller"] = call_site_of(frames, modules=files) if frames else ""
                out.append(kept)
    return out


def group_sequence_counter(group: dist.ProcessGroup) -> Callable[[], int] | None:
    """A callable returning :func:`group_sequence_number` cheaply (the bound method, 0.2 us on
    2.13), or None where the backend keeps no count (checked once, here).

    The flight recorder reads it on every recorded call. The same attribute as
    :func:`group_sequence_number`, ``ProcessGroup._get_sequence_number_for_group`` (2.10, 2.13,
    2.14.1, 2.15.0); the bound method itself was run on 2.13.0 only.
    """
    if group_sequence_number(group) is None:
        return None
    counter: Callable[[], int] = group._get_sequence_number_for_group  # type: ignore[attr-defined]
    return counter


def functional_all_reduce(tensor: torch.Tensor, op: str, group: dist.ProcessGroup) -> torch.Tensor:
    """A functional (always async) all-reduce, waited: ``_functional_collectives.all_reduce``.

    ``torch.distributed._functional_collectives`` on 2.10, 2.13, 2.14.1, 2.15.0. No fallback.
    """
    from torch.distributed import _functional_collectives as funcol

    result: Any = funcol.all_reduce(tensor, op, group)  # an AsyncCollectiveTensor
    waited: torch.Tensor = result.wait()
    return waited


# -------------------------------------------------------------------------------- DeviceMesh
def flatten_mesh(mesh: Any, name: str) -> Any:
    """``mesh._flatten(name)``: what plain DeviceMesh users do for FSDP over several dims.

    Private on 2.10, 2.13, 2.14.1, 2.15.0 (commgroups uses it only to show the plain-DeviceMesh
    baseline in the demo and benchmarks). No fallback.
    """
    return mesh._flatten(name)


def devicemesh_rows(sizes: Sequence[int]) -> list[list[int]] | None:
    """The rank rows DeviceMesh computes for each dim of ``sizes``, its full flatten and the world.

    ``torch.distributed._mesh_layout._MeshLayout``, which has two interfaces: 2.13, 2.14.1, 2.15.0
    (``from_sizes_strides``, ``collapse``, a sequence of flat layouts) and 2.10 (a CuTe layout made
    from ``(sizes, strides)``, ``nest``, ``coalesce``). Both follow DeviceMesh's own code of that
    version. None where the module is missing or has a third interface.
    """
    try:
        from torch.distributed import _mesh_layout
    except ImportError:
        return None
    from commgroups.planning.shapes import row_major_strides

    mesh_layout: Any = _mesh_layout._MeshLayout
    strides = row_major_strides(sizes)
    world = strides[0] * sizes[0] if sizes else 1
    rank_map = torch.arange(world, dtype=torch.int)
    rows: list[list[int]] = []
    try:
        if hasattr(mesh_layout, "from_sizes_strides"):  # 2.13+
            layout = mesh_layout.from_sizes_strides(tuple(sizes))
            dims = [mesh_layout([layout[dim]]) for dim in range(len(sizes))]
            flat = mesh_layout([layout.collapse()])
        else:  # 2.10
            layout = mesh_layout(tuple(sizes), tuple(strides))
            dims = [layout[dim].nest() for dim in range(len(sizes))]
            flat = layout.coalesce()
            if len(flat) > 1:
                flat = flat.nest()
            else:
                flat = flat.nest() if not isinstance(flat.shape, tuple) else flat
        for dim_layout in [*dims, flat]:
            rows.extend(row.tolist() for row in dim_layout.remap_to_tensor(rank_map))
    except (AttributeError, TypeError, ValueError):
        return None
    rows.append(list(range(world)))
    return rows


def register_flattened_mesh(mesh: Any, dim_names: Sequence[str], key: str,
                            group: dist.ProcessGroup) -> bool:
    """Make ``mesh[dim_names]._flatten(key)`` return a 1-D mesh on ``group``, creating nothing.

    torch's ``_flatten`` first looks in the root mesh's ``_flatten_mapping`` for ``key`` and returns
    the entry when its layout equals the one it would compute, so a mesh registered there with
    torch's own flattened layout is what third-party code (FSDP2's ``dp_mesh_dims``) gets back.
    DeviceMesh internals used: ``_layout``, ``_rank_map``, ``_flatten_mapping``,
    ``_dim_group_names`` and the ``_layout/_rank_map/_root_mesh/_init_backend`` constructor
    arguments; the flattened layout is computed as each version's ``_flatten`` does:
    ``_MeshLayout([layout.collapse()])`` on 2.13, 2.14.1, 2.15.0 (which also keep groups in
    ``_pg_registry``), ``layout.coalesce()`` (nested when it has several modes) on 2.10 (which
    resolves groups by name through c10d). Returns False, registering nothing, where the internals
    differ; the caller logs it.
    """
    from torch.distributed.device_mesh import DeviceMesh

    mapping = getattr(mesh, "_flatten_mapping", None)
    if getattr(mesh, "_layout", None) is None or mapping is None or not hasattr(mesh, "_rank_map"):
        return False
    try:
        sub_layout: Any = mesh[tuple(dim_names)]._layout
        if hasattr(sub_layout, "collapse"):  # 2.13+
            flat_layout = type(sub_layout)([sub_layout.collapse()])
        else:  # 2.10
            flat_layout = sub_layout.coalesce()
            if len(flat_layout) > 1:
                flat_layout = flat_layout.nest()
        flat: Any = DeviceMesh(
            mesh.device_type,
            _layout=flat_layout,
            _rank_map=mesh._rank_map,
            mesh_dim_names=(key,),
            _root_mesh=mesh,
            _init_backend=False,
        )
    except (AttributeError, TypeError):
        return False
    flat._dim_group_names = [group.group_name]
    for holder in (flat, mesh):
        registry = getattr(holder, "_pg_registry", None)
        if isinstance(registry, dict):
            registry[group.group_name] = group
    mapping[key] = flat
    return True


def clear_flatten_mapping(mesh: Any) -> None:
    """Drop ``mesh``'s flatten mapping (breaks the root <-> flattened-mesh reference cycle).

    ``DeviceMesh._flatten_mapping`` (a dict) on 2.10, 2.13, 2.14.1, 2.15.0; nothing to do where it
    is missing.
    """
    mapping = getattr(mesh, "_flatten_mapping", None)
    if isinstance(mapping, dict):
        mapping.clear()


# ----------------------------------------------------------------------- custom c10d backends
def privateuse1_backend_name() -> str:
    """The name of torch's PrivateUse1 device backend (``npu`` under torch_npu, else ``privateuseone``).

    ``torch._C._get_privateuse1_backend_name()`` on 2.10, 2.13, 2.14.1, 2.15.0. No fallback.
    """
    name: str = torch._C._get_privateuse1_backend_name()
    return name


def backend_plugin(name: str) -> Any:
    """The registered c10d backend plugin ``(creator_fn, extended_api)`` of ``name``, or None.

    ``dist.Backend._plugins`` (keyed by ``name.upper()``) on 2.10, 2.13, 2.14.1, 2.15.0. None where
    the table is missing (callers then register the backend).
    """
    plugins = getattr(dist.Backend, "_plugins", None)
    return plugins.get(name.upper()) if isinstance(plugins, dict) else None


def work_from_future(future: torch.futures.Future[Any]) -> dist.Work:
    """A c10d ``Work`` completed by ``future``: ``_C._distributed_c10d._create_work_from_future``.

    Present on 2.10, 2.13, 2.14.1, 2.15.0. No fallback.
    """
    c10d_c: Any = torch._C._distributed_c10d  # its stubs lag the bindings across versions
    work: dist.Work = c10d_c._create_work_from_future(future)
    return work


def install_error_backends(group: dist.ProcessGroup, devices: Sequence[str]) -> None:
    """Give ``group`` a backend per device that raises on any collective, as its default backend.

    For groups whose collectives are served above c10d (single-rank groups): anything that reaches
    the c10d backend is a bug and must fail loudly. ``FakeProcessGroup._create_internal(rank, size,
    options)`` with ``Options.error_on_collective``, ``ProcessGroup._register_backend`` and
    ``_set_default_backend`` (2.15 attaches its flight recorder to every new group and needs a
    default backend type); checked on 2.10, 2.13, 2.14.1, 2.15.0. No fallback.
    """
    c10d_c: Any = torch._C._distributed_c10d  # its stubs lag the bindings across versions
    custom = dist.ProcessGroup.BackendType.CUSTOM
    for device in devices:
        options = c10d_c.FakeProcessGroup.Options()
        options.error_on_collective = True
        guard = c10d_c.FakeProcessGroup._create_internal(0, 1, options)
        group._register_backend(torch.device(device), custom, guard)
    group._set_default_backend(custom)


def cuda_sync_events_config() -> Any | None:
    """A profiler ``experimental_config`` recording cuda_sync (Stream Wait Event) events, or None.

    ``torch._C._profiler._ExperimentalConfig(enable_cuda_sync_events=True)`` constructs on 2.10,
    2.13, 2.14.1, 2.15.0 (the events themselves need CUDA). None where it is missing or refuses.
    """
    try:
        from torch._C._profiler import _ExperimentalConfig

        return _ExperimentalConfig(enable_cuda_sync_events=True)
    except (ImportError, TypeError, RuntimeError):
        return None


def functional_collective_ops() -> Any:
    """The ``torch.ops._c10d_functional`` namespace (the ops DTensor issues: all_gather_into_tensor,
    wait_tensor, ...), present on 2.10, 2.13, 2.14.1, 2.15.0; the Python wrappers around them were
    renamed across those versions, the ops were not. No fallback.
    """
    return torch.ops._c10d_functional


# -------------------------------------------------------------------------------------- FSDP2
def fsdp_default_comm_classes() -> tuple[type[Any], type[Any]] | None:
    """FSDP2's ``(DefaultAllGather, DefaultReduceScatter)``, the bases of custom comm hooks.

    ``torch.distributed.fsdp._fully_shard._fsdp_collectives`` (2.10, 2.13, 2.14.1, 2.15.0); the
    setters that take them (``set_custom_all_gather`` / ``set_custom_reduce_scatter``) are public.
    None where the module or classes are missing (callers fall back to FSDP2's own comms).
    """
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_collectives import (
            DefaultAllGather,
            DefaultReduceScatter,
        )
    except ImportError:
        return None
    return DefaultAllGather, DefaultReduceScatter


# -------------------------------------------------------------------------------- fake worlds
def import_fake_backend() -> type[Any]:
    """Register torch's "fake" backend (one process simulates a world) and return its FakeStore.

    ``torch.testing._internal.distributed.fake_pg`` on 2.10, 2.13, 2.14.1, 2.15.0. No fallback.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore

    return FakeStore  # type: ignore[no-any-return]


# ---------------------------------------------------------------------------------- torch_npu
def hccl_process_group_class() -> type[Any]:
    """torch_npu's ``ProcessGroupHCCL`` (for its ``Options``); import torch_npu first.

    ``torch_npu._C._distributed_c10d.ProcessGroupHCCL``: NOT CHECKED on any version here (torch_npu
    needs the Ascend CANN toolkit and is never installed in CI, see ``backends/hccl.py``); the path is
    torch_npu 2.10's. ImportError propagates to the caller's clear message.
    """
    from torch_npu._C._distributed_c10d import (  # type: ignore[import-not-found]
        ProcessGroupHCCL,
    )

    return ProcessGroupHCCL  # type: ignore[no-any-return]


# ------------------------------------------------------------------------------------ DTensor
def clear_dtensor_caches() -> None:
    """Forget DTensor's cached sharding and redistribution decisions (they hold DeviceMeshes).

    torch compares meshes by layout and dim names only, so after a registry closes (its groups
    destroyed), a later mesh named like one of its meshes would get the old mesh back from these
    caches: "Could not resolve the process group". Cheap to refill.

    torch._C._clear_DTensor_sharding_propagator_cache (2.14.1, 2.15.0; absent on 2.10 and 2.13),
    DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear (2.10-2.15),
    _redistribute.clear_redistribute_planner_cache and _gen_transform_infos.cache_clear where they
    exist. Each is skipped where this torch lacks it.
    """
    if "torch.distributed.tensor" not in sys.modules:
        return  # DTensor never ran here: nothing is cached (and importing it costs seconds)
    from torch.distributed.tensor import DTensor, _redistribute

    native = getattr(torch._C, "_clear_DTensor_sharding_propagator_cache", None)
    if callable(native):
        native()
    propagate: Any = getattr(DTensor._op_dispatcher.sharding_propagator,
                             "propagate_op_sharding", None)
    if hasattr(propagate, "cache_clear"):
        propagate.cache_clear()
    planner = getattr(_redistribute, "clear_redistribute_planner_cache", None)
    if callable(planner):
        planner()
    transforms: Any = getattr(_redistribute, "_gen_transform_infos", None)
    if hasattr(transforms, "cache_clear"):
        transforms.cache_clear()


def groupless_mesh(device_type: str, mesh: torch.Tensor, names: tuple[str, ...]) -> Any:
    """A DeviceMesh of ``mesh``'s shape and ``names`` with no process group at all.

    For meshes a framework keeps only for their sizes (torchtitan's MoE view when ep == 1): a
    collective on one raises instead of running anywhere. ``DeviceMesh(..., _init_backend=False)``
    and ``_dim_group_names = []`` (2.10, 2.13, 2.14.1, 2.15.0).
    """
    from torch.distributed.device_mesh import DeviceMesh

    placeholder = DeviceMesh(device_type, mesh, mesh_dim_names=names, _init_backend=False)
    placeholder._dim_group_names = []
    return placeholder
