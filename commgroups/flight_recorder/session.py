"""One generation's flight recorder at work: the recorder, its status publisher, the diagnosis of a
failed call and the dumps.

:func:`open_flight` is the one hook a :class:`~commgroups.generation.Generation` calls after
creating its groups; :meth:`FlightSession.close` the one it calls at teardown. Store keys live under
``<STORE_PREFIX>/flight/<epoch>/`` (one namespace per generation; each rank deletes its own at
``close()``).
"""

from __future__ import annotations

import atexit
import dataclasses
import json
import logging
import os
import tempfile
import threading
import weakref
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch.distributed as dist

from commgroups import torch_internals
from commgroups.errors import RoleCollectiveError, RoleHangError, RoleTimeoutError
from commgroups.flight_recorder import index
from commgroups.flight_recorder.diagnosis import Diagnosis, diagnose, short_site
from commgroups.flight_recorder.entries import FlightEntry
from commgroups.flight_recorder.publisher import (
    DEFAULT_INTERVAL_S,
    LOSS_SHORTEST_S,
    StatusPublisher,
    answer_waits,
    collect,
)
from commgroups.flight_recorder.recorder import FlightRecorder
from commgroups.util.error_text import backend_words

__all__ = ["DIAGNOSIS", "DIR_ENV_VAR", "LOSS_SHORTEST_S", "SHARE_SLACK_S", "FlightSession",
           "dump_file_name", "open_flight"]

logger = logging.getLogger(__name__)

DIR_ENV_VAR = "COMMGROUPS_FLIGHT_DIR"
"""Where recorders are written on a timeout (default: see :meth:`FlightSession.default_dir`)."""

_MAX_TEXT = 300  # commgroups' error texts stay this short; the details are in ``flight``
_MAX_CAUSE = 80  # of which the backend's own words of a failure (a gloo message is one line)

DIAGNOSIS = "commgroups_diagnosis"
"""Set (True) on the log record of a diagnosis, for a filter that wants it at another level (the
bench's worlds keep their planned rank losses' diagnoses at debug)."""

_SPOKEN = "spoken"  # ``role#count@rank;`` per call whose diagnosis one rank printed
_CUT_SHORT = ("cut short by a rank-loss report (the error names the ranks it reported lost; a "
              "rank not heard from by then may only have been interrupted)")

SHARE_SLACK_S = 3.0
"""How much longer than the asker's own wait a member waits for the asker's diagnosis: the
asker diagnoses in milliseconds, the event that carries it reaches 65,536 members in about 2 s
on one store. Past it (the asker died meanwhile) the member diagnoses from one read."""


def dump_file_name(generation: int, rank: int) -> str:
    """``flight-g0-rank00003.json``: one file per rank and generation."""
    return f"flight-g{generation}-rank{rank:05d}.json"


