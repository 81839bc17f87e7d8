"""`emapg export RUN_OR_CHECKPOINT [--anchor] --out FOLDER`: a training checkpoint as a plain Hugging Face model
folder (model.safetensors, config.json, generation_config.json, tokenizer files, a README.md model card) that
transformers, vLLM or the Hub load as it is.

- The checkpoint is verified (trainer.run.checkpoint.verify_checkpoint: every file's size and sha256) before
  anything is read: a truncated or edited checkpoint is refused, never exported. A run folder means its latest
  checkpoint.
- Weights reach the plain model the way the project loads them itself, so the export is what `emapg eval
  --checkpoint` (policy) and the comparison's anchor evaluation (`anchor_weights_in`, anchor) run:
    full-weight policy   the checkpoint's state dict, strictly (load_policy_checkpoint_state)
    full-weight anchor   restored into an EmaAnchor (its names, shapes and dtype checked), then cast into the
                         policy's dtype (EmaAnchor.copy_to): the anchor is evaluated in the policy's dtype too
    LoRA policy          the adapters on their frozen base, merged: W0 + s B A (trainer.lora.merged_weights,
                         what a vLLM engine is sent during training)
    LoRA anchor          restored into a LoraEmaAnchor, merged: W0 + D, D the EMA of s B A. The anchor already is the
                         EMA of the effective weights (trainer.ema.LoraEmaAnchor), so W0 + D is the anchor itself;
                         averaging or merging A and B would not be
- A LoRA checkpoint holds its adapters and a fingerprint of the frozen base, not the base: the base is the run's
  `model`, or the full-weight checkpoint `emapg train --init` started it from (SFT's). The fingerprint decides:
  the candidates (the model, the comparison's recorded SFT start, the run's own sft/) are tried in that order,
  or only `--base` when given, and adapters on any other base are refused.
- Tied embeddings (SmolLM2 ties lm_head to embed_tokens) stay one tensor: the plain model is loaded from `model`
  (its config ties them), and save_pretrained writes the shared tensor once. The written folder is loaded back
  before it is put in place: no missing, unexpected or resized key, the tie intact, every tensor as meant.
- The folder is written under a hidden temporary name beside --out and renamed when complete; an existing
  non-empty --out is refused unless --overwrite (and never a checkpoint or run folder, even then).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from eval.report import EvalReport, pooled
from trainer.run.checkpoint import MANIFEST, CheckpointError, resolve_checkpoint, verify_checkpoint

CARD = "README.md"
START_FILE = "sft_start.json"  # emapg.compare's record of the SFT checkpoint a comparison's runs started from
HUB_IDS = {"smollm2-135m-instruct": "HuggingFaceTB/SmolLM2-135M-Instruct"}  # the packaged default's origin


class ExportError(ValueError):
    """An export that cannot be made as asked: --out in the way, a LoRA base not found, weights that do not fit."""


@dataclass
class Exported:
    folder: Path
    checkpoint: Path
    iteration: int
    which: str  # "policy" or "anchor"
    lora_base: str | None  # where a LoRA run's frozen base came from; None for full-weight runs
    evaluation: Path | None  # the held-out report the model card quotes


# ---------------------------------------------------------------------------------------------------------- the run


def run_folder(checkpoint: Path) -> Path | None:
    """The run folder a checkpoint belongs to (<run>/checkpoints/iter-N), or None for a checkpoint kept elsewhere."""
    checkpoint = Path(checkpoint)
    return checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None


def is_sft(checkpoint: Path) -> bool:
    """An `emapg sft` checkpoint (<run>/sft/checkpoints/iter-N): supervised steps only, its anchor its policy."""
    run = run_folder(checkpoint)
    return run is not None and run.name == "sft"


def _setting(config: dict, dotted: str, default=None):
    node = config
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return default
        node = node[part]
    return node


# --------------------------------------------------------------------------------------------------------- --out


def _prepare_out(out: Path, overwrite: bool, checkpoint: Path) -> Path:
    """The temporary folder to write into, beside `out`, after checking that `out` may be (re)placed."""
    out = Path(out)
    resolved, source = out.resolve(), checkpoint.resolve()
    if resolved == source or source in resolved.parents or resolved in source.parents:
        raise ExportError(f"--out {out} overlaps the checkpoint {checkpoint}: choose a folder outside the run")
    if out.exists():
        if out.is_dir() and ((out / MANIFEST).is_file() or (out / "checkpoints").is_dir()):
            raise ExportError(f"--out {out} is a training checkpoint, run folder or index: never replaced, even with "
                              "--overwrite")
        if (out.is_file() or any(out.iterdir())) and not overwrite:
            raise ExportError(f"--out {out} exists and is not empty: choose another folder or pass --overwrite")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.export-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def _put_in_place(tmp: Path, out: Path) -> None:
    if out.is_dir():
        shutil.rmtree(out)
    elif out.exists():
        out.unlink()
    tmp.rename(out)


# ------------------------------------------------------------------------------------------------------- weights


def _load_plain(config: dict):
    """The run's `model`, plain, on the CPU in the run's dtype: the architecture, tie and tokenizer of the export."""
    from agent.policy import load_policy

    name = config["model"]
    try:
        return load_policy(name, dtype=config.get("dtype", "float32"), device="cpu")
    except (OSError, ValueError) as e:
        raise ExportError(f"the run's model {name!r} (its config's `model`) cannot be loaded: {e}") from e


def _tied_aliases(model) -> dict[str, str]:
    """Second names of shared parameters (lm_head.weight -> model.embed_tokens.weight under tied embeddings)."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def _without_tied_copies(model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` without the second names of tied weights, which must hold the same values as the first: a state
    dict (SFT's anchor is its policy's) names them twice, an EmaAnchor's once."""
    state = dict(state)
    for alias, name in _tied_aliases(model).items():
        if alias in state:
            if name in state and not torch.equal(state[alias], state[name]):
                raise ExportError(f"{alias} and {name} are tied in the model but differ in the checkpoint: they cannot "
                                  "be written as one tensor")
            state.setdefault(name, state[alias])
            del state[alias]
    return state


