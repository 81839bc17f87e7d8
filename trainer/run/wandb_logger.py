"""Weights & Biases for a run folder (`logging.wandb`): the per-iteration metrics with the run's config, and the
evaluation reports as an artifact. Optional: with mode "disabled" (the default) wandb is never imported.

One folder is one W&B run: its id is kept in <folder>/wandb_id.txt, so a resumed run (or the report attached after
training) continues the same W&B run instead of starting another. Metrics are logged against their own
`iteration` key, not W&B's step counter: a resumed run logs the iterations after its checkpoint again, which W&B's
monotonic step would drop.
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path

from trainer.config import TrainConfig, WandbSection

ID_FILE = "wandb_id.txt"


def run_id(run_dir: Path) -> str:
    """The W&B run id of this folder, made on first use (W&B ids: lowercase letters and digits)."""
    path = run_dir / ID_FILE
    if not path.exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_hex(6))
    return path.read_text().strip()


def run_name(cfg: TrainConfig, run_dir: Path) -> str:
    """The folder under out_dir: "demo", "demo/sft", "compare/grpo"."""
    return run_dir.relative_to(cfg.out_dir).as_posix() if run_dir.is_relative_to(cfg.out_dir) else run_dir.name


def start_run(run_dir: Path, section: WandbSection, name: str, config: dict, job_type: str):
    """A W&B run writing under run_dir/wandb/ with `config` attached, or None when W&B is disabled. Grouped by the
    first part of `name` (a demo's SFT and RL runs together)."""
    if section.mode == "disabled":
        return None
    try:
        import wandb
    except ImportError as e:
        raise RuntimeError(f"W&B mode {section.mode} needs wandb: pip install 'emapg[wandb]' (or mode disabled)") from e

    run = wandb.init(project=section.project, entity=section.entity, mode=section.mode, tags=section.tags,
                     dir=str(run_dir), id=run_id(run_dir), resume="allow", name=name, group=name.split("/")[0],
                     job_type=job_type, config=config)
    run.define_metric("iteration")
    run.define_metric("*", step_metric="iteration")
    return run


def attach_reports(run_dir: Path, section: WandbSection, name: str, config: dict, files: list[Path],
                   summary: dict[str, float] | None = None, job_type: str = "report") -> None:
    """Log `files` (reports, plots, under run_dir: their paths there are kept; missing ones skipped) as one "report"
    artifact of run_dir's W&B run, and `summary` into the run's summary."""
    run = start_run(run_dir, section, name, config, job_type)
    if run is None:
        return
    import wandb

    artifact = wandb.Artifact(re.sub(r"[^\w.-]", "_", f"{name}-report"), type="report")
    for path in files:
        if path.exists():
            artifact.add_file(str(path), name=path.relative_to(run_dir).as_posix())
    run.log_artifact(artifact)
    run.summary.update(summary or {})
    run.finish()


def attach_run_reports(cfg: TrainConfig, files: list[Path]) -> None:
    """`attach_reports` for a training run's folder (demo, compare), with the run's config."""
    attach_reports(cfg.run_dir, cfg.logging.wandb, cfg.name, cfg.model_dump(mode="json"), files)
