"""The end of creation, noted without a wait and met before destroying (AttemptStore, one process).

A real TCPStore stands in for the job's store; the "peers" are calls made on their behalf.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist

from commgroups.creation.store_keys import open_attempt


def _store() -> dist.Store:
    return dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))


def test_close_waits_for_a_peer_still_creating_until_it_is_done() -> None:
    root = _store()
    mine, peer = open_attempt(root, "t"), open_attempt(root, "t")
    assert mine.epoch == peer.epoch
    mine.note_created(world_size=2, deadline=time.monotonic() + 5.0)
    assert not mine.underlying_store.check(["created/all"]), "one of two ranks is done: not all"
    peer.note_created(world_size=2, deadline=time.monotonic() + 5.0)
    started = time.monotonic()
    mine.wait_created()
    assert time.monotonic() - started < 1.0, "every rank was done: no wait"


def test_close_waits_no_longer_than_the_creation_deadline() -> None:
    root = _store()
    attempt = open_attempt(root, "t")
    attempt.note_created(world_size=2, deadline=time.monotonic() + 0.3)
    started = time.monotonic()
    attempt.wait_created()  # the peer never finishes: its creation has failed by the deadline
    waited = time.monotonic() - started
    assert 0.1 < waited < 5.0, waited
    started = time.monotonic()
    attempt.wait_created()  # once only
    assert time.monotonic() - started < 0.1


def test_an_attempt_that_created_nothing_to_wait_for_never_touches_the_store() -> None:
    root = _store()
    attempt = open_attempt(root, "t")
    keys = root.num_keys()
    attempt.wait_created()
    assert root.num_keys() == keys


def test_a_note_goes_once_whichever_thread_sends_it() -> None:
    root = _store()
    mine, peer = open_attempt(root, "t"), open_attempt(root, "t")
    for attempt in (mine, peer):
        attempt.note_created(world_size=2, deadline=time.monotonic() + 5.0, announce=False)
    mine.announce_created()  # the starter's
    assert mine.underlying_store.add("created/count", 0) == 1
    assert not mine.underlying_store.check(["created/all"]), "the peer has not sent its note"
    peer.announce_created()
    assert mine.underlying_store.check(["created/all"]), "the last note says so for all"
    mine.announce_created()
    mine.wait_created()  # close(): the note went once; nothing left to wait for
    assert mine.underlying_store.add("created/count", 0) == 2


def test_no_note_where_nothing_connects_on_creation() -> None:
    root = _store()
    attempt = open_attempt(root, "t")
    keys = root.num_keys()
    attempt.announce_created()
    assert root.num_keys() == keys