class FlightSession:
    """A generation's :class:`FlightRecorder`, published and diagnosed.

    Args:
        recorder: the recorder.
        publisher: this rank's status publisher (None under the fake backend: no peers to read).
        epoch: the generation's agreement epoch (names the store namespace and default dump dir).
        members: how many ranks the generation has (the last of them to close deletes the
            shared keys).
    """

    def __init__(self, recorder: FlightRecorder, publisher: StatusPublisher | None,
                 epoch: int, members: int = 0) -> None:
        self.recorder = recorder
        self.publisher = publisher
        self.epoch = epoch
        self.members = members
        self.last_dump = ""
        self._dumps = threading.Lock()  # orders the dumps' snapshots and their writes
        self._snapshots = 0  # dumps begun
        self._written: dict[Path, int] = {}  # dump file -> the snapshot it holds
        self._members: dict[str, frozenset[int]] = {}  # role -> this rank's group's ranks
        self.interrupted = False
        """Set when the registry interrupted the generation (a rebuild, a peer's reported loss):
        the failures that follow are that, and are not diagnosed (nobody should wait on them)."""
        if publisher is not None:
            for role in recorder.roles.values():
                role.diagnose = self.diagnose
        index.register(recorder.roles.values())
        self._at_exit = _exit_dump(weakref.ref(self))
        atexit.register(self._at_exit)

    def start(self) -> None:
        """Start publishing this rank's status from the publisher's own thread; once, by the
        owner of the generation's background threads
        (:class:`~commgroups.rank_loss.recovery.Recovery`), after :func:`open_flight`, where no
        heartbeat runs (with one, the publisher listens through it and looks from its beat's
        thread: :meth:`StatusPublisher.listen_through`)."""
        if self.publisher is not None:
            self.publisher.start()

    def default_dir(self) -> str:
        """``$COMMGROUPS_FLIGHT_DIR``, else ``<tmp>/commgroups-flight-<run>-<epoch>``: the run is
        torchrun's ``TORCHELASTIC_RUN_ID``, else ``MASTER_PORT`` (the same on every rank, and
        another job on the machine has another), else ``local``."""
        run = os.environ.get("TORCHELASTIC_RUN_ID") or os.environ.get("MASTER_PORT") or "local"
        return os.environ.get(DIR_ENV_VAR) or str(
            Path(tempfile.gettempdir()) / f"commgroups-flight-{run}-{max(self.epoch, 0)}")

    def dump(self, directory: str | os.PathLike[str] | None = None, call_sites: bool = True) -> str:
        """Write this rank's recorder as JSON into ``directory``; returns the file's path.

        ``call_sites=False`` (a dump on a hang's clock) writes at once without the call sites of
        torch's own entries; :meth:`dump_soon` then rewrites it with them.
        """
        path = self._path(directory)
        number, own = self._snapshot()
        return self._write(path, number, own, call_sites)

    def dump_soon(self, directory: str | os.PathLike[str]) -> str:
        """:meth:`dump` at once without torch's call sites, then the same snapshot again with
        them from a daemon thread (the symbolizing takes about a second); returns the file's
        path. A process that exits first keeps the first file."""
        path = self._path(directory)
        number, own = self._snapshot()
        self._write(path, number, own, call_sites=False)
        threading.Thread(target=self._add_call_sites, args=(path, number, own),
                         name="commgroups-flight-dump", daemon=True).start()
        return str(path)

    def _path(self, directory: str | os.PathLike[str] | None) -> Path:
        folder = Path(directory if directory is not None else self.default_dir())
        folder.mkdir(parents=True, exist_ok=True)
        return folder / dump_file_name(self.recorder.generation, self.recorder.rank)

    def _snapshot(self) -> tuple[int, dict[str, Any]]:
        """(its number, commgroups' own records now): taken in the caller's thread, in order.
        dump_soon's thread starts late on loaded cores; a snapshot it took itself would record a
        later state than the one asked for (before a detached role kept its group's last count,
        one taken after the registry's close fell back to this rank's own calls: CI's merge
        named a rank ahead in role 'refused')."""
        with self._dumps:
            self._snapshots += 1
            return self._snapshots, self.recorder.snapshot()

    def _write(self, path: Path, number: int, own: dict[str, Any], call_sites: bool) -> str:
        """Write snapshot ``number`` (``own``, with torch's entries added now) to ``path``
        unless a later one is there already (a dump the main thread took after its failed call
        while dump_soon's thread symbolized: CI's merge named a rank behind in the very call
        its last dump recorded)."""
        data = {**own, "torch_trace": self.recorder.torch_trace(call_sites)}
        text = json.dumps(data, indent=1, default=str)
        with self._dumps:
            if self._written.get(path, 0) > number:
                return str(path)
            temporary = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
            temporary.write_text(text, encoding="utf-8")
            temporary.replace(path)  # a reader never sees half a file
            self._written[path] = number
            self.last_dump = str(path)
        return str(path)

    def _add_call_sites(self, path: Path, number: int, own: dict[str, Any]) -> None:
        try:
            self._write(path, number, own, call_sites=True)
        except Exception as error:  # the registry closed meanwhile: the first file stands
            logger.debug("flight recorder: second dump with call sites failed: %s", error)

    def _answer(self, role: str, asker: int) -> dict[str, Any] | None:
        """This rank's compact answer to ``asker``'s ask about ``role`` (its status on the role,
        and a call of another role it is in right now), or None where ``asker`` is not in this
        rank's group of the role (another group of it: not asked)."""
        members = self._members.get(role)
        if members is None:
            members = self._members[role] = frozenset(self.recorder.ranks(role))
        if asker not in members:
            return None
        status = self.recorder.status()
        mine = {role: status[role]} if role in status else {}
        now = next((name for name, info in status.items()
                    if name != role and (info.get("last") or {}).get("state") == "in flight"),
                   None)
        if now is not None:
            mine[now] = status[now]
        return {"status": mine}

    def _on_request(self, request: dict[str, Any]) -> None:
        if request.get("dump"):
            self.dump_soon(str(request["dump"]))

    def diagnose(self, failure: RoleCollectiveError, entry: FlightEntry | None
                 ) -> RoleCollectiveError:
        """``failure`` rewritten to name the ranks behind, ahead, mismatched and silent, after
        asking every rank to publish (and dump) now; ``failure`` itself if the store cannot say.

        Waits for the other ranks' answers: at most about 2.5 intervals after a timeout, 1.5
        request polls (0.675 s with the defaults) after another failure (answers pushed: until
        they stop for a moment), none once a loss is reported.
        """
        publisher = self.publisher
        if publisher is None or entry is None or self.interrupted:
            return failure
        count = self.recorder.roles[failure.role].group_seq()
        if entry.group_seq is not None and count is not None and count < entry.group_seq:
            # The group never counted the call: the backend refused it on this rank before any
            # communication (an op this gloo lacks, a wrong size). Its text is the cause; the
            # peers' statuses would only compare this rank's previous call with theirs.
            return failure
        try:
            diagnosis = self._compare(failure.role, entry, publisher,
                                      wait=isinstance(failure, RoleTimeoutError))
        except Exception as error:  # the store's host died: the plain error is all there is
            logger.debug("flight recorder: no diagnosis: %s", error)
            return failure
        return _rewritten(failure, diagnosis)

    def _compare(self, role: str, entry: FlightEntry, publisher: StatusPublisher,
                 wait: bool) -> Diagnosis:
        """Ask this rank's group of ``role`` to answer and dump, and wait for their answers (a
        rank that gives none is silent), or, where another member asked first, for that
        asker's diagnosis: a live rank's listener answers at once, its thread runs whatever its
        main thread does (a polling publisher: within one request poll).
        After a timeout up to 2.5 intervals (a loaded machine delays threads), ending early
        once every member answered, or after 0.3 s and an interval when no answer came for
        ``ANSWER_QUIET_S``; after another failure (a peer's connection closed: rank-loss
        handling is waiting) up to 1.5 request polls (a quarter interval each: 0.675 s with the
        defaults), and no longer once a loss is reported (the generation is interrupted).
        Without the wait a status can be an interval old: a rank would look behind."""
        directory = self.default_dir()
        recorder = self.recorder.roles[role]
        # The group's count now, not the entry's: an object collective issues several calls,
        # and the one that hung is the last one counted.
        count = recorder.group_seq()
        failed = {"op": entry.op, "seq": entry.seq,
                  "group_seq": count if count is not None else entry.group_seq,
                  "caller": entry.caller}
        token = f"{role}#{failed['group_seq']}"
        ranks = sorted(self.recorder.ranks(role))
        # Only this rank's group of the role is asked, once per failed call however many of
        # its members diagnose it; its members push their answers (see publisher.collect).
        # One ask per exact call: a member answers "reached" with its rank alone, which reads
        # right only for the call asked about (a rank at another op at this count asks its own).
        call = f"{failed['group_seq']}-{failed['seq']}-{failed['op']}"
        ask = publisher.ask_group(role, min(ranks, default=self.recorder.rank), call,
                                  {"dump": directory}, failed, ranks)
        # After a failure that is not a timeout (a peer's connection closed: most likely it
        # died, and this rank's rebuild() waits for this diagnosis) live members' listeners
        # answer within milliseconds, the dead one never: the wait stops once answers stopped
        # for ANSWER_QUIET_S (0.73 s -> about 0.2 s of kill -> rebuilt, 4 and 8 gloo ranks).
        wait_s, shortest_s = answer_waits(publisher.interval_s, publisher.poll_s, len(ranks),
                                          timed_out=wait, pushed=publisher.pushed)
        shared = None
        recollect = False
        diagnoses = ask.first
        if not ask.first:
            # The asker diagnoses for the group and pushes it: one event read here, where every
            # member reading the answers was O(N) each (O(N^2) for a hang of the whole group).
            # A loss reported meanwhile ends the asker's wait at once, and it shares what it has.
            shared = publisher.shared(ask.key, wait_s + SHARE_SLACK_S,
                                      stop=lambda: self.interrupted)
            # The asker failed on a closed connection (torch 2.15's gloo closes a timed-out
            # rank's connections) and waited only as for a loss: a live but slow member may
            # read silent there, and a member that timed out wants it collected as for a
            # timeout. That, or no diagnosis at all (the asker died), is one member's to
            # redo: the first to take over collects and shares, the others wait for that.
            recollect = shared is not None and _loss_wait_with_silent(shared, wait)
            if shared is None or recollect:
                diagnoses = publisher.take_over(ask.key)
                if not diagnoses:
                    # Its diagnosis, or one that waited as for a timeout where this member
                    # must; none (the taker died too): this member diagnoses from one read.
                    shared = publisher.shared(
                        ask.key, wait_s + SHARE_SLACK_S, stop=lambda: self.interrupted,
                        accept=lambda share: not (recollect and _loss_wait_with_silent(
                            share, wait)))
                    recollect = False
        if shared is not None and not diagnoses:
            found = Diagnosis.from_share(shared, role, self.recorder.rank, failed, ranks)
            speaks = False  # the asker speaks for the group
        else:
            # The asker or the member that took over (after a timeout, re-collecting: it waits
            # as for a timeout), or a member whose asker and taker both gave no diagnosis (one
            # read). A loss reported meanwhile (the liveness thread interrupted this
            # generation) means the rank-loss handling is waiting for this rank's rebuild(),
            # and the dead rank would never answer; what answered so far is all the diagnosis
            # gets.
            waits = ask.first or recollect
            published = collect(publisher, ask.key, ranks, role, failed,
                                wait_s=wait_s if waits else 0.0,
                                shortest_s=shortest_s if waits else 0.0,
                                stop=lambda: self.interrupted)
            found = diagnose(role, self.recorder.rank, failed, published, 1)
            if diagnoses:
                publisher.share(ask.key, {**found.share(), "timed_out": wait})
            speaks = _speaker(publisher, token, self.recorder.rank)
        path = self.dump_soon(directory)
        found = dataclasses.replace(found, dump=path)
        text = found.text()
        if self.interrupted:
            # The report ended the wait for answers: a live member not heard from by then reads
            # "silent" here (seen: two live ranks of three named "dead or frozen" beside the
            # dead one). The error raised names whom the report named.
            text = f"{_CUT_SHORT}: {text}"
        logger.log(logging.WARNING if speaks else logging.DEBUG,
                   "flight recorder, role %s: %s (recorders in %s)", role, text,
                   directory, extra={DIAGNOSIS: True})
        return found

    def release(self, lost: tuple[int, ...]) -> list[int]:
        """After :meth:`close` without release (a retired generation), once no rank waits on it:
        delete this rank's keys; the last survivor deletes the shared ones and the ``lost``
        ranks' (global ranks), and returns the listener events of the generation's asks (see
        :meth:`StatusPublisher.release`)."""
        if self.publisher is None:
            return []
        return self.publisher.release(self.members - len(lost), lost)

    def close(self, release: bool = True) -> None:
        """Stop publishing; ``release`` deletes this rank's store keys (``close()``)."""
        index.unregister(self.recorder.roles.values())
        atexit.unregister(self._at_exit)
        # Break the session <-> recorder and publisher cycles and let go of the groups: a group
        # must be freed (its gloo sockets closed) when its generation ends, not when the
        # registry is, nor at the next cyclic garbage collection (close() ran two full ones
        # for nothing while the recorder held the groups: 195 ms on 4 ranks).
        for role in self.recorder.roles.values():
            role.detach()
        if self.publisher is not None:
            self.publisher.stop(release=release, members=self.members)
            self.publisher.on_request = None
            self.publisher.answer = None


