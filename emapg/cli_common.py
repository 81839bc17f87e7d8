"""What every `emapg` command module shares: the Typer app, the consoles, the error exit, the packaged defaults and
the options several commands take alike."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, NoReturn

import typer
from rich.console import Console

from emapg.workflow import ARTIFACTS

app = typer.Typer(help="EMA-PG search agents: retrieval service, rollouts, training, evaluation.", no_args_is_help=True)
console = Console()
stderr = Console(stderr=True)  # for `emapg mcp`, whose stdout may be the MCP stdio channel

PACKAGED_CORPUS = ARTIFACTS / "corpus" / "wiki-summaries.jsonl"
DEFAULT_INDEX = ARTIFACTS / "indexes" / "wiki-minilm-flat"

ConfigFile = Annotated[Path | None, typer.Option("--config", help="YAML config (configs/cpu_demo.yaml, ...); "
                                                 "`emapg config show` prints every field")]
MethodName = Annotated[str | None, typer.Option("--method", help="an arm of trainer/methods.py (GRPO, EMA-k3, "
                                                "EMA-PG, GRPO-k3c, ...): its config keys over the config's")]
OVERRIDES = {"allow_extra_args": True, "ignore_unknown_options": True}  # key=value overrides after the options


def fail(message: str, to: Console = console) -> NoReturn:
    """The CLI's error exit: the message (naming the bad option or path), no traceback, status 2."""
    to.print(f"[bold red]error:[/] {message}")
    raise typer.Exit(2)
