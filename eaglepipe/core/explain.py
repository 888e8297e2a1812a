"""Pydantic's validation errors of a params file, told in params terms: one line per problem, naming the key
(``infer.gates.max_empty``, ``prepare.sources[1].format``), the value and what is allowed, with the closest known key
for an unknown one; of a union's alternatives only the one the value's shape was meant for."""

from __future__ import annotations

import difflib

from pydantic import BaseModel, ValidationError


def _model_at(root, loc: tuple):
    """The section model of the key at ``loc`` under ``root`` (for suggestions)."""
    model = root
    for part in loc[:-1]:
        if isinstance(part, int) or model is None:
            continue
        field = model.model_fields.get(part)
        if field is None:
            return None
        args = getattr(field.annotation, "__args__", ())  # a union's or a container's: one level, then two
        found = [
            a
            for a in (field.annotation, *args, *(b for a in args for b in getattr(a, "__args__", ())))
            if isinstance(a, type) and issubclass(a, BaseModel)
        ]
        if not found:
            return None
        model = found[0]
    return model


def _loc(err: dict) -> tuple:
    """The error's location in params terms, without pydantic's union-branch tags."""
    tags = ("list[", "tuple[", "literal[", "function-", "union[")
    return tuple(
        p
        for p in err["loc"]
        if not (isinstance(p, str) and (p.startswith(tags) or p in ("Markers", "Launch", "str", "int")))
    )


def _describe(err: dict, root) -> str:
    loc = _loc(err)
    key = ".".join(f"[{p}]" if isinstance(p, int) else str(p) for p in loc).replace(".[", "[")
    if err["type"] == "extra_forbidden":
        model = _model_at(root, loc)
        known = list(model.model_fields) if model else []
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f" (did you mean {close[0]}?)" if close else f" (known keys: {', '.join(known)})" if known else ""
        return f"unknown key {key}{hint}"
    if err["type"] == "missing":
        return f"{key} is missing"
    if err["type"] == "value_error":
        return f"{key or 'params'}: {err['ctx']['error']}"
    value = err.get("input")
    return f"{key} = {value!r}: {err['msg'][0].lower()}{err['msg'][1:]}" if key else err["msg"]


def _relevant(err: dict) -> bool:
    """Of a union's alternatives, the error of the one the value's shape was meant for (a string for a name, a
    mapping or a list for the other)."""
    structured = isinstance(err.get("input"), (dict, list))
    if err["type"] == "literal_error":
        return not structured
    if err["type"] in ("model_type", "dict_type", "list_type", "tuple_type"):
        return structured
    return True


def problems(e: ValidationError, root) -> list[str]:
    """The lines of ``e``, raised validating the model ``root``, in pydantic's order, each once."""
    lines, errors = [], e.errors()
    kept = [err for err in errors if _relevant(err)]
    # an error of a union's other alternative is kept only when no kept one is about its key
    kept += [
        err for err in errors if not _relevant(err) and not any(_loc(k)[: len(_loc(err))] == _loc(err) for k in kept)
    ]
    for err in sorted(kept, key=errors.index):
        line = _describe(err, root)
        if line not in lines:  # a union reports one error per alternative
            lines.append(line)
    return lines
