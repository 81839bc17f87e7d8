"""trainer/methods.py is the one table of arms: every study's arms are methods of it, and the Makefile's study
targets run exactly the arms its studies name (in their plan's order)."""

from __future__ import annotations

import re
from pathlib import Path

from trainer.config import load_config
from trainer.methods import METHODS, STUDIES

ROOT = Path(__file__).resolve().parents[1]


def test_every_studys_arms_are_methods_and_make_a_valid_config():
    base = load_config(overrides=[])
    for study, arms in STUDIES.items():
        assert len(set(arms)) == len(arms), study
        for arm in arms:
            METHODS[arm].config(base)  # validated again: a method whose keys the config refuses fails here


def test_the_makefiles_study_targets_read_their_arms_from_the_table():
    import subprocess
    import sys

    # `make -n` expands the targets as they would run (study-d runs study-b's recipe with its own variables); each
    # target's arms are the table's study of the same name.
    for study in ("two-hop", "study-b", "study-d"):
        expanded = subprocess.run(["make", "-n", study], cwd=ROOT, capture_output=True, text=True, check=True).stdout
        assert re.findall(r"--methods \$\(\S+ -m trainer\.methods (\S+)\)", expanded) == [study], study
        printed = subprocess.run([sys.executable, "-m", "trainer.methods", study], cwd=ROOT, capture_output=True,
                                 text=True, check=True).stdout.strip()
        assert tuple(printed.split(",")) == STUDIES[study]


def test_the_stability_preset_and_analysis_read_the_stability_studys_arms():
    from experiments.mechanism.stability import ARMS
    from experiments.mechanism.sweep import study_config

    assert tuple(study_config("stability").sweep.methods) == ARMS == STUDIES["stability"]
