"""One thread at a time through an object's collective methods: a decorator over its ``_lock``."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Concatenate, ParamSpec, Protocol, TypeVar

__all__ = ["serialized"]

_P = ParamSpec("_P")
_R = TypeVar("_R")


class _Locked(Protocol):
    _lock: threading.RLock


_S = TypeVar("_S", bound=_Locked)


def serialized(method: Callable[Concatenate[_S, _P], _R]) -> Callable[Concatenate[_S, _P], _R]:
    """Run ``method`` under ``self._lock``: one thread at a time creates, meshes or closes.

    Creation is collective; two threads of one rank racing into it would meet each other's
    agreement keys and time out. Serialised, the second finds the first one's result.
    """

    @functools.wraps(method)
    def locked(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            return method(self, *args, **kwargs)

    return locked
