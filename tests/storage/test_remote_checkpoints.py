"""The checkpoint protocol on a real S3 server: complete-or-absent uploads, downloads verified, retention, cleanup."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ortflow.checkpoints import CheckpointError, CheckpointManager, list_complete, verify
from ortflow.checkpoints.object_store import RemoteCheckpoints
from ortflow.storage import RemoteDir, StorageError


def write_state(state, folder: Path) -> None:
    np.save(folder / "weights.npy", np.asarray(state, dtype=np.float32))


def remote_dir(bucket: str, prefix: str = "run/checkpoints", **kw) -> RemoteDir:
    return RemoteDir(f"s3://{bucket}/{prefix}", **kw)


def manager(tmp_path: Path, mirror: RemoteCheckpoints, keep: int = 2) -> CheckpointManager:
    return CheckpointManager(tmp_path / "ckpt", period=1, max_num_checkpoints=keep, is_writer=True,
                             writer=write_state, clock=lambda: 0.0, mirror=mirror)


def test_every_saved_checkpoint_lands_complete_on_the_store_and_retention_applies_there(tmp_path, bucket):
    mirror = RemoteCheckpoints(remote_dir(bucket), tmp_path / "ckpt")
    mgr = manager(tmp_path, mirror)
    for step in (1, 2, 3):
        mgr.save(step, [step] * 4, {"global_cursor": step})
    assert mirror.steps() == [2, 3]
    files = mirror.remote.files()
    assert sorted(files) == ["step-00000002/meta.json", "step-00000002/weights.npy",
                             "step-00000003/meta.json", "step-00000003/weights.npy"]  # no temporary prefix left


def test_a_checkpoint_downloaded_to_an_empty_folder_verifies_and_holds_the_same_bytes(tmp_path, bucket):
    mirror = RemoteCheckpoints(remote_dir(bucket), tmp_path / "ckpt")
    manager(tmp_path, mirror).save(7, [1.5, 2.5], {})
    elsewhere = RemoteCheckpoints(remote_dir(bucket), tmp_path / "other" / "ckpt")
    assert elsewhere.pull(newest_only=True) == [7]
    info = verify(tmp_path / "other" / "ckpt" / "step-00000007")
    assert info.step == 7
    original = tmp_path / "ckpt" / "step-00000007" / "weights.npy"
    assert (info.path / "weights.npy").read_bytes() == original.read_bytes()


def test_a_prefix_without_meta_json_is_not_a_checkpoint_and_the_next_writer_deletes_it(tmp_path, bucket):
    remote = remote_dir(bucket)
    remote.write_bytes("step-00000009/weights.npy", b"half")  # a writer killed after copying, before the marker
    remote.write_bytes(".tmp-step-00000010-123/weights.npy", b"half")  # one killed while uploading
    mirror = RemoteCheckpoints(remote, tmp_path / "ckpt")
    assert mirror.steps() == []
    assert mirror.pull(newest_only=False) == []
    manager(tmp_path, mirror)  # the writer cleans up when it starts
    assert mirror.remote.files() == {}


def test_a_damaged_checkpoint_on_the_store_is_skipped_for_the_previous_one(tmp_path, bucket):
    mirror = RemoteCheckpoints(remote_dir(bucket), tmp_path / "ckpt")
    mgr = manager(tmp_path, mirror, keep=3)
    mgr.save(1, [1.0], {})
    mgr.save(2, [2.0], {})
    mirror.remote.write_bytes("step-00000002/weights.npy", b"flipped bits")
    fresh = RemoteCheckpoints(remote_dir(bucket), tmp_path / "fresh")
    assert fresh.pull(newest_only=True) == [1]
    assert [c.step for c in list_complete(tmp_path / "fresh")] == [1]


def test_an_unreachable_store_stops_the_writer_with_an_error_naming_the_store_and_the_fix(tmp_path, bucket):
    fast = {"config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2}}
    dead = RemoteDir("s3://nowhere/run/checkpoints", {"endpoint_url": "http://127.0.0.1:9", **fast}, retries=1,
                     retry_delay_s=0.01)
    with pytest.raises(CheckpointError, match=r"s3://nowhere/run/checkpoints.*failed after 2 attempts.*resume"):
        manager(tmp_path, RemoteCheckpoints(dead, tmp_path / "ckpt"))
    # The store goes away after the writer started: the save stops with the same kind of error, and the local
    # checkpoint stays complete for the next attempt.
    live = RemoteCheckpoints(remote_dir(bucket), tmp_path / "ckpt")
    mgr = manager(tmp_path, live)
    live.remote = dead
    with pytest.raises(CheckpointError, match=r"could not upload checkpoint step-00000001: .*nowhere"):
        mgr.save(1, [1.0], {})
    assert [c.step for c in list_complete(tmp_path / "ckpt")] == [1]


def test_transient_failures_are_retried_and_permanent_ones_are_not(bucket):
    remote = remote_dir(bucket, "x")
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("connection refused")
        return "ok"

    waits = []
    remote._sleep = waits.append  # noqa: SLF001
    assert remote.retry("probing", flaky) == "ok"
    assert waits == [remote.retry_delay_s, 2 * remote.retry_delay_s]
    with pytest.raises(FileNotFoundError):
        remote.read_bytes("missing.json")
    with pytest.raises(StorageError):
        RemoteDir("s3://b/x", retries=0).retry("failing", lambda: (_ for _ in ()).throw(ConnectionError("down")))


def test_meta_json_is_the_last_object_written(tmp_path, bucket, monkeypatch):
    mirror = RemoteCheckpoints(remote_dir(bucket), tmp_path / "ckpt")
    order = []
    real_put, real_copy = mirror.remote.put, mirror.remote.copy
    mirror.remote.put = lambda local, rel: (order.append(rel), real_put(local, rel))[1]
    mirror.remote.copy = lambda src, dst: (order.append(dst), real_copy(src, dst))[1]
    manager(tmp_path, mirror).save(4, [4.0], {})
    finals = [rel for rel in order if rel.startswith("step-")]
    assert finals[-1] == "step-00000004/meta.json"
    assert json.loads(mirror.remote.read_bytes("step-00000004/meta.json"))["step"] == 4
