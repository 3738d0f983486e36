"""Model versions without a server: the plan a run gets (new, resumed, skipped, warm-started), the registry, and
``latest``."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ortflow.config import ConfigError, config_from_dict
from ortflow.examples.mlp import build_mlp
from ortflow.versions import finish_version, plan_run, read_registry, resolve_model, resolve_run, version_name


def _config(tmp_path: Path, **versions) -> object:
    if not (tmp_path / "mlp.onnx").exists():
        build_mlp(tmp_path / "mlp.onnx", num_features=4, hidden=8, num_classes=3)
        np.savez(tmp_path / "a.npz", features=np.zeros((8, 4), np.float32), labels=np.zeros(8, np.int64))
    return config_from_dict({
        "name": "v", "output_dir": str(tmp_path / "runs"), "model": {"path": str(tmp_path / "mlp.onnx")},
        "data": {"train": [str(tmp_path / "*.npz")]}, "train": {"batch_size": 2, "num_train_steps": 4},
        "versions": versions,
    })


def _complete(cfg, plan) -> dict:
    """Pretend the version trained: one complete checkpoint, then record it as completed."""
    ckpt = Path(plan.config.checkpoints_dir) / "step-00000004"
    ckpt.mkdir(parents=True)
    (ckpt / "meta.json").write_text(json.dumps({"format": 1, "step": 4, "files": {}}))
    return finish_version(cfg.output_dir, plan.version, "completed", {"steps": "4/4", "exported model": "m.onnx"})


def test_unversioned_run_trains_the_output_dir_itself(tmp_path):
    cfg = _config(tmp_path)
    plan = plan_run(cfg, "fr-1", new_version=False)
    assert plan.config is cfg and plan.version is None
    assert read_registry(cfg.output_dir) == []


def test_new_versions_get_their_own_folders_and_a_retry_resumes_its_own(tmp_path):
    cfg = _config(tmp_path)
    first = plan_run(cfg, "aaaa-0001", new_version=True, now=1_000_000_000)
    assert first.config.output_dir == cfg.output_dir / "versions" / first.version
    assert first.config.export_path == first.config.output_dir / "export" / "model.onnx"
    assert first.config.checkpoint.init_from is None and not first.resumed
    again = plan_run(cfg, "aaaa-0001", new_version=True, now=1_000_000_500)  # Prefect retries the flow run
    assert again.resumed and again.version == first.version and again.config.output_dir == first.config.output_dir
    second = plan_run(cfg, "bbbb-0002", new_version=True, now=1_000_000_100)
    assert second.version != first.version and sorted([second.version, first.version])[0] == first.version
    assert [e["status"] for e in read_registry(cfg.output_dir)] == ["running", "running"]


def test_continue_warm_starts_from_the_previous_versions_final_checkpoint(tmp_path):
    cfg = _config(tmp_path, policy="continue")
    first = plan_run(cfg, "fr-1", new_version=True, now=1)
    assert first.parent is None and first.config.checkpoint.init_from is None  # nothing to continue from yet
    entry = _complete(cfg, first)
    second = plan_run(cfg, "fr-2", new_version=True, now=2)
    assert second.parent == first.version
    assert second.config.checkpoint.init_from == Path(entry["final_checkpoint"])
    assert resolve_run(cfg.output_dir / "latest") == first.config.output_dir
    assert resolve_model(cfg.output_dir / "latest") == Path("m.onnx")


def test_continue_refuses_a_changed_model_with_the_fix(tmp_path):
    cfg = _config(tmp_path, policy="continue")
    _complete(cfg, plan_run(cfg, "fr-1", new_version=True, now=1))
    build_mlp(tmp_path / "mlp.onnx", num_features=4, hidden=8, num_classes=3, seed=7)
    with pytest.raises(ConfigError, match="use policy retrain"):
        plan_run(cfg, "fr-2", new_version=True, now=2)


def test_skip_unchanged_skips_until_the_data_changes(tmp_path):
    cfg = _config(tmp_path, skip_unchanged=True)
    first = plan_run(cfg, "fr-1", new_version=True, now=1)
    _complete(cfg, first)
    skipped = plan_run(cfg, "fr-2", new_version=True, now=2)
    assert skipped.skipped_because == f"config, model, data and policy unchanged since version {first.version}"
    assert not (cfg.output_dir / "versions" / skipped.version).exists()
    np.savez(tmp_path / "b.npz", features=np.ones((8, 4), np.float32), labels=np.ones(8, np.int64))
    trained = plan_run(cfg, "fr-3", new_version=True, now=3)
    assert trained.skipped_because is None and trained.version not in (first.version, skipped.version)
    assert [e["status"] for e in read_registry(cfg.output_dir)] == ["completed", "skipped", "running"]


def test_a_data_glob_matching_nothing_fails_at_run_start(tmp_path):
    from ortflow.dataprep import DataError

    cfg = _config(tmp_path)
    raw = cfg.model_dump(mode="json")
    raw["data"]["train"] = [str(tmp_path / "missing" / "*.npz")]
    with pytest.raises(DataError, match="matches no file"):
        plan_run(config_from_dict(raw), "fr-1", new_version=True)


def test_latest_without_any_version_says_what_to_do(tmp_path):
    with pytest.raises(ValueError, match="no completed version"):
        resolve_run(tmp_path / "latest")
    assert resolve_run(tmp_path / "step-00000004") == tmp_path / "step-00000004"


def test_version_names_sort_by_time_and_differ_for_runs_created_together():
    ids = ["01a20674-fa53-7683-b66c-71de4f82bb24", "01a20674-fa53-76e4-9bc1-af5163ffe1c0"]
    names = [version_name(i, now=1_700_000_000) for i in ids]
    assert names[0] != names[1] and names[0].startswith("20231114T221320Z-")
    assert version_name(None, now=1) < version_name(None, now=2)


def _entry(version: str, status: str, parent: str | None = None) -> dict:
    return {"version": version, "status": status, "path": f"/runs/versions/{version}", "parent": parent}


def test_retention_keeps_the_newest_completed_pinned_running_and_what_a_running_version_warm_starts_from():
    from ortflow.versions import versions_to_prune

    entries = [_entry("v1", "completed"), _entry("v2", "failed"), _entry("v3", "completed"),
               _entry("v4", "completed"), _entry("v5", "stopped"), _entry("v6", "completed"),
               _entry("v7", "completed"), {"version": "v8", "status": "skipped", "parent": "v7"},
               _entry("v9", "running", parent="v3")]
    # keep 2: v6 and v7 (latest); v3 is what the running v9 warm-starts from; v1 is pinned; v9 runs.
    assert versions_to_prune(entries, 2, pinned=("v1",)) == ["v2", "v4", "v5"]
    assert versions_to_prune(entries, 10) == []  # fewer completed versions than keep: only nothing
    # keep 1 still keeps latest; a failed version newer than every kept completed one stays (it may be looked at)
    assert versions_to_prune([_entry("a", "completed"), _entry("b", "completed"), _entry("c", "failed")], 1) == ["a"]
    pruned = [{**_entry("a", "pruned")}, _entry("b", "completed")]
    assert versions_to_prune(pruned, 1) == []


def test_a_versioned_run_refuses_export_path_by_name(tmp_path):
    from ortflow.config import apply_overrides
    from ortflow.versions import version_config

    cfg = apply_overrides(_config(tmp_path), [f"export.path={tmp_path / 'elsewhere.onnx'}"])
    with pytest.raises(ConfigError, match=r"export.path .*elsewhere.onnx: a versioned run exports into its version"):
        version_config(cfg, tmp_path / "runs" / "versions" / "v1", None)


def test_skip_unchanged_never_skips_a_policy_change(tmp_path):
    cont = _config(tmp_path, policy="continue", skip_unchanged=True)
    _complete(cont, plan_run(cont, "fr-1", new_version=True, now=1))
    retrain = _config(tmp_path, policy="retrain", skip_unchanged=True)  # same config, model and data
    plan = plan_run(retrain, "fr-2", new_version=True, now=2)
    assert plan.skipped_because is None and plan.parent is None  # trained, from model.path
    _complete(retrain, plan)
    again = plan_run(cont, "fr-3", new_version=True, now=3)  # back to continue: a change again, not skipped
    assert again.skipped_because is None and again.parent == plan.version
    _complete(cont, again)
    assert plan_run(cont, "fr-4", new_version=True, now=4).skipped_because  # nothing changed now: skipped


def test_continue_refuses_a_changed_optimizer_section_as_documented_and_validate_says_so_first(tmp_path):
    from ortflow.validate import version_problems

    cfg = _config(tmp_path, policy="continue")
    _complete(cfg, plan_run(cfg, "fr-1", new_version=True, now=1))
    raw = cfg.model_dump(mode="json")
    raw["optimizer"]["learning_rate"] = 0.5
    changed = config_from_dict(raw)
    assert version_problems(cfg) == []
    problems = version_problems(changed)
    assert len(problems) == 1 and "the optimizer section changed since version" in problems[0]
    assert "use policy retrain" in problems[0]
    with pytest.raises(ConfigError, match="the optimizer section changed"):
        plan_run(changed, "fr-2", new_version=True, now=2)


def test_a_repeated_stop_signal_does_not_keep_a_stopped_version_recorded_as_running(monkeypatch):
    """During a flow run Prefect raises each SIGTERM where the flow is: one arriving while the pipeline records the
    version's end interrupts that write, which is then written all the same."""
    from prefect.exceptions import TerminationSignal

    from ortflow.tasks import runs

    written = []

    def finish_version(cfg, plan, status, summary=None):
        if not written:
            written.append("interrupted")
            raise TerminationSignal(signal=15)  # the repeated SIGTERM, raised inside the task
        written.append(status)

    monkeypatch.setattr(runs, "finish_version", finish_version)
    runs.record_version_end(object(), object(), "stopped")
    assert written == ["interrupted", "stopped"]
    # A failure while recording is not swallowed.
    monkeypatch.setattr(runs, "finish_version", lambda *a: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        runs.record_version_end(object(), object(), "stopped")
