"""The one way a GPU check part says it cannot run here: :class:`PartSkipped`.

Its own module because the worker runs as ``__main__``: a class defined there would be a second
class to a part that imports ``tools.gpu_check.worker``, and the worker's ``except`` would miss it.
"""

from __future__ import annotations

__all__ = ["PartSkipped"]


class PartSkipped(Exception):  # a skip, not an error: the answer says "skipped: ..."
    """Raised by a part that cannot run here (a missing optional package); the text is the reason.

    The worker records ``{"ran": False, "skipped": reason}`` as the part's data and
    ``skipped: <reason>`` as its error, and exits 0.
    """
