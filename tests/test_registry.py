"""Algorithms registered by name (trainer/registry.py): an estimator registered here, outside the trainer package, is
usable from the config by name and gives the loss it defines; unknown names are config errors listing the
registered ones; the names each module registers are the ones its registry declares (the config checks those without
importing the module); kl.iw_clip is refused where no importance weight would be clamped."""

from __future__ import annotations

import copy
import json
import subprocess
import sys

import pytest
import torch
from test_learner import make_learner, ragged_trajectories
from torch import Tensor

from trainer.learner.batch import collate
from trainer.learner.logprobs import response_logits
from trainer.config import ConfigError, load_config
from trainer.kl import KLInputs, gather_logprobs
from trainer.registry import KL_ESTIMATORS, KLReads, register_kl_estimator


@register_kl_estimator("test-squared-log-ratio", KLReads("token", importance_weight=False))
def squared_log_ratio(x: KLInputs) -> Tensor:
    """A KL estimator defined in a test module: (log pi_theta(p) - log pi_ref(p))^2 per token (twice k2)."""
    return (x.token_logprob.float() - x.ref_token_logprob.float().detach()).square()


def test_an_estimator_registered_in_a_test_module_is_usable_by_name(tiny_model, tokenizer):
    from trainer.advantages import broadcast_to_tokens
    from trainer.policy_loss import masked_mean, ppo_clip_loss

    assert load_config(overrides=["kl.estimator=test-squared-log-ratio"]).kl.estimator == "test-squared-log-ratio"
    trajs = ragged_trajectories(len(tokenizer))
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0])
    model = copy.deepcopy(tiny_model)
    learner = make_learner(model, 3, "token-mean", "test-squared-log-ratio", "kl.importance_weight=false")
    batch = collate(trajs, advantages, tokenizer.pad_token_id)
    batch = learner.prepare(batch)
    stats = learner.update(batch, torch.Generator().manual_seed(0))
    grad = torch.cat([p.grad.flatten() for p in model.parameters()])

    # The same loss by hand from the whole logits of both models: PPO-clip + beta (0.5) x the squared log-ratio.
    reference, mask, ids = copy.deepcopy(tiny_model), batch.loss_mask, batch.response_ids[..., None]
    logprob = gather_logprobs(response_logits(reference, batch), ids)[..., 0]
    with torch.no_grad():
        anchor = gather_logprobs(response_logits(learner.anchor_logits.model, batch), ids)[..., 0]
    kl = masked_mean((logprob - anchor).square(), mask)
    pg, _ = ppo_clip_loss(logprob, logprob.detach(), broadcast_to_tokens(advantages, mask), mask)
    (pg + 0.5 * kl).backward()
    full_grad = torch.cat([p.grad.flatten() for p in reference.parameters()])
    assert float(kl.detach()) > 1e-4  # the anchor differs from the policy: the term is not trivially 0
    assert stats["kl"] == pytest.approx(float(kl.detach()), rel=1e-5)
    torch.testing.assert_close(grad, full_grad, rtol=1e-4, atol=1e-5 * float(full_grad.abs().max()))


@pytest.mark.parametrize(("override", "listed"), [
    ("kl.estimator=k9", "registered: topk, exact, k1, k2, k3, k3pp, k4, k5, k3_clamped, topk_released"),
    ("train.aggregation=sum", "registered: token-mean, seq-mean-token-mean"),
    ("train.advantage=ppo-gae", "registered: grpo"),
])
def test_unknown_names_are_config_errors_listing_the_registered_ones(override, listed):
    field = override.split("=")[0]
    with pytest.raises(ConfigError, match=field) as error:
        load_config(overrides=[override])
    assert listed in str(error.value)
    if field == "kl.estimator":  # registered here, and the value that turns the term off
        assert "test-squared-log-ratio" in str(error.value) and "none" in str(error.value)


def test_a_name_is_registered_once():
    with pytest.raises(ValueError, match="already registered"):
        register_kl_estimator("k3", KLReads("token"))(squared_log_ratio)
    assert KL_ESTIMATORS.get("k3").fn is not squared_log_ratio


