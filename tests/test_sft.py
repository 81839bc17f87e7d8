"""The SFT warm start: demonstrations from the real server, the masked SFT loss, SFT training, `--init`."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from agent.protocol import format_hits, observation_ids, prompt_ids, prompt_text
from agent.trajectory import Trajectory, load_jsonl
from data.qa import QAExample
from data.qa import normalize_answer
from retriever.client import Hit, RetrieverClient
from trainer.config import load_config
from agent.demonstrations import build_demonstrations, gold_in_hits, keyword_query
from trainer.run.sft import SFTTrainer, sft_loss

MAX_OBS = 200
COMPARE_CONFIG = str(Path(__file__).resolve().parents[1] / "configs" / "cpu_compare.yaml")


def example(i: int, question: str, answer: str) -> QAExample:
    return QAExample(f"toy/train/{i}", "toy", "train", question, (answer,), "test")


@pytest.fixture(scope="module")
def questions(small_corpus) -> list[QAExample]:
    """Questions the small corpus answers (gold = a page title, shown in the top documents), one it cannot."""
    titles = [json.loads(line)["contents"].split("\n")[0].strip('"') for line in small_corpus.read_text().splitlines()]
    out = [example(0, "who wrote pride and prejudice?", "Jane Austen")]
    out += [example(i, f"what is {title}?", title) for i, title in enumerate(titles[1:9], 1)]
    return out + [example(99, "what is the qwzx plugh number?", "xyzzy frobnicate")]


@pytest.fixture(scope="module")
def demos(questions, server_url, tokenizer):
    with RetrieverClient(server_url) as client:
        return build_demonstrations(questions, client, tokenizer, topk=3, max_obs_tokens=MAX_OBS)


def spans(traj):
    """(masked, decoded text) runs of the response, in order."""
    out, start = [], 0
    for i in range(1, len(traj.response_ids) + 1):
        if i == len(traj.response_ids) or traj.loss_mask[i] != traj.loss_mask[start]:
            out.append((traj.loss_mask[start] == 0, traj.response_ids[start:i]))
            start = i
    return out


def test_keyword_query_drops_question_words():
    assert keyword_query("Who wrote the novel Pride and Prejudice?") == "wrote novel Pride Prejudice"


def test_gold_must_be_in_the_shown_part_of_its_document():
    hits = [Hit("1", '"A"\nnothing here', 1.0), Hit("2", '"B"\nthe answer is Paris', 0.5)]
    shown = format_hits(hits)
    assert gold_in_hits(["paris"], hits, shown) == (2, "paris")
    assert gold_in_hits(["paris"], hits, shown[: shown.index("Doc 2")]) is None  # truncated away
    assert gold_in_hits(["London"], hits, shown) is None


def test_demonstrations_keep_answers_out_of_masks_and_observations_in(demos, questions, tokenizer, server_url):
    trajectories, counts = demos
    assert counts["demonstrations"] == len(trajectories) >= 8
    assert counts["dropped_answer_not_shown"] >= 1  # the unanswerable question
    assert all(t.group_id != "toy/train/99" for t in trajectories)
    for traj in trajectories:
        ex = next(q for q in questions if q.id == traj.group_id)
        assert traj.prompt_ids == prompt_ids(tokenizer, prompt_text(ex.question))
        runs = spans(traj)
        assert [masked for masked, _ in runs] == [False, True] * traj.num_searches + [False]
        observations = [tokenizer.decode(ids) for masked, ids in runs if masked]
        model_text = "".join(tokenizer.decode(ids) for masked, ids in runs if not masked)
        # Observations: whole <information> blocks, nothing of the model's own text; the answer: model tokens only.
        assert all(o.startswith("\n\n<information>") and o.endswith("</information>\n\n") for o in observations)
        assert "<answer>" not in "".join(observations) and "<information>" not in model_text
        assert model_text.endswith(f"<answer> {traj.answer} </answer>")
        assert traj.answer in ex.golden_answers and traj.well_formed
        # The answer is readable in the last observation; a first search of two missed it.
        assert normalize_answer(traj.answer) in normalize_answer(observations[-1])
        if traj.num_searches == 2:
            assert normalize_answer(traj.answer) not in normalize_answer(observations[0])
    # Observation ids are exactly what a rollout appends for the same search.
    first = trajectories[0]
    with RetrieverClient(server_url) as client:
        hits = client.search([first.turns[0].query], 3)[0]
    turn = first.turns[0]
    assert first.response_ids[turn.end : turn.observation_end] == observation_ids(tokenizer, format_hits(hits), MAX_OBS)


def test_sft_loss_is_the_mean_nll_of_the_model_tokens_only(tiny_model, tokenizer):
    from trainer.learner.batch import collate
    from trainer.learner.logprobs import response_logits

    trajs = [Trajectory(uid="g#0", group_id="g", question="q", golden_answers=["a"], prompt_ids=[5, 6, 7])]
    trajs[0].append([11, 12], model=True, logprobs=[0.0, 0.0])
    trajs[0].append([13, 14, 15], model=False)
    trajs[0].append([16], model=True, logprobs=[0.0])
    batch = collate(trajs, torch.zeros(1), tokenizer.pad_token_id)
    model = copy.deepcopy(tiny_model)
    loss = sft_loss(response_logits(model, batch, only=batch.loss_mask), batch.response_ids[batch.loss_mask])
    # Reference: one full forward pass, the next-token NLL at the three model tokens only.
    ids = torch.tensor([[5, 6, 7, 11, 12, 13, 14, 15, 16]])
    logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    reference = -(logp[2, 11] + logp[3, 12] + logp[7, 16]) / 3
    torch.testing.assert_close(loss, reference, rtol=1e-5, atol=1e-5)


def sft_config(tmp_path, *overrides):
    return load_config(overrides=[
        f"out_dir={tmp_path}", "name=run", "sft.batch_size=4", "sft.micro_batch_size=2", "sft.lr=3e-3",
        "sft.warmup_steps=0", *overrides,
    ])


def test_sft_drives_the_masked_loss_down_and_init_starts_rl_there(demos, tiny_model, tokenizer, tmp_path):
    from trainer.learner.batch import collate
    from trainer.learner.logprobs import response_logits
    from conftest import local_engine

    fixed = demos[0][:4]
    cfg = sft_config(tmp_path, "sft.epochs=60")
    policy = copy.deepcopy(tiny_model)

    def loss_on_fixed_batch() -> float:
        batch = collate(fixed, torch.zeros(4), tokenizer.pad_token_id)
        with torch.no_grad():
            logits = response_logits(policy, batch, only=batch.loss_mask)
            return float(sft_loss(logits, batch.response_ids[batch.loss_mask]))

    before = loss_on_fixed_batch()
    checkpoint = SFTTrainer(cfg, policy, fixed, tokenizer.pad_token_id).run()
    after = loss_on_fixed_batch()
    assert after < 0.5 * before, (before, after)

    # --init: a fresh policy takes the SFT weights, and so does the anchor.
    rl_cfg = load_config(overrides=[f"out_dir={tmp_path}", "name=rl", "rollout.backend=transformers",
                                    "rollout.mode=direct"])
    rl_policy = copy.deepcopy(tiny_model)
    rl = local_engine(rl_cfg, rl_policy, tokenizer)
    rl.init_from(cfg.sft_dir)  # a run folder: its latest checkpoint
    assert checkpoint.parent == cfg.sft_dir / "checkpoints"
    for name, value in policy.state_dict().items():
        torch.testing.assert_close(rl.learning.policy.state_dict()[name], value, rtol=0, atol=0)
    for name, value in rl.learning.anchor.module.state_dict().items():
        torch.testing.assert_close(value, policy.state_dict()[name].float(), rtol=0, atol=0)


def e2e_overrides(questions, server_url, tiny_model_dir, tmp_path) -> list[str]:
    """A tiny run through the real server, its questions in a FlashRAG-format file. The transformers engine: vLLM's CPU
    attention refuses the tiny model's head size (test_vllm_backend.py runs the CLI on vLLM)."""
    root = tmp_path / "flashrag" / "bamboogle"
    root.mkdir(parents=True)
    (root / "test.jsonl").write_text("".join(
        json.dumps({"question": q.question, "golden_answers": list(q.golden_answers)}) + "\n" for q in questions))
    return [
        f"model={tiny_model_dir}", f"out_dir={tmp_path / 'runs'}", "name=e2e", f"retriever.url={server_url}",
        f"data.flashrag_root={tmp_path / 'flashrag'}", "data.train=[bamboogle:test]", "data.subset=full",
        "rollout.backend=transformers", "rollout.max_turns=1", "rollout.max_tokens_per_turn=4", "rollout.max_obs_tokens=64",
        "data.eval=[bamboogle:test]", "sft.eval_questions=3",
        "sft.examples=4", "sft.batch_size=2", "sft.micro_batch_size=1",
        "train.iterations=1", "train.prompts_per_iteration=2", "train.rollouts_per_prompt=2",
        "train.mini_batch_size=4", "train.micro_batch_size=2",
    ]


