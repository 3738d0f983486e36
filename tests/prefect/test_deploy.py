"""docs/operations.md's deploy block, run from a fresh clone by tools/deploy_from_clone.sh against the test server:
`prefect deploy` (its build step writes the example), a process worker, and a deployment run that completes."""

from __future__ import annotations

import json
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from ortflow.versions import read_registry
from tests.support.prefect_runs import sigint_taken

pytestmark = pytest.mark.prefect

ROOT = Path(__file__).resolve().parents[2]


def _committed() -> bool:
    out = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--", "docs", "prefect.yaml", "tools",
                          "ortflow", "pyproject.toml", "requirements.lock", "Makefile"], capture_output=True, text=True)
    return out.returncode == 0 and not out.stdout.strip()


@pytest.mark.timeout(900)
@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs a git checkout to clone")
@pytest.mark.parametrize("pull", ["working_directory", "git_clone"])
def test_deploy_section_of_the_docs_works_from_a_fresh_clone(prefect_server, tmp_path, pull):
    if not _committed():
        pytest.skip("uncommitted changes in docs/, prefect.yaml, tools/, ortflow/ or the pins: a clone would miss them")
    stdlib = sysconfig.get_paths()["stdlib"]
    overrides = ["train.num_train_steps=4", "train.evaluation_period=0", "checkpoint.period=0",
                 "lr_schedule.warmup_steps=0",  # warm-up longer than the run is refused
                 f"data.train={stdlib}/[a-c]*.py"]
    if pull == "git_clone":  # each run works in a fresh clone the worker deletes afterwards: outputs go elsewhere
        overrides.append(f"output_dir={tmp_path / 'runs'}")
    env = {**prefect_server, "ORTFLOW_VENV": str(Path(sys.executable).parents[1]), "ORTFLOW_CLONE_DIR": str(tmp_path),
           "PREFECT_WORKER_QUERY_SECONDS": "2", "PREFECT_WORKER_PREFETCH_SECONDS": "2", "ORTFLOW_PULL": pull}
    env.pop("VIRTUAL_ENV", None)
    out_file = tmp_path / "deploy.log"
    # A file, not a pipe: nothing the script started can keep the test waiting. The worker the script starts must
    # take SIGINT, or it outlives the script's stop by 20 s.
    with out_file.open("w") as out, sigint_taken():
        done = subprocess.run(
            ["bash", str(ROOT / "tools" / "deploy_from_clone.sh"), "--watch-timeout", "400",
             "--params", json.dumps({"overrides": overrides})],
            env=env, stdout=out, stderr=subprocess.STDOUT, timeout=560, cwd=tmp_path,
        )
    log = out_file.read_text()
    assert done.returncode == 0, log[-6000:]
    assert "Completed" in log, log[-6000:]
    clone = tmp_path / "ortflow"
    assert (clone / "examples/gpt/deploy/config.yaml").exists()  # written by prefect.yaml's build step
    registries = list(tmp_path.rglob("registry.json"))
    assert len(registries) == 1, registries
    runs = registries[0].parent
    if pull == "git_clone":  # the run worked in a clone of its own (the log names it), outputs in output_dir
        assert runs == tmp_path / "runs"
        assert "Deployment step 'git_clone' completed successfully" in log
        assert f"{clone}/examples/gpt/deploy" not in log  # nothing ran in the folder deployed from
    else:
        assert runs == clone / "examples/gpt/deploy/runs"
    versions = read_registry(runs)
    assert [v["status"] for v in versions] == ["completed"], versions
    assert versions[0]["steps"] == "4/4"  # the run's overrides applied
    assert Path(versions[0]["exported model"]).exists()
