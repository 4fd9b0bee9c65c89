"""Growing this process's descriptor table before creation, so that no group's connect waits for it.

Linux keeps a process's open descriptors in a table that starts at 64 entries and doubles when a
descriptor number does not fit (128, 256, ...). In a process with more than one thread (every
torch process: gloo's and the store's threads) a growth waits for an RCU grace period
(``synchronize_rcu`` in ``expand_fdtable``), and every thread that opens a descriptor meanwhile
waits for it too. Measured here (Linux 6.18, 2 cores): 14 ms for one growth on a quiet machine;
20-35 ms while 8 gloo ranks create groups, where a growth inside a group's connect holds every
peer of that group for as long. A gloo group opens a socket per member and three other
descriptors, so the registry's groups on 8 ranks took a process from 59 descriptors past 64, and
that one growth was most of ``create()``'s time: 81 ms against 51 ms with the table grown first
(fresh 8-rank worlds, medians of 8).

:func:`grow_ahead` starts that growth on a thread of its own before the agreement's round trips,
so the grace period passes while this rank waits for its peers, once, to the size creation needs
(a job whose groups open hundreds of descriptors would else wait once per doubling, each time
inside a connect). It opens no descriptor that outlives it, never touches one in use and never
takes a low number, even for a moment (it duplicates an open descriptor to the lowest free number
at or above the size wanted, ``F_DUPFD_CLOEXEC``, and closes that).
Linux only (``/proc/self/status``); elsewhere :data:`SUPPORTED` is False and nothing is done.

The descriptor numbers themselves are listed here too (:func:`open_descriptors`,
:func:`lowest_free`): the socket ledger of :mod:`~commgroups.creation.sockets` reads them.

Example: a rank with descriptors 0-58 open whose groups will open 34 more: ``grow_ahead(34)``
sees the table's 64 entries and that the groups will reach descriptor 92, starts a thread that
takes descriptor 108 (:data:`GROWTH_MARGIN` above: the table grows to 128) and closes it, and
returns 108. With 20 of those numbers free (closed groups' holes, which new descriptors fill
first), the groups reach 72, and it takes 88; with 40 free, they fill holes only and the
highest stays 58: the table holds that, and it returns None.
"""

from __future__ import annotations

import _thread
import fcntl
import logging
import os
import resource
import sys
from collections.abc import Collection

__all__ = ["FDS", "GROWTH_MARGIN", "SUPPORTED", "grow_ahead", "grow_to", "growth_target", "lowest_free",
           "open_descriptors", "smallest_table", "table_size"]

logger = logging.getLogger(__name__)

_STATUS = "/proc/self/status"
FDS = "/proc/self/fd"
"""Where Linux lists a process's open descriptors."""
SUPPORTED = sys.platform.startswith("linux") and os.path.isfile(_STATUS) and os.path.isdir(FDS)
"""Whether this platform tells a process its descriptor table's size (Linux's ``/proc``)."""


GROWTH_MARGIN = 16
"""How far above the highest number creation's descriptors reach the growth's own descriptor is
taken. Never one creation takes: taken while creation opens its own, that number pushed
creation's next descriptor past it, out of the order the socket ledger reads (every group's
sockets then counted for every group; torch 2.15, 8 ranks, once). The margin also covers a gloo
that opens a few descriptors more than :func:`~commgroups.creation.sockets.gloo_descriptors`
counts."""


def lowest_free() -> int:
    """The number the next descriptor opened here takes: the lowest free one (opened, closed)."""
    number = os.open(FDS, os.O_RDONLY | os.O_DIRECTORY)
    os.close(number)
    return number


def open_descriptors() -> set[int]:
    """The numbers of this process's open descriptors: one directory read, no call per
    descriptor.

    The read opens the folder itself, at the lowest free number, and lists that descriptor
    too; the next socket opened takes the same number, which would then look as if it had
    been open all along. So the lowest free number is learned first (opened and closed) and
    left out if nothing holds it after the read. Should another thread open a descriptor in
    the microseconds between, the read's own number stays in: a socket that takes it next
    then looks as if it had been open before (not recorded; its peer records its own end)."""
    free = lowest_free()
    numbers = {int(name) for name in os.listdir(FDS)}
    if free in numbers:
        try:
            os.fstat(free)
        except OSError:  # the read's own descriptor, closed with it
            numbers.discard(free)
    return numbers


