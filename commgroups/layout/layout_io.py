"""Read a :class:`~commgroups.Layout` from a TOML, YAML or JSON file."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, overload

from commgroups.errors import LayoutError, LayoutFileError
from commgroups.layout import limits
from commgroups.layout.auto_layout import AutoLayout, has_auto_dim, resolve_layout
from commgroups.layout.specs import Layout

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib  # type: ignore[import-not-found,no-redef]

__all__ = ["SUFFIXES", "load_layout", "load_layout_data", "parse_layout", "parse_layout_data"]

SUFFIXES = (".toml", ".yaml", ".yml", ".json")


def _refuse_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for JSON: a key given twice is an error, not "the last one wins"."""
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise LayoutFileError(
                f"key {limits.short_repr(key)} is given twice in one object; fix: keep one of them"
            )
        result[key] = value
    return result


def _yaml_loader() -> type:
    """A SafeLoader that refuses duplicate keys, aliases to a node that holds them (a value that
    contains itself), nesting past MAX_NESTING and documents that expand past MAX_LAYOUT_NODES.

    Built on first use so that PyYAML stays optional; the checks run on the composed node graph,
    before any Python object is constructed, so a few bytes of aliases cannot expand for minutes.
    """
    import yaml

    MappingNode, ScalarNode, SequenceNode = yaml.MappingNode, yaml.ScalarNode, yaml.SequenceNode

    class LayoutLoader(yaml.SafeLoader):  # type: ignore[misc]  # untyped base
        depth = 0

        def compose_node(self, parent: Any, index: Any) -> Any:
            # Stop at the first level too deep: PyYAML scans lazily, and deep flow collections
            # cost it quadratic time, so the document's rest is never read.
            self.depth += 1
            try:
                if self.depth > limits.MAX_NESTING + 1:
                    raise LayoutFileError(
                        f"nested more than {limits.MAX_NESTING} levels deep (MAX_NESTING); fix: "
                        "a layout nests at most 7 levels"
                    )
                node: Any = super().compose_node(parent, index)
                return node
            finally:
                self.depth -= 1

        def compose_document(self) -> Any:
            node: Any = super().compose_document()
            if node is not None:
                _check_graph(node)
            return node

        def construct_mapping(self, node: Any, deep: bool = False) -> dict[Any, Any]:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if isinstance(key_node, ScalarNode):
                    key = self.construct_scalar(key_node)
                    if key in seen:
                        line = key_node.start_mark.line + 1
                        raise LayoutFileError(
                            f"key {limits.short_repr(key)} is given twice in one mapping (line "
                            f"{line}); fix: keep one of them"
                        )
                    seen.add(key)
            mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
            return mapping

    def _check_graph(root: Any) -> None:
        # Expanded size and depth per node, memoized by identity: aliases share nodes, so this is
        # linear in the composed graph however far the aliases would expand.
        sizes: dict[int, int] = {}
        depths: dict[int, int] = {}
        open_nodes: set[int] = set()
        stack: list[tuple[Any, bool]] = [(root, False)]
        while stack:
            node, done = stack.pop()
            key = id(node)
            if done:
                open_nodes.discard(key)
                children = _children(node)
                sizes[key] = 1 + sum(sizes[id(c)] for c in children)
                depths[key] = 1 + max((depths[id(c)] for c in children), default=0)
                if sizes[key] > limits.MAX_LAYOUT_NODES:
                    raise LayoutFileError(
                        f"YAML aliases expand to more than {limits.MAX_LAYOUT_NODES:,} values "
                        f"(MAX_LAYOUT_NODES; line {node.start_mark.line + 1}); fix: write the "
                        "layout without repeated aliases"
                    )
                if depths[key] > limits.MAX_NESTING + 1:
                    raise LayoutFileError(
                        f"nested more than {limits.MAX_NESTING} levels deep (MAX_NESTING; line "
                        f"{node.start_mark.line + 1}); fix: a layout nests at most 7 levels"
                    )
                continue
            if key in sizes:
                continue
            if key in open_nodes:
                raise LayoutFileError(
                    f"an alias at line {node.start_mark.line + 1} points at a value that contains "
                    "it (a recursive anchor); fix: remove the alias"
                )
            open_nodes.add(key)
            stack.append((node, True))
            stack.extend((child, False) for child in _children(node))

    def _children(node: Any) -> list[Any]:
        if isinstance(node, SequenceNode):
            return list(node.value)
        if isinstance(node, MappingNode):
            return [part for pair in node.value for part in pair]
        return []

    return LayoutLoader


