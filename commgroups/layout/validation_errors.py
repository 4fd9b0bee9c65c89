"""Turn pydantic's ValidationError into the LayoutError family, with the field and a fix named.

Validators raise :func:`problem` (a ``PydanticCustomError`` whose type is the name of the
:class:`~commgroups.errors.LayoutError` subclass to raise), so the class is chosen where the problem
is found and nothing here maps names to classes. Nested specs are found from the model's own field
annotations, so this module imports no spec.
"""

from __future__ import annotations

from typing import Annotated, Any, get_args, get_origin

from pydantic import BaseModel, ValidationError
from pydantic_core import PydanticCustomError

from commgroups import errors
from commgroups.layout import limits
from commgroups.util.error_text import fit_lines

__all__ = ["Problem", "layout_error_from", "problem"]

Problem = tuple[type[errors.LayoutError], str, str]

# Tags pydantic puts in ``loc`` for the member of a union that failed; they are not fields.
_UNION_TAGS = ("str", "int", "bool", "float")


def problem(
    error: type[errors.LayoutError], message: str, field: str | None = None, **context: Any
) -> PydanticCustomError:
    """A validator's error that becomes ``error`` (field and fix in ``message``) when raised.

    Args:
        error: the LayoutError subclass the caller will receive.
        message: the message, with ``{name}`` placeholders filled from ``context``.
        field: the offending field relative to the validated field (``"[1]"``, ``"min_ctas"``).
        **context: values for the placeholders.

    Returns:
        The ``PydanticCustomError`` to raise inside a pydantic validator.
    """
    if field is not None:
        context["field"] = field
    return PydanticCustomError(error.__name__, message, context)


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The spec model inside a field annotation (``NcclOptions | None``, ``list[RoleSpec]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None


def _models_along(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[type[BaseModel]]:
    """The model that holds each part of ``loc`` (``model`` itself for parts outside any field)."""
    holders = []
    current = model
    for part in loc:
        holders.append(current)
        if isinstance(part, str) and part in current.model_fields:
            current = _model_in(current.model_fields[part].annotation) or current
    return holders


def _field_path(model: type[BaseModel], loc: tuple[int | str, ...], extra: str | None) -> str:
    path = ""
    model_names = {m.__name__ for m in _nested_models(model)}
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            # pydantic names union members and the "function-after" steps in loc; they are noise.
            if part.startswith(("function-", "list[", "literal[", "dict[")) or part in (
                *_UNION_TAGS, *model_names,
            ):
                continue
            path += f".{part}" if path else part
    if extra:
        if extra.startswith("["):
            path += extra
        elif (extra.startswith(path) and path) or (path.startswith("roles") and extra.startswith("roles")):
            path = extra
        else:
            path = f"{path}.{extra}" if path else extra
    return path or "<layout>"


def _nested_models(model: type[BaseModel]) -> set[type[BaseModel]]:
    """Every spec model reachable from ``model``'s fields, ``model`` included."""
    found = {model}
    for info in model.model_fields.values():
        nested = _model_in(info.annotation)
        if nested is not None and nested not in found:
            found |= _nested_models(nested)
    return found


def _is_size(model: type[BaseModel], loc: tuple[int | str, ...]) -> bool:
    """True when ``loc`` is an integer value of nested mappings: a size in Layout.dims or a view.

    RoleSpec.dims (a list) is not one, so a role's bad dims are not called sizes.
    """
    info = model.model_fields.get(str(loc[0])) if loc else None
    annotation = info.annotation if info is not None else None
    for _ in loc[1:]:
        if get_origin(annotation) is not dict:
            return False
        annotation = get_args(annotation)[1]
    if get_origin(annotation) is Annotated:
        annotation = get_args(annotation)[0]
    return len(loc) >= 2 and annotation is int


def _under(field: str, name: str) -> bool:
    """True when the dotted ``field`` (``roles[0].options.nccl``) passes through ``name``."""
    return any(part.split("[")[0] == name for part in field.split("."))


def _classify(model: type[BaseModel], item: dict[str, Any]) -> list[Problem]:
    kind: str = item["type"]
    loc: tuple[int | str, ...] = tuple(item["loc"])
    ctx = item.get("ctx") or {}
    nested = ctx.get("error")
    if kind == "value_error" and isinstance(nested, errors.LayoutError):
        # A nested spec validated through its own __init__ already classified its problems.
        # No loc: the spec itself was validated through its __init__ (model_validate of a spec
        # with a custom __init__), so its fields are already whole paths.
        prefix = _field_path(model, loc, None) if loc else ""
        found = [
            (cls, f"{prefix}{'' if sub.startswith('[') or not prefix else '.'}{sub}", msg)
            for cls, sub, msg in nested.problems
        ]
    else:
        found = [_classify_one(model, item, kind, loc, ctx)]
    return [(_by_place(cls, field), field, msg) for cls, field, msg in found]


def _by_place(cls: type[errors.LayoutError], field: str) -> type[errors.LayoutError]:
    """A generic problem (bad type, out of range) inside ranks or options gets their class.

    Done on the full path: a nested spec classifies its own problems without knowing where it sits.
    """
    if cls is not errors.LayoutError:
        return cls
    if _under(field, "ranks"):
        return errors.InvalidRanksError
    if _under(field, "options"):
        return errors.InvalidOptionError
    return cls


def _classify_one(
    model: type[BaseModel],
    item: dict[str, Any],
    kind: str,
    loc: tuple[int | str, ...],
    ctx: dict[str, Any],
) -> Problem:
    field = _field_path(model, loc, ctx.get("field") if isinstance(ctx.get("field"), str) else None)
    message: str = item["msg"]
    ours = getattr(errors, kind, None)
    if isinstance(ours, type) and issubclass(ours, errors.LayoutError):
        return ours, field, message
    last = loc[-1] if loc else ""
    if kind == "extra_forbidden":
        known = ", ".join(_models_along(model, loc)[-1].model_fields)
        return (
            errors.UnknownFieldError,
            field,
            f"unknown field '{last}'; fix: remove it or use one of: {known}",
        )
    if kind == "literal_error" and last == "backend":
        return (
            errors.UnknownBackendError,
            field,
            f"unknown backend {limits.short_repr(item.get('input'))}; fix: use one of "
            f"{ctx.get('expected')}",
        )
    if kind == "literal_error":
        return (
            errors.LayoutError,
            field,
            f"unknown value {item.get('input')!r} for '{last}'; fix: use one of {ctx.get('expected')}",
        )
    if kind == "missing":
        return errors.LayoutError, field, f"field '{last}' is required; fix: add it"
    if kind == "string_pattern_mismatch":
        return (
            errors.InvalidNameError,
            field,
            f"name {limits.short_repr(item.get('input'))} is not allowed; fix: start with a letter "
            "and use letters, digits, '_' or '-'",
        )
    if _is_size(model, loc):
        return (
            errors.InvalidSizeError,
            field,
            f"dim size must be a whole number >= 1, got {limits.short_repr(item.get('input'))}; "
            "fix: write the size as an integer such as 4",
        )
    got = limits.short_repr(item.get("input"))
    if last == "timeout_s":
        return errors.LayoutError, field, (
            f"a timeout is seconds in [{limits.MIN_TIMEOUT_S:g}, {limits.MAX_TIMEOUT_S:g}], got "
            f"{got}; fix: give seconds in that range, e.g. 600, or leave it unset"
        )
    if kind == "bool_type":
        return errors.LayoutError, field, (
            f"must be true or false, got {got}; fix: write a boolean (true/false), not text or a "
            "number"
        )
    if kind == "int_type":
        return errors.LayoutError, field, (
            f"must be a whole number, got {got}; fix: write an integer such as 4, not text, a "
            "float or a boolean"
        )
    if kind.startswith(("greater_than", "less_than")):
        return errors.LayoutError, field, f"{message}, got {got}; fix: choose a value in range"
    return errors.LayoutError, field, f"{message}, got {got}; fix: give a value of that type"


def layout_error_from(error: ValidationError, model: type[BaseModel]) -> errors.LayoutError:
    """The LayoutError for ``error``: the first problem's class, every problem in the message.

    Args:
        error: what pydantic raised while validating ``model``.
        model: the spec model that was validated (its fields name the known fields).

    Returns:
        An instance of the first problem's LayoutError subclass, with ``field`` and ``problems``.
    """
    # dict.fromkeys: a union (dims: list or "world") reports one problem per member it tried.
    problems = list(dict.fromkeys(p for item in error.errors() for p in _classify(model, dict(item))))
    cls, field, _ = problems[0]
    lines = [f"{f}: {m}" for _, f, m in problems]
    heading = f"invalid {model.__name__}: " if len(lines) == 1 else f"invalid {model.__name__}:\n  "
    # Every problem stays in ``problems``; the text lists those that fit and names the others.
    result = cls(fit_lines(heading, lines, names=[f for _, f, _ in problems]), field=field)
    result.problems = problems
    return result
