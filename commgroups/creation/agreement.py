"""Fingerprint agreement: before any group exists, every rank checks that all ranks plan the same.

Ranks compare a small payload (layout fingerprint, resolved backends, creation mode, and any local
error) through the default group's store, in one round: each rank compares its digest with the first
one in, records itself, casts a ballot where one is asked (local creation's safety) and counts itself
in; the last rank in publishes the verdict. Every rank then raises the same
:class:`~commgroups.errors.LayoutMismatchError` naming the ranks that differ from rank 0 and the
fields, or the same :class:`~commgroups.errors.AgreementTimeoutError` naming the ranks that never
arrived. No collective runs on a group, so disagreement can never hang a communicator. The success
path costs each rank five store operations (six for the first rank in, which publishes its
payload), O(1) in the world size."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import torch.distributed as dist
from torch.distributed import Store  # type: ignore[attr-defined]  # re-exported at runtime

from commgroups.errors import (
    AgreementTimeoutError,
    CommGroupsError,
    LayoutMismatchError,
    StoreUnreachableError,
    SurvivorLostError,
)
from commgroups.util.error_text import fit_lines
from commgroups.util.store_reads import read_bytes_if_present
from commgroups.util.text_table import format_ranks

__all__ = ["Ballot", "OutcomeChannel", "Verdict", "agree", "describe_differences", "store_barrier",
           "store_calls", "store_host"]

logger = logging.getLogger(__name__)

# At most this many differing or missing ranks are read back and named in an error.
MAX_NAMED_RANKS = 16
_TIMEOUT_FIX = ("fix: make every rank call create() (registries in one order), check that none died, "
                "or raise create_timeout_s; create() again retries")

# The arrival counter's unit for a rank that noted something (a difference or a veto): arrivals
# stay below it (worlds of fewer than 2**31 ranks), and the counts together below 2**63.
_ANOMALY = 1 << 31


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


@dataclass(frozen=True)
class Ballot:
    """A yes/no question every rank answers in the agreement's round (local creation's safety).

    It carries only if every rank gives the same ``state`` and no rank vetoes.
    """

    state: str
    """A value that must be equal on every rank (e.g. torch's group-naming state)."""
    veto: bool
    """This rank says no whatever the others say."""


@dataclass(frozen=True)
class Verdict:
    """What the agreement decided besides "every rank plans the same"."""

    carried: bool
    """The ballot carried (False when there was none)."""
    reason: str = ""
    """Why the ballot did not carry (empty when it did or there was none)."""
    counter_split: int = 0
    """Ranks whose ``counter`` differed from the first rank in (see :func:`agree`)."""


class OutcomeChannel(Protocol):
    """How a rank waits for the attempt's outcome without holding a store connection: a
    rebuild's ranks have listeners (:class:`~commgroups.rank_loss.attempt_channel.AttemptChannel`).

    A TCPStore connection serves one request at a time, a wait included, and a survivor's
    background threads send their reports on the connection its main thread would wait on; so
    the outcome is announced to every rank instead, and a rank that sees a member of the
    attempt die while it waits gives the attempt up at once rather than at its timeout.
    """

    def wait(self, timeout_s: float) -> bool | list[int]:
        """Block until the outcome was announced (True), this rank saw members of the attempt
        die (their ranks, as the agreement numbers them), or ``timeout_s`` passed (False)."""

    def announce(self) -> None:
        """Tell every waiting rank that the outcome is set (after it was)."""

    def close(self) -> None:
        """The agreement is over: stop hearing for it."""


def agree(
    store: Store,
    rank: int,
    world_size: int,
    payload: dict[str, Any],
    timeout: timedelta,
    finish: Callable[[], None] | None = None,
    ballot: Ballot | None = None,
    counter: str = "",
    members: Sequence[int] | None = None,
    channel: OutcomeChannel | None = None,
) -> Verdict:
    """Check that every rank holds an identical ``payload``; raise on every rank otherwise.

    ``store`` should be a namespace unique to this attempt (a PrefixStore); every rank must call
    this with the same namespace, in the same order. One round: each rank compares its digest with
    the first one in (a compare-and-set returns it: nobody waits for a particular rank), records
    itself, casts its ``ballot`` and counts itself in; the last rank to arrive decides the attempt
    and publishes the verdict by one compare-and-set on the key ``all``, which every other rank
    waits for. A rank whose wait times out first sets ``all`` to ``abandoned`` instead; every rank
    follows that one outcome, and ``finish`` runs before anyone acts on it, so the caller can open
    a fresh namespace for the next attempt: a rank that skipped this attempt then meets the others
    at the next one instead of reading this one's stale keys. Five store calls per rank on the
    success path (six for the first rank in: it publishes its payload), the last rank in
    included (it waits for nobody: its compare-and-set returns the outcome), O(1) in the world
    size; a difference or a veto adds one; the error path reads every rank's digest once.
    ``counter``: a value compared like the ballot's state but reported, not voted on (torch's name
    for the next all-ranks group: the caller decides whether a difference matters).
    ``channel``: where waiting ranks hear the outcome (:class:`OutcomeChannel`) instead of a
    store wait; a death it reports ends the attempt on every rank, which raise
    :class:`~commgroups.errors.SurvivorLostError`.
    """
    started = time.monotonic()
    with store_calls(store, rank, started, "GroupRegistry.create()"):
        text = json.dumps(payload, sort_keys=True, separators=(",", ":"))
        digest = _digest(text)
        # The ballot's state rides with the digest: one compare-and-set checks both against the
        # first rank in.
        state = ballot.state if ballot is not None else ""
        mine = f"{digest}|{state}|{counter}|{rank}"
        reference = store.compare_set("ref", "", mine).decode()
        reference_digest, reference_state, reference_counter, _ = reference.split("|")
        store.set(f"digest/{rank}", digest)  # presence (names who never came) and the error path
        anomalous = False
        if reference == mine or reference_digest != digest:
            # The reference holder and every rank that differs from it publish their payloads:
            # enough for any rank to show rank 0's payload beside one that differs from it.
            store.set(f"detail/{rank}", text)
            if reference != mine:
                store.add("mismatch", 1)
                anomalous = True
        if reference_counter != counter:
            store.add("counter/split", 1)
            anomalous = True
        if ballot is not None:
            if reference_state != state:
                store.add("ballot/split", 1)
                anomalous = True
            if ballot.veto:
                store.add("ballot/veto", 1)
                anomalous = True
        # One counter says both how many ranks are in and how many of them noted something: the
        # last rank in reads the detailed counters only when one did (none on the success path).
        total = store.add("arrived", 1 + (_ANOMALY if anomalous else 0))
        if total % _ANOMALY == world_size:
            # The last rank in: one compare-and-set publishes the verdict unless a rank gave the
            # attempt up first (it set "all" itself); either way it returns the outcome.
            verdict = _verdict(store, world_size, reference_digest, ballot is not None,
                               anomalies=total // _ANOMALY)
            if finish is not None:
                finish()  # before anyone can leave: the next attempt opens a fresh namespace
            mine = json.dumps(verdict)
            decided = _decide(store, mine)
            if decided == mine and channel is not None:
                channel.announce()
            verdict = json.loads(decided)
        else:
            verdict = _wait_or_abandon(store, timeout, started, world_size, rank, finish,
                                       channel)
        if verdict["state"] != "complete":
            if finish is not None:
                finish()  # whoever gave the attempt up may not have moved the epoch on yet
            if verdict.get("lost"):  # through a channel: a rebuild's
                lost = [members[m] if members is not None else m for m in verdict["lost"]]
                raise SurvivorLostError(
                    f"rank {members[rank] if members is not None else rank}: rebuild() stopped: "
                    f"rank(s) {format_ranks(lost)} died after the survivors were decided "
                    f"({verdict['state']}); nothing was created. fix: call rebuild() again on "
                    "every survivor (it rebuilds without them)", lost=lost)
            missing = _missing_ranks(store, world_size, "digest/")
            if members is not None:  # a rebuild: name global ranks, and the call to make
                raise AgreementTimeoutError(
                    f"rank {members[rank]}: rebuild() timed out after "
                    f"{timeout.total_seconds():g}s creating the next generation; ranks that never "
                    f"arrived: {format_ranks([members[m] for m in missing]) if missing else 'unknown'}"
                    "; fix: call rebuild() again on every survivor (it rebuilds without them)")
            raise AgreementTimeoutError(
                f"rank {rank}: GroupRegistry.create() timed out after {timeout.total_seconds():g}s "
                f"(attempt {verdict['state']}); ranks that never arrived: "
                f"{format_ranks(missing) if missing else 'unknown'}; {_TIMEOUT_FIX}"
            )
        differ = int(verdict["differ"])
        if differ == 0:
            logger.debug("rank %d: %d ranks agree on %s", rank, world_size, digest[:12])
            return Verdict(bool(verdict["carried"]), str(verdict["reason"]),
                           int(verdict["counter_split"]))
        ranks: list[int] = verdict["named"]
        reference_text = json.loads(store.get(f"detail/{verdict['zero']}").decode())
        other = json.loads(store.get(f"detail/{verdict['other']}").decode())
    lines = describe_differences(reference_text, other, ("rank 0", f"rank {verdict['other']}"))
    more = f" (and {differ - len(ranks)} more)" if differ > len(ranks) else ""
    raise LayoutMismatchError(
        fit_lines(f"ranks {ranks}{more} built a different layout than rank 0 "
                  f"({differ} of {world_size} ranks differ):\n  ", lines,
                  "\nfix: give every rank the same layout and creation mode",
                  names=[line.split(":", 1)[0] for line in lines]),
        field=lines[0].split(":")[0] if lines else None,
    )


def _verdict(store: Store, world_size: int, reference: str, ballot: bool,
             anomalies: int) -> dict[str, Any]:
    """The last rank in: every rank has recorded itself, so the counters are final.

    ``anomalies``: how many ranks noted a difference or a veto; with none, no counter is read.
    """
    if anomalies == 0:
        return {"state": "complete", "differ": 0, "carried": ballot, "reason": "",
                "counter_split": 0}
    verdict: dict[str, Any] = {"state": "complete", "differ": 0, "carried": False, "reason": "",
                               "counter_split": store.add("counter/split", 0)}
    if ballot:
        split, vetoes = store.add("ballot/split", 0), store.add("ballot/veto", 0)
        verdict["carried"] = split == 0 and vetoes == 0
        verdict["reason"] = (
            "ranks are in different torch group-naming states (they created different groups "
            "before this call)" if split else
            f"{vetoes} rank(s) would reuse a group name torch created before, or cannot predict it"
            if vetoes else "")
    if store.add("mismatch", 0) == 0:
        return verdict
    # Name the ranks that differ from rank 0 (the reference of the message, whoever came first).
    digests = [bytes(d).decode() for d in
               store.multi_get([f"digest/{r}" for r in range(world_size)])]
    differ = [r for r, d in enumerate(digests) if d != digests[0]]
    holder = int(bytes(store.get("ref")).decode().rpartition("|")[2])
    # Published: the reference holder and every rank whose digest is not the reference's.
    published = [r for r in differ if r == holder or digests[r] != reference]
    verdict.update(differ=len(differ), named=differ[:MAX_NAMED_RANKS],
                   zero=0 if digests[0] != reference or holder == 0 else holder,
                   other=published[0])
    return verdict


def _decide(store: Store, outcome: str) -> str:
    """Set the attempt's outcome (the key ``all``, JSON) unless one is set already; returns the
    outcome that holds. The one key both decides and wakes the waiting ranks."""
    return bytes(store.compare_set("all", "", outcome)).decode()


def _wait_or_abandon(
    store: Store,
    timeout: timedelta,
    started: float,
    world_size: int,
    rank: int,
    finish: Callable[[], None] | None,
    channel: OutcomeChannel | None = None,
) -> dict[str, Any]:
    """Wait for the attempt's outcome and return it; on timeout (or, through ``channel``, a
    member's death) give the attempt up, unless it was decided meanwhile (then that outcome is
    returned), and return that it was given up: the caller raises the one error every rank
    raises for it (a rebuild's names the call to make; this wait's own named ``create()``)."""
    heard: bool | list[int] = True
    if channel is not None:
        heard = channel.wait(timeout.total_seconds() - (time.monotonic() - started))
    else:
        try:
            _wait(store, ["all"], timeout, started, world_size, rank)
        except AgreementTimeoutError:
            heard = False
    if heard is not True:
        given_up: dict[str, Any] = {"state": f"abandoned by rank {rank}"}
        if heard:  # members died: every rank stops now, not at its timeout
            given_up = {"state": f"given up by rank {rank}, which saw them die", "lost": heard}
        mine = json.dumps(given_up)
        outcome = _decide(store, mine)
        if outcome == mine:
            if finish is not None:
                finish()  # idempotent: the next attempt opens however many ranks give up
            if channel is not None:
                channel.announce()
        # Decided just as this rank gave up (the last rank's verdict, or another rank gave up
        # first): that outcome stands.
        return dict(json.loads(outcome))
    # One request: the key exists (the wait returned), and get() would wait for it again first.
    decided = read_bytes_if_present(store, "all")
    return dict(json.loads(decided if decided is not None else store.get("all")))


def store_host(store: Store) -> str:
    """``host:port`` of the TCPStore under ``store`` (through PrefixStores), or a description."""
    inner = store
    for _ in range(8):  # PrefixStore over PrefixStore over the real store
        if not hasattr(inner, "underlying_store"):
            break
        inner = inner.underlying_store
    host, port = getattr(inner, "host", None), getattr(inner, "port", None)
    if host is not None and port is not None:
        return f"{host}:{port}"
    return f"a {type(inner).__name__}"


@contextmanager
def store_calls(store: Store, rank: int, started: float, what: str) -> Iterator[None]:
    """Turn a failure of the store itself (its host died) into :class:`StoreUnreachableError`.

    Store timeouts stay :class:`AgreementTimeoutError` (raised by the waits inside): a store that
    answers "connection reset" after 0.06 s must not be reported as ranks missing for 10 s.
    """
    try:
        yield
    except CommGroupsError:
        raise  # ours, raised inside (a RebuildError is a RuntimeError too): never the store's
    except RuntimeError as error:  # DistNetworkError, DistStoreError: torch's store failures
        # torch's own text gets what the bound leaves; why and how to survive it: the guide.
        raise StoreUnreachableError(fit_lines(
            f"rank {rank}: the store at {store_host(store)} stopped answering after "
            f"{time.monotonic() - started:.2f}s at {what} (",
            [" ".join(str(error).split())],
            "); fix: its host died or is unreachable (rank 0 under env://, torchrun's agent under "
            "--rdzv-backend=c10d): restart the job", sep="")) from error


def store_barrier(
    store: Store, name: str, rank: int, world_size: int, timeout: timedelta, what: str,
    started: float | None = None, members: Sequence[int] | None = None,
) -> None:
    """Every rank reaches ``name`` before any leaves; O(1) store operations per rank.

    The one store barrier (:meth:`~commgroups.GroupRegistry.store_barrier`; repository
    tooling). ``timeout`` counts from ``started`` (``time.monotonic()``; default: now). A rank
    that does not arrive in time makes the others raise
    :class:`~commgroups.errors.AgreementTimeoutError` naming it; a store that stops answering
    raises :class:`~commgroups.errors.StoreUnreachableError`. ``members``: the global rank at
    each position, where ``rank`` and ``world_size`` count positions (a rebuilt generation);
    errors name global ranks.
    """
    started = time.monotonic() if started is None else started
    with store_calls(store, rank if members is None else members[rank], started, what):
        store.set(f"{name}/{rank}", "1")
        if store.add(f"{name}/count", 1) == world_size:
            # A compare-and-set: where a loss report ended the barrier first (LossBarriers.wake
            # wrote its outcome), that outcome stands for every rank, this one included.
            store.compare_set(f"{name}/all", "", "1")
        _wait(store, [f"{name}/all"], timeout, started, world_size, rank, key=f"{name}/",
              what=what, members=members)


def _wait(
    store: Store,
    keys: list[str],
    timeout: timedelta,
    started: float,
    world_size: int,
    rank: int,
    key: str = "digest/",
    what: str = "GroupRegistry.create()",
    members: Sequence[int] | None = None,
) -> None:
    remaining = timeout.total_seconds() - (time.monotonic() - started)
    try:
        store.wait(keys, timedelta(seconds=max(remaining, 0.001)))
    except (RuntimeError, dist.DistStoreError) as error:
        if time.monotonic() - started < timeout.total_seconds() - 0.05:
            raise  # not a timeout: the store itself failed (store_calls names its host)
        missing = _missing_ranks(store, world_size, key)
        if members is not None:
            rank, missing = members[rank], [members[m] for m in missing]
        raise AgreementTimeoutError(
            f"rank {rank}: not every rank reached {what} within {timeout.total_seconds():g}s; "
            f"ranks that never arrived: {format_ranks(missing) if missing else 'unknown'}; "
            f"{_TIMEOUT_FIX}"
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
