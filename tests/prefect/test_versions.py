"""Versioned scheduled training against a real local Prefect server: the server's scheduler creates runs of a served
interval schedule and they complete (the SQLAlchemy pin), a scheduled run trains a new version (continue warm-starts
from the previous one), a scheduled run on unchanged data is skipped, and three versions of one config (trained once
for several tests) show retention, reruns of an existing version's stages and pruning on demand. A killed rank's
retry in its own version folder: tests/prefect/test_pipeline.py; a second run on a busy folder refused with the holder
named: tests/prefect/test_deployments.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from ortflow.flows import train_pipeline
from ortflow.tasks.charts import loss_curve
from ortflow.versions import read_registry, resolve_run
from tests.prefect.serving import flow_runs_of, read_flow_run, serving
from tests.support.prefect_runs import mlp_config, wait_for, write_config

pytestmark = pytest.mark.prefect


def _write_data(path: Path, rows: int, seed: int) -> Path:
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(rows, 8)).astype(np.float32)
    labels = (features[:, 0] > 0).astype(np.int64) + (features[:, 1] > 1).astype(np.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, features=features, labels=labels)
    return path


def _entries(base: Path, status: str) -> list[dict]:
    return [e for e in read_registry(base) if e.get("status") == status]


def _first_and_last_train_loss(version: dict) -> tuple[float, float]:
    curve = loss_curve(Path(version["path"]) / "tensorboard")["train"]
    return curve[0][1], curve[-1][1]


def test_scheduled_runs_train_new_versions_warm_start_and_skip_unchanged_data(
    prefect_server, mlp_sources, tmp_path
):
    data = tmp_path / "data"
    _write_data(data / "part-0.npz", 256, seed=0)
    cfg = mlp_config(
        tmp_path, mlp_sources, "versioned",
        data={"train": [str(data / "*.npz")]},
        train={"num_train_steps": 40, "display_loss_steps": 1, "evaluation_period": 20, "batch_size": 8},
        optimizer={"learning_rate": 0.05},
        versions={"policy": "continue", "skip_unchanged": True},
        schedule={"interval_s": 5},
        distributed={"num_ranks": 1, "threads_per_rank": 1},  # versions, not a layout: one rank (2 x 4 rows a batch)
    )
    config_file = write_config(cfg, tmp_path / "versioned.yaml")
    start_folder = tmp_path / "checkout"  # a folder holding a package named ortflow must not shadow the installed one
    (start_folder / "ortflow").mkdir(parents=True)
    (start_folder / "ortflow" / "__init__.py").write_text("raise ImportError('the working folder was imported')\n")
    base = cfg.output_dir
    # The first version, trained from scratch by a run of the config (scheduled runs and this one plan versions the
    # same way): the scheduled runs below continue from it.
    assert train_pipeline(cfg, new_version=True, return_state=True).is_completed()
    _write_data(data / "part-1.npz", 256, seed=1)  # new data arrives
    # Runs take longer than the 5 s schedule, so scheduled runs queue; `--limit 1` keeps serve from asking the server
    # to start each queued run at every poll (docs/operations.md), which slowed a loaded test server to a crawl.
    with serving(config_file, prefect_server, "versioned", start_folder, tmp_path / "serve.log", ["--limit", "1"]):
        def no_failed_runs():
            failed = [r for r in flow_runs_of("train-pipeline/versioned") if r.state and r.state.is_failed()]
            assert not failed, f"{failed[0].state}\n{(tmp_path / 'serve.log').read_text()[-4000:]}"

        wait_for(lambda: no_failed_runs() or len(_entries(base, "completed")) == 2, 240,
                 "a scheduled version on the new data", 1)
        second = _entries(base, "completed")[1]["version"]
        skip = wait_for(lambda: no_failed_runs() or next(
            (e["flow_run_id"] for e in _entries(base, "skipped") if e.get("parent") == second), None), 240,
            "a scheduled run skipped as unchanged", 1)

        def ended():  # the skip is recorded before the run ends: serve stops once it has
            state = read_flow_run(skip).state
            return state is not None and state.is_final()

        wait_for(ended, 60, "the skipped run to end", 1)

    first, second = _entries(base, "completed")[:2]
    skipped = next(e for e in _entries(base, "skipped") if e.get("parent") == second["version"])
    for entry in (second, skipped):  # both were created by the server's scheduler service and completed
        run = read_flow_run(entry["flow_run_id"])
        assert run.auto_scheduled and run.state.is_completed(), run.state
    assert read_flow_run(second["flow_run_id"]).state.name == "Completed"
    assert read_flow_run(skipped["flow_run_id"]).state.name == "Skipped"
    for entry in (first, second):
        assert Path(entry["path"]).parent == base / "versions" and (Path(entry["path"]) / "export/model.onnx").exists()
        assert entry["steps"] == "40/40"
    assert first["parent"] is None and second["parent"] == first["version"]
    assert second["fingerprints"]["data"] != first["fingerprints"]["data"]
    assert second["init_from"] == first["final_checkpoint"]
    assert first["version"] < second["version"]  # names sort by time
    # continue warm-starts: the second version's first loss is near the first version's final loss, not its initial.
    first_initial, first_final = _first_and_last_train_loss(first)
    second_initial, _ = _first_and_last_train_loss(second)
    assert first_initial - first_final > 0.2, (first_initial, first_final)
    assert abs(second_initial - first_final) < 0.5 * abs(second_initial - first_initial), (
        first_initial, first_final, second_initial)
    assert "unchanged since version " + second["version"] in skipped["reason"]
    assert "path" not in skipped  # nothing was trained or written for it
    assert sorted(p.name for p in (base / "versions").iterdir()) == sorted(e["version"] for e in (first, second))
    assert resolve_run(base / "latest") == Path(second["path"])
    assert (base / "latest").resolve() == Path(second["path"]).resolve()


@pytest.fixture(scope="module")
def kept(prefect_server, mlp_sources, tmp_path_factory):
    """Three versions of one config with ``versions.keep: 2``, trained once for the tests below (in file order: the
    reruns leave the versions as they were, the data change and the prune come last). Its data file is its own: a
    test changes it on disk."""
    from ortflow.versions import folder_bytes

    root = tmp_path_factory.mktemp("kept")
    data = _write_data(root / "data-a" / "train.npz", 256, seed=1)
    cfg = mlp_config(root, {**mlp_sources, "data": data}, "kept",
                     train={"num_train_steps": 10, "display_loss_steps": 5, "evaluation_period": 5},
                     checkpoint={"period": 5, "max_num_checkpoints": 2}, versions={"keep": 2},
                     distributed={"num_ranks": 1, "threads_per_rank": 1})  # versions, not a layout: one rank
    sizes = []
    for _ in range(3):
        state = train_pipeline(cfg, new_version=True, return_state=True)
        assert state.is_completed(), state
        sizes.append(folder_bytes(cfg.output_dir / "versions"))
    return {"cfg": cfg, "root": root, "data": data, "sizes": sizes}


def test_versions_keep_2_after_3_runs_leaves_2_version_folders(kept):
    cfg = kept["cfg"]
    entries = read_registry(cfg.output_dir)
    statuses = [e["status"] for e in entries]
    assert statuses == ["pruned", "completed", "completed"], statuses
    folders = sorted(p.name for p in (cfg.output_dir / "versions").iterdir())
    assert folders == [e["version"] for e in entries[1:]]
    assert resolve_run(cfg.output_dir / "latest") == Path(entries[-1]["path"])
    print(f"version folders after each of the 3 runs (keep 2): {[f'{s / 1e6:.2f} MB' for s in kept['sizes']]}")


def test_from_stage_on_a_versioned_run_reruns_that_stage_of_an_existing_version_never_a_new_one(kept):
    from tests.prefect.test_pipeline import task_states

    cfg = kept["cfg"]
    registered = read_registry(cfg.output_dir)
    first, second = registered[1:]  # the two kept versions
    models = {e["version"]: Path(e["exported model"]) for e in (first, second)}
    written = {name: path.stat().st_mtime_ns for name, path in models.items()}

    named = train_pipeline(cfg, new_version=True, from_stage="export", version=first["version"], return_state=True)
    assert named.is_completed(), named
    states = task_states(named.state_details.flow_run_id, expect=("train", "export"))
    assert states["train"] == "Cached" and states["export"] == "Completed", states
    listed = [(e["version"], e["status"]) for e in registered]
    assert [(e["version"], e["status"]) for e in read_registry(cfg.output_dir)] == listed  # no new version
    assert models[first["version"]].stat().st_mtime_ns > written[first["version"]]  # exported again
    assert models[second["version"]].stat().st_mtime_ns == written[second["version"]]
    assert resolve_run(cfg.output_dir / "latest") == Path(second["path"])  # latest stays the newest version

    newest = train_pipeline(cfg, new_version=True, from_stage="export", return_state=True)
    assert newest.is_completed(), newest
    assert models[second["version"]].stat().st_mtime_ns > written[second["version"]]
    assert [(e["version"], e["status"]) for e in read_registry(cfg.output_dir)] == listed
    assert len(list((cfg.output_dir / "versions").iterdir())) == 2

    missing = train_pipeline(cfg, new_version=True, from_stage="export", version="no-such", return_state=True)
    assert missing.is_failed()
    with pytest.raises(Exception, match="version no-such: no such version folder"):
        missing.result()


def test_a_rerun_of_a_version_uses_its_recorded_config_and_refuses_to_change_its_data_or_settings(kept, mlp_sources):
    from ortflow.config import load_run_config
    from tests.prefect.test_pipeline import task_states

    cfg, root, data = kept["cfg"], kept["root"], kept["data"]
    entry = read_registry(cfg.output_dir)[1]  # the older kept version
    manifest = (Path(entry["path"]) / "data" / "manifest.json").read_bytes()
    # The deployment's config moves on (other data, longer training); a rerun of the old version's export stage
    # still exports that version as it was trained: nothing is prepared or trained again.
    moved = mlp_config(root, {**mlp_sources, "data": _write_data(root / "data-b" / "train.npz", 512, seed=2)},
                       "kept", train={"num_train_steps": 40, "display_loss_steps": 5, "evaluation_period": 5},
                       checkpoint={"period": 5, "max_num_checkpoints": 2}, versions={"keep": 2},
                       distributed={"num_ranks": 1, "threads_per_rank": 1})
    rerun = train_pipeline(moved, new_version=True, from_stage="export", version=entry["version"], return_state=True)
    assert rerun.is_completed(), rerun
    states = task_states(rerun.state_details.flow_run_id, expect=("prepare_data", "train", "export"))
    assert states["prepare_data"] == "Cached" and states["train"] == "Cached", states
    after = next(e for e in read_registry(cfg.output_dir) if e["version"] == entry["version"])
    assert after["steps"] == entry["steps"] == "10/10", after
    assert (Path(entry["path"]) / "data" / "manifest.json").read_bytes() == manifest
    recorded = load_run_config(Path(entry["path"]))
    assert recorded.train.num_train_steps == 10 and [str(p) for p in recorded.data.train] == [str(data)]

    # Overrides of a training setting, or sources that changed on disk, would change the version: refused.
    changed = train_pipeline(cfg, overrides=["train.num_train_steps=20"], new_version=True, from_stage="train",
                             version=entry["version"], return_state=True)
    assert changed.is_failed()
    with pytest.raises(Exception, match="this run's overrides change its training settings"):
        changed.result()
    _write_data(data, 256, seed=3)
    redone = train_pipeline(cfg, new_version=True, from_stage="prepare_data", version=entry["version"],
                            return_state=True)
    assert redone.is_failed()
    with pytest.raises(Exception, match="the data sources changed on disk"):
        redone.result()
    assert (Path(entry["path"]) / "data" / "manifest.json").read_bytes() == manifest
    assert [e["steps"] for e in read_registry(cfg.output_dir)][1:] == ["10/10", "10/10"]


def test_prune_on_demand_keeps_the_newest_versions_and_reports_the_disk_freed(kept):
    from typer.testing import CliRunner

    from ortflow.cli.app import app

    cfg = kept["cfg"]
    entries = read_registry(cfg.output_dir)
    config_file = write_config(cfg, kept["root"] / "kept.yaml")
    # `ortflow runs` in this process (no interpreter start, no imports again); its streams apart.
    done = CliRunner().invoke(app, ["runs", str(config_file), "--prune", "--set", "versions.keep=1"])
    assert done.exit_code == 0, done.output
    assert "pruned 1 version(s)" in done.stderr and "MB freed" in done.stderr, done.stderr
    assert [p.name for p in (cfg.output_dir / "versions").iterdir()] == [entries[-1]["version"]]
    print(done.stderr.splitlines()[0])
    without = CliRunner().invoke(app, ["runs", str(config_file), "--prune", "--set", "versions.keep=null"])
    assert without.exit_code == 1 and "versions.keep is not set" in without.stderr, without.output
