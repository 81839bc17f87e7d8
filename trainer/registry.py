"""Algorithms by name (verl's `core_algos` style): KL estimators, advantage estimators and loss aggregations.

Each is a pure function registered where it is defined (trainer/kl.py, trainer/advantages.py,
trainer/policy_loss.py) into a registry here; the learner and the loop look functions up here, and the config checks
names here. This module imports neither torch nor the rest of the project, so validating a config loads no algorithm
(and no torch), and the algorithm modules import it without a circle. For a typo to fail validation all the same,
each registry declares the names its module registers (and, for KL estimators, what each reads): a fast path for the
built-ins, not a second list to keep. Registering one of them checks that its registration says the same, and
tests/test_registry.py that each declared one is registered; a name not declared makes the check import the module
that defines the built-ins and look again. Adding one is one decorated function in one file:

    from trainer.kl import KLInputs, sampled_kl
    from trainer.registry import KLReads, register_kl_estimator

    @register_kl_estimator("k2x2", KLReads("token"))
    def k2_twice(x: KLInputs) -> Tensor:
        return 2 * sampled_kl(x.token_logprob, x.ref_token_logprob, "k2", old_logprob=x.old_token_logprob,
                              iw_clip=x.iw_clip)

then `kl.estimator=k2x2`: in trainer/kl.py (a built-in) nothing else changes; elsewhere, once the module that
registers it is imported before the config is loaded. A lookup (`get`) of a declared name imports the module that defines
it first, so no caller depends on what happened to be imported before (the viewer scores a run's rollouts in a
process that never trained).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

Entry = TypeVar("Entry")


class Registry(Generic[Entry]):
    """Name -> entry, in registration order, with the names `defined_in` registers declared up front (each with what
    the config checks of it: `declared`). A name is registered once: a second registration is an error, not a silent
    replacement of an algorithm that runs under the same config value."""

    def __init__(self, kind: str, defined_in: str, declared: dict[str, Any]):
        self.kind = kind
        self.defined_in = defined_in
        self.declared = dict(declared)  # name -> declaration; registrations from elsewhere are added as they come
        self.entries: dict[str, Entry] = {}

    def add(self, name: str, entry: Entry, declaration: Any = None) -> Entry:
        if name in self.entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        if name in self.declared and self.declared[name] != declaration:
            raise ValueError(f"{self.kind} {name!r} is declared as {self.declared[name]} in trainer.registry but "
                             f"registered as {declaration}")
        self.declared[name] = declaration
        self.entries[name] = entry
        return entry

    def check(self, name: str) -> None:
        if name not in self.declared:  # a built-in added to `defined_in` without a declaration here: look there
            importlib.import_module(self.defined_in)
        if name not in self.declared:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}")

    def declaration(self, name: str) -> Any:
        """What the config checks of `name` (no import of the module that defines it)."""
        self.check(name)
        return self.declared[name]

    def get(self, name: str) -> Entry:
        """The entry, importing the module that defines the built-ins first when it has not been imported yet."""
        self.check(name)
        if name not in self.entries:
            importlib.import_module(self.defined_in)
        if name not in self.entries:
            raise ValueError(f"{self.kind} {name!r} is declared for {self.defined_in}, which does not register it")
        return self.entries[name]

    def names(self) -> tuple[str, ...]:
        return tuple(self.declared)


@dataclass(frozen=True)
class KLReads:
    """What a KL estimator reads, so that the learner gathers exactly that and the config refuses what it would ignore.

    values: besides log pi_theta(p) of the sampled token p,
      token: log pi_ref(p) (the anchor's pass in prepare, at the token alone)
      topk:  also log pi_theta and log pi_ref at the top-k ids q (pi_old's for reverse, the anchor's for forward)
      exact: the full-vocabulary KL per token, beside the policy's LM head chunk by chunk (the anchor's hidden states
             come from the update pass: prepare runs no anchor pass)
    importance_weight: whether it weighs by s = sg(pi_theta(p) / pi_old(p)) (reading log pi_old(p)), which
      kl.importance_weight turns on and kl.iw_clip clamps.
    """

    values: Literal["token", "topk", "exact"]
    importance_weight: bool = True


@dataclass(frozen=True)
class KLEstimator:
    fn: Callable  # (trainer.kl.KLInputs) -> (M,) per-token KL; gradient through the policy's log-probs only
    reads: KLReads


@dataclass(frozen=True)
class LossAggregation:
    """A mean over masked tokens that accumulates exactly over micro-batches: reduce(x, mask) is a sum over the
    masked entries divided by count(mask), so the mini-batch mean is sum_i count_i / count_total x reduce_i."""

    reduce: Callable  # (x (N, T), mask (N, T) bool) -> scalar
    count: Callable  # (mask (N, T) bool) -> scalar: the denominator of reduce


SAMPLED = KLReads("token")
KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator", "trainer.kl", {
    "topk": KLReads("topk"), "exact": KLReads("exact", importance_weight=False),
    "k1": SAMPLED, "k2": SAMPLED, "k3": SAMPLED, "k3pp": SAMPLED, "k4": SAMPLED, "k5": SAMPLED, "k3_clamped": SAMPLED,
    "topk_released": KLReads("topk"),
})
# (rewards (N,), group_ids list[str], *, normalize_std: bool) -> advantages (N,)
ADVANTAGE_ESTIMATORS: Registry[Callable] = Registry("advantage estimator", "trainer.advantages", {"grpo": None})
LOSS_AGGREGATIONS: Registry[LossAggregation] = Registry(
    "loss aggregation", "trainer.policy_loss", {"token-mean": None, "seq-mean-token-mean": None})


def register_kl_estimator(name: str, reads: KLReads) -> Callable[[Callable], Callable]:
    def decorate(fn: Callable) -> Callable:
        KL_ESTIMATORS.add(name, KLEstimator(fn, reads), reads)
        return fn

    return decorate


def register_advantage_estimator(name: str) -> Callable[[Callable], Callable]:
    def decorate(fn: Callable) -> Callable:
        return ADVANTAGE_ESTIMATORS.add(name, fn)

    return decorate


def register_loss_aggregation(name: str, count: Callable) -> Callable[[Callable], Callable]:
    def decorate(reduce: Callable) -> Callable:
        LOSS_AGGREGATIONS.add(name, LossAggregation(reduce, count))
        return reduce

    return decorate
