"""`emapg`'s commands over what runs leave: one trajectory as the model saw it, a checkpoint exported as a Hugging
Face model, and the web page over run folders."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from emapg.cli_common import app, console, fail


@app.command()
def show(
    path: Annotated[Path, typer.Argument(help="trajectories JSONL (from eval or training)")],
    index: Annotated[int, typer.Option(min=0, help="which trajectory (0-based)")] = 0,
    model: Annotated[str, typer.Option(help="whose tokenizer decodes the ids")] = "smollm2-135m-instruct",
) -> None:
    """Print one trajectory as the model saw it; masked spans (observations, invalid-action messages) dimmed."""
    import itertools

    from rich.text import Text

    from agent.policy import load_tokenizer
    from agent.trajectory import MASK_CLOSE, MASK_OPEN, load_jsonl

    if not path.is_file():
        fail(f"{path} does not exist")
    traj = next(itertools.islice(load_jsonl(path), index, None), None)
    if traj is None:
        fail(f"{path} has no trajectory {index}")
    text = Text()
    for i, part in enumerate(traj.render(load_tokenizer(model)).replace(MASK_CLOSE, MASK_OPEN).split(MASK_OPEN)):
        text.append(part, style="dim cyan" if i % 2 else "")
    console.print(text)
    console.rule(f"{traj.uid}: answer {traj.answer!r}, gold {traj.golden_answers}, {len(traj.turns)} turns, "
                 f"{traj.num_searches} searches, {traj.model_tokens} model / {traj.observation_tokens} masked tokens")



@app.command()
def export(
    source: Annotated[Path, typer.Argument(help="a run folder (its latest checkpoint) or a checkpoint folder")],
    out: Annotated[Path, typer.Option(help="the Hugging Face model folder to write")],
    anchor: Annotated[bool, typer.Option("--anchor", help="the run's EMA anchor (its KL reference) instead of its "
                                         "policy")] = False,
    base: Annotated[Path | None, typer.Option(help="LoRA runs: the full-weight checkpoint or run folder the run "
                                              "started from (its `train --init`), when it is neither the run's "
                                              "model nor found beside the run")] = None,
    overwrite: Annotated[bool, typer.Option(help="replace an existing non-empty --out")] = False,
) -> None:
    """Write a checkpoint's policy (or EMA anchor) as a plain Hugging Face model folder (safetensors, config,
    tokenizer, generation config, a model card with the run's method, config and held-out EM) that transformers,
    vLLM and the Hub load as it is; LoRA adapters are merged into the base weights."""
    from emapg.export import CheckpointError, ExportError
    from emapg.export import export as export_model

    try:
        exported = export_model(source, out, anchor=anchor, base=base, overwrite=overwrite)
    except (CheckpointError, ExportError) as e:
        fail(str(e))
    held_out = f"held-out EM from {exported.evaluation}" if exported.evaluation else "held-out EM: not evaluated"
    console.print(f"wrote the {exported.which} of {exported.checkpoint} (iteration {exported.iteration}) to "
                  f"{exported.folder}" + (f", LoRA merged on {exported.lora_base}" if exported.lora_base else "")
                  + f"; {held_out}")


@app.command()
def view(
    run_dirs: Annotated[list[Path], typer.Argument(help="run folders (a demo's, a comparison's, an evaluation's)")],
    host: Annotated[str, typer.Option(help="bind address; the page serves the runs' files to whoever reaches it")] = (
        "127.0.0.1"),
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8050,
    tokenizer: Annotated[str | None, typer.Option(help="decodes the trajectories' token ids; default: each run's "
                                                  "model (its config), else the packaged SmolLM2")] = None,
) -> None:
    """A local web page over run folders: training curves, every rollout and evaluation trajectory turn by turn
    (queries, returned documents, answers), filters, and two runs side by side on the same questions."""
    from emapg.view import serve

    missing = [str(d) for d in run_dirs if not d.is_dir()]
    if missing:
        fail(f"not a run folder: {', '.join(missing)}")
    if host not in ("127.0.0.1", "localhost", "::1"):
        console.print(f"[yellow]warning:[/] {host}: whoever reaches the port can read these runs' trajectories")
    console.print(f"emapg view: http://{host}:{port}/ over {', '.join(map(str, run_dirs))} (Ctrl-C stops it)")
    serve(run_dirs, host=host, port=port, tokenizer_name=tokenizer)
