"""`emapg compare`'s three methods, its evaluation schedule, the EMA anchor's evaluation through the policy, and the
report's final and paired sections, on small fakes (no engine, no server)."""

from __future__ import annotations

import json
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
from torch import nn

from emapg.compare import (
    SFT,
    adamw_steps,
    check_start,
    comparison_pairs,
    eval_points,
    final_table,
    paired_section,
    run_compare,
    saved_variant,
    variant_config,
    work_minutes,
    write_report,
)
from agent.trajectory import Trajectory, save_jsonl
from eval.paired import paired_em
from eval.report import plot_methods
from trainer.config import load_config
from trainer.ema import anchor_weights_in, ema_anchor
from trainer.run.workers import LocalWorkers
from trainer.methods import METHODS, chosen_methods


def test_the_three_methods_differ_only_in_anchor_and_estimator(tmp_path):
    cfg = load_config("configs/cpu_compare.yaml", [f"out_dir={tmp_path}"])
    assert list(METHODS)[:3] == ["GRPO", "EMA-k3", "EMA-PG"]
    grpo, ema_k3, emapg = (variant_config(cfg, name).model_dump() for name in ("GRPO", "EMA-k3", "EMA-PG"))
    assert (grpo["ema"]["tau"], grpo["kl"]["estimator"]) == (1.0, "k3")
    assert (ema_k3["ema"]["tau"], ema_k3["kl"]["estimator"]) == (cfg.ema.tau, "k3") and cfg.ema.tau < 1
    assert (emapg["ema"]["tau"], emapg["kl"]["estimator"]) == (cfg.ema.tau, "topk")
    for key in grpo:
        if key not in ("ema", "kl", "name"):
            assert grpo[key] == ema_k3[key] == emapg[key] == cfg.model_dump()[key], key
    for section, varied in (("ema", "tau"), ("kl", "estimator")):
        rest = [{k: v for k, v in method[section].items() if k != varied} for method in (grpo, ema_k3, emapg)]
        assert rest[0] == rest[1] == rest[2], section
    # Each method in a folder of its own; GRPO's and EMA-PG's are the ones earlier runs used (they resume there).
    folders = [variant_config(cfg, name).run_dir for name in ("GRPO", "EMA-k3", "EMA-PG")]
    assert [f.name for f in folders] == ["grpo", "ema-k3", "ema-pg"] and {f.parent for f in folders} == {cfg.run_dir}


def test_methods_are_chosen_by_name_in_the_reports_order():
    def names(spec):
        return [method.name for method in chosen_methods(spec)]

    assert names("GRPO,EMA-k3,EMA-PG") == ["GRPO", "EMA-k3", "EMA-PG"]
    assert names("ema-pg, grpo") == ["GRPO", "EMA-PG"]
    assert names("EMA-PG,EMA-PG") == ["EMA-PG"]
    # The methods whose anchor is the SFT model: exactly those with ema.tau = 1 (Method.config checks it).
    assert [m.name for m in METHODS.values() if m.fixed_reference] == ["GRPO", "GRPO-k3c", "GRPO-floor", "GRPO-k3c-warmup"]
    for bad in ("PPO", "GRPO,emapg", ""):
        with pytest.raises(ValueError, match="choose from GRPO, EMA-k3, EMA-PG, GRPO-k3c"):
            chosen_methods(bad)


def test_evaluation_points_are_every_nth_iteration_and_the_last():
    assert eval_points(10, 20) == [10, 20]
    assert eval_points(50, 100) == [50, 100]
    assert eval_points(15, 20) == [15, 20]  # the last even when eval_every does not divide it
    assert eval_points(30, 20) == [20]
    assert eval_points(1, 3) == [1, 2, 3]


def test_adamw_steps_count_a_resumed_runs_replayed_iterations_once():
    logged = [{"iteration": 1, "loss/optimizer_steps": 2}, {"iteration": 2, "loss/optimizer_steps": 2},
              {"iteration": 2, "loss/optimizer_steps": 1},  # iteration 2 replayed, with 1 step skipped
              {"iteration": 3, "loss/optimizer_steps": 2}]
    assert adamw_steps(logged) == 5


