"""The compose file and Dockerfile, checked without a Docker engine (none runs on CI machines)."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compose() -> dict:
    """docker-compose.yml as `docker-compose config` validates and resolves it."""
    exe = shutil.which("docker-compose")
    if exe is None:
        pytest.fail("docker-compose is missing: `make setup` installs Debian's docker-compose package")
    out = subprocess.run([exe, "-f", str(ROOT / "docker-compose.yml"), "config"], capture_output=True, text=True,
                         check=False)
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def volume_targets(service: dict) -> dict[str, str]:
    """mount target -> source volume (long or short syntax)."""
    out = {}
    for v in service["volumes"]:
        source, target = (v["source"], v["target"]) if isinstance(v, dict) else v.split(":")[:2]
        out[target] = source
    return out


def test_compose_file_is_valid_and_checks_health(compose):
    retriever = compose["services"]["retriever"]
    assert "/health" in json.dumps(retriever["healthcheck"]["test"])
    assert "/data" in volume_targets(retriever)  # the index volume
    assert (ROOT / retriever["build"]["dockerfile"]).is_file()


def test_compose_trainer_reserves_gpus_and_waits_for_a_healthy_retriever(compose):
    trainer = compose["services"]["trainer"]
    assert (ROOT / trainer["build"]["dockerfile"]).is_file()
    devices = trainer["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert trainer["depends_on"]["retriever"]["condition"] == "service_healthy"
    command = trainer["command"]
    config = command[command.index("--config") + 1]
    assert config == "configs/gpu_1x.yaml" and (ROOT / config).is_file()
    assert "retriever.url=http://retriever:8000" in command  # the service name on the compose network
    out_dir = next(arg.partition("=")[2] for arg in command if arg.startswith("out_dir="))
    assert volume_targets(trainer)[out_dir] == "runs"


def test_compose_tensorboard_reads_the_runs_volume_on_loopback(compose):
    tensorboard = compose["services"]["tensorboard"]
    assert volume_targets(tensorboard)["/runs"] == "runs"
    assert "/runs" in tensorboard["entrypoint"]
    hosts = [p["host_ip"] if isinstance(p, dict) else p.split(":")[0] for p in tensorboard["ports"]]
    assert hosts == ["127.0.0.1"]
    assert "deploy" not in tensorboard  # no GPU: it runs on the retriever's CPU image


def test_trainer_dockerfile_pins_vllm_and_ray_and_runs_emapg_train():
    text = (ROOT / "docker" / "trainer.Dockerfile").read_text()
    assert text.startswith("#") and "FROM nvidia/cuda:" in text
    assert "vllm==0.32.0" in text  # pins torch==2.13.0, the torch pyproject.toml pins
    assert "ray[default]==" in text
    assert 'ENTRYPOINT ["emapg", "train"]' in text
    for package in ("emapg", "data", "retriever", "eval", "agent", "trainer", "configs", "benchmarks"):
        assert f"COPY {package} ./{package}" in text


def test_dockerfile_pins_the_cpu_torch_and_copies_what_the_server_imports():
    text = (ROOT / "docker" / "retriever.Dockerfile").read_text()
    assert "torch==2.13.0" in text
    for package in ("emapg", "data", "retriever"):
        assert f"COPY {package} ./{package}" in text
