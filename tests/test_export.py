"""`emapg export`: real tiny runs made through the CLI (a full-weight EMA-PG run, and a LoRA EMA-k3 run started from
an SFT checkpoint with `--init`, both on the real retriever server), exported as Hugging Face folders and loaded back
in plain transformers: the same weights and greedy tokens as the checkpoint loaded inside the project, tied embeddings
tied, `emapg eval --model FOLDER` running it as `emapg eval --checkpoint` runs the checkpoint, LoRA merged onto the
right base, and corrupt checkpoints and occupied folders refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

QUESTIONS = [("Who wrote Pride and Prejudice?", ["Jane Austen"]), ("Which planet is largest?", ["Jupiter"])]
PROMPT = "Question: Who wrote Pride and Prejudice?"


def run_cli(*args: str, code: int = 0) -> str:
    from typer.testing import CliRunner

    from emapg.cli import app

    result = CliRunner().invoke(app, list(args))
    assert result.exit_code == code, result.output
    return " ".join(result.output.split())  # rich wraps long lines at the terminal's width


@pytest.fixture(scope="module")
def runs(server_url, tiny_model_dir, tmp_path_factory) -> dict:
    """runs/full: 2 iterations of EMA-PG (Top-k KL, tau 0.5 every iteration); runs/lora: `emapg sft`, then 2
    iterations of LoRA EMA-k3 from that SFT checkpoint. A random tiny model earns no reward (every group's advantages
    are zero, so the policy loss has no gradient): an entropy bonus and a high learning rate move the policy anyway,
    so that start, policy and anchor all differ after two iterations."""
    tmp = tmp_path_factory.mktemp("export")
    flashrag = tmp / "flashrag"
    (flashrag / "bamboogle").mkdir(parents=True)
    (flashrag / "bamboogle" / "test.jsonl").write_text("".join(
        json.dumps({"id": str(i), "question": q, "golden_answers": a}) + "\n" for i, (q, a) in enumerate(QUESTIONS)))
    common = [f"model={tiny_model_dir}", f"out_dir={tmp / 'runs'}", f"retriever.url={server_url}",
              "rollout.backend=transformers", "data.train=[bamboogle:test]", f"data.flashrag_root={flashrag}",
              "data.subset=full", "rollout.max_turns=2", "rollout.max_tokens_per_turn=8", "rollout.max_obs_tokens=64"]
    train = ["train.iterations=2", "train.prompts_per_iteration=2", "train.rollouts_per_prompt=2",
             "train.mini_batch_size=4", "train.micro_batch_size=4", "train.warmup_steps=0", "train.lr=0.01",
             "train.entropy_coef=0.1",
             "kl.topk=4", "ema.tau=0.5", "ema.period=1", "checkpoint.every=1"]
    run_cli("train", "name=full", *common, *train, "kl.estimator=topk")
    run_cli("sft", "name=lora", *common, "sft.eval_questions=0", "sft.examples=2", "sft.batch_size=2", "sft.micro_batch_size=2",
            "sft.warmup_steps=0", "sft.lr=0.01")
    run_cli("train", "--init", str(tmp / "runs" / "lora" / "sft"), "name=lora", *common, *train, "kl.estimator=k3",
            "lora.rank=4", "lora.alpha=8")
    eval_args = ["--datasets", "bamboogle", "--flashrag-root", str(flashrag), "--subset", "full", "--modes", "agent",
                 "--retriever-url", server_url, "--max-turns", "2", "--max-tokens-per-turn", "8",
                 "--max-obs-tokens", "64", "--backend", "transformers", "--limit", "2"]
    return {"full": tmp / "runs" / "full", "lora": tmp / "runs" / "lora", "tmp": tmp, "eval": eval_args,
            "model": tiny_model_dir}


def checkpoint_of(run: Path):
    from trainer.run.checkpoint import latest_checkpoint, load_checkpoint

    path = latest_checkpoint(run)
    return path, load_checkpoint(path)


def exported(folder: Path):
    """The folder in plain transformers, after checking it loads with no missing or unexpected key and tied."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert not any(info.values()), info
    assert model.lm_head.weight is model.model.embed_tokens.weight  # SmolLM2-style tied embeddings stay tied
    return model.eval(), AutoTokenizer.from_pretrained(folder)


def same_outputs(a, b, tokenizer) -> None:
    """Greedy tokens equal, and the logits they come from equal to float tolerance (b may compute W0 x + s B A x
    where a has the merged matrix)."""
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(a(ids).logits, b(ids).logits, rtol=1e-4, atol=1e-5)
        greedy = [m.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
                  for m in (a, b)]
    assert greedy[0].tolist() == greedy[1].tolist()


