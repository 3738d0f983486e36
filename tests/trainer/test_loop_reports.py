"""What the loop reports at each step, as docs/training.md states it: the rate of that update, the gradient norm before
clipping, the samples of every replica per second of training time, and which checkpoints record an eval loss (in
process)."""

from __future__ import annotations

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ortflow.checkpoints import CheckpointManager, list_complete
from ortflow.checkpoints.h5state import write_state
from ortflow.dataprep.loader import EvalLoader, TrainLoader
from ortflow.trainer.comm import SingleProcessComm
from ortflow.trainer.loop import StopFlag, train
from ortflow.trainer.metrics import Progress, TensorBoardLog, read_progress
from ortflow.trainer.runtime import init_runtime
from tests.support.runs import make_run


def test_step_n_reports_update_n_rate_the_unclipped_norm_and_samples_per_training_second(tmp_path):
    max_norm = 1e-4  # far below any norm of this model: every update is clipped
    cfg = make_run(tmp_path, "reports", train={"num_train_steps": 12, "gradient_accumulation_steps": 2},
                   optimizer={"learning_rate": 0.01, "max_grad_norm": max_norm},
                   lr_schedule={"name": "linear", "warmup_steps": 2}, checkpoint={"period": 0})
    rt = init_runtime(cfg.output_dir, cfg, SingleProcessComm())
    loader = TrainLoader(cfg.data_dir, cfg.train.batch_size, 0, 1, prefetch=0)
    tensorboard = TensorBoardLog(cfg.tensorboard_dir, cfg.tensorboard.scalar_names, ())
    manager = CheckpointManager(cfg.checkpoints_dir, 0, 1, is_writer=True, writer=write_state)
    no_eval = EvalLoader(cfg.data_dir, 4, 0, 1, max_rows=0)
    train(rt, loader.iter_from, no_eval, manager, tensorboard, Progress(cfg.output_dir, 6, 0), StopFlag())
    tensorboard.close()
    events = EventAccumulator(str(cfg.tensorboard_dir))
    events.Reload()

    # T = 12 micro-batches / 2 = 6 updates, W = 2: step N is update s = N - 1, f(s) = s / W, then 1 - (s - W) / (T - W)
    rates = events.Scalars("train/learning_rate")
    assert [e.step for e in rates] == [1, 2, 3, 4, 5, 6]
    assert [e.value for e in rates] == pytest.approx([0.0, 0.005, 0.01, 0.0075, 0.005, 0.0025], rel=1e-6)
    assert read_progress(cfg.output_dir)["lr"] == pytest.approx(0.0025)

    tags = events.Tags()["scalars"]  # fp32 and no text: no loss scale, no tokens
    assert "train/loss_scale" not in tags and "train/skipped_updates" not in tags and "train/tokens_per_s" not in tags

    norms = [e.value for e in events.Scalars("train/grad_norm")]
    assert len(norms) == 6 and min(norms) > 100 * max_norm  # the norm before clipping, as clip_grad_norm_ returns

    # One update per display window: 4 samples x 2 micro-batches x 1 replica over the window's seconds without the
    # eval and checkpoint phases (timing.json keeps each window's seconds per phase).
    windows = json.loads((cfg.output_dir / "timing.json").read_text())["windows"]
    throughput = [e.value for e in events.Scalars("train/samples_per_s")]
    assert len(windows) == len(throughput) == 6
    for rate, window in zip(throughput, windows, strict=True):
        training_s = sum(window.values()) - window["eval"] - window["checkpoint"]
        assert rate * training_s == pytest.approx(8, rel=1e-5)


def test_a_checkpoint_records_an_eval_loss_only_at_an_evaluation_step(tmp_path):
    cfg = make_run(tmp_path, "periods", train={"num_train_steps": 6, "evaluation_period": 2},
                   checkpoint={"period": 3, "max_num_checkpoints": 3})
    rt = init_runtime(cfg.output_dir, cfg, SingleProcessComm())
    loader = TrainLoader(cfg.data_dir, cfg.train.batch_size, 0, 1, prefetch=0)
    manager = CheckpointManager(cfg.checkpoints_dir, 3, 3, is_writer=True, writer=write_state)
    evals = EvalLoader(cfg.data_dir, 4, 0, 1)
    train(rt, loader.iter_from, evals, manager, None, Progress(cfg.output_dir, 6, 0), StopFlag())
    metas = {c.step: c.meta for c in list_complete(cfg.checkpoints_dir)}
    assert sorted(metas) == [3, 6]
    assert metas[3]["eval_loss"] is None  # update 3 is no evaluation step: no candidate for the best checkpoint
    assert metas[6]["eval_loss"] is not None and metas[6]["eval_loss"] > 0  # the final one always evaluates
