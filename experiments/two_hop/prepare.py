"""The two-hop study's inputs, so that `emapg compare --seeds` runs it as it runs any task (docs/study_two_hop_plan.md).

    python -m experiments.two_hop.prepare --out artifacts/two-hop          # KB, sets, index, SFT start (resumes)
    emapg compare --config configs/two_hop.yaml --seeds 0,1,2,3,4,5,6,7 --methods ... --compare ...

Steps, each reused from `--out` when already there:
  kb/         the knowledge base of experiments/mechanism/kb.py (answers reachable only by searching it)
  flashrag/   its questions as FlashRAG-format sets (data.qa.load_flashrag reads a local set of one's own):
              kb/train.jsonl (every kind, the ideal strategy's answerable ones), kb-2hop/test.jsonl (the primary
              outcome's two-hop questions), kb-1hop/test.jsonl (one-hop, reported beside it), kb-reworded/test.jsonl
              (Study B's generalisation set: test questions of every kind in wordings never trained on; evaluated
              with `data.eval=[kb-2hop:test,kb-reworded:test]`)
  index/      BM25 over the KB corpus, served by the real retrieval server
  two-hop/sft the SFT warm start of the config's policy on demonstrations that show the two-search strategy on
              only sft_full_rate of the two-hop questions (experiments/mechanism/demos.py), so RL has room above SFT;
              `emapg compare` with the same config finds it there (out_dir/name/sft) and starts every method from it
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from experiments.mechanism.kb import KBQuestion

app = typer.Typer(add_completion=False)
CONFIG = Path("configs/two_hop.yaml")
TWO_HOP = "birth_country"


def flashrag_rows(questions: list[KBQuestion]) -> str:
    return "".join(json.dumps({"id": q.example.id, "question": q.example.question,
                               "golden_answers": list(q.example.golden_answers), "kind": q.kind}) + "\n"
                   for q in questions)


def write_sets(root: Path, train: list[KBQuestion], test: list[KBQuestion],
               reworded: list[KBQuestion]) -> dict[str, int]:
    """The FlashRAG-format sets under `root`; returns the number of questions in each."""
    sets = {"kb/train": train, "kb-2hop/test": [q for q in test if q.kind == TWO_HOP],
            "kb-1hop/test": [q for q in test if q.kind != TWO_HOP], "kb-reworded/test": reworded}
    for name, questions in sets.items():
        path = root / f"{name}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.with_suffix(".tmp").write_text(flashrag_rows(questions))
        path.with_suffix(".tmp").replace(path)
    return {name: len(questions) for name, questions in sets.items()}


@app.command()
def main(
    out: Annotated[Path, typer.Option(help="the study's folder (resumed when it exists)")] = Path("artifacts/two-hop"),
    config: Annotated[Path, typer.Option(help="the study's run config")] = CONFIG,
    full_rate: Annotated[float, typer.Option(min=0, max=1, help="share of two-hop demonstrations that search "
                                             "twice")] = 0.25,
    demonstrations: Annotated[int, typer.Option(min=1, help="train questions demonstrated")] = 1000,
) -> None:
    """Build the KB, its FlashRAG-format sets and BM25 index, and the SFT start of the two-hop study."""
    from agent.policy import load_policy, load_tokenizer
    from experiments.mechanism.demos import answerable, build_demonstrations
    from experiments.mechanism.kb import KBSpec, generate_kb, load_questions, read_kb, write_kb, write_reworded
    from retriever.bm25 import build_bm25_index
    from retriever.client import RetrieverClient
    from retriever.process import running_server
    from trainer.run.checkpoint import latest_checkpoint
    from trainer.config import load_config
    from trainer.run.sft import SFTTrainer

    cfg = load_config(config, [f"out_dir={out}", f"retriever.index={out / 'index'}",
                               f"data.flashrag_root={out / 'flashrag'}"])
    if not (out / "kb" / "kb.json").exists():
        write_kb(generate_kb(KBSpec()), out / "kb")
    if not (out / "kb" / "questions-reworded.jsonl").exists():  # a KB made before the set existed
        try:
            write_reworded(read_kb(out / "kb"), out / "kb")
        except ValueError as e:
            raise SystemExit(f"{e}; cannot add the reworded questions to it") from e
    if not (out / "index" / "manifest.json").exists():
        build_bm25_index(out / "kb" / "corpus.jsonl", out / "index", overwrite=True)
    tokenizer = load_tokenizer(cfg.model)
    questions = {split: load_questions(out / "kb" / f"questions-{split}.jsonl")
                 for split in ("train", "test", "reworded")}
    r = cfg.rollout
    with running_server(out / "index", log=out / "server.log") as url, \
            RetrieverClient(url, topk=cfg.retriever.topk, timeout_s=60) as client:
        train = answerable(questions["train"], client, tokenizer, topk=cfg.retriever.topk,
                           max_obs_tokens=r.max_obs_tokens)
        counts = write_sets(out / "flashrag", train, questions["test"], questions["reworded"])
        print(f"sets: {counts} (train: the {len(train)} of {len(questions['train'])} the ideal strategy answers)")
        if latest_checkpoint(cfg.sft_dir) is None:
            demos, kinds = build_demonstrations(train[:demonstrations], client, tokenizer, topk=cfg.retriever.topk,
                                                max_obs_tokens=r.max_obs_tokens, full_rate=full_rate, seed=cfg.seed)
            cfg.sft_dir.mkdir(parents=True, exist_ok=True)
            (cfg.sft_dir / "demonstrations.json").write_text(json.dumps(kinds, indent=1))
            trainer = SFTTrainer(cfg, load_policy(cfg.model, dtype=cfg.dtype), demos, tokenizer.pad_token_id or 0)
            print(f"SFT: {trainer.steps} steps on {len(demos)} demonstrations {kinds}", flush=True)
            trainer.run()
    print(f"SFT start: {latest_checkpoint(cfg.sft_dir)}; next: emapg compare --config {config} out_dir={out} "
          f"retriever.index={out / 'index'} data.flashrag_root={out / 'flashrag'} --seeds ...")


if __name__ == "__main__":
    app()