def _loss_wait_with_silent(share: dict[str, Any], timed_out: bool) -> bool:
    """Whether a member whose call ``timed_out`` must have the shared diagnosis ``share``
    collected again: its asker waited only as for a loss (a closed connection) and named
    silent ranks, which a timeout's longer wait may hear from."""
    return timed_out and not share.get("timed_out", True) and any(
        state.get("position") == "silent" for state in share.get("ranks", ()))


def _speaker(publisher: StatusPublisher, token: str, rank: int) -> bool:
    """Whether this rank prints the diagnosis of ``token`` (``role#count``): the job's console
    gets it once per role and failed call, the other diagnosing ranks log it at debug.

    Only a group's asker comes here (every other member takes the asker's diagnosis), so one or
    a few ranks per failed call: the first to claim the call in the store prints it. Two asks
    of one call (another group of the role, a member at another op) print once. One request,
    more only where another call was claimed meanwhile.
    """
    try:
        # The claim names this rank: compare_set answers the key's value whether it swapped or
        # not, and another rank's claim of the same call must not read as this one's.
        key, claim, current = f"{publisher.prefix}{_SPOKEN}", f"{token}@{rank};", ""
        for _ in range(16):
            value = bytes(publisher.store.compare_set(key, current, current + claim)).decode()
            if value == current + claim:
                return True
            if any(part.rsplit("@", 1)[0] == token for part in value.split(";")):
                return False
            current = value
    except Exception as error:  # the store's host died: print rather than lose it
        logger.debug("flight recorder: choosing the rank that prints: %s", error)
    return True


