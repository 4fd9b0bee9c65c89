"""commgroups' one seam with Megatron-Core beyond its public API: every private name, in one place.

:mod:`~commgroups.integrations.megatron.install` and :mod:`~commgroups.integrations.megatron.checkpoint`
reach Megatron's module globals, its private helpers and its save internals only through this
module (``tests/test_megatron_install.py`` scans the package for any other private Megatron name).
Everything here was read and run on each of :data:`CHECKED_VERSIONS`:

- ``0.19.2``: the PyPI wheel the ``megatron`` extra installs (``megatron-core>=0.19,<0.20``), run
  in CI's megatron leg (Python 3.12).

What is private and why:

- ``parallel_state``'s module globals (``_TENSOR_MODEL_PARALLEL_GROUP``, ...): the getters read
  them at call time and there is no setter for most (``initialize_model_parallel`` is the only
  writer); :func:`set_state` writes them, checking first that each name exists.
- ``parallel_state._set_global_memory_buffer``: ``initialize_model_parallel`` calls it last; TP
  layers read the buffer through ``get_global_memory_buffer()``.
- ``parallel_state.destroy_model_parallel`` and the getters without a registry counterpart are
  *replaced* on the module while a handle is installed (:func:`replaced_functions`), and put back.
- ``dist_checkpointing``: ``serialization.save`` takes no process group (Megatron-LM #6092) and its
  strategy's ``async_save`` hard-codes ``process_group=None``; the save is therefore rebuilt from
  the steps it runs, with the group passed where the helpers take one:
  ``strategies.torch._replace_state_dict_keys_with_sharded_keys``, ``mcore_to_pyt_state_dict``,
  ``MCoreSavePlanner``, ``strategies.filesystem_async.FileSystemWriterAsync``,
  ``strategies.state_dict_saver.save_state_dict_async_plan`` (which takes ``process_group``),
  ``serialization._CONTENT_METADATA_KEY``, ``state_dict_utils.save_preprocess``,
  ``validation.determine_global_metadata`` (takes ``process_group``), ``validation.
  validate_sharding_integrity``, ``core.save_config`` / ``CheckpointingConfig``; and
  ``filesystem_async._results_queue`` / ``_process_memory`` for the block of a sync write
  (:func:`sync_write`).

A change in any of these fails loudly (:class:`~commgroups.errors.MegatronUnavailableError` naming
the name and the version), never silently.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Iterator, Mapping
from importlib.metadata import PackageNotFoundError, version
from types import ModuleType
from typing import Any

from commgroups.errors import MegatronUnavailableError

__all__ = [
    "CHECKED_VERSIONS",
    "SAVE_NAMES",
    "checkpoint_names",
    "megatron_version",
    "parallel_state",
    "read_state",
    "replaced_functions",
    "set_global_memory_buffer",
    "set_state",
    "sync_write",
]

CHECKED_VERSIONS = ("0.19.2",)
"""megatron-core releases every name here was checked on (see the module docs)."""

_SUPPORTED_SERIES = "0.19."
"""The release series the ``megatron`` extra accepts; a release outside it is refused."""

SAVE_NAMES: dict[str, tuple[str, str]] = {
    "replace_keys": ("megatron.core.dist_checkpointing.strategies.torch",
                     "_replace_state_dict_keys_with_sharded_keys"),
    "to_pyt": ("megatron.core.dist_checkpointing.strategies.torch", "mcore_to_pyt_state_dict"),
    "planner": ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlanner"),
    "save_strategy": ("megatron.core.dist_checkpointing.strategies.torch",
                      "TorchDistSaveShardedStrategy"),
    "writer": ("megatron.core.dist_checkpointing.strategies.filesystem_async",
               "FileSystemWriterAsync"),
    "plan": ("megatron.core.dist_checkpointing.strategies.state_dict_saver",
             "save_state_dict_async_plan"),
    "content_key": ("megatron.core.dist_checkpointing.serialization", "_CONTENT_METADATA_KEY"),
    "preprocess": ("megatron.core.dist_checkpointing.state_dict_utils", "save_preprocess"),
    "global_metadata": ("megatron.core.dist_checkpointing.validation", "determine_global_metadata"),
    "validate": ("megatron.core.dist_checkpointing.validation", "validate_sharding_integrity"),
    "save_config": ("megatron.core.dist_checkpointing.core", "save_config"),
    "config": ("megatron.core.dist_checkpointing.core", "CheckpointingConfig"),
    "sharded_object": ("megatron.core.dist_checkpointing.mapping", "ShardedObject"),
    "diff": ("megatron.core.dist_checkpointing.dict_utils", "diff"),
    "load": ("megatron.core.dist_checkpointing.serialization", "load"),
}
"""What :mod:`~commgroups.integrations.megatron.checkpoint` uses of ``dist_checkpointing``:
key -> (module, name). Read on 0.19.2."""


def megatron_version() -> str:
    """The installed megatron-core version; refused outside the checked series.

    Raises:
        MegatronUnavailableError: megatron-core is not installed, or is not a 0.19 release.
    """
    try:
        installed = version("megatron-core")
    except PackageNotFoundError as error:
        raise MegatronUnavailableError(
            "commgroups.integrations.megatron needs Megatron-Core (megatron-core is not installed); "
            "fix: pip install 'commgroups[megatron]' (megatron-core 0.19, Python 3.12 wheels)"
        ) from error
    if not installed.startswith(_SUPPORTED_SERIES):
        raise MegatronUnavailableError(
            f"megatron-core {installed} is installed, but commgroups reaches Megatron's private "
            f"names as checked on {', '.join(CHECKED_VERSIONS)}; fix: pip install "
            f"'commgroups[megatron]' (megatron-core>=0.19,<0.20)")
    return installed


def _import(module: str) -> ModuleType:
    megatron_version()
    try:
        return importlib.import_module(module)
    except ImportError as error:
        raise MegatronUnavailableError(
            f"commgroups.integrations.megatron needs {module} ({error}); fix: pip install "
            "'commgroups[megatron]' (megatron-core 0.19, Python 3.12 wheels)") from error


def parallel_state() -> ModuleType:
    """``megatron.core.parallel_state`` (version checked)."""
    return _import("megatron.core.parallel_state")


def _missing(module: ModuleType, names: Any) -> list[str]:
    return sorted(name for name in names if not hasattr(module, name))


def read_state(names: Any) -> dict[str, Any]:
    """The current values of ``parallel_state``'s module globals ``names``.

    Raises:
        MegatronUnavailableError: a name does not exist in this Megatron (a changed seam).
    """
    module = parallel_state()
    missing = _missing(module, names)
    if missing:
        raise MegatronUnavailableError(
            f"megatron.core.parallel_state {megatron_version()} has no {', '.join(missing)} (read "
            f"on {', '.join(CHECKED_VERSIONS)}); fix: pip install 'commgroups[megatron]'")
    return {name: getattr(module, name) for name in names}


def set_state(values: Mapping[str, Any]) -> None:
    """Write ``parallel_state``'s module globals; every name is checked before any is written."""
    module = parallel_state()
    read_state(values)  # raises, naming the missing ones, before anything changes
    for name, value in values.items():
        setattr(module, name, value)


