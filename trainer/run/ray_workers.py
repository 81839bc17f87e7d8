"""Scale-out on Ray: rollout workers (one engine each) and learner ranks (torch.distributed: DDP or FSDP2) as
actors behind `RayWorkers`, which the training loop (`trainer.run.loop.Trainer`) drives as it drives the in-process one.

    driver (Trainer + RayWorkers)   prompts -> split over workers -> trajectories -> rewards, advantages, batch
      RolloutWorker x W            rollouts over its own engine (vLLM: continuous; transformers) and retriever client
      LearnerRank x R              PolicyTrainer: prepare + update (gradients summed over ranks) + EMA anchor
    after each update              rank 0's weights -> object store -> every worker's engine, in place

Every rank gets the whole batch (one object in Ray's store) and works on its share of the micro-batches. Under DDP
every rank holds the whole policy and anchor and applies the same EMA update to its own copy, so all ranks stay
identical; under FSDP each rank holds and updates its shard of both (tests check both against one process).
`distributed.address`: None starts a local cluster, "auto" joins the one `ray start` made.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import ray
import torch
from transformers import set_seed

from agent.backend import Generation, SamplingParams
from agent.seeds import worker_seed
from agent.trajectory import Trajectory
from data.qa import QAExample
from retriever.process import free_port
from trainer.learner.batch import RolloutBatch
from trainer.config import TrainConfig
from trainer.run.workers import PolicyTrainer


def _policy(cfg: TrainConfig, device: str | None = None):
    from agent.policy import load_policy

    return load_policy(cfg.model, cfg.dtype, device)


class RolloutWorker:
    """A Ray actor: one rollout engine, one retriever client, the multi-turn agent."""

    def __init__(self, cfg_json: dict):
        from agent.factory import make_agent, open_backend
        from agent.policy import load_tokenizer
        from retriever.client import RetrieverClient

        cfg = TrainConfig.model_validate(cfg_json)
        self.tokenizer = load_tokenizer(cfg.model)
        # The transformers engine samples from a policy copy of its own; vLLM loads the model folder itself.
        policy = _policy(cfg) if cfg.rollout.backend == "transformers" else None  # on the GPU if there is one
        self.backend = open_backend(cfg.rollout, cfg.model, self.tokenizer, policy, dtype=cfg.dtype, seed=cfg.seed)
        client = None
        if cfg.rollout.mode != "direct":
            client = RetrieverClient(cfg.retriever.url, topk=cfg.retriever.topk, timeout_s=cfg.retriever.timeout_s)
        self.agent = make_agent(self.backend, self.tokenizer, client, cfg.rollout,
                                retriever_timeout_s=cfg.retriever.timeout_s)

    def rollout(self, examples: list[QAExample], params: SamplingParams,
                samples: int) -> tuple[list[Trajectory], float]:
        """The trajectories, and the seconds the engine waited on retrieval."""
        return self.agent.rollout(examples, params, samples), self.agent.retrieval_wait_s

    def load_weights(self, weights: dict[str, torch.Tensor]) -> None:
        self.backend.load_weights(weights.items())

    def ready(self) -> bool:
        return True

    def greedy(self, prompt_ids: list[int], max_tokens: int) -> Generation:
        """A greedy continuation with its log-probs: what the engine's weights are, seen from outside."""
        return self.backend.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=max_tokens), [])[0]


class LearnerRank:
    """A Ray actor: one torch.distributed rank holding a PolicyTrainer (policy, EMA anchor, AdamW). Made in two
    steps: rank 0's node address is only known once it is placed (it may be on another node than the driver)."""

    def __init__(self, cfg_json: dict):
        self.cfg = TrainConfig.model_validate(cfg_json)

    def rendezvous_address(self) -> str:
        """host:port on this actor's node for torch.distributed's rendezvous (asked of rank 0)."""
        return f"{ray.util.get_node_ip_address()}:{free_port()}"

    def start(self, rank: int, world_size: int, master: str) -> None:
        import torch.distributed as dist

        cuda = self.cfg.distributed.gpus_per_learner_rank > 0
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master.rsplit(":", 1)
        dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=world_size)
        set_seed(self.cfg.seed)
        # Ray gives each GPU actor its own CUDA_VISIBLE_DEVICES: its device is cuda:0.
        self.learning = PolicyTrainer(self.cfg, _policy(self.cfg, "cuda" if cuda else "cpu"))

    def train_step(self, batch: RolloutBatch, iteration: int) -> dict[str, float]:
        return self.learning.train_step(batch, iteration)

    def policy_weights(self) -> dict[str, torch.Tensor]:
        # The full state dict (tied output layer included, as its own copy): workers load it strictly.
        return self.learning.policy_state()

    def gradients(self) -> dict[str, torch.Tensor]:
        """The last optimizer step's gradients, whole (for tests: set_to_none happens at the next step's start).
        Sharded: a collective that gathers every shard."""
        return {name: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad).detach().to("cpu")
                for name, p in self.learning.policy.named_parameters() if p.grad is not None}

    def state(self) -> dict:
        return self.learning.state()

    def load_state(self, state: dict) -> None:
        self.learning.load_state(state)

    def init_from(self, path: str) -> None:
        self.learning.init_from(Path(path))


