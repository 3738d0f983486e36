"""configure records the BatchNorm layers the ranks keep (configure.json ``batchnorm``), also into a record written
before that entry; ranks refuse a BatchNorm model whose record lacks it, and need nothing for other models."""

from __future__ import annotations

import json

import pytest

from ortflow.build.configure import configure
from ortflow.examples.mlp import build_mlp
from ortflow.trainer.batchnorm import RunningStats, recorded_layers
from tests.graph.test_export_patterns import make_cfg
from tests.support.exports import export_path


def test_configure_records_each_batchnorm_and_a_reused_record_gets_the_entry(tmp_path):
    cfg = make_cfg(tmp_path, export_path("cnn.onnx"))
    configure(cfg)
    record_path = cfg.output_dir / "configure.json"
    layers = recorded_layers(cfg.output_dir, cfg.model.path)
    assert [(la["mean"], la["var"], la["per_row"]) for la in layers] == [
        ("features.1.running_mean", "features.1.running_var", 16 * 16),
        ("features.4.running_mean", "features.4.running_var", 8 * 8),
    ]
    assert all(la["momentum"] == pytest.approx(0.9) for la in layers)
    record = json.loads(record_path.read_text())
    del record["batchnorm"]  # as a record written before the entry
    record_path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="re-run `ortflow configure CONFIG`"):
        recorded_layers(cfg.output_dir, cfg.model.path)
    assert configure(cfg).reused  # the artifacts stay; the record gets the entry
    assert recorded_layers(cfg.output_dir, cfg.model.path) == layers


def test_a_model_without_batchnorm_needs_no_entry(tmp_path):
    build_mlp(tmp_path / "mlp.onnx", num_features=4, hidden=8, num_classes=3)
    (tmp_path / "run").mkdir()
    assert recorded_layers(tmp_path / "run", tmp_path / "mlp.onnx") == []  # no configure.json at all


def test_unbiased_variance_needs_two_values_per_channel():
    layer = {"node": "bn", "mean": "m", "var": "v", "momentum": 0.9, "per_row": 1}
    with pytest.raises(ValueError, match="n >= 2 values per channel.*train.batchnorm_variance: biased"):
        RunningStats([layer], {}, None, 1, 1, "unbiased", "broadcast")
    with pytest.raises(ValueError, match="shape after the channel dim is unknown"):
        RunningStats([{**layer, "per_row": None}], {}, None, 8, 1, "unbiased", "broadcast")