def set_global_memory_buffer() -> bool:
    """What ``initialize_model_parallel`` does last: make the TP layers' shared buffer, if none.

    Returns whether it made one (``parallel_state.destroy_global_memory_buffer()`` undoes it).
    """
    # Names as data, read through read_state like every global here (checked to exist first).
    state = read_state(["_GLOBAL_MEMORY_BUFFER", "_set_global_memory_buffer"])
    if state["_GLOBAL_MEMORY_BUFFER"] is not None:
        return False
    state["_set_global_memory_buffer"]()
    return True


@contextlib.contextmanager
def replaced_functions(replacements: Mapping[str, Callable[..., Any]]) -> Iterator[
        dict[str, Callable[..., Any]]]:
    """Replace ``parallel_state`` functions by name for the block; yields the originals.

    Code that calls ``parallel_state.<name>()`` (Megatron's own modules do) gets the replacement;
    a name imported by value before the block keeps the original. Put back on exit, whatever
    happened.
    """
    module = parallel_state()
    originals = read_state(replacements)
    for name, function in replacements.items():
        setattr(module, name, function)
    try:
        yield dict(originals)
    finally:
        for name, function in originals.items():
            setattr(module, name, function)


@contextlib.contextmanager
def sync_write() -> Iterator[None]:
    """Megatron's checkpoint writer, set up for a save that writes in this process, for the block.

    Two module globals of ``dist_checkpointing.strategies.filesystem_async`` (0.19.2), put back
    after the block so Megatron's own async saves see them unchanged:

    - ``_results_queue``: ``FileSystemWriterAsync.prepare_write_data`` takes its results queue from
      it, made on first use as a ``multiprocessing`` Manager queue (a spawned server process per
      rank, for the async save's writer process; it cannot start in a daemonic process). A sync
      save writes in this process: a ``queue.Queue`` is all it needs.
    - ``_process_memory``: the writer threads call it around each write for a debug log line; it
      raises without psutil, which megatron-core does not declare. Without psutil it reads 0.
    """
    import importlib.util
    import queue

    module = _import("megatron.core.dist_checkpointing.strategies.filesystem_async")
    names = ("_results_queue", "_process_memory")  # names held as data, like every private here
    missing = _missing(module, names)
    if missing:
        raise MegatronUnavailableError(
            f"{module.__name__} {megatron_version()} has no {', '.join(missing)} (read on "
            f"{', '.join(CHECKED_VERSIONS)}); fix: pip install 'commgroups[megatron]'")
    previous = {name: getattr(module, name) for name in names}
    setattr(module, names[0], queue.Queue())
    if importlib.util.find_spec("psutil") is None:
        setattr(module, names[1], lambda: 0)
    try:
        yield
    finally:
        for name, value in previous.items():
            setattr(module, name, value)


def checkpoint_names() -> dict[str, Any]:
    """Every ``dist_checkpointing`` name of :data:`SAVE_NAMES`, imported and checked."""
    found: dict[str, Any] = {}
    for key, (module_name, name) in SAVE_NAMES.items():
        module = _import(module_name)
        if not hasattr(module, name):
            raise MegatronUnavailableError(
                f"{module_name} {megatron_version()} has no {name} (read on "
                f"{', '.join(CHECKED_VERSIONS)}); fix: pip install 'commgroups[megatron]'")
        found[key] = getattr(module, name)
    return found
