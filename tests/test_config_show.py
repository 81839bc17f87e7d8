"""Config fields carry their help: every field of the training config has a description, `emapg config show` prints
the resolved config with each field's value, default and help, the CLI's options are made from those fields, and
`--method` applies an arm of trainer/methods.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel, Field
from typer.testing import CliRunner

from agent.settings import RolloutSettings
from emapg.cli import app
from trainer.config import TrainConfig, load_config
from trainer.methods import METHODS

ROOT = Path(__file__).resolve().parents[1]
DEMO = str(ROOT / "configs" / "cpu_demo.yaml")


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, list(args))
    return result.exit_code, result.output


def fields(model: type[BaseModel], prefix: str = ""):
    for name, field in model.model_fields.items():
        yield f"{prefix}{name}", field
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from fields(field.annotation, f"{prefix}{name}.")


def test_every_field_of_the_training_config_has_a_description():
    missing = [key for key, field in fields(TrainConfig) if not (field.description or "").strip()]
    assert not missing, f"give these Field(description=...): {missing}"


def test_config_show_prints_value_default_and_help_and_loads_back():
    code, out = invoke("config", "show", "--config", DEMO, "kl.beta=0.5", "rollout.max_turns=3")
    assert code == 0, out
    lines = out.splitlines()
    beta = lines.index("  beta: 0.5  # changed")
    assert lines[beta - 1] == "  # weight of the KL term (default: 0.001)"
    assert "  max_turns: 3  # changed" in lines and "  topk: 32" in lines  # a default is not marked
    assert "# the EMA anchor" in lines and "ema:" in lines  # sections under their own help
    resolved = load_config(Path(DEMO), ["kl.beta=0.5", "rollout.max_turns=3"])
    assert TrainConfig.model_validate(yaml.safe_load(out)) == resolved  # the comments are YAML comments


def test_config_show_refuses_a_bad_override_by_its_field():
    code, out = invoke("config", "show", "kl.bta=0.1")
    assert code == 2 and "kl.bta" in out


def test_method_applies_an_arm_of_the_methods_table():
    code, out = invoke("config", "show", "--config", DEMO, "--method", "grpo")  # any case
    assert code == 0, out
    shown = TrainConfig.model_validate(yaml.safe_load(out))
    assert shown == METHODS["GRPO"].config(load_config(Path(DEMO)))
    assert (shown.ema.tau, shown.kl.estimator) == (1.0, "k3")


def test_an_unknown_method_or_an_override_the_method_sets_is_refused_by_name():
    for command in (("train",), ("config", "show")):
        code, out = invoke(*command, "--method", "PPO")
        flat = " ".join(out.split())
        assert code == 2 and f"--method: unknown method 'PPO'; choose from {', '.join(METHODS)}" in flat, flat
    code, out = invoke("train", "--method", "GRPO", "kl.estimator=topk")
    flat = " ".join(out.split())
    assert code == 2 and "--method GRPO sets kl.estimator itself" in flat, flat


def test_options_made_from_fields_carry_the_fields_help_and_default():
    code, out = invoke("eval", "--help")
    flat = " ".join(out.replace("│", " ").split())
    assert code == 0
    for name in ("max_turns", "max_obs_tokens"):
        described = " ".join(RolloutSettings.model_fields[name].description.split()[:4])
        assert described in flat, (name, described)
    assert "--limit" in flat and "held-out questions per eval set" in flat and "--wandb-project" in flat


class FakeSettings(BaseModel):
    """A fake settings model for the option maker's unit test."""

    depth: int = Field(3, ge=0, description="how deep to go")
    label: str = Field("plain", description="what to call it")


def test_model_options_make_flags_from_fields_and_refuse_by_flag():
    import typer

    from emapg.cli_options import model_options

    app_ = typer.Typer()
    seen = []

    @app_.command()
    @model_options("settings", FakeSettings, "depth", "label", prefix="fake-", flags={"label": "--name"})
    def command(settings: FakeSettings, extra: int = 0) -> None:
        seen.append((settings, extra))

    runner = CliRunner()
    assert runner.invoke(app_, []).exit_code == 0 and seen.pop() == (FakeSettings(), 0)  # unset: the model's defaults
    assert runner.invoke(app_, ["--fake-depth", "5", "--name", "x", "--extra", "1"]).exit_code == 0
    assert seen.pop() == (FakeSettings(depth=5, label="x"), 1)
    refused = runner.invoke(app_, ["--fake-depth", "-1"])
    assert refused.exit_code == 2 and "--fake-depth: Input should be greater than or equal to 0" in refused.output
    shown = " ".join(runner.invoke(app_, ["--help"]).output.replace("│", " ").split())
    assert "how deep to go" in shown and "what to call it" in shown and "[default: (3)]" in shown

    class Undescribed(BaseModel):
        depth: int = 3

    with pytest.raises(TypeError, match="Undescribed.depth has no description"):
        model_options("settings", Undescribed, "depth")(command)
