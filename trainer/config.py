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
    """`name` if it is registered in `table` (a built-in declared in trainer.registry needs no algorithm module
    imported; any other name is looked for in the module that defines the built-ins) or one of `also`, else an error
    listing them all."""
    if name in also:
        return name
    try:
        table.check(name)
    except ValueError:
        raise ValueError(f"unknown {table.kind} {name!r}; registered: {', '.join((*table.names(), *also))}") from None
    return name


class DataConfig(Section):
    train: list[str] = Field(["nq:dev", "triviaqa:dev"], description="training question sets as dataset:split "
                             "(packaged nq/triviaqa, or FlashRAG names under flashrag_root)")
    eval: list[str] = Field(["nq:test", "triviaqa:test"], description="held-out question sets as dataset:split")
    flashrag_root: Path | None = Field(None, description="folder of FlashRAG JSONL files (<set>/<split>.jsonl); "
                                       "None: the packaged NQ and TriviaQA")
    subset: Literal["answerable", "full"] = Field("answerable", description="answerable: only questions whose gold "
                                                  "answer is in their top answerable_k passages; full: all")
    answerable_k: int = Field(5, ge=1, description="passages searched when a question's answerability is checked")
    # The first eval_limit answerable held-out questions are the same as with a full scan whenever N covers them.
    scan_limit: int | None = Field(None, ge=1, description="check only the first N questions of each set for "
                                   "answerability (a quick start on CPU); None: all")
    eval_limit: int = Field(100, ge=1, description="held-out questions per eval set (the first N)")


class RetrieverConfig(Section):
    url: str | list[str] | None = Field(None, description="a running retriever, or a list of replicas of one index "
                                        "(requests spread round-robin, failover when one is down); None: one is "
                                        "started on `index` for the run")
    index: Path = Field(Path("artifacts/indexes/wiki-minilm-flat"), description="the index folder a started "
                        "retriever serves")
    topk: int = Field(3, ge=1, description="documents per search")
    timeout_s: float = Field(30.0, gt=0, description="seconds per request to the retriever")

    @model_validator(mode="after")
    def _urls_are_http(self) -> RetrieverConfig:
        from retriever.client import retrieve_endpoints

        if self.url is not None:
            retrieve_endpoints(self.url)  # raises ValueError naming the bad URL
        return self