def test_the_policy_exports_as_emapg_eval_checkpoint_loads_it(runs, tmp_path):
    from safetensors import safe_open

    from agent.policy import load_policy
    from trainer.run.checkpoint import load_policy_weights

    path, ckpt = checkpoint_of(runs["full"])
    out = tmp_path / "policy"
    assert "held-out EM: not evaluated" in run_cli("export", str(runs["full"]), "--out", str(out))  # a run: latest
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "README.md"} <= {p.name for p in out.iterdir()}
    assert (out / "model.safetensors").stat().st_mode == (out / "config.json").stat().st_mode  # not owner-only
    with safe_open(out / "model.safetensors", "pt") as f:
        assert "lm_head.weight" not in f.keys()  # the tied tensor written once
    model, tokenizer = exported(out)
    for name, tensor in model.state_dict().items():  # bit for bit the checkpoint's policy
        assert torch.equal(tensor, ckpt.policy[name]), name
    inside = load_policy(str(runs["model"]), device="cpu").eval()  # `emapg eval --checkpoint`'s way
    inside.load_state_dict(load_policy_weights(path))
    same_outputs(model, inside, tokenizer)
    assert not torch.equal(ckpt.policy["model.layers.0.self_attn.q_proj.weight"],
                           load_policy(str(runs["model"]), device="cpu").state_dict()[
                               "model.layers.0.self_attn.q_proj.weight"])  # training moved it: not the base exported

    card = (out / "README.md").read_text()
    for expected in ("EMA-PG: EMA anchor, Top-k KL", "tau = 0.5", "topk (reverse, top-k 4", "| beta | 0.001 |",
                     "Held-out EM: not evaluated", "iteration 2", "library_name: transformers", "kl:"):
        assert expected in card, expected


def test_emapg_eval_reads_the_exported_folder_and_the_card_quotes_its_em(runs, tmp_path):
    """`emapg eval --model FOLDER` runs the export exactly as `emapg eval --checkpoint` runs the checkpoint (the
    same greedy trajectories); written where a comparison puts iteration 2's evaluation, the card quotes it."""
    out = tmp_path / "policy"
    run_cli("export", str(runs["full"]), "--out", str(out))
    via_checkpoint = tmp_path / "eval-checkpoint"
    run_cli("eval", "--model", str(runs["model"]), "--checkpoint", str(runs["full"]), *runs["eval"],
            "--out", str(via_checkpoint))
    beside = runs["full"] / "eval-0002"  # <run>/eval-NNNN: emapg compare's evaluation of iteration N's policy
    run_cli("eval", "--model", str(out), *runs["eval"], "--out", str(beside))
    try:
        def responses(folder: Path) -> list:
            lines = (folder / "trajectories" / "bamboogle.agent.jsonl").read_text().splitlines()
            return [json.loads(line)["response_ids"] for line in lines]

        assert len(responses(beside)) == 2 and responses(beside) == responses(via_checkpoint)
        report = json.loads((beside / "report.json").read_text())
        output = run_cli("export", str(runs["full"]), "--out", str(out), "--overwrite")
        assert "held-out EM from" in output
        card = (out / "README.md").read_text()
        em = report["results"][0]["em"]
        assert "Held-out EM: not evaluated" not in card and f"EM **{em:.3f}**" in card
        assert "| bamboogle | agent | 2 |" in card
    finally:
        shutil.rmtree(beside)  # the other tests see the run without an evaluation


def test_the_anchor_exports_as_the_comparison_evaluates_it(runs, tmp_path):
    from agent.policy import load_policy
    from trainer.ema import EmaAnchor, anchor_weights_in

    _, ckpt = checkpoint_of(runs["full"])
    out = tmp_path / "anchor"
    run_cli("export", str(runs["full"]), "--anchor", "--out", str(out))
    model, tokenizer = exported(out)
    for name, tensor in ckpt.anchor.items():
        assert torch.equal(model.state_dict()[name], tensor), name
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(ckpt.anchor[name], ckpt.policy[name])  # an anchor, not the policy again
    policy = load_policy(str(runs["model"]), device="cpu").eval()
    anchor = EmaAnchor(policy)
    anchor.load_state_dict(ckpt.anchor)
    with anchor_weights_in(policy, anchor) as inside:  # emapg compare's anchor evaluation
        same_outputs(model, inside, tokenizer)
    card = (out / "README.md").read_text()
    assert "the EMA anchor at iteration 2" in card and "KL anchor, not its policy" in card and "not evaluated" in card


def lora_inside(runs):
    """The LoRA run's policy as the trainer holds it: its model, the SFT base (`--init`), the adapters."""
    from agent.policy import load_policy
    from trainer.lora import apply_lora, load_base_weights, load_policy_checkpoint_state
    from trainer.run.checkpoint import load_policy_weights

    _, ckpt = checkpoint_of(runs["lora"])
    model = apply_lora(load_policy(str(runs["model"]), device="cpu"), 4, 8.0,
                       ckpt.config["lora"]["target_modules"], 0.0).eval()
    load_base_weights(model, load_policy_weights(runs["lora"] / "sft"))
    load_policy_checkpoint_state(model, ckpt.policy)
    return model, ckpt