def in_fresh_process(code: str):
    """What `code` prints as JSON, run in a new interpreter (nothing of this test process imported)."""
    return json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def test_each_module_registers_exactly_the_names_its_registry_declares():
    """In a fresh interpreter: the names declared before any algorithm module is imported, against what importing
    trainer.kl, trainer.advantages and trainer.policy_loss registers (with the same KLReads: a mismatch fails the
    registration itself)."""
    code = (
        "import importlib, json\n"
        "from trainer import registry\n"
        "tables = (registry.KL_ESTIMATORS, registry.ADVANTAGE_ESTIMATORS, registry.LOSS_AGGREGATIONS)\n"
        "declared = [list(t.names()) for t in tables]\n"
        "for t in tables:\n"
        "    importlib.import_module(t.defined_in)\n"
        "print(json.dumps([declared, [list(t.entries) for t in tables]]))\n"
    )
    declared, registered = in_fresh_process(code)
    assert declared == registered


def test_a_lookup_imports_the_defining_module_and_a_declared_name_it_lacks_says_which_module():
    from trainer.registry import Registry

    table = Registry("KL estimator", "trainer.gradient_probe", {"k7": KLReads("token")})
    assert table.names() == ("k7",) and table.declaration("k7") == KLReads("token")
    with pytest.raises(ValueError, match="declared for trainer.gradient_probe, which does not register it"):
        table.get("k7")  # the module imports fine, and registers no k7
    with pytest.raises(ModuleNotFoundError, match="trainer.somewhere"):
        Registry("KL estimator", "trainer.somewhere", {"k7": KLReads("token")}).get("k7")
    with pytest.raises(ValueError, match="declared as .* but registered as"):
        table.add("k7", squared_log_ratio, KLReads("topk"))


def test_every_registry_resolves_its_entries_in_a_fresh_process_that_imported_only_the_registry():
    """The bug of issue 44: `ADVANTAGE_ESTIMATORS.get("grpo")` failed in any process that had not imported
    trainer.advantages (the viewer's); a lookup now imports it. Validating a config still imports no torch."""
    torch_after_config, found = in_fresh_process(
        "import json, sys\n"
        "from trainer.config import load_config\n"
        "load_config(overrides=['kl.estimator=k3'])\n"
        "torch_after_config = 'torch' in sys.modules\n"
        "from trainer import registry\n"
        "print(json.dumps([torch_after_config, [registry.ADVANTAGE_ESTIMATORS.get('grpo').__name__,\n"
        "    registry.KL_ESTIMATORS.get('k3').fn.__name__, registry.LOSS_AGGREGATIONS.get('token-mean').reduce.__name__]]))\n"
    )
    assert torch_after_config is False and all(found)


@pytest.mark.parametrize(("overrides", "reason"), [
    (["kl.estimator=exact"], "kl.estimator=exact applies no importance weight"),
    (["kl.estimator=none"], "kl.estimator=none applies no importance weight"),
    (["kl.estimator=test-squared-log-ratio"], "applies no importance weight"),
    (["kl.estimator=k3", "kl.importance_weight=false"], "kl.importance_weight=false"),
    (["kl.estimator=k3", "kl.iw_clip=0"], "kl.iw_clip"),
])
def test_iw_clip_where_no_importance_weight_is_clamped_is_a_config_error(overrides, reason):
    with pytest.raises(ConfigError, match="kl") as error:
        load_config(overrides=["kl.iw_clip=2", *overrides])
    assert reason in str(error.value) and "iw_clip" in str(error.value)


@pytest.mark.parametrize("estimator", ["topk", "topk_released", "k1", "k3", "k3_clamped"])
def test_iw_clip_is_accepted_by_the_estimators_that_weigh(estimator):
    assert load_config(overrides=[f"kl.estimator={estimator}", "kl.iw_clip=2"]).kl.iw_clip == 2
