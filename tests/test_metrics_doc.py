"""docs/metrics.md lists every logged metric once: a tiny RL run and a tiny SFT run log no key it does not document,
and every key it marks "always" is logged."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

from test_learner import ragged_trajectories
from test_training import make_trainer, tiny_config

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def documented() -> dict[str, dict[str, str]]:
    """Section title -> {key: when it is logged}, from the tables' rows."""
    sections: dict[str, dict[str, str]] = {}
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            section = sections.setdefault(line[3:].split(" (")[0], {})
        elif row := re.match(r"\| `([^`]+)` \| ([^|]+) \|", line):
            key, when = row.groups()
            assert key not in section, f"{key} is documented twice in one section"
            section[key] = when.strip()
    return sections


def logged_keys(metrics_jsonl: Path) -> set[str]:
    return {key for line in metrics_jsonl.read_text().splitlines() for key in json.loads(line)}


def check(section: dict[str, str], logged: set[str]) -> None:
    assert not logged - set(section), f"logged but not documented in docs/metrics.md: {sorted(logged - set(section))}"
    always = {key for key, when in section.items() if when == "always"}
    assert not always - logged, f"documented as always logged, but not logged: {sorted(always - logged)}"


def test_every_key_an_rl_run_logs_is_documented(tmp_path, tiny_model, tokenizer):
    cfg = tiny_config(tmp_path, "train.iterations=1")
    make_trainer(cfg, tiny_model, tokenizer).run()
    check(documented()["RL iteration"], logged_keys(cfg.run_dir / "metrics.jsonl"))


def test_every_key_an_sft_run_logs_is_documented(tmp_path, tiny_model, tokenizer):
    from trainer.sft import SFTTrainer

    cfg = tiny_config(tmp_path, "sft.batch_size=6", "sft.micro_batch_size=3")
    SFTTrainer(cfg, copy.deepcopy(tiny_model), ragged_trajectories(len(tokenizer)), tokenizer.pad_token_id).run()
    check(documented()["SFT step"], logged_keys(cfg.sft_dir / "metrics.jsonl"))
