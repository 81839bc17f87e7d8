"""The trainer's mixed precision: `autocast: auto` (the CPU configs') runs bf16 only where the CPU has it natively.
Emulated bf16 measured 55x slower than fp32 on a CPU without AVX-512 (issue 12); the flags are faked here."""

import warnings
from pathlib import Path

import pytest
import torch

from trainer.learner.logprobs import autocast, resolve_autocast
from trainer.config import ConfigError, load_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def cpu_flags(monkeypatch):
    """Set what torch reports of the CPU's AVX512-BF16 and AMX support."""

    def set_flags(avx512_bf16: bool, amx: bool) -> None:
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
        resolve_autocast.cache_clear()  # the choice is made once per process

    yield set_flags
    resolve_autocast.cache_clear()


@pytest.mark.parametrize("config", ["configs/cpu_demo.yaml", "configs/cpu_compare.yaml"])
def test_cpu_configs_choose_fp32_without_native_bf16_and_bf16_with_it(config, cpu_flags):
    cfg = load_config(ROOT / config)
    assert cfg.autocast == "auto"
    for avx512_bf16, amx, chosen in ((False, False, "none"), (True, False, "bfloat16"), (False, True, "bfloat16")):
        cpu_flags(avx512_bf16, amx)
        assert resolve_autocast(cfg.autocast, "cpu") == chosen


def test_auto_autocast_runs_the_matmuls_in_the_chosen_dtype(cpu_flags):
    layer, x = torch.nn.Linear(8, 8), torch.randn(2, 8)
    cpu_flags(False, False)
    with autocast("auto", layer):
        assert layer(x).dtype == torch.float32
    cpu_flags(True, False)
    with autocast("auto", layer):
        assert layer(x).dtype == torch.bfloat16
    with autocast("none", layer):
        assert layer(x).dtype == torch.float32


def test_explicit_bf16_where_it_is_emulated_is_kept_with_a_warning_of_the_cost(cpu_flags):
    cpu_flags(False, False)
    with pytest.warns(UserWarning, match="55x slower"):
        assert resolve_autocast("bfloat16", "cpu") == "bfloat16"
    cpu_flags(True, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # where bf16 is native, no warning
        assert resolve_autocast("bfloat16", "cpu") == "bfloat16"


def test_a_bad_autocast_value_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match="autocast"):
        load_config(overrides=["autocast=bf16"])
