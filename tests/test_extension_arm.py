"""A new arm is one entry in trainer/methods.py: a fake arm put into the table (as a user would add a line there) is
chosen by name, shown by `emapg config show --method`, and trains: two iterations of the real trainer run with its
keys on a tiny random Llama."""

from __future__ import annotations

import json

import pytest
from test_training import make_trainer, peaked_model, tiny_config  # noqa: F401 (peaked_model: a fixture)
from typer.testing import CliRunner

from trainer.methods import METHODS, Method, chosen_methods

FAKE = Method("FAKE-k2-anchor", {"kl.estimator": "k2", "ema.tau": 0.5}, about="a fake arm: EMA anchor, k2 KL")


@pytest.fixture
def fake_arm(monkeypatch):
    monkeypatch.setitem(METHODS, FAKE.name, FAKE)
    return FAKE


def test_a_fake_arm_is_chosen_by_name_shown_and_trained(fake_arm, tmp_path, peaked_model, tokenizer):
    from emapg.cli import app

    assert [m.name for m in chosen_methods("fake-k2-anchor")] == [FAKE.name]  # any case, as --method takes it
    shown = CliRunner().invoke(app, ["config", "show", "--method", FAKE.name])
    assert shown.exit_code == 0, shown.output
    assert "estimator: k2" in shown.output and "tau: 0.5" in shown.output

    cfg = fake_arm.config(tiny_config(tmp_path, "train.iterations=2"), run_name="fake-arm")
    assert (cfg.kl.estimator, cfg.ema.tau, cfg.name) == ("k2", 0.5, "fake-arm")
    history = make_trainer(cfg, peaked_model, tokenizer).run()
    assert len(history) == 2 and all(row["kl/anchor"] >= 0 for row in history)
    logged = [json.loads(line) for line in (cfg.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["iteration"] for row in logged] == [1, 2]
