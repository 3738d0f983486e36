"""configure with distributed.pipeline_parallel_size > 1: each stage's artifacts, built once, or a clear refusal."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from ortflow.artifacts_folder import ARTIFACT_FILES, read_stages_record, stage_dir
from ortflow.config import ConfigError, config_from_dict
from ortflow.configure.configure import configure, plan_layout
from ortflow.engine import api
from tests.support.exports import export_path
from tests.support.mlp_stack import B, T, V, build_torchlike


def pipeline_cfg(tmp_path, model_path, cuts=()):
    return config_from_dict({
        "name": "t", "output_dir": str(tmp_path / "run"),
        "model": {"path": str(model_path), "pipeline_cuts": list(cuts)},
        "data": {"train": str(tmp_path / "train.parquet")},
        "train": {"batch_size": B, "num_train_steps": 2},
        "distributed": {"num_ranks": 2, "pipeline_parallel_size": 2},
    })


def test_each_stage_gets_its_artifacts_once(tmp_path):
    path = tmp_path / "m.onnx"
    build_torchlike(path, num_blocks=2)
    cfg = pipeline_cfg(tmp_path, path, ["blocks.0.resid"])
    first = configure(cfg)
    record = read_stages_record(cfg.artifacts_dir)
    assert record["cuts"] == ["blocks.0.resid"] == first.info["pipeline_cuts"]
    for index in (0, 1):
        assert all((stage_dir(cfg.artifacts_dir, index) / f).exists() for f in ARTIFACT_FILES)
        assert not list(stage_dir(cfg.artifacts_dir, index).glob("optimizer*"))  # ortflow updates: no engine graph
    # configure.json's checksums cover the stages' files too (rank 0 verifies them before training).
    digests = json.loads((cfg.output_dir / "configure.json").read_text())["artifact_sha256"]
    assert {"stages/stage-00/training_model.onnx", "stages/stage-01/checkpoint"} <= set(digests)
    assert configure(cfg).reused
    # Stage 1's training call returns the loss and the gradient of what it received, right after the loss.
    folder = stage_dir(cfg.artifacts_dir, 1)
    outputs = [o.name for o in onnx.load(str(folder / "training_model.onnx")).graph.output]
    assert outputs[1] == "blocks.0.resid.backprop"
    state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    module = api.Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"))
    rng = np.random.default_rng(0)
    # Stage 1 also reads the batch's input_ids: its shape arithmetic is read from the inputs (graph/shapes.py).
    feeds = {"blocks.0.resid": rng.standard_normal((B, T, 16)).astype(np.float32),
             "input_ids": rng.integers(0, V, (B, T)), "labels": rng.integers(0, V, B * T)}
    loss, grad = module(*(feeds[n] for n in module.input_names()))
    assert np.isfinite(loss) and grad.shape == (B, T, 16) and np.abs(grad).sum() > 0
    # The received tensor is no parameter: the checkpoint holds only the stage's own weights.
    assert "blocks.0.resid" not in {name for name, _ in state.parameters}


def test_a_bad_cut_fails_configure_before_any_build(tmp_path):
    # An int64 tensor computed from trained values (ArgMax in block 0, read after block 1) cannot cross a cut; the
    # shape arithmetic of every block (Shape of an activation) is read from the inputs and crosses nothing.
    path = tmp_path / "m.onnx"
    build_torchlike(path, routed=True)
    with pytest.raises(ConfigError, match=r"pipeline_parallel_size 2: cut 1 is crossed by non-float tensors.*"
                                          r"'blocks.0.top' \(made by ArgMax"):
        configure(pipeline_cfg(tmp_path, path, ["blocks.0.resid"]))
    assert not (tmp_path / "run" / "artifacts").exists()  # refused before the engine built anything


def test_tied_weights_are_recorded_for_both_stages(tmp_path):
    path = tmp_path / "tied.onnx"
    build_torchlike(path, tied=True)
    cfg = pipeline_cfg(tmp_path, path, ["blocks.0.resid"])
    configure(cfg)
    record = read_stages_record(cfg.artifacts_dir)
    assert [s["shared"] for s in record["stages"]] == [{"wte": [0, 1]}, {"wte": [0, 1]}]


def test_tied_weights_across_stages_are_recorded_on_gpus_too(tmp_path):
    path = tmp_path / "tied.onnx"
    build_torchlike(path, tied=True)
    cfg = pipeline_cfg(tmp_path, path, ["blocks.0.resid"])
    gpu = cfg.model_copy(update={"distributed": cfg.distributed.model_copy(update={"device": "cuda",
                                                                                    "use_nccl": True})})
    configure(gpu)  # GPU ranks sum the tied gradients through the host as CPU ranks do
    record = read_stages_record(gpu.artifacts_dir)
    assert [s["shared"] for s in record["stages"]] == [{"wte": [0, 1]}, {"wte": [0, 1]}]


def test_changing_the_stage_count_rebuilds(tmp_path):
    path = tmp_path / "m.onnx"
    build_torchlike(path, num_blocks=3)
    configure(pipeline_cfg(tmp_path, path))
    raw = json.loads(json.dumps(pipeline_cfg(tmp_path, path).model_dump(mode="json")))
    raw["distributed"].update(num_ranks=3, pipeline_parallel_size=3)
    cfg3 = config_from_dict(raw)
    result = configure(cfg3)
    assert not result.reused and len(read_stages_record(cfg3.artifacts_dir)["stages"]) == 3


@pytest.mark.parametrize("recompute", ["auto", False, True])
def test_the_plan_says_a_stage_with_batchnorm_recomputes_its_forward_whatever_recompute_forward_says(tmp_path,
                                                                                                  recompute):
    """The CNN export's first stage holds BatchNorm: its forward normalises by the batch only inside the training call,
    so it recomputes (tests/trainer/test_batchnorm_mpi.py trains it); the plan says so instead of 'keep'."""
    raw = pipeline_cfg(tmp_path, export_path("cnn.onnx")).model_dump(mode="json")
    raw["distributed"]["recompute_forward"] = recompute
    lines: list[str] = []
    plan_layout(config_from_dict(raw), lines)
    stages = (", except stage(s) [0], whose forward switches BatchNorm to batch statistics: they run the forward "
              "again in the backward call")
    assert lines[-1] == (
        "activations: pipeline stages but the last run the forward again in the backward call "
        "(distributed.recompute_forward true)" if recompute is True else
        "activations: pipeline stages but the last run each micro-batch's forward once and keep its activations until "
        f"its backward (distributed.recompute_forward {str(recompute).lower()}){stages}")
