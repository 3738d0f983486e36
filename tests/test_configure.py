"""The configure stage on models built in the tests: an MLP classifier and a tiny GPT-style decoder."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from ortflow.artifacts_folder import ARTIFACT_FILES
from ortflow.config import ConfigError, OptimizerConfig, config_from_dict
from ortflow.configure.artifacts import inspect_model
from ortflow.configure.configure import CONFIGURE_RECORD_NAME, configure
from ortflow.engine import api
from ortflow.examples import build_gpt, build_mlp
from ortflow.trainer.optim import build_update, whole_segments

SEQ_LEN = 16
LR = 1e-2


def make_cfg(tmp_path: Path, model_path: Path, model: dict | None = None, optimizer: dict | None = None):
    raw = {
        "name": "t",
        "output_dir": str(tmp_path / "run"),
        "model": {"path": str(model_path), **(model or {})},
        "data": {"train": str(tmp_path / "train.parquet")},
        "train": {"batch_size": 4, "num_train_steps": 2},
        "optimizer": {"learning_rate": LR, **(optimizer or {})},
    }
    return config_from_dict(raw)


def mlp_batch(rng: np.random.Generator, n: int = 16) -> tuple[np.ndarray, np.ndarray]:
    return rng.standard_normal((n, 8)).astype(np.float32), rng.integers(0, 3, n).astype(np.int64)


def gpt_batch(rng: np.random.Generator, b: int = 2) -> tuple[np.ndarray, np.ndarray]:
    ids = rng.integers(0, 256, (b, SEQ_LEN)).astype(np.int64)
    return ids, np.roll(ids, -1, axis=1).reshape(-1)


class Engine:
    """The artifacts loaded the way a rank loads them."""

    def __init__(self, artifacts_dir: Path, learning_rate: float = LR):
        d = artifacts_dir
        self.state = api.CheckpointState.load_checkpoint(str(d / "checkpoint"))
        self.module = api.Module(str(d / "training_model.onnx"), self.state, str(d / "eval_model.onnx"), device="cpu")
        # No optimizer graph in the artifacts: ortflow's update on the engine's buffers, as a rank builds it.
        self.names = sorted(n for n, p in self.state.parameters if p.requires_grad)
        params = [self.state.parameters[n].data.reshape(-1) for n in self.names]
        self.update = build_update(OptimizerConfig(), whole_segments(self.names, [p.size for p in params]), params)
        self.learning_rate = learning_rate

    def step(self, *inputs: np.ndarray) -> float:
        self.module.train()
        loss = float(self.module(*inputs))
        self.update.step([self.state.parameters[n].grad.reshape(-1) for n in self.names], self.learning_rate)
        self.module.lazy_reset_grad()
        return loss

    def eval_loss(self, *inputs: np.ndarray) -> float:
        self.module.eval()
        return float(self.module(*inputs))

    def param(self, name: str) -> np.ndarray:
        return np.array(self.state.parameters[name].data)


def mtimes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_configure_builds_artifacts_and_training_lowers_the_loss(tmp_path, kind):
    rng = np.random.default_rng(0)
    if kind == "mlp":
        path, batch = build_mlp(tmp_path / "mlp.onnx"), mlp_batch(rng)
    else:
        path = build_gpt(tmp_path / "gpt.onnx", seq_len=SEQ_LEN, d_model=32, num_layers=1, num_heads=2)
        batch = gpt_batch(rng)
    result = configure(make_cfg(tmp_path, path))

    assert not result.reused
    assert sorted(p.name for p in result.artifacts_dir.iterdir()) == sorted(ARTIFACT_FILES)
    assert (result.run_dir / "config.yaml").exists()
    engine = Engine(result.artifacts_dir)
    before = engine.eval_loss(*batch)
    if kind == "gpt":
        assert abs(before - math.log(256)) < 0.3
    for _ in range(10):
        engine.step(*batch)
    after = engine.eval_loss(*batch)
    assert after < 0.95 * before, (before, after)


def test_second_configure_is_a_no_op(tmp_path, caplog):
    cfg = make_cfg(tmp_path, build_mlp(tmp_path / "mlp.onnx"))
    first = configure(cfg)
    stamps = mtimes(first.artifacts_dir)
    record_stamp = (first.run_dir / CONFIGURE_RECORD_NAME).stat().st_mtime_ns

    with caplog.at_level(logging.INFO, logger="ortflow.configure.configure"):
        second = configure(cfg)

    assert second.reused
    assert mtimes(second.artifacts_dir) == stamps
    assert (second.run_dir / CONFIGURE_RECORD_NAME).stat().st_mtime_ns == record_stamp
    assert second.info == first.info
    assert f"configure: unchanged, reusing {first.artifacts_dir}" in caplog.text


def test_changing_the_optimizer_section_reuses_the_artifacts(tmp_path):
    # The artifacts hold no optimizer graph any more (ortflow applies the update), so nothing needs rebuilding.
    model = build_mlp(tmp_path / "mlp.onnx")
    first = configure(make_cfg(tmp_path, model))
    second = configure(make_cfg(tmp_path, model, optimizer={"name": "lamb"}))
    assert second.reused and second.info["fingerprint"] == first.info["fingerprint"]
    assert not (second.artifacts_dir / "optimizer_model.onnx").exists()


def test_changing_the_model_bytes_rebuilds(tmp_path):
    model = tmp_path / "mlp.onnx"
    cfg = make_cfg(tmp_path, build_mlp(model, seed=0))
    first = configure(cfg)
    build_mlp(model, seed=1)
    second = configure(cfg)
    assert not second.reused
    assert second.info["fingerprint"] != first.info["fingerprint"]
    weight = next(t for t in onnx.load(str(model)).graph.initializer if t.name == "fc1.weight")
    new_weight = numpy_helper.to_array(weight)
    assert np.array_equal(Engine(second.artifacts_dir).param("fc1.weight"), new_weight)


def test_missing_artifact_file_rebuilds(tmp_path):
    cfg = make_cfg(tmp_path, build_mlp(tmp_path / "mlp.onnx"))
    first = configure(cfg)
    (first.artifacts_dir / "eval_model.onnx").unlink()
    assert not configure(cfg).reused
    assert (first.artifacts_dir / "eval_model.onnx").exists()


def test_frozen_patterns_exclude_parameters_from_training(tmp_path):
    cfg = make_cfg(tmp_path, build_mlp(tmp_path / "mlp.onnx"), model={"frozen": ["fc1.*"]})
    result = configure(cfg)
    assert result.info["frozen"] == ["fc1.bias", "fc1.weight"]
    assert result.info["trainable"] == ["fc2.bias", "fc2.weight"]
    assert result.info["num_parameters"] == 16 * 3 + 3

    engine = Engine(result.artifacts_dir)
    frozen_before, trained_before = engine.param("fc1.weight"), engine.param("fc2.weight")
    for _ in range(3):
        engine.step(*mlp_batch(np.random.default_rng(1)))
    assert np.array_equal(engine.param("fc1.weight"), frozen_before)
    assert not np.array_equal(engine.param("fc2.weight"), trained_before)


def test_frozen_pattern_matching_nothing_is_an_error_naming_it(tmp_path):
    cfg = make_cfg(tmp_path, build_mlp(tmp_path / "mlp.onnx"), model={"frozen": ["fc1.*", "encoder.*"]})
    with pytest.raises(ConfigError, match=r"model\.frozen: pattern 'encoder\.\*' matches no float initializer"):
        configure(cfg)
    assert not (tmp_path / "run" / CONFIGURE_RECORD_NAME).exists()


def test_freezing_everything_is_an_error(tmp_path):
    cfg = make_cfg(tmp_path, build_mlp(tmp_path / "mlp.onnx"), model={"frozen": ["*"]})
    with pytest.raises(ConfigError, match="nothing to train"):
        configure(cfg)


def _mlp_with_own_loss(tmp_path: Path) -> Path:
    """The MLP with a labels input and a second output 'loss' (mean softmax cross-entropy)."""
    model = onnx.load(str(build_mlp(tmp_path / "base.onnx")))
    graph = model.graph
    graph.input.append(helper.make_tensor_value_info("y", TensorProto.INT64, ["batch"]))
    # Both outputs declared: the engine's gradient builder fails on a SoftmaxCrossEntropyLoss without log_prob.
    graph.node.append(
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss", "log_prob"], reduction="mean")
    )
    graph.output.append(helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))
    path = tmp_path / "mlp_loss.onnx"
    onnx.save(model, str(path))
    return path


def test_model_that_outputs_its_own_loss(tmp_path):
    path = _mlp_with_own_loss(tmp_path)
    result = configure(make_cfg(tmp_path, path, model={"loss": "model_output", "loss_output": "loss"}))
    assert [t["name"] for t in result.info["train_inputs"]] == ["features", "y"]
    assert result.info["label_input"] is None

    engine = Engine(result.artifacts_dir)
    batch = mlp_batch(np.random.default_rng(2))
    before = engine.eval_loss(*batch)
    for _ in range(5):
        engine.step(*batch)
    assert engine.eval_loss(*batch) < before - 0.05


def test_model_output_loss_must_be_a_scalar(tmp_path):
    path = _mlp_with_own_loss(tmp_path)
    cfg = make_cfg(tmp_path, path, model={"loss": "model_output", "loss_output": "logits"})
    with pytest.raises(ConfigError, match="must be a scalar loss"):
        configure(cfg)


def test_loss_on_a_named_output_that_is_not_first_with_a_custom_label_name(tmp_path):
    # Outputs [probs, logits]: the loss must read 'logits', the second output, and take labels named 'target_class'.
    model = onnx.load(str(build_mlp(tmp_path / "base.onnx")))
    model.graph.node.append(helper.make_node("Softmax", ["logits"], ["probs"], axis=-1))
    model.graph.output.insert(0, helper.make_tensor_value_info("probs", TensorProto.FLOAT, ["batch", 3]))
    path = tmp_path / "two_outputs.onnx"
    onnx.save(model, str(path))
    cfg = make_cfg(
        tmp_path, path, model={"loss": "cross_entropy", "loss_output": "logits", "label_input": "target_class"}
    )
    result = configure(cfg)
    assert [t["name"] for t in result.info["train_inputs"]] == ["features", "target_class"]
    assert result.info["loss_output"] == "logits"

    engine = Engine(result.artifacts_dir)
    x, y = mlp_batch(np.random.default_rng(3))
    # The loss is cross-entropy of the logits (not of the softmax output): check it against numpy.
    logits = x @ engine.param("fc1.weight") + engine.param("fc1.bias")
    logits = np.maximum(logits, 0) @ engine.param("fc2.weight") + engine.param("fc2.bias")
    log_probs = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    assert engine.eval_loss(x, y) == pytest.approx(-log_probs[np.arange(len(y)), y].mean(), rel=1e-5)


def test_mse_loss_with_a_named_target(tmp_path):
    cfg = make_cfg(tmp_path, build_mlp(tmp_path / "mlp.onnx"), model={"loss": "mse", "label_input": "wanted"})
    result = configure(cfg)
    assert result.info["train_inputs"][1] == {"name": "wanted", "dtype": "float32", "shape": ["batch", 3]}
    engine = Engine(result.artifacts_dir)
    x = np.random.default_rng(4).standard_normal((8, 8)).astype(np.float32)
    target = np.ones((8, 3), np.float32)
    before = engine.eval_loss(x, target)
    for _ in range(5):
        engine.step(x, target)
    assert engine.eval_loss(x, target) < before


def test_unknown_loss_output_is_an_error(tmp_path):
    cfg = make_cfg(tmp_path, build_mlp(tmp_path / "mlp.onnx"), model={"loss_output": "scores"})
    with pytest.raises(ConfigError, match=r"model\.loss_output: 'scores' is not a model output"):
        configure(cfg)


def test_configure_json_records_the_inputs_in_engine_order(tmp_path):
    path = build_gpt(tmp_path / "gpt.onnx", seq_len=SEQ_LEN, d_model=32, num_layers=1, num_heads=2)
    result = configure(make_cfg(tmp_path, path))
    record = json.loads((result.run_dir / CONFIGURE_RECORD_NAME).read_text())
    assert record == result.info
    assert record["train_inputs"] == [
        {"name": "input_ids", "dtype": "int64", "shape": ["batch", SEQ_LEN]},
        {"name": "labels", "dtype": "int64", "shape": ["tokens"]},
    ]
    assert record["eval_inputs"] == record["train_inputs"]
    assert record["model_inputs"] == [record["train_inputs"][0]]
    assert record["model_outputs"] == [{"name": "logits", "dtype": "float32", "shape": ["tokens", 256]}]
    assert record["loss"] == "cross_entropy" and record["label_input"] == "labels"
    params = inspect_model(path).float_initializers
    assert record["trainable"] == sorted(t.name for t in params) and record["frozen"] == []
    assert record["num_parameters"] == sum(int(np.prod(t.shape)) for t in params)
    assert len(record["fingerprint"]) == 64 and record["ort_version"] == "1.19.2"
    # The order the data stage will feed is the order the engine's Module expects.
    assert [t["name"] for t in record["train_inputs"]] == Engine(result.artifacts_dir).module.input_names()


def test_external_data_outside_the_model_folder_is_refused(tmp_path):
    model = onnx.load(str(build_mlp(tmp_path / "base.onnx")))
    weight = next(t for t in model.graph.initializer if t.name == "fc1.weight")
    raw = numpy_helper.to_array(weight).tobytes()
    (tmp_path / "stolen.bin").write_bytes(raw)
    weight.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(weight), weight.name))  # as raw_data
    onnx.external_data_helper.set_external_data(weight, location="../stolen.bin", offset=0, length=len(raw))
    weight.data_location = TensorProto.EXTERNAL
    weight.ClearField("raw_data")
    (tmp_path / "model").mkdir()
    onnx.save(model, str(tmp_path / "model" / "m.onnx"))

    with pytest.raises(ConfigError, match="outside the model's folder"):
        configure(make_cfg(tmp_path, tmp_path / "model" / "m.onnx"))
    assert not (tmp_path / "run" / "artifacts").exists()


def test_external_data_inside_the_folder_is_fingerprinted(tmp_path):
    model = onnx.load(str(build_mlp(tmp_path / "base.onnx")))
    path = tmp_path / "model" / "m.onnx"
    path.parent.mkdir()
    onnx.save(model, str(path), save_as_external_data=True, location="m.data", size_threshold=0)
    cfg = make_cfg(tmp_path, path)
    first = configure(cfg)
    data = (path.parent / "m.data").read_bytes()
    (path.parent / "m.data").write_bytes(bytes([data[0] ^ 0xFF]) + data[1:])  # change a weight, not the .onnx file
    second = configure(cfg)
    assert not second.reused and second.info["fingerprint"] != first.info["fingerprint"]


def test_opset_22_model_is_refused_with_the_re_export_hint(tmp_path):
    model = onnx.load(str(build_mlp(tmp_path / "base.onnx")))
    model.opset_import[0].version = 22
    model.ir_version = 10
    onnx.save(model, str(tmp_path / "new.onnx"))
    with pytest.raises(ConfigError, match=r"opset 22 is newer than the engine runs .*re-export with opset_version=21"):
        configure(make_cfg(tmp_path, tmp_path / "new.onnx"))


def test_missing_model_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        configure(make_cfg(tmp_path, tmp_path / "nope.onnx"))


def test_a_failed_reconfigure_keeps_the_previous_artifacts_and_record(tmp_path):
    model = build_mlp(tmp_path / "mlp.onnx")
    first = configure(make_cfg(tmp_path, model))
    stamps = mtimes(first.artifacts_dir)
    with pytest.raises(ConfigError):
        configure(make_cfg(tmp_path, model, model={"frozen": ["nothing*"]}))
    again = configure(make_cfg(tmp_path, model))
    assert again.reused and mtimes(again.artifacts_dir) == stamps


def test_cli_configure_reports_reuse_and_errors_without_traceback(tmp_path):
    from typer.testing import CliRunner

    from ortflow.cli import app

    build_mlp(tmp_path / "mlp.onnx")
    config = tmp_path / "config.yaml"
    config.write_text(
        "output_dir: run\nmodel: {path: mlp.onnx}\ndata: {train: train.parquet}\n"
        "train: {batch_size: 4, num_train_steps: 2}\n"
    )
    runner = CliRunner()
    first = runner.invoke(app, ["configure", str(config)])
    assert first.exit_code == 0, first.output
    assert "built artifacts" in first.output and "195 trainable parameters" in first.output
    assert str(tmp_path / "run") in first.output.replace("\n", "")
    second = runner.invoke(app, ["configure", str(config)])
    assert "unchanged, reused" in second.output
    bad = runner.invoke(app, ["configure", str(config), "--set", "model.loss_output=nope"])
    assert bad.exit_code == 1
    assert "model.loss_output: 'nope' is not a model output" in bad.output
    assert "Traceback" not in bad.output


def test_cross_entropy_on_a_1d_output_is_refused_with_the_loss_to_use(tmp_path):
    # [B, T, V] logits are flattened by the preparation pass (tests/graph/); one score per row cannot be classes.
    model = onnx.load(str(build_mlp(tmp_path / "base.onnx")))
    model.graph.node.append(helper.make_node("ReduceSum", ["logits", "axes"], ["score"], keepdims=0))
    model.graph.initializer.append(numpy_helper.from_array(np.array([1], np.int64), "axes"))
    model.graph.output.insert(0, helper.make_tensor_value_info("score", TensorProto.FLOAT, ["batch"]))
    onnx.save(model, str(tmp_path / "m1.onnx"))
    with pytest.raises(ConfigError, match=r"cross_entropy needs class scores .*use model.loss bce_with_logits"):
        configure(make_cfg(tmp_path, tmp_path / "m1.onnx"))


def test_mixed_precision_is_in_the_artifacts_fingerprint(tmp_path):
    """The autocast pass and the loss-scale input are in the artifacts: switching precision must rebuild them."""
    from ortflow.configure.configure import fingerprint

    path = build_mlp(tmp_path / "m.onnx")

    def cfg(**precision):
        return config_from_dict({"name": "t", "output_dir": str(tmp_path / "run"), "model": {"path": str(path)},
                                 "data": {"train": str(tmp_path / "train.parquet")},
                                 "train": {"batch_size": 4, "num_train_steps": 2},
                                 "distributed": {"device": "cuda", "use_nccl": True},
                                 "precision": precision})  # fmt: skip

    prints = {fingerprint(cfg()), fingerprint(cfg(use_mixed_precision=True)),
              fingerprint(cfg(use_mixed_precision=True, use_bfloat16=True))}
    assert len(prints) == 3
    assert fingerprint(cfg()) == fingerprint(cfg(use_mixed_precision=False))  # fp32 runs keep their fingerprint


def test_building_graphs_leaves_the_root_loggers_handlers_as_they_were():
    # The engine's ORT-format tools call logging.basicConfig on import: in a fresh process that would give the root
    # logger a stderr handler (records printed twice; `ortflow run`'s terminal then misses Prefect's console handler).
    import subprocess
    import sys

    code = ("import logging; from ortflow import engine; engine.artifacts; engine.onnxblock; "
            "print(len(logging.getLogger().handlers))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "0", out.stdout + out.stderr