class TrainSection(Section):
    iterations: int = Field(1000, ge=1, description="RL iterations (rollouts, then updates)")
    prompts_per_iteration: int = Field(512, ge=1, description="questions rolled out per iteration")
    rollouts_per_prompt: int = Field(5, ge=1, description="trajectories per question (the GRPO group size)")
    mini_batch_size: int = Field(256, ge=1, description="trajectories per optimizer step")
    micro_batch_size: int = Field(8, ge=1, description="trajectories per forward/backward (gradient accumulation)")
    # The gradient is the same either way (accumulation weighs each micro-batch by its tokens or sequences).
    micro_batch_tokens: int = Field(0, ge=0, description=(
        "> 0: micro-batches cut by tokens instead: rows of similar lengths packed up to this many tokens of decoder "
        "pass (rows x (prompt width + their longest response), less a shared prefix run once), a longer row alone; "
        "micro_batch_size is then unused. 0: micro_batch_size rows each"))
    ppo_epochs: int = Field(1, ge=1, description="passes over each iteration's trajectories")
    lr: float = Field(1e-6, gt=0, description="AdamW learning rate")
    betas: tuple[float, float] = Field((0.9, 0.95), description="AdamW betas")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, gt=0, description="gradient norm clip per optimizer step")
    warmup_steps: int = Field(10, ge=0, description="AdamW steps of linear warm-up (trainer/schedule.py)")
    warmup_fraction: float | None = Field(None, gt=0, lt=1, description=(
        "or warm up over this share of `iterations`, the rate stepping once per iteration (the authors' way: verl's "
        "lr_warmup_steps_ratio, 0.285 in their search recipe); set warmup_steps to 0 with it"))
    clip_low: float = Field(0.2, ge=0, description="PPO ratio clip below 1")
    clip_high: float = Field(0.28, ge=0, description="PPO ratio clip above 1 (clip-higher)")
    aggregation: str = Field("token-mean", description="a registered loss aggregation (trainer/policy_loss.py)")
    advantage: str = Field("grpo", description="a registered advantage estimator (trainer/advantages.py)")
    normalize_adv_std: bool = Field(True, description="divide advantages by the group's std (false: Dr. GRPO)")
    entropy_coef: float = Field(0.0, ge=0, description="weight of an entropy bonus in the loss")
    gradient_checkpointing: bool = Field(False, description=(
        "recompute each decoder layer's activations in the backward pass: activation memory falls to the layers' "
        "inputs plus one layer's worth, for about one more forward pass of compute"))
    # V = 151,936 for Qwen: ~0.6 MB of logits per token in fp32.
    logprob_chunk_tokens: int = Field(256, ge=0, description=(
        "the learner's log-probs, entropy and Top-k gathers run the LM head this many model tokens at a time, "
        "recomputing each chunk's logits in the backward pass (at most chunk x vocabulary logits alive); 0: all of a "
        "micro-batch's tokens at once"))
    share_prefix: bool = Field(True, description=(
        "rows of a micro-batch that begin alike (one question's rollouts) run those columns once through the decoder, "
        "the rest attending to its cached keys and values: the same gradients for less compute; micro-batches are "
        "then runs of rows in lexicographic order. false (and always under FSDP): every row whole, length-sorted"))
    # 10 keeps the probe near 4% of a one-mini-batch iteration (docs/metrics.md).
    grad_probe_every: int = Field(10, ge=0, description=(
        "the gradient probe (trainer/gradient_probe.py: grad/pg_norm, grad/kl_norm, their cosine and ratio) on the "
        "first optimizer step of iterations 1, 1 + N, ...; one more backward of the KL term per micro-batch of that "
        "step; 1 for a study, 0 off"))
    # The paper's and the authors' setting is off; the CPU engines' fp32 gap is ~1e-3 nats.
    tis_cap: float | None = Field(None, gt=0, description=(
        "truncated importance sampling between the rollout engine's log-probs and pi_old "
        "(trainer/rollout_correction.py): each token's policy-gradient term weighted by min(pi_old / q, cap); None: "
        "off; for bf16 engines on GPUs e.g. 2.0 (verl's default cap)"))
    tis_level: Literal["token", "sequence"] = Field("token", description="the importance ratio of tis_cap per token "
                                                    "or per sequence")

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
    estimator: str = Field("topk", description="a registered KL estimator (trainer/kl.py: topk, k3, ...), or none")
    direction: Literal["reverse", "forward"] = Field("reverse", description="KL(policy || anchor) (reverse) or "
                                                     "KL(anchor || policy) (forward)")
    topk: int = Field(32, ge=0, description="the topk estimator's tokens per position")
    beta: float = Field(0.001, ge=0, description="weight of the KL term")
    importance_weight: bool = Field(True, description="weight the KL term by pi / pi_old (rollouts came from pi_old)")
    iw_clip: float | None = Field(None, gt=0, description="clamp the importance weight to at most this (biasing it)")

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
    B trained (trainer/lora.py); the EMA anchor is then W0 + D with D the EMA of (alpha / rank) B A, exactly
    (trainer.ema.LoraEmaAnchor). A section of its own: `model` stays the plain name or folder it always was."""

    rank: int = Field(0, ge=0, description="adapter rank; 0: off (full fine-tuning)")
    alpha: float = Field(32.0, gt=0, description="adapter scale numerator: updates are (alpha / rank) B A")
    # Not the LM head: the chunked log-probs run it as a plain Linear.
    target_modules: list[str] = Field(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], min_length=1,
        description="the Linears that get adapters (Qwen2 / Llama / SmolLM2 names: all of attention and MLP)")
    dropout: float = Field(0.0, ge=0, lt=1, description=(
        "dropout on the adapters' input, in train mode only (the update pass, not pi_old's): above 0 the first PPO "
        "ratio is no longer 1; 0 keeps it exact"))


class EMASection(Section):
    tau: float = Field(0.9, ge=0, le=1, description="anchor <- tau anchor + (1 - tau) policy; 1.0: a fixed "
                       "reference (plain GRPO)")
    period: int = Field(10, ge=1, description="iterations between anchor updates")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="the anchor's weights' dtype")


class RewardSection(Section):
    name: str = Field("em", description="the metric that scores the answer (trainer/reward.py: em, f1)")
    format: float = Field(0.0, ge=0, lt=1, description="bonus for a well-formed trajectory; < 1, so that it never "
                          "beats a correct answer")

    @field_validator("name")
    @classmethod
    def _known_reward(cls, name: str) -> str:
        return registered(REWARDS, name)


class SFTSection(Section):
    """The warm start: supervised training on protocol demonstrations (`emapg sft`)."""

    examples: int = Field(256, ge=1, description="demonstrations built from the (answerable) train questions")
    epochs: int = Field(1, ge=1, description="passes over the demonstrations")
    lr: float = Field(5e-5, gt=0, description="AdamW learning rate")
    batch_size: int = Field(8, ge=1, description="demonstrations per optimizer step")
    micro_batch_size: int = Field(4, ge=1, description="demonstrations per forward/backward")
    warmup_steps: int = Field(4, ge=0, description="steps of linear warm-up")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay")
    grad_clip: float = Field(1.0, gt=0, description="gradient norm clip per step")
    eval_questions: int = Field(20, ge=0, description="`emapg sft`'s held-out evaluation: the first N questions of "
                                "each data.eval set; 0: no evaluation")
    eval_every: int = Field(0, ge=0, description="evaluate the held-out slice every N steps too; 0: at the end only")
    min_format: float | None = Field(None, ge=0, le=1, description="floor on the final evaluation's valid-format "
                                     "share (protocol learned?): below it `emapg sft` exits 1; None: unchecked")
    min_em: float | None = Field(None, ge=0, le=1, description="floor on the final evaluation's held-out EM (answers "
                                 "learned?): below it `emapg sft` exits 1; None: unchecked")

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

    backend: Literal["none", "ray"] = Field("none", description="none: everything in this process; ray: actors")
    address: str | None = Field(None, description="the Ray cluster: None starts a local one; auto joins the one "
                                "`ray start` made")
    rollout_workers: int = Field(1, ge=1, description="rollout engines, one per worker; prompts are split between "
                                 "them")
    learner_ranks: int = Field(1, ge=1, description="torch.distributed world size (data parallel over "
                               "micro-batches)")
    strategy: Literal["ddp", "fsdp"] = Field("ddp", description="ddp: every rank holds policy, anchor and optimizer "
                                             "state whole; fsdp: sharded over the ranks (FSDP2)")
    gpus_per_rollout_worker: float = Field(0.0, ge=0, description="GPUs Ray reserves per rollout worker")
    gpus_per_learner_rank: float = Field(0.0, ge=0, description="GPUs Ray reserves per learner rank")


class WandbSection(Section):
    """Weights & Biases, beside metrics.jsonl and TensorBoard (trainer/run/wandb_logger.py). offline: everything is
    written under the run folder (<run>/wandb/), no network; `wandb sync <run>/wandb/offline-run-*` uploads it later."""

    mode: Literal["disabled", "offline", "online"] = Field("disabled", description=(
        "Weights & Biases: disabled, offline (files under the run folder's wandb/, no network) or online"))
    project: str = Field("emapg", description="the W&B project")
    entity: str | None = Field(None, description="the W&B user or team; None: the logged-in user's default")
    tags: list[str] = Field([], description="tags of the W&B run")


class LoggingSection(Section):
    wandb: WandbSection = Field(WandbSection(), description="Weights & Biases (trainer/run/wandb_logger.py)")


class CheckpointSection(Section):
    every: int = Field(10, ge=1, description="iterations between checkpoints")
    keep: int = Field(2, ge=1, description="checkpoints kept (the latest)")


class GuardSection(Section):
    """The training-health guard (trainer/run/guard.py). Non-finite steps are always skipped while it is on; the collapse
    rules below are checked every iteration (None turns one off). The defaults fire on NaNs and on clear collapses
    only, never on a healthy CPU demo or compare run (their per-iteration reward swings 0.09-0.52, entropy ~0.25)."""

    enabled: bool = Field(True, description="false: no step checks, no signals, no rules (the trainer as it was)")
    max_consecutive_skips: int = Field(3, ge=1, description=(
        "an optimizer step whose micro-batch loss or gradient norm is non-finite is skipped; this many in a row stop "
        "the run with an error naming the iteration and micro-batch"))
    warmup_iterations: int = Field(10, ge=0, description="iterations the reward and entropy-drift rules wait")
    reward_window: int = Field(5, ge=1, description="iterations in the trailing means of reward and entropy")
    reward_drop: float | None = Field(0.2, gt=0, lt=1, description=(
        "collapse: the smoothed reward falls below this fraction of its running peak (after warm-up, once the peak "
        "reached min_reward_peak); None: off"))
    min_reward_peak: float = Field(0.05, ge=0, description="the peak reward_drop needs: a run that never learned "
                                   "has nothing to collapse from")
    entropy_min: float | None = Field(None, ge=0, description="floor on the entropy, nats per model token; None: off")
    # A 135M-3B policy samples at ~0.2-2 nats per token.
    entropy_max: float | None = Field(6.0, gt=0, description="blow-up: entropy above this, nats per model token; "
                                      "None: off")
    # Measured (trailing mean of 5 after iteration 10): the collapsed lr 8e-5 pilot of cpu_evidence 5.8x; the healthy
    # runs (the other two pilots, the 68 mechanism-study runs that did not collapse) at most 2.4x; the mechanism
    # study's 7 collapses 1.3-3.6x, which the reward rule catches (docs/benchmarks.md, guard section).
    entropy_rise: float | None = Field(4.0, gt=1, description=(
        "drift: the entropy's trailing mean above this multiple of the first iteration's, after warm-up; None: off"))
    kl_max: float | None = Field(None, gt=0, description="KL to the anchor per token above this; None: off")
    clip_fraction_max: float | None = Field(None, gt=0, le=1, description="PPO clip fraction above this; None: off")
    zero_variance_max: float | None = Field(None, gt=0, le=1, description="share of groups whose rewards are all "
                                            "equal above this; None: off")
    rollback: bool = Field(False, description=(
        "when a rule fires: false logs a warning event and goes on; true restores the latest checkpoint (each saved "
        "one passed the rules) with the learning rate x lr_decay, at most max_rollbacks times, then stops the run"))
    lr_decay: float = Field(0.5, gt=0, le=1, description="learning-rate factor of each rollback")
    max_rollbacks: int = Field(2, ge=0, description="rollbacks before the run stops")


class TrainConfig(Section):
    name: str = Field("run", description="the run's name: its folder is out_dir/name")
    model: str = Field("smollm2-135m-instruct", description="the policy: smollm2-135m-instruct (packaged), a folder "
                       "or a hub id")
    dtype: Literal["float32", "bfloat16"] = Field("float32", description="the policy's weights' dtype")
    # About 2x faster on CPUs with AVX512-BF16 or AMX, but emulated (up to 55x slower) on CPUs without them.
    autocast: Literal["none", "bfloat16", "auto"] = Field("none", description=(
        "bfloat16: the trainer's passes (SFT, pi_old, anchor, update) under autocast; auto: bfloat16 where the CPU or "
        "GPU runs it natively, else none; rollouts keep `dtype` and the sampler/trainer log-prob gap is logged"))
    seed: int = Field(0, description="seeds sampling, the question order and initialisation")
    out_dir: Path = Field(Path("artifacts/runs"), description="where run folders are made")
    data: DataConfig = Field(DataConfig(), description="question sets")
    retriever: RetrieverConfig = Field(RetrieverConfig(), description="the retrieval service the agent searches")
    rollout: RolloutSettings = Field(RolloutSettings(), description="the agent's own settings (agent/settings.py)")
    train: TrainSection = Field(TrainSection(), description="the RL trainer: batch shape, optimizer, PPO loss")
    kl: KLSection = Field(KLSection(), description="the KL term to the anchor")
    ema: EMASection = Field(EMASection(), description="the EMA anchor")
    lora: LoRASection = Field(LoRASection(), description="LoRA adapters (off by default)")
    reward: RewardSection = Field(RewardSection(), description="the reward")
    sft: SFTSection = Field(SFTSection(), description="the SFT warm start (`emapg sft`)")
    distributed: DistributedSection = Field(DistributedSection(), description="scale-out over Ray")
    checkpoint: CheckpointSection = Field(CheckpointSection(), description="checkpoints")
    guard: GuardSection = Field(GuardSection(), description="the training-health guard")
    logging: LoggingSection = Field(LoggingSection(), description="loggers beside metrics.jsonl and TensorBoard")

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