def test_pairs_are_each_model_against_sft_later_methods_against_earlier_and_anchors_against_their_policy():
    assert comparison_pairs(["GRPO", "EMA-k3", "EMA-PG"], ["EMA-k3", "EMA-PG"]) == [
        ("GRPO", SFT), ("EMA-k3", SFT), ("EMA-PG", SFT), ("EMA-k3 anchor", SFT), ("EMA-PG anchor", SFT),
        ("EMA-k3", "GRPO"), ("EMA-PG", "GRPO"), ("EMA-PG", "EMA-k3"),
        ("EMA-k3 anchor", "EMA-k3"), ("EMA-PG anchor", "EMA-PG")]
    assert comparison_pairs(["GRPO"], []) == [("GRPO", SFT)]


def test_paired_section_from_per_question_results():
    ids = [f"nq/test/{i}" for i in range(6)] + [f"triviaqa/test/{i}" for i in range(4)]
    sft = dict.fromkeys(ids, False) | {ids[0]: True, ids[1]: True}
    grpo = dict(sft) | {ids[2]: True}  # one gained
    emapg = dict(sft) | {ids[2]: True, ids[3]: True, ids[7]: True, ids[0]: False}  # three gained, one lost
    anchor = dict(sft)
    correct = {SFT: sft, "GRPO": grpo, "EMA-PG": emapg, "EMA-PG anchor": anchor}
    # Shuffled key order: pairs are matched by question id.
    correct = {model: dict(reversed(results.items())) for model, results in correct.items()}
    lines, rows = paired_section(correct, comparison_pairs(["GRPO", "EMA-PG"], ["EMA-PG"]))
    assert [(r["a"], r["b"], r["a_only"], r["b_only"]) for r in rows] == [
        ("GRPO", SFT, 1, 0), ("EMA-PG", SFT, 3, 1), ("EMA-PG anchor", SFT, 0, 0), ("EMA-PG", "GRPO", 2, 1),
        ("EMA-PG anchor", "EMA-PG", 1, 3)]
    emapg_vs_sft = paired_em(emapg, sft)
    assert rows[1]["p_value"] == emapg_vs_sft.p_value == pytest.approx(2 * 5 / 16)  # 2 P(X <= 1 | Bin(4, 1/2))
    assert rows[2]["p_value"] == 1.0 and rows[2]["difference"] == 0.0
    assert lines[0].startswith("| A | B | n | EM A | EM B | A - B | 95% CI |") and len(lines) == 2 + len(rows)
    low, high = emapg_vs_sft.ci95
    holm_p = rows[1]["holm_p"]  # Holm over the table's 5: the McNemar p values sorted, stepped down
    ps = sorted(r["p_value"] for r in rows)
    assert holm_p == pytest.approx(max(min(1.0, (5 - i) * ps[i]) for i in range(ps.index(rows[1]["p_value"]) + 1)))
    assert lines[3] == (f"| EMA-PG | SFT | 10 | 0.400 | 0.200 | +0.200 | {low:+.3f} to {high:+.3f} | 3 | 1 | 0.625 | "
                        f"{holm_p:.3g} |")


def test_final_table_gives_each_model_its_steps_and_says_grpos_anchor_is_sft():
    row = {"n": 1000, "em": 0.25, "em_low": 0.224, "em_high": 0.278, "well_formed": 0.99}
    lines = final_table({SFT: (0, row), "GRPO": (100, row), "EMA-PG": (100, row), "EMA-PG anchor": (100, row)},
                        {SFT: 0, "GRPO": 200, "EMA-PG": 198, "EMA-PG anchor": 198}, ["GRPO"])
    assert lines[2:] == ["| SFT | 0 | 0 | 1000 | 0.250 | 0.224-0.278 | 0.99 |",
                         "| GRPO | 100 | 200 | 1000 | 0.250 | 0.224-0.278 | 0.99 |",
                         "| EMA-PG | 100 | 198 | 1000 | 0.250 | 0.224-0.278 | 0.99 |",
                         "| EMA-PG anchor | 100 | 198 | 1000 | 0.250 | 0.224-0.278 | 0.99 |",
                         "| GRPO anchor | | | | = SFT | | |"]


def test_plot_takes_three_methods(tmp_path):
    curves = {name: [{"iteration": i, "rollout/reward": 0.1 * i} for i in (1, 2)]
              for name in ("GRPO", "EMA-k3", "EMA-PG")}
    point = {"em": 0.2, "em_low": 0.1, "em_high": 0.3}
    plot_methods(curves, {name: [(0, point), (2, point)] for name in curves}, tmp_path / "compare.png")
    assert (tmp_path / "compare.png").stat().st_size > 0


