"""Checkpoints: policy, EMA anchor, optimizer, scheduler, RNG states, data cursor, iteration, config.

A checkpoint is a folder `iter-NNNNNN/` written under a hidden temp name (`.iter-NNNNNN.tmp`), every file and
the folder flushed to disk (fsync), and renamed when complete: a process killed while saving (SIGTERM, SIGKILL,
a full disk) leaves at most a hidden folder that `latest_checkpoint` never returns and the next save removes, and
the previous checkpoint intact. Its `manifest.json` (written last) lists every file with its size and sha256;
loading verifies them all, so a truncated or edited checkpoint is refused instead of silently resuming from garbage. Weights are safetensors;
optimizer/scheduler/RNG state (nested Python objects) go through `torch.save`, loaded with `weights_only=True`.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

MANIFEST = "manifest.json"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    """A checkpoint that is incomplete, corrupt, or made by a different run configuration."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def rng_state() -> dict[str, Any]:
    """Python and NumPy states as JSON-able lists (so nothing needs unpickling), torch's as a tensor."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "python": [version, list(internal), gauss],
        "numpy": [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "torch": torch.get_rng_state(),
    }


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(state["torch"])


@dataclass
class Checkpoint:
    iteration: int
    policy: dict[str, torch.Tensor]
    anchor: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    rng: dict[str, Any]
    data_cursor: dict[str, Any]  # where the prompt sampler is (epoch, position, permutation seed)
    config: dict[str, Any]  # the run's TrainConfig, as JSON-able dict
    guard: dict[str, Any] = field(default_factory=dict)  # trainer.run.guard.Guard's state (reward window, rollbacks)


def _contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses shared or non-contiguous storage (tied embeddings share one): save independent copies.
    return {k: v.detach().contiguous().clone() for k, v in tensors.items()}


def _fsync(path: Path) -> None:
    """Flush a file's (or a folder's entries') bytes to disk: a rename is only as durable as what it names."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _discard(folder: Path) -> None:
    """Remove a checkpoint folder: hidden first (one atomic rename), then deleted, so that a kill mid-deletion leaves
    no half-deleted `iter-*` folder for `latest_checkpoint` to pick."""
    trash = folder.with_name(f".{folder.name}.old")
    shutil.rmtree(trash, ignore_errors=True)
    folder.rename(trash)
    shutil.rmtree(trash)


def _write_files(ckpt: Checkpoint, tmp: Path) -> None:
    save_file(_contiguous(ckpt.policy), str(tmp / "policy.safetensors"))
    save_file(_contiguous(ckpt.anchor), str(tmp / "anchor.safetensors"))
    torch.save(
        {"optimizer": ckpt.optimizer, "scheduler": ckpt.scheduler, "torch_rng": ckpt.rng["torch"]},
        tmp / "trainer_state.pt",
    )
    python_rng = {k: v for k, v in ckpt.rng.items() if k != "torch"}
    (tmp / "state.json").write_text(json.dumps(
        {"iteration": ckpt.iteration, "data_cursor": ckpt.data_cursor, "config": ckpt.config, "rng": python_rng,
         "guard": ckpt.guard},
        default=str,
    ))
    files = sorted(p.name for p in tmp.iterdir())
    manifest = {
        "format_version": FORMAT_VERSION,
        "iteration": ckpt.iteration,
        "files": {name: {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)} for name in files},
    }
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    for name in [*files, MANIFEST]:
        _fsync(tmp / name)
    _fsync(tmp)


def save_checkpoint(ckpt: Checkpoint, run_dir: Path, keep: int = 2) -> Path:
    root = Path(run_dir) / "checkpoints"
    final = root / f"iter-{ckpt.iteration:06d}"
    tmp = root / f".iter-{ckpt.iteration:06d}.tmp"
    root.mkdir(parents=True, exist_ok=True)
    for leftover in root.glob(".iter-*"):  # what an interrupted save or deletion left behind
        shutil.rmtree(leftover)
    try:
        tmp.mkdir()
        _write_files(ckpt, tmp)
    # A full disk (ENOSPC), a quota, a read-only folder: nothing half-written stays. safetensors reports I/O errors
    # as its own SafetensorError ("I/O error: No space left on device"), not as OSError.
    except (OSError, SafetensorError) as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(f"could not write checkpoint {final}: {e}; the previous checkpoints are untouched") from e
    if final.exists():  # the same iteration saved again (after a rollback)
        _discard(final)
    tmp.rename(final)
    _fsync(root)
    for old in sorted(root.glob("iter-*"))[:-keep]:
        _discard(old)
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = sorted((Path(run_dir) / "checkpoints").glob("iter-*"))
    return found[-1] if found else None


