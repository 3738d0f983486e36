"""A run's identity survives a move and not a copy: a moved run folder resumes where it stopped (the paths inside it
are stored relative to it, and no lock appears at the old place); a copied folder is a new run that refuses the
original's checkpoints once (a retry would be refused again) and never deletes them; a damaged run record does not
make a run refuse its own checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ortflow.checkpoints import list_complete
from ortflow.config import RESOLVED_CONFIG_NAME, load_yaml
from ortflow.launch.job import is_error_line
from ortflow.tasks.training import failure_repeats
from tests.faults import procs
from tests.support.runs import make_run

pytestmark = [pytest.mark.mpi, pytest.mark.faults]


_ortflow = procs.ortflow_here  # the commands run in this process: their ranks are real, their start-up is not repeated


def _trained(tmp_path: Path, name: str, checkpoint: dict | None = None):
    cfg = make_run(tmp_path, name, distributed={"num_ranks": 1}, train={"num_train_steps": 4},
                   checkpoint={"period": 2, "max_num_checkpoints": 5, **(checkpoint or {})})
    out = _ortflow("train", str(cfg.output_dir))
    assert out.returncode == 0, out.stdout[-3000:]
    return cfg


def _set(run_dir: Path, section: str, field: str, value) -> None:
    """Edit the run folder's config.yaml as a user would (then trained with --accept-changed-config)."""
    path = run_dir / RESOLVED_CONFIG_NAME
    raw = load_yaml(path.read_text())
    raw[section][field] = value
    path.write_text(json.dumps(raw))


def _steps(folder: Path) -> dict[int, str]:
    return {c.step: c.meta["run"]["run_id"] for c in list_complete(folder)}


def test_a_copied_run_folder_is_a_new_run_refused_without_retries_that_leaves_the_originals_checkpoints_alone(
        tmp_path):
    shared = tmp_path / "shared-checkpoints"
    first = _trained(tmp_path, "exp1", checkpoint={"dir": str(shared)})
    kept = {c.path.name: (c.path / "params.h5").read_bytes() for c in list_complete(shared)}
    copy = tmp_path / "exp2"
    shutil.copytree(first.output_dir, copy)
    _set(copy, "optimizer", "learning_rate", 0.05)
    _set(copy, "train", "num_train_steps", 8)
    out = _ortflow("train", str(copy), "--accept-changed-config")
    assert out.returncode != 0 and "Traceback" not in out.stdout, out.stdout[-3000:]
    assert str(first.output_dir) in out.stdout and str(copy) in out.stdout, out.stdout[-3000:]
    # The train task reads the ranks' error lines as this: a refusal that a retry would meet again is not retried.
    errors = tuple(line for line in out.stdout.splitlines() if is_error_line(line))
    assert failure_repeats(errors, out.returncode), errors
    assert {c.path.name: (c.path / "params.h5").read_bytes() for c in list_complete(shared)} == kept
    # The original still resumes its own checkpoints (trained further: a finished run starts no ranks).
    own = set(_steps(shared).values())
    _set(first.output_dir, "train", "num_train_steps", 6)
    again = _ortflow("train", str(first.output_dir), "--accept-changed-config")
    assert again.returncode == 0, again.stdout[-3000:]
    assert max(_steps(shared)) == 6 and set(_steps(shared).values()) == own, _steps(shared)


def test_a_damaged_run_record_does_not_disown_the_runs_checkpoints_and_a_moved_run_folder_resumes_in_its_new_place(
        tmp_path):
    cfg = _trained(tmp_path, "run")
    before = _steps(cfg.checkpoints_dir)
    record = cfg.output_dir / ".ortflow" / "run.json"
    record.write_text(record.read_text()[:10])
    _set(cfg.output_dir, "train", "num_train_steps", 6)
    out = _ortflow("train", str(cfg.output_dir), "--accept-changed-config")
    assert out.returncode == 0, out.stdout[-3000:]
    repaired = _steps(cfg.checkpoints_dir)
    assert max(repaired) == 6 and set(repaired.values()) == set(before.values()), (before, repaired)  # one run

    moved = tmp_path / "elsewhere" / "moved"
    moved.parent.mkdir()
    shutil.move(cfg.output_dir, moved)
    _set(moved, "train", "num_train_steps", 8)
    out = _ortflow("train", str(moved), "--accept-changed-config")
    assert out.returncode == 0, out.stdout[-3000:]
    after = _steps(moved / "checkpoints")
    assert max(after) == 8 and set(after.values()) == set(before.values()), (before, after)  # the same run went on
    assert not cfg.output_dir.exists(), "something was written at the old place (a lock folder?)"