class FakeWeightRecordingBackend:
    """A fake rollout engine holding its own copy of the weights, as vLLM does: records what it was loaded with."""

    model = None  # not the policy: LocalWorkers.sync_weights copies into it

    def __init__(self):
        self.weights: dict[str, torch.Tensor] = {}

    def load_weights(self, named_tensors) -> None:
        self.weights = {name: tensor.detach().clone() for name, tensor in named_tensors}


def tiny_policy() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(proj=nn.Linear(4, 8), act=nn.Tanh(), head=nn.Linear(8, 3)))


def params(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in module.named_parameters()}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def engine_with_a_moved_policy(tmp_path) -> tuple[LocalWorkers, FakeWeightRecordingBackend]:
    """A LocalWorkers whose policy has moved away from its EMA anchor, the backend already synced to the policy (so
    the engine sees nothing stale: the case where an evaluation could leak into the next rollout)."""
    cfg = load_config("configs/cpu_compare.yaml", [f"out_dir={tmp_path}", "rollout.mode=direct"])
    backend = FakeWeightRecordingBackend()
    engine = LocalWorkers(cfg, tiny_policy(), backend, agent=None)  # no rollout here
    policy = engine.learning.policy
    with torch.no_grad():
        for p in policy.parameters():
            p.add_(torch.randn_like(p))  # stand-in for optimizer steps
    engine.learning.anchor.update(policy, cfg.ema.tau)
    engine.weights_stale = True
    engine.sync_weights()
    assert same(backend.weights, params(policy)) and not engine.weights_stale
    return engine, backend


def test_evaluating_the_anchor_through_the_policy_cannot_leak_into_training(tmp_path):
    engine, backend = engine_with_a_moved_policy(tmp_path)
    policy, anchor = engine.learning.policy, engine.learning.anchor
    before = params(policy)
    assert not same(before, anchor.state_dict())
    with engine.anchor_as_policy() as evaluated:
        assert evaluated is policy and same(params(policy), anchor.state_dict())
        backend.load_weights(evaluated.named_parameters())  # what Session.evaluate does before evaluating
    assert same(params(policy), before)  # bit for bit
    assert same(backend.weights, anchor.state_dict())  # the engine still holds the anchor...
    engine.sync_weights()  # ...until the next iteration's sync, which Trainer.step runs before every rollout
    assert same(backend.weights, before)
    # The optimizer still holds the policy's own parameter objects.
    assert {id(p) for group in engine.learning.optimizer.param_groups for p in group["params"]} == \
        {id(p) for p in policy.parameters()}


def test_an_evaluation_that_fails_still_restores_the_policy(tmp_path):
    engine, backend = engine_with_a_moved_policy(tmp_path)
    before = params(engine.learning.policy)
    with pytest.raises(RuntimeError, match="retriever down"), engine.anchor_as_policy() as evaluated:
        backend.load_weights(evaluated.named_parameters())
        raise RuntimeError("retriever down")
    assert same(params(engine.learning.policy), before) and engine.weights_stale


def test_a_lora_anchor_is_refused():
    from trainer.lora import apply_lora

    policy = apply_lora(tiny_policy(), 2, 4.0, ["proj"], 0.0)
    with pytest.raises(TypeError, match="LoRA"), anchor_weights_in(policy, ema_anchor(policy)):
        pass


def test_compare_refuses_lora_before_starting_anything(tmp_path):
    cfg = load_config("configs/cpu_compare.yaml", [f"out_dir={tmp_path}", "lora.rank=4"])
    with pytest.raises(ValueError, match="lora.rank=0"):
        run_compare(cfg, None, 10, ["GRPO", "EMA-PG"])
    assert not cfg.run_dir.exists()


def test_the_cli_refuses_an_unknown_method_before_starting_anything(tmp_path):
    from typer.testing import CliRunner

    from emapg.cli import app

    result = CliRunner().invoke(app, ["compare", "--methods", "GRPO,PPO", f"out_dir={tmp_path}"])
    assert result.exit_code == 2 and "unknown methods ['ppo']" in " ".join(result.output.split())
    assert not list(tmp_path.iterdir())


