"""The loop with loss scaling on: an overflowing update is skipped and counted, the state reaches the checkpoint,
TensorBoard and the progress line (on the CPU, in process; the fp16 graphs themselves need a GPU: tests/gpu)."""

from __future__ import annotations

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from ortflow.checkpoints import CheckpointManager, list_complete
from ortflow.checkpoints.h5state import write_state
from ortflow.dataprep.loader import EvalLoader, TrainLoader
from ortflow.trainer.comm import SingleProcessComm
from ortflow.trainer.loop import StopFlag, train
from ortflow.trainer.loss_scale import LossScaler
from ortflow.trainer.metrics import Progress, TensorBoardLog, read_progress
from ortflow.trainer.runtime import init_runtime
from tests.support.runs import make_run


def test_a_non_finite_gradient_skips_exactly_that_update_and_is_reported(tmp_path):
    cfg = make_run(tmp_path, "scaled", train={"num_train_steps": 8}, checkpoint={"period": 1, "max_num_checkpoints": 8})
    rt = init_runtime(cfg.output_dir, cfg, SingleProcessComm())
    # The fp32 graph has no scale input, so the scale stays 1 (exact math); the loop's scaling path is what is tested.
    rt.loss_scale = LossScaler(enabled=True, scale=1.0, dynamic=True, growth_interval=1000)
    loader = TrainLoader(cfg.data_dir, cfg.train.batch_size, 0, 1, prefetch=0)

    def batches(cursor):
        for k, feeds in enumerate(loader.iter_from(cursor)):
            yield {**feeds, "features": feeds["features"] * 1e38} if k == 4 else feeds  # update 5 overflows

    tensorboard = TensorBoardLog(cfg.tensorboard_dir, cfg.tensorboard.scalar_names, ())
    manager = CheckpointManager(cfg.checkpoints_dir, 1, 8, is_writer=True, writer=write_state)
    no_eval = EvalLoader(cfg.data_dir, 4, 0, 1, max_rows=0)
    result = train(rt, batches, no_eval, manager, tensorboard, Progress(cfg.output_dir, 8, 0), StopFlag())
    tensorboard.close()
    assert result.step == 8 and rt.loss_scale.skipped_updates == 1
    digests = {c.step: c.meta["params_sha256"] for c in list_complete(cfg.checkpoints_dir)}
    assert digests[5] == digests[4]  # no step at update 5
    assert len({digests[s] for s in (1, 2, 3, 4, 6, 7, 8)}) == 7  # every other update stepped
    metas = {c.step: c.meta["loss_scale"] for c in list_complete(cfg.checkpoints_dir)}
    assert metas[4]["skipped_updates"] == 0 and metas[5]["skipped_updates"] == 1 and metas[8]["clean_updates"] == 3
    events = EventAccumulator(str(cfg.tensorboard_dir))
    events.Reload()
    assert [e.value for e in events.Scalars("train/skipped_updates")] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [e.value for e in events.Scalars("train/loss_scale")] == [1.0] * 8
    assert read_progress(cfg.output_dir)["skipped_updates"] == 1
