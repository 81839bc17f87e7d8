"""docs/metrics.md lists every logged metric once: a tiny RL run and a tiny SFT run log no key it does not document,
and every key it marks "always" is logged. Keys are namespaced, merged without silent overwrites, and older runs'
flat names are read under the new ones (trainer/run/metrics_log.py)."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
from test_learner import ragged_trajectories
from test_training import make_trainer, tiny_config

from trainer.run.metrics_log import (
    FLAT_NAMES,
    NAMESPACES,
    current_history,
    merge_metrics,
    namespaced,
    read_metrics,
)

DOC = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def rows() -> dict[str, dict[str, tuple[str, str]]]:
    """Section title -> {key: (when it is logged, meaning)}, from the tables' rows."""
    sections: dict[str, dict[str, tuple[str, str]]] = {}
    for line in DOC.read_text().splitlines():
        if line.startswith("## "):
            section = sections.setdefault(line[3:].split(" (")[0], {})
        elif row := re.match(r"\| `([^`]+)` \| ([^|]+) \| (.*) \|$", line):
            key, when, meaning = row.groups()
            assert key not in section, f"{key} is documented twice in one section"
            section[key] = (when.strip(), meaning)
    return sections


def documented() -> dict[str, dict[str, str]]:
    """Section title -> {key: when it is logged}."""
    return {title: {key: when for key, (when, _) in keys.items()} for title, keys in rows().items()}


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
    from trainer.run.sft import SFTTrainer

    cfg = tiny_config(tmp_path, "sft.batch_size=6", "sft.micro_batch_size=3")
    SFTTrainer(cfg, copy.deepcopy(tiny_model), ragged_trajectories(len(tokenizer)), tokenizer.pad_token_id).run()
    check(documented()["SFT step"], logged_keys(cfg.sft_dir / "metrics.jsonl"))


def test_every_documented_key_is_namespaced_and_says_what_it_was():
    was = {}
    for section in rows().values():
        for key, (_, meaning) in section.items():
            if key == "iteration":
                continue
            assert key.split("/")[0] in NAMESPACES and key.count("/") == 1, key
            if old := re.search(r"\(was `([^`]+)`\)", meaning):
                was[old.group(1)] = key
    assert was == FLAT_NAMES  # the docs' "was" notes and the reader's mapping are the same, both ways


def test_merge_metrics_refuses_a_key_two_sources_produce():
    assert merge_metrics({"rollout/reward": 0.5}, {"loss/policy": 0.1}, {}) == {"rollout/reward": 0.5,
                                                                                "loss/policy": 0.1}
    with pytest.raises(ValueError, match=r"\['time/rollout_s'\] come from two sources"):
        merge_metrics({"time/rollout_s": 1.0, "rollout/em": 0.0}, {"time/rollout_s": 2.0})


def test_namespaced_places_flat_names_and_keeps_namespaced_ones():
    stats = {"policy_loss": 0.1, "kl": 0.01, "time_update_s": 2.0, "grad/kl_norm": 0.003}
    assert namespaced(stats) == {"loss/policy": 0.1, "kl/anchor": 0.01, "time/update_s": 2.0,
                                 "grad/kl_norm": 0.003}
    with pytest.raises(KeyError, match="'kl_norm' has no namespace"):
        namespaced({"kl_norm": 0.003})
    with pytest.raises(KeyError, match="'learner/x' has no namespace"):
        namespaced({"learner/x": 1.0})
    with pytest.raises(ValueError, match="two sources"):  # a flat name and its namespaced one
        namespaced({"kl": 0.01, "kl/anchor": 0.02})


def test_read_metrics_reads_an_older_flat_log_under_the_new_names(tmp_path):
    path = tmp_path / "metrics.jsonl"
    # A run from before the namespaces, resumed after: its file holds both kinds of row.
    path.write_text(json.dumps({"iteration": 1, "reward": 0.25, "kl": 0.01, "time_rollout_s": 60.0}) + "\n\n"
                    + json.dumps({"iteration": 2, "rollout/reward": 0.5, "kl/grad_share": 0.002}) + "\n")
    assert read_metrics(path) == [{"iteration": 1, "rollout/reward": 0.25, "kl/anchor": 0.01, "time/rollout_s": 60.0},
                                  {"iteration": 2, "rollout/reward": 0.5, "kl/grad_share": 0.002}]
    assert read_metrics(tmp_path / "missing.jsonl") == []


def test_current_history_is_the_runs_last_attempt_from_each_checkpoint_it_resumed():
    """Rows as a run logs them across attempts, each tagged with its attempt: a reached iteration 6 and was killed;
    b resumed from the checkpoint at 4 and logged 5; c, a guard's rollback to the checkpoint at 2, logged 3-4; d went
    on to 5. The history is the attempt that went on from each point; no row of an abandoned attempt stays (keeping
    each iteration's last row would keep a's 6)."""
    def rows(attempt, iterations):
        return [{"iteration": i, "attempt": attempt} for i in iterations]

    assert current_history(rows("a", [1, 2, 3])) == rows("a", [1, 2, 3])
    logged = rows("a", [1, 2, 3, 4, 5, 6]) + rows("b", [5]) + rows("c", [3, 4]) + rows("d", [5])
    assert current_history(logged) == rows("a", [1, 2]) + rows("c", [3, 4]) + rows("d", [5])
    # Started over from nothing (no checkpoint yet) in the same folder: only the new attempt.
    assert current_history(rows("a", [1, 2]) + rows("b", [1, 2, 3])) == rows("b", [1, 2, 3])
    assert current_history([]) == []
