"""How the learner runs: in one process, or data-parallel over torch.distributed ranks under DDP or FSDP2. Every rank
holds the same batch and takes every world_size-th micro-batch; these objects say how a rank's passes, gradients and
results meet the other ranks'. The learner asks the one it holds and never checks which it is."""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch import Tensor

from trainer.learner.logprobs import ResponseLogprobs


class OneProcess:
    """No other ranks: nothing to sum or wait for."""

    rank, world_size = 0, 1
    lockstep = False  # whether every rank must run every pass (a collective waits for each rank's)
    share_prefix = True  # whether a micro-batch may run its shared prefix as a pass of its own

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        """The module the learner's gradient passes go through."""
        return module

    def gradient_sync(self, module, enabled: bool):
        """Context for one backward: with `enabled` False, gradients only accumulate on this rank (all but its last
        micro-batch of a mini-batch); the last one's backward sums them over the ranks."""
        return nullcontext()

    def sum(self, *tensors: Tensor) -> None:
        """Each tensor summed over the ranks, in place."""

    def first_bad_micro_batch(self, mine: int | None, device: torch.device) -> int | None:
        """The first micro-batch of the mini-batch with a non-finite loss on any rank (`mine`: this rank's), so that
        every rank skips the same steps."""
        return mine

    def whole(self, value: Tensor) -> Tensor:
        """A value the ranks hold in shards (FSDP's gradient norm) as a plain tensor."""
        return value

    def reshard(self, *modules) -> None:
        """Free weights a sharded module keeps gathered after a forward pass without a backward."""


class DDP(OneProcess):
    """Every rank holds the whole policy; DistributedDataParallel sums the gradients in the last backward."""

    lockstep = True

    def __init__(self):
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        from torch.nn.parallel import DistributedDataParallel

        # DDP broadcasts rank 0's weights at construction, so every rank starts from the same policy.
        return DistributedDataParallel(module)

    def gradient_sync(self, module, enabled: bool):
        return nullcontext() if enabled else module.no_sync()

    def sum(self, *tensors: Tensor) -> None:
        for tensor in tensors:
            dist.all_reduce(tensor)

    def first_bad_micro_batch(self, mine: int | None, device: torch.device) -> int | None:
        sentinel = torch.iinfo(torch.int64).max
        first = torch.tensor([sentinel if mine is None else mine], device=device)  # NCCL reduces GPU tensors only
        dist.all_reduce(first, op=dist.ReduceOp.MIN)
        return None if int(first) == sentinel else int(first)


class FSDP(DDP):
    """Policy and anchor sharded over the ranks (`fsdp_logits`): the ranks gather each layer's weights together, so
    they run the same passes, and a shared prefix's extra pass is off."""

    share_prefix = False

    def wrap(self, module: torch.nn.Module) -> torch.nn.Module:
        return module  # sharded already

    def gradient_sync(self, module, enabled: bool):
        module.set_requires_gradient_sync(enabled)
        return nullcontext()

    def whole(self, value: Tensor) -> Tensor:
        return value.full_tensor()  # a DTensor

    def reshard(self, *modules) -> None:
        for module in modules:
            module.reshard()


def data_parallel(policy_logits: torch.nn.Module) -> OneProcess:
    """The strategy for this process: FSDP for a sharded `policy_logits` (from `fsdp_logits`), DDP with
    torch.distributed initialised, else one process."""
    if not (dist.is_available() and dist.is_initialized()):
        return OneProcess()
    return FSDP() if hasattr(policy_logits, "set_requires_gradient_sync") else DDP()


def fsdp_logits(model, temperature: float, mesh) -> ResponseLogprobs:
    """FSDP2 over `mesh`: each decoder layer is one unit (its full weights exist only during its forward and
    backward), the rest (embeddings, final norm, tied output layer) belongs to the root. The root is the
    ResponseLogprobs wrapper, not the causal LM: the learner never calls the LM's own forward, and FSDP gathers a
    root's weights in the root's forward."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.get_decoder().layers:
        fully_shard(layer, mesh=mesh)
    return fully_shard(ResponseLogprobs(model, temperature), mesh=mesh)
