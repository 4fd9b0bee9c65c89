"""commgroups.creation.descriptor_table: the descriptor table grown ahead of creation, in a fresh
Python process (a thread started so the process is multi-threaded, as every torch process is),
read back from /proc."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from commgroups.creation.descriptor_table import GROWTH_MARGIN, SUPPORTED

pytestmark = [pytest.mark.world,
              pytest.mark.skipif(not SUPPORTED, reason="no /proc/self/status: not Linux")]


_CHILD = textwrap.dedent("""
    import json, os, threading, time
    from commgroups.creation.descriptor_table import grow_ahead, lowest_free, table_size
    idle = threading.Event()
    threading.Thread(target=idle.wait, daemon=True).start()  # multi-threaded, as torch is
    def descriptors():  # the listing's own descriptor is gone by the time it is read
        found = {}
        for name in os.listdir("/proc/self/fd"):
            try:
                found[name] = os.readlink(f"/proc/self/fd/{name}")
            except OSError:
                pass
        return found
    before = descriptors()
    size = table_size()
    highest = max(int(name) for name in before)
    # A table as large as the parent's highest descriptor (fork copies that much): the growth
    # asks for as many again (beyond any holes); the fit asks for one more than is open.
    target = grow_ahead(2 * size if GROW else 1)
    lowest = {lowest_free()}  # never taken by the growth, even for a moment
    deadline = time.monotonic() + 10
    while target is not None and table_size() <= target and time.monotonic() < deadline:
        lowest.add(lowest_free())
        time.sleep(0.0005)
    time.sleep(0.05)  # the thread closed what it took
    after = descriptors()
    print(json.dumps({"size": size, "highest": highest, "target": target,
                      "grown": table_size(), "same": before == after,
                      "lowest": len(lowest)}))
""")


def _child(grow: bool) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", _CHILD.replace("GROW", str(grow))],
                          capture_output=True, text=True, timeout=60, check=True)
    return dict(json.loads(done.stdout.strip().splitlines()[-1]))


def test_a_growth_makes_room_in_the_background_and_leaves_every_descriptor_as_it_was() -> None:
    got = _child(grow=True)
    size, highest, target, grown = got["size"], got["highest"], got["target"], got["grown"]
    assert isinstance(size, int) and isinstance(highest, int) and highest < size
    assert isinstance(target, int)
    assert highest + size + GROWTH_MARGIN <= target <= highest + 2 * size + GROWTH_MARGIN
    assert isinstance(grown, int) and grown > target  # the table holds the number taken
    assert got["same"] is True  # nothing left open, nothing in use closed or replaced
    assert got["lowest"] == 1  # no low number held during the grace period (the socket ledger)


def test_a_table_that_fits_already_is_left_alone() -> None:
    got = _child(grow=False)
    assert got["target"] is None and got["grown"] == got["size"] and got["same"] is True
    assert got["lowest"] == 1
