"""docs/operations.md's deploy block, run from a fresh clone by tools/deploy_from_clone.sh against the test server:
`prefect deploy` (its build step writes the example), a process worker, and a deployment run that completes, for both
pull steps of prefect.yaml (in turn from one clone, with one work pool and worker)."""

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


PULLS = ("working_directory", "git_clone")


@pytest.fixture(scope="module")
def deployed(prefect_server, tmp_path_factory) -> dict:
    """The script run once for both pull variants, in turn from one clone with one work pool and worker; yields the
    script's exit status, its output per variant, its folder and the git_clone runs' output folder."""
    if not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to clone")
    if not _committed():
        pytest.skip("uncommitted changes in docs/, prefect.yaml, tools/, ortflow/ or the pins: a clone would miss them")
    tmp_path = tmp_path_factory.mktemp("deploy")
    stdlib = sysconfig.get_paths()["stdlib"]
    overrides = ["train.num_train_steps=4", "train.evaluation_period=0", "checkpoint.period=0",
                 "train.max_eval_rows=16",  # the final evaluation: two batches, not the example's 160 rows
                 "lr_schedule.warmup_steps=0",  # warm-up longer than the run is refused
                 "distributed.num_ranks=1", f"data.train={stdlib}/abc.py"]  # the deployment's run, not its layout
    # A git_clone run works in a fresh clone the worker deletes afterwards: its outputs go elsewhere.
    params = {"working_directory": overrides, "git_clone": [*overrides, f"output_dir={tmp_path / 'runs'}"]}
    args = []  # each variant's args for `prefect deployment run`, `--` between them
    for pull in PULLS:
        args += ["--"] if args else []
        args += ["--watch-timeout", "400", "--params", json.dumps({"overrides": params[pull]})]
    env = {**prefect_server, "ORTFLOW_VENV": str(Path(sys.executable).parents[1]), "ORTFLOW_CLONE_DIR": str(tmp_path),
           "PREFECT_WORKER_QUERY_SECONDS": "2", "PREFECT_WORKER_PREFETCH_SECONDS": "2", "ORTFLOW_PULL": " ".join(PULLS)}
    env.pop("VIRTUAL_ENV", None)
    out_file = tmp_path / "deploy.log"
    # A file, not a pipe: nothing the script started can keep the test waiting. The worker the script starts must
    # take SIGINT, or it outlives the script's stop by 20 s.
    with out_file.open("w") as out, sigint_taken():
        done = subprocess.run(["bash", str(ROOT / "tools" / "deploy_from_clone.sh"), *args], env=env, stdout=out,
                              stderr=subprocess.STDOUT, timeout=860, cwd=tmp_path)
    log = out_file.read_text()
    parts = dict(part.split("\n", 1) for part in log.split("== pull: ")[1:])
    return {"returncode": done.returncode, "log": log, "parts": parts, "root": tmp_path, "runs": tmp_path / "runs"}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("pull", PULLS)
def test_deploy_section_of_the_docs_works_from_a_fresh_clone(deployed, pull):
    log = deployed["log"]
    assert deployed["returncode"] == 0, log[-6000:]
    part = deployed["parts"][pull]
    assert "Flow run finished successfully in 'Completed'" in part, part[-6000:]
    tmp_path = deployed["root"]
    clone = tmp_path / "ortflow"
    assert (clone / "examples/gpt/deploy/config.yaml").exists()  # written by prefect.yaml's build step
    registries = sorted(tmp_path.rglob("registry.json"))
    assert registries == sorted([clone / "examples/gpt/deploy/runs/registry.json", deployed["runs"] / "registry.json"])
    if pull == "git_clone":  # the run worked in a clone of its own (the log names it), outputs in output_dir
        runs = deployed["runs"]
        assert "Deployment step 'git_clone' completed successfully" in part
        assert f"{clone}/examples/gpt/deploy" not in part  # nothing ran in the folder deployed from
        assert "prefect worker start" not in part  # the first variant's worker runs it
    else:
        runs = clone / "examples/gpt/deploy/runs"
        assert "Deployment step 'set_working_directory' completed successfully" in part
    versions = read_registry(runs)
    assert [v["status"] for v in versions] == ["completed"], versions
    assert versions[0]["steps"] == "4/4"  # the run's overrides applied
    assert Path(versions[0]["exported model"]).exists()
