"""The ranks' side of ``ortflow tune``: time a few weight updates of this layout and print the job's samples/s.

Started by :func:`ortflow.launch.tune.tune` as ``python -m ortflow.trainer.tune_updates RUN_DIR`` under mpiexec,
once per candidate layout. Each rank builds the rank model training would (a replica, a pipeline stage, tensor-parallel
pieces or a stage's pieces) and runs the training loop's own weight update (:func:`ortflow.trainer.loop.update_weights`)
on real batches. Weights change in memory only; nothing is written.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

from ortflow.protocol import TUNE_RESULT_TAG
from ortflow.trainer import batchnorm
from ortflow.trainer.loop import update_weights
from ortflow.trainer.lr_schedule import learning_rate
from ortflow.trainer.profiling import StepProfiler
from ortflow.trainer.timing import PhaseTimer


def measure(run_dir: Path, updates: int, warmup: int) -> dict | None:
    """On each rank: time ``warmup + updates`` weight updates; rank 0 returns the job's samples/s (slowest rank)."""
    from ortflow.dataprep.loader import TrainLoader
    from ortflow.trainer.runtime import init_runtime, start_mpi

    cfg, comm = start_mpi(run_dir)
    model = init_runtime(run_dir, cfg, comm)
    cfg, train = model.cfg, model.cfg.train  # with a global batch, the per-rank batch and accumulation
    shard, shards = model.data_shard()
    loader = TrainLoader(cfg.data_dir, train.batch_size, shard, shards, prefetch=2)
    batches = loader.iter_from(0)
    timer, profiler, norm_stats = PhaseTimer(time.perf_counter), StepProfiler(model, None), batchnorm.for_model(model)
    times = []
    try:
        for step in range(1, warmup + updates + 1):
            start = time.perf_counter()
            lr = learning_rate(step - 1, train.num_weight_updates, cfg.optimizer.learning_rate, cfg.lr_schedule)
            update_weights(model, batches, step, lr, False, timer, profiler, norm_stats)
            times.append(time.perf_counter() - start)
    finally:
        loader.close()
    mine = float(np.mean(times[warmup:]))
    # Sync point: the job runs at its slowest rank's pace.
    slowest = float(comm.allreduce_sum(np.eye(comm.size)[comm.rank] * mine, "tune times").max())
    comm.close()
    samples = train.gradient_accumulation_steps * model.dims.dp * train.batch_size  # over the replicas
    if comm.rank:
        return None
    return {"samples_per_s": samples / slowest, "update_s": slowest, "samples_per_update": samples}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ortflow.trainer.tune_updates")
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--updates", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args(argv)
    result = measure(args.run_dir, args.updates, args.warmup)
    if result is not None:
        print(TUNE_RESULT_TAG + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
