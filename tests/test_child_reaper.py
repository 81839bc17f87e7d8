"""emapg/child_reaper.py, for real: a command that ends, by SIGKILL (as the OOM killer ends it) or by returning,
leaves none of its descendants running: a child, a child that ignores SIGTERM (killed after the grace period) and a
grandchild whose parent is stopped first. The `emapg` command starts the watchdog."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]

SLEEPER = "import time; time.sleep(600)"
COMMAND = f"""
import subprocess, sys, time
from emapg.child_reaper import reap_children_at_exit

reap_children_at_exit(grace_s=1.0)
child = subprocess.Popen([sys.executable, "-c", {SLEEPER!r}])
stubborn = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN);"
                             " print(flush=True); time.sleep(600)"], stdout=subprocess.PIPE)
stubborn.stdout.readline()  # SIGTERM ignored from here on
middle = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                           "print(subprocess.Popen([sys.executable, '-c', {SLEEPER!r}]).pid, flush=True); time.sleep(600)"],
                          stdout=subprocess.PIPE)
grandchild = int(middle.stdout.readline())
print(child.pid, stubborn.pid, middle.pid, grandchild, flush=True)
time.sleep(2.0)  # the watchdog looks every second
print("noted", flush=True)
if sys.argv[1] == "wait":
    time.sleep(600)
"""


def gone(process: psutil.Process) -> bool:
    """Ended: no such process, or a zombie its new parent has not reaped yet."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


@pytest.mark.parametrize("ending", ["sigkill", "return"])
def test_a_command_that_ends_leaves_no_descendant_running(ending):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = subprocess.Popen([sys.executable, "-c", COMMAND, "wait" if ending == "sigkill" else "return"],
                               stdout=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    descendants = [psutil.Process(int(pid)) for pid in command.stdout.readline().split()]
    try:
        assert command.stdout.readline().strip() == "noted"
        assert not any(gone(p) for p in descendants)
        if ending == "sigkill":
            command.send_signal(signal.SIGKILL)
        assert command.wait(timeout=30) == (-signal.SIGKILL if ending == "sigkill" else 0)
        deadline = time.monotonic() + 15  # a look (1 s), SIGTERM, the grace period (1 s), SIGKILL
        while time.monotonic() < deadline and not all(gone(p) for p in descendants):
            time.sleep(0.2)
        assert [p.pid for p in descendants if not gone(p)] == []
    finally:
        for process in descendants:
            if not gone(process):
                process.kill()


def test_the_emapg_command_starts_the_watchdog_before_the_app(monkeypatch):
    import emapg.child_reaper
    import emapg.cli

    calls = []
    monkeypatch.setattr(emapg.child_reaper, "reap_children_at_exit", lambda: calls.append("watchdog"))
    monkeypatch.setattr(emapg.cli, "app", lambda: calls.append("app"))  # a fake app: the order is what is checked
    emapg.cli.main()
    assert calls == ["watchdog", "app"]
    assert tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["emapg"] == "emapg.cli:main"
