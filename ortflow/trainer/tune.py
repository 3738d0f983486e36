"""``ortflow tune``: time a few weight updates of candidate layouts on this host and record the fastest.

The driver (:func:`tune`) starts each candidate as its own ``mpiexec`` job of ``python -m ortflow.trainer.tune
RUN_DIR``; every rank builds the trainer's runtime (the same session, communicator and, with a global batch, the
same per-rank split) and times updates on real batches: micro-batches forward and backward, the gradient exchange, the
optimizer step. Nothing is written but ``layout.json``: weights change in memory only, no checkpoint is saved.
``distributed.num_ranks: auto`` (and ``--np auto``) then starts the recorded winner on a host with the same cores.
"""

from __future__ import annotations

import argparse
import json
import logging
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from ortflow.trainer.layout import (
    MEMORY_SHARE,
    Host,
    Layout,
    LayoutError,
    _divides,
    auto_layout,
    rank_memory_bytes,
    run_facts,
    write_tuned,
)

log = logging.getLogger(__name__)
RESULT_TAG = "ORTFLOW_TUNE "


def candidates(host: Host, num_parameters: int, global_batch: int | None, fixed_batch: int | None) -> list[Layout]:
    """The rule's layout, then one rank per CPU where the rule starts fewer (SMT, or its cap of 16 ranks), then half
    the rule's ranks with twice the threads down to one rank with every core."""
    first = auto_layout(host, num_parameters, global_batch, fixed_batch)
    found, ranks = [first], first.ranks // 2
    fits = host.cores * rank_memory_bytes(num_parameters) <= host.memory_bytes * MEMORY_SHARE
    if first.ranks < host.cores and fits and (global_batch is None or _divides(global_batch, host.cores,
                                                                               fixed_batch or 1)):
        found.append(Layout(host.cores, 1, "candidate: one rank per CPU (SMT siblings included, past the cap)"))
    while ranks >= 1:
        if global_batch is None or _divides(global_batch, ranks, fixed_batch or 1):
            found.append(Layout(ranks, max(1, host.cores // ranks), "candidate"))
        ranks //= 2
    if found[-1].ranks != 1 and (global_batch is None or _divides(global_batch, 1, fixed_batch or 1)):
        found.append(Layout(1, host.cores, "candidate"))
    return found


def tune(cfg, host: Host, updates: int = 6, warmup: int = 2, mpiexec: str | None = None) -> Path:
    """Time every candidate layout on this host and record the results and the winner in ``layout.json``."""
    from ortflow.trainer.launch import find_mpiexec, launcher_flavor, rank_environment

    run_dir = Path(cfg.output_dir)
    facts = run_facts(run_dir)
    exe = find_mpiexec(mpiexec)
    flavor = launcher_flavor(exe)
    results = []
    for layout in candidates(host, facts.num_parameters, cfg.train.global_batch_size, facts.fixed_batch):
        cmd = [str(exe), "-n", str(layout.ranks)] + (["--allow-run-as-root"] if flavor == "openmpi" else [])
        cmd += [sys.executable, "-m", "ortflow.trainer.tune", str(run_dir), "--updates", str(updates),
                "--warmup", str(warmup)]  # fmt: skip
        env = rank_environment(layout.ranks, 1, layout.threads, host.cores)
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        found = re.search(RESULT_TAG + r"(\{.*\})", out.stdout)
        if out.returncode or not found:
            detail = (out.stdout + out.stderr)[-3000:]
            raise LayoutError(f"tuning {layout.ranks} x {layout.threads} failed:\n{detail}")
        record = {"ranks": layout.ranks, "threads": layout.threads, **json.loads(found[1])}
        log.info("%d x %d: %.1f samples/s", layout.ranks, layout.threads, record["samples_per_s"])
        results.append(record)
    return write_tuned(run_dir, host, results)


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
    parser = argparse.ArgumentParser(prog="python -m ortflow.trainer.tune")
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
