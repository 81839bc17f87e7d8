"""`make compare` / `make evidence`: the paper's three rows from one SFT checkpoint.

    GRPO     fixed reference (ema.tau = 1), k3 KL
    EMA-k3   EMA anchor, k3 KL
    EMA-PG   EMA anchor, Top-k KL

All start from the same SFT weights with the same seeds, data order and budget; the only differences are `ema.tau`
and `kl.estimator`. Held-out EM is measured at the start (the SFT model, shared), every `eval_every` iterations and
at the end; at the end the EMA methods' anchors are evaluated too (GRPO's anchor is the SFT model itself). The final
evaluations are compared pairwise on the same questions (eval.paired: EM difference with a 95% CI, exact McNemar p),
against SFT and between methods. Writes <run>/compare.md, compare.json and compare.png (reward curves, held-out EM).

A job of hours must survive an interrupted session: run again, it picks up what is on disk (the SFT checkpoint,
finished evaluations, each method's latest checkpoint) and computes only the rest. A method whose evaluations are
all saved is read back without its checkpoints, so a run folder copied without them (to another machine) resumes
too; the SFT weights' sha256 is recorded at the first run and checked at every later one, so that a remade SFT
checkpoint that differs cannot pair its evaluations with another start's.
"""

from __future__ import annotations

import fcntl
import json
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from itertools import combinations
from pathlib import Path

from emapg.session import Session, open_session
from emapg.workflow import build_sft_data, console, eval_examples, print_iteration, run_sft, train_examples
from eval.paired import paired_em, per_question_em
from eval.report import EvalReport, plot_methods, pooled
from trainer.run.metrics_log import current_history, read_metrics
from trainer.methods import METHODS

SFT = "SFT"
START_FILE = "sft_start.json"  # in the run folder: the SFT checkpoint every result in it started from


def anchor_name(method: str) -> str:
    return f"{method} anchor"


def variant_config(cfg, name: str):
    """The run config of method `name` (trainer.methods.METHODS): its keys over `cfg`, in a run folder of its own."""
    return METHODS[name].config(cfg, run_name=f"{cfg.name}/{name.lower()}")


def held_out_eval(session: Session, weights: AbstractContextManager, test, name: str, out_dir: Path) -> dict:
    """Pooled held-out EM of the policy `weights` gives (entered only if needed), or of the evaluation an earlier
    (interrupted) run saved in `out_dir`."""
    if (row := saved_eval(out_dir)) is not None:
        console.print(f"{name}: reusing {out_dir / 'report.json'}")
        return row
    with weights as policy:
        return pooled(session.evaluate(test, name=name, out_dir=out_dir, subset="held-out", policy=policy))


def saved_eval(out_dir: Path) -> dict | None:
    """The pooled row of the evaluation an earlier run saved in `out_dir`, or None if it has none."""
    path = out_dir / "report.json"
    return pooled(EvalReport.load(path)) if path.exists() else None


def eval_points(eval_every: int, iterations: int) -> list[int]:
    """The iterations evaluated on held-out questions: every eval_every-th, and the last."""
    return sorted({*range(eval_every, iterations + 1, eval_every), iterations})


def anchor_eval_dir(run_dir: Path, iteration: int) -> Path:
    return run_dir / f"eval-anchor-{iteration:04d}"


def check_start(out: Path, init: Path) -> None:
    """The SFT checkpoint `init` must be the one the run folder's results started from: the first run records its
    policy weights' sha256 (from the checkpoint's manifest, which load_policy_weights has verified the files
    against) in <out>/sft_start.json, later runs compare."""
    from trainer.run.checkpoint import MANIFEST, resolve_checkpoint

    manifest = json.loads((resolve_checkpoint(init) / MANIFEST).read_text())
    sha256 = manifest["files"]["policy.safetensors"]["sha256"]
    path = out / START_FILE
    if not path.exists():
        path.write_text(json.dumps({"init": str(init), "policy_sha256": sha256}, indent=2) + "\n")
        return
    recorded = json.loads(path.read_text())
    if recorded["policy_sha256"] != sha256:
        raise ValueError(f"the SFT checkpoint {init} (policy sha256 {sha256[:12]}) is not the one the results in {out} "
                         f"started from ({recorded['init']}, {recorded['policy_sha256'][:12]}; {path}): pairing them "
                         "would compare two starts. Use that checkpoint, or a new run folder (name= or out_dir=)")


