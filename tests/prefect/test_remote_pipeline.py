"""The pipeline with its run folder and its sources on a real S3 server (SeaweedFS), against a real Prefect server:
every stage's output lands on the store, retention applies there, and a machine with no local copy reruns the export
from the store alone."""

from __future__ import annotations

import json
import shutil

import h5py
import numpy as np
import pytest

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
    files = store.files(f"versions/{name}")
    assert {"config.yaml", "export/model.onnx", "checkpoints.json"} <= set(files), sorted(files)
    steps = RemoteCheckpoints(store.child(f"versions/{name}/checkpoints"), tmp_path / "probe").steps()
    assert steps[-1] == 10
    assert not any(k.startswith("checkpoints/") for k in store.files() if not k.startswith("versions/"))