def _exit_dump(session: weakref.ref[FlightSession]) -> Callable[[], None]:
    """At interpreter exit with the registry still open: dump when a recorded call failed or
    never returned (the process is ending on an error; nothing else would keep the record)."""

    def dump_at_exit() -> None:
        live = session()
        if live is None or live.last_dump:
            return
        last = [role.last for role in live.recorder.roles.values() if role.last is not None]
        if any(entry.state != "done" for entry in last):
            try:
                path = live.dump()
            except OSError as error:
                logger.warning("flight recorder: no dump at exit: %s", error)
                return
            logger.warning("flight recorder written to %s at exit (a call failed or never "
                           "returned)", path)

    return dump_at_exit


def _rewritten(failure: RoleCollectiveError, diagnosis: Diagnosis) -> RoleCollectiveError:
    if not any(diagnosis.where(position)
               for position in ("behind", "silent", "mismatch", "left", "ahead")):
        # Nobody behind or apart: the cause is this call's own (torch's text says which), so the
        # error keeps its message and carries the diagnosis.
        failure.flight = {**diagnosis.to_dict(), "error": str(failure)}
        return failure
    timed_out = isinstance(failure, RoleTimeoutError)
    cls: type[RoleCollectiveError] = RoleHangError if timed_out else type(failure)
    verb = "timed out" if timed_out else "failed"
    head = (f"role {diagnosis.role!r}: {diagnosis.op} #{diagnosis.seq} at "
            f"{short_site(diagnosis.caller)} ")
    tail = (f"; fix: see error.flight or `commgroups flight merge "
            f"{os.path.dirname(diagnosis.dump)}`")
    if len(head) + len(verb) + 2 + len(tail) > _MAX_TEXT - 60:  # a long dump path: in .flight
        tail = "; fix: see error.flight (its 'dump' names this rank's file)"
    body = diagnosis.text()
    room = _MAX_TEXT - len(head) - len(verb) - 2 - len(tail)
    # A failure other than a timeout keeps the backend's words (a closed connection, a refused
    # op) where the ranks apart leave room: they explain it, the ranks come first.
    spare = min(_MAX_CAUSE, room - len(body) - 2)
    words = "" if timed_out else backend_words(failure.cause, spare)
    if words and spare >= 24:
        verb += f": {words}"
        room -= len(verb) - len("failed")
    if len(body) > room:
        body = body[: max(0, room - 4)] + " ..."
    head += f"{verb}; "
    return cls(head + body + tail, role=failure.role, op=failure.op, seq=failure.seq,
               flight={**diagnosis.to_dict(), "error": str(failure)}, cause=failure.cause)


