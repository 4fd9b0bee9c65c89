"""Estimated communicator memory per rank for a layout: how much device memory its groups cost.

Each role a rank belongs to is one more communicator on that rank, and device communicators are not
cheap. The figures below are published measurements, not a model of any one NCCL/HCCL version: use
them to compare layouts (how many communicators, which ones share resources), not as an exact budget.

- NCCL/RCCL: 544-688 MB per communicator measured on 4xA100 (NVIDIA/nccl#964); a single-rank
  communicator still costs 512 MiB (NVIDIA/nccl#2363). A communicator made by ``ncclCommSplit`` with
  ``split_share=1`` shares its parent's resources, so it adds (almost) nothing on top of the parent.
- HCCL: each communicator allocates its buffer, 200 MB by default (``hccl_buffer_size`` in
  ``hccl_config``; a role's ``options.hccl.buffer_size_mb`` overrides it).
- Gloo (and the fake backend): host memory only, negligible next to device communicators.

Nothing here touches torch.distributed: like :mod:`commgroups.plan`, it is arithmetic over the layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from commgroups.plan import Plan
from commgroups.specs import Layout

__all__ = [
    "DEVICE_BACKENDS",
    "HCCL_DEFAULT_BUFFER_MB",
    "NCCL_COMM_MB",
    "NCCL_SINGLE_RANK_MB",
    "MemoryEstimate",
    "SPLIT_PARENT",
    "RoleMemory",
    "communicator_cost_mb",
    "estimate_memory",
]

# NVIDIA/nccl#964: 544-688 MB of device memory per communicator on 4xA100 (the spread is the range
# reported across ranks and NCCL versions in that thread).
NCCL_COMM_MB: tuple[float, float] = (544.0, 688.0)
# NVIDIA/nccl#2363: even a communicator over a single rank allocates 512 MiB.
NCCL_SINGLE_RANK_MB: float = 512 * 1024 * 1024 / 1e6
# Ascend HCCL: hccl_buffer_size defaults to 200 (MB) per communicator.
HCCL_DEFAULT_BUFFER_MB: float = 200.0

SPLIT_PARENT = "default group (split parent)"
"""The extra row counted when split_share children share the default group's communicator."""
DEVICE_BACKENDS: tuple[str, ...] = ("nccl", "rccl", "hccl", "gloo")
"""What a role with ``backend = "device"`` may be estimated as."""


@dataclass(frozen=True)
class RoleMemory:
    """The estimated memory one role's communicator costs on one rank (MB, 1 MB = 10**6 bytes)."""

    role: str
    backend: str
    communicators: int
    """0 when the rank is in no group of the role, else 1."""
    low_mb: float
    high_mb: float
    basis: str
    """Where the figure comes from (issue or default)."""


