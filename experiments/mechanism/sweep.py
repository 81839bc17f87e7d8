"""The study's settings (one typed config) and its sweep: methods x learning rates x betas x seeds.

The methods are trainer/methods.py's (GRPO, EMA-k3, EMA-PG, GRPO-k3c, GRPO-floor, EMA-k3c, ...): they differ only in
the anchor and the KL estimator (and GRPO-floor in its fixed beta); everything else is the same config. The EMA
methods' tau is the study's `rl.ema_tau`. (Before issue 44 the sweep had its own names: grpo = GRPO, ema-k3 = EMA-k3,
ema-topk = EMA-PG, grpo-k3c = GRPO-k3c.)

The grid is two slices through (lr, beta), not their full product: every lr at `beta_at`, every beta at `lr_at`
(the shared point once). That asks the two questions of the issue (where does GRPO become unstable as lr grows; where
does a fixed reference hold learning back as beta grows) at a third of the product's cost.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from pydantic import Field, field_validator, model_validator

from trainer.config import Section  # extra keys forbidden: a typo is an error, as in a training config
from trainer.methods import METHODS, STUDIES


class KBSection(Section):
    seed: int = 0
    train_people: int = Field(1200, ge=1)
    test_people: int = Field(200, ge=1)
    train_cities: int = Field(150, ge=1)
    test_cities: int = Field(50, ge=1)
    countries: int = Field(40, ge=2)
    mix: tuple[float, float, float] = (0.25, 0.25, 0.5)  # birthplace, city_country, birth_country (two-hop)
    train_questions: int = Field(3000, ge=1)
    test_questions: int = Field(200, ge=1)


class PolicySection(Section):
    hidden: int = Field(128, ge=8)
    layers: int = Field(2, ge=1)
    heads: int = Field(4, ge=1)
    init_seed: int = 0


class SFTSection(Section):
    demonstrations: int = Field(3000, ge=1)  # train questions demonstrated (answerable ones kept)
    full_rate: float = Field(0.25, ge=0, le=1)  # share of two-hop demonstrations that search twice
    epochs: int = Field(4, ge=1)  # 750 steps of 16: the digit copying is learned by ~600 (policy.py)
    batch_size: int = Field(16, ge=1)
    lr: float = Field(3e-3, gt=0)
    warmup_steps: int = Field(20, ge=0)


class RLSection(Section):
    """The RL run of every cell (trainer/config.py's keys; the method, lr, beta and seed come from the cell)."""

    iterations: int = Field(20, ge=1)
    prompts_per_iteration: int = Field(8, ge=1)
    rollouts_per_prompt: int = Field(6, ge=2)
    mini_batch_size: int = Field(24, ge=1)  # two AdamW steps per iteration
    micro_batch_size: int = Field(24, ge=1)
    warmup_steps: int = Field(0, ge=0)
    ema_tau: float = Field(0.9, ge=0, lt=1)  # the EMA methods' tau (GRPO's is 1)
    ema_period: int = Field(1, ge=1)
    topk: int = Field(32, ge=0)
    max_turns: int = Field(2, ge=1)
    max_tokens_per_turn: int = Field(16, ge=1)
    max_obs_tokens: int = Field(100, ge=1)
    retriever_topk: int = Field(1, ge=1)  # one document per search: the answer is its last word (kb.py)
    grad_probe_every: int = Field(1, ge=0)  # the grad/ metrics on every iteration (train.grad_probe_every)


class DiagnosticSection(Section):
    kl_gradient: bool = True  # the exact KL-gradient variance of k3 and Top-k at the last rollouts' states
    states: int = Field(128, ge=1)  # model-token positions of the last iteration's rollouts, per run
    test_questions: int = Field(200, ge=1)  # held-out questions of the final greedy evaluation


class SweepSection(Section):
    # trainer/methods.py's names; the default is the first sweep's three (issue 17).
    methods: list[str] = ["GRPO", "EMA-k3", "EMA-PG"]
    # From the pilot (seed 0, docs/benchmarks.md): at beta 0.1 GRPO learns at lr 3e-4 and collapses at 3e-3; at
    # lr 3e-4 a fixed reference visibly slows learning from beta 1 and stalls it at beta 3.
    lrs: list[float] = [3e-4, 1e-3, 3e-3]
    betas: list[float] = [0.1, 1.0, 3.0]
    lr_at: float = 3e-4  # the beta slice's learning rate
    beta_at: float = 0.1  # the lr slice's beta
    seeds: list[int] = [0, 1, 2, 3, 4]
    # Explicit (method, lr) points at beta_at (or the method's own beta), in place of the two slices: a study whose
    # arms do not all run at every rate (Study C). Empty: the slices.
    cells: list[tuple[str, float]] = []

    @field_validator("methods")
    @classmethod
    def _known_methods(cls, names: list[str]) -> list[str]:
        unknown = [name for name in names if name not in METHODS]
        if unknown:
            raise ValueError(f"unknown methods {unknown}: choose from {', '.join(METHODS)} (trainer/methods.py)")
        return names

    @model_validator(mode="after")
    def _cells_of_the_methods(self) -> SweepSection:
        stray = sorted({method for method, _ in self.cells} - set(self.methods))
        if stray:
            raise ValueError(f"sweep.cells name methods not in sweep.methods: {stray}")
        return self


class StudyConfig(Section):
    kb: KBSection = KBSection()
    policy: PolicySection = PolicySection()
    sft: SFTSection = SFTSection()
    rl: RLSection = RLSection()
    diagnostic: DiagnosticSection = DiagnosticSection()
    sweep: SweepSection = SweepSection()

    @model_validator(mode="after")
    def _consistent(self) -> StudyConfig:
        if self.diagnostic.test_questions > self.kb.test_questions:
            raise ValueError(f"diagnostic.test_questions ({self.diagnostic.test_questions}) exceeds kb.test_questions "
                             f"({self.kb.test_questions})")
        return self

    def setup(self) -> dict:
        """Everything but the sweep axes: results made under a different setup must not be mixed."""
        return self.model_dump(mode="json", exclude={"sweep"})


# A size for the end-to-end test: the whole pipeline in seconds, nothing learned.
TOY = {
    "kb": {"train_people": 40, "test_people": 10, "train_cities": 8, "test_cities": 4, "countries": 4,
           "train_questions": 64, "test_questions": 8},
    "policy": {"hidden": 16, "layers": 1, "heads": 2},
    "sft": {"demonstrations": 8, "epochs": 1, "batch_size": 4, "warmup_steps": 0},
    "rl": {"iterations": 1, "prompts_per_iteration": 2, "rollouts_per_prompt": 2, "mini_batch_size": 4,
           "micro_batch_size": 4, "topk": 4, "max_tokens_per_turn": 8},
    "diagnostic": {"states": 4, "test_questions": 4},
    "sweep": {"methods": ["GRPO"], "lrs": [1e-3], "betas": [0.1], "lr_at": 1e-3, "beta_at": 0.1, "seeds": [0]},
}
# Study A of issue 43 (docs/study_stability_plan.md): the learning-rate slice at beta 0.1 with trainer/methods.py's
# four arms, no KL-gradient-variance diagnostic (not among its outcomes); the seeds and SFT start come per block.
STABILITY = {
    "diagnostic": {"kl_gradient": False},
    "sweep": {"methods": list(STUDIES["stability"]), "lrs": [2e-3, 3e-3, 5e-3],
              "betas": [0.1], "lr_at": 3e-3, "beta_at": 0.1},
}
# Study C of issue 54 (docs/study_c_plan.md): what in the EMA-PG arm buys the stability (Part 1: the KL term alone
# varies, EMA anchor in every arm, lr 3e-3, no warm-up) and whether it survives the authors' warm-up (Part 2). Each
# seed runs Part 1's five arms, then Part 2's five cells, so an interrupted study has whole seeds of both parts.
STUDY_C_PART_1 = [("EMA-PG", 3e-3), ("EMA-k3c", 3e-3), ("EMA-PG-weak", 3e-3), ("EMA-k3c-strong", 3e-3),
                  ("EMA-PG-tail", 3e-3)]
STUDY_C_PART_2 = [("GRPO-k3c", 3e-3), ("GRPO-k3c-warmup", 3e-3), ("EMA-PG-warmup", 3e-3), ("GRPO-k3c-warmup", 5e-3),
                  ("EMA-PG-warmup", 5e-3)]
STUDY_C = {
    "diagnostic": {"kl_gradient": False},
    "sweep": {"methods": list(STUDIES["study-c"]), "lrs": [3e-3, 5e-3], "betas": [0.1], "lr_at": 3e-3,
              "beta_at": 0.1, "cells": STUDY_C_PART_1 + STUDY_C_PART_2},
}
# The plan's conditional rate: both warm-up arms at 1e-2, run only if both held at 5e-3 (stability.extra_rate_due).
STUDY_C_EXTRA = {**STUDY_C, "sweep": {**STUDY_C["sweep"], "lrs": [1e-2],
                                      "cells": [("GRPO-k3c-warmup", 1e-2), ("EMA-PG-warmup", 1e-2)]}}
PRESETS = {"study": {}, "toy": TOY, "stability": STABILITY, "study-c": STUDY_C, "study-c-extra": STUDY_C_EXTRA}


def study_config(preset: str = "study", init_seed: int | None = None, **sweep_overrides) -> StudyConfig:
    """The preset's setup, with the SFT start's `policy.init_seed` (a block of a study) and the sweep's axes given."""
    if preset not in PRESETS:
        raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {preset!r}")
    raw = {section: dict(values) for section, values in PRESETS[preset].items()}
    if init_seed is not None:
        raw["policy"] = {**raw.get("policy", {}), "init_seed": init_seed}
    raw["sweep"] = {**raw.get("sweep", {}), **{k: v for k, v in sweep_overrides.items() if v is not None}}
    return StudyConfig.model_validate(raw)


@dataclass(frozen=True)
class Cell:
    method: str
    lr: float
    beta: float
    seed: int

    @property
    def name(self) -> str:
        return f"{self.method}_lr{self.lr:g}_beta{self.beta:g}_seed{self.seed}"

    @classmethod
    def parse(cls, name: str) -> Cell:
        m = re.fullmatch(r"(?P<method>[A-Za-z0-9-]+)_lr(?P<lr>[^_]+)_beta(?P<beta>[^_]+)_seed(?P<seed>\d+)", name)
        if m is None:
            raise ValueError(f"not a cell name: {name!r}")
        return cls(m["method"], float(m["lr"]), float(m["beta"]), int(m["seed"]))

    def result_path(self, out: Path) -> Path:
        return out / "cells" / self.name / "result.json"


def method_beta(method: str, beta: float) -> float:
    """The beta a cell of `method` runs at: the method's own where it fixes one (GRPO-floor's 0.001), else `beta`."""
    return float(METHODS[method].overrides.get("kl.beta", beta))


def grid(sweep: SweepSection) -> list[Cell]:
    """Seed-major (every (method, lr, beta) of seed 0, then of seed 1, ...), so that an interrupted sweep has whole
    paired comparisons for the seeds it finished. A method with a fixed beta runs once per learning rate. With
    `sweep.cells`, those points in their order instead of the slices."""
    if sweep.cells:
        return [Cell(method, lr, method_beta(method, sweep.beta_at), seed)
                for seed in sweep.seeds for method, lr in sweep.cells]
    points = [(lr, sweep.beta_at) for lr in sweep.lrs] + [(sweep.lr_at, b) for b in sweep.betas]
    cells = [Cell(method, lr, method_beta(method, beta), seed)
             for seed in sweep.seeds for lr, beta in points for method in sweep.methods]
    return list(dict.fromkeys(cells))  # the shared point once, order kept


def train_overrides(study: StudyConfig, cell: Cell) -> list[str]:
    """trainer/config.py overrides for one cell's RL run."""
    rl = study.rl
    if method_beta(cell.method, cell.beta) != cell.beta:
        raise ValueError(f"cell {cell.name}: {cell.method} runs at beta {method_beta(cell.method, cell.beta):g}")
    # The method's own keys come last, so they win over the study's (EMA-PG-tail's kl.topk=0, a warm-up arm's
    # train.warmup_fraction); the EMA methods take the study's tau.
    method = {"ema.tau": rl.ema_tau, **METHODS[cell.method].overrides}
    return [
        f"seed={cell.seed}", f"train.lr={cell.lr}", f"kl.beta={cell.beta}",
        f"kl.topk={rl.topk}", f"ema.period={rl.ema_period}",
        f"train.iterations={rl.iterations}", f"train.prompts_per_iteration={rl.prompts_per_iteration}",
        f"train.rollouts_per_prompt={rl.rollouts_per_prompt}", f"train.mini_batch_size={rl.mini_batch_size}",
        f"train.micro_batch_size={rl.micro_batch_size}", f"train.warmup_steps={rl.warmup_steps}",
        f"rollout.max_turns={rl.max_turns}", f"rollout.max_tokens_per_turn={rl.max_tokens_per_turn}",
        f"rollout.max_obs_tokens={rl.max_obs_tokens}", "rollout.backend=transformers",
        f"rollout.max_in_flight={rl.prompts_per_iteration * rl.rollouts_per_prompt}", f"retriever.topk={rl.retriever_topk}",
        f"checkpoint.every={rl.iterations}", "checkpoint.keep=1", f"train.grad_probe_every={rl.grad_probe_every}",
        *(f"{key}={value}" for key, value in method.items()),
    ]
