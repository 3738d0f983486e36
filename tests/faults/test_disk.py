"""A full or read-only disk is reported as such by every command that writes, with no traceback and no temp files."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from ortflow.checkpoints import list_complete
from tests.faults import procs
from tests.faults import trials_files as files
from tests.support.runs import make_run, run_ranks

pytestmark = [pytest.mark.mpi, pytest.mark.faults]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A finished 1-rank run and its config file (on the ordinary disk)."""
    root = tmp_path_factory.mktemp("disk")
    cfg = make_run(root, "run", distributed={"num_ranks": 1}, train={"num_train_steps": 10})
    out = run_ranks(cfg, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:]
    return cfg


@pytest.fixture
def mount(tmp_path):
    """A small tmpfs (root only): the test fills it or makes it read-only."""
    where = tmp_path / "mnt"
    if not files.tmpfs(where, "4m"):
        pytest.skip("needs root to mount a tmpfs")
    yield where
    files.untmpfs(where)


def _copy_run(cfg, mount: Path) -> Path:
    """The run folder copied onto the mount, with a config file whose paths point there."""
    run = mount / "run"
    shutil.copytree(cfg.output_dir, run)
    raw = cfg.model_dump(mode="json")
    raw["output_dir"] = str(run)
    config = mount.parent / "config.yaml"
    config.write_text(yaml.safe_dump(raw))
    return config


def _fill(mount: Path, leave: int = 0) -> None:
    with open(mount / "filler", "wb", buffering=0) as f:  # unbuffered: no failing flush when it closes
        for chunk in (65536, 4096, 512):
            try:
                while True:
                    f.write(b"\0" * chunk)
            except OSError:
                pass
    if leave:
        os.truncate(mount / "filler", max(0, os.path.getsize(mount / "filler") - leave))


def _ortflow(*args: str) -> subprocess.CompletedProcess:
    """``ortflow run`` in a process of its own (its Prefect server and flow); the other commands run in this process
    (procs.ortflow_here): what they say and their status are checked, with no interpreter start for each."""
    return subprocess.run([procs.ORTFLOW, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300, stdin=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _temp_files(folder: Path) -> list[str]:
    return [str(p) for p in folder.rglob("*") if ".tmp" in p.name or ".building-" in p.name or p.name == ".staging"]


def _reported(out: subprocess.CompletedProcess, what: str, where: Path) -> None:
    assert out.returncode != 0, out.stdout
    assert "Traceback" not in out.stdout and "Errno" not in out.stdout, out.stdout
    assert what in out.stdout and str(where) in out.stdout, out.stdout


@pytest.mark.parametrize("command", ["prepare-data", "retain", "configure", "export", "checkpoint merge"])
def test_a_full_disk_is_named_with_the_folder_and_leaves_no_temp_files(trained, mount, command):
    config = _copy_run(trained, mount)
    run = mount / "run"
    args = {
        "prepare-data": ["prepare-data", str(config), "--set", "data.rows_per_shard=50"],
        "retain": ["retain", str(config), "--set", "checkpoint.max_num_checkpoints=5"],
        "configure": ["configure", str(config), "--set", f"output_dir={mount / 'fresh'}"],
        "export": ["export", str(run), "-o", str(mount / "out" / "model.onnx")],
        "checkpoint merge": ["checkpoint", "merge", str(list_complete(run / "checkpoints")[-1].path), "-o",
                             str(mount / "out" / "merged.h5")],
    }[command]
    _fill(mount)
    out = procs.ortflow_here(*args)
    _reported(out, "the disk is full", mount)
    assert not _temp_files(mount), _temp_files(mount)
    assert list_complete(run / "checkpoints"), "the run's checkpoints must survive"


@pytest.mark.parametrize("command", ["train", "configure", "export", "run"])
def test_a_read_only_run_folder_is_named_as_such(trained, mount, command):
    config = _copy_run(trained, mount)
    run = mount / "run"
    if command == "train":  # a run with training left (a finished one starts no ranks and writes nothing)
        shutil.rmtree(list_complete(run / "checkpoints")[-1].path)
    subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
    args = {
        "train": ["train", str(run)],
        "configure": ["configure", str(config), "--set", "optimizer.learning_rate=0.5"],
        "export": ["export", str(run), "-o", str(mount / "model.onnx")],
        "run": ["run", str(config), "--from", "configure"],
    }[command]
    out = _ortflow(*args) if command == "run" else procs.ortflow_here(*args)
    _reported(out, "read-only", mount)


FINALIZER = """
import errno, logging, sys
sys.path.insert(0, {root!r})
from ortflow.trainer.__main__ import _one_line_os_errors
logging.basicConfig(level=logging.INFO)
sys.unraisablehook = _one_line_os_errors

class File:
    def __del__(self):
        raise OSError(errno.ENOSPC, "No space left on device")

f = File()
del f
"""


def test_an_os_error_in_a_finalizer_is_one_line_not_a_traceback():
    import sys

    out = subprocess.run([sys.executable, "-c", FINALIZER.format(root=os.getcwd())], capture_output=True, text=True,
                         timeout=60)
    assert "No space left on device" in out.stderr and "Traceback" not in out.stderr, out.stderr
    assert "Exception ignored" not in out.stderr, out.stderr


@pytest.fixture
def big_mount(tmp_path):
    """A tmpfs that holds a whole small run (root only)."""
    where = tmp_path / "big"
    if not files.tmpfs(where, "64m"):
        pytest.skip("needs root to mount a tmpfs")
    yield where
    files.untmpfs(where)


def test_a_disk_that_fills_before_a_checkpoint_write_is_named_and_leaves_no_temp_files(big_mount):
    from ortflow.checkpoints import run_owner
    from ortflow.examples.mlp import build_mlp

    mount = big_mount
    build_mlp(mount / "wide.onnx", num_features=8, hidden=4096, num_classes=3, seed=0)  # ~0.4 MB per checkpoint
    cfg = make_run(mount, "run", model=mount / "wide.onnx", num_rows=256, distributed={"num_ranks": 2},
                   train={"num_train_steps": 6}, checkpoint={"period": 2})
    run_owner(cfg)  # the run has its id: the first write that fails is the checkpoint's (h5py)
    _fill(mount, leave=96 * 1024)  # room for the lock and progress files, not for a checkpoint
    out = procs.ortflow_here("train", str(cfg.output_dir))
    _reported(out, "the disk is full", mount)
    assert not _temp_files(mount), _temp_files(mount)
    assert not list_complete(cfg.checkpoints_dir)
    assert "step 1/6" in out.stdout, out.stdout[-3000:]  # it trained, then failed writing the checkpoint


def test_the_run_record_on_a_full_disk_is_named_not_a_traceback(big_mount):
    from ortflow.checkpoints import CheckpointError, run_owner

    cfg = make_run(big_mount, "run", distributed={"num_ranks": 1})
    _fill(big_mount)
    with pytest.raises(CheckpointError, match="the disk is full") as err:
        run_owner(cfg)  # what rank 0 does first when a run trains for the first time
    assert str(cfg.output_dir / ".ortflow" / "run.json") in str(err.value)
    assert not _temp_files(big_mount), _temp_files(big_mount)
