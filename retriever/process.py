"""Run the retrieval server as a child process on a free loopback port (the demo, end-to-end tests, benchmarks)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path



def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen | None = None, timeout_s: float = 600.0):
    """The server's `GET /health` (retriever.api.Health, read by the client as everywhere else) once it answers."""
    from retriever.client import RetrieverClient, RetrieverUnavailable

    deadline = time.monotonic() + timeout_s
    with RetrieverClient(url, timeout_s=2.0, retries=0) as client:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"retrieval server exited with code {proc.returncode} before it was healthy")
            try:
                return client.health()
            except RetrieverUnavailable:  # not listening yet, or still loading its index
                time.sleep(0.2)
    raise TimeoutError(f"retrieval server at {url} not healthy after {timeout_s:.0f} s")


@dataclass
class ServerProcess:
    """A retrieval server running as a child process, and its URL."""

    proc: subprocess.Popen
    url: str

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def start_server(
    index: Path, *extra_args: str, port: int | None = None, env: dict[str, str] | None = None, log: Path | None = None
) -> ServerProcess:
    """Start `emapg serve --index INDEX` on 127.0.0.1 and return once /health answers; the caller stops it."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "emapg.cli", "serve", "--index", str(index), "--port", str(port), *extra_args]
    with open(log, "ab") if log else open(os.devnull, "wb") as out:  # the child holds its own copy of the file
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    server = ServerProcess(proc, f"http://127.0.0.1:{port}")
    try:
        wait_healthy(server.url, proc)
    except BaseException:
        server.stop()
        raise
    return server


@contextmanager
def running_server(
    index: Path, *extra_args: str, port: int | None = None, env: dict[str, str] | None = None, log: Path | None = None
) -> Iterator[str]:
    """Start `emapg serve --index INDEX` on 127.0.0.1, yield its URL once /health answers, stop it after."""
    server = start_server(index, *extra_args, port=port, env=env, log=log)
    try:
        yield server.url
    finally:
        server.stop()
