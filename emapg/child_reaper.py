"""A command's child processes never outlive it, however it ends.

`emapg train` and `emapg compare` start a retrieval server and a vLLM engine (EngineCore and its workers) as child
processes. Killed with SIGKILL, as the kernel's OOM killer does, the command runs none of its own clean-up, and vLLM's
EngineCore does not watch its parent: server, engine and workers stay behind with their memory (~4 GB for SmolLM2's),
so the next attempt runs out of memory too (docs/study_d_plan.md, "Observed while running"). So every `emapg` command
first starts this watchdog: a small process in its own session (a Ctrl-C to the command does not reach it) that notes
the command's descendants every second and, once the command is gone, terminates those still running: SIGTERM, then
SIGKILL after a grace period. A descendant started in the command's last second may be missed.

    python -m emapg.child_reaper PID [GRACE_S]
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

POLL_S = 1.0


def reap_children_at_exit(grace_s: float = 5.0) -> subprocess.Popen:
    """Start the watchdog of this process; it ends when this process has ended and its descendants are stopped."""
    return subprocess.Popen([sys.executable, "-m", "emapg.child_reaper", str(os.getpid()), str(grace_s)],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def watch(parent_pid: int, grace_s: float) -> None:
    import psutil

    try:
        parent = psutil.Process(parent_pid)
    except psutil.NoSuchProcess:
        return
    me = os.getpid()
    descendants: dict[int, psutil.Process] = {}
    # Orphaned, this process is re-parented (to init or a subreaper): that is how a SIGKILLed parent shows.
    while os.getppid() == parent_pid:
        try:
            found = [p for p in parent.children(recursive=True) if p.pid != me]
        except psutil.NoSuchProcess:
            break
        # is_running() compares creation times too, so a recycled pid is never taken for a descendant.
        descendants = {p.pid: p for p in [*descendants.values(), *found] if p.is_running()}
        time.sleep(POLL_S)
    left = [p for p in descendants.values() if p.is_running()]
    for process in left:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(left, timeout=grace_s)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass


if __name__ == "__main__":
    watch(int(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 5.0)
