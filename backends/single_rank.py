"""A process group over one rank that creates no communicator, yet computes every collective.

A size-1 mesh dim or role still needs a process group (DeviceMesh, FSDP2 and DTensor call
collectives on it), but over one rank every collective is local tensor work: all-reduce and
broadcast leave the data as it is, all-gather, reduce-scatter, all-to-all, gather and scatter copy
input to output. torch's ``fake`` backend moves no data (wrong for all_gather and friends) and a real
1-rank NCCL communicator costs ~512 MiB of device memory; :class:`SingleRankProcessGroup` costs
neither: no NCCL/RCCL/HCCL/gloo context, no device memory, no socket, no store traffic.

It is a Python ``ProcessGroup`` subclass, like torch's own ``ProcessLocalGroup``
(``torch/testing/_internal/distributed/multi_threaded_pg.py``): torch.distributed's Python API calls
the group's methods directly, and C++ callers (functional collectives, DTensor, DDP) reach them
through torch's ``PyProcessGroup`` trampoline. Every collective runs at once on the caller's current
stream (as NCCL's ``async_op=False`` does) and returns a finished ``Work`` whose future holds the
output tensors.

Registration with torch (:func:`ensure_registered`) is lazy and idempotent: importing this module
registers nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from commgroups import torch_internals

from .base import BackendAdapter

__all__ = [
    "TORCH_BACKEND",
    "SingleRankAdapter",
    "SingleRankProcessGroup",
    "ensure_registered",
    "single_rank_device_types",
]

TORCH_BACKEND = "cg_single"
"""The name torch.distributed knows this backend by (``dist.get_backend(group)``)."""

_ReduceOp = dist.ReduceOp


def single_rank_device_types() -> list[str]:
    """Device types this machine's torch knows: cpu, cuda and the current accelerator, if any.

    Returns:
        ``["cpu", "cuda"]`` plus the accelerator's type (``xpu``, ``npu``, ``mps``, ...) when it is
        neither; a privateuse1 backend renamed by a plugin (torch_npu's ``npu``) is included too.

    Example::

        >>> single_rank_device_types()  # on a CPU-only machine
        ['cpu', 'cuda']
    """
    types = ["cpu", "cuda"]
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    if accelerator is not None and accelerator.type not in types:
        types.append(accelerator.type)
    privateuse1 = _privateuse1_name()
    if privateuse1 != "privateuseone" and privateuse1 not in types:
        types.append(privateuse1)
    return types


def ensure_registered() -> str:
    """Register the single-rank backend with torch.distributed (once; later calls do nothing).

    Registers for every device type :func:`single_rank_device_types` names, and never becomes a
    device's default backend (``init_process_group()`` without a backend is unaffected).

    Returns:
        The backend name to pass to ``new_group(backend=...)``: :data:`TORCH_BACKEND`.

    Raises:
        RuntimeError: another library registered a different backend under the same name.

    Example::

        >>> name = ensure_registered()
        >>> group = dist.new_group([dist.get_rank()], backend=name, use_local_synchronization=True)
    """
    devices = single_rank_device_types()
    plugin = _registered_plugin(TORCH_BACKEND)
    if plugin is not None and plugin.creator_fn is not _create_single_rank_group:
        raise RuntimeError(
            f"torch.distributed backend {TORCH_BACKEND!r} is already registered by someone else "
            f"({plugin.creator_fn!r}); fix: do not register another backend under that name"
        )
    known = dist.Backend.backend_capability.get(TORCH_BACKEND, [])
    if plugin is not None and all(device in known for device in devices):
        return TORCH_BACKEND
    # register_backend makes the backend the default of any listed device that has none
    # (torch 2.10-2.15); a 1-rank backend must never be picked by init_process_group().
    defaults = dist.Backend.default_device_backend_map
    unclaimed = [device for device in devices if device not in defaults]
    dist.Backend.register_backend(
        TORCH_BACKEND, _create_single_rank_group, extended_api=True,
        devices=sorted(set(known) | set(devices)),
    )
    for device in unclaimed:
        if defaults.get(device) == TORCH_BACKEND:
            del defaults[device]
    return TORCH_BACKEND


# ---- private torch attributes: reached through commgroups.torch_internals ------------------------
def _privateuse1_name() -> str:
    return torch_internals.privateuse1_backend_name()


def _registered_plugin(name: str) -> Any:
    return torch_internals.backend_plugin(name)


def _install_guard_backends(group: dist.ProcessGroup, devices: Sequence[str]) -> None:
    torch_internals.install_error_backends(group, devices)


def _create_single_rank_group(common: Any, options: Any) -> SingleRankProcessGroup:
    # torch's extended-API creator: `common` is a c10d DistributedBackendOptions.
    ranks = list(common.global_ranks_in_group)
    if common.group_size != 1:
        raise ValueError(
            f"backend {TORCH_BACKEND!r} serves groups of exactly one rank; got a group of "
            f"{common.group_size} ranks {ranks}; fix: give size-1 dims or roles this backend, "
            "and a real backend (gloo, nccl, ...) to larger ones"
        )
    return SingleRankProcessGroup(global_rank=ranks[0] if ranks else None)


def _done(result: list[torch.Tensor]) -> dist.Work:
    """A finished Work whose future holds ``result`` (after the work already queued on it)."""
    devices: list[int | str | torch.device] = list(
        sorted({str(t.device) for t in result if t.device.type != "cpu"}))
    # An accelerator future records an event on the current stream when set, and wait() makes the
    # waiter's stream wait for it: correct even if the consumer uses another stream.
    future: torch.futures.Future[list[torch.Tensor]] = (
        torch.futures.Future(devices=devices) if devices else torch.futures.Future()
    )
    future.set_result(result)
    return torch_internals.work_from_future(future)


def _factor(op: Any) -> Any:
    # A PREMUL_SUM ReduceOp carries its factor (a float or a 0-dim tensor); `.factor` exists from
    # torch 2.13 on, pickling state (op, factor) on every version.
    factor = getattr(op, "factor", None)
    if factor is None:
        factor = op.__getstate__()[1]
    return factor


def _reduce_in_place(tensors: Sequence[torch.Tensor], op: Any) -> None:
    """Apply the reduction of one rank: identity, except PREMUL_SUM, which scales by its factor."""
    kind = op.op if hasattr(op, "op") else op
    if kind == _ReduceOp.PREMUL_SUM:
        factor = _factor(op)
        with torch.no_grad():
            for tensor in tensors:
                tensor.detach().mul_(factor)


def _copy(out: torch.Tensor, src: torch.Tensor, what: str) -> None:
    if out.dtype != src.dtype:
        raise RuntimeError(f"{what}: output dtype {out.dtype} differs from input dtype {src.dtype}; "
                        "fix: pass tensors of one dtype")
    if out.numel() != src.numel():
        raise RuntimeError(f"{what}: output has {out.numel()} elements, input {src.numel()}; a 1-rank "
                         "group's output equals its input; fix: size the output like the input")
    if out.data_ptr() == src.data_ptr() and out.shape == src.shape and out.stride() == src.stride():
        return
    # Hide the copy from autograd like torch's own Python process group does: collectives mutate
    # their outputs behind autograd's back on every backend.
    with torch.no_grad():
        out.detach().copy_(src.detach().reshape(out.shape))


def _check_root(root: int, what: str) -> None:
    if root != 0:
        raise RuntimeError(f"{what}: root rank {root} is not in this 1-rank group (only rank 0)")


class SingleRankProcessGroup(dist.ProcessGroup):
    """A group of one rank whose collectives are local copies; it holds no communicator.

    Every collective returns a finished ``Work`` and leaves the same results a real 1-rank group
    gives: in place where torch's op is in place, ``output == input`` otherwise, PREMUL_SUM
    scaled by its factor, AVG the identity. Point-to-point ops raise: a 1-rank group has no peer.
    Timeouts do not apply (nothing waits); ``set_timeout`` only records the value.

    For the devices torch knows it holds a guard backend (torch's ``FakeProcessGroup`` with
    ``error_on_collective``): ``_get_backend(device)`` answers capability questions (no split, no
    tensor allocation), and a C++ caller that bypassed this class's methods would get an error,
    never a silently skipped collective.

    Args:
        global_rank: the default-group rank this group holds (for messages only).

    Example::

        >>> group = dist.new_group([dist.get_rank()], backend=ensure_registered(),
        ...                        use_local_synchronization=True)
        >>> out = torch.empty(4); dist.all_gather_into_tensor(out, torch.arange(4.), group=group)
        >>> out
        tensor([0., 1., 2., 3.])
    """

    backend_name: ClassVar[str] = TORCH_BACKEND

    # Overrides take torch.distributed's calling form (tensor lists + an options object); the
    # stub's other overloads (single tensor, root/op arguments) are pybind conveniences that
    # torch.distributed never calls on a group, hence the `type: ignore[override]`s.

    def __init__(self, global_rank: int | None = None) -> None:
        # The (rank, size) constructor exists (torch's ProcessLocalGroup uses it); the stub lacks it.
        super().__init__(0, 1)  # type: ignore[call-arg]
        self._global_rank = global_rank
        self._timeout: timedelta | None = None
        _install_guard_backends(self, dist.Backend.backend_capability.get(TORCH_BACKEND, ["cpu"]))

    def __repr__(self) -> str:
        return f"SingleRankProcessGroup(global_rank={self._global_rank})"

    def getBackendName(self) -> str:  # torch's C++ name, reached through the trampoline
        """The backend's name as torch reports it (``pg.name()``)."""
        return TORCH_BACKEND

    def set_timeout(self, timeout: timedelta) -> None:
        """Record ``timeout``; no collective here ever waits, so it changes nothing."""
        self._timeout = timeout

    # ---- all-reduce / broadcast / reduce: in place -------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        """All-reduce over one rank: the tensors keep their values (PREMUL_SUM scales them)."""
        _reduce_in_place(tensors, opts.reduceOp if opts is not None else _ReduceOp.SUM)
        return _done(list(tensors))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """Coalesced all-reduce: :meth:`allreduce` on every tensor."""
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        """Broadcast from rank 0 to itself: nothing changes."""
        _check_root(opts.rootRank if opts is not None else 0, "broadcast")
        return _done(list(tensors))

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> dist.Work:  # type: ignore[override]
        """Reduce to rank 0: like :meth:`allreduce`."""
        _check_root(opts.rootRank if opts is not None else 0, "reduce")
        _reduce_in_place(tensors, opts.reduceOp if opts is not None else _ReduceOp.SUM)
        return _done(list(tensors))

    # ---- all-gather family: output = input ------------------------------------------------------
    def allgather(  # type: ignore[override]
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None,
    ) -> dist.Work:
        """All-gather into lists: ``output_lists[i][0] = inputs[i]``."""
        for outputs, src in zip(output_lists, inputs, strict=True):
            if len(outputs) != 1:
                raise RuntimeError(f"all_gather: expected 1 output tensor per input (group size 1), "
                                 f"got {len(outputs)}")
            _copy(outputs[0], src, "all_gather")
        return _done([t for outputs in output_lists for t in outputs])

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]],
                            inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """Coalesced all-gather: ``output_lists[0][i] = inputs[i]`` (outer list: one per rank)."""
        if len(output_lists) != 1:
            raise RuntimeError(f"all_gather_coalesced: expected 1 output list (group size 1), "
                             f"got {len(output_lists)}")
        for out, src in zip(output_lists[0], inputs, strict=True):
            _copy(out, src, "all_gather_coalesced")
        return _done(list(output_lists[0]))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts: Any = None) -> dist.Work:
        """All-gather into one tensor (``all_gather_into_tensor``): ``output = input``."""
        _copy(output, input, "all_gather_into_tensor")
        return _done([output])

    _allgather_base = all_gather_single  # type: ignore[assignment]  # torch <= 2.12's name (and the C++ one)

    def all_gather_single_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                    opts: Any = None) -> dist.Work:
        """Coalesced all-gather into tensors: ``outputs[i] = inputs[i]``."""
        for out, src in zip(outputs, inputs, strict=True):
            _copy(out, src, "all_gather_into_tensor_coalesced")
        return _done(list(outputs))

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]  # torch <= 2.12's name

    # ---- reduce-scatter family: output = input (PREMUL_SUM scales) ----------------------------
    def reduce_scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None,
    ) -> dist.Work:
        """Reduce-scatter from lists: ``outputs[i] = input_lists[i][0]``."""
        for out, inputs in zip(outputs, input_lists, strict=True):
            if len(inputs) != 1:
                raise RuntimeError(f"reduce_scatter: expected 1 input tensor per output (group size "
                                 f"1), got {len(inputs)}")
            _copy(out, inputs[0], "reduce_scatter")
        _reduce_in_place(outputs, opts.reduceOp if opts is not None else _ReduceOp.SUM)
        return _done(list(outputs))

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts: Any = None) -> dist.Work:
        """Reduce-scatter one tensor (``reduce_scatter_tensor``): ``output = input``."""
        _copy(output, input, "reduce_scatter_tensor")
        _reduce_in_place([output], opts.reduceOp if opts is not None else _ReduceOp.SUM)
        return _done([output])

    _reduce_scatter_base = reduce_scatter_single  # type: ignore[assignment]  # torch <= 2.12's name (and the C++ one)

    def reduce_scatter_single_coalesced(self, outputs: list[torch.Tensor],
                                        inputs: list[torch.Tensor], opts: Any = None) -> dist.Work:
        """Coalesced reduce-scatter of tensors: ``outputs[i] = inputs[i]``."""
        for out, src in zip(outputs, inputs, strict=True):
            _copy(out, src, "reduce_scatter_tensor_coalesced")
        _reduce_in_place(outputs, opts.reduceOp if opts is not None else _ReduceOp.SUM)
        return _done(list(outputs))

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]  # torch <= 2.12's name

    # ---- all-to-all ----------------------------------------------------------------------------
    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                 opts: Any = None) -> dist.Work:
        """All-to-all of lists: ``outputs[0] = inputs[0]``."""
        if len(outputs) != 1 or len(inputs) != 1:
            raise RuntimeError(f"all_to_all: expected 1 input and 1 output tensor (group size 1), "
                             f"got {len(inputs)} and {len(outputs)}")
        _copy(outputs[0], inputs[0], "all_to_all")
        return _done(list(outputs))

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts: Any = None) -> dist.Work:
        """All-to-all of one tensor with optional split sizes (one split each over one rank)."""
        out_rows = _one_split(output, output_split_sizes, "output_split_sizes")
        in_rows = _one_split(input, input_split_sizes, "input_split_sizes")
        if out_rows != in_rows:
            raise RuntimeError(f"all_to_all_single: this rank sends itself {in_rows} rows but "
                             f"expects {out_rows}; fix: make output and input splits equal")
        _copy(output, input, "all_to_all_single")
        return _done([output])

    alltoall_base = all_to_all_single  # type: ignore[assignment]  # torch <= 2.12's name

    # ---- gather / scatter ----------------------------------------------------------------------
    def gather(  # type: ignore[override]
        self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor], opts: Any = None,
    ) -> dist.Work:
        """Gather to rank 0: ``output_lists[0][0] = inputs[0]``."""
        _check_root(opts.rootRank if opts is not None else 0, "gather")
        if len(output_lists) != 1 or len(output_lists[0]) != 1 or len(inputs) != 1:
            raise RuntimeError("gather: expected one input and a gather list of 1 tensor (group size 1)")
        _copy(output_lists[0][0], inputs[0], "gather")
        return _done(list(output_lists[0]))

    def gather_single(self, output: torch.Tensor, input: torch.Tensor,
                      opts: Any = None) -> dist.Work:
        """Gather into one tensor at rank 0 (torch >= 2.14): ``output = input``."""
        _check_root(opts.rootRank if opts is not None else 0, "gather_into_tensor")
        _copy(output, input, "gather_into_tensor")
        return _done([output])

    def scatter(  # type: ignore[override]
        self, outputs: list[torch.Tensor], input_lists: list[list[torch.Tensor]], opts: Any = None,
    ) -> dist.Work:
        """Scatter from rank 0: ``outputs[0] = input_lists[0][0]``."""
        _check_root(opts.rootRank if opts is not None else 0, "scatter")
        if len(outputs) != 1 or len(input_lists) != 1 or len(input_lists[0]) != 1:
            raise RuntimeError("scatter: expected one output and a scatter list of 1 tensor (group size 1)")
        _copy(outputs[0], input_lists[0][0], "scatter")
        return _done(list(outputs))

    # ---- synchronization and point-to-point ----------------------------------------------------
    def barrier(self, opts: Any = None) -> dist.Work:
        """A barrier of one rank: already passed."""
        return _done([])

    def _start_coalescing(self, device: torch.device) -> None:
        """Begin a coalescing block: nothing to batch (every op already ran)."""

    def _end_coalescing(self, device: torch.device) -> dist.Work:
        """End a coalescing block: a finished Work."""
        return _done([])

    def _no_peer(self, what: str, peer: int) -> dist.Work:
        raise RuntimeError(
            f"{what} with group peer {peer} on a 1-rank {TORCH_BACKEND!r} group (global rank "
            f"{self._global_rank}): it has no other rank; fix: use a group that holds the peer"
        )

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> dist.Work:
        """Always raises: a 1-rank group has no peer to send to."""
        return self._no_peer("send", dst)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> dist.Work:
        """Always raises: a 1-rank group has no peer to receive from."""
        return self._no_peer("recv", src)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> dist.Work:
        """Always raises: a 1-rank group has no peer to receive from."""
        return self._no_peer("recv", -1)


