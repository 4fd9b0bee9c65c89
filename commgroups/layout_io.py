"""Read a :class:`~commgroups.Layout` from a TOML, YAML or JSON file."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from commgroups.errors import LayoutError, LayoutFileError
from commgroups.specs import Layout

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found,no-redef]

__all__ = ["SUFFIXES", "load_layout", "load_layout_data", "parse_layout", "parse_layout_data"]

SUFFIXES = (".toml", ".yaml", ".yml", ".json")


def _parse(text: str, suffix: str, source: str) -> Any:
    try:
        if suffix == ".toml":
            return tomllib.loads(text)
        if suffix == ".json":
            return json.loads(text)
        try:
            import yaml
        except ImportError as error:
            raise LayoutFileError(
                f"{source}: reading YAML needs PyYAML; fix: pip install 'commgroups[yaml]' or use "
                "TOML/JSON"
            ) from error
        return yaml.safe_load(text)
    except LayoutError:
        raise
    except Exception as error:  # each parser has its own error types; all mean "bad syntax"
        raise LayoutFileError(
            f"{source}: not valid {suffix.lstrip('.').upper()}: {error}; fix: correct the syntax"
        ) from None


def parse_layout_data(text: str, suffix: str, source: str = "<layout>") -> dict[str, Any]:
    """Parse layout text into its mapping, not yet validated (for callers that complete it first).

    Raises:
        LayoutFileError: an unknown suffix, bad syntax, YAML without PyYAML, or a top level that is
            not a mapping.

    Example::

        >>> parse_layout_data('{"dims": {"cp": 4}}', ".json")
        {'dims': {'cp': 4}}
    """
    if suffix not in SUFFIXES:
        raise LayoutFileError(
            f"{source}: unknown layout format {suffix!r}; fix: use one of {', '.join(SUFFIXES)}"
        )
    data = _parse(text, suffix, source)
    if not isinstance(data, dict):
        raise LayoutFileError(
            f"{source}: a layout must be a table/mapping with 'dims' (and optionally 'roles'), got "
            f"{type(data).__name__}; fix: start with e.g. [dims] in TOML"
        )
    return data


def parse_layout(text: str, suffix: str, source: str = "<layout>") -> Layout:
    """Parse layout text in the format of ``suffix`` into a validated :class:`~commgroups.Layout`.

    Args:
        text (str): the layout: a table/mapping with ``dims`` and optionally ``roles``.
        suffix (str): the format, as a file suffix: ``.toml``, ``.yaml``, ``.yml`` or ``.json``.
        source (str): what to call the text in error messages (a path, a URL).

    Returns:
        Layout: the validated layout.

    Raises:
        LayoutFileError: an unknown suffix, bad syntax, YAML without PyYAML, or a top level that is
            not a mapping.
        LayoutError: the layout itself is invalid (the subclass names the problem, see
            :class:`~commgroups.Layout`); the message starts with ``source``.

    Example::

        >>> layout = parse_layout('{"dims": {"dp_shard": 2, "cp": 2}}', ".json")
        >>> layout.world_size, layout.role_names
        (4, ('dp_shard', 'cp', 'fsdp', 'checkpoint-metadata'))
    """
    data = parse_layout_data(text, suffix, source)
    try:
        return Layout.model_validate(data)
    except LayoutError as error:
        error.args = (f"{source}: {error.args[0]}",)
        raise


def load_layout(path: str | Path) -> Layout:
    """Read and validate a layout file; every failure is a LayoutError naming the field and fix.

    Args:
        path (str | Path): a ``.toml``, ``.yaml``, ``.yml`` or ``.json`` file; the suffix picks
            the format.

    Returns:
        Layout: the validated layout.

    Raises:
        LayoutFileError: the file cannot be read, or see :func:`parse_layout`.
        LayoutError: the layout itself is invalid, see :func:`parse_layout`.

    Example::

        >>> layout = load_layout("examples/layouts/seed_cp4.toml")  # from the repository root
        >>> layout.role_names
        ('fsdp', 'cp', 'checkpoint-metadata')
    """
    path = Path(path)
    return parse_layout(_read(path), path.suffix.lower(), str(path))


def load_layout_data(path: str | Path) -> dict[str, Any]:
    """Read a layout file into its mapping, not yet validated (see :func:`parse_layout_data`).

    Raises:
        LayoutFileError: the file cannot be read, or see :func:`parse_layout_data`.
    """
    path = Path(path)
    return parse_layout_data(_read(path), path.suffix.lower(), str(path))


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise LayoutFileError(f"{path}: cannot read layout file ({error}); fix: check the path") from None
