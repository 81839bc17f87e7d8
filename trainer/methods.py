"""The methods a comparison runs, by name: each is a few config keys over a shared run config (the paper's rows).

    GRPO     fixed reference (ema.tau = 1), k3 KL            the anchor is the start model and never moves
    EMA-k3   EMA anchor, k3 KL                               the anchor alone
    EMA-PG   EMA anchor, Top-k KL                            the paper's method

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


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("GRPO", {"ema.tau": 1.0, "kl.estimator": "k3"}, fixed_reference=True, about="fixed reference, k3 KL"),
    Method("EMA-k3", {"kl.estimator": "k3"}, about="EMA anchor, k3 KL"),
    Method("EMA-PG", {"kl.estimator": "topk"}, about="EMA anchor, Top-k KL"),
)}


def chosen_methods(spec: str) -> list[Method]:
    """The methods named in a comma-separated list (any case), in the table's order."""
    canonical = {name.lower(): name for name in METHODS}
    asked = [part.strip().lower() for part in spec.split(",") if part.strip()]
    unknown = [name for name in asked if name not in canonical]
    if unknown or not asked:
        raise ValueError(f"unknown methods {unknown or [spec]}: choose from {', '.join(METHODS)}")
    return [method for name, method in METHODS.items() if name.lower() in asked]
