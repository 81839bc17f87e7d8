"""Faults during a real run (issue 34): a checkpoint write killed (SIGTERM, SIGKILL) or refused (a full disk), the
retriever killed and restarted mid-iteration, the vLLM engine process killed. Each test measures what the fault costs
(seconds to recover, searches failed or retried) and prints it; docs/benchmarks.md records the numbers."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from test_training import make_trainer, tiny_config

from trainer.run.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
)
from trainer.run.loop import resume_or_start

TESTS = Path(__file__).resolve().parent
ITERATIONS = 4


def same_runs(want_history, want_policy, got_history, got_policy) -> None:
    """The metrics and final policy weights of two runs of the same iterations, bit for bit."""
    assert len(want_history) == len(got_history)
    for want, got in zip(want_history, got_history, strict=True):
        for key in ("rollout/reward", "loss/policy", "kl/anchor", "loss/grad_norm", "kl/anchor_distance"):
            assert got[key] == want[key], key
    for (name, a), b in zip(want_policy.state_dict().items(), got_policy.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


@pytest.fixture(scope="module")
def straight_run(tmp_path_factory, tiny_model, tokenizer):
    """The tiny transformers-backend run of test_training, uninterrupted: its metrics and final policy."""
    trainer = make_trainer(tiny_config(tmp_path_factory.mktemp("straight"), f"train.iterations={ITERATIONS}"),
                           tiny_model, tokenizer)
    return trainer.run(), trainer.workers.learning.policy


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_a_run_killed_while_writing_a_checkpoint_resumes_from_the_previous_one(
        sig, tmp_path, tiny_model_dir, tiny_model, tokenizer, straight_run):
    """The run in a child process, killed as soon as iteration 3's checkpoint folder appears (mid-write: ~25 MB of
    weights and optimizer state still to write, hash and flush). The half-written folder stays hidden, iteration 2's
    checkpoint loads, and the resumed run equals the uninterrupted one."""
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from pathlib import Path
        from transformers import AutoModelForCausalLM, AutoTokenizer
        from test_training import make_trainer, tiny_config
        model = AutoModelForCausalLM.from_pretrained({str(tiny_model_dir)!r}).eval()
        tok = AutoTokenizer.from_pretrained({str(tiny_model_dir)!r})
        make_trainer(tiny_config(Path({str(tmp_path)!r}), "train.iterations={ITERATIONS}"), model, tok).run()
    """)
    checkpoints = tmp_path / "run" / "checkpoints"
    writing = checkpoints / ".iter-000003.tmp"
    child = subprocess.Popen([sys.executable, "-c", script], cwd=TESTS.parent, stderr=subprocess.PIPE, text=True)
    try:
        while not writing.exists() and child.poll() is None:
            time.sleep(0.001)
        child.send_signal(sig)
    finally:
        _, stderr = child.communicate(timeout=300)
    assert child.returncode == -sig, stderr[-2000:]
    assert not (checkpoints / "iter-000003").exists()  # killed mid-write: no iteration 3 under a checkpoint's name
    assert latest_checkpoint(tmp_path / "run").name == "iter-000002"

    start = time.perf_counter()
    resumed = make_trainer(tiny_config(tmp_path, f"train.iterations={ITERATIONS}"), tiny_model, tokenizer)
    resume_or_start(resumed, resume=True, init=None)
    assert resumed.iteration == 2
    tail = resumed.run()
    print(f"\nFAULT checkpoint-write-{sig.name}: resumed from iteration 2, 1 iteration redone, "
          f"{time.perf_counter() - start:.1f} s to resume and finish")
    assert not writing.exists()  # the next save cleared what the killed one left
    history, policy = straight_run
    same_runs(history[2:], policy, tail, resumed.workers.learning.policy)


def small_checkpoint(iteration: int, floats: int):
    from test_config_checkpoint import make_ckpt

    ckpt = make_ckpt(iteration)
    ckpt.policy["padding"] = torch.zeros(floats)
    return ckpt


