"""Reading a store key that may not exist, in one request, without creating it or blocking on it.

``get`` blocks until the key exists and ``add(key, 0)`` creates it; ``compare_set(key, x, x)``
with an ``x`` no key ever holds returns the value, or ``x`` where the key is missing, and
changes nothing. The liveness listener, the check-in and the flight recorder's asks read keys
that other ranks may have deleted already, and must neither wait for them nor bring them back.

Example: ``read_if_present(store, "lost/3")`` is ``"1"`` once a loss of generation 3 was
reported, and None before (or after its release).

The control plane's lists of numbers (ranks that answered or checked in, event numbers) have one
format, written by :func:`append_numbers` and read by :func:`read_numbers` and
:func:`parse_numbers`: ``"3,17,"``.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch.distributed import Store  # type: ignore[attr-defined]  # re-exported

__all__ = ["append_numbers", "parse_numbers", "read_bytes_if_present", "read_if_present",
           "read_numbers"]

_ABSENT = "\x00"  # a value no key holds


def read_bytes_if_present(store: Store, key: str) -> bytes | None:
    """``key``'s raw value, or None where it does not exist (one request; never blocks, never
    creates the key). For large values read as bytes (a list of answers)."""
    value = bytes(store.compare_set(key, _ABSENT, _ABSENT))
    return None if value == _ABSENT.encode() else value


def read_if_present(store: Store, key: str) -> str | None:
    """``key``'s value as text, or None where it does not exist (as
    :func:`read_bytes_if_present`)."""
    value = read_bytes_if_present(store, key)
    return None if value is None else value.decode()


def read_numbers(store: Store, key: str) -> list[int]:
    """The numbers appended to ``key`` (:func:`append_numbers`), in the order they were
    appended; empty where the key does not exist (as :func:`read_bytes_if_present`)."""
    value = read_if_present(store, key)
    return [] if value is None else parse_numbers(value)


def parse_numbers(text: str) -> list[int]:
    """``"3,17,"`` (or ``"3,17"``) -> ``[3, 17]``; ``""`` -> ``[]``."""
    return [int(part) for part in text.split(",") if part]


def append_numbers(store: Store, key: str, numbers: Iterable[int]) -> None:
    """Append ``numbers`` to ``key`` as ``"3,17,"``, creating it where missing: one request,
    no reply awaited (``Store.append``); concurrent appends never interleave inside one."""
    # Store.append: at runtime on 2.10-2.15, missing from some releases' stubs.
    store.append(key, "".join(f"{number}," for number in numbers))  # type: ignore[attr-defined,unused-ignore]
