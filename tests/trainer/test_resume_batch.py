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
