"""Deployment files: no Docker engine runs in CI, so check what can be checked statically."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def test_compose_file_has_redis_and_worker_services():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    services = compose["services"]
    assert {"redis", "worker"} <= set(services)
    worker = services["worker"]
    assert worker["build"] == {"context": ".", "target": "worker"}
    assert worker["command"][0] == "worker"
    assert "redis://redis:6379/0" in worker["command"]
    assert worker["depends_on"]["redis"]["condition"] == "service_healthy"
    assert worker["stop_signal"] == "SIGTERM"
    assert "--appendonly" in services["redis"]["command"]
    assert services["dashboard"]["profiles"] == ["dashboard"]


def test_compose_file_serves_the_gateway_from_its_light_image():
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    gateway = compose["services"]["gateway"]
    assert gateway["build"] == {"context": ".", "target": "gateway"}
    command = gateway["command"]
    assert command[0] == "serve" and "redis://redis:6379/0" in command
    assert command[command.index("--host") + 1] == "0.0.0.0"  # reachable from the host
    assert gateway["ports"] == ["8000:8000"]
    assert "/metrics" in " ".join(gateway["healthcheck"]["test"])  # up, even with no worker
    stages = [line.split()[-1] for line in (ROOT / "Dockerfile").read_text().splitlines()
              if line.startswith("FROM ")]
    assert stages[-1] == "worker" and "gateway" in stages  # a plain build is the worker


def test_dockerfile_preloads_openblas_and_installs_the_worker():
    text = (ROOT / "Dockerfile").read_text()
    assert "libopenblas0-pthread" in text
    assert "LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3" in text
    assert '".[worker]"' in text and '".[gateway]"' in text
    assert 'ENTRYPOINT ["prefillq"]' in text


def test_every_package_ships_in_a_non_editable_install():
    """A Docker build installs the wheel, not the checkout: every sub-package of the four
    packages must be in it, and the benchmarks must not (they run from a checkout;
    tests/test_packaging.py builds the wheel itself)."""
    import tomllib
    from setuptools import find_packages

    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "packages"]["find"]["include"]
    shipped = set(find_packages(where=ROOT, include=include))
    on_disk = {str(p.parent.relative_to(ROOT)).replace("/", ".")
               for top in ("jobs", "worker", "model", "tokentext")
               for p in (ROOT / top).rglob("__init__.py")}
    assert on_disk <= shipped, on_disk - shipped
    assert not [name for name in shipped if name.split(".")[0] in ("bench", "tests")]
