"""One cell of the sweep: RL from the shared SFT checkpoint with the real trainer, then its measurements.

    1. Trainer(TrainConfig, policy at the SFT weights, train questions, the real retriever).run()
    2. the training reward curve (metrics.jsonl): area under it, collapse (defined below), non-finite values
    3. the final policy (from the run's last checkpoint): greedy EM on the held-out questions, per question kind
    4. at states of the last iteration's rollouts: the exact mean and variance of the KL gradient of k3 and of Top-k,
       both against the run's own anchor (experiments/mechanism/kl_gradient_variance.py)

The cell's folder keeps metrics.jsonl, the last iteration's trajectories and result.json; checkpoints and the other
iterations' trajectories are deleted once measured (tens of MB per run, a sweep has dozens).

Collapse: a run collapses when a logged loss, KL or gradient norm is non-finite, or training stopped on non-finite
values, or its smoothed training reward (trailing mean over SMOOTH iterations) ends below half its peak
(trainer/collapse.py: the studies' share, and why the guard's is another).
"""

from __future__ import annotations

import json
import math
import shutil
import time
from pathlib import Path

import numpy as np
import torch
from transformers import set_seed

from agent.factory import make_agent, open_backend
from agent.trajectory import load_jsonl
from experiments.mechanism.kb import KBQuestion
from experiments.mechanism.kl_gradient_variance import kl_gradient_moments
from experiments.mechanism.policy import eval_settings, greedy_eval, tiny_policy
from experiments.mechanism.sweep import Cell, StudyConfig, train_overrides
from retriever.client import RetrieverError
from trainer.collapse import STUDY_SHARE, reward_fell
from trainer.learner.batch import collate
from trainer.learner.logprobs import response_logits
from trainer.run.metrics_log import FLAT_NAMES
from trainer.run.checkpoint import latest_checkpoint, load_checkpoint
from trainer.config import load_config
from trainer.run.workers import LocalWorkers
from trainer.run.loop import Trainer

SMOOTH = 5  # iterations in the trailing mean of the reward curve
FINITE_KEYS = ("loss/total", "loss/policy", "kl/anchor", "loss/grad_norm")
GRAD_KEYS = ("grad/pg_norm", "grad/kl_norm", "grad/kl_pg_cosine", "grad/kl_pg_ratio", "grad/zero_advantage_groups")


def smoothed(values: list[float], window: int = SMOOTH) -> list[float]:
    return [float(np.mean(values[max(0, i - window + 1) : i + 1])) for i in range(len(values))]


def curve_summary(rewards: list[float], finite: bool) -> dict:
    """Area under the reward curve (its mean over iterations, in [0, 1]), the smoothed final and peak, collapse."""
    if not rewards:
        return {"auc": 0.0, "final_train_reward": 0.0, "peak_train_reward": 0.0, "collapsed": True,
                "collapse_reason": "no iteration finished"}
    smooth = smoothed(rewards)
    peak, final = max(smooth), smooth[-1]
    reason = None
    if not finite:
        reason = "non-finite loss, KL or gradient"
    elif reward_fell(final, peak, STUDY_SHARE):
        reason = f"smoothed reward fell from {peak:.3f} to {final:.3f}"
    return {"auc": float(np.mean(rewards)), "final_train_reward": final, "peak_train_reward": peak,
            "collapsed": reason is not None, "collapse_reason": reason}


def read_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def all_finite(metrics: list[dict]) -> bool:
    return all(math.isfinite(m[key]) for m in metrics for key in FINITE_KEYS if key in m)


