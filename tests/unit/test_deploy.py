"""The deployment files: the compose file is one Compose accepts, with the stack DESIGN.md names."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"


def test_compose_names_the_whole_stack() -> None:
    services = yaml.safe_load(COMPOSE.read_text())["services"]
    assert {"postgres", "redis", "migrate", "api", "worker", "flower"} <= set(services)
    assert services["migrate"]["command"][0] == "migrate"
    for name in ("api", "worker"):
        depends = services[name]["depends_on"]
        assert depends["migrate"]["condition"] == "service_completed_successfully"
    assert "container_name" not in services["worker"]  # so --scale worker=N works


def test_compose_config_accepts_the_file() -> None:
    compose = shutil.which("docker-compose")
    if compose is None:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail("docker-compose is missing; .ci/run installs it")
        pytest.skip("docker-compose is not installed")
    result = subprocess.run(
        [compose, "-f", str(COMPOSE), "config", "-q"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stderr


def test_workers_serve_their_metrics_by_default_where_prometheus_looks() -> None:
    from shared.settings import Settings

    default_port = Settings.model_fields["worker_metrics_port"].default
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())["scrape_configs"]
    [worker_job] = [job for job in scrape if job["job_name"] == "ratchet-worker"]
    assert default_port == worker_job["dns_sd_configs"][0]["port"] != 0


def test_prometheus_scrapes_the_api_with_the_token_the_api_is_given() -> None:
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())["scrape_configs"]
    [api_job] = [job for job in scrape if job["job_name"] == "ratchet-api"]
    environment = yaml.safe_load(COMPOSE.read_text())["x-ratchet"]["environment"]
    token = environment["RATCHET_METRICS_TOKEN"]
    assert api_job["authorization"]["credentials"] == token
    assert len(token) >= 32  # what the API accepts as a metrics token
