"""Fingerprint agreement: before any group exists, every rank checks that all ranks plan the same.

Ranks compare a small payload (layout fingerprint, resolved backends, creation mode, and any local
error) through the default group's store, in one round: each rank counts itself under its payload's
digest and meets the others at one store barrier (:func:`store_barrier`, the one barrier commgroups
has); the digest's count is then the world size exactly when every rank agrees. Counters other
decisions need (local creation's votes) ride in the same round. Only when ranks disagree does a second
round run: rank 0's payload is the reference, the ranks that differ publish their details, and every
rank raises the same :class:`~commgroups.errors.LayoutMismatchError` naming them and the fields. A rank
that never arrives makes every other one raise :class:`~commgroups.errors.AgreementTimeoutError`
naming it. No collective runs on a group, so disagreement can never hang a communicator. The success
path costs each rank a handful of store operations, O(1) in the world size.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Mapping
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed import Store  # type: ignore[attr-defined]  # re-exported at runtime

from commgroups.errors import AgreementTimeoutError, LayoutMismatchError

__all__ = ["agree", "describe_differences", "store_barrier"]

logger = logging.getLogger(__name__)

# At most this many differing or missing ranks are read back and named in an error.
MAX_NAMED_RANKS = 16


def describe_differences(
    reference: Any, other: Any, labels: tuple[str, str] = ("reference", "other"), limit: int = 6
) -> list[str]:
    """Readable lines naming where two JSON-like values differ (``dims: rank 0 has .., ...``)."""
    lines: list[str] = []

    def walk(a: Any, b: Any, where: str) -> None:
        if len(lines) >= limit or a == b:
            return
        if isinstance(a, dict) and isinstance(b, dict):
            for key in list(a) + [k for k in b if k not in a]:
                walk(a.get(key), b.get(key), f"{where}.{key}" if where else str(key))
        elif isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            for i, (x, y) in enumerate(zip(a, b)):
                walk(x, y, f"{where}[{i}]")
        else:
            lines.append(
                f"{where or '<root>'}: {labels[0]} has {_short(a)}, {labels[1]} has {_short(b)}"
            )

    # The layout is the root cause of most differences; name it before what follows from it.
    if isinstance(reference, dict) and isinstance(other, dict) and "layout" in reference:
        walk(reference.get("layout"), other.get("layout"), "layout")
        reference = {k: v for k, v in reference.items() if k != "layout"}
        other = {k: v for k, v in other.items() if k != "layout"}
    walk(reference, other, "")
    return lines


def _short(value: Any, width: int = 100) -> str:
    text = repr(value)
    return text if len(text) <= width else text[: width - 4] + " ..."


def _digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def agree(
    store: Store,
    rank: int,
    world_size: int,
    payload: dict[str, Any],
    timeout: timedelta,
    tallies: Mapping[str, int] | None = None,
) -> dict[str, int]:
    """Check that every rank holds an identical ``payload``; raise on every rank otherwise.

    ``store`` should be a namespace unique to this creation (a PrefixStore); every rank must call
    this with the same namespace, in the same order. ``tallies``: counters this rank adds to in the
    same store round; returns each one's total over all ranks (read after every rank has added).
    """
    text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
    digest = _digest(text)
    started = time.monotonic()
    if rank == 0:
        store.set("detail/0", text)
    store.set(f"digest/{rank}", digest)
    store.add(f"votes/{digest}", 1)
    for key, value in (tallies or {}).items():
        store.add(f"tally/{key}", value)
    store_barrier(store, "agreed", rank, world_size, timeout, "GroupRegistry.create()",
                  started=started)
    if store.add(f"votes/{digest}", 0) == world_size:
        logger.debug("rank %d: %d ranks agree on %s", rank, world_size, digest[:12])
        return {key: store.add(f"tally/{key}", 0) for key in (tallies or {})}
    # Some rank differs (every rank sees it: no digest counts every rank). Name who and how.
    if store.get("digest/0").decode() != digest:
        store.set(f"detail/{rank}", text)
        index = store.add("mismatch", 1)
        store.set(f"mismatch/{index}", str(rank))
    store_barrier(store, "compared", rank, world_size, timeout, "GroupRegistry.create()",
                  started=started)
    mismatches = store.add("mismatch", 0)
    named = min(mismatches, MAX_NAMED_RANKS)
    ranks = sorted(int(store.get(f"mismatch/{i}").decode()) for i in range(1, named + 1))
    reference = json.loads(store.get("detail/0").decode())
    other = json.loads(store.get(f"detail/{ranks[0]}").decode())
    lines = describe_differences(reference, other, ("rank 0", f"rank {ranks[0]}"))
    more = f" (and {mismatches - named} more)" if mismatches > named else ""
    raise LayoutMismatchError(
        f"ranks {ranks}{more} built a different layout than rank 0 "
        f"({mismatches} of {world_size} ranks differ); differences:\n  "
        + "\n  ".join(lines)
        + "\nfix: give every rank the same layout (same file, dims, roles, options, backends) "
        "and the same creation mode",
        field=lines[0].split(":")[0] if lines else None,
    )


def store_barrier(
    store: Store, name: str, rank: int, world_size: int, timeout: timedelta, what: str,
    started: float | None = None,
) -> None:
    """Every rank reaches ``name`` before any leaves; O(1) store operations per rank.

    The one store barrier: the agreement round, the end of creation on backends that connect on
    creation (on gloo a rank can return from ``new_group`` while a peer is still connecting to it,
    and destroying the group then would break the peer's connection), torchtitan's timeout
    switch. ``timeout`` counts from ``started`` (``time.monotonic()``; default: now). A rank that
    does not arrive in time makes the others raise
    :class:`~commgroups.errors.AgreementTimeoutError` naming it.
    """
    started = time.monotonic() if started is None else started
    store.set(f"{name}/{rank}", "1")
    if store.add(f"{name}/count", 1) == world_size:
        store.set(f"{name}/all", "1")
    _wait(store, [f"{name}/all"], timeout, started, world_size, rank, key=f"{name}/", what=what)


def _wait(
    store: Store,
    keys: list[str],
    timeout: timedelta,
    started: float,
    world_size: int,
    rank: int,
    key: str,
    what: str,
) -> None:
    remaining = timeout.total_seconds() - (time.monotonic() - started)
    try:
        store.wait(keys, timedelta(seconds=max(remaining, 0.001)))
    except (RuntimeError, dist.DistStoreError) as error:
        missing = _missing_ranks(store, world_size, key)
        raise AgreementTimeoutError(
            f"rank {rank}: not every rank reached {what} within "
            f"{timeout.total_seconds():g}s; ranks that never arrived: {missing or 'unknown'}. "
            "fix: make every rank call create() (in the same order as other registries), check "
            "that no rank died, or raise create_timeout_s"
        ) from error


def _missing_ranks(store: Store, world_size: int, key: str) -> list[int]:
    missing: list[int] = []
    for other in range(world_size):
        try:
            if not store.check([f"{key}{other}"]):
                missing.append(other)
        except RuntimeError:
            return missing
        if len(missing) >= MAX_NAMED_RANKS:
            break
    return missing
