"""Chunked log-probs (trainer.learner.logprobs): the same values and gradients as the whole logits through autograd, without
ever keeping a (tokens, V) block for the backward pass."""

from __future__ import annotations

import pytest
import torch

from trainer.learner.logprobs import token_logprobs

M, H, V = 37, 16, 300  # 37 tokens: chunks of 8 leave a ragged last chunk


def head_and_inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    head, ref_head = torch.nn.Linear(H, V, bias=False), torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g))
        ref_head.weight.copy_(head.weight + 0.3 * torch.randn(V, H, generator=g))
    hidden = torch.randn(M, H, generator=g)
    ref_hidden = hidden + 0.1 * torch.randn(M, H, generator=g)
    ids = torch.randint(0, V, (M, 5), generator=g)
    ids[:, 1] = ids[:, 0]  # a repeated id: its gradient must count twice
    return head, ref_head, hidden, ref_hidden, ids


def values_and_grads(chunk: int, direction: str, temperature: float, **options):
    head, ref_head, hidden, ref_hidden, ids = head_and_inputs()
    hidden.requires_grad_(True)
    out = token_logprobs(hidden, head, ids, temperature=temperature, chunk_tokens=chunk, entropy=True,
                         entropy_grad=True, reference=(ref_hidden, ref_head), direction=direction, **options)
    g = torch.Generator().manual_seed(1)  # arbitrary weights on every output: each backward term is checked
    loss = ((out.logprobs * torch.randn(M, 5, generator=g)).sum() + (out.entropy * torch.randn(M, generator=g)).sum()
            + (out.kl * torch.randn(M, generator=g)).sum())
    loss.backward()
    assert ref_head.weight.grad is None  # nothing reaches the reference
    return [out.logprobs, out.entropy, out.kl, hidden.grad, head.weight.grad]


@pytest.mark.parametrize("direction", ["reverse", "forward"])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 8, 64])
def test_chunked_values_and_gradients_equal_the_unchunked_ones(direction, temperature, chunk):
    for a, b in zip(values_and_grads(chunk, direction, temperature), values_and_grads(0, direction, temperature),
                    strict=True):
        torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-5)


def test_outputs_not_used_by_the_loss_add_nothing_to_the_gradient():
    head, _, hidden, _, ids = head_and_inputs()
    grads = []
    for entropy in (False, True):
        h = hidden.clone().requires_grad_(True)
        out = token_logprobs(h, head, ids, chunk_tokens=8, entropy=entropy)
        assert (out.entropy is None) == (not entropy)
        assert entropy is False or not out.entropy.requires_grad  # detached without entropy_grad
        out.logprobs.sum().backward()
        grads.append(h.grad)
    torch.testing.assert_close(grads[0], grads[1])


def test_topk_ids_and_logprobs_match_the_full_logits():
    head, _, hidden, _, ids = head_and_inputs()
    with torch.no_grad():
        chunked = token_logprobs(hidden, head, ids, chunk_tokens=8, topk=6)
        full = token_logprobs(hidden, head, ids, chunk_tokens=0, topk=6)
        logits = head(hidden)
        empty = token_logprobs(hidden, head, ids, chunk_tokens=8, topk=0)
    assert empty.topk_ids.shape == (M, 0) and empty.topk_logprobs.shape == (M, 0)
    assert torch.equal(chunked.topk_ids, full.topk_ids)
    assert torch.equal(chunked.topk_ids, logits.topk(6, dim=-1).indices)
    torch.testing.assert_close(chunked.topk_logprobs, torch.log_softmax(logits, -1).gather(-1, chunked.topk_ids))


def test_bfloat16_autocast_matches_the_unchunked_autocast_path():
    head, _, hidden, _, ids = head_and_inputs()
    results = []
    for chunk in (8, 0):
        h = hidden.clone().requires_grad_(True)
        head.weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = token_logprobs(h, head, ids, chunk_tokens=chunk, entropy=True, entropy_grad=True)
        assert out.logprobs.dtype == torch.float32 and out.entropy.dtype == torch.float32
        (out.logprobs.sum() + out.entropy.sum()).backward()
        assert head.weight.grad.dtype == torch.float32  # fp32 master weights get fp32 gradients
        results.append((out.logprobs.detach(), h.grad, head.weight.grad))
    for a, b in zip(*results, strict=True):  # the same bf16 matmuls; sums may round in a different order
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().max()))


def test_no_tokens_by_vocabulary_tensor_is_kept_for_the_backward_pass():
    """What autograd saves for the backward pass: the chunked path keeps the hidden states, the weight and a few
    numbers per token; the unchunked path (the check's control) keeps the whole (tokens, V) logits."""
    head, ref_head, hidden, ref_hidden, ids = head_and_inputs()
    hidden.requires_grad_(True)
    for chunk, expect_full_logits in ((8, False), (0, True)):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
            token_logprobs(hidden, head, ids, chunk_tokens=chunk, entropy=True, entropy_grad=True,
                           reference=(ref_hidden, ref_head))
        assert any(tuple(s) == (M, V) for s in saved) == expect_full_logits, saved
        assert max(torch.Size(s).numel() for s in saved) >= V * H  # the hook saw the head weight


def test_bad_arguments_are_refused_with_clear_messages():
    head, _, hidden, _, ids = head_and_inputs()
    with pytest.raises(ValueError, match="chunk_tokens must be >= 0"):
        token_logprobs(hidden, head, ids, chunk_tokens=-1)
    with pytest.raises(ValueError, match="direction must be one of"):
        token_logprobs(hidden, head, ids, direction="both")
    with pytest.raises(ValueError, match=r"hidden must be \(M, H\)"):
        token_logprobs(hidden, head, ids[:3])
    with pytest.raises(ValueError, match="no-grad passes"):
        token_logprobs(hidden.requires_grad_(True), head, ids, chunk_tokens=8, topk=4)
    biased = torch.nn.Linear(H, V)
    with pytest.raises(ValueError, match="nn.Linear without bias.*logprob_chunk_tokens=0"):
        token_logprobs(hidden, biased, ids, chunk_tokens=8)
