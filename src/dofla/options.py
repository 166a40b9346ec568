"""Typed options of feature maps, losses and data sources, read from their signatures.

``feature_map.options``, ``loss.options`` and ``data.options`` are passed as keyword arguments to the
registered class or function; its signature (minus the arguments the pipeline passes itself) is the
declaration, so a new option needs no second list. ``option_problem`` finds an unknown or ill-typed
option before any model loads.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Mapping

from dofla.registry import did_you_mean

# Arguments the pipeline passes itself, so they are not user options.
FEATURE_MAP_PASSED = ("num_heads", "head_dim", "num_features", "seed")
LOSS_PASSED = ("log_q", "log_k", "q", "k", "v", "causal", "window", "sinks", "softcap", "student", "input_ids")
DATA_PASSED = ()

_TYPE_NAMES = {"int": int, "float": float, "str": str, "bool": bool, "list": list, "List": list,
               "Sequence": list, "tuple": list, "Tuple": list, "Path": str, "None": type(None),
               "NoneType": type(None)}


@dataclass(frozen=True)
class Option:
    """One declared option: its default, the value types it accepts and, for a list, the types of
    its items (empty: any)."""

    name: str
    default: Any
    types: tuple[type, ...]
    item_types: tuple[type, ...] = ()


def _annotation_parts(annotation) -> list[tuple[str, str]]:
    """(base name, bracketed argument) per union member: ``"list[str] | str"`` -> [("list", "str"), ("str", "")]."""
    if annotation is inspect.Parameter.empty:
        return []
    text = annotation if isinstance(annotation, str) else (
        annotation.__name__ if isinstance(annotation, type) else str(annotation))
    text = text.replace("typing.", "")
    if text.startswith("Optional[") and text.endswith("]"):
        text = text[len("Optional["):-1] + " | None"
    parts = []
    for part in text.split("|"):
        base, _, argument = part.strip().partition("[")
        parts.append((base, argument[:-1]))
    return parts


def _annotation_types(annotation) -> tuple[type, ...]:
    """Types named by an annotation such as ``int``, ``"list[str] | str"`` or ``Optional[float]``."""
    parts = _annotation_parts(annotation)
    if any(base not in _TYPE_NAMES for base, _ in parts):
        return ()  # an annotation this check cannot read accepts anything
    return tuple(dict.fromkeys(_TYPE_NAMES[base] for base, _ in parts))


def _item_types(annotation) -> tuple[type, ...]:
    """The item types of the list in an annotation (``list[str]`` -> (str,)); empty when unstated."""
    for base, argument in _annotation_parts(annotation):
        if _TYPE_NAMES.get(base) is list and argument and "," not in argument:
            return _annotation_types(argument)
    return ()


def declared_options(obj, passed: tuple[str, ...]) -> dict[str, Option] | None:
    """Keyword options of a class's constructor or a function; None when it takes ``**kwargs``."""
    params = inspect.signature(obj).parameters.values()
    options = {}
    for p in params:
        if p.kind is p.VAR_KEYWORD:
            return None
        if p.kind is p.VAR_POSITIONAL or p.name in passed or p.name == "self":
            continue
        types = _annotation_types(p.annotation)
        if not types and p.default not in (inspect.Parameter.empty, None):
            types = _annotation_types(type(p.default).__name__)
        if p.default is None and types and type(None) not in types:
            types = (*types, type(None))
        options[p.name] = Option(p.name, p.default, types, _item_types(p.annotation) if types else ())
    return options


def _type_ok(value, types: tuple[type, ...]) -> bool:
    if not types:
        return True
    if isinstance(value, bool):  # bool is an int in Python, not in a config
        return bool in types
    if isinstance(value, int) and float in types:
        return True
    if isinstance(value, (list, tuple)):
        return list in types
    return any(t not in (bool, list) and isinstance(value, t) for t in types)


def _type_names(types: tuple[type, ...]) -> str:
    return " or ".join("null" if t is type(None) else t.__name__ for t in types)


def option_problem(key: str, owner: str, declared: dict[str, Option] | None, given: Mapping) -> str | None:
    """One sentence about the first unknown or ill-typed entry of ``given`` (the options at ``key``,
    e.g. ``feature_map.options``, of ``owner``, e.g. "feature map 'performer'"), or None when all fit."""
    if declared is None:
        return None
    for name, value in given.items():
        if name not in declared:
            valid = ", ".join(declared) or "none"
            return f"{key}.{name} is not an option of {owner}{did_you_mean(name, declared)}; valid options: {valid}"
        option = declared[name]
        if not _type_ok(value, option.types):
            return (f"{key}.{name}={value!r} must be {_type_names(option.types)} "
                    f"(got {type(value).__name__}); fix the value in {key}")
        bad = [v for v in value if not _type_ok(v, option.item_types)] if isinstance(value, (list, tuple)) else []
        if bad:
            return (f"{key}.{name} holds {bad[0]!r} ({type(bad[0]).__name__}) but its items must be "
                    f"{_type_names(option.item_types)}; fix the list in {key}")
    return None