def placement(d) -> tuple[list[dict], list[dict]]:
    """Ray options for each rollout worker and each learner rank. With GPUs and as many workers as ranks, worker i
    and rank i share bundle i of a placement group (one GPU's worth): fractional GPU requests alone would let Ray put
    two engines on one GPU and two ranks on another."""
    workers = [{"num_cpus": 1, "num_gpus": d.gpus_per_rollout_worker}] * d.rollout_workers
    ranks = [{"num_cpus": 1, "num_gpus": d.gpus_per_learner_rank}] * d.learner_ranks
    gpus = d.gpus_per_rollout_worker + d.gpus_per_learner_rank
    if gpus == 0 or d.rollout_workers != d.learner_ranks:
        return workers, ranks
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = placement_group([{"CPU": 2, "GPU": gpus}] * d.learner_ranks, strategy="PACK")
    ray.get(group.ready())

    def pinned(options: list[dict]) -> list[dict]:
        return [{**o, "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)}
                for i, o in enumerate(options)]

    return pinned(workers), pinned(ranks)


def start_ray(cfg: TrainConfig) -> None:
    if ray.is_initialized():
        return
    d = cfg.distributed
    if d.address is not None:
        ray.init(address=d.address)
        return
    # A local cluster: logical CPUs are only a scheduling count; every actor asks for one.
    ray.init(num_cpus=max(os.cpu_count() or 1, d.rollout_workers + d.learner_ranks),
             include_dashboard=False, log_to_driver=True)


class RayWorkers:
    """The workers on Ray actors: rollouts split over the workers, learning on the ranks, rank 0's weights synced into
    every worker's engine."""

    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        start_ray(cfg)
        d = cfg.distributed
        cfg_json = cfg.model_dump(mode="json")
        worker_options, rank_options = placement(d)
        worker = ray.remote(RolloutWorker)
        self.workers = [worker.options(**o).remote(cfg_json) for o in worker_options]
        # Engines first: vLLM sizes its KV cache from the GPU memory free when it starts.
        ray.get([w.ready.remote() for w in self.workers])
        rank = ray.remote(LearnerRank)
        self.ranks = [rank.options(**o).remote(cfg_json) for o in rank_options]
        master = ray.get(self.ranks[0].rendezvous_address.remote())
        ray.get([r.start.remote(i, len(self.ranks), master) for i, r in enumerate(self.ranks)])
        self.weights_stale = True  # the workers' engines hold the base model until the first sync

    def rollout(self, examples: list[QAExample], params: SamplingParams,
                samples: int) -> tuple[list[Trajectory], dict[str, float]]:
        chunks = split_evenly(examples, len(self.workers))
        futures = [w.rollout.remote(chunk, worker_params(params, i), samples)
                   for i, (w, chunk) in enumerate(zip(self.workers, chunks, strict=True)) if chunk]
        parts = ray.get(futures)
        trajectories = [traj for part, _ in parts for traj in part]
        return trajectories, {"rollout_retrieval_wait_s": max(wait for _, wait in parts)}  # workers run side by side

    def learn(self, batch: RolloutBatch, iteration: int) -> dict[str, float]:
        batch_ref = ray.put(batch)  # one copy in the object store, read by every rank
        stats = ray.get([r.train_step.remote(batch_ref, iteration) for r in self.ranks])
        self.weights_stale = True
        return stats[0]  # all-reduced inside the update: every rank reports the same numbers

    def from_rank_0(self, method: str):
        """Rank 0's answer. Sharded (FSDP), gathering full tensors is a collective: every rank is asked, the others
        answer empty. Under DDP the ranks are identical and rank 0 alone is asked."""
        ranks = self.ranks if self.cfg.distributed.strategy == "fsdp" else self.ranks[:1]
        refs = [getattr(r, method).remote() for r in ranks]
        ray.wait(refs, num_returns=len(refs))
        return refs[0]

    def sync_weights(self) -> None:
        if self.weights_stale:
            weights = self.from_rank_0("policy_weights")
            ray.get([w.load_weights.remote(weights) for w in self.workers])
        self.weights_stale = False

    def state(self) -> dict:
        return ray.get(self.from_rank_0("state"))

    def load_state(self, state: dict) -> None:
        ref = ray.put(state)
        ray.get([r.load_state.remote(ref) for r in self.ranks])
        self.weights_stale = True

    def init_from(self, path: Path) -> None:
        ray.get([r.init_from.remote(str(path)) for r in self.ranks])
        self.weights_stale = True

    def close(self) -> None:
        for actor in self.workers + self.ranks:
            ray.kill(actor)


def split_evenly(items: list, parts: int) -> list[list]:
    """Contiguous, sizes differing by at most one: a group's prompts stay on one worker (G samples each)."""
    size, extra = divmod(len(items), parts)
    out, start = [], 0
    for i in range(parts):
        end = start + size + (i < extra)
        out.append(items[start:end])
        start = end
    return out


def worker_params(params: SamplingParams, worker: int) -> SamplingParams:
    return replace(params, seed=worker_seed(params.seed, worker))
