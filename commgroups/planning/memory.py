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
- A regular one-rank role: none. The registry gives it the single-rank backend (local copies, no
  communicator); the 512 MiB above is what a one-rank NCCL group made by hand (or an irregular
  explicit-ranks role) costs.

Measured figures replace the published ones where a GPU check measured them
(``benchmarks/results/gpu/memory.json``, written by ``python -m tools.gpu_check``; read with
:func:`load_measured`, shown by ``commgroups plan --measured``): each is keyed by backend, case
(``fresh`` communicator, ``split`` child, ``split_share`` child) and group size, so a one-GPU
measurement changes only one-rank groups and split_share children; everything else stays the
estimate above.

Nothing here touches torch.distributed: like :mod:`commgroups.planning.plan`, it is arithmetic over
the layout.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from commgroups.layout.specs import Layout
from commgroups.planning.plan import Plan

__all__ = [
    "DEVICE_BACKENDS",
    "HCCL_DEFAULT_BUFFER_MB",
    "MEASURED_CASES",
    "MEASURED_SCHEMA",
    "NCCL_COMM_MB",
    "NCCL_SINGLE_RANK_MB",
    "MeasuredFigure",
    "MeasuredMemory",
    "MemoryEstimate",
    "SINGLE_RANK",
    "SPLIT_PARENT",
    "RoleMemory",
    "communicator_cost_mb",
    "estimate_memory",
    "load_measured",
    "parse_measured",
]

# NVIDIA/nccl#964: 544-688 MB of device memory per communicator on 4xA100 (the spread is the range
# reported across ranks and NCCL versions in that thread).
NCCL_COMM_MB: tuple[float, float] = (544.0, 688.0)
# NVIDIA/nccl#2363: even a communicator over a single rank allocates 512 MiB.
NCCL_SINGLE_RANK_MB: float = 512 * 1024 * 1024 / 1e6
# Ascend HCCL: hccl_buffer_size defaults to 200 (MB) per communicator.
HCCL_DEFAULT_BUFFER_MB: float = 200.0

SINGLE_RANK = "single"
"""The backend name of a one-rank role's group: the registry's single-rank backend, no communicator."""
SPLIT_PARENT = "default group (split parent)"
"""The extra row counted when split_share children share the default group's communicator."""
DEVICE_BACKENDS: tuple[str, ...] = ("nccl", "rccl", "hccl", "gloo")
"""What a role with ``backend = "device"`` may be estimated as."""
MEASURED_SCHEMA = "commgroups.measured-memory/1"
"""The ``schema`` field of a measured-memory file."""
MEASURED_CASES: tuple[str, ...] = ("fresh", "split", "split_share")
"""How a measured communicator was made: its own init, an ncclCommSplit child, or a child sharing
its parent's resources (split_share=1)."""
# A measured figure inside the estimate's range, widened by this fraction, agrees with it.
AGREE_FRACTION = 0.05


@dataclass(frozen=True)
class MeasuredFigure:
    """Device memory one communicator took, as a GPU check measured it."""

    backend: str
    case: str
    group_size: int
    mb: float


@dataclass(frozen=True)
class MeasuredMemory:
    """Measured per-communicator figures and where they come from (see :func:`load_measured`)."""

    figures: tuple[MeasuredFigure, ...]
    source: str
    """GPU, NCCL and torch versions and the date, for the basis column."""
    path: str | None = None

    def lookup(self, backend: str, case: str, group_size: int) -> MeasuredFigure | None:
        """The figure for exactly this backend, case and group size, if measured."""
        for figure in self.figures:
            if (figure.backend, figure.case, figure.group_size) == (backend, case, group_size):
                return figure
        return None


def parse_measured(document: Mapping[str, Any], path: str | None = None) -> MeasuredMemory:
    """Validate a measured-memory document (the content of ``memory.json``).

    Raises:
        ValueError: naming the field that is wrong and the fix.
    """
    where = path or "measured memory"
    if document.get("schema") != MEASURED_SCHEMA:
        raise ValueError(f"{where}: schema is {document.get('schema')!r}, expected "
                         f"{MEASURED_SCHEMA!r}; fix: pass a memory.json written by "
                         "python -m tools.gpu_check")
    rows = document.get("communicators")
    if not isinstance(rows, list):
        raise ValueError(f"{where}: communicators must be a list; fix: re-run "
                         "python -m tools.gpu_check analyze on the results folder")
    figures = []
    for index, row in enumerate(rows):
        field = f"communicators[{index}]"
        if not isinstance(row, Mapping):
            raise ValueError(f"{where}: {field} must be an object")
        if row.get("case") not in MEASURED_CASES:
            raise ValueError(f"{where}: {field}.case is {row.get('case')!r}; fix: use one of "
                             f"{', '.join(MEASURED_CASES)}")
        if row.get("backend") not in ("nccl", "rccl", "hccl"):
            raise ValueError(f"{where}: {field}.backend is {row.get('backend')!r}; fix: use nccl, "
                             "rccl or hccl")
        try:
            size, mb = int(row["group_size"]), float(row["mb"])
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{where}: {field} needs a numeric group_size and mb ({error})") \
                from error
        if size < 1 or not mb >= 0:
            raise ValueError(f"{where}: {field}: group_size must be >= 1 and mb >= 0")
        figures.append(MeasuredFigure(str(row["backend"]), str(row["case"]), size, mb))
    raw_source = document.get("source")
    source_map: Mapping[str, Any] = raw_source if isinstance(raw_source, Mapping) else {}
    bits = [str(source_map[k]) for k in ("gpu",) if source_map.get(k)]
    bits += [f"{k} {source_map[k]}" for k in ("nccl", "torch") if source_map.get(k)]
    if source_map.get("date_utc"):
        bits.append(str(source_map["date_utc"]).split(" ")[0])
    return MeasuredMemory(tuple(figures), ", ".join(bits) or "a GPU check", path)


