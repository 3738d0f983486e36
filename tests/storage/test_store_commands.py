"""``ortflow evaluate``, ``export`` and ``sample`` given a URL on a real S3 server (SeaweedFS): each brings what it
reads (the run folder with its checkpoints, or the exported model) into the local copy and proceeds, from a machine
that has no copy yet; ``ortflow train``, which runs ranks on a local folder, still refuses a URL and names the copy."""

from __future__ import annotations

import json
import shutil

import numpy as np
import yaml
from typer.testing import CliRunner

from ortflow.cli import app
from ortflow.config import load_config
from ortflow.config.storage import cache_folder
from ortflow.storage import RemoteDir
from tests.support.runs import run_ranks


def _configured_on_the_store(tmp_path, url: str):
    """An MLP run folder configured and sharded on the store (``ortflow configure``, ``prepare-data``)."""
    from ortflow.examples.mlp import build_mlp

    build_mlp(tmp_path / "mlp.onnx", num_features=8, hidden=16, num_classes=3, seed=0)
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "data.npz", features=rng.normal(size=(64, 8)).astype(np.float32),
             labels=rng.integers(0, 3, 64))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "name": "cmds", "output_dir": url, "model": {"path": "mlp.onnx"},
        "data": {"train": "data.npz", "eval_fraction": 0.25},
        "train": {"batch_size": 4, "num_train_steps": 4, "evaluation_period": 2},
        "distributed": {"num_ranks": 1, "threads_per_rank": 1}, "checkpoint": {"period": 2}}))
    for command in ("configure", "prepare-data"):
        result = CliRunner().invoke(app, [command, str(config)])
        assert result.exit_code == 0, result.output
    return load_config(config)


def test_evaluate_and_export_read_a_run_folder_url_through_its_local_copy_on_a_machine_without_one(
        s3_server, bucket, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("ORTFLOW_CACHE_DIR", str(cache))
    url = f"s3://{bucket}/run"
    cfg = _configured_on_the_store(tmp_path, url)
    trained = run_ranks(cfg)  # one rank, 4 steps: it uploads each checkpoint to the store
    assert trained.returncode == 0, trained.stdout
    local = cfg.output_dir
    assert local == cache_folder(url, None)
    shutil.rmtree(cache)  # another machine: nothing local, the store holds the run

    evaluated = CliRunner().invoke(app, ["evaluate", url, "--checkpoint", "latest"])
    assert evaluated.exit_code == 0, evaluated.output
    result = json.loads(evaluated.stdout.strip().splitlines()[-1])
    assert result["step"] == 4 and result["num_rows"] == 16
    recorded = json.loads((local / "checkpoints" / "step-00000004" / "meta.json").read_text())
    assert result["loss"] == recorded["eval_loss"]  # the checkpoint pulled into the copy, evaluated as trained
    assert sorted(p.name for p in (local / "checkpoints").glob("step-*")) == ["step-00000002", "step-00000004"]

    out = tmp_path / "model.onnx"
    exported = CliRunner().invoke(app, ["export", f"{url}/checkpoints/step-00000002", "-o", str(out)])
    assert exported.exit_code == 0, exported.output
    assert "from step-00000002 (step 2" in exported.output and out.exists()
    refused = CliRunner().invoke(app, ["export", url, "-o", f"{url}/export/other.onnx"])
    assert refused.exit_code == 1 and "takes a local path" in refused.output, refused.output

    missing = CliRunner().invoke(app, ["evaluate", f"s3://{bucket}/nothing-here"])
    assert missing.exit_code == 1, missing.output
    assert f"s3://{bucket}/nothing-here/config.yaml does not exist" in missing.output
    assert "Traceback" not in missing.output


def test_sample_downloads_an_exported_model_named_by_its_url_or_by_output_dir_latest_into_its_runs_local_copy(
        s3_server, bucket, tmp_path, monkeypatch):
    """The model lands where ``evaluate`` and ``export`` keep the local copy of its run: under the run's own
    ``storage.cache_dir`` when its config sets one, else under the default cache."""
    from tests.test_sample import _next_byte_model

    monkeypatch.setenv("ORTFLOW_CACHE_DIR", str(tmp_path / "cache"))
    team = tmp_path / "team-cache"
    store = RemoteDir(f"s3://{bucket}/runs")
    model = _next_byte_model(tmp_path / "m.onnx")
    store.put(model, "versions/v1/export/model.onnx")
    store.write_bytes("versions/v1/config.yaml", yaml.safe_dump({"storage": {"cache_dir": str(team)}}).encode())
    store.put(model, "plain/export/model.onnx")  # a run folder whose config keeps the default cache
    store.write_bytes("plain/config.yaml", yaml.safe_dump({"storage": {}}).encode())
    store.write_bytes("registry.json", json.dumps({"format": 1, "versions": [
        {"version": "v1", "status": "completed"}, {"version": "v2", "status": "failed"}]}).encode())
    for source in (f"s3://{bucket}/runs/versions/v1/export/model.onnx", f"s3://{bucket}/runs/latest",
                   f"s3://{bucket}/runs/plain/export/model.onnx"):
        sampled = CliRunner().invoke(app, ["sample", source, "--prompt", "a", "--max-new-tokens", "3",
                                           "--temperature", "0"])
        assert sampled.exit_code == 0, sampled.output
        assert sampled.stdout.splitlines()[-1] == "abcd"
    run = f"s3://{bucket}/runs/versions/v1"
    assert (cache_folder(run, team) / "export" / "model.onnx").exists()  # evaluate/export's copy of that run
    assert not cache_folder(run, None).exists()
    assert (cache_folder(f"s3://{bucket}/runs/plain", None) / "export" / "model.onnx").exists()


def test_train_still_refuses_a_url_and_names_the_local_copy(tmp_path, monkeypatch):
    monkeypatch.setenv("ORTFLOW_CACHE_DIR", str(tmp_path / "cache"))
    refused = CliRunner().invoke(app, ["train", "s3://b/run"])
    assert refused.exit_code == 1
    assert "s3://b/run: this command reads local files" in refused.output
    assert str(tmp_path / "cache" / "runs" / "s3" / "b" / "run") in " ".join(refused.output.split())