def test_a_lora_policy_exports_merged_on_the_base_it_was_trained_on(runs, tmp_path):
    from trainer.lora import merged_weights

    out = tmp_path / "lora-policy"
    output = run_cli("export", str(runs["lora"]), "--out", str(out))
    assert "LoRA merged on" in output and str(runs["lora"] / "sft") in output  # found beside the run: its sft/
    model, tokenizer = exported(out)
    inside, _ = lora_inside(runs)
    merged = dict(merged_weights(inside, inside.state_dict().items()))
    assert model.state_dict().keys() == merged.keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, merged[name]), name
    same_outputs(model, inside, tokenizer)  # the adapters' own forward (W0 x + s B A x) on the same tokens
    card = (out / "README.md").read_text()
    assert "EMA-k3: EMA anchor, k3 KL" in card and "rank 4, alpha 8.0" in card and "W0 + s B A" in card

    # Another base (the full-weight run's trained policy fits the shapes) is refused by the adapters' fingerprint.
    error = run_cli("export", str(runs["lora"]), "--out", str(tmp_path / "wrong"), "--base", str(runs["full"]), code=2)
    assert "trained on another base" in error and not (tmp_path / "wrong").exists()


def test_a_lora_anchor_exports_as_base_plus_its_averaged_delta(runs, tmp_path):
    """The LoRA anchor is W0 + D, D the EMA of s B A (trainer.ema.LoraEmaAnchor): exported merged, equal to the
    anchor module's own forward, and not the policy's merged weights."""
    from trainer.ema import LoraEmaAnchor
    from trainer.run.checkpoint import load_policy_weights

    out = tmp_path / "lora-anchor"
    run_cli("export", str(runs["lora"]), "--anchor", "--out", str(out))
    model, tokenizer = exported(out)
    inside, ckpt = lora_inside(runs)
    base = load_policy_weights(runs["lora"] / "sft")
    deltas = {name.removesuffix(".delta"): d for name, d in ckpt.anchor.items()}
    assert len(deltas) == 2 * 7  # two layers, seven adapted modules each
    for name, tensor in model.state_dict().items():
        module = name.removesuffix(".weight")
        expected = (base[name].float() + deltas[module].float()) if module in deltas else base[name]
        assert torch.equal(tensor, expected.to(tensor.dtype)), name
    name = "model.layers.0.self_attn.q_proj"
    policy_delta = inside.get_submodule(name).get_delta_weight("default")
    assert not torch.allclose(deltas[name], policy_delta) and deltas[name].abs().max() > 0  # moved, but lags
    anchor = LoraEmaAnchor(inside)
    anchor.load_state_dict(ckpt.anchor)
    same_outputs(model, anchor.module, tokenizer)  # W0 x + D x, as the learner runs the anchor
    assert "W0 + D" in (out / "README.md").read_text()


def test_a_tampered_checkpoint_is_refused(runs, tmp_path):
    path, _ = checkpoint_of(runs["full"])
    copy = shutil.copytree(path, tmp_path / "ckpt")
    weights = copy / "policy.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one bit pattern of one weight
    weights.write_bytes(bytes(data))
    out = tmp_path / "out"
    error = run_cli("export", str(copy), "--out", str(out), code=2)
    assert "policy.safetensors is truncated or modified" in error and not out.exists()
    (copy / "manifest.json").unlink()
    assert "no manifest.json" in run_cli("export", str(copy), "--out", str(out), code=2)


def test_an_occupied_out_is_refused_unless_overwrite(runs, tmp_path):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    error = run_cli("export", str(runs["full"]), "--out", str(out), code=2)
    assert "not empty" in error and (out / "mine.txt").read_text() == "keep me"
    # A run folder is never replaced, even with --overwrite.
    assert "never replaced" in run_cli("export", str(runs["lora"]), "--out", str(runs["full"]), "--overwrite",
                                       code=2)
    assert (runs["full"] / "checkpoints").is_dir()
    run_cli("export", str(runs["full"]), "--out", str(out), "--overwrite")
    assert not (out / "mine.txt").exists() and (out / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary folder left


def test_the_card_names_each_method_by_its_config_keys():
    from emapg.export import method_of
    from trainer.config import TrainConfig
    from trainer.methods import METHODS

    for name, method in METHODS.items():  # a comparison's run <run>/<method>: its name decides between equal keys
        config = method.config(TrainConfig(), run_name=f"cmp/{name.lower()}").model_dump(mode="json")
        assert method_of(config).name == name
    # GRPO-floor is GRPO-k3c at beta 0.001: an unnamed run with those keys is the more specific one.
    assert method_of(METHODS["GRPO-k3c"].config(TrainConfig()).model_dump(mode="json")).name == "GRPO-floor"
    assert method_of(TrainConfig(kl={"estimator": "k2"}).model_dump(mode="json")) is None
