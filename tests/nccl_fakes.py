"""Fakes of torch's NCCL classes with exactly the real classes' attributes (mocked NCCL on the CPU).

Built from ``tests/data/nccl_class_attrs.json`` (``dir()`` of ProcessGroupNCCL, ProcessGroupNCCL2,
their Options, ... of each recorded CUDA build; ``tools/capture_nccl_attrs.py`` writes it). A fake
has every recorded attribute and no other: reading one the real class lacks raises AttributeError
as the real class does, and so does giving it a value (``monkeypatch.setattr`` included), so a method
that does not exist cannot be mocked into existence. A recorded attribute reads as an :class:`Unset`
until the test gives it a value; using an Unset (calling it, truth, numbers) fails the test, naming
the attribute.
"""

from __future__ import annotations

import functools
import json
import pathlib
from typing import Any

DATA_FILE = pathlib.Path(__file__).resolve().parent / "data" / "nccl_class_attrs.json"

__all__ = ["DATA_FILE", "Unset", "fake_backend", "fake_class", "fake_group", "nccl_backends",
           "recorded", "recorded_versions", "serve_backends", "touched"]


@functools.cache
def _data() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(DATA_FILE.read_text())
    return data


def recorded_versions() -> list[str]:
    """The torch releases the file holds, oldest first."""
    return list(_data()["versions"])


def recorded(version: str, name: str) -> frozenset[str] | None:
    """The attributes of class ``name`` (``ProcessGroupNCCL2``, ``ProcessGroupNCCL.Options``, ...) in
    torch ``version``; None where that build lacks the class."""
    attrs = _data()["versions"][version]["classes"][name]
    return None if attrs is None else frozenset(attrs)


def nccl_backends(*names: str) -> list[tuple[str, str]]:
    """``(version, class)`` for every recorded build that has each class of ``names`` (default: the
    NCCL backend classes), for ``pytest.mark.parametrize``."""
    wanted = names or ("ProcessGroupNCCL", "ProcessGroupNCCL2", "ProcessGroupNCCLLazy")
    return [(version, name) for version in recorded_versions() for name in wanted
            if recorded(version, name) is not None]


class Unset:
    """A recorded attribute the test gave no value: any use of it fails, naming it."""

    def __init__(self, where: str) -> None:
        object.__setattr__(self, "_where", where)

    def _fail(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"fake {self._where} was used, but the test gave it no value")

    __call__ = __bool__ = __int__ = __float__ = __index__ = __iter__ = __len__ = _fail

    def __repr__(self) -> str:
        return f"Unset({self._where})"


class _Recorded:
    """Base of the fakes: only recorded names may be read or given a value."""

    _recorded: frozenset[str] = frozenset()
    _label: str = ""

    def __init__(self, **values: Any) -> None:
        for name, value in values.items():
            setattr(self, name, value)

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_recorded", "_label", "_fail_missing"):
            return object.__getattribute__(self, name)
        if name not in object.__getattribute__(self, "_recorded"):
            object.__getattribute__(self, "_fail_missing")(name)
        given = object.__getattribute__(self, "__dict__")
        given.setdefault("__touched__", []).append(name)
        if name in given:
            return given[name]
        nested = type(self).__dict__.get(name)
        if isinstance(nested, type):  # a fake Options / NCCLConfig class
            return nested
        return Unset(f"{object.__getattribute__(self, '_label')}.{name}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name not in type(self)._recorded:
            self._fail_missing(name)
        self.__dict__.setdefault("__touched__", []).append(name)
        self.__dict__[name] = value

    def __delattr__(self, name: str) -> None:
        self.__dict__.pop(name, None)  # monkeypatch's undo: the recorded attribute reads Unset again

    def _fail_missing(self, name: str) -> None:
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}' "
                             f"(not in {self._label}'s recorded attributes)")

    def __repr__(self) -> str:
        return f"<fake {self._label}>"


def touched(fake: Any) -> list[str]:
    """The recorded attributes of ``fake`` read or given a value so far, in order."""
    names: list[str] = object.__getattribute__(fake, "__dict__").get("__touched__", [])
    return list(names)


class _RecordedMeta(type):
    """Class-level reads of a fake follow the record too (``FakeNCCL.comm_split_count``)."""

    def __getattr__(cls, name: str) -> Any:
        if name.startswith("__") or name not in cls.__dict__.get("_recorded", frozenset()):
            raise AttributeError(f"type object '{cls.__name__}' has no attribute '{name}'")
        return Unset(f"{cls.__dict__['_label']}.{name}")


@functools.cache
def fake_class(name: str, version: str | None = None) -> type[Any]:
    """A fake of class ``name`` as recorded for torch ``version`` (default: the newest build that
    has it). Its ``Options`` / ``NCCLConfig`` are fakes too; a fake Options starts with a fake config
    (as the real one does), every other attribute Unset.

    Raises:
        KeyError: no recorded build has the class (or ``version`` lacks it).
    """
    if version is None:
        having = [v for v in recorded_versions() if recorded(v, name) is not None]
        if not having:
            raise KeyError(f"no recorded torch build has {name}")
        version = having[-1]
    attrs = recorded(version, name)
    if attrs is None:
        raise KeyError(f"torch {version} has no {name} (tests/data/nccl_class_attrs.json)")
    namespace: dict[str, Any] = {"_recorded": attrs, "_label": f"{name} (torch {version})"}
    same = _data()["versions"][version]["options_same_as_ProcessGroupNCCL"].get(name)
    for nested in ("Options", "NCCLConfig"):
        if nested in attrs and recorded(version, f"{name}.{nested}") is not None:
            # One fake where torch has one class (ProcessGroupNCCL2.Options is ProcessGroupNCCL's).
            owner = "ProcessGroupNCCL" if nested == "Options" and same else name
            namespace[nested] = fake_class(f"{owner}.{nested}", version)
    if name.endswith(".Options") and "config" in attrs:
        config_cls = fake_class("ProcessGroupNCCL.NCCLConfig", version)

        def __init__(self: Any, **values: Any) -> None:
            _Recorded.__init__(self, **{"config": config_cls(), **values})

        namespace["__init__"] = __init__
    return _RecordedMeta(f"Fake{name.replace('.', '')}", (_Recorded,), namespace)


def fake_backend(version: str, name: str, **values: Any) -> Any:
    """An NCCL backend object of class ``name`` as recorded for ``version``, with ``values`` given
    (``supports_shrinking=True``, ``options=...``); its ``options`` default to a fresh fake Options."""
    backend_cls = fake_class(name, version)
    if "options" in backend_cls._recorded and "options" not in values:
        options_cls = fake_class("ProcessGroupNCCL.Options", version)
        values["options"] = options_cls(is_high_priority_stream=False)
    return backend_cls(**values)


def fake_group(version: str = "2.15.0", **values: Any) -> Any:
    """A ``ProcessGroup`` of torch ``version``'s recorded attributes (``bound_device_id=...``)."""
    return fake_class("ProcessGroup", version)(**values)


def serve_backends(monkeypatch: Any, backend_for: Any) -> list[Any]:
    """Make ``backend_for(group, device)`` what every group's backend lookup returns (the one reader
    of ``ProcessGroup._get_backend`` in commgroups, ``nccl_classes.group_backend``); it may raise
    RuntimeError as torch does for a device without a backend. Returns the devices asked for."""
    from commgroups.torch_internals import nccl_classes

    asked: list[Any] = []

    def lookup(group: Any, device: Any) -> Any:
        asked.append(device)
        return backend_for(group, device)

    monkeypatch.setattr(nccl_classes, "group_backend", lookup)
    return asked
