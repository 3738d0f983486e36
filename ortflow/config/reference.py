"""The generated field reference (docs/config.md)."""

from __future__ import annotations

import json
import re

from pydantic import BaseModel

from ortflow.config.run import RunConfig

# ---------------------------------------------------------------------------------------------------------------------
# Reference documentation


def reference_markdown() -> str:
    """A markdown table of every config field with its type, default and description (docs/config.md)."""

    def rows(model: type[BaseModel], prefix: str) -> list[str]:
        out = []
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                out.extend(rows(annotation, f"{prefix}{name}."))
                continue
            kind = str(annotation).replace("typing.", "").replace("pathlib.", "").replace("<class '", "")
            kind = re.sub(r"ortflow\.config\.(\w+\.)?", "", kind.replace("'>", "")).replace("|", "\\|")
            default = "*required*" if field.is_required() else f"`{json.dumps(field.default, default=str)}`"
            out.append(f"| `{prefix}{name}` | {kind} | {default} | {field.description} |")
            item = (getattr(annotation, "__args__", None) or (None,))[0]
            if isinstance(item, type) and issubclass(item, BaseModel):  # a list of sections: each entry's fields
                out.extend(rows(item, f"{prefix}{name}[]."))
        return out

    header = ["| field | type | default | meaning |", "|---|---|---|---|"]
    return "\n".join(header + rows(RunConfig, ""))