def _load_into(plain, weights: dict[str, torch.Tensor]) -> None:
    """`weights` (the plain model's names) into `plain`, every parameter covered, nothing left over, ties agreeing."""
    weights = _without_tied_copies(plain, weights)
    own = {name for name, _ in plain.named_parameters()}  # tied weights once
    missing, unexpected = sorted(own - set(weights)), sorted(set(weights) - set(plain.state_dict()))
    if missing or unexpected:
        raise ExportError(f"the weights do not fit the run's model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    try:  # not strict: it would ask for the tied second names again
        plain.load_state_dict(weights, strict=False)
    except RuntimeError as e:  # a resized tensor
        raise ExportError(f"the weights do not fit the run's model: {e}") from e


def _lora_model(config: dict):
    from trainer.lora import apply_lora

    lora = config["lora"]
    model = _load_plain(config)
    return apply_lora(model, lora["rank"], lora["alpha"], lora["target_modules"], lora["dropout"])


def _fingerprint_fits(model, state: dict[str, torch.Tensor]) -> bool:
    from trainer.lora import BASE_FINGERPRINT, base_fingerprint

    saved, own = state.get(BASE_FINGERPRINT), base_fingerprint(model)
    return saved is not None and saved.shape == own.shape and torch.allclose(saved, own, rtol=1e-9, atol=1e-9)


def lora_base_candidates(checkpoint: Path) -> list[Path]:
    """Full-weight checkpoints (or run folders) a LoRA run may have started from, besides its `model`: the SFT start
    a comparison recorded (sft_start.json), and the run's own sft/ (`emapg sft` then `emapg train --init <run>/sft`,
    and the demo)."""
    run = run_folder(checkpoint)
    if run is None:
        return []
    found = []
    if (run / START_FILE).is_file():
        found.append(Path(json.loads((run / START_FILE).read_text())["init"]))
    found.append(run / "sft")
    return [path for path in found if (path / MANIFEST).is_file() or (path / "checkpoints").is_dir()]


def _fit_lora_base(model, state: dict[str, torch.Tensor], config: dict, checkpoint: Path, base: Path | None) -> str:
    """Put the base the adapters were trained on into `model`'s frozen weights (their fingerprint must match);
    returns where it came from."""
    from trainer.lora import load_base_weights
    from trainer.run.checkpoint import load_policy_weights

    tried = []
    candidates = [base] if base is not None else [None, *lora_base_candidates(checkpoint)]
    for candidate in candidates:
        if candidate is not None:  # None: the model's own weights, as loaded
            try:
                load_base_weights(model, load_policy_weights(candidate))
            except ValueError as e:  # a CheckpointError too: a corrupt --base is named, not skipped
                if base is not None:
                    raise ExportError(f"--base {base}: {e}") from e
                tried.append(f"{candidate} ({e})")
                continue
        if _fingerprint_fits(model, state):
            return str(candidate) if candidate is not None else config["model"]
        tried.append(str(candidate) if candidate is not None else f"the model {config['model']}")
    raise ExportError(f"the LoRA adapters of {checkpoint} were trained on another base than {'; '.join(tried)}: give "
                      "the full-weight checkpoint (or run folder) the run started from, its `emapg train --init`, with "
                      "--base")


def _anchor_merged(anchor) -> dict[str, torch.Tensor]:
    """A LoraEmaAnchor's effective weights under the plain model's names: W0 + D in each adapted module (computed in
    fp32, in W0's dtype), the shared frozen rest as it is."""
    weights = {}
    deltas = {name[: -len(".delta")]: t for name, t in anchor.module.state_dict().items() if name.endswith(".delta")}
    for name, tensor in anchor.module.state_dict().items():
        if name.endswith(".delta"):
            continue
        module = name[: -len(".base_layer.weight")] if name.endswith(".base_layer.weight") else None
        if module in deltas:
            tensor = (tensor.detach().float() + deltas[module].float()).to(tensor.dtype)
        weights[name.replace(".base_layer.", ".")] = tensor
    return weights


def exported_model(checkpoint: Path, config: dict, anchor: bool, base: Path | None = None):
    """(the plain model holding the policy's or the anchor's weights, where a LoRA base came from)."""
    from safetensors.torch import load_file

    from trainer.ema import EmaAnchor, LoraEmaAnchor
    from trainer.lora import load_policy_checkpoint_state, merged_weights

    policy_state = load_file(str(checkpoint / "policy.safetensors"))
    anchor_state = load_file(str(checkpoint / "anchor.safetensors")) if anchor else None
    ema_dtype = getattr(torch, _setting(config, "ema.dtype", "float32"))
    lora = bool(_setting(config, "lora.rank", 0))
    if lora != any(".lora_" in name for name in policy_state):
        raise ExportError(f"{checkpoint}: its config has lora.rank={_setting(config, 'lora.rank', 0)} but its policy "
                          f"{'holds no' if lora else 'holds'} LoRA adapters")
    if not lora:
        plain = _load_plain(config)
        try:
            if anchor:
                ema = EmaAnchor(plain, dtype=ema_dtype)
                ema.load_state_dict(_without_tied_copies(plain, anchor_state))
                ema.copy_to(plain)  # into the policy's dtype, as the anchor is evaluated
            else:
                load_policy_checkpoint_state(plain, policy_state)
        except (ValueError, RuntimeError) as e:
            raise ExportError(f"{checkpoint}: the {'anchor' if anchor else 'policy'} does not fit the run's model: "
                              f"{e}") from e
        return plain, None
    model = _lora_model(config)
    source = _fit_lora_base(model, policy_state, config, checkpoint, base)
    try:
        load_policy_checkpoint_state(model, policy_state)  # names, shapes, fingerprint checked again
        if anchor:
            ema = LoraEmaAnchor(model, dtype=ema_dtype)
            ema.load_state_dict(anchor_state)
            weights = _anchor_merged(ema)
        else:
            weights = dict(merged_weights(model, model.state_dict().items()))
    except ValueError as e:
        raise ExportError(f"{checkpoint}: {e}") from e
    del model  # what `weights` does not hold of it (the adapters)
    plain = _load_plain(config)
    _load_into(plain, weights)
    return plain, source


def check_saved(folder: Path, model) -> None:
    """The written folder loads in plain transformers with no missing, unexpected or resized key, tied weights tied,
    and every tensor equal to `model`'s."""
    from transformers import AutoModelForCausalLM

    loaded, info = AutoModelForCausalLM.from_pretrained(folder, dtype=model.dtype, output_loading_info=True)
    problems = {key: sorted(map(str, value))[:3] for key, value in info.items() if value}
    if problems:
        raise ExportError(f"the written folder does not load cleanly: {problems}")
    if getattr(model.config, "tie_word_embeddings", False):
        if loaded.get_output_embeddings().weight is not loaded.get_input_embeddings().weight:
            raise ExportError("the written folder unties the embeddings the model ties")
    meant = model.state_dict()
    for name, tensor in loaded.state_dict().items():
        if not torch.equal(tensor, meant[name]):
            raise ExportError(f"the written folder's {name} differs from the exported weights")


# ---------------------------------------------------------------------------------------------------- model card


def method_of(config: dict):
    """The trainer.methods.METHODS entry whose keys the config has (the run's own name first: a comparison runs
    method M in <run>/<m>; else the one with the most keys, e.g. GRPO-floor over GRPO-k3c at beta 0.001), or None."""
    from trainer.methods import METHODS

    fixed = _setting(config, "ema.tau") == 1.0
    fits = [m for m in METHODS.values() if m.fixed_reference == fixed
            and all(_setting(config, key) == value for key, value in m.overrides.items())]
    own = str(config.get("name", "")).rsplit("/", 1)[-1].lower()
    named = [m for m in fits if m.name.lower() == own]
    return (named or sorted(fits, key=lambda m: -len(m.overrides)) or [None])[0]


def evaluation_folders(checkpoint: Path, iteration: int, anchor: bool, config: dict) -> list[Path]:
    """Where the run's held-out evaluation of this policy or anchor would be, by the layouts emapg writes:
    `emapg compare` <run>/eval-NNNN (policy at iteration N) and eval-anchor-NNNN; `emapg demo` eval-emapg (its final
    policy) and eval-sft (the SFT model, which a fixed reference's anchor is)."""
    run = run_folder(checkpoint)
    if run is None:
        return []
    if is_sft(checkpoint):  # the SFT model: evaluated by the demo and a comparison as <run>/eval-sft
        return [run.parent / "eval-sft"]
    if anchor:
        found = [run / f"eval-anchor-{iteration:04d}"]
        if _setting(config, "ema.tau") == 1.0:  # a fixed reference: the start model, the SFT one in demo and compare
            found += [run / "eval-sft", *([run.parent / "eval-sft"] if (run / START_FILE).is_file() else [])]
        return found
    found = [run / f"eval-{iteration:04d}"]
    if iteration == _setting(config, "train.iterations") and (run / "eval-emapg").is_dir():
        found.append(run / "eval-emapg")
    return found


def _held_out_section(report_path: Path | None, which: str, iteration: int) -> list[str]:
    if report_path is None:
        return [f"Held-out EM: not evaluated (no evaluation of this {which} at iteration {iteration} beside the run). "
                "`emapg eval --model <this folder>` evaluates it."]
    report = EvalReport.load(report_path)
    p = pooled(report)
    lines = [f"From `{report_path}` ({report.model}; questions: {report.subset}).", "",
             f"Pooled: EM **{p['em']:.3f}** (95% CI {p['em_low']:.3f}-{p['em_high']:.3f}, n = {p['n']}).", "",
             "| dataset | mode | n | EM | EM 95% CI | F1 | valid format | searches |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r.dataset} | {r.mode} | {r.n} | {r.em:.3f} | {r.em_ci95[0]:.3f}-{r.em_ci95[1]:.3f} | {r.f1:.3f} | "
              f"{r.well_formed:.2f} | {r.mean_searches:.2f} |" for r in report.results]
    return lines


def _hub_id(model: str) -> str | None:
    """The base model's Hub id for the card's metadata (a local folder has none)."""
    if model in HUB_IDS:
        return HUB_IDS[model]
    return model if re.fullmatch(r"[\w.-]+/[\w.-]+", model) and not Path(model).exists() else None


def _method_rows(config: dict, checkpoint: Path) -> list[tuple[str, str]]:
    if is_sft(checkpoint):
        return [("method", "SFT warm start (`emapg sft`): supervised steps on the protocol's demonstrations; no RL, "
                           "no KL, its anchor is its policy"),
                ("SFT", f"lr {_setting(config, 'sft.lr')}, {_setting(config, 'sft.epochs')} epoch(s) over "
                        f"{_setting(config, 'sft.examples')} demonstrations")]
    method = method_of(config)
    tau, period = _setting(config, "ema.tau"), _setting(config, "ema.period")
    if tau == 1.0:
        reference = "fixed reference (ema.tau = 1, plain GRPO's): the start model, never updated"
    else:
        every = "every iteration" if period == 1 else f"every {period} iterations"
        reference = (f"EMA anchor: theta_ema <- tau theta_ema + (1 - tau) theta, {every}, tau = {tau} "
                     f"({_setting(config, 'ema.dtype')})")
    estimator = _setting(config, "kl.estimator")
    if estimator == "none":
        kl = "none (no KL term)"
    else:
        topk = f", top-k {_setting(config, 'kl.topk')}" if str(estimator).startswith("topk") else ""
        weight = "on" if _setting(config, "kl.importance_weight") else "off"
        kl = f"{estimator} ({_setting(config, 'kl.direction')}{topk}, importance weight {weight})"
    rank = _setting(config, "lora.rank", 0)
    targets = ", ".join(_setting(config, "lora.target_modules") or [])
    lora = f"rank {rank}, alpha {_setting(config, 'lora.alpha')} on {targets}; merged here" if rank else "off"
    return [("method", f"{method.name}: {method.about}" if method else "a configuration of its own (not one of "
                                                                       "trainer/methods.py's methods)"),
            ("KL reference", reference), ("KL estimator", kl), ("beta", str(_setting(config, "kl.beta"))),
            ("advantage", f"{_setting(config, 'train.advantage')} (std-normalised: "
                          f"{_setting(config, 'train.normalize_adv_std')})"),
            ("reward", f"{_setting(config, 'reward.name')}, format bonus {_setting(config, 'reward.format')}"),
            ("learning rate", str(_setting(config, "train.lr"))), ("LoRA", lora)]


def model_card(exported: Exported, config: dict) -> str:
    which = exported.which
    if which == "anchor":
        which = "fixed reference (anchor)" if _setting(config, "ema.tau") == 1.0 else "EMA anchor"
    step = "step" if is_sft(exported.checkpoint) else "iteration"
    title = f"{config.get('name', 'run')}: the {which} at {step} {exported.iteration}"
    hub = _hub_id(str(config["model"]))
    method = method_of(config)
    tags = ["emapg", "search-agent", "reinforcement-learning", *([method.name] if method else [])]
    meta = {"library_name": "transformers", "pipeline_tag": "text-generation", **({"base_model": hub} if hub else {}),
            "tags": tags}
    lines = ["---", yaml.safe_dump(meta, sort_keys=False).strip(), "---", "", f"# {title}", "",
             f"Exported by `emapg export` from `{exported.checkpoint}` (every file checked against its manifest) as a "
             f"plain transformers model in {config.get('dtype', 'float32')}; base model `{config['model']}`."]
    if exported.lora_base is not None:
        merged = ("W0 + D, D the EMA of the adapters' s B A (the anchor of the effective weights)"
                  if exported.which == "anchor" else "W0 + s B A")
        lines += ["", f"LoRA run: the weights are {merged}, W0 the frozen base from `{exported.lora_base}` (its "
                      "fingerprint matches the checkpoint's)."]
    if exported.which == "anchor":
        lines += ["", "This is the run's KL anchor, not its policy: the comparison's `anchor` rows evaluate it."]
    lines += ["", "## Method", "", "| | |", "|---|---|", *[f"| {k} | {v} |" for k, v in _method_rows(config,
                                                                                                exported.checkpoint)]]
    lines += ["", "## Held-out exact match", "", *_held_out_section(exported.evaluation, exported.which,
                                                                      exported.iteration)]
    lines += ["", "## Use", "", "```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
              'model = AutoModelForCausalLM.from_pretrained("<this folder>")',
              'tokenizer = AutoTokenizer.from_pretrained("<this folder>")', "```", "",
              "`vllm serve <this folder>` serves it; `emapg eval --model <this folder>` runs it as the search agent "
              "it was trained as (its prompt and search/answer protocol: agent/protocol.py).", "",
              "## Training config", "", "```yaml", yaml.safe_dump(config, sort_keys=False).strip(), "```", ""]
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------------------- export


def export(source: Path, out: Path, *, anchor: bool = False, base: Path | None = None,
           overwrite: bool = False) -> Exported:
    """Write the policy (or EMA anchor) of a checkpoint, or of a run folder's latest, as a Hugging Face model folder
    `out`. Raises CheckpointError for a missing or corrupt checkpoint, ExportError for the rest."""
    from agent.policy import load_tokenizer

    checkpoint = resolve_checkpoint(Path(source))
    verify_checkpoint(checkpoint)
    state = json.loads((checkpoint / "state.json").read_text())
    config, iteration = state["config"], state["iteration"]
    if base is not None and not _setting(config, "lora.rank", 0):
        raise ExportError(f"--base is for LoRA runs; {checkpoint} holds full weights (lora.rank=0)")
    tmp = _prepare_out(out, overwrite, checkpoint)
    try:
        model, lora_base = exported_model(checkpoint, config, anchor, base)
        model.save_pretrained(tmp)
        load_tokenizer(config["model"]).save_pretrained(tmp)
        if not (tmp / "generation_config.json").exists():  # a model whose base folder had none: its config's defaults
            from transformers import GenerationConfig

            GenerationConfig.from_model_config(model.config).save_pretrained(tmp)
        check_saved(tmp, model)
        del model
        reports = [folder / "report.json" for folder in evaluation_folders(checkpoint, iteration, anchor, config)]
        exported = Exported(Path(out), checkpoint, iteration, "anchor" if anchor else "policy", lora_base,
                            next((path for path in reports if path.is_file()), None))
        (tmp / CARD).write_text(model_card(exported, config))
        # safetensors writes its files owner-only (0600): a server or container running as another user (vLLM's)
        # could not read the weights. Every file gets the mode the umask gave the card.
        mode = (tmp / CARD).stat().st_mode & 0o777
        for path in tmp.iterdir():
            path.chmod(mode)
        _put_in_place(tmp, Path(out))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return exported


__all__ = ["CheckpointError", "ExportError", "Exported", "export"]
