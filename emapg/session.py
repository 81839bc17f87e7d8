"""One run's pieces, opened once and closed once: the retriever (a running one, or a server started on the index for
the run) and its index tag, the tokenizer, the policy and the rollout engine. `emapg train`, `eval`, `sft`,
`demo` and `compare` all hold their pieces in a Session:

    with open_session(cfg, log=run_dir / "server.log") as session:
        report = session.evaluate(held_out, name="base", out_dir=..., subset=..., policy=session.policy)
        engine = session.local_engine()          # trainer side: PolicyTrainer + the session's agent and backend

The policy and the engine are made on first use (vLLM loads the model from disk itself, so an evaluation of the base
model never loads a policy here), and closed with the session. Agents and backends come from agent.factory.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path

from agent.rollout import Mode, RolloutAgent
from eval.report import EvalReport
from trainer.config import TrainConfig


def index_tag(health) -> str:
    """A name for the served index (retriever.api.Health), recorded with every answerable subset made from it."""
    encoder = (health.encoder or "bm25").split("/")[-1]
    dtype = health.passage_dtype
    precision = f"-{dtype}" if dtype not in (None, "float32") else ""  # fp32 tags predate this field
    return f"{health.kind}-{encoder}-{health.index_factory or 'bm25'}{precision}-{health.num_docs}"


def served_index_tag(urls: Sequence[str]) -> str:
    """The index tag of the retriever replicas at `urls`, from their /health. The replicas that answer must serve
    the same index (another index would give other passages for the same query); one that is down is skipped,
    as the client fails over from it."""
    from retriever.client import RetrieverClient, RetrieverError, RetrieverUnavailable

    tags: dict[str, str] = {}
    down: list[str] = []
    for url in urls:
        # One replica at a time, no retries: a replica that is down is reported, not waited for.
        with RetrieverClient(url, timeout_s=10, retries=0) as replica:
            try:
                tags[url] = index_tag(replica.health())
            except RetrieverError as e:
                down.append(f"{url}: {e}")
    if not tags:
        raise RetrieverUnavailable(f"no retriever answers /health: {'; '.join(down)}")
    if len(set(tags.values())) > 1:
        served = ", ".join(f"{url} has {tag}" for url, tag in tags.items())
        raise ValueError(f"retriever replicas serve different indexes: {served}")
    return next(iter(tags.values()))


@contextmanager
def connect_retriever(cfg: TrainConfig, log: Path | None = None) -> Iterator[tuple]:
    """(client, index tag) for a run: the server (or replicas) at cfg.retriever.url, else one started on
    cfg.retriever.index for the duration (its output to `log`); (None, "none") when rollout.mode is direct."""
    from retriever.client import RetrieverClient
    from retriever.process import running_server

    if cfg.rollout.mode == "direct":
        yield None, "none"
        return
    server = nullcontext(cfg.retriever.url) if cfg.retriever.url else running_server(cfg.retriever.index, log=log)
    with server as urls, RetrieverClient(urls, topk=cfg.retriever.topk, timeout_s=cfg.retriever.timeout_s) as client:
        yield client, served_index_tag(client.urls)


class Session:
    """The open pieces of one run (see the module's docstring). `client` is None in direct mode."""

    def __init__(self, cfg: TrainConfig, client, index_tag: str, tokenizer):
        self.cfg = cfg
        self.client = client
        self.index_tag = index_tag
        self.tokenizer = tokenizer
        self._policy = None
        self._backend = None

    @property
    def policy(self):
        """The policy in memory (cfg.model in cfg.dtype), loaded on first use; training updates it in place."""
        if self._policy is None:
            from agent.policy import load_policy

            self._policy = load_policy(self.cfg.model, dtype=self.cfg.dtype)
        return self._policy

    @property
    def backend(self):
        """The process's one rollout engine (agent.factory.open_backend), started on first use; training and every
        evaluation of the session share it. transformers samples from `policy` itself."""
        if self._backend is None:
            from agent.factory import open_backend
            from emapg.console import engine_output_to_log

            policy = self.policy if self.cfg.rollout.backend == "transformers" else self._policy
            if self.cfg.rollout.backend == "vllm":  # about a minute on a CPU, its output in the log: say so first
                from emapg.workflow import console

                console.print(f"starting the vLLM engine for {self.cfg.model} (about a minute on a CPU)")
            with engine_output_to_log():  # the engine's processes print around logging: into the run's log
                self._backend = open_backend(self.cfg.rollout, self.cfg.model, self.tokenizer, policy,
                                             dtype=self.cfg.dtype, seed=self.cfg.seed)
        return self._backend

    def agent(self, mode: Mode | None = None) -> RolloutAgent:
        """Rollouts with the run's settings (in `mode` if given) on the session's engine and retriever."""
        from agent.factory import make_agent

        settings = self.cfg.rollout if mode is None else self.cfg.rollout.with_mode(mode)
        return make_agent(self.backend, self.tokenizer, self.client, settings,
                          retriever_timeout_s=self.cfg.retriever.timeout_s)

    def local_engine(self, cfg: TrainConfig | None = None):
        """The in-process training engine over the session's policy, engine and agent; `cfg` (default: the
        session's) may differ in what the learner reads (a method's KL and anchor), not in the rollout."""
        from trainer.run.workers import LocalWorkers

        cfg = cfg or self.cfg
        if cfg.rollout != self.cfg.rollout:
            raise ValueError("a session's engine rolls out with the session's rollout settings: open another session")
        return LocalWorkers(cfg, self.policy, self.backend, self.agent())

    def evaluate(self, datasets: dict, *, name: str, out_dir: Path, subset: str, modes: Sequence[Mode] = ("agent",),
                 policy=None) -> EvalReport:
        """Greedy evaluation (eval.harness.evaluate) with the run's rollout shape. `policy`: a model in memory whose
        weights the engine samples from (copied in first: vLLM holds its own copy); None: the engine's own weights."""
        from eval.harness import evaluate

        if policy is not None:
            self.backend.load_weights(policy.named_parameters())
        return evaluate(self.agent, self.tokenizer, datasets, list(modes), model_name=name, subset=subset,
                        out_dir=out_dir)

    def close(self) -> None:
        if self._backend is not None:
            self._backend.close()
            self._backend = None


@contextmanager
def open_session(cfg: TrainConfig, *, log: Path | None = None) -> Iterator[Session]:
    """A Session for `cfg`: the retriever connected (started if cfg.retriever.url is None, its output to `log`), the
    tokenizer loaded; everything it opened is closed on exit, the engine before the server."""
    from agent.policy import load_tokenizer

    with connect_retriever(cfg, log=log) as (client, tag):
        session = Session(cfg, client, tag, load_tokenizer(cfg.model))
        try:
            yield session
        finally:
            session.close()
