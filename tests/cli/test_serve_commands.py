"""``ortflow serve`` without a Prefect server to register on."""

from __future__ import annotations

import numpy as np
import yaml
from typer.testing import CliRunner

from ortflow.cli import app
from ortflow.examples.mlp import build_mlp

runner = CliRunner()


def test_serve_without_prefect_api_url_names_the_server_to_start_and_serves_nothing(tmp_path):
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED, temporary_settings

    build_mlp(tmp_path / "mlp.onnx", num_features=4, hidden=8, num_classes=3)
    np.savez(tmp_path / "a.npz", features=np.zeros((8, 4), np.float32), labels=np.zeros(8, np.int64))
    raw = {"name": "s", "output_dir": str(tmp_path / "runs"), "model": {"path": str(tmp_path / "mlp.onnx")},
           "data": {"train": [str(tmp_path / "a.npz")]}, "train": {"batch_size": 2, "num_train_steps": 4},
           "schedule": {"interval_s": 60}}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(raw))
    # No temporary server either: a serve that went on would fail at once instead of starting one.
    with temporary_settings(updates={PREFECT_SERVER_EPHEMERAL_ENABLED: False}, restore_defaults={PREFECT_API_URL}):
        result = runner.invoke(app, ["serve", str(tmp_path / "config.yaml")], env={"COLUMNS": "200"})
    assert result.exit_code == 1, result.output
    assert result.output.startswith("error: ortflow serve registers its deployments on a Prefect server")
    assert "prefect server start" in result.output and "PREFECT_API_URL=" in result.output
    assert not (tmp_path / "runs" / ".ortflow" / "serve").exists()  # nothing registered, no flow-run folder