@torch.no_grad()
def state_logits(policy, anchor, trajectories, pad_id: int, states: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(states, V) logits of the policy and of the anchor at model-token positions drawn (seeded) from `trajectories`."""
    batch = collate(trajectories, torch.zeros(len(trajectories)), pad_id)
    policy_logits = response_logits(policy, batch, only=batch.loss_mask)
    anchor_logits = response_logits(anchor, batch, only=batch.loss_mask)
    pick = torch.from_numpy(np.random.default_rng(seed).permutation(len(policy_logits))[:states])
    return policy_logits[pick], anchor_logits[pick]


def kl_gradient_diagnostic(policy, anchor, trajectories, pad_id: int, states: int, topk: int, seed: int) -> dict:
    """The exact KL-gradient variance of k3 and of Top-k at the same states, against the same anchor (mean over states:
    what a mini-batch gradient's noise adds up from; median: a typical state) and the bias of each against the
    reverse KL's gradient (mean norm); the policy is the sampling policy (pi_old = pi)."""
    logits, ref_logits = state_logits(policy, anchor, trajectories, pad_id, states, seed)
    out: dict[str, float] = {"states": float(len(logits))}
    for name, estimator in (("k3", "k3"), ("topk", "topk")):
        moments = kl_gradient_moments(logits, ref_logits, estimator, topk=topk)
        out[f"variance_{name}"] = float(moments.variance.mean())
        out[f"variance_median_{name}"] = float(moments.variance.median())
        out[f"bias_{name}"] = float(moments.bias.mean())
    out["true_gradient_norm"] = float(moments.true_gradient.norm(dim=-1).mean())
    return out


def run_cell(study: StudyConfig, cell: Cell, *, out: Path, tokenizer, retriever_url: str, retriever,
             sft_weights: dict, train: list[KBQuestion], test: list[KBQuestion]) -> dict:
    """Train, measure, write `result.json` in the cell's folder (atomically, last), and return it."""
    run_dir = cell.result_path(out).parent
    if run_dir.exists():  # an interrupted earlier attempt: start the cell over
        shutil.rmtree(run_dir)
    cfg = load_config(overrides=[f"out_dir={out / 'cells'}", f"name={cell.name}", f"retriever.url={retriever_url}",
                                 *train_overrides(study, cell)])
    p = study.policy
    policy = tiny_policy(tokenizer, p)
    policy.load_state_dict(sft_weights)
    set_seed(cell.seed)
    start = time.perf_counter()
    error = None
    try:
        backend = open_backend(cfg.rollout, cfg.model, tokenizer, policy)  # rollout.backend=transformers: in memory
        engine = LocalWorkers(cfg, policy, backend, make_agent(backend, tokenizer, retriever, cfg.rollout))
        Trainer(cfg, engine, tokenizer, [q.example for q in train]).run()
    except RetrieverError:
        raise  # the server, not the method: not a result
    except RuntimeError as e:  # e.g. sampling from non-finite probabilities after the weights went NaN
        error = f"{type(e).__name__}: {e}"
    train_seconds = time.perf_counter() - start
    metrics = read_metrics(run_dir)
    finite = all_finite(metrics) and error is None
    result = {"cell": cell.name, "method": cell.method, "lr": cell.lr, "beta": cell.beta, "seed": cell.seed,
              "iterations": len(metrics), "error": error, "train_seconds": train_seconds,
              # result.json's curves keep the short (flat) names analysis.py reads
              "curve": {key: [m.get(FLAT_NAMES[key]) for m in metrics] for key in
                        ("reward", "em", "kl", "grad_norm", "entropy", "searches", "anchor_distance", "clip_fraction")},
              "grad": {key: [m.get(key) for m in metrics] for key in GRAD_KEYS},  # None off the probe's period
              **curve_summary([m["rollout/reward"] for m in metrics], finite)}

    start = time.perf_counter()
    checkpoint = latest_checkpoint(run_dir)
    if finite and checkpoint is not None:
        ckpt = load_checkpoint(checkpoint)
        policy.load_state_dict(ckpt.policy)
        anchor = tiny_policy(tokenizer, p)
        # The anchor's state names the tied output weights once (as the embeddings): nothing else may be missing.
        missing, unexpected = anchor.load_state_dict(ckpt.anchor, strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:
            raise ValueError(f"{checkpoint}: anchor state does not fit the policy ({missing=}, {unexpected=})")
        r = study.rl
        result["final"] = greedy_eval(policy, tokenizer, retriever, test,
                                      eval_settings(r.max_turns, r.max_tokens_per_turn, r.max_obs_tokens))
        last = run_dir / "trajectories" / f"iter-{len(metrics):06d}.jsonl"
        result["kl_gradient"] = kl_gradient_diagnostic(
            policy, anchor, list(load_jsonl(last)), tokenizer.pad_token_id, study.diagnostic.states, r.topk,
            cell.seed) if study.diagnostic.kl_gradient else None
    else:  # a diverged policy answers nothing: its held-out EM is 0, not measured
        result["final"] = {"em": 0.0, "searches": 0.0, "n": 0.0, "answered": 0.0,
                           "not_evaluated": "the run did not finish finitely"}
        result["kl_gradient"] = None
    result["measure_seconds"] = time.perf_counter() - start

    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
    for path in sorted((run_dir / "trajectories").glob("iter-*.jsonl"))[:-1]:
        path.unlink()
    tmp = cell.result_path(out).with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(cell.result_path(out))
    return result