def test_the_evidence_config_is_make_compares_at_five_times_the_steps_with_a_bigger_held_out_set():
    compare, evidence = (load_config(f"configs/{name}.yaml") for name in ("cpu_compare", "cpu_evidence"))
    t = evidence.train
    steps = t.iterations * t.ppo_epochs * (t.prompts_per_iteration * t.rollouts_per_prompt // t.mini_batch_size)
    assert steps >= 5 * 40 and t.lr == 2e-5  # the learning-rate pilot's choice (docs/benchmarks.md)
    # Two held-out sets capped after the answerable filter: over 1,000 needs more than 500 from at least one.
    assert evidence.data.eval == ["nq:test", "triviaqa:test"] and evidence.data.eval_limit > 500
    assert evidence.data.scan_limit is None  # every test question is a candidate
    same, different = compare.model_dump(), evidence.model_dump()
    for section in ("model", "dtype", "seed", "retriever", "rollout", "sft", "kl", "ema", "reward"):
        assert same[section] == different[section], section
    # micro_batch_size only groups the accumulated gradient (the same sum either way).
    own = ("iterations", "lr", "micro_batch_size")
    assert {k: v for k, v in same["train"].items() if k not in own} == \
        {k: v for k, v in different["train"].items() if k not in own}
    assert evidence.checkpoint.every <= 5


def test_work_minutes_count_the_anchors_evaluations():
    curves = {"EMA-PG": [{"iteration": 1, "time/rollout_s": 60.0}]}
    held_out = {"EMA-PG": [(0, {"seconds": 120.0}), (1, {"seconds": 60.0})]}
    assert work_minutes(curves, held_out, {"EMA-PG": {"seconds": 90.0}}) == (60 + 120 + 60 + 90) / 60


def fake_evaluation(folder, right: list[bool]) -> dict:
    """An evaluation folder's trajectories (question i right or wrong), and its pooled row."""
    save_jsonl([Trajectory(uid=f"nq/test/{i}#0", group_id=f"nq/test/{i}", question=f"q{i}", golden_answers=["yes"],
                           prompt_ids=[1], answer="yes" if ok else "no") for i, ok in enumerate(right)],
               folder / "trajectories" / "nq.agent.jsonl")
    em = sum(right) / len(right)
    return {"n": len(right), "em": em, "em_low": 0.0, "em_high": 1.0, "well_formed": 1.0, "seconds": 60.0}


def test_the_report_pairs_the_final_evaluations_read_from_the_run_folders(tmp_path):
    cfg = load_config("configs/cpu_compare.yaml", [f"out_dir={tmp_path}", "train.iterations=2"])
    sft = fake_evaluation(cfg.run_dir / "eval-sft", [True, False, False, False, False, False])
    finals = {"GRPO": [True, True, False, False, False, False], "EMA-PG": [False, True, True, True, False, False]}
    held_out, anchors = {}, {}
    for name, right in finals.items():
        run_dir = variant_config(cfg, name).run_dir
        # Iteration 2 logged twice (a resumed run replayed it): its last line counts. Flat names, as runs from before
        # the namespaces logged them: the report reads them under the new ones.
        logged = [{"iteration": 1, "reward": 0.1, "optimizer_steps": 2, "time_rollout_s": 60.0},
                  {"iteration": 2, "reward": 0.2, "optimizer_steps": 1, "time_rollout_s": 60.0},
                  {"iteration": 2, "reward": 0.3, "optimizer_steps": 2, "time_rollout_s": 60.0}]
        held_out[name] = [(0, sft), (2, fake_evaluation(run_dir / "eval-0002", right))]
        (run_dir / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in logged))
    anchors["EMA-PG"] = fake_evaluation(variant_config(cfg, "EMA-PG").run_dir / "eval-anchor-0002",
                                        [True, True, False, False, False, False])
    path = write_report(cfg, tmp_path / "sft", held_out, anchors, 6, 12.0)
    report = path.read_text()
    assert "| SFT | 0 | 0 | 6 | 0.167 |" in report and "| GRPO | 2 | 4 | 6 | 0.333 |" in report
    assert "| EMA-PG anchor | 2 | 4 | 6 | 0.333 |" in report and "| GRPO anchor | | | | = SFT | | |" in report
    assert "| EMA-PG | SFT | 6 | 0.500 | 0.167 | +0.333 |" in report and "| 3 | 1 | 0.625 |" in report
    saved = json.loads((cfg.run_dir / "compare.json").read_text())
    assert saved["adamw_steps"] == {"GRPO": 4, "EMA-PG": 4} and saved["methods"] == ["GRPO", "EMA-PG"]
    assert [(r["a"], r["b"], r["a_only"], r["b_only"]) for r in saved["paired"]] == [
        ("GRPO", SFT, 1, 0), ("EMA-PG", SFT, 3, 1), ("EMA-PG anchor", SFT, 1, 0), ("EMA-PG", "GRPO", 2, 1),
        ("EMA-PG anchor", "EMA-PG", 1, 2)]
    assert saved["final"]["EMA-PG anchor"]["iteration"] == 2 and (cfg.run_dir / "compare.png").is_file()


