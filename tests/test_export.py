"""Export: an inference model from a checkpoint and the eval model, verified, with no training operators."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest

from ortflow.checkpoints import PARAMS_FILE, CheckpointError, CheckpointManager
from ortflow.checkpoints.h5state import TrainState, read_params, write_state
from ortflow.config import config_from_dict
from ortflow.configure.configure import configure
from ortflow.dataprep import prepare_data
from ortflow.examples.mlp import build_mlp
from ortflow.export import ExportError, VerificationError, export_model
from ortflow.export.model import TRAINING_DOMAINS, training_ops
from ortflow.export.verify import NUM_BATCHES, verify_against
from ortflow.trainer.optim import build_update, whole_segments

EVAL_LOSSES = {1: 0.9, 2: 0.4, 3: 0.6}  # step 2 is the best: export's default


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A configured run with prepared data and three checkpoints made by the engine (steps 1-3)."""
    from ortflow.engine import api

    root = tmp_path_factory.mktemp("export")
    build_mlp(root / "mlp.onnx", num_features=8, hidden=16, num_classes=3, seed=0)
    rng = np.random.default_rng(0)
    np.savez(root / "train.npz", features=rng.standard_normal((48, 8)).astype(np.float32),
             labels=rng.integers(0, 3, 48).astype(np.int64))
    cfg = config_from_dict({
        "output_dir": str(root / "run"),
        "model": {"path": str(root / "mlp.onnx")},
        "data": {"train": [str(root / "train.npz")], "eval_fraction": 0.25},
        "train": {"batch_size": 4, "num_train_steps": 3},
        "checkpoint": {"period": 1, "max_num_checkpoints": 5},
    })
    configure(cfg)
    prepare_data(cfg)
    art = cfg.artifacts_dir
    state = api.CheckpointState.load_checkpoint(str(art / "checkpoint"))
    module = api.Module(str(art / "training_model.onnx"), state, str(art / "eval_model.onnx"))
    names = sorted(n for n, p in state.parameters if p.requires_grad)
    params = [state.parameters[n].data.reshape(-1) for n in names]
    update = build_update(cfg.optimizer, whole_segments(names, [p.size for p in params]), params)
    train_state = TrainState(lambda: {n: np.array(p.data) for n, p in state.parameters}, names, update, "adamw/torch")
    manager = CheckpointManager(cfg.checkpoints_dir, 1, 5, is_writer=True, writer=write_state)
    module.train()
    for step, loss in EVAL_LOSSES.items():
        x = rng.standard_normal((8, 8)).astype(np.float32)
        module(x, rng.integers(0, 3, 8).astype(np.int64))
        update.step([state.parameters[n].grad.reshape(-1) for n in names], 0.05)
        module.lazy_reset_grad()
        manager.maybe_save(step, train_state, {"eval_loss": loss, "config_fingerprint": cfg.section_fingerprint()})
    return cfg


def checkpoint_state(cfg, step: int):
    """The engine's state holding a checkpoint's parameters (the artifacts' state, values from params.h5)."""
    from ortflow.engine import api

    state = api.CheckpointState.load_checkpoint(str(cfg.artifacts_dir / "checkpoint"))
    for name, value in read_params(cfg.checkpoints_dir / f"step-{step:08d}").items():
        state.parameters[name].data[...] = value  # the CPU state's buffers are writable views
    return state


def features(n: int = 5, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 8)).astype(np.float32)


def engine_export(cfg, step: int, out: Path) -> Path:
    """The engine's own export (needs the training model and a training session): an independent reference."""
    from ortflow.engine import api

    art = cfg.artifacts_dir
    state = checkpoint_state(cfg, step)
    module = api.Module(str(art / "training_model.onnx"), state, str(art / "eval_model.onnx"))
    module.export_model_for_inferencing(str(out), ["logits"])
    return out


def engine_eval_loss(cfg, step: int) -> float:
    """Mean eval loss of a checkpoint over the eval batches export uses, by the engine's eval graph."""
    from ortflow.dataprep.loader import EvalLoader
    from ortflow.engine import api

    art = cfg.artifacts_dir
    state = checkpoint_state(cfg, step)
    module = api.Module(str(art / "training_model.onnx"), state, str(art / "eval_model.onnx"))
    module.eval()
    batches = [f for f, _ in EvalLoader(cfg.data_dir, 4, 0, 1).batches(NUM_BATCHES)]
    losses = [float(module(f["features"], f["labels"])) for f in batches]
    return float(np.average(losses, weights=[len(f["labels"]) for f in batches]))


def run_plain(model: Path, x: np.ndarray) -> np.ndarray:
    import onnxruntime

    session = onnxruntime.InferenceSession(str(model), providers=["CPUExecutionProvider"])
    return session.run(["logits"], {"features": x})[0]


