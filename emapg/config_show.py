"""`emapg config show`: a resolved training config as YAML, each field under a comment with its help (the field's
description) and its default, the fields that differ from their defaults marked. The output loads back as a config
file: `emapg config show --config a.yaml kl.beta=0.01 > b.yaml` writes a config with every field spelled out."""

from __future__ import annotations

import textwrap

import yaml
from pydantic import BaseModel

WIDTH = 118


def scalar(value) -> str:
    """`value` (JSON-mode) as one line of YAML flow style."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).removesuffix("...\n").strip()


def commented_yaml(settings: BaseModel, depth: int = 0) -> str:
    pad = "  " * depth
    lines = []
    values, defaults = settings.model_dump(mode="json"), type(settings)().model_dump(mode="json")
    for name, field in type(settings).model_fields.items():
        value = getattr(settings, name)
        if isinstance(value, BaseModel):
            lines += textwrap.wrap(field.description or "", WIDTH - len(pad), initial_indent=f"{pad}# ",
                                   subsequent_indent=f"{pad}# ")
            lines += [f"{pad}{name}:", commented_yaml(value, depth + 1)]
            continue
        help_text = f"{field.description or ''} (default: {scalar(defaults[name])})"
        lines += textwrap.wrap(help_text, WIDTH - len(pad), initial_indent=f"{pad}# ", subsequent_indent=f"{pad}# ")
        changed = "  # changed" if values[name] != defaults[name] else ""
        lines.append(f"{pad}{name}: {scalar(values[name])}{changed}")
    return "\n".join(lines)
