"""`emapg view RUN_DIR...`: a local web page over run folders, to see what the agent did.

What it reads (the files our code writes; nothing else, never writes):
    metrics.jsonl                  per-iteration metrics (trainer.run.metrics_log.RunLogger, sft too): plotted
    sft/demonstrations.jsonl       the SFT warm start's demonstrations (trajectories written by a template)
    trajectories/iter-NNNNNN.jsonl one training iteration's rollouts (trainer.run.loop)
    <eval>/report.json + <eval>/trajectories/<dataset>.<mode>.jsonl   an evaluation (eval.harness)
    checkpoints/iter-*/state.json  the run's config: which tokenizer decodes the ids, the reward's format bonus
                                   and the advantage estimator (rewards and advantages are recomputed from it)

Trajectories hold token ids, not text: the page's detail view decodes them with the run's tokenizer, the model's
own tokens apart from the masked ones (the documents that came back, invalid-action messages).

The page (emapg/static/view/) is static HTML and JavaScript served from the package: no build step, no CDN. Its
whole state is in the URL's query (source, filters, selected trajectory, the two sides of a comparison), so a view
can be linked and a headless browser can load any state (tests/test_viewer.py). Every path a request names is
resolved inside one of the given run folders; anything outside them, or missing, is a 404.
"""

from __future__ import annotations

import json
import math
import os
import re
import threading
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from agent.diagnostics import repeated_searches
from agent.trajectory import Trajectory, load_jsonl
from eval.metrics import exact_match
from trainer.run.metrics_log import current_history

STATIC = Path(__file__).parent / "static" / "view"
DEFAULT_PORT = 8050
# Folders a run holds that the viewer never reads: weights, TensorBoard and W&B files.
SKIPPED_FOLDERS = {"checkpoints", "tb", "wandb", ".git", "__pycache__"}
# Metric names plotted first, in this order: a key matches a name when it is the name or ends in "/" + name, so
# `reward` and `rollout/reward` alike; the policy's KL to its anchor is `kl` or `kl/anchor` (trainer.run.metrics_log).
PREFERRED_SERIES = (("reward",), ("em",), ("kl", "kl/anchor"), ("entropy",), ("searches",))
ITERATION_FILE = re.compile(r"iter-(\d+)\.jsonl$")
DEMONSTRATIONS = "demonstrations.jsonl"  # the SFT warm start's (emapg.workflow.build_sft_data)
LIST_LIMIT = 500  # rows the trajectory list sends at most; the counts cover all of them


class OutsideRuns(LookupError):
    """A requested path that is not a file inside the given run folders (the server answers 404)."""


def view_command(run_dir: Path) -> str:
    """The command that opens a run in the viewer (what `make demo` prints at its end)."""
    return f"emapg view {run_dir}"


def resolve_inside(roots: list[Path], source: str) -> Path:
    """`source` is "<root index>:<path relative to that root>"; the existing file it names, or OutsideRuns when it
    names nothing inside that root (`..`, absolute paths and symbolic links out of it included)."""
    index, sep, rel = source.partition(":")
    if not sep or not index.isdigit() or int(index) >= len(roots):
        raise OutsideRuns(f"no run folder {index!r}")
    root = roots[int(index)]
    path = (root / rel).resolve()
    if not path.is_relative_to(root) or not path.is_file():
        raise OutsideRuns(f"{rel!r} is not a file inside {root}")
    return path


def _walk(root: Path):
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = sorted(d for d in subfolders if d not in SKIPPED_FOLDERS)
        yield Path(folder), set(files)


