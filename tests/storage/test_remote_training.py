"""Training on 2 real MPI ranks whose run folder is on a real S3 server (SeaweedFS), each rank with its own local copy
(no shared filesystem): killed and resumed from the store bitwise (plain and ZeRO-1, both to the bits of one
uninterrupted local run without ZeRO), retention applied on the store, and a server restart in the middle of the
resumed run survived (or stopped with a clear error and resumed)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import h5py
import numpy as np
import pytest

from ortflow.checkpoints.object_store import RemoteCheckpoints
from ortflow.checkpoints.run_store import RunStore
from ortflow.config import config_from_dict
from ortflow.configure.configure import configure
from ortflow.dataprep import prepare_data
from ortflow.storage import RemoteDir
from tests.support.runs import MPIEXEC, final_parameters, kill_job, make_run, run_ranks

STEPS, PERIOD, KEEP = 100, 10, 2
SECTIONS = {"train": {"num_train_steps": STEPS, "display_loss_steps": 10},
            "checkpoint": {"period": PERIOD, "max_num_checkpoints": KEEP},
            "distributed": {"num_ranks": 2, "threads_per_rank": 1}}


def local_reference(root: Path, sections: dict) -> dict:
    """The same run in a local folder, uninterrupted: its final trainable parameters."""
    cfg = make_run(root, "local", **sections)
    done = run_ranks(cfg, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:]
    return {"params": final_parameters(cfg), "model": cfg.model.path, "data": cfg.data.train[0],
            "distributed": sections["distributed"]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return local_reference(tmp_path_factory.mktemp("reference"), SECTIONS)


@pytest.fixture(scope="module")
def zero_reference(reference):
    """ZeRO-1 (every rank writes its own optimizer shard into each checkpoint): the uninterrupted local run without it,
    since ZeRO-1 and ZeRO-0 train to the same bits (docs/gpu.md)."""
    return {**reference, "distributed": {**SECTIONS["distributed"], "zero_stage": 1}}


def remote_run(url: str, reference: dict, cache: Path, monkeypatch) -> None:
    """Configure and shard the run in a local copy, then upload it to ``url`` (what `ortflow run` does first)."""
    monkeypatch.setenv("ORTFLOW_CACHE_DIR", str(cache))
    local = config_from_dict({
        "name": "remote", "output_dir": url, "model": {"path": str(reference["model"])},
        "data": {"train": [reference["data"]], "eval_fraction": 0.125, "rows_per_shard": 100},
        "train": {"batch_size": 4, "evaluation_period": 0, **SECTIONS["train"]}, "optimizer": {"learning_rate": 0.01},
        "checkpoint": SECTIONS["checkpoint"], "distributed": reference["distributed"]})
    assert local.storage.remote_dir == url and local.output_dir.is_relative_to(cache)
    configure(local)
    prepare_data(local)
    RunStore(local).push()
    shutil.rmtree(cache)  # the ranks below share nothing with this process but the store


def start_ranks(url: str, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ORTFLOW_CACHE_DIR": str(cache)}
    return subprocess.Popen([MPIEXEC, "-n", "2", "-prepend-rank", sys.executable, "-u", "-m", "ortflow.trainer", url],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            stdin=subprocess.DEVNULL, start_new_session=True)


def wait_for_stored_checkpoint(store: RemoteCheckpoints, proc: subprocess.Popen, timeout_s: float = 180) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        steps = store.steps()
        if steps:
            return steps
        if proc.poll() is not None:
            pytest.fail(f"the job ended before a checkpoint reached the store:\n{proc.stdout.read()[-3000:]}")
        time.sleep(0.05)  # polling the store for the first checkpoint
    pytest.fail("no checkpoint reached the store")


def stored_parameters(url: str, folder: Path) -> tuple[list[int], dict[str, np.ndarray]]:
    """Steps on the store, and the trainable parameters of its newest checkpoint, downloaded into ``folder``."""
    store = RemoteCheckpoints(RemoteDir(url).child("checkpoints"), folder)
    steps = store.steps()
    info = store.download(steps[-1])
    with h5py.File(info.path / "params.h5", "r") as f:
        params = {ds.attrs["name"]: ds[()] for ds in f["parameters"].values() if ds.attrs["requires_grad"]}
    return steps, params


def assert_bitwise(params: dict, expected: dict) -> None:
    assert params.keys() == expected.keys()
    for name, value in expected.items():
        assert np.array_equal(params[name], value), name


def killed_and_resumed(url: str, reference: dict, tmp_path: Path, monkeypatch, meanwhile=None) -> str:
    """Kill the ranks (machine A) between two checkpoints on the store; resume on machine B from the store alone,
    calling ``meanwhile(job, store, resumed_from, lines)`` while B trains (``lines``: B's output so far). Returns B's
    output (and a rerun's, if any)."""
    remote_run(url, reference, tmp_path / "launcher", monkeypatch)
    store = RemoteCheckpoints(RemoteDir(url).child("checkpoints"), tmp_path / "probe")
    first = start_ranks(url, tmp_path / "machine-a")
    wait_for_stored_checkpoint(store, first)
    kill_job(first)  # the ranks too: none uploads a checkpoint after the store's are counted
    before = store.steps()
    assert before and max(before) < STEPS, before  # killed between checkpoints, before the end
    shutil.rmtree(tmp_path / "machine-a")  # the machines are gone: only the store remains

    second = start_ranks(url, tmp_path / "machine-b")
    lines: list[str] = []  # B's output as it comes (``meanwhile`` reads it while B trains)
    reader = threading.Thread(target=lambda: lines.extend(second.stdout), daemon=True)
    reader.start()
    rerun = meanwhile(second, store, max(before), lines) if meanwhile else None
    second.wait(timeout=600)
    reader.join(timeout=60)
    out = "".join(lines)
    assert f"starting from step {max(before)}" in out, out[-3000:]
    if rerun:
        out += rerun(second.returncode, out)
    else:
        assert second.returncode == 0, out[-3000:]
    steps, params = stored_parameters(url, tmp_path / "check")
    assert steps == [STEPS - PERIOD, STEPS]  # max_num_checkpoints applied on the store
    assert_bitwise(params, reference["params"])
    assert [k for k in RemoteDir(url).files("checkpoints") if k.startswith(".tmp-")] == []
    return out


def test_ranks_without_a_shared_folder_killed_mid_run_resume_from_the_store_bitwise_through_a_server_restart(
        s3_server, bucket, reference, tmp_path, monkeypatch):
    url = f"s3://{bucket}/run"

    def restart_server(job: subprocess.Popen, store: RemoteCheckpoints, resumed_from: int, lines: list[str]):
        deadline = time.monotonic() + 180
        while max(store.steps(), default=0) <= resumed_from and job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # polling the store for the resumed job's first checkpoint
        s3_server.stop()
        assert job.poll() is None  # the server went away while the ranks were training
        # It stays away until the ranks have found it gone (past the client library's own quick retries of a refused
        # connection) and retry the operation, or have given up; then it comes back.
        deadline = time.monotonic() + 180
        while not any("retrying in" in line for line in list(lines)) and job.poll() is None:
            assert time.monotonic() < deadline, "the ranks neither retried a store operation nor ended"
            time.sleep(0.05)  # polling the job's output for its first retry
        s3_server.start()

        def rerun_if_stopped(returncode: int, out: str) -> str:
            if returncode != 0:  # the retries ran out: the error names the store and says how to go on
                assert url in out and "resume" in out, out[-3000:]
                again = start_ranks(url, tmp_path / "machine-b")
                more = again.communicate(timeout=600)[0]
                assert again.returncode == 0, more[-3000:]
                print("the job stopped with the store's error and the rerun resumed")  # noqa: T201 - shown with -s
                return more
            assert "retrying in" in out, out[-3000:]  # it saw the outage and outlasted it
            print(f"the job outlasted the outage: {out.count('retrying in')} retried store operation(s)")  # noqa: T201
            return ""

        return rerun_if_stopped

    killed_and_resumed(url, reference, tmp_path, monkeypatch, restart_server)


def test_ranks_without_a_shared_folder_killed_mid_run_resume_from_the_store_bitwise_with_zero1(
        s3_server, bucket, zero_reference, tmp_path, monkeypatch):
    url = f"s3://{bucket}/run"
    killed_and_resumed(url, zero_reference, tmp_path, monkeypatch)
    files = RemoteDir(url).files("checkpoints")  # each rank's optimizer shard reached the store from its own machine
    assert {f"step-{STEPS:08d}/optimizer-rank0000{r}-of-00002.h5" for r in (0, 1)} <= set(files), sorted(files)
