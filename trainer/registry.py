"""Algorithms by name (verl's `core_algos` style): KL estimators, advantage estimators and loss aggregations.

Each is a pure function registered where it is defined (trainer/kl.py, trainer/advantages.py,
trainer/policy_loss.py); the config's allowed values are the registered names (trainer/config.py) and the learner
and the loop look functions up here, so adding one is one decorated function in one file:

    from trainer.kl import KLInputs, sampled_kl
    from trainer.registry import register_kl_estimator

    @register_kl_estimator("k2x2", reads="token")
    def k2_twice(x: KLInputs) -> Tensor:
        return 2 * sampled_kl(x.token_logprob, x.ref_token_logprob, "k2", old_logprob=x.old_token_logprob)

then `kl.estimator=k2x2`, once the module that registers it is imported before the config is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, Literal, TypeVar

Entry = TypeVar("Entry")


class Registry(Generic[Entry]):
    """Name -> entry, in registration order. A name is registered once: a second registration is an error, not a
    silent replacement of an algorithm that runs under the same config value."""

    def __init__(self, kind: str):
        self.kind = kind
        self.entries: dict[str, Entry] = {}

    def add(self, name: str, entry: Entry) -> Entry:
        if name in self.entries:
            raise ValueError(f"{self.kind} {name!r} is already registered")
        self.entries[name] = entry
        return entry

    def get(self, name: str) -> Entry:
        if name not in self.entries:
            raise ValueError(f"unknown {self.kind} {name!r}; registered: {', '.join(self.names())}")
        return self.entries[name]

    def names(self) -> tuple[str, ...]:
        return tuple(self.entries)


# What a KL estimator reads of the policy besides log pi at the sampled token (the learner asks the chunked
# log-prob pass for exactly that, and prepare() stores the anchor's values it needs):
#   token: log pi_theta(p), log pi_ref(p) (and log pi_old(p) for the importance weight)
#   topk:  also log pi_theta and log pi_ref at the top-k ids q (pi_old's for reverse, the anchor's for forward)
#   exact: also the full-vocabulary KL per token, computed beside the policy's LM head chunk by chunk
KLReads = Literal["token", "topk", "exact"]


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


KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")
# (rewards (N,), group_ids list[str], *, normalize_std: bool) -> advantages (N,)
ADVANTAGE_ESTIMATORS: Registry[Callable] = Registry("advantage estimator")
LOSS_AGGREGATIONS: Registry[LossAggregation] = Registry("loss aggregation")


def register_kl_estimator(name: str, reads: KLReads) -> Callable[[Callable], Callable]:
    def decorate(fn: Callable) -> Callable:
        KL_ESTIMATORS.add(name, KLEstimator(fn, reads))
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


def load_builtin_algorithms() -> None:
    """Import the modules that register the built-in algorithms (torch-heavy: imported when a config is
    validated, not when trainer.config is imported)."""
    import trainer.advantages  # noqa: F401
    import trainer.kl  # noqa: F401
    import trainer.policy_loss  # noqa: F401