def emapg(tmp_path, *args: str, timeout: int = 1800) -> subprocess.CompletedProcess:
    """The CLI in a child process; `timeout` only guards against a hang (generous: no test depends on speed)."""
    env = {"EMAPG_ARTIFACTS": str(tmp_path / "artifacts"), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "emapg.cli", *args], capture_output=True, text=True, env=env,
                          timeout=timeout, check=False)


def test_sft_and_train_commands_end_to_end(questions, server_url, tiny_model_dir, tmp_path):
    """`emapg sft` then `emapg train --init` through the real server, with a FlashRAG-format question file."""
    common = e2e_overrides(questions, server_url, tiny_model_dir, tmp_path)
    sft = emapg(tmp_path, "sft", *common)
    assert sft.returncode == 0, sft.stdout + sft.stderr
    assert "protocol learned? unchecked (sft.min_format not set)" in sft.stdout  # floors are off by default
    run_dir = tmp_path / "runs" / "e2e"
    assert len(list(load_jsonl(run_dir / "sft" / "demonstrations.jsonl"))) == 4
    assert list((run_dir / "sft" / "checkpoints").glob("iter-000002"))
    train = emapg(tmp_path, "train", "--init", str(run_dir / "sft"), *common)
    assert train.returncode == 0, train.stdout + train.stderr
    assert list((run_dir / "checkpoints").glob("iter-000001"))
    # The same under Ray (a local cluster it starts): 2 rollout workers reaching the server, 2 gloo DDP learner ranks
    # starting from the SFT policy.
    ray_run = emapg(tmp_path, "train", "--init", str(run_dir / "sft"), *common, "name=e2e-ray",
                    "distributed.backend=ray", "distributed.rollout_workers=2", "distributed.learner_ranks=2",
                    "train.micro_batch_size=1")
    assert ray_run.returncode == 0, ray_run.stdout + ray_run.stderr
    metrics = [json.loads(line) for line in (tmp_path / "runs" / "e2e-ray" / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 1 and metrics[0]["loss/sampler_trainer_logprob_gap_max"] < 1e-3
    # A bad override is refused, naming the field.
    bad = emapg(tmp_path, "sft", *common, "sft.lrr=1")
    assert bad.returncode == 2 and "sft.lrr" in bad.stdout


def test_an_sft_start_that_cannot_learn_fails_its_floor_by_name(questions, server_url, tiny_model_dir, tmp_path):
    """A random tiny Llama after two SFT steps at a negligible rate writes no valid protocol: `emapg sft` records the
    loss curve and the held-out evaluations (every step and at the end), prints the verdict and exits 1 naming the
    floor and the measured value."""
    from typer.testing import CliRunner

    from emapg.cli import app

    common = e2e_overrides(questions, server_url, tiny_model_dir, tmp_path)
    result = CliRunner().invoke(app, ["sft", *common, "sft.lr=1e-12", "sft.eval_every=1", "sft.min_format=0.5"])
    out = " ".join(result.output.split())
    assert result.exit_code == 1, out
    assert "the SFT start fails its floors: sft.min_format = 0.5 not met: valid format 0.000" in out
    assert "protocol learned? NO: below sft.min_format = 0.5" in out and "answers learned? unchecked" in out
    sft_dir = tmp_path / "runs" / "e2e" / "sft"
    record = json.loads((sft_dir / "evaluations.json").read_text())
    assert [row["step"] for row in record["evaluations"]] == [1, 2] and record["evaluations"][-1]["n"] == 3
    assert record["verdict"]["ok"] is False and record["floors"] == {"min_format": 0.5, "min_em": None}
    assert len((sft_dir / "metrics.jsonl").read_text().splitlines()) == 2
    assert (sft_dir / "eval-step-000002" / "report.json").is_file()
    assert list((sft_dir / "checkpoints").glob("iter-000002"))  # the start is kept, to inspect


def test_sft_reports_every_step_with_its_loss(tiny_model, tokenizer, tmp_path):
    """The progress callback (the console's bar) is called once per step, in order, with that step's loss."""
    examples = [example(0, "who wrote pride and prejudice?", "Jane Austen"),
                example(1, "what is pride and prejudice?", "Pride and Prejudice")]
    retriever = FakeRetriever({"who wrote pride and prejudice": AUSTEN, "wrote pride prejudice": MISS,
                               "what is pride and prejudice": AUSTEN, "pride prejudice": AUSTEN})
    demos, _ = build_demonstrations(examples, retriever, tokenizer, topk=3, max_obs_tokens=MAX_OBS)
    cfg = sft_config(tmp_path, "sft.batch_size=2", "sft.micro_batch_size=1", "sft.epochs=3")
    calls = []
    trainer = SFTTrainer(cfg, copy.deepcopy(tiny_model), demos, tokenizer.pad_token_id)
    trainer.run(progress=lambda step, metrics: calls.append((step, metrics["loss/sft"])))
    assert [step for step, _ in calls] == [1, 2, 3] == list(range(1, trainer.steps + 1))
    logged = [json.loads(line)["loss/sft"] for line in (cfg.sft_dir / "metrics.jsonl").read_text().splitlines()]
    assert [loss for _, loss in calls] == logged and all(loss > 0 for loss in logged)


def test_compare_end_to_end_then_resumed_further(questions, server_url, tiny_model_dir, tmp_path):
    """`emapg compare` (SFT, then GRPO and EMA-PG with held-out evaluations and EMA-PG's anchor) through the real
    server; run again with a longer budget and all three methods it reuses the SFT checkpoint, every saved evaluation
    and each method's checkpoint, runs EMA-k3 from the start, and pairs the final evaluations."""
    common = [*e2e_overrides(questions, server_url, tiny_model_dir, tmp_path), "data.eval=[bamboogle:test]",
              "data.eval_limit=3"]
    first = emapg(tmp_path, "compare", "--config", COMPARE_CONFIG, "--eval-every", "1", "--methods", "GRPO,EMA-PG",
                  *common)
    assert first.returncode == 0, first.stdout + first.stderr
    out = tmp_path / "runs" / "e2e"
    before = json.loads((out / "compare.json").read_text())
    assert {name: [i for i, _ in points] for name, points in before["held_out"].items()} == \
        {"GRPO": [0, 1], "EMA-PG": [0, 1]}
    assert list(before["anchors"]) == ["EMA-PG"] and (out / "ema-pg" / "eval-anchor-0001" / "report.json").is_file()

    again = emapg(tmp_path, "compare", "--config", COMPARE_CONFIG, "--eval-every", "1", *common,
                  "train.iterations=2")
    assert again.returncode == 0, again.stdout + again.stderr
    for line in ("reusing the SFT checkpoint", "GRPO: resuming from", "GRPO @ 1: reusing", "EMA-PG @ 1: reusing"):
        assert line in again.stdout, again.stdout
    after = json.loads((out / "compare.json").read_text())
    for name in ("GRPO", "EMA-PG"):
        assert [i for i, _ in after["held_out"][name]] == [0, 1, 2]
        assert after["held_out"][name][:2] == before["held_out"][name]  # the saved evaluations, as they were
        metrics = (out / name.lower() / "metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["iteration"] for line in metrics] == [1, 2]
    assert [i for i, _ in after["held_out"]["EMA-k3"]] == [0, 1, 2]
    assert list(after["anchors"]) == ["EMA-k3", "EMA-PG"] and after["adamw_steps"] == {"GRPO": 2, "EMA-k3": 2,
                                                                                          "EMA-PG": 2}
    assert [(row["a"], row["b"]) for row in after["paired"]][:3] == [("GRPO", "SFT"), ("EMA-k3", "SFT"),
                                                                      ("EMA-PG", "SFT")]
    assert all(row["n"] == 3 for row in after["paired"])
    report = (out / "compare.md").read_text()
    assert (out / "compare.png").is_file() and "| EMA-PG | 2 |" in report and "| GRPO anchor | | | | = SFT" in report
    assert all(f"{name} guard" in report for name in ("GRPO", "EMA-k3", "EMA-PG"))  # its events
    # Given a running retriever, compare builds no index of its own (it used to build the full packaged one).
    assert not list(tmp_path.rglob("*.building")) and not (tmp_path / "artifacts" / "indexes").exists()
    assert "building the" not in first.stdout + again.stdout



# --- the demonstrations' exact text, pinned (a change of protocol text must be deliberate) -------------------------


class FakeRetriever:
    """A fake retriever for unit tests: fixed hits per query, as `RetrieverClient.search` returns them."""

    def __init__(self, hits: dict[str, list[Hit]]):
        self.hits = hits

    def search(self, queries: list[str], topk: int | None = None) -> list[list[Hit]]:
        return [self.hits.get(query, [])[:topk] for query in queries]


AUSTEN = [Hit("1", '"Bath"\nA city in England.', 2.0), Hit("2", '"Pride and Prejudice"\nA novel by Jane Austen.', 1.0)]
MISS = [Hit("3", '"Prejudice"\nA preconceived opinion.', 1.0)]
PINNED_OBS = ("Doc 1(Title: Bath) A city in England.\nDoc 2(Title: Pride and Prejudice) A novel by Jane Austen.",
              "Doc 1(Title: Prejudice) A preconceived opinion.")


def pinned_ids(tokenizer, pieces: list[tuple[str, str]]) -> list[int]:
    """The response ids of ("model", text) and ("observation", body) pieces, written out without agent.protocol's
    helpers: the text the demonstrations were made of before the protocol's text moved into one module."""
    ids: list[int] = []
    for kind, text in pieces:
        if kind == "model":
            ids += tokenizer.encode(text, add_special_tokens=False)
        else:
            ids += (tokenizer.encode("\n\n<information>", add_special_tokens=False)
                    + tokenizer.encode(text, add_special_tokens=False)[:MAX_OBS]
                    + tokenizer.encode("</information>\n\n", add_special_tokens=False))
    return ids


def test_demonstrations_are_the_pinned_text(tokenizer):
    examples = [example(0, "who wrote pride and prejudice?", "Jane Austen"),
                example(1, "what is pride and prejudice?", "Pride and Prejudice"),
                example(2, "what is the qwzx number?", "xyzzy")]
    retriever = FakeRetriever({"who wrote pride and prejudice": AUSTEN, "wrote pride prejudice": MISS,
                               "what is pride and prejudice": AUSTEN, "pride prejudice": AUSTEN})
    demos, counts = build_demonstrations(examples, retriever, tokenizer, topk=3, max_obs_tokens=MAX_OBS)
    assert counts == {"questions_seen": 3, "dropped_answer_not_shown": 1, "demonstrations": 2, "one_search": 1,
                      "two_search": 1}
    two, one = demos
    assert two.prompt_ids == prompt_ids(tokenizer, (
        "Answer the given question. Every time you get new information, first reason about it inside <think> and "
        "</think>. If you find you are missing some knowledge, you can call a search engine with <search> query "
        "</search>, and its top results will be returned between <information> and </information>. You may search "
        "as many times as you need. When no more outside knowledge is needed, give the answer inside <answer> and "
        "</answer> without a detailed explanation, for example <answer> Beijing </answer>. Question: who wrote pride "
        "and prejudice?\n"))
    assert two.response_ids == pinned_ids(tokenizer, [
        ("model", "<think> I need to look this up. </think>\n<search> wrote pride prejudice </search>"),
        ("observation", PINNED_OBS[1]),
        ("model", "<think> These documents do not give the answer. I will search again. </think>\n"
                  "<search> who wrote pride and prejudice </search>"),
        ("observation", PINNED_OBS[0]),
        ("model", "<think> Doc 2 has the answer. </think>\n<answer> Jane Austen </answer>"),
    ])
    assert one.response_ids == pinned_ids(tokenizer, [
        ("model", "<think> I need to look this up. </think>\n<search> what is pride and prejudice </search>"),
        ("observation", PINNED_OBS[0]),
        ("model", "<think> Doc 2 has the answer. </think>\n<answer> Pride and Prejudice </answer>"),
    ])
    assert [t.doc_ids for t in two.turns] == [["3"], ["1", "2"], []] and two.answer == "Jane Austen"


def test_mechanism_demonstrations_are_the_pinned_text(tokenizer):
    from experiments.mechanism.demos import build_demonstrations as mechanism_demonstrations
    from experiments.mechanism.kb import KBQuestion

    question = KBQuestion(example(5, "in which country was Ann born?", "England"), "birth_country",
                          ("where was Ann born", "which country is Bath in"), bridge="Bath")
    retriever = FakeRetriever({"where was Ann born": [Hit("7", '"Ann"\nAnn was born in Bath.', 1.0)],
                               "which country is Bath in": [Hit("1", '"Bath"\nBath is a city in England.', 1.0)]})
    (full,), _ = mechanism_demonstrations([question], retriever, tokenizer, topk=1, max_obs_tokens=MAX_OBS,
                                          full_rate=1.0, seed=0)
    (weak,), _ = mechanism_demonstrations([question], retriever, tokenizer, topk=1, max_obs_tokens=MAX_OBS,
                                          full_rate=0.0, seed=0)
    assert full.response_ids == pinned_ids(tokenizer, [
        ("model", "<search> where was Ann born </search>"), ("observation", "Doc 1(Title: Ann) Ann was born in Bath."),
        ("model", "<search> which country is Bath in </search>"),
        ("observation", "Doc 1(Title: Bath) Bath is a city in England."), ("model", "<answer> England </answer>"),
    ])
    assert weak.response_ids == pinned_ids(tokenizer, [
        ("model", "<search> where was Ann born </search>"), ("observation", "Doc 1(Title: Ann) Ann was born in Bath."),
        ("model", "<answer> Bath </answer>"),
    ])