@pytest.fixture
def tiny_disk(tmp_path):
    """A 256 KiB tmpfs (root only; elsewhere the test is skipped): a disk that really fills up (ENOSPC)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(disk)], capture_output=True,
                             text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root): {mounted.stderr.strip()}")
    yield disk
    subprocess.run(["umount", str(disk)], check=True)


def test_a_checkpoint_that_does_not_fit_on_the_disk_is_refused_cleanly(tiny_disk):
    save_checkpoint(small_checkpoint(1, 1_000), tiny_disk)
    with pytest.raises(CheckpointError, match=r"could not write checkpoint .*iter-000002: .*No space left on device"):
        save_checkpoint(small_checkpoint(2, 100_000), tiny_disk)  # 400 KB of weights on a 256 KiB disk
    assert sorted(p.name for p in (tiny_disk / "checkpoints").iterdir()) == ["iter-000001"]  # nothing half-written
    assert load_checkpoint(latest_checkpoint(tiny_disk)).iteration == 1
    save_checkpoint(small_checkpoint(2, 1_000), tiny_disk)  # the disk's room came back with the failed save's removal
    assert latest_checkpoint(tiny_disk).name == "iter-000002"


QUESTION = "who wrote pride and prejudice?"
SEARCHES = ["pride and prejudice"]
MAX_OBS_TOKENS = 32  # short conversations: the memorising below takes seconds, not minutes


class KillingSearcher:
    """The real client (retriever.client.RetrieverClient, default retries and backoff), wrapped to kill the server
    just before search call number `kill_at` and restart it on the same port in the background, as an operator or a
    supervisor would; it records how many queries each call carried and whether it raised (the ground truth the
    trajectories' recorded failures are checked against)."""

    def __init__(self, client, server, index: Path, kill_at: int):
        self.client, self.server, self.index, self.kill_at = client, server, index, kill_at
        self.calls: list[tuple[int, bool]] = []  # (queries, answered)
        self.killed_at = self.healthy_at = self.answered_at = None
        self.restart = None

    def _restart(self) -> None:
        from retriever.process import start_server

        port = int(self.server.url.rsplit(":", 1)[1])
        self.server = start_server(self.index, port=port)
        self.healthy_at = time.perf_counter()

    def search(self, queries, topk=None):
        import threading

        if len(self.calls) + 1 == self.kill_at:
            self.server.proc.kill()
            self.server.proc.wait()
            self.killed_at = time.perf_counter()
            self.restart = threading.Thread(target=self._restart)
            self.restart.start()
        try:
            hits = self.client.search(queries, topk)
        except Exception:
            self.calls.append((len(queries), False))
            raise
        self.calls.append((len(queries), True))
        if self.killed_at is not None and self.answered_at is None:
            self.answered_at = time.perf_counter()
        return hits


@pytest.fixture(scope="module")
def search_policy(tiny_model, tokenizer, bm25_index_dir):
    """The tiny model after memorising a one-search trajectory through the real (BM25: no encoder to load, so it
    restarts in seconds) server: it searches, then answers."""
    from conftest import memorise_search_trajectory

    from retriever.process import running_server

    with running_server(bm25_index_dir) as url:
        return memorise_search_trajectory(tiny_model, tokenizer, url, QUESTION, SEARCHES, "Jane Austen",
                                          MAX_OBS_TOKENS)


def test_a_retriever_killed_and_restarted_mid_iteration_loses_no_trajectory(
        tmp_path, search_policy, tokenizer, bm25_index_dir):
    """Iteration 1's search (the rollout's first turn generated, its search pending) finds the server killed; it
    restarts on the same port while the client retries (5 rounds, backoff 0.25 s doubling: ~8 s). Whatever the
    restart's timing, every trajectory is kept, the searches that failed are exactly those whose call the client gave
    up on, each is recorded on its turn and counted in `rollout/failed_searches`, and iteration 2 (after the
    restart) searches normally."""
    import copy

    from conftest import local_engine
    from test_training import first_token_reward

    from agent.failures import failed_searches
    from agent.trajectory import load_jsonl
    from data.qa import QAExample
    from retriever.client import RetrieverClient
    from retriever.process import start_server
    from trainer.run.loop import Trainer

    cfg = tiny_config(tmp_path, "train.iterations=2", "rollout.mode=agent", "rollout.max_turns=1",
                      "rollout.temperature=0", "rollout.max_tokens_per_turn=16",
                      f"rollout.max_obs_tokens={MAX_OBS_TOKENS}", "train.prompts_per_iteration=2",
                      "train.rollouts_per_prompt=2", "train.mini_batch_size=4", "train.micro_batch_size=4",
                      "rollout.max_in_flight=4")
    examples = [QAExample(f"nq/train/{i}", "nq", "train", QUESTION, ("Jane Austen",), "t") for i in range(2)]
    server = start_server(bm25_index_dir)
    with RetrieverClient(server.url) as client:
        searcher = KillingSearcher(client, server, bm25_index_dir, kill_at=1)
        policy = copy.deepcopy(search_policy)
        trainer = Trainer(cfg, local_engine(cfg, policy, tokenizer, retriever=searcher), tokenizer, examples,
                          reward_fn=first_token_reward)
        try:
            history = trainer.run(progress=lambda iteration, metrics: searcher.restart.join())
        finally:
            searcher.restart.join()
            searcher.server.stop()

    per_iteration = [list(load_jsonl(cfg.run_dir / "trajectories" / f"iter-{i:06d}.jsonl")) for i in (1, 2)]
    assert [len(trajs) for trajs in per_iteration] == [4, 4]  # every trajectory kept
    assert all(traj.turns[-1].kind in ("answer", "final") for trajs in per_iteration for traj in trajs)
    assert [t.query for t in per_iteration[1][0].turns if t.kind == "search"] == SEARCHES  # it does search
    failed = sum(n for n, answered in searcher.calls if not answered)
    assert failed_searches(per_iteration[0]) == failed == history[0]["rollout/failed_searches"]
    assert failed_searches(per_iteration[1]) == 0 == history[1]["rollout/failed_searches"]
    failed_turns = [t for trajs in per_iteration for traj in trajs for t in traj.turns if t.retrieval_error]
    assert all("unavailable" in t.retrieval_error and t.doc_ids == [] for t in failed_turns)
    print(f"\nFAULT retriever-restart: server healthy again {searcher.healthy_at - searcher.killed_at:.1f} s after "
          f"the kill; first answered search {(searcher.answered_at or float('nan')) - searcher.killed_at:.1f} s after; "
          f"{failed} of {sum(n for n, _ in searcher.calls)} searches failed (recorded, counted); trajectories lost: 0")


def engine_processes():
    """This process's vLLM engine processes (EngineCore and its workers)."""
    import psutil

    return [p for p in psutil.Process().children(recursive=True) if p.name().startswith("VLLM::")]


def test_a_killed_vllm_engine_stops_the_run_naming_it_and_resume_equals_an_uninterrupted_run(
        tmp_path, tokenizer):
    """The EngineCore process SIGKILLed (as the OOM killer would) during iteration 3's rollout, after iteration 2's
    checkpoint: the run stops at once with EngineDied naming the engine, not a hang; a fresh engine resumes from
    iteration 2 and iteration 3 equals an uninterrupted run's, bit for bit. One killed engine and one fresh one (a
    start-up each, the slow part: ~1-2 min on 2 cores)."""
    import copy

    from conftest import local_engine, tiny_llama
    from test_vllm_backend import parity_reward

    from agent.vllm_backend import EngineDied, VLLMBackend
    from data.qa import QAExample
    from trainer.config import load_config
    from trainer.run.loop import Trainer

    model = tiny_llama(tokenizer, hidden=128, heads=2, kv_heads=1)  # vLLM's CPU attention needs heads of >= 32
    folder = tmp_path / "model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    examples = [QAExample(f"toy/train/{i}", "toy", "train", f"question number {i}?", ("x",), "toy") for i in range(4)]

    def trainer_on(backend, run: str) -> Trainer:
        cfg = load_config(overrides=[
            f"out_dir={tmp_path}", f"name={run}", f"model={folder}", "rollout.backend=vllm", "rollout.mode=direct",
            "rollout.max_tokens_per_turn=8", "train.iterations=3", "train.prompts_per_iteration=2",
            "train.rollouts_per_prompt=2", "train.mini_batch_size=4", "train.micro_batch_size=2", "train.lr=0.01",
            "train.warmup_steps=0", "kl.topk=4", "ema.period=1", "checkpoint.every=1",
        ])
        return Trainer(cfg, local_engine(cfg, copy.deepcopy(model), tokenizer, backend), tokenizer, examples,
                       reward_fn=parity_reward)

    first = VLLMBackend(str(folder), dtype="float32", max_model_len=1024)
    processes = engine_processes()
    interrupted = trainer_on(first, "interrupted")
    generate = first.agenerate

    async def generate_then_die(*args, **kwargs):
        if interrupted.iteration == 3 and not killed:  # the first request of iteration 3's rollout
            killed.append(time.perf_counter())
            next(p for p in processes if p.name() == "VLLM::EngineCore").kill()
        return await generate(*args, **kwargs)

    killed: list[float] = []
    first.agenerate = generate_then_die
    try:
        with pytest.raises(EngineDied, match=r"vLLM engine for .*model died: its EngineCore process is gone"):
            interrupted.run()
        stopped_after = time.perf_counter() - killed[0]
    finally:
        first.close()
        for process in processes:  # a worker the dead EngineCore left behind
            if process.is_running():
                process.kill()
    assert latest_checkpoint(interrupted.cfg.run_dir).name == "iter-000002"

    start = time.perf_counter()
    second = VLLMBackend(str(folder), dtype="float32", max_model_len=1024)
    restarted_after = time.perf_counter() - start
    try:
        resumed = trainer_on(second, "interrupted")
        resume_or_start(resumed, resume=True, init=None)
        assert resumed.iteration == 2
        tail = resumed.run()
        straight = trainer_on(second, "straight")
        history = straight.run()
    finally:
        second.close()
    print(f"\nFAULT vllm-engine-killed: the run stopped {stopped_after:.1f} s after the kill; a new engine started in "
          f"{restarted_after:.0f} s; 1 iteration (4 trajectories) redone from iteration 2's checkpoint")
    same_runs(history[2:], straight.workers.learning.policy, tail, resumed.workers.learning.policy)
