"""The KL term's gradient against the policy gradient, on one optimizer step: what choosing beta needs to see.

For a step whose loss is L = L_pg + beta * KL (L_pg: the PPO-clip term, and the entropy bonus when it is on), the
accumulated gradient g = g_pg + g_kl. The probe takes g_kl = grad(beta * KL) micro-batch by micro-batch (one more
backward of the KL term alone per micro-batch), sums it over the step's micro-batches, and at the step's end reads
g from the parameters' .grad (before clipping), so g_pg = g - g_kl. It reports

    grad/pg_norm        ||g_pg||
    grad/kl_norm        ||g_kl||                    (beta included: the gradient the KL term adds)
    grad/kl_pg_cosine   <g_kl, g_pg> / (||g_kl|| ||g_pg||)   (NaN when either is zero)
    grad/kl_pg_ratio    ||g_kl|| / ||g_pg||         (NaN, not inf, when the policy gradient is zero: every group of
                                                     the step had equal rewards, so there is nothing to compare)

Taken over a whole mini-batch (not one micro-batch, as the old `kl/grad_share` was), so one step's groups all count.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def gradient_split(whole: list[Tensor | None], kl: list[Tensor | None]) -> dict[str, float]:
    """The four grad/ metrics from the whole gradient and the KL term's part of it, per parameter (None: no gradient
    reached it), in float64."""
    pg_sq = kl_sq = dot = 0.0
    for w, k in zip(whole, kl, strict=True):
        if w is None and k is None:
            continue
        w = torch.zeros_like(k) if w is None else w.double()
        k = torch.zeros_like(w) if k is None else k.double()
        pg = w - k
        pg_sq += float(pg.square().sum())
        kl_sq += float(k.square().sum())
        dot += float((pg * k).sum())
    pg_norm, kl_norm = math.sqrt(pg_sq), math.sqrt(kl_sq)
    return {
        "grad/pg_norm": pg_norm,
        "grad/kl_norm": kl_norm,
        "grad/kl_pg_cosine": dot / (pg_norm * kl_norm) if pg_norm > 0 and kl_norm > 0 else math.nan,
        "grad/kl_pg_ratio": kl_norm / pg_norm if pg_norm > 0 else math.nan,
    }


class GradientProbe:
    """Sums grad(beta * KL) over one step's micro-batches (`add`), then splits the step's gradient (`finish`)."""

    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = params
        self.kl_grad: list[Tensor | None] = [None] * len(params)

    def add(self, kl_term: Tensor) -> None:
        """The gradient of this micro-batch's (scaled) KL term, kept aside; call before its backward (the graph is
        retained for it)."""
        if not kl_term.requires_grad:  # beta 0, or nothing trainable reached it
            return
        grads = torch.autograd.grad(kl_term, self.params, retain_graph=True, allow_unused=True)
        for i, g in enumerate(grads):
            if g is not None:
                self.kl_grad[i] = g.detach().clone() if self.kl_grad[i] is None else self.kl_grad[i] + g

    def finish(self) -> dict[str, float]:
        """The grad/ metrics of the gradient accumulated in .grad so far (call before clipping)."""
        return gradient_split([p.grad for p in self.params], self.kl_grad)
