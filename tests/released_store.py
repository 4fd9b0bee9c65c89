"""A store where another rank's release deletes some keys right after this rank first reads one.

The race of a ``check`` then a ``get`` (or a read then a wait) of a key another rank may delete:
a ``get`` or ``wait`` of the deleted key waits out the store's timeout on the job's shared
connection. The wrapper makes that moment certain: CI hit it once in thousands of runs.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from torch.distributed import Store  # type: ignore[attr-defined]  # re-exported at runtime

__all__ = ["ReleasedAfterFirstRead"]


class ReleasedAfterFirstRead(Store):  # type: ignore[misc]  # torch's Store: no subclass stubs
    """Forwards to ``inner``; right after the first request that reads one of ``keys``
    (``check``, ``get`` or ``compare_set``) returns, deletes them all, as another rank's release
    landing then would. :attr:`released` says whether it happened."""

    def __init__(self, inner: Store, keys: tuple[str, ...]) -> None:
        super().__init__()
        self.inner, self.keys, self.released = inner, keys, False

    def _read(self, key: str, result: Any) -> Any:
        if key in self.keys and not self.released:
            self.released = True
            for name in self.keys:
                self.inner.delete_key(name)
        return result

    def check(self, keys: list[str]) -> bool:
        return bool(self._read(keys[0], self.inner.check(keys)))

    def get(self, key: str) -> bytes:
        return bytes(self._read(key, self.inner.get(key)))

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return bytes(self._read(key, self.inner.compare_set(key, expected, desired)))

    def set(self, key: str, value: Any) -> None:
        self.inner.set(key, value)

    def add(self, key: str, amount: int) -> int:
        return int(self.inner.add(key, amount))

    def delete_key(self, key: str) -> bool:
        return bool(self.inner.delete_key(key))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)
