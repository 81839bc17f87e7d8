"""One typed config for a training run: YAML file + `section.key=value` overrides, every key checked.

Unknown keys are errors (a typo such as `kl.bta=0.1` must not silently train with the default), and every error
names the field.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from agent.settings import RolloutSettings
from trainer import registry
from trainer.reward import REWARDS


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


def registered(table: registry.Registry, name: str, *also: str) -> str:
    """`name` if it is registered in `table` (trainer.registry: declared there, so no algorithm module is imported)
    or one of `also`, else an error listing them all."""
    if name not in also and name not in table.names():
        raise ValueError(f"unknown {table.kind} {name!r}; registered: {', '.join((*table.names(), *also))}")
    return name


class DataConfig(Section):
    train: list[str] = ["nq:dev", "triviaqa:dev"]  # dataset:split; packaged NQ/TriviaQA or FlashRAG names
    eval: list[str] = ["nq:test", "triviaqa:test"]
    flashrag_root: Path | None = None
    subset: Literal["answerable", "full"] = "answerable"
    answerable_k: int = Field(5, ge=1)
    # Only the first N questions of each set are checked for answerability (a quick start on CPU). The first
    # eval_limit answerable held-out questions are the same as with a full scan whenever N covers them.
    scan_limit: int | None = Field(None, ge=1)
    eval_limit: int = Field(100, ge=1)  # held-out questions per eval dataset


class RetrieverConfig(Section):
    # A running server, or a list of replicas of one index (requests spread round-robin, failover when one is
    # down); None starts one on `index` for the run.
    url: str | list[str] | None = None
    index: Path = Path("artifacts/indexes/wiki-minilm-flat")
    topk: int = Field(3, ge=1)
    timeout_s: float = Field(30.0, gt=0)

    @model_validator(mode="after")
    def _urls_are_http(self) -> RetrieverConfig:
        from retriever.client import retrieve_endpoints

        if self.url is not None:
            retrieve_endpoints(self.url)  # raises ValueError naming the bad URL
        return self


class TrainSection(Section):
    iterations: int = Field(1000, ge=1)
    prompts_per_iteration: int = Field(512, ge=1)
    rollouts_per_prompt: int = Field(5, ge=1)
    mini_batch_size: int = Field(256, ge=1)  # trajectories per optimizer step
    micro_batch_size: int = Field(8, ge=1)  # trajectories per forward/backward (gradient accumulation)
    # Or micro-batches cut by tokens: > 0 packs each with rows of similar lengths up to this many tokens of decoder
    # pass (rows x (prompt width + their longest response), less a shared prefix run once), so short trajectories
    # go many to a pass and long ones few, with less padding; a row longer than this is a micro-batch of its own.
    # micro_batch_size is then unused. The gradient is the same either way (accumulation weighs each micro-batch by
    # its tokens or sequences). 0: micro_batch_size rows each.
    micro_batch_tokens: int = Field(0, ge=0)
    ppo_epochs: int = Field(1, ge=1)
    lr: float = Field(1e-6, gt=0)
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = Field(0.01, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    warmup_steps: int = Field(10, ge=0)  # AdamW steps of linear warm-up (trainer/schedule.py)
    # Or the authors' way: warm up over this share of `iterations`, the rate stepping once per iteration (verl's
    # lr_warmup_steps_ratio; 0.285 in their search recipe). Set warmup_steps to 0 with it.
    warmup_fraction: float | None = Field(None, gt=0, lt=1)
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.28, ge=0)
    aggregation: str = "token-mean"  # a registered loss aggregation (trainer/policy_loss.py)
    advantage: str = "grpo"  # a registered advantage estimator (trainer/advantages.py)
    normalize_adv_std: bool = True  # False: Dr. GRPO
    entropy_coef: float = Field(0.0, ge=0)
    # Recompute each decoder layer's activations in the backward pass instead of keeping them: activation memory
    # falls to the layers' inputs plus one layer's worth, for about one more forward pass of compute.
    gradient_checkpointing: bool = False
    # The learner's per-token log-probs, entropy and Top-k gathers run the LM head this many model tokens at a time,
    # recomputing each chunk's logits in the backward pass: at most chunk x V logits alive instead of every token's
    # (V = 151,936 for Qwen: ~0.6 MB per token in fp32). 0 = all of a micro-batch's tokens at once.
    logprob_chunk_tokens: int = Field(256, ge=0)
    # Rows of a micro-batch that begin alike (rollouts of one question: the prompt, and the documents too where they
    # searched alike) run those columns once through the decoder, the rest attending to its cached keys and values:
    # the same states and gradients for less compute. Micro-batches are then runs of the rows in lexicographic order
    # (rows sharing a prefix side by side), split where the decoder computes fewest tokens, instead of by length.
    # False (and always under FSDP, whose ranks must run the same passes): every row runs whole, length-sorted.
    share_prefix: bool = True
    # The gradient probe (trainer/gradient_probe.py: grad/pg_norm, grad/kl_norm, their cosine and ratio) on the first
    # optimizer step of iterations 1, 1 + N, 1 + 2N, ...; it costs one backward of the KL term alone per micro-batch of
    # that step. 10 keeps it near 4% of a one-mini-batch iteration (docs/metrics.md); 1 for a study; 0 off.
    grad_probe_every: int = Field(10, ge=0)
    # Truncated importance sampling between the rollout engine's log-probs and pi_old (trainer/rollout_correction.py):
    # each token's policy-gradient term weighted by min(pi_old / q, cap). None: off (the paper's and the authors'
    # setting; the CPU engines' fp32 gap is ~1e-3 nats). On for bf16 engines on GPUs, e.g. 2.0 (verl's default cap).
    tis_cap: float | None = Field(None, gt=0)
    tis_level: Literal["token", "sequence"] = "token"

    @field_validator("aggregation")
    @classmethod
    def _registered_aggregation(cls, name: str) -> str:
        return registered(registry.LOSS_AGGREGATIONS, name)

    @field_validator("advantage")
    @classmethod
    def _registered_advantage(cls, name: str) -> str:
        return registered(registry.ADVANTAGE_ESTIMATORS, name)

    @model_validator(mode="after")
    def _one_warmup(self) -> TrainSection:
        if self.warmup_fraction is not None and self.warmup_steps:
            raise ValueError(f"train.warmup_steps ({self.warmup_steps}) and train.warmup_fraction "
                             f"({self.warmup_fraction}) both set a warm-up: set train.warmup_steps=0 to use the fraction")
        return self


KL_OFF = "none"  # kl.estimator value for no KL term


class KLSection(Section):
    estimator: str = "topk"  # a registered KL estimator (trainer/kl.py), or "none"
    direction: Literal["reverse", "forward"] = "reverse"
    topk: int = Field(32, ge=0)
    beta: float = Field(0.001, ge=0)
    importance_weight: bool = True
    iw_clip: float | None = Field(None, gt=0)  # clamps the importance weight to at most this (biasing it)

    @field_validator("estimator")
    @classmethod
    def _registered_estimator(cls, name: str) -> str:
        return registered(registry.KL_ESTIMATORS, name, KL_OFF)

    @model_validator(mode="after")
    def _iw_clip_is_used(self) -> KLSection:
        """kl.iw_clip only where an importance weight is applied: never silently ignored."""
        if self.iw_clip is None:
            return self
        if self.estimator == KL_OFF or not registry.KL_ESTIMATORS.declaration(self.estimator).importance_weight:
            raise ValueError(f"kl.iw_clip is set but kl.estimator={self.estimator} applies no importance weight")
        if not self.importance_weight:
            raise ValueError("kl.iw_clip is set but kl.importance_weight=false turns the weight it clamps off")
        return self


class LoRASection(Section):
    """LoRA adapters (peft) on the policy: W = W0 + (alpha / rank) B A in each targeted Linear, W0 frozen, only A and
    B trained (trainer/learner/lora.py); the EMA anchor is then W0 + D with D the EMA of (alpha / rank) B A, exactly
    (trainer.ema.LoraEmaAnchor). A section of its own: `model` stays the plain name or folder it always was."""

    rank: int = Field(0, ge=0)  # 0 = off: full fine-tuning
    alpha: float = Field(32.0, gt=0)
    # Qwen2 / Llama / SmolLM2 names: every Linear of attention and MLP (not the LM head: the chunked log-probs run
    # it as a plain Linear).
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], min_length=1)
    # On the adapters' input, in train mode only: the update pass but not pi_old's, so above 0 the first PPO ratio is
    # no longer 1 (peft's dropout noise); 0 keeps the ratio exact.
    dropout: float = Field(0.0, ge=0, lt=1)


class EMASection(Section):
    tau: float = Field(0.9, ge=0, le=1)  # 1.0 = fixed reference (plain GRPO)
    period: int = Field(10, ge=1)  # iterations between anchor updates
    dtype: Literal["float32", "bfloat16"] = "float32"


class RewardSection(Section):
    name: str = "em"  # the metric that scores the answer, from trainer.reward.REWARDS (em, f1)
    format: float = Field(0.0, ge=0, lt=1)  # bonus for a well-formed trajectory; < 1 so it never beats a correct answer

    @field_validator("name")
    @classmethod
    def _known_reward(cls, name: str) -> str:
        return registered(REWARDS, name)


class SFTSection(Section):
    """The warm start: supervised training on protocol demonstrations (`emapg sft`)."""

    examples: int = Field(256, ge=1)  # demonstrations built from the (answerable) train questions
    epochs: int = Field(1, ge=1)
    lr: float = Field(5e-5, gt=0)
    batch_size: int = Field(8, ge=1)  # demonstrations per optimizer step
    micro_batch_size: int = Field(4, ge=1)
    warmup_steps: int = Field(4, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float = Field(1.0, gt=0)
    eval_questions: int = Field(20, ge=0)
    eval_every: int = Field(0, ge=0)
    min_format: float | None = Field(None, ge=0, le=1)
    min_em: float | None = Field(None, ge=0, le=1)

    @model_validator(mode="after")
    def _floors_need_an_evaluation(self) -> SFTSection:
        floors = [name for name in ("min_format", "min_em") if getattr(self, name) is not None]
        if floors and not self.eval_questions:
            raise ValueError(f"sft.{floors[0]} is a floor on the held-out evaluation, which sft.eval_questions=0 "
                             "turns off")
        return self


class DistributedSection(Section):
    """Scale-out (`distributed.backend=ray`): rollout workers and learner ranks as Ray actors under one driver loop,
    the same steps as the in-process default."""

    backend: Literal["none", "ray"] = "none"
    address: str | None = None  # None: start a local Ray cluster; "auto": join the one `ray start` made
    rollout_workers: int = Field(1, ge=1)  # one rollout engine each; prompts are split between them
    learner_ranks: int = Field(1, ge=1)  # torch.distributed world size (data parallel over micro-batches)
    # ddp: every rank holds policy, anchor and optimizer state whole; fsdp: sharded over the ranks (FSDP2)
    strategy: Literal["ddp", "fsdp"] = "ddp"
    gpus_per_rollout_worker: float = Field(0.0, ge=0)
    gpus_per_learner_rank: float = Field(0.0, ge=0)


class WandbSection(Section):
    """Weights & Biases, beside metrics.jsonl and TensorBoard (trainer/run/wandb_logger.py). offline: everything is
    written under the run folder (<run>/wandb/), no network; `wandb sync <run>/wandb/offline-run-*` uploads it later."""

    mode: Literal["disabled", "offline", "online"] = "disabled"
    project: str = "emapg"
    entity: str | None = None  # the W&B user or team; None: the logged-in user's default
    tags: list[str] = []


class LoggingSection(Section):
    wandb: WandbSection = WandbSection()


class CheckpointSection(Section):
    every: int = Field(10, ge=1)  # iterations
    keep: int = Field(2, ge=1)


class GuardSection(Section):
    """The training-health guard (trainer/run/guard.py). Non-finite steps are always skipped while it is on; the collapse
    rules below are checked every iteration (None turns one off). The defaults fire on NaNs and on clear collapses
    only, never on a healthy CPU demo or compare run (their per-iteration reward swings 0.09-0.52, entropy ~0.25)."""

    enabled: bool = True  # off: no step checks, no signals, no rules (the trainer as it was)
    # An optimizer step whose micro-batch loss or gradient norm is non-finite is skipped (no AdamW or scheduler step);
    # this many skipped steps in a row stop the run with an error naming the iteration and micro-batch.
    max_consecutive_skips: int = Field(3, ge=1)
    warmup_iterations: int = Field(10, ge=0)  # the reward rule waits this many iterations
    reward_window: int = Field(5, ge=1)  # iterations in the trailing mean of the reward
    # Collapse: the smoothed reward falls below this fraction of its running peak (after warm-up, once the peak
    # reached min_reward_peak: a run that never learned has nothing to collapse from).
    reward_drop: float | None = Field(0.2, gt=0, lt=1)
    min_reward_peak: float = Field(0.05, ge=0)
    entropy_min: float | None = Field(None, ge=0)  # nats per model token
    entropy_max: float | None = Field(6.0, gt=0)  # blow-up: a 135M-3B policy samples at ~0.2-2 nats per token
    # Drift: the entropy's trailing mean (reward_window iterations) above this x the run's first iteration's entropy,
    # after warm-up. Measured (trailing mean of 5 after iteration 10): the collapsed lr 8e-5 pilot of cpu_evidence
    # 5.8x; the healthy runs (the other two pilots, the 68 mechanism-study runs that did not collapse) at most 2.4x;
    # the mechanism study's 7 collapses 1.3-3.6x, which the reward rule catches (docs/benchmarks.md, guard section).
    entropy_rise: float | None = Field(4.0, gt=1)
    kl_max: float | None = Field(None, gt=0)  # KL to the anchor, per token
    clip_fraction_max: float | None = Field(None, gt=0, le=1)
    zero_variance_max: float | None = Field(None, gt=0, le=1)  # share of groups whose G rewards are all equal
    # When a rule fires: False logs a warning event and goes on; True restores the latest checkpoint (every saved
    # one passed the rules) with the learning rate x lr_decay, at most max_rollbacks times, then stops the run.
    rollback: bool = False
    lr_decay: float = Field(0.5, gt=0, le=1)
    max_rollbacks: int = Field(2, ge=0)


class TrainConfig(Section):
    name: str = "run"
    model: str = "smollm2-135m-instruct"
    dtype: Literal["float32", "bfloat16"] = "float32"
    # bfloat16: the trainer's forward/backward passes (SFT, pi_old, anchor, update) under CPU/GPU autocast; about 2x
    # faster on CPUs with AVX512-BF16 or AMX, but emulated (up to 55x slower) on CPUs without them. auto: bfloat16
    # where native, else none. Rollouts keep `dtype`; the sampler/trainer log-prob gap is logged.
    autocast: Literal["none", "bfloat16", "auto"] = "none"
    seed: int = 0
    out_dir: Path = Path("artifacts/runs")
    data: DataConfig = DataConfig()
    retriever: RetrieverConfig = RetrieverConfig()
    rollout: RolloutSettings = RolloutSettings()  # the agent's own settings (agent/settings.py)
    train: TrainSection = TrainSection()
    kl: KLSection = KLSection()
    ema: EMASection = EMASection()
    lora: LoRASection = LoRASection()
    reward: RewardSection = RewardSection()
    sft: SFTSection = SFTSection()
    distributed: DistributedSection = DistributedSection()
    checkpoint: CheckpointSection = CheckpointSection()
    guard: GuardSection = GuardSection()
    logging: LoggingSection = LoggingSection()

    @model_validator(mode="after")
    def _consistent(self) -> TrainConfig:
        batch = self.train.prompts_per_iteration * self.train.rollouts_per_prompt
        if batch % self.train.mini_batch_size:
            raise ValueError(
                f"train.mini_batch_size ({self.train.mini_batch_size}) must divide prompts_per_iteration x "
                f"rollouts_per_prompt ({batch})"
            )
        if self.train.mini_batch_size % self.train.micro_batch_size:
            raise ValueError(
                f"train.micro_batch_size ({self.train.micro_batch_size}) must divide train.mini_batch_size "
                f"({self.train.mini_batch_size})"
            )
        if self.sft.batch_size % self.sft.micro_batch_size:
            raise ValueError(
                f"sft.micro_batch_size ({self.sft.micro_batch_size}) must divide sft.batch_size ({self.sft.batch_size})"
            )
        d = self.distributed
        if self.lora.rank and d.strategy == "fsdp":
            raise ValueError(
                "lora.rank > 0 with distributed.strategy=fsdp is not supported (the LoRA anchor shares the frozen base "
                "with the policy, which FSDP would shard twice); use ddp: only the adapters' gradients are reduced"
            )
        if d.backend == "ray" and self.train.mini_batch_size % (self.train.micro_batch_size * d.learner_ranks):
            raise ValueError(
                f"distributed.learner_ranks ({d.learner_ranks}) x train.micro_batch_size ({self.train.micro_batch_size})"
                f" must divide train.mini_batch_size ({self.train.mini_batch_size})"
            )
        return self

    @property
    def run_dir(self) -> Path:
        return self.out_dir / self.name

    @property
    def sft_dir(self) -> Path:
        return self.run_dir / "sft"


class ConfigError(ValueError):
    """A bad config file or override; the message names the field."""


def apply_override(raw: dict, override: str) -> None:
    """`kl.beta=0.01` sets raw["kl"]["beta"] = 0.01 (the value parsed as YAML: numbers, bools, lists)."""
    key, sep, value = override.partition("=")
    if not sep or not key:
        raise ConfigError(f"override {override!r} is not key=value (e.g. kl.beta=0.01)")
    *parents, leaf = key.strip().split(".")
    node = raw
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"override {override!r}: {part} is not a section")
    node[leaf] = yaml.safe_load(value)


def load_config(path: Path | None = None, overrides: list[str] | None = None) -> TrainConfig:
    raw: dict = {}
    if path is not None:
        try:
            raw = yaml.safe_load(Path(path).read_text()) or {}
        except (OSError, yaml.YAMLError) as e:
            raise ConfigError(f"cannot read config {path}: {e}") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"config {path} must be a mapping of sections")
    for override in overrides or []:
        apply_override(raw, override)
    try:
        return TrainConfig.model_validate(raw)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'config'}: {err['msg']}" for err in e.errors())
        raise ConfigError(f"invalid config{f' {path}' if path else ''}: {problems}") from e
