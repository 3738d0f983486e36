"""A checkpoint folder belongs to one run: the lock covers checkpoint.dir, and a resume refuses another run's
checkpoint, naming both runs."""

from __future__ import annotations

import signal
import time
from pathlib import Path

import pytest

from ortflow.checkpoints import (
    CheckpointError,
    CheckpointManager,
    final_checkpoint,
    list_complete,
    resolve_resume,
    run_owner,
)
from ortflow.config import config_from_dict
from ortflow.runlock import holder
from tests.faults import procs
from tests.support.runs import make_run, run_ranks


def _cfg(tmp_path: Path, name: str):
    model = tmp_path / "m.onnx"
    model.touch()
    return config_from_dict({"name": name, "output_dir": str(tmp_path / name), "model": {"path": str(model)},
                             "data": {"train": [str(model)]}, "train": {"batch_size": 1, "num_train_steps": 4}})


def _write(folder: Path, owner: dict, step: int) -> None:
    def writer(state: bytes, tmp: Path) -> None:
        (tmp / "params.h5").write_bytes(state)

    CheckpointManager(folder, 1, 5, is_writer=True, writer=writer, owner=owner).save(step, b"x", {})


def test_a_resume_refuses_the_newest_checkpoint_of_another_run_naming_both(tmp_path):
    shared = tmp_path / "shared"
    first, second = run_owner(_cfg(tmp_path, "first")), run_owner(_cfg(tmp_path, "second"))
    _write(shared, first, 150)
    with pytest.raises(CheckpointError) as err:
        resolve_resume(shared, None, second)
    message = str(err.value)
    assert "run 'first'" in message and "run 'second'" in message and "checkpoint.dir" in message
    assert str(tmp_path / "first") in message and str(tmp_path / "second") in message
    assert resolve_resume(shared, None, first).step == 150  # its own run resumes


def test_a_final_checkpoint_another_run_wrote_does_not_make_this_run_complete(tmp_path):
    """`ortflow train` says a run is complete, and starts nothing, only from a final checkpoint of that run: another
    run's (a shared checkpoint.dir) or a copied folder's (no id of its own yet) goes to the ranks, which refuse it
    naming both runs."""
    shared = tmp_path / "shared"
    first, second = run_owner(_cfg(tmp_path, "first")), run_owner(_cfg(tmp_path, "second"))
    _write(shared, first, 4)
    assert final_checkpoint(shared, 4, first).step == 4
    assert final_checkpoint(shared, 4) is not None  # no owner to compare: the checkpoint alone
    assert final_checkpoint(shared, 4, second) is None
    assert final_checkpoint(shared, 4, {**first, "run_id": None}) is None


def test_a_run_folder_keeps_its_identity_when_moved(tmp_path):
    owner = run_owner(_cfg(tmp_path, "run"))
    (tmp_path / "run").rename(tmp_path / "moved")
    raw = _cfg(tmp_path, "run").model_dump(mode="json")
    raw["output_dir"] = str(tmp_path / "moved")
    assert run_owner(config_from_dict(raw), create=False)["run_id"] == owner["run_id"]


def test_every_checkpoint_records_its_run_and_config_fingerprint(tmp_path):
    cfg = _cfg(tmp_path, "run")
    _write(tmp_path / "ck", run_owner(cfg), 3)
    meta = list_complete(tmp_path / "ck")[0].meta
    assert meta["run"]["name"] == "run" and meta["run"]["config_fingerprint"] == cfg.section_fingerprint()


@pytest.mark.mpi
def test_a_second_run_sharing_a_checkpoint_dir_is_refused_and_the_first_keeps_its_checkpoints(tmp_path):
    shared = {"dir": str(tmp_path / "shared-checkpoints")}
    first = make_run(tmp_path, "first", distributed={"num_ranks": 1}, train={"num_train_steps": 10}, checkpoint=shared)
    second = make_run(tmp_path, "second", distributed={"num_ranks": 1}, train={"num_train_steps": 20},
                      checkpoint=shared)
    assert run_ranks(first, timeout=300).returncode == 0
    kept = [c.path.name for c in list_complete(first.checkpoints_dir)]
    out = procs.ortflow_here("train", str(second.output_dir))  # what the refusal says, in this process
    assert out.returncode != 0 and "Traceback" not in out.stdout, out.stdout
    assert "run 'first'" in out.stdout and "run 'second'" in out.stdout, out.stdout
    assert [c.path.name for c in list_complete(first.checkpoints_dir)] == kept  # nothing of the first run touched


@pytest.mark.mpi
def test_two_runs_training_into_one_checkpoint_dir_at_once_are_refused_by_its_lock(tmp_path):
    shared = {"dir": str(tmp_path / "shared-checkpoints")}
    first = make_run(tmp_path, "first", distributed={"num_ranks": 1}, train={"num_train_steps": 100000},
                     checkpoint=shared)
    second = make_run(tmp_path, "second", distributed={"num_ranks": 1}, checkpoint=shared)
    job = procs.start_train(first.output_dir)
    try:
        deadline = time.monotonic() + 120
        while holder(first.checkpoints_dir) is None:
            assert job.poll() is None and time.monotonic() < deadline, "the first run never held checkpoint.dir"
            time.sleep(0.05)
        out = procs.ortflow_here("train", str(second.output_dir))
        assert out.returncode != 0 and "Traceback" not in out.stdout, out.stdout
        assert str(first.checkpoints_dir) in out.stdout and "in use by" in out.stdout, out.stdout
        assert f"to queue behind it instead: ortflow train {second.output_dir} --wait" in out.stdout, out.stdout
    finally:
        job.send_signal(signal.SIGTERM)
        job.communicate(timeout=120)
