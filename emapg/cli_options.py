"""CLI options made from a typed settings model's fields: the flag, its type, its help and its default all come from
the model (Field(description=...)), so a command never restates them; the command receives the validated model.

    @app.command()
    @model_options("rollout", RolloutSettings, "max_turns", "max_in_flight")
    def eval_command(..., rollout: RolloutSettings) -> None: ...

gives `--max-turns` and `--max-in-flight`, each with its field's description and default; the options left unset take
the model's own defaults, and a refused value fails naming its flag (`--max-turns: ...`) with pydantic's reason.
"""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Union, get_args, get_origin

import typer
from pydantic import BaseModel, ValidationError

from emapg.cli_common import fail

SIMPLE = (int, float, str, bool, Path)


def flag(name: str, prefix: str = "") -> str:
    return f"--{prefix}{name.replace('_', '-')}"


def option_type(annotation: Any) -> Any:
    """The field's type as an optional CLI type: X | None for the types typer parses, lists of them as repeated
    options; anything else (a Literal included) is taken as text, for pydantic to refuse naming the flag."""
    union = get_origin(annotation) in (Union, types.UnionType)
    args = [a for a in get_args(annotation) if a is not type(None)] if union else [annotation]
    if len(args) == 1:
        inner = args[0]
        if inner in SIMPLE or (get_origin(inner) is list and get_args(inner)[0] in SIMPLE):
            return inner | None
    return str | None


def shown_default(field) -> str | bool:
    """The model's default as the help shows it (a default factory's value on this machine); none for None."""
    default = field.get_default(call_default_factory=True, validated_data={})
    return False if default is None else str(default)


def model_options(into: str, model: type[BaseModel], *names: str, prefix: str = "",
                  flags: dict[str, str] | None = None) -> Callable:
    """Decorate a typer command: one option per field in `names` (flag --<prefix><field>, or flags[field]), and the
    command's `into` parameter receives `model` validated from them. Stack several for several models."""
    flags = flags or {}

    def decorate(command: Callable) -> Callable:
        signature = inspect.signature(command, eval_str=True)
        generated = {}
        for name in names:
            field = model.model_fields[name]
            if not field.description:
                raise TypeError(f"{model.__name__}.{name} has no description to be an option's help")
            option = typer.Option(flags.get(name, flag(name, prefix)), help=field.description,
                                  show_default=shown_default(field))
            generated[f"{into}__{name}"] = (name, Annotated[option_type(field.annotation), option])

        @functools.wraps(command)
        def wrapper(**kwargs):
            values = {field: kwargs.pop(param) for param, (field, _) in generated.items()}
            try:
                kwargs[into] = model(**{k: v for k, v in values.items() if v is not None})
            except ValidationError as e:
                error = e.errors()[0]
                name = str(error["loc"][0]) if error["loc"] else names[0]
                fail(f"{flags.get(name, flag(name, prefix))}: {error['msg']}")
            return command(**kwargs)

        kept = [p for p in signature.parameters.values() if p.name != into]
        added = [inspect.Parameter(param, inspect.Parameter.KEYWORD_ONLY, default=None, annotation=annotation)
                 for param, (_, annotation) in generated.items()]
        wrapper.__signature__ = signature.replace(parameters=sorted(kept + added, key=lambda p: p.kind))
        wrapper.__annotations__ = {p.name: p.annotation for p in kept + added}
        del wrapper.__wrapped__  # typer must read the signature above, not the command's own
        return wrapper

    return decorate
