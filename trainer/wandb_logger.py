"""Weights & Biases for a run folder (`logging.wandb`): the per-iteration metrics with the run's config, and the
evaluation reports as an artifact. Optional: with mode "disabled" (the default) wandb is never imported.

One run folder is one W&B run: its id is kept in <run>/wandb_id.txt, so a resumed run (or the report attached after
training) continues the same W&B run instead of starting another. Metrics are logged against their own
`iteration` key, not W&B's step counter: a resumed run logs the iterations after its checkpoint again, which W&B's
monotonic step would drop.
"""

from __future__ import annotations

import re
import secrets
from pathlib import Path

from trainer.config import TrainConfig

ID_FILE = "wandb_id.txt"


def run_id(run_dir: Path) -> str:
    """The W&B run id of this run folder, made on first use (W&B ids: lowercase letters and digits)."""
    path = run_dir / ID_FILE
    if not path.exists():
        run_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_hex(6))
    return path.read_text().strip()


def start_run(run_dir: Path, cfg: TrainConfig, job_type: str):
    """A W&B run writing under run_dir/wandb/ with the run's config, or None when W&B is disabled. Named after the run
    folder under out_dir ("demo", "demo/sft", "compare/grpo"), grouped by its first part."""
    section = cfg.logging.wandb
    if section.mode == "disabled":
        return None
    try:
        import wandb
    except ImportError as e:
        raise RuntimeError(f"logging.wandb.mode={section.mode} needs wandb: pip install 'emapg[wandb]' "
                           "(or logging.wandb.mode=disabled)") from e

    name = run_dir.relative_to(cfg.out_dir).as_posix() if run_dir.is_relative_to(cfg.out_dir) else run_dir.name
    run = wandb.init(project=section.project, entity=section.entity, mode=section.mode, tags=section.tags,
                     dir=str(run_dir), id=run_id(run_dir), resume="allow", name=name, group=name.split("/")[0],
                     job_type=job_type, config=cfg.model_dump(mode="json"))
    run.define_metric("iteration")
    run.define_metric("*", step_metric="iteration")
    return run


def attach_reports(cfg: TrainConfig, files: list[Path]) -> None:
    """Log `files` (reports, plots, under the run folder: their paths there are kept) as one "report" artifact of
    the run folder's W&B run."""
    run_dir = cfg.run_dir
    run = start_run(run_dir, cfg, job_type="report")
    if run is None:
        return
    import wandb

    artifact = wandb.Artifact(re.sub(r"[^\w.-]", "_", f"{run_dir.name}-report"), type="report")
    for path in files:
        if path.exists():
            artifact.add_file(str(path), name=str(path.relative_to(run_dir)))
    run.log_artifact(artifact)
    run.finish()