def test_export_from_run_picks_best_has_no_training_ops_and_records_metadata(run, tmp_path):
    result = export_model(run.output_dir, tmp_path / "model.onnx")
    assert result.step == 2 and result.eval_loss == 0.4
    assert result.inputs == ("features",) and result.outputs == ("logits",)
    assert result.verification.data.startswith("eval split")
    assert result.verification.max_abs_diff["logits"] <= 1e-4 and result.verification.num_rows > 0

    model = onnx.load(str(tmp_path / "model.onnx"))
    assert training_ops(model) == []
    assert {n.domain for n in model.graph.node} <= {""}
    assert not TRAINING_DOMAINS & {o.domain for o in model.opset_import}
    assert [n.op_type for n in model.graph.node] == ["MatMul", "Add", "Relu", "MatMul", "Add"]
    assert [i.name for i in model.graph.input] == ["features"]  # no labels, no parameters as inputs
    meta = {p.key: p.value for p in model.metadata_props}
    assert meta["step"] == "2" and float(meta["eval_loss"]) == 0.4
    assert meta["config_fingerprint"] == run.section_fingerprint() and meta["ortflow_version"] == "0.1.0"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.onnx", "model.onnx.sha256"]  # no temp files left


def test_exported_model_runs_in_a_fresh_interpreter_without_the_training_api(run, tmp_path):
    model = export_model(run.output_dir, tmp_path / "model.onnx").path
    x = features()
    np.save(tmp_path / "x.npy", x)
    script = textwrap.dedent(f"""
        import sys
        class BlockTraining:  # onnxruntime's __init__ tries to import its training package: refuse it
            def find_spec(self, name, path=None, target=None):
                if name == "onnxruntime.training" or name.startswith("onnxruntime.training."):
                    raise ImportError("blocked " + name)
        sys.meta_path.insert(0, BlockTraining())
        import numpy as np, onnxruntime
        session = onnxruntime.InferenceSession({str(model)!r}, providers=["CPUExecutionProvider"])
        out = session.run(["logits"], {{"features": np.load({str(tmp_path / "x.npy")!r})}})[0]
        np.save({str(tmp_path / "y.npy")!r}, out)
        leaked = sorted(m for m in sys.modules if m.startswith(("onnxruntime.training", "ortflow", "torch")))
        print("LEAKED", leaked)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "LEAKED []" in done.stdout
    fresh = np.load(tmp_path / "y.npy")
    # The engine's own export of the same checkpoint (a training session) agrees with ours.
    reference = run_plain(engine_export(run, 2, tmp_path / "engine.onnx"), x)
    np.testing.assert_allclose(fresh, reference, rtol=0, atol=1e-6)
    # And it is not the untrained model: the checkpoint's parameters were used.
    untrained = run_plain(build_mlp(tmp_path / "untrained.onnx", seed=0), x)
    assert np.abs(fresh - untrained).max() > 1e-3


def test_export_from_a_checkpoint_folder_copied_elsewhere_and_its_eval_model_checked(run, tmp_path):
    alone = tmp_path / "copied" / "step-00000003"
    shutil.copytree(run.checkpoints_dir / "step-00000003", alone)
    shutil.copy(run.artifacts_dir / "eval_model.onnx", alone / "eval_model.onnx")
    result = export_model(alone, tmp_path / "from_copy.onnx")
    assert result.step == 3 and result.outputs == ("logits",)  # outputs found from the eval graph's loss input
    assert result.verification.data.startswith("random inputs")
    x = features(seed=3)
    expected = run_plain(engine_export(run, 3, tmp_path / "engine3.onnx"), x)
    np.testing.assert_allclose(run_plain(result.path, x), expected, rtol=0, atol=1e-6)

    bare = tmp_path / "bare" / "step-00000003"
    shutil.copytree(run.checkpoints_dir / "step-00000003", bare)
    with pytest.raises(ExportError, match="no eval model.*--eval-model"):
        export_model(bare, tmp_path / "nope.onnx")
    assert export_model(bare, tmp_path / "given.onnx", eval_model=alone / "eval_model.onnx").step == 3
    # A truncated copy of the eval model (no digest records it outside the run) is named, not a protobuf traceback.
    data = (alone / "eval_model.onnx").read_bytes()
    (alone / "eval_model.onnx").write_bytes(data[: len(data) // 2])
    with pytest.raises(ExportError, match=r"eval_model.onnx is not a valid ONNX model .*copy the run's"):
        export_model(alone, tmp_path / "truncated.onnx")


def test_corrupted_checkpoint_is_refused_with_a_clear_message(run, tmp_path):
    broken = tmp_path / "step-00000002"
    shutil.copytree(run.checkpoints_dir / "step-00000002", broken)
    data = bytearray((broken / PARAMS_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (broken / PARAMS_FILE).write_bytes(bytes(data))
    out = tmp_path / "model.onnx"
    with pytest.raises(CheckpointError, match=r"step-00000002/params.h5: checksum mismatch"):
        export_model(broken, out, eval_model=run.artifacts_dir / "eval_model.onnx")
    assert not out.exists()


def test_a_failed_export_leaves_the_previous_model_in_place(run, tmp_path):
    out = tmp_path / "model.onnx"
    out.write_bytes(b"previous")
    loss_name = onnx.load(str(run.artifacts_dir / "eval_model.onnx")).graph.output[0].name
    with pytest.raises(ExportError, match="belongs to the loss"):
        export_model(run.output_dir, out, outputs=[loss_name])
    with pytest.raises(ExportError, match="'nope' is not a tensor"):
        export_model(run.output_dir, out, outputs=["nope"])
    assert out.read_bytes() == b"previous" and [p.name for p in tmp_path.iterdir()] == ["model.onnx"]


def test_verification_fails_beyond_the_tolerance(run, tmp_path):
    model = export_model(run.output_dir, tmp_path / "model.onnx").path
    x = features()
    good = {"logits": run_plain(model, x)}
    assert verify_against(model, [{"features": x}], [good], 1e-6, "test").max_abs_diff["logits"] == 0.0
    off = {"logits": good["logits"] + np.float32(1e-3)}
    with pytest.raises(VerificationError, match=r"differ from the eval graph by \{'logits'"):
        verify_against(model, [{"features": x}], [off], 1e-4, "test")


def test_optimize_and_quantize_report_the_accuracy_change(run, tmp_path):
    result = export_model(run.output_dir, tmp_path / "q.onnx", optimize=True, quantize=True)
    assert result.optimized and result.verification.max_abs_diff["logits"] <= 1e-4
    q = result.quantization
    assert q is not None and q.data.startswith("eval split")
    assert 0 < q.max_abs_diff["logits"] < 1.0 and 0 < q.mean_abs_diff["logits"] <= q.max_abs_diff["logits"]
    assert 0.0 <= q.argmax_agreement["logits"] <= 1.0
    assert q.loss_fp32 is not None and q.loss_int8 is not None and abs(q.loss_int8 - q.loss_fp32) < 0.5
    assert q.loss_fp32 == pytest.approx(engine_eval_loss(run, 2), rel=1e-5)  # the reported loss is the eval loss
    model = onnx.load(str(result.path))
    assert {"DynamicQuantizeLinear", "MatMulInteger"} <= {n.op_type for n in model.graph.node}
    assert training_ops(model) == []
    assert {p.key: p.value for p in model.metadata_props}["step"] == "2"
    assert json.dumps(result.to_dict())  # the CLI prints this


def test_cli_export_and_retain(run, tmp_path):
    from typer.testing import CliRunner

    from ortflow.cli import app

    runner = CliRunner()
    out = tmp_path / "cli.onnx"
    done = runner.invoke(app, ["export", str(run.output_dir), "-o", str(out), "--outputs", "logits", "--quantize"])
    assert done.exit_code == 0, done.output
    assert "from step-00000002" in done.output and "int8:" in done.output and out.exists()
    refused = runner.invoke(app, ["export", str(run.checkpoints_dir / "step-00000001")])
    assert refused.exit_code == 1 and "-o model.onnx" in refused.output
    retained = runner.invoke(app, ["retain", str(run.output_dir / "config.yaml")])  # keeps 5: deletes nothing here
    assert retained.exit_code == 0, retained.output
    assert "keep   step 2: one of the 5 newest, best eval loss, export source" in retained.output
    assert "delete" not in retained.output
    assert (run.output_dir / "checkpoints.json").exists()


@pytest.mark.parametrize("args,problem", [
    (["-o", "model.onnx", "--state-dict", "w.safetensors"],
     "--state-dict writes the parameters instead of a model, so -o/--out would do nothing"),
    (["--state-dict", "w.safetensors", "--outputs", "logits", "--quantize"],
     "--state-dict writes the parameters instead of a model, so --outputs, --quantize would do nothing"),
    (["--strip-prefix", "model."], "--strip-prefix and --add-prefix rename the keys of a state dict: add --state-dict"),
])
def test_export_refuses_options_of_the_other_kind_of_export_instead_of_ignoring_them(tmp_path, monkeypatch, args,
                                                                                    problem):
    from typer.testing import CliRunner

    from ortflow.cli import app

    monkeypatch.chdir(tmp_path)  # where the files named above would go
    result = CliRunner().invoke(app, ["export", str(tmp_path), *args])
    assert result.exit_code == 1 and problem in " ".join(result.output.split()), result.output
    assert not list(tmp_path.iterdir())  # nothing written
