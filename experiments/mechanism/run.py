"""The mechanism study in one command; rerun it to resume (finished cells are skipped).

    python -m experiments.mechanism.run --out artifacts/mechanism                  # the whole sweep
    python -m experiments.mechanism.run --out artifacts/mechanism --seeds 0 --max-cells 6   # a slice of it
    python -m experiments.mechanism.run --out artifacts/mechanism --analyse-only

Steps, each reused from `--out` when already there: the knowledge base (kb/), its BM25 index (index/), the real
retrieval server (started for the run, stopped after), the SFT warm start (policy/sft/) and its held-out
evaluation (sft_eval.json), then every cell of the sweep not yet done (cells/<cell>/result.json), then the analysis
(summary.md, summary.json, curves.png, final.png). The study's setup is written to study.json on the first run; a
later run with a different setup is refused, so results made under two setups never mix.
"""

from __future__ import annotations

import hashlib
import json
import signal
import sys
import time
from pathlib import Path
from typing import Annotated

import typer

from experiments.mechanism.sweep import PRESETS, StudyConfig, grid, study_config

app = typer.Typer(add_completion=False)


def _floats(text: str | None) -> list[float] | None:
    return None if text is None else [float(x) for x in text.split(",")]


def _ints(text: str | None) -> list[int] | None:
    if text is None:
        return None
    if "-" in text:  # 0-4
        first, last = text.split("-")
        return list(range(int(first), int(last) + 1))
    return [int(x) for x in text.split(",")]


def check_setup(out: Path, study: StudyConfig) -> None:
    """Write study.json, or refuse a setup other than the one already there (naming the differing keys)."""
    path = out / "study.json"
    if not path.exists():
        out.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(study.setup(), indent=1))
        return
    saved = json.loads(path.read_text())
    if saved != study.setup():
        differing = [f"{section}.{key}" for section in saved for key in saved[section]
                     if saved[section][key] != study.setup().get(section, {}).get(key)]
        raise typer.BadParameter(f"{out} holds a study with another setup (differs in {', '.join(differing)}): use "
                                 "another --out, or the same preset")


def prepare_kb(out: Path, study: StudyConfig) -> None:
    from experiments.mechanism.kb import KBSpec, generate_kb, write_kb
    from retriever.bm25 import build_bm25_index

    if not (out / "kb" / "kb.json").exists():
        spec = KBSpec(**study.kb.model_dump())
        write_kb(generate_kb(spec), out / "kb")
    if not (out / "index" / "manifest.json").exists():
        build_bm25_index(out / "kb" / "corpus.jsonl", out / "index", overwrite=True)


def warm_start(out: Path, study: StudyConfig, tokenizer, client, train) -> dict:
    """The SFT checkpoint's weights (trained once, shared by every cell) and sft_eval.json."""
    from experiments.mechanism.demos import build_demonstrations
    from experiments.mechanism.policy import eval_settings, greedy_eval, tiny_policy
    from trainer.run.checkpoint import latest_checkpoint, load_policy_weights
    from trainer.config import load_config
    from trainer.run.sft import SFTTrainer

    s, p, r = study.sft, study.policy, study.rl
    cfg = load_config(overrides=[
        f"out_dir={out}", "name=policy", f"seed={p.init_seed}", f"sft.epochs={s.epochs}", f"sft.lr={s.lr}",
        f"sft.batch_size={s.batch_size}", f"sft.micro_batch_size={s.batch_size}", f"sft.warmup_steps={s.warmup_steps}",
    ])
    policy = tiny_policy(tokenizer, p)
    if latest_checkpoint(cfg.sft_dir) is None:
        demos, counts = build_demonstrations(train[: s.demonstrations], client, tokenizer, topk=r.retriever_topk,
                                             max_obs_tokens=r.max_obs_tokens, full_rate=s.full_rate, seed=p.init_seed)
        cfg.sft_dir.mkdir(parents=True, exist_ok=True)
        (cfg.sft_dir / "demonstrations.json").write_text(json.dumps(counts, indent=1))
        trainer = SFTTrainer(cfg, policy, demos, tokenizer.pad_token_id)
        print(f"SFT: {trainer.steps} steps on {len(demos)} demonstrations {counts}", flush=True)
        start = time.perf_counter()
        trainer.run(progress=lambda step, m: step % 50 == 0 and print(f"  SFT step {step} loss {m['loss/sft']:.3f}",
                                                                       flush=True))
        print(f"SFT done in {time.perf_counter() - start:.0f} s", flush=True)
    weights = load_policy_weights(cfg.sft_dir)
    check_sft_start(out, latest_checkpoint(cfg.sft_dir) / "policy.safetensors", p.init_seed)
    if not (out / "sft_eval.json").exists():
        policy.load_state_dict(weights)
        test = load_test(out, study)
        settings = eval_settings(r.max_turns, r.max_tokens_per_turn, r.max_obs_tokens)
        (out / "sft_eval.json").write_text(json.dumps(greedy_eval(policy, tokenizer, client, test, settings), indent=1))
    sft_eval = json.loads((out / "sft_eval.json").read_text())
    print(f"SFT start: { {k: v for k, v in sft_eval.items() if k != 'predictions'} }", flush=True)
    return weights


