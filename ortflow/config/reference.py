"""The generated field reference (docs/config.md)."""

from __future__ import annotations

import json
import re
import types
import typing

from pydantic import BaseModel

from ortflow.config.run import RunConfig

# ---------------------------------------------------------------------------------------------------------------------
# Reference documentation


def type_name(annotation) -> str:
    """A field's type as the table shows it: unions as ``a | b``, literals as their quoted values, ``int > 0`` for a
    bounded int."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin is typing.Annotated:
        marks = [m for a in args[1:] for m in (getattr(a, "metadata", None) or [a])]  # Field(gt=0) or Gt(0)
        bounds = [f"{op} {getattr(m, attr)}" for m in marks for attr, op in
                  (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")) if getattr(m, attr, None) is not None]
        return " ".join([type_name(args[0]), *bounds]) if bounds else type_name(args[0])
    if annotation is type(None):
        return "None"
    kind = str(annotation).replace("typing.", "").replace("pathlib.", "").replace("<class '", "")
    return re.sub(r"ortflow\.config\.(\w+\.)?", "", kind.replace("'>", ""))


def reference_markdown() -> str:
    """A markdown table of every config field with its type, default and description (docs/config.md)."""

    def rows(model: type[BaseModel], prefix: str) -> list[str]:
        out = []
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                out.extend(rows(annotation, f"{prefix}{name}."))
                continue
            kind = type_name(annotation).replace("|", "\\|")
            default = "*required*" if field.is_required() else f"`{json.dumps(field.default, default=str)}`"
            out.append(f"| `{prefix}{name}` | {kind} | {default} | {field.description} |")
            item = (getattr(annotation, "__args__", None) or (None,))[0]
            if isinstance(item, type) and issubclass(item, BaseModel):  # a list of sections: each entry's fields
                out.extend(rows(item, f"{prefix}{name}[]."))
        return out

    header = ["| field | type | default | meaning |", "|---|---|---|---|"]
    return "\n".join(header + rows(RunConfig, ""))