@dataclass(frozen=True)
class MemoryEstimate:
    """Estimated communicator memory on one rank for a whole layout."""

    rank: int
    device_backend: str
    creation: str
    roles: tuple[RoleMemory, ...]

    @property
    def low_mb(self) -> float:
        """Lower bound of the total, in MB."""
        return sum(role.low_mb for role in self.roles)

    @property
    def high_mb(self) -> float:
        """Upper bound of the total, in MB."""
        return sum(role.high_mb for role in self.roles)

    @property
    def device_communicators(self) -> int:
        """How many device (NCCL, RCCL, HCCL) communicators this rank holds, shared ones included."""
        return sum(r.communicators for r in self.roles if r.backend in ("nccl", "rccl", "hccl"))

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready form (``commgroups plan --json`` and the benchmarks)."""
        return {
            "rank": self.rank,
            "device_backend": self.device_backend,
            "creation": self.creation,
            "low_mb": round(self.low_mb, 1),
            "high_mb": round(self.high_mb, 1),
            "device_communicators": self.device_communicators,
            "roles": [
                {"role": r.role, "backend": r.backend, "communicators": r.communicators,
                 "low_mb": round(r.low_mb, 1), "high_mb": round(r.high_mb, 1), "basis": r.basis}
                for r in self.roles
            ],
        }

    def text(self) -> str:
        """One line per role plus a total, for ``commgroups plan``."""
        lines = [
            f"estimated communicator memory on rank {self.rank} (device = {self.device_backend}, "
            f"{self.creation} creation): {_range(self.low_mb, self.high_mb)} over "
            f"{self.device_communicators} device communicators"
        ]
        for r in self.roles:
            cost = "-" if r.communicators == 0 else _range(r.low_mb, r.high_mb)
            lines.append(f"  {r.role}: {cost} ({r.backend}; {r.basis})")
        return "\n".join(lines)


def _range(low: float, high: float) -> str:
    return f"{low:,.0f} MB" if abs(high - low) < 0.5 else f"{low:,.0f}-{high:,.0f} MB"


def communicator_cost_mb(
    backend: str,
    group_size: int,
    *,
    buffer_size_mb: int | None = None,
    split_share: bool = False,
) -> tuple[float, float, str]:
    """``(low_mb, high_mb, basis)`` for one communicator of ``backend`` over ``group_size`` ranks."""
    if backend in ("nccl", "rccl"):
        if split_share:
            # ncclCommSplit with splitShare=1 reuses the parent's buffers and channels.
            return 0.0, 0.0, "split_share: shares the parent communicator's resources"
        if group_size == 1:
            return NCCL_SINGLE_RANK_MB, NCCL_SINGLE_RANK_MB, "single-rank communicator, nccl#2363"
        low, high = NCCL_COMM_MB
        return low, high, "per communicator on 4xA100, nccl#964"
    if backend == "hccl":
        size = float(buffer_size_mb) if buffer_size_mb is not None else HCCL_DEFAULT_BUFFER_MB
        basis = "role buffer_size_mb" if buffer_size_mb is not None else "HCCL default buffer"
        return size, size, basis
    return 0.0, 0.0, "host memory only"


def estimate_memory(
    layout: Layout,
    rank: int = 0,
    *,
    device_backend: str = "nccl",
    creation: str = "all_ranks",
    split_share: bool | None = None,
) -> MemoryEstimate:
    """Estimate the communicator memory ``rank`` holds for every role of ``layout``.

    Args:
        layout: the layout.
        rank: the rank to estimate for (ranks outside explicit-ranks roles hold fewer communicators).
        device_backend: what roles with ``backend = "device"`` become (nccl, rccl, hccl or gloo).
        creation: the registry's creation mode; ``split_share`` only takes effect under ``split``,
            because only ``ncclCommSplit`` children can share their parent's resources.
        split_share: override every NCCL/RCCL role's ``options.nccl.split_share`` (None: use each
            role's own setting).
    """
    if device_backend not in DEVICE_BACKENDS:
        raise ValueError(
            f"device_backend {device_backend!r} is not one of {', '.join(DEVICE_BACKENDS)}"
        )
    plan = Plan(layout)
    rows: list[RoleMemory] = []
    parent_backend: str | None = None
    for spec in layout.roles:
        backend = device_backend if spec.backend == "device" else spec.backend
        member = plan.group_index(spec.name, rank) is not None
        info = plan.role(spec.name)
        group_size = info.group_size
        if info.dim_names is None and member:  # explicit groups may differ in size: use this rank's
            group_size = len(plan.group_of(spec.name, rank) or ())
        shared = split_share if split_share is not None else bool(
            spec.options.nccl is not None and spec.options.nccl.split_share
        )
        buffer_mb = spec.options.hccl.buffer_size_mb if spec.options.hccl is not None else None
        low, high, basis = communicator_cost_mb(
            backend,
            group_size,
            buffer_size_mb=buffer_mb,
            split_share=shared and creation == "split",
        )
        if not member:
            low = high = 0.0
        rows.append(RoleMemory(spec.name, backend, int(member), low, high, basis))
        if member and shared and creation == "split" and backend in ("nccl", "rccl"):
            parent_backend = backend
    if parent_backend is not None:
        # split_share children live off the default group's communicator, which split creation
        # needs anyway (init_process_group(device_id=...) creates it eagerly): count it once.
        low, high, basis = communicator_cost_mb(parent_backend, layout.world_size)
        rows.append(RoleMemory(SPLIT_PARENT, parent_backend, 1, low, high,
                               f"split parent (default group), {basis.split(', ')[-1]}"))
    return MemoryEstimate(rank=rank, device_backend=device_backend, creation=creation,
                          roles=tuple(rows))
