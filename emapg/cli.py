"""`emapg`: the command line. The runs are here (evaluate, SFT, train, the demo, the comparison, the config they
read); the retrieval service's commands are in emapg/cli_retriever.py, those over a run's outputs in
emapg/cli_outputs.py, all on one Typer app (emapg/cli_common.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, get_args

import typer
from pydantic import BaseModel

from agent.settings import Mode, RolloutSettings
from emapg.cli_common import DEFAULT_INDEX, OVERRIDES, ConfigFile, MethodName, app, console, fail
from emapg.cli_options import model_options
from emapg.cli_retriever import index
from emapg.workflow import ARTIFACTS
from trainer.config import DataConfig, RetrieverConfig, TrainConfig, WandbSection


# `demo` and `compare` serve the config's retriever.index unless told another.
ConfigIndex = Annotated[Path | None, typer.Option("--index", help="index folder (built if missing); default: the "
                                                  "config's retriever.index")]


def _log_to(folder: Path) -> None:
    """The engine's logs into the run's folder (made here), unless the console is verbose (emapg/console.py)."""
    from emapg.console import log_to

    folder.mkdir(parents=True, exist_ok=True)
    log_to(folder)


@app.callback()
def global_options(
    verbose: Annotated[bool, typer.Option("--verbose", envvar="EMAPG_VERBOSE", help="show the engine's (vLLM's) "
                                          "logs on the console; by default they go to the run folder's emapg.log")] = False,
) -> None:
    """EMA-PG search agents: retrieval service, rollouts, training, evaluation."""
    from emapg.console import setup

    setup(verbose)


@app.command("eval")
@model_options("rollout", RolloutSettings, "max_turns", "max_tokens_per_turn", "max_obs_tokens", "max_in_flight",
               "backend")
@model_options("search", RetrieverConfig, "topk")
@model_options("data", DataConfig, "flashrag_root", "subset", "answerable_k", "eval_limit",
               flags={"eval_limit": "--limit"})
@model_options("wandb", WandbSection, "mode", "project", prefix="wandb-")
@model_options("run", TrainConfig, "model")
def eval_command(
    run: TrainConfig, rollout: RolloutSettings, search: RetrieverConfig, data: DataConfig, wandb: WandbSection,
    datasets: Annotated[str, typer.Option(help="comma-separated: nq, triviaqa, popqa, hotpotqa, 2wikimultihopqa, "
                                          "musique, bamboogle")] = "nq,triviaqa",
    split: Annotated[str, typer.Option(help="test, dev, or auto (test if the set has one, else dev)")] = "test",
    modes: Annotated[str, typer.Option(help="comma-separated: direct, rag, agent")] = "direct,rag,agent",
    retriever_url: Annotated[list[str] | None, typer.Option(help="a running retriever (repeat it for replicas of one "
                                                      "index); default: start one on --index")] = None,
    index_dir: Annotated[Path, typer.Option("--index", help="index to serve when no --retriever-url")] = DEFAULT_INDEX,
    out: Annotated[Path, typer.Option(help="report folder")] = ARTIFACTS / "eval" / "latest",
    checkpoint: Annotated[Path | None, typer.Option(help="a training checkpoint (or run folder) whose policy weights "
                                                   "replace --model's")] = None,
) -> None:
    """Exact match of a policy on QA benchmarks in direct, RAG and agent modes; writes a report and a chart."""
    arguments = {name: str(value) if isinstance(value, Path) else value for name, value in locals().items()
                 if not isinstance(value, BaseModel)} | {"model": run.model, "topk": search.topk,
                                                         "rollout": rollout.model_dump(mode="json"),
                                                         "data": data.model_dump(mode="json")}
    from emapg.session import open_session
    from emapg.workflow import answerable, load_datasets
    from retriever.client import retrieve_endpoints
    from trainer.run.checkpoint import CheckpointError, load_policy_weights
    from trainer.run.wandb_logger import attach_reports

    mode_list = [m.strip() for m in modes.split(",") if m.strip()]
    for m in mode_list:
        if m not in get_args(Mode):
            fail(f"--modes: unknown mode {m!r} ({', '.join(get_args(Mode))})")
    if retriever_url:
        try:
            retrieve_endpoints(retriever_url)
        except ValueError as e:
            fail(f"--retriever-url: {e}")
    retriever = search.model_copy(update={"url": retriever_url or None, "index": index_dir})
    try:
        sets = load_datasets([d.strip() for d in datasets.split(",") if d.strip()], split, data.flashrag_root)
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        fail(str(e))
    # The evaluation's whole configuration: the session opens what it names (a started server on --index without
    # --retriever-url; the policy only where it is sampled from in memory or carries a checkpoint).
    cfg = TrainConfig(model=run.model, retriever=retriever, rollout=rollout)
    _ensure_index(index_dir, retriever_url)  # after every option is checked: building the default takes minutes
    _log_to(out)
    limit, k = data.eval_limit, data.answerable_k
    with open_session(cfg) as session:
        tag = session.index_tag
        if data.subset == "answerable":
            sets = {name: answerable(examples, session.client, k, tag, f"{name}-{split}")
                    for name, examples in sets.items()}
        sets = {name: examples[:limit] for name, examples in sets.items()}
        policy = None  # vLLM loads --model itself
        if checkpoint is not None:
            policy = session.policy
            try:
                policy.load_state_dict(load_policy_weights(checkpoint))
            except (CheckpointError, RuntimeError) as e:
                fail(f"--checkpoint: {e}")
        label = f"{data.subset} subset (top-{k} of {tag}), first {limit}" if data.subset == "answerable" else (
            f"full {split} set, first {limit}")
        report = session.evaluate(sets, name=run.model, out_dir=out, subset=label, modes=mode_list, policy=policy)
    attach_reports(out, wandb, out.name, arguments, [out / "report.md", out / "report.json", out / "em.png"],
                   summary={f"em/{r.dataset}/{r.mode}": r.em for r in report.results}, job_type="eval")
    print(report.markdown())  # the Markdown source: readable as is, and wide tables do not get squeezed
    console.print(f"report: {out / 'report.md'}, chart: {out / 'em.png'}, trajectories: {out / 'trajectories'}")


def _resolved_config(config: Path | None, overrides: list[str], method: str | None = None):
    """The run's config: the YAML file, the key=value overrides, then the named arm of trainer/methods.py (whose
    keys an override may not also set: one of the two would be silently dropped)."""
    from trainer.config import ConfigError, load_config
    from trainer.methods import METHODS

    try:
        cfg = load_config(config, overrides)
    except ConfigError as e:
        fail(str(e))
    if method is None:
        return cfg
    chosen = METHODS.get({name.lower(): name for name in METHODS}.get(method.lower(), ""))
    if chosen is None:
        fail(f"--method: unknown method {method!r}; choose from {', '.join(METHODS)}")
    clashes = [o.partition("=")[0] for o in overrides if o.partition("=")[0].strip() in chosen.overrides]
    if clashes:
        fail(f"--method {chosen.name} sets {', '.join(clashes)} itself ({chosen.about}): drop the override or the "
             "method")
    try:
        return chosen.config(cfg)
    except ValueError as e:
        fail(f"--method {chosen.name}: {e}")


config_app = typer.Typer(help="The training config: every field with its value, default and help.",
                         no_args_is_help=True)
app.add_typer(config_app, name="config")


@config_app.command("show", context_settings=OVERRIDES)
def config_show(ctx: typer.Context, config: ConfigFile = None, method: MethodName = None) -> None:
    """Print the resolved config (the file, then key=value overrides, then --method) as YAML that loads back as a
    config: each field under its help and default, those that differ from their default marked `# changed`."""
    from emapg.config_show import commented_yaml

    print(commented_yaml(_resolved_config(config, list(ctx.args), method)))


def _run_config(ctx: typer.Context, config: Path | None, method: str | None = None):
    from transformers import set_seed

    cfg = _resolved_config(config, list(ctx.args), method)
    set_seed(cfg.seed)
    return cfg


def _train_questions(cfg, client, tag: str) -> list:
    from emapg.workflow import train_examples

    try:
        return train_examples(cfg, client, tag)
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))


# MiniLM passages per second on 2 cores with the default encoder (openvino) by the dtype `auto` gives: fp32 on CPUs
# without native bf16 (torch fp32 encodes ~21/s on CPUs without AVX-512, and the exported graph 1.2-1.5x that), bf16
# where native (~100/s on an AVX512-BF16 EPYC; docs/benchmarks.md, "Encoder backends").
DEFAULT_INDEX_RATE = {"float32": 32, "bfloat16": 100}
PACKAGED_PASSAGES = 10_033


def _ensure_index(index_dir: Path, retriever_url=None, needs_retriever: bool = True) -> None:
    """Make sure the run can start its retriever: nothing to do when it is given a running one (`retriever_url`) or
    needs none; the packaged-Wikipedia index is built once at the default place, saying first how long that takes;
    any other missing index is an error."""
    if retriever_url or not needs_retriever or (index_dir / "manifest.json").exists():
        return
    if index_dir.resolve() not in (DEFAULT_INDEX.resolve(), RetrieverConfig().index.resolve()):
        fail(f"no index at {index_dir} (no manifest.json): build it with `emapg index --out {index_dir}` or give a "
             "running retriever's URL")
    from retriever.encoder import resolve_backend, resolve_dtype

    backend = resolve_backend("auto", "cpu", "auto")
    dtype = resolve_dtype("auto", "cpu", backend)
    minutes = PACKAGED_PASSAGES / DEFAULT_INDEX_RATE[dtype] / 60
    console.rule(f"building the MiniLM index of {PACKAGED_PASSAGES:,} packaged Wikipedia passages in {index_dir} "
                 f"({backend}, {dtype}): about {minutes:.0f} minutes on 2 cores, once; later runs reuse it")
    index(out=index_dir)


@app.command(context_settings=OVERRIDES)
def sft(
    ctx: typer.Context,
    config: ConfigFile = None,
) -> None:
    """Warm start: build protocol demonstrations with the real retriever, then supervised training on their model
    tokens, then a held-out evaluation and a verdict (protocol learned? answers learned?), exiting 1 when a floor
    (sft.min_format, sft.min_em) is not met (docs/training.md). Writes <run>/sft/checkpoints/ for `emapg train
    --init`. Overrides as key=value, e.g. `sft.lr=1e-5`."""
    from emapg.session import open_session
    from emapg.sft_start import sft_start

    cfg = _run_config(ctx, config)
    if cfg.rollout.mode != "agent":
        fail("sft builds search demonstrations: rollout.mode must be agent")
    _ensure_index(cfg.retriever.index, cfg.retriever.url)
    _log_to(cfg.sft_dir)
    with open_session(cfg) as session:
        try:
            path, verdict = sft_start(cfg, session)
        except (ValueError, FileNotFoundError) as e:
            fail(str(e))
    for line in [] if verdict is None else verdict.lines:
        console.print(line, highlight=False)
    if verdict is not None and not verdict.ok:
        console.print(f"[bold red]the SFT start fails its floors:[/] {'; '.join(verdict.failures)} "
                      f"({cfg.sft_dir / 'evaluations.json'}); its checkpoint: {path}", highlight=False)
        raise typer.Exit(1)
    console.print(f"done: {path}; start RL with `emapg train --init {cfg.sft_dir}`")


@app.command(context_settings=OVERRIDES)
def train(
    ctx: typer.Context,
    config: ConfigFile = None,
    resume: Annotated[bool, typer.Option(help="continue the run from its latest checkpoint")] = False,
    init: Annotated[Path | None, typer.Option(help="start from this checkpoint's (or run folder's latest) policy, "
                                              "e.g. SFT's; the anchor starts equal to it")] = None,
    method: MethodName = None,
) -> None:
    """EMA-PG training, or another method by --method. Overrides follow the options as key=value, e.g.
    `kl.beta=0.01 ema.tau=1.0`."""
    from emapg.session import open_session
    from emapg.workflow import train_with_progress
    from trainer.run.checkpoint import CheckpointError
    from trainer.run.guard import GuardError, events_markdown
    from trainer.run.loop import Trainer, resume_or_start

    cfg = _run_config(ctx, config, method)
    _ensure_index(cfg.retriever.index, cfg.retriever.url, cfg.rollout.mode != "direct")
    _log_to(cfg.run_dir)
    with open_session(cfg) as session:
        client = session.client
        examples = _train_questions(cfg, client, session.index_tag)
        console.print(f"{len(examples):,} training questions; run folder {cfg.run_dir}")
        if cfg.distributed.backend == "ray":
            from trainer.run.ray_workers import RayWorkers

            # The actors reach the same retriever(s) as this driver: the URLs in use, including a started server's.
            cfg.retriever.url = client.urls if client is not None else None
            try:
                engine = RayWorkers(cfg)
            except NotImplementedError as e:
                fail(str(e))
            close = engine.close
        else:  # the session closes its engine
            engine, close = session.local_engine(), lambda: None
        trainer = Trainer(cfg, engine, session.tokenizer, examples)
        try:
            try:
                resume_or_start(trainer, resume, init)
            except (CheckpointError, FileNotFoundError, ValueError) as e:
                fail(str(e))
            try:
                train_with_progress(trainer, cfg.name)
            except GuardError as e:
                fail(f"{e} (events: {trainer.guard.events_path})")
        finally:
            close()
    console.print("\n".join(events_markdown(cfg.run_dir)))
    console.print(f"done: {cfg.run_dir} (metrics.jsonl, guard_events.jsonl, tb/, checkpoints/)")


@app.command(context_settings=OVERRIDES)
def demo(
    ctx: typer.Context,
    config: ConfigFile = Path("configs/cpu_demo.yaml"),
    index_dir: ConfigIndex = None,
) -> None:
    """The whole job on the CPU default: index, serve, evaluate the base model, SFT warm start, evaluate, EMA-PG,
    evaluate, report (table with 95% CIs, training curves). Overrides as key=value."""
    from emapg.demo import run_demo

    cfg = _run_config(ctx, config)
    cfg.retriever.index = index_dir or cfg.retriever.index
    _ensure_index(cfg.retriever.index, cfg.retriever.url)
    report = run_demo(cfg)
    console.print(f"report: {report}")


@app.command(context_settings=OVERRIDES)
def compare(
    ctx: typer.Context,
    config: ConfigFile = Path("configs/cpu_compare.yaml"),
    init: Annotated[Path | None, typer.Option(help="SFT checkpoint or run folder every method starts from; "
                                              "default: the run's own SFT (made first if missing)")] = None,
    eval_every: Annotated[int, typer.Option(min=1, help="held-out evaluation every N iterations and at the end")] = 10,
    methods: Annotated[str, typer.Option(help="comma-separated methods to run: GRPO (fixed reference, k3), EMA-k3 "
                                         "(EMA anchor, k3), EMA-PG (EMA anchor, Top-k)")] = "GRPO,EMA-k3,EMA-PG",
    index_dir: ConfigIndex = None,
    seeds: Annotated[str, typer.Option(help="comma-separated training seeds (e.g. 0,1,2,3): every method once per "
                                       "seed, and a report testing the methods across seeds (exact sign-flip, "
                                       "bootstrap, Holm); default: one run at the config's seed")] = "",
    comparisons: Annotated[str, typer.Option("--compare", help="with --seeds: the comparisons declared before the "
                                             "first run, A:B pairs, e.g. EMA-PG:GRPO,EMA-k3:GRPO; default: every "
                                             "later method against every earlier one")] = "",
) -> None:
    """The paper's rows from the same SFT checkpoint, same seeds and budget: GRPO (fixed reference, k3 KL), EMA-k3
    (EMA anchor, k3) and EMA-PG (EMA anchor, Top-k KL); held-out EM over training, the EMA anchors at the end, and
    paired tests against SFT and between methods. Resumes if run again. Overrides as key=value."""
    from emapg.compare import run_compare
    from trainer.methods import chosen_methods

    try:
        chosen = [method.name for method in chosen_methods(methods)]
        seed_list = [int(seed) for seed in seeds.split(",") if seed.strip()]
        declared = [tuple(pair.split(":")) for pair in comparisons.split(",") if pair.strip()]
    except ValueError as e:
        fail(f"--methods/--seeds: {e}")
    if len(set(seed_list)) != len(seed_list):
        fail(f"--seeds: {seeds!r} names a seed twice")
    if declared and not seed_list:
        fail("--compare declares comparisons across seeds: give --seeds too")
    for pair in declared:
        if len(pair) != 2 or not set(pair) <= set(chosen) or pair[0] == pair[1]:
            fail(f"--compare: {':'.join(pair)!r} must be A:B, two different methods of {chosen}")
    cfg = _run_config(ctx, config)
    cfg.retriever.index = index_dir or cfg.retriever.index
    _ensure_index(cfg.retriever.index, cfg.retriever.url, cfg.rollout.mode != "direct")
    _log_to(cfg.run_dir)
    try:
        report = run_compare(cfg, init, eval_every, chosen, seed_list or None, declared or None)
    except ValueError as e:  # e.g. a plan.json that declares another family
        fail(str(e))
    console.print(f"report: {report}")


import emapg.cli_outputs  # noqa: E402, F401 - its commands register on the app after the runs', listed last


def main() -> None:
    """The `emapg` command: the app, with a watchdog that stops its child processes when it ends (even by SIGKILL)."""
    from emapg.child_reaper import reap_children_at_exit

    reap_children_at_exit()
    app()


if __name__ == "__main__":
    main()