def save_weights(weights: dict[str, torch.Tensor], run_dir):
    from trainer.run.checkpoint import Checkpoint, save_checkpoint

    return save_checkpoint(Checkpoint(iteration=0, policy=weights, anchor=weights, optimizer={}, scheduler={}, rng={"torch": torch.get_rng_state()},
                                      data_cursor={}, config={}), run_dir)


def test_a_compare_run_folder_refuses_an_sft_start_that_differs_from_its_first(tmp_path):
    weights = params(tiny_policy())
    sft = save_weights(weights, tmp_path / "sft")
    out = tmp_path / "run"
    out.mkdir()
    check_start(out, tmp_path / "sft")  # the first run records it (a run folder or its checkpoint: the same)
    check_start(out, sft)
    remade = save_weights(weights, tmp_path / "sft-remade")  # the same weights made again (another machine)
    check_start(out, remade)
    moved = {name: w + 1e-7 for name, w in weights.items()}
    with pytest.raises(ValueError, match="not the one the results in .* started from"):
        check_start(out, save_weights(moved, tmp_path / "sft-other"))
    assert json.loads((out / "sft_start.json").read_text())["init"] == str(tmp_path / "sft")


def saved_report(folder, em: float) -> dict:
    from eval.report import DatasetResult, EvalReport, pooled, wilson_interval

    report = EvalReport(model="m", subset="answerable", results=[DatasetResult(
        dataset="nq", mode="agent", n=10, em=em, em_ci95=wilson_interval(em * 10, 10), cover_em=em, f1=em,
        answered=1.0, well_formed=1.0, text_cover_em=em, mean_searches=1.0, mean_turns=2.0, invalid_action_rate=0.0,
        mean_response_tokens=50.0, seconds=1.0)], seconds=60.0)
    report.save(folder)
    return pooled(report)


def test_a_method_with_every_evaluation_saved_is_read_back_and_one_missing_any_is_not(tmp_path):
    cfg = load_config("configs/cpu_evidence.yaml", [f"out_dir={tmp_path}"])
    start = {"em": 0.2}
    grpo, emapg = variant_config(cfg, "GRPO"), variant_config(cfg, "EMA-PG")
    assert saved_variant("GRPO", grpo, start, 50) is None
    at_50, at_100 = saved_report(grpo.run_dir / "eval-0050", 0.3), saved_report(grpo.run_dir / "eval-0100", 0.4)
    assert saved_variant("GRPO", grpo, start, 50) == ([(0, start), (50, at_50), (100, at_100)], None)
    assert saved_variant("GRPO", grpo, start, 30) is None  # 30, 60 and 90 were never evaluated
    saved_report(emapg.run_dir / "eval-0050", 0.3)
    policy = saved_report(emapg.run_dir / "eval-0100", 0.5)
    assert saved_variant("EMA-PG", emapg, start, 50) is None  # its anchor's evaluation is missing
    anchor = saved_report(emapg.run_dir / "eval-anchor-0100", 0.6)
    points, saved_anchor = saved_variant("EMA-PG", emapg, start, 50)
    assert points[-1] == (100, policy) and saved_anchor == anchor


