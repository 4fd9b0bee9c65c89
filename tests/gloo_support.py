"""What a supported torch's gloo lacks, so a test skips that one check (with its reason), not its file.

torch 2.10's gloo has no tensor-list ``all_to_all`` ("Backend gloo does not support alltoall");
``all_to_all_single`` works there. The call fails on every rank alike, before any communication, so a
world can note it and go on with its other checks.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

NO_ALL_TO_ALL = "gloo in this torch has no tensor-list all_to_all"


def all_to_all_or_note(call: Callable[[], Any]) -> Any:
    """``call()`` (an all_to_all), or :data:`NO_ALL_TO_ALL` where this torch's gloo lacks it."""
    try:
        return call()
    except RuntimeError as error:
        if "does not support alltoall" not in str(error):
            raise
        return NO_ALL_TO_ALL
