"""Export of a mixed-precision run: fp32 by default (the autocast casts removed), or the compute type (fp16 weights).

The checkpoint is the artifacts' initial state saved through the real CheckpointManager (training needs a GPU);
export and its verification run on the CPU.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import pytest

from ortflow.checkpoints import CheckpointManager
from ortflow.checkpoints.h5state import TrainState, write_state
from ortflow.config import config_from_dict
from ortflow.configure.configure import configure
from ortflow.engine import api
from ortflow.export import export_model
from ortflow.trainer.optim import build_update, whole_segments
from tests.support.tiny_lm import build_tiny_lm, save


def _save_initial_as_checkpoint(cfg) -> None:
    """The configured weights written as checkpoint step 1 (HDF5, as the trainer writes it)."""
    state = api.CheckpointState.load_checkpoint(str(cfg.artifacts_dir / "checkpoint"))
    names = sorted(n for n, p in state.parameters if p.requires_grad)
    params = [state.parameters[n].data.reshape(-1) for n in names]
    update = build_update(cfg.optimizer, whole_segments(names, [p.size for p in params]), params)
    train_state = TrainState(lambda: {n: np.array(p.data) for n, p in state.parameters}, names, update, "adamw/torch")
    CheckpointManager(cfg.checkpoints_dir, 1, 1, is_writer=True, writer=write_state).save(1, train_state,
                                                                                            {"eval_loss": None})


@pytest.fixture(scope="module")
def mixed_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("mixed")
    original = build_tiny_lm(flatten=True, full_layer_norm=True)
    cfg = config_from_dict({
        "output_dir": str(root / "run"),
        "model": {"path": str(save(original, root / "lm.onnx")), "loss": "cross_entropy"},
        "data": {"train": [str(root / "none.npz")]},
        "train": {"batch_size": 2, "num_train_steps": 2},
        "distributed": {"device": "cuda", "use_nccl": True},
        "precision": {"use_mixed_precision": True},
    })  # fmt: skip
    configure(cfg)
    _save_initial_as_checkpoint(cfg)
    return cfg, original


def _logits(model_path, ids) -> np.ndarray:
    session = onnxruntime.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    return session.run(["logits"], {"input_ids": ids})[0]


def test_default_export_is_the_users_fp32_graph_with_the_trained_weights(mixed_run, tmp_path):
    cfg, original = mixed_run
    result = export_model(cfg.output_dir, tmp_path / "fp32.onnx", config=cfg)
    model = onnx.load(str(result.path))
    assert not [n.name for n in model.graph.node if n.name.startswith("autocast/") or n.op_type == "Cast"]
    assert {t.data_type for t in model.graph.initializer} == {onnx.TensorProto.FLOAT}
    save(original, tmp_path / "original.onnx")
    ids = np.random.default_rng(3).integers(0, 32, (2, 8))
    assert np.array_equal(_logits(result.path, ids), _logits(tmp_path / "original.onnx", ids))  # same weights
    assert result.verification.max_abs_diff["logits"] <= 1e-4


def test_compute_export_stores_fp16_weights_and_follows_the_fp32_model(mixed_run, tmp_path):
    cfg, original = mixed_run
    result = export_model(cfg.output_dir, tmp_path / "fp16.onnx", config=cfg, precision="compute")
    model = onnx.load(str(result.path))
    kinds = {t.name: t.data_type for t in model.graph.initializer}
    assert kinds["attn.q.weight__fp16"] == onnx.TensorProto.FLOAT16 and "attn.q.weight" not in kinds
    assert model.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.INT64
    assert model.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    save(original, tmp_path / "original.onnx")
    ids = np.random.default_rng(3).integers(0, 32, (2, 8))
    reference = _logits(tmp_path / "original.onnx", ids)
    # fp16 rounding (4.9e-4 relative per op) through one block: 5e-3 of the largest logit.
    np.testing.assert_allclose(_logits(result.path, ids), reference, atol=5e-3 * float(np.abs(reference).max()))
    # Verified against the eval graph in the same precision, to 4 fp16 units in the last place of the largest logit.
    largest = float(np.abs(reference).max())
    assert 1e-4 < result.verification.tolerance <= 4 * 2**-10 * 2 * largest
    assert result.verification.max_abs_diff["logits"] <= result.verification.tolerance


def test_a_bf16_compute_export_is_refused_with_the_reason(tmp_path):
    from ortflow.export.verify import ExportError

    cfg = config_from_dict({
        "output_dir": str(tmp_path / "run"),
        "model": {"path": str(save(build_tiny_lm(flatten=True, full_layer_norm=True), tmp_path / "lm.onnx"))},
        "data": {"train": [str(tmp_path / "none.npz")]}, "train": {"batch_size": 2, "num_train_steps": 2},
        "distributed": {"device": "cuda", "use_nccl": True},
        "precision": {"use_mixed_precision": True, "use_bfloat16": True}, "export": {"precision": "compute"},
    })  # fmt: skip
    configure(cfg)
    _save_initial_as_checkpoint(cfg)
    with pytest.raises(ExportError, match="no bf16 kernels.*export fp32"):
        export_model(cfg.output_dir, tmp_path / "bf16.onnx", config=cfg)
    assert not (tmp_path / "bf16.onnx").exists()
