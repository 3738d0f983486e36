"""Checkpoint manager: atomic writes, verification, resume choice, failure handling (real engine for round trips)."""

from __future__ import annotations

import errno
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ortflow.checkpoints import (
    CHECKPOINT_FILE,
    META_FILE,
    CheckpointError,
    CheckpointManager,
    list_complete,
    resolve_resume,
    step_dirname,
    verify,
)


def fake_writer(state: bytes, folder: Path) -> None:
    """Stands in for the HDF5 writer: the 'state' is the bytes to store in one file."""
    (folder / CHECKPOINT_FILE).write_bytes(state)


def manager(directory: Path, period: int = 1, keep: int = 10, **kw) -> CheckpointManager:
    return CheckpointManager(directory, period, keep, is_writer=True, clock=lambda: 0.0, writer=fake_writer, **kw)


def test_step_dirname_sorts_by_step():
    names = [step_dirname(s) for s in (5, 120, 1200, 99999999)]
    assert names[1] == "step-00000120"
    assert sorted(names) == names


def test_save_writes_meta_last_with_fields_and_checksum(tmp_path):
    mgr = manager(tmp_path, period=1)
    path = mgr.save(3, b"abcdef", {"global_cursor": 24, "eval_loss": 1.5, "config_fingerprint": "fp"})
    assert path == tmp_path / "step-00000003"
    meta = json.loads((path / META_FILE).read_text())
    assert meta["step"] == 3 and meta["global_cursor"] == 24 and meta["config_fingerprint"] == "fp"
    assert meta["format"] == 2 and meta["ortflow_version"] and meta["created"] == "1970-01-01T00:00:00Z"
    assert meta["files"][CHECKPOINT_FILE]["bytes"] == 6
    info = verify(path)
    assert (info.step, info.global_cursor, info.eval_loss, info.train_loss) == (3, 24, 1.5, None)
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000003"]  # no temporary folder left


def test_amend_records_the_final_eval_loss_in_meta_json_alone(tmp_path):
    mgr = manager(tmp_path, period=1)
    path = mgr.save(4, b"state", {"global_cursor": 8, "eval_loss": None, "train_loss": 2.0})
    state_file = path / CHECKPOINT_FILE
    before = state_file.stat()
    assert mgr.amend(4, {"eval_loss": 1.25}) == path
    after = state_file.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)  # the state is not written again
    info = verify(path)  # meta.json's own checksum and the files' checksums hold
    assert (info.step, info.global_cursor, info.eval_loss, info.train_loss) == (4, 8, 1.25, 2.0)
    assert sorted(p.name for p in path.iterdir()) == sorted([CHECKPOINT_FILE, META_FILE])  # no temporary file left
    reader = CheckpointManager(tmp_path, 1, 10, is_writer=False, clock=lambda: 0.0, writer=fake_writer)
    assert reader.amend(4, {"eval_loss": 9.0}) is None  # only the writer rank touches the folder
    assert verify(path).eval_loss == 1.25
    with pytest.raises(CheckpointError, match="step-00000005.*intact"):
        mgr.amend(5, {"eval_loss": 1.0})


def test_should_save_every_period_and_final_never_twice(tmp_path):
    mgr = manager(tmp_path, period=3)
    saved = [s for s in range(1, 11) if mgr.maybe_save(s, b"x", {}, final=(s == 10))]
    assert saved == [3, 6, 9, 10]
    assert mgr.maybe_save(10, b"x", {}, final=True) is None  # the same step is never saved twice
    only_final = manager(tmp_path / "p0", period=0)
    assert [s for s in range(1, 6) if only_final.maybe_save(s, b"x", {}, final=(s == 5))] == [5]


def test_non_writer_rank_writes_nothing(tmp_path):
    mgr = CheckpointManager(tmp_path / "ck", 1, 3, is_writer=False, writer=fake_writer)
    assert mgr.maybe_save(1, b"x", {}) is None
    assert not (tmp_path / "ck").exists()


