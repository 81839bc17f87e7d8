"""The compose file and Dockerfile, checked without a Docker engine (none runs on CI machines)."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_compose_file_is_valid_and_checks_health():
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("docker-compose is missing: `make setup` installs Debian's docker-compose package")
    out = subprocess.run([exe, "-f", str(ROOT / "docker-compose.yml"), "config"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    config = yaml.safe_load(out.stdout)
    retriever = config["services"]["retriever"]
    assert "/health" in json.dumps(retriever["healthcheck"]["test"])
    targets = [v["target"] if isinstance(v, dict) else v.split(":")[1] for v in retriever["volumes"]]
    assert "/data" in targets  # the index volume
    assert (ROOT / retriever["build"]["dockerfile"]).is_file()


def test_dockerfile_pins_the_cpu_torch_and_copies_what_the_server_imports():
    text = (ROOT / "docker" / "retriever.Dockerfile").read_text()
    assert "torch==2.13.0" in text
    for package in ("emapg", "data", "retriever"):
        assert f"COPY {package} ./{package}" in text
