"""Turn pydantic's ValidationError into the LayoutError family, with the field and a fix named."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationError

from commgroups import errors

# Our validators raise PydanticCustomError with these types; each maps to one LayoutError subclass.
_CUSTOM_TYPES: dict[str, type[errors.LayoutError]] = {
    "unknown_dim": errors.UnknownDimError,
    "duplicate_role": errors.DuplicateRoleError,
    "invalid_size": errors.InvalidSizeError,
    "empty_dims": errors.EmptyDimsError,
    "invalid_name": errors.InvalidNameError,
    "unknown_backend": errors.UnknownBackendError,
    "unknown_option": errors.UnknownOptionError,
    "invalid_option": errors.UnknownOptionError,
}


def _field_path(loc: tuple[int | str, ...], extra: str | None) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            # pydantic names union members and the "function-after" steps in loc; they are noise.
            if part.startswith(("function-", "list[", "literal[", "dict[")) or part in (
                "str", "int", "bool", "float", "NcclOptions", "HcclOptions", "RoleSpec",
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


def _known_fields(model: type[BaseModel], loc: tuple[int | str, ...]) -> list[str]:
    """The field names of the model at ``loc``'s parent, for 'unknown field' messages."""
    from commgroups import specs

    nested: dict[str, type[BaseModel]] = {
        "roles": specs.RoleSpec,
        "options": specs.RoleOptions,
        "nccl": specs.NcclOptions,
        "hccl": specs.HcclOptions,
    }
    current = model
    for part in loc[:-1]:
        if isinstance(part, str) and part in nested:
            current = nested[part]
    return list(current.model_fields)


Problem = tuple[type[errors.LayoutError], str, str]


def _classify(model: type[BaseModel], item: dict[str, Any]) -> list[Problem]:
    kind: str = item["type"]
    loc: tuple[int | str, ...] = tuple(item["loc"])
    ctx = item.get("ctx") or {}
    nested = ctx.get("error")
    if kind == "value_error" and isinstance(nested, errors.LayoutError):
        # A nested spec validated through its own __init__ already classified its problems.
        prefix = _field_path(loc, None)
        return [
            (cls, f"{prefix}{'' if sub.startswith('[') else '.'}{sub}", msg)
            for cls, sub, msg in getattr(nested, "problems", [(type(nested), "", str(nested))])
        ]
    return [_classify_one(model, item, kind, loc, ctx)]


def _classify_one(
    model: type[BaseModel],
    item: dict[str, Any],
    kind: str,
    loc: tuple[int | str, ...],
    ctx: dict[str, Any],
) -> Problem:
    field = _field_path(loc, ctx.get("field") if isinstance(ctx.get("field"), str) else None)
    message: str = item["msg"]
    if kind in _CUSTOM_TYPES:
        return _CUSTOM_TYPES[kind], field, message
    last = loc[-1] if loc else ""
    if kind == "extra_forbidden":
        known = ", ".join(_known_fields(model, loc))
        return (
            errors.UnknownOptionError,
            field,
            f"unknown field '{last}'; fix: remove it or use one of: {known}",
        )
    if kind == "literal_error" and last == "backend":
        return (
            errors.UnknownBackendError,
            field,
            f"unknown backend {item.get('input')!r}; fix: use one of device, nccl, rccl, hccl, "
            "gloo, fake",
        )
    if kind == "missing":
        return errors.LayoutError, field, f"field '{last}' is required; fix: add it"
    in_dims = bool(loc) and loc[0] == "dims"
    if in_dims and len(loc) >= 2:
        return (
            errors.InvalidSizeError,
            field,
            f"dim size must be a whole number >= 1, got {item.get('input')!r}; "
            "fix: write the size as an integer such as 4",
        )
    if kind.startswith("greater_than") or kind.startswith("less_than"):
        return errors.UnknownOptionError if "options" in field else errors.LayoutError, field, (
            f"{message}, got {item.get('input')!r}; fix: choose a value in range"
        )
    if kind == "string_pattern_mismatch":
        return (
            errors.InvalidNameError,
            field,
            f"name {item.get('input')!r} is not allowed; fix: start with a letter and use "
            "letters, digits, '_' or '-'",
        )
    if "options" in field:
        return errors.UnknownOptionError, field, f"{message}; fix: give a value of that type"
    return errors.LayoutError, field, f"{message}; fix: give a value of that type"


def layout_error_from(error: ValidationError, model: type[BaseModel]) -> errors.LayoutError:
    """The LayoutError for ``error``: the first problem's class, every problem in the message."""
    problems = [p for item in error.errors() for p in _classify(model, dict(item))]
    cls, field, _ = problems[0]
    lines = [f"{f}: {m}" for _, f, m in problems]
    heading = f"invalid {model.__name__}: " if len(lines) == 1 else f"invalid {model.__name__}:\n  "
    result = cls(heading + "\n  ".join(lines), field=field)
    result.problems = problems
    return result