def check_sft_start(out: Path, policy_file: Path, init_seed: int) -> None:
    """Write sft_start.json (the SFT policy's sha256), or refuse an SFT start other than the recorded one: cells
    unpacked from a committed record were trained from that start, and a remade one (another CPU kind rounds
    differently) must not be mixed with them."""
    digest = hashlib.sha256(policy_file.read_bytes()).hexdigest()
    path = out / "sft_start.json"
    if not path.exists():
        path.write_text(json.dumps({"policy_sha256": digest, "init_seed": init_seed}, indent=1))
        return
    recorded = json.loads(path.read_text())["policy_sha256"]
    if recorded != digest:
        raise SystemExit(f"{out}: the SFT start made here (sha256 {digest[:12]}...) is not the recorded one "
                         f"({recorded[:12]}...): its cells cannot be continued from this start; use another --out")


def load_test(out: Path, study: StudyConfig):
    from experiments.mechanism.kb import load_questions

    return load_questions(out / "kb" / "questions-test.jsonl")[: study.diagnostic.test_questions]


@app.command()
def main(
    out: Annotated[Path, typer.Option(help="the study's folder (resumed when it exists)")] = Path("artifacts/mechanism"),
    preset: Annotated[str, typer.Option(help=f"setup size: {', '.join(PRESETS)}")] = "study",
    methods: Annotated[str | None, typer.Option(help="comma-separated trainer/methods.py names, e.g. GRPO,EMA-PG")] = None,
    lrs: Annotated[str | None, typer.Option(help="comma-separated learning rates (the lr slice)")] = None,
    betas: Annotated[str | None, typer.Option(help="comma-separated betas (the beta slice)")] = None,
    lr_at: Annotated[float | None, typer.Option(help="the beta slice's learning rate")] = None,
    beta_at: Annotated[float | None, typer.Option(help="the lr slice's beta")] = None,
    seeds: Annotated[str | None, typer.Option(help="e.g. 0-4 or 0,2")] = None,
    init_seed: Annotated[int | None, typer.Option(help="the SFT start's policy.init_seed (one block of a study)")] = None,
    max_cells: Annotated[int | None, typer.Option(min=0, help="run at most this many new cells, then analyse")] = None,
    analyse_only: Annotated[bool, typer.Option(help="only rebuild summary.md and the plots")] = False,
    threads: Annotated[int, typer.Option(min=1, help="torch threads (1 is fastest on a shared 2-core machine)")] = 1,
    min_sft_em: Annotated[float | None, typer.Option(
        help="refuse an SFT start below this held-out EM, or with any two-hop EM (a study's rule for its starts)")] = None,
) -> None:
    """Run (or resume) the mechanism study: GRPO vs EMA anchor + k3 vs EMA anchor + Top-k on a synthetic KB."""
    # A terminated run must still stop its retrieval server (the `with` below): SIGTERM -> SystemExit.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    import torch

    from experiments.mechanism.analysis import analyse

    torch.set_num_threads(threads)
    try:
        study = study_config(preset, init_seed, methods=methods and methods.split(","), lrs=_floats(lrs), betas=_floats(betas),
                             lr_at=lr_at, beta_at=beta_at, seeds=_ints(seeds))
    except ValueError as e:
        raise typer.BadParameter(str(e)) from e
    if not analyse_only:
        check_setup(out, study)
        run_sweep(out, study, max_cells, min_sft_em)
    summary = analyse(out, study.sweep.methods)
    print(f"summary: {summary}" if summary else "no finished cell yet")


