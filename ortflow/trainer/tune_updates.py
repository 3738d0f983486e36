"""The ranks' side of ``ortflow tune``: time a few weight updates of this layout and print the job's samples/s.

Started by :func:`ortflow.launch.tune.tune` as ``python -m ortflow.trainer.tune_updates RUN_DIR`` under mpiexec,
once per candidate layout. Weights change in memory only; nothing is written.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

#: Rank 0 prints its result on one line that starts with this tag; the driver reads it from the job's output.
RESULT_TAG = "ORTFLOW_TUNE "


def measure(run_dir: Path, updates: int, warmup: int) -> dict | None:
    """On each rank: time ``warmup + updates`` weight updates; rank 0 returns the job's samples/s (slowest rank)."""
    from ortflow.dataprep.loader import TrainLoader
    from ortflow.trainer.runtime import init_runtime, start_mpi

    cfg, comm = start_mpi(run_dir)
    rt = init_runtime(run_dir, cfg, comm)
    cfg, module = rt.cfg, rt.module
    k, names = cfg.train.gradient_accumulation_steps, module.input_names()
    batches = TrainLoader(cfg.data_dir, cfg.train.batch_size, comm.rank, comm.size, prefetch=2).iter_from(0)
    grads, scalars, times = rt.gradient_buffers(), np.zeros(2, dtype=np.float32), []
    for _ in range(warmup + updates):
        start = time.perf_counter()
        for _ in range(k):
            feeds = next(batches)
            module(*(feeds[n] for n in names))
        mine = rt.exchange.reduce(grads, k * comm.size, scalars)  # as the loop: exchange, update, gather
        rt.update.step(mine, cfg.optimizer.learning_rate)
        rt.exchange.gather()
        module.lazy_reset_grad()
        times.append(time.perf_counter() - start)
    batches.close()
    mine = float(np.mean(times[warmup:]))
    # Sync point: the job runs at its slowest rank's pace.
    slowest = float(comm.allreduce_sum(np.eye(comm.size)[comm.rank] * mine, "tune times").max())
    comm.close()
    samples = k * comm.size * cfg.train.batch_size
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
        print(RESULT_TAG + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