def test_half_written_checkpoints_are_never_loaded(tmp_path):
    mgr = manager(tmp_path)
    mgr.save(4, b"good", {})
    # A writer that died: a temporary folder (even with a meta) and a step folder without meta.json.
    tmp = tmp_path / f".tmp-step-00000010-{os.getpid()}"
    tmp.mkdir()
    (tmp / CHECKPOINT_FILE).write_bytes(b"newer")
    meta = (tmp_path / "step-00000004" / META_FILE).read_text()
    (tmp / META_FILE).write_text(meta.replace('"step": 4', '"step": 10'))
    (tmp_path / "step-00000009").mkdir()
    (tmp_path / "step-00000009" / CHECKPOINT_FILE).write_bytes(b"half")
    assert [c.step for c in list_complete(tmp_path)] == [4]
    assert mgr.latest().step == 4
    assert resolve_resume(tmp_path, None).step == 4


def test_truncated_newest_falls_back_to_previous_with_warning(tmp_path, caplog):
    mgr = manager(tmp_path)
    mgr.save(1, b"first-state", {})
    newest = mgr.save(2, b"second-state", {})
    with open(newest / CHECKPOINT_FILE, "r+b") as f:
        f.truncate(4)
    with pytest.raises(CheckpointError, match=r"truncated: 4 of 12 bytes"):
        verify(newest)
    with caplog.at_level(logging.WARNING, logger="ortflow.checkpoints"):
        assert mgr.latest().step == 1
    assert "step-00000002" in caplog.text and "truncated" in caplog.text


def test_checksum_mismatch_is_named(tmp_path):
    path = manager(tmp_path).save(1, b"abcdef", {})
    (path / CHECKPOINT_FILE).write_bytes(b"abcdeX")  # same size, other bytes
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        verify(path)


def test_explicit_corrupted_checkpoint_raises_instead_of_falling_back(tmp_path):
    mgr = manager(tmp_path)
    first = mgr.save(1, b"one", {})
    second = mgr.save(2, b"two", {})
    (second / CHECKPOINT_FILE).write_bytes(b"tw")
    with pytest.raises(CheckpointError, match="step-00000002"):
        resolve_resume(tmp_path, second)
    assert resolve_resume(tmp_path, first).step == 1
    assert resolve_resume(tmp_path, None).step == 1
    assert resolve_resume(tmp_path / "empty", None) is None
    (first / META_FILE).unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        resolve_resume(tmp_path, first)


def test_a_checkpoint_of_another_split_is_refused_naming_both_sizes_and_a_way_out_that_works_there(tmp_path):
    # A CheckpointError: the rank stops with its one line (no traceback) and the train task does not retry it.
    from ortflow.checkpoints.layout_check import check_checkpoint_layout

    with pytest.raises(CheckpointError, match="pipeline_parallel_size 1 but this run has 2: resume with 1") as err:
        check_checkpoint_layout({"pipeline_parallel_size": 1}, tmp_path, 2, 1, named=False)
    # The way out: its weights with checkpoint.init_from, in a run whose checkpoint folder is empty (a folder holding
    # checkpoints resumes its newest and never reads init_from, so the same folder would refuse again).
    assert f"checkpoint.init_from: {tmp_path}" in str(err.value), err.value
    assert "another output_dir" in str(err.value) and "ignores checkpoint.init_from" in str(err.value), err.value
    with pytest.raises(CheckpointError, match="horizontal_parallel_size 1 but this run has 2: resume with 1") as err:
        check_checkpoint_layout({}, tmp_path, 1, 2, named=True)
    # Named with checkpoint_to_load_path: the same config with init_from in its place.
    assert f"checkpoint.init_from: {tmp_path} in place of checkpoint.checkpoint_to_load_path" in str(err.value)
    with pytest.raises(CheckpointError, match="horizontal_parallel_size 4 but this run has 2"):
        check_checkpoint_layout({"horizontal_parallel_size": 4}, tmp_path, 1, 2, named=False)
    check_checkpoint_layout({"pipeline_parallel_size": 2}, tmp_path, 2, 1, named=False)
    check_checkpoint_layout({"pipeline_parallel_size": 2, "horizontal_parallel_size": 2}, tmp_path, 2, 2, named=False)
    # An unsplit run resumes a tensor-parallel checkpoint with its slices merged.
    check_checkpoint_layout({"horizontal_parallel_size": 2}, tmp_path, 1, 1, named=False)


