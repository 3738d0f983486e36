"""``ortflow render CONFIG``: the job training would submit, printed without a cluster and without submitting: the
documented Kubernetes example and a GPU example as MPIJobs the CRD's schema accepts strictly, and the documented
Slurm example as an sbatch script."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import yaml
from typer.testing import CliRunner

from ortflow.cli import app
from ortflow.launch import mpijob

DOCS = Path(__file__).parents[2] / "docs"


def first_yaml_example(page: str, tmp_path: Path, launcher: str) -> Path:
    """The page's first YAML example with this launcher, as a config file (its paths as written: render reads none
    of them)."""
    blocks = re.findall(r"```yaml\n(.*?)```", (DOCS / page).read_text(), re.S)
    block = next(b for b in blocks if f"launcher: {launcher}" in b)
    path = tmp_path / f"{page}.yaml"
    path.write_text(block)
    return path


def render(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["render", *map(str, args)])
    return result.exit_code, result.output


def test_render_prints_the_documented_mpijob_and_a_gpu_one_both_strictly_valid(tmp_path):
    config = first_yaml_example("clusters.md", tmp_path, "kubernetes")
    code, text = render(config)
    assert code == 0, text
    documented = yaml.safe_load(text)
    mpijob.validate(documented)  # strict: an unknown field would be refused
    assert documented["kind"] == "MPIJob" and documented["spec"]["slotsPerWorker"] == 8
    mount = documented["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["volumeMounts"][0]
    assert mount["mountPath"] == "/runs"  # the docs' claim holds /runs, the run folder is /runs/gpt-small

    code, text = render(config, "--set", "kubernetes.shm_size=32Gi", "--set", "kubernetes.scheduler_name=volcano",
                        "--set", "kubernetes.scheduling_queue=research",
                        "--set", 'kubernetes.tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists"}]')
    assert code == 0, text
    gpu = yaml.safe_load(text)
    mpijob.validate(gpu)
    worker = gpu["spec"]["mpiReplicaSpecs"]["Worker"]["template"]["spec"]
    assert worker["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 8
    assert worker["schedulerName"] == "volcano" and worker["tolerations"][0]["operator"] == "Exists"
    assert gpu["spec"]["runPolicy"]["schedulingPolicy"]["minAvailable"] == 3


def test_render_prints_the_documented_sbatch_script(tmp_path):
    code, text = render(first_yaml_example("clusters.md", tmp_path, "slurm"))
    assert code == 0, text
    for line in ("#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=8", "#SBATCH --gpus-per-node=8",
                 "#SBATCH --partition=gpu", "#SBATCH --signal=B:USR1@300", "module load cuda/12.4"):
        assert line in text.splitlines(), line
    assert subprocess.run(["bash", "-n"], input=text, text=True).returncode == 0
    assert not (Path("/shared/runs/gpt-small") / "slurm").exists()  # nothing written, nothing submitted


def test_render_refuses_the_local_launcher_and_a_manifest_the_config_cannot_place(tmp_path):
    config = first_yaml_example("clusters.md", tmp_path, "kubernetes")
    code, text = render(config, "--launcher", "local")
    assert code == 1 and "submits nothing to render" in text
    code, text = render(config, "--set", "kubernetes.run_volume_mount_path=/data")
    assert code == 1 and "not under kubernetes.run_volume_mount_path /data" in text and "Traceback" not in text
