"""Object-storage URLs in the config: a URL output_dir becomes the store's run folder plus a local copy, unknown schemes
and URLs in local-only fields are refused by name, file:// URLs are local paths; commands that take local paths refuse a
URL and name its local copy."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from ortflow.cli import app
from ortflow.config import ConfigError, config_from_dict, dump_config, load_config
from ortflow.versions import version_config

RAW = {"name": "unit", "output_dir": "runs/unit", "model": {"path": "model.onnx"},
       "data": {"train": "corpus/*.txt", "format": "text"}, "train": {"batch_size": 4, "num_train_steps": 12}}


def build(tmp_path: Path, **fields) -> object:
    return config_from_dict({**RAW, **fields}, base_dir=tmp_path)


def problems(tmp_path: Path, **fields) -> list[str]:
    with pytest.raises(ConfigError) as err:
        build(tmp_path, **fields)
    return err.value.problems


def test_a_url_output_dir_names_the_store_and_a_local_copy_under_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("ORTFLOW_CACHE_DIR", str(tmp_path / "cache"))
    cfg = build(tmp_path, output_dir="s3://bucket/teams/run/")
    assert cfg.storage.remote_dir == "s3://bucket/teams/run"
    assert cfg.output_dir == tmp_path / "cache" / "runs" / "s3" / "bucket" / "teams" / "run"
    assert cfg.checkpoints_dir == cfg.output_dir / "checkpoints"
    mine = build(tmp_path, output_dir="gs://b/r", storage={"cache_dir": "scratch"})  # relative: the config's folder
    assert mine.output_dir == tmp_path / "scratch" / "runs" / "gs" / "b" / "r"
    monkeypatch.chdir(tmp_path)  # built in Python, without a config folder: relative to the current folder
    python = config_from_dict({**RAW, "output_dir": "gs://b/r", "storage": {"cache_dir": "scratch"}})
    assert python.output_dir == mine.output_dir and python.storage.cache_dir == tmp_path / "scratch"
    again = load_config_text(tmp_path, dump_config(cfg, tmp_path))  # as every rank loads it (written here)
    assert again.output_dir == cfg.output_dir and again.storage.remote_dir == cfg.storage.remote_dir


def load_config_text(tmp_path: Path, text: str):
    path = tmp_path / "resolved.yaml"
    path.write_text(text)
    return load_config(path)


def test_an_unknown_scheme_is_refused_instead_of_becoming_a_local_folder(tmp_path):
    assert problems(tmp_path, output_dir="ftp://host/run") == [
        "output_dir: 'ftp://host/run' uses the scheme ftp://, which ortflow does not read; use s3://, gs://, az://, "
        "abfs://, file:// or a local path"]
    assert "names no bucket" in problems(tmp_path, output_dir="s3:///run")[0]
    assert problems(tmp_path, data={"train": ["http://x/data.csv"]})[0].startswith("data.train: 'http://x/data.csv' "
                                                                                  "uses the scheme http://")


def test_a_remote_url_in_a_field_that_takes_a_local_path_is_refused_by_name(tmp_path):
    found = problems(tmp_path, model={"path": "s3://bucket/model.onnx"})
    assert len(found) == 1 and "path: 's3://bucket/model.onnx' is a remote URL, but this field takes a local path" \
        in found[0]
    found = problems(tmp_path, output_dir="s3://bucket/run", checkpoint={"dir": str(tmp_path / "ckpt")})
    assert found == ["checkpoint.dir: with a remote output_dir (s3://bucket/run) this folder lives inside it; remove "
                     "checkpoint.dir"]


def test_file_urls_are_plain_local_paths(tmp_path):
    cfg = build(tmp_path, output_dir=f"file://{tmp_path}/out", data={"train": [f"file://{tmp_path}/c.txt"],
                                                                     "format": "text"})
    assert cfg.output_dir == tmp_path / "out" and cfg.storage.remote_dir is None
    assert cfg.data.train == (str(tmp_path / "c.txt"),)


def test_validate_refuses_an_unknown_scheme_without_a_traceback(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("name: unit\noutput_dir: s4://bucket/run\nmodel: {path: model.onnx}\n"
                    "data: {train: 'corpus/*.txt', format: text}\ntrain: {batch_size: 4, num_train_steps: 12}\n")
    result = CliRunner().invoke(app, ["validate", str(path)])
    assert result.exit_code != 0
    assert "output_dir: 's4://bucket/run' uses the scheme s4://" in result.output
    assert "Traceback" not in result.output


def test_a_version_of_a_remote_run_lives_in_the_versions_folder_on_the_store(tmp_path, monkeypatch):
    monkeypatch.setenv("ORTFLOW_CACHE_DIR", str(tmp_path / "cache"))
    cfg = build(tmp_path, output_dir="s3://bucket/run")
    version = version_config(cfg, cfg.output_dir / "versions" / "v1", None)
    assert version.storage.remote_dir == "s3://bucket/run/versions/v1"
    assert version.output_dir == cfg.output_dir / "versions" / "v1"


def test_commands_that_read_or_write_local_files_refuse_a_url_naming_the_local_copy_and_write_no_s3_folder(
        tmp_path, monkeypatch):
    monkeypatch.setenv("ORTFLOW_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    copy = tmp_path / "cache" / "runs" / "s3" / "team" / "runs" / "gpt"
    result = CliRunner().invoke(app, ["train", "s3://team/runs/gpt"])
    assert result.exit_code == 1, result.output
    assert "error: s3://team/runs/gpt: this command reads local files" in result.output, result.output
    assert str(copy) in result.output.replace("\n", ""), result.output
    result = CliRunner().invoke(app, ["export", str(tmp_path), "-o", "s3://team/models/model.onnx"])
    assert result.exit_code == 1, result.output
    assert "-o/--out s3://team/models/model.onnx: takes a local path" in result.output, result.output
    assert not (tmp_path / "s3:").exists()


def test_commands_that_fetch_from_a_store_without_credentials_say_so_at_once_without_retrying(tmp_path, monkeypatch):
    """evaluate, export and sample fetch a run folder or model from its store; with no credentials anywhere
    (botocore's NoCredentialsError) that is one line naming the variables to set, not six retries with backoff."""
    monkeypatch.setenv("ORTFLOW_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.chdir(tmp_path)
    for command in (["evaluate", "s3://team/runs/gpt"], ["export", "s3://team/runs/gpt/latest"],
                    ["sample", "s3://team/runs/gpt/export/model.onnx"]):
        result = CliRunner().invoke(app, command)
        assert result.exit_code == 1, (command, result.output)
        assert "AWS_ACCESS_KEY_ID" in result.output and "attempts" not in result.output, (command, result.output)
        assert "retrying" not in result.output and "Traceback" not in result.output, (command, result.output)