def test_seeds_run_in_folders_of_their_own_and_the_report_pairs_their_final_evaluations(tmp_path):
    from emapg.compare import declared_models, default_family, seed_config, seed_evaluations
    from eval.seed_report import write_plan, write_seed_report
    from test_seed_report import ALL, fabricated_eval

    def evaluated(folder, em: float):  # FABRICATED trajectories, written by the real writers: the first em x n right
        fabricated_eval(folder, set(ALL[: round(em * len(ALL))]))

    cfg = load_config("configs/cpu_compare.yaml", [f"out_dir={tmp_path}", "train.iterations=2"])
    methods = ["GRPO", "EMA-PG"]
    seeds = [0, 1, 2]
    assert declared_models(methods) == [SFT, "GRPO", "EMA-PG", "EMA-PG anchor"]  # GRPO's anchor is the SFT model
    assert default_family(methods) == [("EMA-PG", "GRPO")]
    runs = {seed: seed_config(cfg, seed) for seed in seeds}
    assert [(r.seed, r.run_dir) for r in runs.values()] == [(s, cfg.run_dir / f"seed-{s}") for s in seeds]
    assert variant_config(runs[1], "EMA-PG").run_dir == cfg.run_dir / "seed-1" / "ema-pg"
    plan = write_plan(cfg.run_dir, declared_models(methods), default_family(methods), seeds)
    evaluated(cfg.run_dir / "eval-sft", 0.2)
    # Seeds 0 and 1 finished (final evaluations at iteration 2, EMA-PG's anchor too); seed 2 has only GRPO's.
    for seed, (grpo, emapg) in {0: (0.3, 0.5), 1: (0.4, 0.6)}.items():
        evaluated(variant_config(runs[seed], "GRPO").run_dir / "eval-0002", grpo)
        evaluated(variant_config(runs[seed], "EMA-PG").run_dir / "eval-0002", emapg)
        evaluated(variant_config(runs[seed], "EMA-PG").run_dir / "eval-anchor-0002", emapg)
    evaluated(variant_config(runs[2], "GRPO").run_dir / "eval-0002", 0.1)
    evals = seed_evaluations(cfg, methods, seeds)
    assert sorted(evals["GRPO"]) == [0, 1, 2] and sorted(evals["EMA-PG"]) == [0, 1]
    assert set(evals[SFT].values()) == {cfg.run_dir / "eval-sft"}  # one evaluation of the shared start
    report = json.loads((write_seed_report(cfg.run_dir, evals, plan).with_suffix(".json")).read_text())
    assert report["seeds"] == [0, 1] and report["unfinished_seeds"] == [2]
    (row,) = report["comparisons"]
    assert (row["a"], row["b"], row["wins"]) == ("EMA-PG", "GRPO", 2) and row["mean"] == pytest.approx(0.2)
    assert row["p"] == 0.5  # two seeds: the exact sign-flip test cannot go below 2 / 2^2


def test_the_cli_refuses_comparisons_it_cannot_test_before_starting_anything(tmp_path):
    from typer.testing import CliRunner

    from emapg.cli import app

    for args, message in ((["--compare", "EMA-PG:GRPO"], "give --seeds too"),
                          (["--seeds", "0,1", "--compare", "EMA-PG:PPO"], "must be A:B"),
                          (["--seeds", "0,0"], "names a seed twice"),
                          (["--seeds", "zero"], "--methods/--seeds")):
        result = CliRunner().invoke(app, ["compare", "--methods", "GRPO,EMA-PG", *args, f"out_dir={tmp_path}"])
        assert result.exit_code == 2 and message in " ".join(result.output.split()), (args, result.output)
    assert not list(tmp_path.iterdir())


def test_every_method_in_the_table_makes_a_valid_config_that_differs_only_in_its_keys(tmp_path):
    cfg = load_config("configs/cpu_compare.yaml", [f"out_dir={tmp_path}"])
    for name, method in METHODS.items():
        made = variant_config(cfg, name)
        for key, value in method.overrides.items():
            section, field = key.split(".")
            assert getattr(getattr(made, section), field) == value, (name, key)
        assert (made.ema.tau == 1.0) == method.fixed_reference
    assert variant_config(cfg, "GRPO-floor").kl.beta == 0.001 and variant_config(cfg, "EMA-PG-released").kl.estimator \
        == "topk_released"


