"""The transformers rollout backend (CPU default): a batched sampling loop over a KV cache.

Written out rather than calling `generate()` because the rollout needs, per row, the exact sampled ids, the
sampler's log-prob of each, and which stop string ended it; rows that finish leave the batch (and the cache),
so a long straggler does not make finished rows keep computing.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from agent.backend import FinishReason, Generation, SamplingParams


def sample_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its log-prob under the distribution it was drawn from (temperature, then top-p).
    Greedy (temperature 0) reports the log-prob under the untempered distribution."""
    logits = logits.float()
    if params.temperature == 0:
        logp = F.log_softmax(logits, dim=-1)
        tokens = logp.argmax(dim=-1)
        return tokens, logp.gather(-1, tokens[:, None])[:, 0]
    logits = logits / params.temperature
    if params.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(dim=-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass (the first always stays).
        drop_sorted = probs.cumsum(dim=-1) - probs >= params.top_p
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    logp = F.log_softmax(logits, dim=-1)
    tokens = torch.multinomial(logp.exp(), 1, generator=generator)[:, 0]
    return tokens, logp.gather(-1, tokens[:, None])[:, 0]


class TransformersBackend:
    def __init__(self, model, tokenizer, *, max_batch_size: int = 16):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.device = next(model.parameters()).device
        eos = tokenizer.eos_token_id
        self.eos_ids = {eos} if isinstance(eos, int) else set(eos or [])
        generation_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        if generation_eos is not None:
            self.eos_ids |= {generation_eos} if isinstance(generation_eos, int) else set(generation_eos)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else min(self.eos_ids)

    def generate(self, prompts: list[list[int]], params: SamplingParams, stop: list[str],
                 rows: list[int] | None = None) -> list[Generation]:
        """All rows draw from one generator seeded per call (`rows` is for per-row-seeded engines)."""
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        out: list[Generation] = []
        for start in range(0, len(prompts), self.max_batch_size):
            out += self._generate_batch(prompts[start : start + self.max_batch_size], params, stop, generator)
        return out

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy weights into the model it samples from. Tensors that are that model's own are skipped: in process the
        model is the trainer's policy itself, and there is nothing to copy."""
        own = self.model.state_dict(keep_vars=True)
        with torch.no_grad():
            for name, tensor in named_tensors:
                if tensor.data_ptr() != own[name].data_ptr():
                    own[name].copy_(tensor)

    def close(self) -> None:
        """Nothing to release: the model is the caller's."""

    def _stop_hit(self, ids: list[int], stop: list[str], window: int) -> str | None:
        # A stop string can only have been completed by the newest token, so decoding a short tail suffices.
        tail = self.tokenizer.decode(ids[-window:])
        return next((s for s in stop if s in tail), None)

    @torch.inference_mode()
    def _generate_batch(
        self, prompts: list[list[int]], params: SamplingParams, stop: list[str], generator: torch.Generator | None
    ) -> list[Generation]:
        n, width = len(prompts), max(len(p) for p in prompts)
        input_ids = torch.full((n, width), self.pad_id, dtype=torch.long, device=self.device)
        mask = torch.zeros((n, width), dtype=torch.long, device=self.device)
        for i, p in enumerate(prompts):  # left padding: every row's next token goes in the last column
            input_ids[i, width - len(p) :] = torch.tensor(p, device=self.device)
            mask[i, width - len(p) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        # Only the last position's logits are read: without logits_to_keep the prefill builds (rows, width, V) logits
        # (1.9 GB for 48 rows of 200 tokens at V = 49,152) and took 10x longer, measured in experiments/mechanism.
        output = self.model(input_ids=input_ids, attention_mask=mask, position_ids=positions, use_cache=True,
                            logits_to_keep=1)
        cache, logits = output.past_key_values, output.logits[:, -1]
        next_position = positions[:, -1] + 1

        window = max((len(s) for s in stop), default=0) + 2
        ids: list[list[int]] = [[] for _ in range(n)]
        logprobs: list[list[float]] = [[] for _ in range(n)]
        finish: list[FinishReason | None] = [None] * n
        stop_hit: list[str | None] = [None] * n
        rows = list(range(n))  # the prompts still generating, in batch order
        while True:
            tokens, token_logprobs = sample_tokens(logits, params, generator)
            still = []
            for j, row in enumerate(rows):
                ids[row].append(int(tokens[j]))
                logprobs[row].append(float(token_logprobs[j]))
                if ids[row][-1] in self.eos_ids:
                    finish[row] = "eos"
                elif (hit := self._stop_hit(ids[row], stop, window)) is not None:
                    finish[row], stop_hit[row] = "stop", hit
                elif len(ids[row]) >= params.max_tokens:
                    finish[row] = "length"
                else:
                    still.append(j)
            if not still:
                break
            if len(still) < len(rows):  # finished rows leave the batch and the KV cache
                keep = torch.tensor(still, device=self.device)
                cache.batch_select_indices(keep)
                mask, tokens, next_position = mask[keep], tokens[keep], next_position[keep]
                rows = [rows[j] for j in still]
            mask = torch.cat([mask, mask.new_ones((len(rows), 1))], dim=1)
            output = self.model(
                input_ids=tokens[:, None], attention_mask=mask, position_ids=next_position[:, None],
                past_key_values=cache, use_cache=True,
            )
            cache, logits = output.past_key_values, output.logits[:, -1]
            next_position = next_position + 1
        return [Generation(ids[i], logprobs[i], finish[i], stop_hit[i]) for i in range(n)]  # type: ignore[arg-type]