def load_measured(path: str | Path) -> MeasuredMemory:
    """Read measured per-communicator figures from ``path`` (a GPU check's ``memory.json``).

    Example::

        measured = load_measured("benchmarks/results/gpu/memory.json")
        estimate_memory(layout, measured=measured).text()
    """
    file = Path(path)
    try:
        document = json.loads(file.read_text())
    except FileNotFoundError as error:
        raise ValueError(f"{file}: no such file; fix: commit a GPU check's results (see "
                         "benchmarks/README.md, GPU check) or pass another path") from error
    except json.JSONDecodeError as error:
        raise ValueError(f"{file}: not JSON ({error})") from error
    if not isinstance(document, Mapping):
        raise ValueError(f"{file}: expected a JSON object")
    return parse_measured(document, str(file))


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
    measured: str | None = None
    """Where the measured figures used come from (None: estimates only)."""

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
            "measured": self.measured,
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
            + (f"; measured figures from {self.measured} where they differ" if self.measured
               else "")
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
    split: bool = False,
    measured: MeasuredMemory | None = None,
) -> tuple[float, float, str]:
    """``(low_mb, high_mb, basis)`` for one communicator of ``backend`` over ``group_size`` ranks.

    Args:
        backend: nccl, rccl, hccl, gloo or fake.
        group_size: ranks in the communicator.
        buffer_size_mb: the role's HCCL buffer (HCCL only).
        split_share: an ncclCommSplit child sharing its parent's resources.
        split: an ncclCommSplit child (split creation) without sharing.
        measured: measured figures; one for this backend, case and group size replaces the
            estimate when it falls outside the estimate's range, and is named in the basis.
    """
    low, high, basis = _published_cost(backend, group_size, buffer_size_mb, split_share)
    if measured is None or backend not in ("nccl", "rccl", "hccl"):
        return low, high, basis
    case = "split_share" if split_share else ("split" if split else "fresh")
    figure = measured.lookup(backend, case, group_size)
    if figure is None:
        return low, high, basis
    if low * (1 - AGREE_FRACTION) - 0.5 <= figure.mb <= high * (1 + AGREE_FRACTION) + 0.5:
        return low, high, f"{basis}; measured {figure.mb:,.0f} MB agrees ({measured.source})"
    return figure.mb, figure.mb, (f"measured on {measured.source}; estimate was "
                                  f"{_range(low, high)} ({basis})")


def _published_cost(backend: str, group_size: int, buffer_size_mb: int | None,
                    split_share: bool) -> tuple[float, float, str]:
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
    measured: MeasuredMemory | None = None,
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
        measured: measured per-communicator figures (:func:`load_measured`) to use where they
            differ from the published estimates; None: estimates only.
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
        if info.regular and info.group_size == 1:
            # The registry gives a regular one-rank role its single-rank backend: local copies, no
            # communicator (backends.detection.resolve_backend), whatever backend was asked for.
            rows.append(RoleMemory(spec.name, SINGLE_RANK, 0, 0.0, 0.0,
                                   "one-rank group: single-rank backend, no communicator"))
            continue
        group_size = info.group_size
        if info.dim_names is None and member:  # explicit groups may differ in size: use this rank's
            group_size = len(plan.ranks_of(spec.name, rank) or ())
        shared = split_share if split_share is not None else bool(
            spec.options.nccl is not None and spec.options.nccl.split_share
        )
        # Only regular roles are split (creation.choose_method); the others are made on all ranks.
        split = creation == "split" and info.regular
        buffer_mb = spec.options.hccl.buffer_size_mb if spec.options.hccl is not None else None
        low, high, basis = communicator_cost_mb(
            backend,
            group_size,
            buffer_size_mb=buffer_mb,
            split_share=shared and split,
            split=split,
            measured=measured,
        )
        if not member:
            low = high = 0.0
        rows.append(RoleMemory(spec.name, backend, int(member), low, high, basis))
        if member and shared and split and backend in ("nccl", "rccl"):
            parent_backend = backend
    if parent_backend is not None:
        # split_share children live off the default group's communicator, which split creation
        # needs anyway (init_process_group(device_id=...) creates it eagerly): count it once.
        low, high, basis = communicator_cost_mb(parent_backend, layout.world_size,
                                                measured=measured)
        rows.append(RoleMemory(SPLIT_PARENT, parent_backend, 1, low, high,
                               "split parent (default group), " + (
                                   basis if "measured" in basis else basis.split(", ")[-1])))
    return MemoryEstimate(rank=rank, device_backend=device_backend, creation=creation,
                          roles=tuple(rows),
                          measured=None if measured is None else (measured.path or measured.source))