def saved_variant(name: str, vcfg, start: dict, eval_every: int) -> tuple[list[tuple[int, dict]], dict | None] | None:
    """A method every evaluation of which (its anchor's too) an earlier run saved: its results read back, with no
    engine, trainer or checkpoint needed. None while any is missing."""
    iterations = vcfg.train.iterations
    rows = {i: saved_eval(vcfg.run_dir / f"eval-{i:04d}") for i in eval_points(eval_every, iterations)}
    moving = not METHODS[name].fixed_reference
    anchor = saved_eval(anchor_eval_dir(vcfg.run_dir, iterations)) if moving else None
    if None in rows.values() or (moving and anchor is None):
        return None
    return [(0, start), *rows.items()], anchor


def run_variant(session: Session, cfg, name: str, sft_weights, train, test, start: dict,
                eval_every: int) -> tuple[list[tuple[int, dict]], dict | None]:
    """One method from the SFT weights (or its latest checkpoint), evaluated at `eval_points`; then its EMA anchor
    (None for a fixed reference: that is the SFT model, evaluated once for all methods)."""
    from transformers import set_seed

    from trainer.run.checkpoint import latest_checkpoint
    from trainer.run.loop import Trainer

    vcfg = variant_config(cfg, name)
    if (saved := saved_variant(name, vcfg, start, eval_every)) is not None:
        console.print(f"{name}: every evaluation is saved in {vcfg.run_dir}: reusing them")
        return saved
    set_seed(vcfg.seed)
    policy = session.policy
    policy.load_state_dict(sft_weights)
    engine = session.local_engine(vcfg)  # anchor starts at SFT
    trainer = Trainer(vcfg, engine, session.tokenizer, train)
    if (checkpoint := latest_checkpoint(vcfg.run_dir)) is not None:
        trainer.restore(checkpoint)
        console.print(f"{name}: resuming from {checkpoint}")
    points = [(0, start)]
    for iteration in eval_points(eval_every, vcfg.train.iterations):
        folder = vcfg.run_dir / f"eval-{iteration:04d}"
        if iteration > trainer.iteration:
            trainer.run(progress=print_iteration, until=iteration)
        # Evaluations before the resumed iteration were saved by the run that got there (their policies are gone).
        elif iteration < trainer.iteration and not (folder / "report.json").exists():
            raise FileNotFoundError(f"{folder / 'report.json'} is missing and iteration {iteration}'s policy is "
                                    f"gone (resuming at {trainer.iteration}): delete {vcfg.run_dir} to redo {name}")
        points.append((iteration, held_out_eval(session, nullcontext(policy), test, f"{name} @ {iteration}", folder)))
        console.print(f"{name} iteration {iteration}: held-out EM {points[-1][1]['em']:.3f}")
    if METHODS[name].fixed_reference:
        return points, None
    # The last checkpoint is the last iteration's, so an interrupted anchor evaluation resumes with its anchor.
    final = trainer.iteration
    anchor = held_out_eval(session, engine.anchor_as_policy(), test, f"{anchor_name(name)} @ {final}",
                           anchor_eval_dir(vcfg.run_dir, final))
    console.print(f"{anchor_name(name)} iteration {final}: held-out EM {anchor['em']:.3f}")
    return points, anchor


def work_minutes(logged: dict[str, list[dict]], held_out: dict[str, list[tuple[int, dict]]],
                 anchors: dict[str, dict] | None = None) -> float:
    """Training and evaluation time summed from the logs, which count the work of an interrupted earlier run too
    (a resumed run's wall time does not): every iteration's timed phases and every distinct evaluation (the
    anchors' included)."""
    training = sum(value for metrics in logged.values() for m in metrics
                   for key, value in m.items() if key.startswith("time/"))
    # Every variant's points start with the same SFT evaluation: count it once.
    start = next(iter(held_out.values()))[0][1]["seconds"]
    evaluations = start + sum(p["seconds"] for points in held_out.values() for _, p in points[1:])
    evaluations += sum(p["seconds"] for p in (anchors or {}).values())
    return (training + evaluations) / 60


