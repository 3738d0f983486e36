"""configure records the BatchNorm layers the ranks keep (configure.json ``batchnorm``) and rebuilds a record without
that entry (unsealed, from before); ranks refuse a BatchNorm model whose record lacks it, and need nothing for other
models."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ortflow.configure.configure import configure
from ortflow.examples.mlp import build_mlp
from ortflow.trainer.batchnorm import RunningStats, recorded_layers
from tests.graph.test_export_patterns import make_cfg
from tests.support.exports import export_path


def test_configure_records_each_batchnorm_and_rebuilds_a_record_without_the_entry(tmp_path):
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
    op_types = record["op_types"]
    assert {"Conv", "BatchNormalization"} <= set(op_types)
    del record["batchnorm"], record["op_types"], record["record_sha256"]  # as an unsealed record of before
    record_path.write_text(json.dumps(record))
    with pytest.raises(ValueError, match="re-run `ortflow configure CONFIG`"):
        recorded_layers(cfg.output_dir, cfg.model.path)
    assert not configure(cfg).reused  # an unsealed record vouches for nothing: configure rebuilds, with the entries
    assert recorded_layers(cfg.output_dir, cfg.model.path) == layers
    assert json.loads(record_path.read_text())["op_types"] == op_types


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


class _Param:
    """An engine parameter: ``.data`` a writable view (CPU ranks write into it), ``.data = x`` (CUDA ranks)."""

    def __init__(self, value):
        self._value = np.array(value, dtype=np.float32)

    @property
    def data(self):
        return self._value

    @data.setter
    def data(self, value):
        self._value = np.array(value, dtype=np.float32)


@pytest.mark.parametrize("on_device", [False, True], ids=["cpu-engine", "cuda-engine"])
@pytest.mark.parametrize("variance", ["unbiased", "biased"])
def test_running_variance_follows_the_asked_rule_whatever_the_engines(on_device, variance):
    """The CPU engine updates running_var with the biased batch variance, the CUDA engine (cuDNN) with the unbiased
    one; after an update of k micro-batches the statistics follow the rule asked for either way."""
    n, k, m = 8, 3, 0.9  # n values per channel: batch 2 x 4 per row
    layer = {"node": "bn", "mean": "m", "var": "v", "momentum": m, "per_row": 4}
    rng = np.random.default_rng(0)
    v0 = rng.uniform(0.5, 2, size=3)
    params = {"m": _Param(np.zeros(3)), "v": _Param(v0)}
    stats = RunningStats([layer], params, None, 2, k, variance, "broadcast", on_device=on_device)
    batches = [rng.normal(size=(n, 3)) * 2 for _ in range(k)]
    engine, asked = v0.copy(), v0.copy()
    for x in batches:  # the engine's own update, then the rule asked for, in float64
        engine = m * engine + (1 - m) * x.var(axis=0, ddof=1 if on_device else 0)
        asked = m * asked + (1 - m) * x.var(axis=0, ddof=1 if variance == "unbiased" else 0)
    params["v"].data = engine
    stats.after_update()
    np.testing.assert_allclose(params["v"].data, asked, rtol=2e-6)


@pytest.mark.parametrize(("export", "pp"), [("cnn.onnx", 1), ("cnn-dynamo-noopt.onnx", 1),
                                           ("bnmlp-dynamo-noopt.onnx", 1), ("bnmlp-dynamo-noopt.onnx", 2)],
                         ids=["cnn-tp2", "cnn-dynamo-noopt-tp2", "bnmlp-dynamo-noopt-tp2",
                              "bnmlp-dynamo-noopt-pp2xtp2"])
def test_tensor_parallel_pieces_of_a_batchnorm_model_are_refused_naming_the_running_statistics(tmp_path, export, pp):
    """Both exporters' CNN and the MLP with BatchNorm1d at tp 2 (the MLP also at pp 2 x tp 2): ``ortflow validate``
    refuses it as the tensor-parallel ranks would, naming the first BatchNorm and its running mean (by torch's name),
    why (its running statistics are kept in data-parallel and pipeline layouts only) and the fix."""
    import yaml

    from ortflow.validate import validate

    rng = np.random.default_rng(0)
    if export.startswith("cnn"):
        np.savez(tmp_path / "data.npz", pixels=rng.normal(size=(64, 1, 16, 16)).astype(np.float32),
                 labels=rng.integers(0, 10, 64))
    else:
        np.savez(tmp_path / "data.npz", features=rng.normal(size=(64, 8)).astype(np.float32),
                 labels=rng.integers(0, 3, 64))
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump({
        "name": "tp2", "output_dir": str(tmp_path / "run"), "model": {"path": str(export_path(export))},
        "data": {"train": [str(tmp_path / "data.npz")], "eval_fraction": 0.25},
        "train": {"batch_size": 2, "num_train_steps": 2},
        "distributed": {"num_ranks": 2 * pp, "horizontal_parallel_size": 2, "pipeline_parallel_size": pp},
    }))
    (problem,) = validate(path)
    first = "features.1" if export.startswith("cnn") else "bn"
    assert problem.startswith("BatchNormalization '") and problem.endswith(
        f" (running mean '{first}.running_mean'): its running statistics are kept in data-parallel and pipeline "
        "layouts, not with distributed.horizontal_parallel_size > 1; set it to 1"), problem