def discover(roots: list[Path]) -> list[dict]:
    """Per run folder: its training logs (metrics.jsonl) with their iterations' rollout files, and its evaluations
    (report.json + trajectories/*.jsonl), paths relative to the run folder."""
    runs = []
    for i, root in enumerate(roots):
        training, evaluations = [], []
        for folder, files in _walk(root):
            rel = folder.relative_to(root).as_posix()
            prefix = "" if rel == "." else rel + "/"
            trajectories = folder / "trajectories"
            if "metrics.jsonl" in files:
                iterations = sorted(trajectories.glob("iter-*.jsonl")) if trajectories.is_dir() else []
                training.append({"path": prefix + "metrics.jsonl", "name": rel,
                                 "rollouts": [{"iteration": int(ITERATION_FILE.search(p.name).group(1)),
                                               "source": f"{i}:{prefix}trajectories/{p.name}"} for p in iterations],
                                 "demonstrations": f"{i}:{prefix}{DEMONSTRATIONS}" if DEMONSTRATIONS in files else None})
            if "report.json" in files and trajectories.is_dir():
                try:
                    label = json.loads((folder / "report.json").read_text()).get("model", rel)
                except (json.JSONDecodeError, AttributeError):
                    label = rel
                evaluations.append({"name": rel, "label": label, "files": [
                    {"name": p.stem, "source": f"{i}:{prefix}trajectories/{p.name}"}
                    for p in sorted(trajectories.glob("*.jsonl")) if not ITERATION_FILE.search(p.name)]})
        runs.append({"index": i, "root": str(root), "name": root.name, "training": training,
                     "evaluations": evaluations})
    return runs


def metric_series(path: Path) -> dict:
    """Every numeric series of a metrics.jsonl by iteration (missing or non-finite values as None), and the keys
    matching PREFERRED_SERIES in that order."""
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if all("iteration" in row for row in rows):  # a resumed run's repeated iterations: its history now
        rows = current_history(rows)
    keys = list(dict.fromkeys(k for row in rows for k, v in row.items()
                              if k != "iteration" and isinstance(v, int | float) and not isinstance(v, bool)))

    def number(value):
        return value if isinstance(value, int | float) and math.isfinite(value) else None

    series = {k: [number(row.get(k)) for row in rows] for k in keys}
    preferred = [k for names in PREFERRED_SERIES for k in keys
                 if any(k == name or k.endswith("/" + name) for name in names)]
    return {"iteration": [row.get("iteration", n + 1) for n, row in enumerate(rows)], "series": series,
            "preferred": preferred}


def flags(traj: Trajectory) -> dict:
    """What the filters select on: wrong (EM 0), invalid format (no answer, or an invalid action on the way), the
    number of searches, a repeated search (as the logged `rollout/repeated_search_rate` counts it: an earlier
    search's query or documents again, agent.diagnostics), truncated (a turn hit its token limit)."""
    return {"wrong": not exact_match(traj.answer, traj.golden_answers), "invalid": not traj.well_formed,
            "searches": traj.num_searches, "repeated": repeated_searches(traj) > 0,
            "truncated": any(t.finish_reason == "length" for t in traj.turns)}


@dataclass(frozen=True)
class Filters:
    wrong: bool = False
    invalid: bool = False
    repeated: bool = False
    truncated: bool = False
    searches: int | None = None

    def keep(self, f: dict) -> bool:
        return ((not self.wrong or f["wrong"]) and (not self.invalid or f["invalid"])
                and (not self.repeated or f["repeated"]) and (not self.truncated or f["truncated"])
                and (self.searches is None or f["searches"] == self.searches))


@lru_cache(maxsize=16)
def _load(path: Path, mtime_ns: int) -> list[Trajectory]:
    return list(load_jsonl(path))


def load(path: Path) -> list[Trajectory]:
    """A trajectory file, cached until it changes (a running training appends new iteration files, not lines)."""
    return _load(path, path.stat().st_mtime_ns)


def run_config(start: Path, root: Path) -> dict | None:
    """The config of the run a file belongs to: the latest checkpoint's state.json (or a demo's report.json) in the
    file's folder or the nearest folder above it, up to the run folder."""
    if not start.is_relative_to(root):
        start = root
    for folder in [start, *start.parents]:
        states = sorted((folder / "checkpoints").glob("iter-*/state.json"))
        if states:
            return json.loads(states[-1].read_text()).get("config")
        report = folder / "report.json"
        if report.is_file():
            config = json.loads(report.read_text()).get("config")
            if isinstance(config, dict):
                return config
        if folder == root:
            return None
    return None