def adamw_steps(metrics: list[dict]) -> int:
    """Optimizer steps a method took (its logged iterations, a resumed run's replays counted once; steps the guard
    skipped are not steps)."""
    return sum(m["loss/optimizer_steps"] for m in current_history(metrics))


def comparison_pairs(methods: list[str], anchors: list[str]) -> list[tuple[str, str]]:
    """(a, b) pairs reported as a - b: every method and anchor against SFT, every later method against every
    earlier one (trainer.methods.METHODS' order: EMA-PG - GRPO), and each anchor against its own policy."""
    pairs = [(name, SFT) for name in (*methods, *(anchor_name(m) for m in anchors))]
    pairs += [(later, earlier) for earlier, later in combinations(methods, 2)]
    return pairs + [(anchor_name(m), m) for m in anchors]


def paired_section(correct: dict[str, dict], pairs: list[tuple[str, str]]) -> tuple[list[str], list[dict]]:
    """The report's paired comparisons of per-question EM (model -> question -> correct, as eval.paired reads them):
    markdown lines and the same rows for compare.json."""
    from dataclasses import asdict

    from eval.seed_stats import holm

    lines = ["| A | B | n | EM A | EM B | A - B | 95% CI | A right, B wrong | B right, A wrong | McNemar p | "
             f"Holm p ({len(pairs)}) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    results = [paired_em(correct[a], correct[b]) for a, b in pairs]
    rows = []
    for (a, b), r, adjusted in zip(pairs, results, holm([r.p_value for r in results]), strict=True):
        lines.append(f"| {a} | {b} | {r.n} | {r.em_a:.3f} | {r.em_b:.3f} | {r.difference:+.3f} | "
                     f"{r.ci95[0]:+.3f} to {r.ci95[1]:+.3f} | {r.a_only} | {r.b_only} | {r.p_value:.3g} | "
                     f"{adjusted:.3g} |")
        rows.append({"a": a, "b": b, **asdict(r), "holm_p": adjusted})
    return lines, rows


def final_table(finals: dict[str, tuple[int, dict]], steps: dict[str, int], fixed: list[str]) -> list[str]:
    """The final evaluations (model -> (iteration, pooled row)) with the AdamW steps behind each model; a fixed
    reference's anchor is the SFT model and gets a line saying so."""
    lines = ["| model | iteration | AdamW steps | n | held-out EM | 95% CI | valid format |",
             "|---|---|---|---|---|---|---|"]
    for model, (iteration, p) in finals.items():
        lines.append(f"| {model} | {iteration} | {steps[model]} | {p['n']} | {p['em']:.3f} | "
                     f"{p['em_low']:.3f}-{p['em_high']:.3f} | {p['well_formed']:.2f} |")
    lines += [f"| {anchor_name(name)} | | | | = {SFT} | | |" for name in fixed]
    return lines


@contextmanager
def exclusive(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on `path` (made if missing) for the duration: other processes wait."""
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def seed_config(cfg, seed: int):
    """The run config of training seed `seed`: the same run in <run>/seed-<seed>/ (its methods in folders below)."""
    return cfg.model_copy(update={"seed": seed, "name": f"{cfg.name}/seed-{seed}"})


def declared_models(methods: list[str]) -> list[str]:
    """Every model a seed's final evaluation has: the SFT start, each method, each moving anchor."""
    return [SFT, *methods, *(anchor_name(m) for m in methods if not METHODS[m].fixed_reference)]


def default_family(methods: list[str]) -> list[tuple[str, str]]:
    """The comparisons declared when none are given: every later method against every earlier one (EMA-PG - GRPO)."""
    return [(later, earlier) for earlier, later in combinations(methods, 2)]


def seed_evaluations(cfg, methods: list[str], seeds: list[int]) -> dict[str, dict[int, Path]]:
    """model -> seed -> the folder of its final held-out evaluation, for the seeds that have it. The SFT start is
    the same model at every seed: one evaluation, shared."""
    evals: dict[str, dict[int, Path]] = {SFT: {seed: cfg.run_dir / "eval-sft" for seed in seeds}}
    for seed in seeds:
        for name in methods:
            vcfg = variant_config(seed_config(cfg, seed), name)
            final = vcfg.train.iterations
            folders = {name: vcfg.run_dir / f"eval-{final:04d}"}
            if not METHODS[name].fixed_reference:
                folders[anchor_name(name)] = anchor_eval_dir(vcfg.run_dir, final)
            for model, folder in folders.items():
                if (folder / "report.json").exists():
                    evals.setdefault(model, {})[seed] = folder
    return evals


def run_compare(cfg, init: Path | None, eval_every: int, methods: list[str], seeds: list[int] | None = None,
                comparisons: list[tuple[str, str]] | None = None) -> Path:
    """The methods from one SFT start. With `seeds`, once per training seed (each in <run>/seed-<s>/, resumable;
    processes running other seeds may share the folder once its SFT exists), and the plan (the models, the seeds and
    the comparisons: the family Holm corrects over) is written to <run>/plan.json before the first run; then
    <run>/seeds.md tests the methods across the seeds that have finished."""
    from agent.policy import load_policy
    from eval.seed_report import write_plan, write_seed_report
    from trainer.run.checkpoint import latest_checkpoint, load_policy_weights

    if cfg.lora.rank and not all(METHODS[name].fixed_reference for name in methods):
        raise ValueError("compare evaluates each EMA anchor with the policy's weights swapped for the anchor's; a "
                         "LoRA anchor (W0 + a dense delta) has no such weights: run compare with lora.rank=0")
    out = cfg.run_dir
    out.mkdir(parents=True, exist_ok=True)
    with open_session(cfg, log=out / "server.log") as session:
        client, tag = session.client, session.index_tag
        train, test = train_examples(cfg, client, tag), eval_examples(cfg, client, tag)
        # Processes running other seeds into the same folder: one at a time declares its seeds, makes the SFT start
        # and evaluates it; the others then find both on disk.
        with exclusive(out / ".setup.lock"):
            if seeds:
                write_plan(out, declared_models(methods), comparisons or default_family(methods), seeds)
            if init is None and latest_checkpoint(cfg.sft_dir) is not None:
                init = cfg.sft_dir  # an earlier run's SFT
                console.print(f"reusing the SFT checkpoint in {init}")
            if init is None:  # no SFT checkpoint given: make one, shared by every method (and every seed)
                console.rule("SFT warm start")
                init = run_sft(cfg, load_policy(cfg.model, dtype=cfg.dtype), session.tokenizer,
                               build_sft_data(cfg, client, session.tokenizer, train))
            sft_weights = load_policy_weights(init)
            check_start(out, init)
            session.policy.load_state_dict(sft_weights)
            # One engine for every method's rollouts and evaluations (the session's); the SFT start's evaluation is
            # the same for every seed (greedy), made once in <run>/eval-sft.
            start = held_out_eval(session, nullcontext(session.policy), test, SFT, out / "eval-sft")
        for run_cfg in [seed_config(cfg, seed) for seed in seeds] if seeds else [cfg]:
            begin = time.perf_counter()
            held_out: dict[str, list[tuple[int, dict]]] = {}
            anchors: dict[str, dict] = {}
            if run_cfg is not cfg:
                run_cfg.run_dir.mkdir(parents=True, exist_ok=True)
                check_start(run_cfg.run_dir, init)
            for name in methods:
                console.rule(name if run_cfg is cfg else f"{name}, seed {run_cfg.seed}")
                held_out[name], anchor = run_variant(session, run_cfg, name, sft_weights, train, test, start,
                                                     eval_every)
                if anchor is not None:
                    anchors[name] = anchor
            report = write_report(run_cfg, init, held_out, anchors, sum(len(v) for v in test.values()),
                                  (time.perf_counter() - begin) / 60, sft_eval=out / "eval-sft")
            if seeds:
                report = write_seed_report(out, seed_evaluations(cfg, methods, seeds))
                console.print(report.read_text())
    return report


def write_report(cfg, init: Path, held_out: dict[str, list[tuple[int, dict]]], anchors: dict[str, dict],
                 questions: int, wall_minutes: float, sft_eval: Path | None = None) -> Path:
    """compare.md, compare.json and compare.png from the methods' evaluation points (each starting with the shared
    SFT evaluation), their anchors' final evaluations, and what the run folders hold: the training logs and every
    final evaluation's trajectories, paired per question."""
    from trainer.run.guard import events_markdown, read_events
    from trainer.run.wandb_logger import attach_run_reports

    out = cfg.run_dir
    methods = list(held_out)
    runs = {name: variant_config(cfg, name) for name in methods}
    logged = {name: read_metrics(vcfg.run_dir / "metrics.jsonl") for name, vcfg in runs.items()}  # every attempt's
    curves = {name: current_history(rows) for name, rows in logged.items()}
    steps = {name: adamw_steps(metrics) for name, metrics in curves.items()}
    # The final evaluations, paired on the same questions: model -> (iteration, pooled row, its folder).
    finals = {SFT: (0, held_out[methods[0]][0][1], sft_eval or out / "eval-sft")}
    for name in methods:
        final, row = held_out[name][-1]
        finals[name] = (final, row, runs[name].run_dir / f"eval-{final:04d}")
        if name in anchors:
            finals[anchor_name(name)] = (final, anchors[name], anchor_eval_dir(runs[name].run_dir, final))
    correct = {model: per_question_em(folder) for model, (_, _, folder) in finals.items()}
    paired_lines, paired_rows = paired_section(correct, comparison_pairs(methods, list(anchors)))
    lines = [(f"From `{init}`; held-out: {questions} questions; wall time {wall_minutes:.0f} min (this run); "
              f"training and evaluation {work_minutes(logged, held_out, anchors):.0f} min (all runs, from the logs; "
              "SFT not counted)."), "",
             "| method | iteration | held-out EM | 95% CI | valid format | mean reward, last 5 iterations |",
             "|---|---|---|---|---|---|"]
    for name, points in held_out.items():
        last = curves[name][-5:]
        for iteration, p in points:
            tail = f"{sum(m['rollout/reward'] for m in last) / max(1, len(last)):.3f}" if iteration == points[-1][0] else ""
            lines.append(f"| {name} | {iteration} | {p['em']:.3f} | {p['em_low']:.3f}-{p['em_high']:.3f} | "
                         f"{p['well_formed']:.2f} | {tail} |")
    fixed = [name for name in methods if name not in anchors]  # GRPO: its reference is the SFT model
    lines += ["", "Final held-out evaluation: each method's last policy and, for the EMA methods, its EMA anchor "
              "(the fixed reference of GRPO is the SFT model itself). AdamW steps: the optimizer steps the method "
              "took (an anchor's are its method's).", "",
              *final_table({model: (it, p) for model, (it, p, _) in finals.items()},
                           {SFT: 0, **steps, **{anchor_name(name): steps[name] for name in anchors}}, fixed), "",
              f"Paired on the same {questions} questions, for these checkpoints (one training run of each method, "
              f"seed {cfg.seed}): A - B is the difference in EM, its 95% CI the Agresti-Min interval; McNemar p is "
              "the exact two-sided test on the questions exactly one of the two got right. Its noise is which "
              "questions were drawn, not how training went: it compares these checkpoints, not the methods "
              "(`emapg compare --seeds` tests methods across training seeds). Holm p adjusts McNemar's over the "
              f"{len(paired_rows)} comparisons of this table.", "", *paired_lines]
    for name, vcfg in runs.items():
        lines += ["", *events_markdown(vcfg.run_dir, title=f"{name} guard")]
    (out / "compare.md").write_text("\n".join(lines) + "\n")
    (out / "compare.json").write_text(json.dumps({
        "init": str(init), "methods": methods, "held_out": held_out, "anchors": anchors, "adamw_steps": steps,
        "final": {model: {"iteration": it, **p} for model, (it, p, _) in finals.items()}, "paired": paired_rows,
        "guard_events": {name: read_events(vcfg.run_dir) for name, vcfg in runs.items()}}, indent=2))
    plot_methods(curves, held_out, out / "compare.png")
    attach_run_reports(cfg, [out / name for name in ("compare.md", "compare.json", "compare.png")]
                       + sorted(out.glob("**/eval-*/report.*")) + sorted(out.glob("**/eval-*/em.png")))
    print("\n".join(lines))
    return out / "compare.md"
