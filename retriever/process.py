"""Run the retrieval server as a child process on a free loopback port (the demo, end-to-end tests, benchmarks)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 120.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"retrieval server exited with code {proc.returncode} before it was healthy")
        try:
            r = httpx.get(url + "/health", timeout=2.0)
            if r.status_code == 200:
                return r.json()
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"retrieval server at {url} not healthy after {timeout_s:.0f} s")


@contextmanager
def running_server(
    index: Path, *extra_args: str, port: int | None = None, env: dict[str, str] | None = None, log: Path | None = None
) -> Iterator[str]:
    """Start `emapg serve --index INDEX` on 127.0.0.1, yield its URL once /health answers, stop it after."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "emapg.cli", "serve", "--index", str(index), "--port", str(port), *extra_args]
    out = open(log, "ab") if log else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if log:
            out.close()