def test_compare_and_demo_serve_the_configs_index_unless_index_is_given(tmp_path, monkeypatch):
    """`--index` used to default to the packaged dense index and so override a config's retriever.index (the two-hop
    study's BM25 index); now it overrides only when given."""
    from typer.testing import CliRunner

    import emapg.cli as cli
    import emapg.compare
    import emapg.demo

    served = []  # a fake run: records the index the command would serve, runs nothing
    monkeypatch.setattr(cli, "_ensure_index", lambda index, *rest: served.append(index))
    monkeypatch.setattr(cli, "_log_to", lambda run_dir: None)
    monkeypatch.setattr(emapg.compare, "run_compare", lambda cfg, *rest: served.append(cfg.retriever.index) or tmp_path)
    monkeypatch.setattr(emapg.demo, "run_demo", lambda cfg: served.append(cfg.retriever.index) or tmp_path)
    config, own = "configs/two_hop.yaml", Path("artifacts/two-hop/index")
    for command in ("compare", "demo"):
        for extra, want in (([], own), (["--index", str(tmp_path / "other")], tmp_path / "other")):
            served.clear()
            result = CliRunner().invoke(cli.app, [command, "--config", config, *extra, f"out_dir={tmp_path}"])
            assert result.exit_code == 0, result.output
            assert served == [want, want], (command, extra, served)


def test_a_seeded_study_packed_by_make_evidence_record_resumes_from_the_record_alone(tmp_path):
    """A fresh checkout has none of the last session's artifacts: `make evidence-record` packs a seeded run folder
    (<run>/seed-N/<method>/), and unpacked elsewhere it gives back every finished method and the plan, and an
    unfinished one stays unfinished (it is rerun)."""
    import subprocess

    from emapg.compare import declared_models, default_family, seed_config, seed_evaluations
    from eval.seed_report import read_plan, write_plan
    from test_seed_report import ALL, fabricated_eval

    out, record, fresh = tmp_path / "runs", tmp_path / "record", tmp_path / "fresh"
    cfg = load_config("configs/cpu_compare.yaml", [f"out_dir={out}", "train.iterations=2"])
    methods, seeds = ["GRPO", "EMA-PG"], [0, 1]
    write_plan(cfg.run_dir, declared_models(methods), default_family(methods), seeds)
    (cfg.run_dir / "sft_start.json").write_text(json.dumps({"init": "sft", "policy_sha256": "ab" * 32}))
    fabricated_eval(cfg.run_dir / "eval-sft", set(ALL[:4]))  # FABRICATED evaluations, by the real writers
    for seed in seeds:
        for name in methods:
            run_dir = variant_config(seed_config(cfg, seed), name).run_dir
            (run_dir / "checkpoints").mkdir(parents=True)  # never packed: a fresh checkout resumes without them
            (run_dir / "metrics.jsonl").write_text(json.dumps({"iteration": 1, "seed": seed}) + "\n")
            if (seed, name) != (1, "EMA-PG"):  # seed 1's EMA-PG has no final evaluation yet
                fabricated_eval(run_dir / "eval-0002", set(ALL[:6]))
    fabricated_eval(variant_config(seed_config(cfg, 0), "EMA-PG").run_dir / "eval-anchor-0002", set(ALL[:5]))

    root = Path(__file__).resolve().parent.parent
    subprocess.run(["make", "-s", "evidence-record", f"EVIDENCE_OUT={out}", f"EVIDENCE_NAME={cfg.name}",
                    f"EVIDENCE_RECORD={record}"], cwd=root, check=True, capture_output=True, timeout=60)
    fresh.mkdir()
    for packed in sorted(record.glob("*.tar.gz")):  # as `make two-hop` unpacks them
        listed = subprocess.run(["tar", "-tzf", packed], check=True, capture_output=True, text=True).stdout
        assert "checkpoints" not in listed
        subprocess.run(["tar", "-xzf", packed, "--skip-old-files", "-C", fresh], check=True)
    again = load_config("configs/cpu_compare.yaml", [f"out_dir={fresh}", "train.iterations=2"])
    assert read_plan(again.run_dir)["seeds"] == seeds
    assert json.loads((again.run_dir / "sft_start.json").read_text())["policy_sha256"] == "ab" * 32
    start = {"em": 0.1}
    for seed in seeds:
        for name in methods:
            vcfg = variant_config(seed_config(again, seed), name)
            assert (vcfg.run_dir / "metrics.jsonl").exists()
            finished = name == "GRPO" or seed == 0
            assert (saved_variant(name, vcfg, start, 2) is not None) == finished, (seed, name)
    assert seed_evaluations(again, methods, seeds) == {
        model: {s: fresh / path.relative_to(out) for s, path in by_seed.items()}
        for model, by_seed in seed_evaluations(cfg, methods, seeds).items()}
