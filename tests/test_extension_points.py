"""The extension points README promises, each exercised the way a user adds one: a fake one defined in one file
(this one, or a module written here), then run through the code that uses it, with nothing else edited. The fakes
are removed from their tables after each test. (The retrieval backend's is in tests/test_index_kinds.py, the arm's in
tests/test_extension_arm.py.)"""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch

from agent.trajectory import Trajectory
from data.qa import QA_DATASETS, QAExample, qa_dataset
from trainer.config import load_config
from trainer.registry import KL_ESTIMATORS


@pytest.fixture
def forget(monkeypatch):
    """Registrations made by a test, taken out of their table afterwards."""
    added: list[tuple[dict, str]] = []
    yield added.append
    for table, name in added:
        table.pop(name, None)


def test_a_kl_estimator_added_to_the_built_ins_module_needs_no_declaration(tmp_path, monkeypatch, forget):
    """A new built-in is one decorated function in the module the registry names (trainer/kl.py); here a module
    written by the test stands in for that file. The config's check finds the name by importing it."""
    module = tmp_path / "fake_kl_builtins.py"
    module.write_text(textwrap.dedent('''
        from trainer.registry import KLReads, register_kl_estimator

        @register_kl_estimator("fake-abs-log-ratio", KLReads("token", importance_weight=False))
        def fake_abs_log_ratio(x):
            return (x.token_logprob - x.ref_token_logprob.detach()).abs()
    '''))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(KL_ESTIMATORS, "defined_in", "fake_kl_builtins")
    forget((KL_ESTIMATORS.declared, "fake-abs-log-ratio"))
    forget((KL_ESTIMATORS.entries, "fake-abs-log-ratio"))
    forget((sys.modules, "fake_kl_builtins"))
    assert "fake-abs-log-ratio" not in KL_ESTIMATORS.names()

    cfg = load_config(overrides=["kl.estimator=fake-abs-log-ratio", "kl.importance_weight=false"])
    estimator = KL_ESTIMATORS.get(cfg.kl.estimator)
    from trainer.kl import KLInputs

    logprob = torch.tensor([-1.0, -2.0], requires_grad=True)
    kl = estimator.fn(KLInputs(token_logprob=logprob, ref_token_logprob=torch.tensor([-1.5, -1.0]),
                               tokens=torch.tensor([0, 1]), direction="reverse"))
    assert kl.tolist() == [0.5, 1.0] and estimator.reads.values == "token"
    with pytest.raises(Exception, match="unknown KL estimator 'fake-nope'"):
        load_config(overrides=["kl.estimator=fake-nope"])


def test_a_reward_added_in_one_file_scores_the_trajectory(forget):
    from trainer.reward import REWARDS, reward

    REWARDS.add("fake-length", lambda prediction, gold: float(prediction is not None and len(prediction) == 4))
    forget((REWARDS.declared, "fake-length"))
    forget((REWARDS.entries, "fake-length"))
    cfg = load_config(overrides=["reward.name=fake-length"])
    traj = Trajectory(uid="q#0", group_id="q", question="where?", golden_answers=("Paris",), prompt_ids=[1],
                      answer="Rome")
    score = reward(traj, name=cfg.reward.name)
    assert (score.reward, score.em) == (1.0, 0.0)  # the fake's score; EM is still EM


def test_a_qa_dataset_added_in_one_file_is_loaded_by_name_where_datasets_are_named(forget):
    from emapg.workflow import question_sets

    @qa_dataset("fake-capitals")
    def capitals(split: str, flashrag_root):
        return [QAExample(f"fake-capitals/{split}/{i}", "fake-capitals", split, f"capital of {c}?", (a,), "test")
                for i, (c, a) in enumerate((("France", "Paris"), ("Italy", "Rome"), ("Spain", "Madrid")))]

    forget((QA_DATASETS, "fake-capitals"))
    cfg = load_config(overrides=["data.subset=full", "data.scan_limit=2", "data.eval=[fake-capitals:test]"])
    sets = question_sets(cfg, cfg.data.eval, "test", client=None, tag="none")
    assert [ex.golden_answers for ex in sets["fake-capitals:test"]] == [("Paris",), ("Rome",)]
    with pytest.raises(ValueError, match="already registered"):
        qa_dataset("fake-capitals")(capitals)