def scores(trajs: list[Trajectory], config: dict | None, training: bool) -> tuple[list[float], list[float | None]]:
    """Rewards and advantages as the trainer computed them (trainer.scoring, the training loop's own function),
    recomputed from the run's config; an evaluation's reward is its EM and it has no advantages. Without a config a
    training file's reward is EM alone and its advantages unknown (None)."""
    from pydantic import ValidationError

    from trainer.config import TrainConfig
    from trainer.reward import reward
    from trainer.scoring import score_rollouts

    if not training:
        return [float(exact_match(t.answer, t.golden_answers)) for t in trajs], [None] * len(trajs)
    try:
        cfg = TrainConfig.model_validate(config) if config is not None else None
    except ValidationError:  # a config of another version of the code: its rewards and advantages are not known
        cfg = None
    if cfg is None:
        return [reward(t).reward for t in trajs], [None] * len(trajs)
    scored = score_rollouts(trajs, cfg)
    return [s.reward for s in scored.scores], [float(a) for a in scored.advantages]


def summary(traj: Trajectory) -> dict:
    return {"uid": traj.uid, "question": traj.question, "answer": traj.answer, "gold": traj.golden_answers,
            "turns": len(traj.turns), **flags(traj)}


def listing(trajs: list[Trajectory], filters: Filters) -> dict:
    kept = [summary(t) for t in trajs if filters.keep(flags(t))]
    return {"total": len(trajs), "matched": len(kept), "items": kept[:LIST_LIMIT]}


def decode_turns(traj: Trajectory, tokenizer) -> list[dict]:
    """Each turn as text: the model's tokens, then the masked tokens after it (documents, invalid-action messages);
    the mask is read from loss_mask itself, so what is marked masked is what the learner skipped."""
    turns = []
    for turn in traj.turns:
        end = turn.observation_end if turn.observation_end is not None else turn.end
        masked = traj.loss_mask[turn.end:end]
        turns.append({
            "kind": turn.kind, "finish_reason": turn.finish_reason, "query": turn.query, "doc_ids": turn.doc_ids,
            "retrieval_error": turn.retrieval_error,
            "text": tokenizer.decode(traj.response_ids[turn.start:turn.end]),
            "observation": tokenizer.decode(traj.response_ids[turn.end:end]) if end > turn.end else None,
            "masked_tokens": len(masked) - sum(masked), "model_tokens": sum(traj.loss_mask[turn.start:turn.end]),
        })
    return turns


def detail(trajs: list[Trajectory], uid: str, tokenizer, config: dict | None, training: bool) -> dict:
    index = next((i for i, t in enumerate(trajs) if t.uid == uid), None)
    if index is None:
        raise OutsideRuns(f"no trajectory {uid!r}")
    rewards, advantages = scores(trajs, config, training)
    traj = trajs[index]
    return {**summary(traj), "reward": rewards[index], "advantage": advantages[index],
            "em": float(exact_match(traj.answer, traj.golden_answers)),
            "prompt": tokenizer.decode(traj.prompt_ids), "steps": decode_turns(traj, tokenizer),
            "model_tokens": traj.model_tokens, "masked_tokens": traj.observation_tokens}


OUTCOMES = ("both", "only_a", "only_b", "neither")


def paired_outcome(right_a: bool, right_b: bool) -> str:
    if right_a and right_b:
        return "both"
    if right_a or right_b:
        return "only_a" if right_a else "only_b"
    return "neither"


def question_keys(trajs: list[Trajectory]) -> list[tuple[str, str, int]]:
    """Each trajectory's question, as eval.paired keys it (example id and text, the same in every evaluation of a
    held-out set), with its rank among the file's samples of that question (training rollouts have several)."""
    seen: dict[tuple[str, str], int] = {}
    keys = []
    for t in trajs:
        rank = seen[(t.group_id, t.question)] = seen.get((t.group_id, t.question), -1) + 1
        keys.append((t.group_id, t.question, rank))
    return keys


