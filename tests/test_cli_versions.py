"""The CLI's side of versions and the run-folder lock: ``ortflow runs``, ``latest`` for export and sample, and
``ortflow train`` refused while another process holds the folder."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import yaml
from typer.testing import CliRunner

from ortflow.cli import app
from ortflow.config import config_from_dict, write_resolved_config
from ortflow.examples.mlp import build_mlp
from ortflow.versions import finish_version, plan_run

runner = CliRunner()


def _config_file(tmp_path, **versions):
    build_mlp(tmp_path / "mlp.onnx", num_features=4, hidden=8, num_classes=3)
    np.savez(tmp_path / "a.npz", features=np.zeros((8, 4), np.float32), labels=np.zeros(8, np.int64))
    raw = {"name": "v", "output_dir": str(tmp_path / "runs"), "model": {"path": str(tmp_path / "mlp.onnx")},
           "data": {"train": [str(tmp_path / "a.npz")]}, "train": {"batch_size": 2, "num_train_steps": 4},
           "versions": versions}
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path, config_from_dict(raw)


def test_runs_lists_versions_with_status_parent_and_losses(tmp_path):
    path, cfg = _config_file(tmp_path, skip_unchanged=True)
    assert "no versions yet" in runner.invoke(app, ["runs", str(path)]).output
    first = plan_run(cfg, "fr-1", new_version=True, now=1)
    finish_version(cfg.output_dir, first.version, "completed", {"steps": "4/4", "final eval loss": 0.5})
    plan_run(cfg, "fr-2", new_version=True, now=2)  # unchanged: skipped
    result = runner.invoke(app, ["runs", str(path)], env={"COLUMNS": "300"})
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert any(first.version in line and "completed" in line and "0.5" in line and "4/4" in line for line in lines)
    assert any("skipped (config, model and data unchanged" in line for line in lines), result.output


def test_a_running_version_nobody_holds_shows_as_interrupted(tmp_path):
    path, cfg = _config_file(tmp_path)
    plan_run(cfg, "fr-1", new_version=True, now=1)  # its flow run died without recording an end
    result = runner.invoke(app, ["runs", str(path)], env={"COLUMNS": "300"})
    assert "interrupted" in result.output


def test_export_and_sample_of_latest_without_versions_say_what_to_do(tmp_path):
    for args in (["export", str(tmp_path / "runs" / "latest")], ["sample", str(tmp_path / "runs" / "latest")]):
        result = runner.invoke(app, args, terminal_width=250)
        assert result.exit_code == 1 and "no completed version" in result.output, result.output


HOLD = textwrap.dedent(
    """
    import sys, time
    from ortflow import runlock
    with runlock.hold(sys.argv[1], flow_run_id="fr-9", purpose="train"):
        print("held", flush=True)
        time.sleep(60)
    """
)


def test_ortflow_train_is_refused_while_another_process_holds_the_folder(tmp_path):
    _, cfg = _config_file(tmp_path)
    write_resolved_config(cfg)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(cfg.output_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        result = runner.invoke(app, ["train", str(cfg.output_dir)], terminal_width=300)
        assert result.exit_code == 1
        assert f"is in use by pid {holder.pid}" in result.output and "flow run fr-9" in result.output, result.output
        assert not cfg.checkpoints_dir.exists()
    finally:
        holder.kill()
        holder.wait()