def test_a_disk_full_message_from_h5py_is_read_from_its_text():
    from ortflow.checkpoints.manager import write_failure

    h5py_style = RuntimeError("Can't decrement id ref count (file write failed: time = ..., filename = 'x.h5', "
                              "file descriptor = 36, errno = 28, error message = 'No space left on device', ...)")
    assert write_failure(h5py_style) == "the disk is full"
    assert write_failure(OSError(errno.EROFS, "Read-only file system")) == "it is read-only"
    assert write_failure(RuntimeError("something else\nmore")) == "something else"


def test_failed_save_keeps_previous_checkpoints_and_leaves_no_tmp(tmp_path):
    mgr = manager(tmp_path, keep=1)
    mgr.save(1, b"one", {})

    def disk_full(state, folder):
        (folder / "params.h5").write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    failing = CheckpointManager(tmp_path, 1, 1, is_writer=True, writer=disk_full)
    with pytest.raises(CheckpointError, match="the disk is full.*intact"):
        failing.maybe_save(2, b"two", {})
    assert [p.name for p in tmp_path.iterdir()] == ["step-00000001"]
    assert verify(tmp_path / "step-00000001").step == 1
    assert failing.should_save(2)  # a failed step may be saved again


def test_resaving_a_step_replaces_the_complete_folder(tmp_path):
    manager(tmp_path).save(5, b"old", {})
    manager(tmp_path).save(5, b"new-state", {})
    assert (tmp_path / "step-00000005" / CHECKPOINT_FILE).read_bytes() == b"new-state"
    assert verify(tmp_path / "step-00000005").step == 5
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000005"]


def test_stale_tmp_folders_of_dead_writers_are_removed_at_start(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    (tmp_path / f".tmp-step-00000007-{dead_pid}").mkdir()
    live = tmp_path / f".tmp-step-00000008-{os.getppid()}"  # the parent process is alive: maybe another writer
    live.mkdir()
    manager(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name]


def test_a_checkpoint_set_aside_by_a_dead_replacing_writer_is_restored(tmp_path):
    manager(tmp_path).save(5, b"old", {})
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    aside = tmp_path / f".tmp-replaced-step-00000005-{int(dead.stdout)}"
    os.rename(tmp_path / "step-00000005", aside)  # the writer died between moving the old one aside and the new in
    (tmp_path / f".tmp-step-00000005-{int(dead.stdout)}").mkdir()
    manager(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000005"]
    assert verify(tmp_path / "step-00000005").step == 5


def test_any_edit_of_meta_json_is_detected(tmp_path):
    path = manager(tmp_path).save(3, b"abcdef", {"global_cursor": 4800})
    text = (path / META_FILE).read_text()
    (path / META_FILE).write_text(text.replace('"global_cursor": 4800', '"global_cursor": 4801'))
    with pytest.raises(CheckpointError, match="modified after it was written"):
        verify(path)
    raw = bytearray(text.encode())
    raw[text.index('"created"') + 14] ^= 0x01  # one flipped bit inside a string value: still valid JSON
    (path / META_FILE).write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="modified after it was written|cannot be read"):
        verify(path)


def test_leftover_step_folders_without_meta_are_removed_at_start(tmp_path):
    mgr = manager(tmp_path)
    mgr.save(2, b"good", {})
    leftover = tmp_path / "step-00000001"  # a kill during retention: meta.json gone, files left
    leftover.mkdir()
    (leftover / CHECKPOINT_FILE).write_bytes(b"old")
    manager(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-00000002"]


def test_zombie_writer_counts_as_dead(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    import time

    for _ in range(100):  # exited but not reaped: a zombie
        if Path(f"/proc/{child.pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
            break
        time.sleep(0.05)
    stale = tmp_path / f".tmp-step-00000007-{child.pid}"
    stale.mkdir()
    manager(tmp_path)
    child.wait()
    assert not stale.exists()