def paired(a: list[Trajectory], b: list[Trajectory], only: str | None = None) -> dict:
    """Two trajectory files on the questions both answered, each question's outcome (both right, only A, only B,
    neither) and the counts of each."""
    b_by_key = dict(zip(question_keys(b), b, strict=True))
    rows = []
    for key, ta in zip(question_keys(a), a, strict=True):
        tb = b_by_key.get(key)
        if tb is None:
            continue
        right_a, right_b = exact_match(ta.answer, ta.golden_answers), exact_match(tb.answer, tb.golden_answers)
        rows.append({"uid_a": ta.uid, "uid_b": tb.uid, "question": ta.question, "gold": ta.golden_answers,
                     "answer_a": ta.answer, "answer_b": tb.answer,
                     "outcome": paired_outcome(bool(right_a), bool(right_b))})
    counts = {name: sum(r["outcome"] == name for r in rows) for name in OUTCOMES}
    kept = [r for r in rows if only is None or r["outcome"] == only]
    return {"n": len(rows), "only_in_a": len(a) - len(rows), "only_in_b": len(b) - len(rows), "counts": counts,
            "matched": len(kept), "items": kept[:LIST_LIMIT]}


def create_app(run_dirs: list[Path], tokenizer_name: str | None = None):
    """The viewer's FastAPI app over `run_dirs` (each must be an existing folder). `tokenizer_name` decodes every
    run's ids; by default each run's own config names its model (the packaged SmolLM2 when it has none)."""
    from fastapi import FastAPI, HTTPException, Query
    from fastapi.responses import FileResponse
    from fastapi.staticfiles import StaticFiles

    from agent.policy import PACKAGED_SMOLLM2, load_tokenizer

    roots = []
    for run_dir in run_dirs:
        if not Path(run_dir).is_dir():
            raise FileNotFoundError(f"run folder {run_dir} does not exist")
        roots.append(Path(run_dir).resolve())
    cached_tokenizer = lru_cache(maxsize=4)(load_tokenizer)
    tokenizer_lock = threading.Lock()  # requests run in threads; two first imports of transformers at once fail

    def tokenizers(name: str):
        with tokenizer_lock:
            return cached_tokenizer(name)
    app = FastAPI(title="emapg view", docs_url=None, redoc_url=None, openapi_url=None)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")

    def file_of(source: str) -> Path:
        try:
            return resolve_inside(roots, source)
        except OutsideRuns as e:
            raise HTTPException(404, str(e)) from None

    def trajectories_of(source: str) -> tuple[Path, list[Trajectory]]:
        path = file_of(source)
        if path.suffix != ".jsonl":
            raise HTTPException(404, f"{source} is not a trajectory file")
        try:
            return path, load(path)
        except (json.JSONDecodeError, TypeError, KeyError) as e:
            raise HTTPException(422, f"{source}: not a trajectory file ({e})") from None

    def context(source: str, path: Path) -> tuple[dict | None, bool]:
        root = roots[int(source.partition(":")[0])]
        return run_config(path.parent.parent, root), ITERATION_FILE.search(path.name) is not None

    @app.get("/")
    def page():
        return FileResponse(STATIC / "index.html")

    @app.get("/api/runs")
    def runs():
        return discover(roots)

    @app.get("/api/metrics")
    def metrics(source: str):
        path = file_of(source)
        if path.name != "metrics.jsonl":
            raise HTTPException(404, f"{source} is not a metrics.jsonl")
        return metric_series(path)

    @app.get("/api/trajectories")
    def trajectories(source: str, wrong: bool = False, invalid: bool = False, repeated: bool = False,
                     truncated: bool = False, searches: int | None = Query(None, ge=0)):
        _, trajs = trajectories_of(source)
        return listing(trajs, Filters(wrong, invalid, repeated, truncated, searches))

    @app.get("/api/trajectory")
    def trajectory(source: str, uid: str):
        path, trajs = trajectories_of(source)
        config, training = context(source, path)
        name = tokenizer_name or (config or {}).get("model") or PACKAGED_SMOLLM2
        try:
            return detail(trajs, uid, tokenizers(name), config, training)
        except OutsideRuns as e:
            raise HTTPException(404, str(e)) from None

    @app.get("/api/paired")
    def pair(a: str, b: str, outcome: str | None = Query(None, pattern="^(both|only_a|only_b|neither)$")):
        return paired(trajectories_of(a)[1], trajectories_of(b)[1], outcome)

    return app


def serve(run_dirs: list[Path], host: str = "127.0.0.1", port: int = DEFAULT_PORT,
          tokenizer_name: str | None = None) -> None:
    import uvicorn

    uvicorn.run(create_app(run_dirs, tokenizer_name), host=host, port=port, log_level="warning")
