"""A resume that takes another number of samples per update than its checkpoint's run says so (the multi-rank case
under mpiexec: test_zero_mpi.py, a 2-rank checkpoint resumed on 1 and 3 ranks)."""

from __future__ import annotations

import logging

from ortflow.config.model_data import TrainConfig
from ortflow.trainer.loop import SAMPLES_KEY, note_batch_change


def _warnings(caplog, meta: dict, samples: int, train: TrainConfig) -> list[str]:
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ortflow.trainer"):
        note_batch_change(meta, "step-00000004", samples, 1, 2, train)
    return [r.getMessage() for r in caplog.records]


def test_another_batch_on_resume_is_named_with_the_fix_only_where_the_global_batch_is_unset(caplog):
    per_rank = TrainConfig(batch_size=4, num_train_steps=10)
    assert _warnings(caplog, {SAMPLES_KEY: 8}, 8, per_rank) == []
    assert _warnings(caplog, {}, 4, per_rank) == []  # a checkpoint that does not record it: nothing to compare
    assert _warnings(caplog, {SAMPLES_KEY: 16}, 8, per_rank) == [
        "step-00000004 was trained with 16 samples per weight update; this run takes 8 (1 replica(s) x "
        "train.batch_size 4 x 2 micro-batch(es)): set train.global_batch_size: 16 to keep 16 on any layout"]
    fixed = TrainConfig(batch_size=4, global_batch_size=8, num_train_steps=10)
    assert _warnings(caplog, {SAMPLES_KEY: 16}, 8, fixed) == [
        "step-00000004 was trained with 16 samples per weight update; this run takes 8 (train.global_batch_size)"]


def test_micro_batches_per_rank_count_on_from_the_resumed_checkpoint_with_this_runs_accumulation():
    """torch's BatchNorm ``num_batches_tracked`` (``ortflow export --state-dict``): a fresh run counts its updates'
    micro-batches; a resume adds its own to the checkpoint's count, recorded or (an older meta.json) derived from the
    micro-batches per update its run was configured with."""
    from pathlib import Path
    from types import SimpleNamespace

    from ortflow.checkpoints import CheckpointInfo
    from ortflow.trainer.loop import micro_batches_per_rank

    def model(resume, k):
        return SimpleNamespace(cfg=SimpleNamespace(train=SimpleNamespace(gradient_accumulation_steps=k)),
                               resume=resume)

    assert micro_batches_per_rank(model(None, 3), 4) == 12
    recorded = CheckpointInfo(Path("step-00000004"), 4, {"micro_batches_per_rank": 12})
    assert micro_batches_per_rank(model(recorded, 2), 6) == 16  # 12, then 2 updates of 2
    older = CheckpointInfo(Path("step-00000004"), 4, {"num_train_steps": 30, "num_weight_updates": 10})
    assert micro_batches_per_rank(model(older, 1), 5) == 13  # 4 updates of 3, then 1 of 1