def _one_split(tensor: torch.Tensor, splits: Sequence[int], field: str) -> int:
    rows = tensor.size(0) if tensor.dim() > 0 else tensor.numel()
    if len(splits) == 0:
        return rows
    if len(splits) != 1:
        raise RuntimeError(f"all_to_all_single: {field} has {len(splits)} entries; a 1-rank group "
                         "takes one (or none)")
    if int(splits[0]) != rows:
        raise RuntimeError(f"all_to_all_single: {field}={list(splits)} does not cover the "
                         f"tensor's {rows} rows")
    return rows


class SingleRankAdapter(BackendAdapter):
    """Adapter for 1-rank groups that hold no communicator (size-1 dims and roles).

    Only for groups of exactly one rank; each rank creates its own with member-only creation
    (``new_group([rank], use_local_synchronization=True)``), never all-ranks. ``device_type`` is
    a placeholder: the group serves every device, so a DeviceMesh takes its device type from its
    other dims.
    """

    name: ClassVar[str] = "single"
    torch_backend: ClassVar[str] = TORCH_BACKEND
    device_type: ClassVar[str] = "cpu"
    supports_split: ClassVar[bool] = False
    supports_local_creation: ClassVar[bool] = True
    created_by_members: ClassVar[bool] = True
    serves_every_device: ClassVar[bool] = True
    has_timeout: ClassVar[bool] = False

    def check_available(self) -> None:
        """Always available: it needs nothing but torch.distributed; registers the backend."""
        ensure_registered()

