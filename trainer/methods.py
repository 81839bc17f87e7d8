"""The methods a comparison runs, by name: each is a few config keys over a shared run config (the paper's rows).

    GRPO     fixed reference (ema.tau = 1), k3 KL            the anchor is the start model and never moves
    EMA-k3   EMA anchor, k3 KL                               the anchor alone
    EMA-PG   EMA anchor, Top-k KL                            the paper's method
    and the two-hop study's arms: GRPO-k3c, GRPO-floor, EMA-k3c (the authors' clamped k3), EMA-PG-released;
    Study C's: one change each (a matched beta, k = 0, the authors' warm-up)

`emapg compare` and the experiments read this table (not `ema.tau == 1` tests), so a method added here is run,
evaluated and reported everywhere the same way. Config only: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.config import TrainConfig, apply_override


@dataclass(frozen=True)
class Method:
    name: str
    overrides: dict[str, object] = field(default_factory=dict)  # dotted config keys, as on the command line
    # The anchor never moves (tau = 1): it is the start model, evaluated once for all methods, not per method.
    fixed_reference: bool = False
    about: str = ""

    def config(self, base: TrainConfig, run_name: str | None = None) -> TrainConfig:
        """`base` with this method's keys set (and `name` = run_name if given), validated again."""
        raw = base.model_dump()
        for key, value in self.overrides.items():
            apply_override(raw, f"{key}={value}")
        if run_name is not None:
            raw["name"] = run_name
        cfg = TrainConfig.model_validate(raw)
        if self.fixed_reference != (cfg.ema.tau == 1.0):
            raise ValueError(f"method {self.name}: fixed_reference={self.fixed_reference} but ema.tau={cfg.ema.tau}")
        return cfg


# The authors' GRPO baseline (LunjunZhang/ema-pg, docs/fidelity.md): verl's low_var_kl, no importance weight.
AUTHORS_K3 = {"kl.estimator": "k3_clamped", "kl.importance_weight": False}
# The authors' warm-up: verl's lr_warmup_steps_ratio 0.285, stepped per iteration (trainer/schedule.py).
AUTHORS_WARMUP = {"train.warmup_steps": 0, "train.warmup_fraction": 0.285}

METHODS: dict[str, Method] = {m.name: m for m in (
    Method("GRPO", {"ema.tau": 1.0, "kl.estimator": "k3"}, fixed_reference=True, about="fixed reference, k3 KL"),
    Method("EMA-k3", {"kl.estimator": "k3"}, about="EMA anchor, k3 KL"),
    Method("EMA-PG", {"kl.estimator": "topk"}, about="EMA anchor, Top-k KL"),
    # The two-hop study's arms (docs/study_two_hop_plan.md): the authors' baseline KL, and their released Top-k.
    Method("GRPO-k3c", {"ema.tau": 1.0, **AUTHORS_K3}, fixed_reference=True,
           about="fixed reference, the authors' clamped k3 without importance weight"),
    Method("GRPO-floor", {"ema.tau": 1.0, **AUTHORS_K3, "kl.beta": 0.001}, fixed_reference=True,
           about="GRPO-k3c at the paper's beta 0.001, where the KL term barely acts"),
    Method("EMA-k3c", AUTHORS_K3, about="EMA anchor, the authors' clamped k3 without importance weight"),
    Method("EMA-PG-released", {"kl.estimator": "topk_released"},
           about="EMA anchor, the authors' released Top-k (no head-mass correction: biased by +grad P_q)"),
    # Study C's arms (docs/study_c_plan.md), each one change from an arm above. The two betas match the KL term's
    # gradient norm of the other estimator at the same state: Top-k's was 2.78x k3c's at beta 0.1 (Study A's records,
    # lr 3e-3, iterations 2-4, median over 16 seeds of each seed's median; experiments/mechanism/stability.py
    # `pull_ratio`), so 0.1 / 2.78 and 0.1 x 2.78. They are the tiny policy's, not a recommendation.
    Method("EMA-PG-weak", {"kl.estimator": "topk", "kl.beta": 0.036},
           about="EMA-PG with beta lowered to 0.036, where its KL pull matches EMA-k3c's at beta 0.1"),
    Method("EMA-k3c-strong", {**AUTHORS_K3, "kl.beta": 0.28},
           about="EMA-k3c with beta raised to 0.28, where its KL pull matches EMA-PG's at beta 0.1"),
    Method("EMA-PG-tail", {"kl.estimator": "topk", "kl.topk": 0},
           about="EMA-PG with k = 0: the sampled tail alone, Top-k's expected gradient without its variance reduction"),
    # The authors' warm-up (docs/fidelity.md): the rate rises over the first 28.5% of the iterations.
    Method("GRPO-k3c-warmup", {"ema.tau": 1.0, **AUTHORS_K3, **AUTHORS_WARMUP}, fixed_reference=True,
           about="GRPO-k3c with the authors' warm-up (28.5% of the iterations)"),
    Method("EMA-PG-warmup", {"kl.estimator": "topk", **AUTHORS_WARMUP},
           about="EMA-PG with the authors' warm-up (28.5% of the iterations)"),
)}


# Each study's arms, in its plan's order (docs/study_two_hop_plan.md, docs/study_stability_plan.md,
# docs/study_b_plan.md, docs/study_c_plan.md): the experiments, their analyses and the Makefile's study targets
# (`python -m trainer.methods STUDY`) read them from here, so a new arm is an entry in this file.
STUDIES: dict[str, tuple[str, ...]] = {
    "two-hop": ("GRPO-floor", "GRPO-k3c", "EMA-k3c", "EMA-PG", "EMA-PG-released"),
    "stability": ("GRPO-k3c", "GRPO-floor", "EMA-k3c", "EMA-PG"),
    "study-b": ("GRPO-k3c", "EMA-PG"),
    "study-c": ("EMA-PG", "EMA-k3c", "EMA-PG-weak", "EMA-k3c-strong", "EMA-PG-tail", "GRPO-k3c", "GRPO-k3c-warmup",
                "EMA-PG-warmup"),
    "study-d": ("GRPO-k3c-warmup", "EMA-PG-warmup"),
}


def chosen_methods(spec: str) -> list[Method]:
    """The methods named in a comma-separated list (any case), in the table's order."""
    canonical = {name.lower(): name for name in METHODS}
    asked = [part.strip().lower() for part in spec.split(",") if part.strip()]
    unknown = [name for name in asked if name not in canonical]
    if unknown or not asked:
        raise ValueError(f"unknown methods {unknown or [spec]}: choose from {', '.join(METHODS)}")
    return [method for name, method in METHODS.items() if name.lower() in asked]


if __name__ == "__main__":  # `python -m trainer.methods STUDY`: its arms, comma-separated (the Makefile's --methods)
    import sys

    print(",".join(STUDIES[sys.argv[1]]))