def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint folder as given, or the latest checkpoint of a run folder."""
    path = Path(path)
    if (path / MANIFEST).is_file():
        return path
    latest = latest_checkpoint(path)
    if latest is None:
        raise CheckpointError(f"{path} is neither a checkpoint (no {MANIFEST}) nor a run folder with checkpoints/")
    return latest


def verify_checkpoint(path: Path) -> dict:
    """The manifest, after checking that every listed file exists with the recorded size and sha256."""
    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise CheckpointError(f"{path}: no {MANIFEST}; an incomplete checkpoint (interrupted while saving?)")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}/{MANIFEST} is corrupt: {e}") from e
    if manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{path}: checkpoint format {manifest.get('format_version')}, expected {FORMAT_VERSION}")
    for name, meta in files.items():
        f = path / name
        if not f.is_file():
            raise CheckpointError(f"{path}: {name} is missing")
        if f.stat().st_size != meta["bytes"] or _sha256(f) != meta["sha256"]:
            raise CheckpointError(f"{path}: {name} is truncated or modified (size/sha256 differ from the manifest)")
    return manifest


def load_policy_weights(path: Path) -> dict[str, torch.Tensor]:
    """Only the policy's weights of a checkpoint (or of a run folder's latest), after verifying the checkpoint."""
    path = resolve_checkpoint(path)
    verify_checkpoint(path)
    return load_file(str(path / "policy.safetensors"))


def load_checkpoint(path: Path) -> Checkpoint:
    path = Path(path)
    verify_checkpoint(path)
    state = json.loads((path / "state.json").read_text())
    trainer_state = torch.load(path / "trainer_state.pt", weights_only=True)
    return Checkpoint(
        iteration=state["iteration"],
        policy=load_file(str(path / "policy.safetensors")),
        anchor=load_file(str(path / "anchor.safetensors")),
        optimizer=trainer_state["optimizer"],
        scheduler=trainer_state["scheduler"],
        rng={**state["rng"], "torch": trainer_state["torch_rng"]},
        data_cursor=state["data_cursor"],
        config=state["config"],
        guard=state.get("guard", {}),  # checkpoints from before the guard have none
    )


# How torch runs AdamW's step, not what it computes. Checkpoints leave them out and a load keeps the live optimizer's
# own: a state saved fused (one process) resumes sharded (FSDP's DTensors have no fused kernel) and the reverse, and
# a checkpoint from before fused AdamW resumes fused.
OPTIMIZER_IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable")


def portable_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict without the implementation flags of its parameter groups."""
    return {"state": state["state"],
            "param_groups": [{key: value for key, value in group.items() if key not in OPTIMIZER_IMPLEMENTATION}
                             for group in state["param_groups"]]}


def optimizer_state_for(optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> dict[str, Any]:
    """`state` with `optimizer`'s own implementation flags, group by group, ready for its `load_state_dict`."""
    return {"state": state["state"],
            "param_groups": [{**saved, **{key: live[key] for key in OPTIMIZER_IMPLEMENTATION if key in live}}
                             for live, saved in zip(optimizer.param_groups, state["param_groups"])]}


def optimizer_state_by_index(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name (torch.distributed.checkpoint's full state dict, what FSDP gives)
    in torch's own format, keyed by the parameter's position in `names` (the model's `named_parameters()` order, the
    order the optimizer was built with). Checkpoints hold this one format whatever the run's sharding, so a run on
    8 FSDP ranks resumes in one process and the reverse."""
    index = {name: i for i, name in enumerate(names)}
    return {"state": {index[name]: value for name, value in state["state"].items()},
            "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                             for group in state["param_groups"]]}


def optimizer_state_by_name(state: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """The inverse of `optimizer_state_by_index`."""
    return {"state": {names[i]: value for i, value in state["state"].items()},
            "param_groups": [{**group, "params": [names[i] for i in group["params"]]}
                             for group in state["param_groups"]]}


def check_compatible(ckpt_config: dict[str, Any], config: dict[str, Any], keys: tuple[str, ...] = ("model",)) -> None:
    """Refuse to resume a run whose model (or other named key) differs from the checkpoint's."""
    for key in keys:
        if ckpt_config.get(key) != config.get(key):
            raise CheckpointError(
                f"checkpoint was made with {key}={ckpt_config.get(key)!r}, this run has {key}={config.get(key)!r}"
            )