def _flow_nesting(text: str, bound: int) -> bool:
    """Whether YAML flow brackets (``[`` / ``{`` outside quotes) nest deeper than ``bound``.

    PyYAML's scanner looks up to 1,024 characters ahead for each open bracket (a possible simple
    key), which is quadratic in the depth: ten thousand ``[`` take it over a second before the
    composer sees the first node. This linear pass refuses such text first.
    """
    depth, quote = 0, ""
    for char in text:
        if char == "\n":
            quote = ""  # an apostrophe in a comment or plain text must not hide the next lines
        elif quote:
            quote = "" if char == quote else quote
        elif char in "\"'":
            quote = char
        elif char in "[{":
            depth += 1
            if depth > bound:
                return True
        elif char in "]}":
            depth = max(depth - 1, 0)
    return False


def _parse(text: str, suffix: str, source: str) -> Any:
    if len(text) > limits.MAX_LAYOUT_CHARS:
        raise LayoutFileError(
            f"{source}: {len(text):,} characters is more than MAX_LAYOUT_CHARS = "
            f"{limits.MAX_LAYOUT_CHARS:,}; fix: a layout is a few hundred characters, so check "
            "that this is the right file"
        )
    try:
        if suffix == ".toml":
            return tomllib.loads(text)  # a key given twice is already a TOML syntax error
        if suffix == ".json":
            return json.loads(text, object_pairs_hook=_refuse_duplicates)
        try:
            import yaml
        except ImportError as error:
            raise LayoutFileError(
                f"{source}: reading YAML needs PyYAML; fix: pip install 'commgroups[yaml]' or use "
                "TOML/JSON"
            ) from error
        if _flow_nesting(text, limits.MAX_NESTING + 1):
            raise LayoutFileError(
                f"flow collections ([...] / {{...}}) nested more than {limits.MAX_NESTING} levels "
                "deep (MAX_NESTING); fix: a layout nests at most 7 levels"
            )
        return yaml.load(text, Loader=_yaml_loader())  # a SafeLoader subclass: safe
    except LayoutError as error:
        error.args = (f"{source}: {error.args[0]}",)
        raise
    except RecursionError:
        # json and tomllib recurse per nesting level (the YAML loader is bounded above).
        raise LayoutFileError(
            f"{source}: nested too deep to parse; fix: a layout nests at most 7 levels "
            f"(MAX_NESTING = {limits.MAX_NESTING})"
        ) from None
    except Exception as error:  # each parser has its own error types; all mean "bad syntax"
        detail = " ".join(str(error).split())  # one line: parsers put marks on several lines
        detail = detail if len(detail) <= 300 else detail[:296] + " ..."
        raise LayoutFileError(
            f"{source}: not valid {suffix.lstrip('.').upper()}: {detail}; fix: correct the syntax"
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


@overload
def parse_layout(text: str, suffix: str, source: str = ..., *, world_size: int) -> Layout: ...


@overload
def parse_layout(
    text: str, suffix: str, source: str = ..., *, world_size: None = None
) -> Layout | AutoLayout: ...


def parse_layout(
    text: str, suffix: str, source: str = "<layout>", *, world_size: int | None = None
) -> Layout | AutoLayout:
    """Parse layout text in the format of ``suffix`` into a validated :class:`~commgroups.Layout`.

    Text whose ``dims`` give one elastic dim the size ``"auto"`` (restart mode) becomes a
    :class:`~commgroups.AutoLayout` instead, which ``GroupRegistry`` resolves with the job's world
    size; with ``world_size`` it is resolved here.

    Args:
        text (str): the layout: a table/mapping with ``dims`` and optionally ``roles``.
        suffix (str): the format, as a file suffix: ``.toml``, ``.yaml``, ``.yml`` or ``.json``.
        source (str): what to call the text in error messages (a path, a URL).
        world_size (int, optional): resolve for this many ranks (see
            :func:`~commgroups.resolve_layout`): an AutoLayout gets its ``"auto"`` size, a Layout
            must have this world size.

    Returns:
        Layout | AutoLayout: the validated layout (always a Layout when ``world_size`` is given).

    Raises:
        LayoutFileError: an unknown suffix, bad syntax, YAML without PyYAML, or a top level that is
            not a mapping.
        LayoutError: the layout itself is invalid (the subclass names the problem, see
            :class:`~commgroups.Layout` and :class:`~commgroups.AutoLayout`), or does not fit
            ``world_size`` (:class:`~commgroups.errors.WorldSizeMismatchError`); the message starts
            with ``source``.

    Example::

        >>> layout = parse_layout('{"dims": {"dp_shard": 2, "cp": 2}}', ".json")
        >>> layout.world_size, layout.role_names
        (4, ('dp_shard', 'cp', 'fsdp', 'checkpoint-metadata'))
        >>> text = '{"dims": {"dp_shard": "auto"}, "elastic": {"dims": {"dp_shard": 1}}}'
        >>> parse_layout(text, ".json", world_size=2).dims
        {'dp_shard': 2}
    """
    data = parse_layout_data(text, suffix, source)
    try:
        layout: Layout | AutoLayout = (
            AutoLayout.model_validate(data) if has_auto_dim(data) else Layout.model_validate(data)
        )
        return layout if world_size is None else resolve_layout(layout, world_size)
    except LayoutError as error:
        error.args = (f"{source}: {error.args[0]}",)
        raise


@overload
def load_layout(path: str | Path, *, world_size: int) -> Layout: ...


@overload
def load_layout(path: str | Path, *, world_size: None = None) -> Layout | AutoLayout: ...


def load_layout(path: str | Path, *, world_size: int | None = None) -> Layout | AutoLayout:
    """Read and validate a layout file; every failure is a LayoutError naming the field and fix.

    Args:
        path (str | Path): a ``.toml``, ``.yaml``, ``.yml`` or ``.json`` file; the suffix picks
            the format.
        world_size (int, optional): resolve for this many ranks, see :func:`parse_layout`.

    Returns:
        Layout | AutoLayout: the validated layout; an :class:`~commgroups.AutoLayout` when a dim
        is ``"auto"`` and no ``world_size`` is given (``GroupRegistry`` takes either).

    Raises:
        LayoutFileError: the file cannot be read, or see :func:`parse_layout`.
        LayoutError: the layout itself is invalid, see :func:`parse_layout`.

    Example::

        >>> layout = load_layout("examples/layouts/seed_cp4.toml")  # from the repository root
        >>> layout.role_names
        ('fsdp', 'cp', 'checkpoint-metadata')
        >>> load_layout("examples/layouts/hsdp_restart.toml", world_size=2).dims
        {'dp_replicate': 1, 'dp_shard': 2}
    """
    path = Path(path)
    return parse_layout(_read(path), path.suffix.lower(), str(path), world_size=world_size)


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
        # strerror, not str(error): the OSError's own text repeats the path.
        reason = getattr(error, "strerror", None) or error
        raise LayoutFileError(f"{path}: cannot read layout file ({reason}); fix: check the path") from None