def table_size() -> int | None:
    """How many descriptors this process's table holds now (``FDSize``), or None where unknown."""
    if not SUPPORTED:
        return None
    try:
        with open(_STATUS) as status:
            for line in status:
                if line.startswith("FDSize:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def smallest_table(highest: int) -> int:
    """The fewest entries a table holding descriptor ``highest`` has: Linux's first table holds
    64, and a grown one 128 times a power of two (``alloc_fdtable`` on 64-bit).

    >>> [smallest_table(n) for n in (3, 63, 64, 127, 128, 255, 256, 1000)]
    [64, 64, 128, 128, 256, 256, 512, 1024]
    """
    if highest < 64:
        return 64
    return 128 << (highest // 128).bit_length()


def growth_target(open_numbers: Collection[int], extra: int, size: int,
                  limit: int | None) -> int | None:
    """The highest descriptor number ``extra`` more descriptors reach besides ``open_numbers``,
    opened lowest free number first (the holes below the highest open one fill first); None
    where the table of ``size`` entries holds it already. Capped below ``limit`` (the soft
    ``RLIMIT_NOFILE``; None: no limit), where no descriptor can be.

    >>> growth_target(range(59), 34, 64, 1024)
    92
    >>> growth_target(set(range(59)) - set(range(20, 40)), 34, 64, 1024)
    72
    >>> growth_target(range(20), 34, 64, 1024) is None
    True
    >>> growth_target(range(59), 5000, 64, 1024)
    1023
    """
    highest = max(open_numbers, default=-1)
    holes = highest + 1 - len(set(open_numbers))
    target = highest + max(0, extra - holes)
    if limit is not None:
        target = min(target, limit - 1)
    return target if target >= size else None


def grow_ahead(extra: int) -> int | None:
    """Start growing the table, on a thread of its own, to fit ``extra`` more descriptors than
    are open now (the thread takes the number :data:`GROWTH_MARGIN` above the highest they
    reach); returns that number, or None where nothing needs growing (or the platform cannot
    tell). Never blocks on the growth: call it before a wait (the agreement), so the growth's
    grace period passes then."""
    if not SUPPORTED or extra <= 0:
        return None
    try:
        numbers = open_descriptors()
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    except (OSError, ValueError):
        return None
    limit = None if soft == resource.RLIM_INFINITY else int(soft)
    # The table holds the highest open number at least: where that size fits, the table's own
    # size (FDSize, a read the kernel composes line by line) is not read.
    if growth_target(numbers, extra, smallest_table(max(numbers, default=0)), limit) is None:
        return None
    size = table_size()
    reached = None if size is None else growth_target(numbers, extra, size, limit)
    if reached is None:
        return None
    target = reached + GROWTH_MARGIN if limit is None else min(reached + GROWTH_MARGIN, limit - 1)
    # _thread: threading.Thread.start() waits until the new thread runs (1-6 ms with every
    # rank's cores busy); this start does not.
    _thread.start_new_thread(grow_to, (target, min(numbers)))
    return target


def grow_to(number: int, source: int | None = None) -> int | None:
    """Grow the table now, on this thread, to hold descriptor ``number`` (capped below the soft
    ``RLIMIT_NOFILE``): duplicate ``source`` (an open descriptor; None: the lowest open one) to
    the lowest free number at or above it, then close that. Nothing in use is touched, no
    number below ``number`` is taken even for a moment (the socket ledger reads the lowest free
    number while groups are made: a descriptor held there during the growth's grace period
    made a gloo socket look as if it had been open before, and its group was never severed),
    nothing stays open. Returns the number taken, or None where it failed (``source`` closed
    meanwhile, or the limit lowered: creation then grows the table as it goes). Waits for the
    growth's grace period where the table must grow: :func:`grow_ahead` calls it on a
    thread."""
    try:
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY:
            number = min(number, int(soft) - 1)
        if source is None:
            source = min(open_descriptors())
        taken = fcntl.fcntl(source, fcntl.F_DUPFD_CLOEXEC, number)
        os.close(taken)
    except (OSError, ValueError) as error:  # ValueError: no descriptor open at all
        logger.debug("descriptor table not grown to %d: %s", number, error)
        return None
    return int(taken)