def open_flight(groups: Mapping[str, dist.ProcessGroup | None], *, enabled: bool,
                generation: int, epoch: int, backends: Mapping[str, str],
                store_prefix: str, publish: bool, members: int,
                interval_s: float = DEFAULT_INTERVAL_S) -> FlightSession | None:
    """The generation's flight session, or None when the recorder is off; its publisher is
    not started (:meth:`FlightSession.start`).

    Args:
        groups: role -> this rank's group (None where this rank is not a member).
        enabled: :func:`~commgroups.flight_recorder.settings.flight_enabled` of the layout.
        generation, epoch: the generation's number and agreement epoch.
        backends: role -> backend name.
        store_prefix: the registry's store prefix (``STORE_PREFIX``).
        publish: whether ranks publish their status (False under the fake backend).
        members: how many ranks the generation has.
        interval_s: the publisher's interval.
    """
    if not enabled:
        return None
    mine = {name: group for name, group in groups.items() if group is not None}
    rank = dist.get_rank()
    recorder = FlightRecorder(mine, rank=rank, generation=generation, backends=backends)
    publisher = None
    if publish:
        prefix = f"{store_prefix}/flight/{epoch}/"
        publisher = StatusPublisher(torch_internals.default_store(), prefix, rank,
                                    recorder.status, interval_s)
    session = FlightSession(recorder, publisher, epoch, members)
    if publisher is not None:
        publisher.on_request = session._on_request
        publisher.answer = session._answer
    return session
