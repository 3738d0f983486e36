"""HDF5 checkpoint files: round trip, resharding, corruption of any single file, format 1 conversion."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import h5py
import numpy as np
import pytest

from ortflow.checkpoints import (
    CHECKPOINT_FILE,
    META_FILE,
    CheckpointError,
    CheckpointManager,
    latest_verified,
    verify,
)
from ortflow.checkpoints.h5state import TrainState, load_optimizer, read_params, write_state
from ortflow.config import OptimizerConfig
from ortflow.trainer.optim import build_update, whole_segments
from ortflow.trainer.optim.zero import shard_segments
from tests.support.tied_lm import TRAINABLE, lm_batch
from tests.trainer.test_optim_rules import _engine_adamw_artifacts

NAMES = ("a/weight", "b.bias", "c%odd")  # ONNX names with '/' and '%'
SIZES = (30, 7, 50)


def trained(world: int, opt: OptimizerConfig, steps: int = 3):
    """Per rank (params, update) after ``steps`` updates of the same random gradients, sharded over ``world``."""
    rng = np.random.default_rng(0)
    full = [rng.standard_normal(s).astype(np.float32) for s in SIZES]
    grads = [[rng.standard_normal(s).astype(np.float32) for s in SIZES] for _ in range(steps)]
    ranks = []
    for rank in range(world):
        params = [p.copy() for p in full]
        segs = shard_segments(NAMES, SIZES, rank, world) if world > 1 else whole_segments(NAMES, SIZES)
        update = build_update(opt, segs, [params[s.index][s.lo : s.hi] for s in segs], num_tensors=len(SIZES))
        ranks.append((params, update))
    for g in grads:
        for _, update in ranks:
            update.step([g[s.index][s.lo : s.hi].copy() for s in update.segments], 0.01)
        for _, update in ranks:  # the all-gather: every rank's updated segments into every rank's parameters
            for seg, values in zip(update.segments, update.params, strict=True):
                for other, _ in ranks:
                    other[seg.index][seg.lo : seg.hi] = values
    return ranks


def save(directory: Path, ranks, step: int = 3, extra=None, optimizer: str = "adamw/torch") -> Path:
    """A checkpoint of every rank's state (the ranks' writes into one folder, done here one after the other), its
    optimizer files labelled ``optimizer``."""
    world = len(ranks)
    states = [
        TrainState(lambda p=params: dict(zip(NAMES, p, strict=True)), list(NAMES), update, optimizer,
                   rank=rank, world_size=world, sharded=world > 1, extra_state=extra)
        for rank, (params, update) in enumerate(ranks)
    ]

    def write_all(_, folder):
        for state in states:
            write_state(state, folder)

    return CheckpointManager(directory, 1, 5, is_writer=True, writer=write_all).save(step, None, {"global_cursor": 24})


def test_round_trip_parameters_by_onnx_name_and_extra_state(tmp_path):
    (params, update), = trained(1, OptimizerConfig())
    path = save(tmp_path, [(params, update)], extra=lambda: {"loss_scale": 1024.0, "good_steps": np.int64(7)})
    info = verify(path)
    assert sorted(info.meta["files"]) == ["optimizer.h5", "params.h5"]
    loaded = read_params(path)
    assert sorted(loaded) == sorted(NAMES)
    for name, p in zip(NAMES, params, strict=True):
        assert np.array_equal(loaded[name], p)
    with h5py.File(path / "params.h5", "r") as f:  # plain h5py: one dataset per parameter, the ONNX name kept
        assert {ds.attrs["name"] for ds in f["parameters"].values()} == set(NAMES)
        assert float(f["extra_state"]["loss_scale"][()]) == 1024.0


@pytest.mark.parametrize("written, read", [(1, 2), (2, 1), (2, 3), (3, 2)])
def test_optimizer_state_reshards_between_world_sizes(tmp_path, written, read):
    opt = OptimizerConfig(name="adamw")
    path = save(tmp_path, trained(written, opt))
    reference = trained(1, opt)[0][1]  # the unsharded state after the same updates
    for rank in range(read):
        segs = shard_segments(NAMES, SIZES, rank, read) if read > 1 else whole_segments(NAMES, SIZES)
        target = build_update(opt, segs, [np.zeros(s.size, np.float32) for s in segs], num_tensors=len(SIZES))
        load_optimizer(path, target, "adamw/torch")
        assert target.step_count == 3
        for i, seg in enumerate(segs):
            ref = reference.state_views(seg.index)
            for k in range(2):
                # Sharded updates are the same element-wise arithmetic: bitwise equal to the unsharded state.
                assert np.array_equal(target.state_views(i)[k], ref[k][seg.lo : seg.hi]), (seg, k)


def test_resuming_with_another_optimizer_is_refused_clearly(tmp_path):
    path = save(tmp_path, trained(1, OptimizerConfig(name="sgd", momentum=0.9)), optimizer="sgd")
    segs = whole_segments(NAMES, SIZES)
    adam = build_update(OptimizerConfig(), segs, [np.zeros(s.size, np.float32) for s in segs])
    with pytest.raises(CheckpointError, match="needs \\['exp_avg', 'exp_avg_sq'\\]") as err:
        load_optimizer(path, adam, "adamw/torch")
    # Both ways out: the optimizer that wrote it, or its weights with a fresh state in a run without checkpoints
    # (a run folder that holds checkpoints resumes them and never reads init_from).
    assert "resume with optimizer sgd" in str(err.value), err.value
    assert f"checkpoint.init_from: {path} in a new run (another output_dir" in str(err.value), err.value


@pytest.mark.parametrize("victim", ["params.h5", "optimizer-rank00000-of-00002.h5", "optimizer-rank00001-of-00002.h5",
                                    META_FILE])
@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_any_single_damaged_file_is_detected_and_the_previous_checkpoint_used(tmp_path, victim, damage):
    opt = OptimizerConfig()
    first = save(tmp_path, trained(2, opt), step=3)
    second = save(tmp_path, trained(2, opt, steps=4), step=4)
    target = second / victim
    data = bytearray(target.read_bytes())
    if damage == "flip":
        data[len(data) // 3] ^= 0x04
    else:
        data = data[: len(data) // 2]
    target.write_bytes(bytes(data))
    with pytest.raises(CheckpointError):
        verify(second)
    assert latest_verified(tmp_path).path == first
    assert (second / victim).exists()  # nothing deleted: the damaged folder stays for the user to inspect


def test_a_format_1_engine_checkpoint_resumes_bit_for_bit_with_the_engine_rule(tmp_path):
    from ortflow.engine import api

    (tmp_path / "art").mkdir()
    art = _engine_adamw_artifacts(tmp_path / "art", eps=1e-8, wd=0.05)
    state = api.CheckpointState.load_checkpoint(str(art / "checkpoint"))
    module = api.Module(str(art / "training_model.onnx"), state, str(art / "eval_model.onnx"))
    optimizer = api.Optimizer(str(art / "optimizer_model.onnx"), module)
    module.train()
    rng = np.random.default_rng(0)

    def engine_step(lr):
        optimizer.set_learning_rate(lr)
        module(*lm_batch(rng))
        grads = [np.array(state.parameters[n].grad, copy=True).reshape(-1) for n in TRAINABLE]
        optimizer.step()
        module.lazy_reset_grad()
        return grads

    for k in range(7):
        engine_step(0.05 - 0.001 * k)
    # A format 1 folder as ortflow wrote it before owning the update: the engine's file and a meta without digest.
    old = tmp_path / "ck" / "step-00000007"
    old.mkdir(parents=True)
    api.CheckpointState.save_checkpoint(state, str(old / CHECKPOINT_FILE), include_optimizer_state=True)
    digest = hashlib.sha256((old / CHECKPOINT_FILE).read_bytes()).hexdigest()
    size = (old / CHECKPOINT_FILE).stat().st_size
    meta = {"format": 1, "step": 7, "global_cursor": 56, "files": {CHECKPOINT_FILE: {"sha256": digest, "bytes": size}}}
    (old / META_FILE).write_text(json.dumps(meta))
    assert verify(old).format == 1

    values = read_params(old)
    ours = [values[n].reshape(-1).copy() for n in TRAINABLE]
    update = build_update(OptimizerConfig(rule="engine", epsilon=1e-8, weight_decay=0.05),
                          whole_segments(TRAINABLE, [p.size for p in ours]), ours)
    load_optimizer(old, update, "adamw/engine")
    assert update.step_count == 7
    for k in range(7, 15):  # the engine continues; ortflow continues from the converted state on the same gradients
        lr = 0.05 - 0.001 * k
        update.step(engine_step(lr), lr)
        for name, mine in zip(TRAINABLE, ours, strict=True):
            assert np.array_equal(mine, state.parameters[name].data.reshape(-1)), (k, name)
    shutil.rmtree(tmp_path / "art")


def test_checkpoint_cli_inspect_verify_and_merge_readable_with_plain_h5py(tmp_path):
    from typer.testing import CliRunner

    from ortflow.cli import app

    opt = OptimizerConfig()
    path = save(tmp_path / "ck", trained(2, opt))
    runner = CliRunner()
    shown = runner.invoke(app, ["checkpoint", "inspect", str(path)])
    assert shown.exit_code == 0, shown.output
    summary = json.loads(shown.stdout)
    assert summary["step"] == 3 and summary["optimizer_files"] == ["optimizer-rank00000-of-00002.h5",
                                                                   "optimizer-rank00001-of-00002.h5"]
    assert summary["parameters"] == {"a/weight": [30], "b.bias": [7], "c%odd": [50]}
    assert runner.invoke(app, ["checkpoint", "verify", str(path)]).exit_code == 0
    out = tmp_path / "merged.h5"
    merged = runner.invoke(app, ["checkpoint", "merge", str(path), "--out", str(out)])
    assert merged.exit_code == 0, merged.output
    reference = trained(1, opt)[0]
    with h5py.File(out, "r") as f:
        assert f.attrs["step"] == 3 and f.attrs["step_count"] == 3
        by_name = {ds.attrs["name"]: ds[()] for ds in f["optimizer"]["exp_avg_sq"].values()}
        params = {ds.attrs["name"]: ds[()] for ds in f["parameters"].values()}
    for i, name in enumerate(NAMES):
        assert np.array_equal(by_name[name], reference[1].state_views(i)[1])  # shards gathered whole, in order
        assert np.array_equal(params[name], reference[0][i])
    (path / "optimizer-rank00001-of-00002.h5").write_bytes(b"x")
    broken = runner.invoke(app, ["checkpoint", "verify", str(path)])
    assert broken.exit_code == 1 and "optimizer-rank00001-of-00002.h5" in broken.output
    assert "Traceback" not in broken.output
