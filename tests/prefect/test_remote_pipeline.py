"""The pipeline with its run folder and its sources on a real S3 server (SeaweedFS), against a real Prefect server:
every stage's output lands on the store, retention applies there, a machine with no local copy reruns the export
from the store alone, and the summary and the versions' registry name the exported model's URL."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml

from ortflow.checkpoints.object_store import RemoteCheckpoints
from ortflow.flows import train_pipeline
from ortflow.storage import RemoteDir
from tests.support.prefect_runs import mlp_config

pytestmark = pytest.mark.prefect


def params_on_store(store: RemoteDir, step: int, folder) -> dict[str, np.ndarray]:
    info = RemoteCheckpoints(store.child("checkpoints"), folder).download(step)
    with h5py.File(info.path / "params.h5", "r") as f:
        return {ds.attrs["name"]: ds[()] for ds in f["parameters"].values()}


def test_pipeline_on_s3_keeps_every_stage_on_the_store_and_a_fresh_machine_exports_from_it(
        prefect_server, mlp_sources, s3_server, bucket, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv("ORTFLOW_CACHE_DIR", str(cache))
    s3_server.filesystem().put_file(str(mlp_sources["data"]), f"{bucket}/sources/part-0.npz")
    url = f"s3://{bucket}/run"
    cfg = mlp_config(tmp_path, mlp_sources, "remote", output_dir=url,
                     data={"train": [f"s3://{bucket}/sources/*.npz"]},
                     train={"num_train_steps": 20, "evaluation_period": 5},
                     checkpoint={"period": 5, "max_num_checkpoints": 2})
    assert cfg.output_dir.is_relative_to(cache) and cfg.storage.remote_dir == url

    state = train_pipeline(cfg, return_state=True)
    assert state.is_completed(), state
    summary = state.result()  # the summary names the model on the store, and its local copy as such
    assert summary["exported model"] == f"{url}/export/model.onnx"
    assert summary["exported model, local copy"] == str(cfg.export_path)
    store = RemoteDir(url)  # the test's one client of the store
    files = store.files()
    for name in ("config.yaml", "configure.json", "artifacts/training_model.onnx", "data/manifest.json",
                 "checkpoints.json", "progress.json", "export/model.onnx"):
        assert name in files, (name, sorted(files))
    index = json.loads(store.read_bytes("checkpoints.json"))
    kept = sorted(entry["step"] for entry in index["kept"])
    stored = RemoteCheckpoints(store.child("checkpoints"), tmp_path / "probe").steps()
    assert stored == kept and 20 in stored and len(stored) < 4  # retention ran on the store
    manifest = json.loads(store.read_bytes("data/manifest.json"))
    assert manifest["sources"]["train"] == [f"s3://{bucket}/sources/part-0.npz"]  # read from the store
    final = params_on_store(store, 20, tmp_path / "before")
    exported = files["export/model.onnx"]

    shutil.rmtree(cache)  # another machine: nothing local, the store holds the run
    store.remove("export/model.onnx")
    again = train_pipeline(cfg, from_stage="export", return_state=True)
    assert again.is_completed(), again
    files = store.files()
    assert files["export/model.onnx"]["size"] == exported["size"]
    assert RemoteCheckpoints(store.child("checkpoints"), tmp_path / "probe").steps() == stored
    after = params_on_store(store, 20, tmp_path / "after")
    assert all(np.array_equal(after[k], final[k]) for k in final)  # nothing was trained again


def test_versions_of_a_remote_run_folder_and_their_registry_live_on_the_store(
        prefect_server, mlp_sources, s3_server, bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("ORTFLOW_CACHE_DIR", str(tmp_path / "cache"))
    url = f"s3://{bucket}/runs"
    cfg = mlp_config(tmp_path, mlp_sources, "versions", output_dir=url, train={"num_train_steps": 10},
                     checkpoint={"period": 5, "max_num_checkpoints": 1})
    state = train_pipeline(cfg, new_version=True, return_state=True)
    assert state.is_completed(), state
    store = RemoteDir(url)  # the test's one client of the store
    registry = json.loads(store.read_bytes("registry.json"))["versions"]
    assert [entry["status"] for entry in registry] == ["completed"]
    name = registry[0]["version"]
    # The registry keeps the local file (`ortflow sample OUTPUT_DIR/latest` reads it) and the model's URL beside it.
    assert registry[0]["exported model url"] == f"{url}/versions/{name}/export/model.onnx"
    assert registry[0]["exported model"] == str(cfg.output_dir / "versions" / name / "export" / "model.onnx")
    files = store.files(f"versions/{name}")
    assert {"config.yaml", "export/model.onnx", "checkpoints.json"} <= set(files), sorted(files)
    steps = RemoteCheckpoints(store.child(f"versions/{name}/checkpoints"), tmp_path / "probe").steps()
    assert steps[-1] == 10
    assert not any(k.startswith("checkpoints/") for k in store.files() if not k.startswith("versions/"))


def test_ortflow_run_on_s3_keeps_its_whole_log_here_and_on_the_store(prefect_server, mlp_sources, s3_server, bucket,
                                                                      tmp_path):
    url = f"s3://{bucket}/run"
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "name": "logged", "output_dir": url, "model": {"path": str(mlp_sources["model"])},
        "data": {"train": [str(mlp_sources["data"])], "eval_fraction": 0.125},
        "train": {"batch_size": 4, "num_train_steps": 10}, "distributed": {"num_ranks": 1, "threads_per_rank": 1},
        "checkpoint": {"period": 5}}))
    # COLUMNS: the summary table's cells hold a whole URL per line.
    env = {**prefect_server, **s3_server.env, "ORTFLOW_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "300"}
    done = subprocess.run([str(Path(sys.executable).parent / "ortflow"), "run", str(config)], env=env,
                          capture_output=True, text=True, timeout=400, cwd=tmp_path)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    log_file = tmp_path / re.search(r"full log: +(\S+)", out)[1]
    # The summary at the end names the exported model's URL, and its local copy labelled as such.
    local = tmp_path / "cache" / "runs" / "s3" / bucket / "run" / "export" / "model.onnx"
    assert re.search(rf"exported model +│ {re.escape(url)}/export/model.onnx ", out), out[-3000:]
    assert re.search(rf"exported model, local copy +│ {re.escape(str(local))} ", out), out[-3000:]
    log = log_file.read_text()
    # Each stage pulls the run folder from the store while the log is being written: the log keeps every stage's
    # lines, and the flow run's end, which comes after the last stage uploaded the folder, reaches the store too.
    for stage in ("configure", "train", "export"):
        assert re.search(rf"'{stage}-\w+' \| Finished in state Completed", log), (stage, log[-3000:])
    assert re.search(r"prefect\.flow_runs .*Finished in state Completed", log), log[-3000:]
    assert RemoteDir(url).read_bytes(f"logs/{log_file.name}") == log_file.read_bytes()
