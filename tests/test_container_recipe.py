"""docker/Dockerfile, the container recipe of docs/clusters.md (no image is built here): it
installs exactly the pinned set, swaps in the pinned GPU engine for the cuda variant, and has what the MPI
Operator's pods and the worker's entry script use."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from ortflow.launch import mpijob

ROOT = Path(__file__).parents[1]
RECIPE = ROOT / "docker" / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", "\n".join(line for line in RECIPE.read_text().splitlines()
                                          if not line.lstrip().startswith("#")))  # fmt: skip
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in text.splitlines() if line.strip()]


def test_the_recipe_installs_the_pinned_lock_and_the_pinned_gpu_engine():
    steps = instructions()
    args = dict(value.split("=", 1) for kind, value in steps if kind == "ARG" and "=" in value)
    assert args["VARIANT"] == "cpu" and args["PYTHON_IMAGE"].startswith("python:3.11")  # ortflow needs 3.11
    lock = (ROOT / "requirements.lock").read_text()
    cpu_engine = re.search(r"^onnxruntime-training-cpu==(\S+)$", lock, re.M)[1]
    assert args["GPU_ENGINE"] == f"onnxruntime-training=={cpu_engine}"  # the same engine release, GPU build
    install = next(value for kind, value in steps if kind == "RUN" and "pip install" in value)
    assert 'pip install -c requirements.lock ".[cuda,text]"' in install  # text: data.text.tokenizer's package
    assert 'pip install -c requirements.lock ".[text]"' in install
    assert "pip uninstall -y onnxruntime-training-cpu" in install  # never both engines
    for kind, value in steps:
        if kind == "COPY":
            for source in value.split()[:-1]:
                assert (ROOT / source).exists(), source
        if kind == "RUN":
            assert subprocess.run(["bash", "-n"], input=value, text=True).returncode == 0, value


def test_the_image_has_what_the_mpijobs_pods_run():
    packages = next(value for kind, value in instructions() if kind == "RUN" and "apt-get install" in value)
    assert {"openssh-server", "openssh-client", "procps"} <= set(packages.split())
    assert "/usr/sbin/sshd" in mpijob.WORKER_SCRIPT and "pgrep" in mpijob.WORKER_SCRIPT  # from those packages
    env = next(value for kind, value in instructions() if kind == "ENV")
    assert "PATH=/opt/ortflow/bin:$PATH" in env  # `python` (kubernetes.python) and its mpiexec are the pinned ones
    assert "docker/Dockerfile" in (ROOT / "docs" / "clusters.md").read_text()
