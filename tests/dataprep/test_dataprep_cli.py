"""`ortflow prepare-data CONFIG` prints a one-line summary and reports errors without a traceback."""

from __future__ import annotations

import json

import yaml
from dataprep_helpers import TABLE_INPUTS, write_parquet
from typer.testing import CliRunner

from ortflow.cli import app
from ortflow.config.sealed import seal


def test_prepare_data_command(tmp_path):
    write_parquet(tmp_path / "d.parquet", 20)
    (tmp_path / "model.onnx").write_bytes(b"x")
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "output_dir": "out", "model": {"path": "model.onnx"},
        "data": {"train": "d.parquet", "eval_fraction": 0.25}, "train": {"batch_size": 2, "num_train_steps": 1},
    }))  # fmt: skip
    runner = CliRunner()
    result = runner.invoke(app, ["prepare-data", str(config)])
    assert result.exit_code == 1 and "run configure first" in result.output and "Traceback" not in result.output

    (tmp_path / "out").mkdir()
    record = seal({"train_inputs": TABLE_INPUTS})  # sealed, as configure writes it
    (tmp_path / "out" / "configure.json").write_text(json.dumps(record))
    result = runner.invoke(app, ["prepare-data", str(config)])
    assert result.exit_code == 0, result.output
    assert "15 train + 5 eval rows, 2 shard(s)" in result.output and "written" in result.output
    result = runner.invoke(app, ["prepare-data", str(config), "--set", "data.eval_fraction=0.25"])
    assert result.exit_code == 0 and "reused" in result.output