def usable_start(sft_eval: dict, min_em: float | None) -> str | None:
    """Why an SFT start fails the rule `min_em` (held-out EM at least that, two-hop EM 0: RL has room), or None."""
    if min_em is None:
        return None
    if sft_eval["em"] < min_em:
        return f"held-out EM {sft_eval['em']:.3f} < {min_em}"
    if sft_eval.get("em_birth_country", 0.0) > 0:
        return f"two-hop EM {sft_eval['em_birth_country']:.3f} > 0"
    return None


def run_sweep(out: Path, study: StudyConfig, max_cells: int | None, min_sft_em: float | None = None) -> None:
    from agent.policy import load_tokenizer
    from experiments.mechanism.cell import run_cell
    from experiments.mechanism.demos import answerable
    from experiments.mechanism.kb import load_questions
    from retriever.client import RetrieverClient
    from retriever.process import running_server

    tokenizer = load_tokenizer()
    prepare_kb(out, study)
    cells = grid(study.sweep)
    todo = [c for c in cells if not c.result_path(out).exists()]
    print(f"{len(cells)} cells, {len(cells) - len(todo)} done, {len(todo)} to run", flush=True)
    if not todo and (out / "sft_eval.json").exists():
        return  # nothing needs the server
    r = study.rl
    with running_server(out / "index", log=out / "server.log") as url, \
            RetrieverClient(url, topk=r.retriever_topk, timeout_s=60) as client:
        questions = {split: load_questions(out / "kb" / f"questions-{split}.jsonl") for split in ("train", "test")}
        train = answerable(questions["train"], client, tokenizer, topk=r.retriever_topk, max_obs_tokens=r.max_obs_tokens)
        if len(train) < len(questions["train"]):
            print(f"kept {len(train)} of {len(questions['train'])} train questions (the ideal strategy's)", flush=True)
        weights = warm_start(out, study, tokenizer, client, train)
        refused = usable_start(json.loads((out / "sft_eval.json").read_text()), min_sft_em)
        if refused:
            raise SystemExit(f"{out}: the SFT start (policy.init_seed {study.policy.init_seed}) fails the study's rule: "
                             f"{refused}; report it and give the block the next unused init_seed")
        test = load_test(out, study)
        started = time.perf_counter()
        for done, cell in enumerate(todo[:max_cells] if max_cells is not None else todo, 1):
            if cell.result_path(out).exists():  # another process running other seeds into --out finished it
                continue
            result = run_cell(study, cell, out=out, tokenizer=tokenizer, retriever_url=url, retriever=client,
                              sft_weights=weights, train=train, test=test)
            per_cell = (time.perf_counter() - started) / done
            print(f"[{done}/{len(todo)}] {cell.name}: held-out EM {result['final']['em']:.3f}, AUC {result['auc']:.3f}, "
                  f"collapsed {result['collapsed']}, {result['train_seconds'] + result['measure_seconds']:.0f} s "
                  f"(about {per_cell * (len(todo) - done) / 3600:.1f} h left at this pace)", flush=True)


if __name__ == "__main__":
    app()
