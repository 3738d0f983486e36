"""``ortflow tune``: time a few weight updates of candidate layouts on this host and record the fastest.

The driver (:func:`tune`) starts each candidate as its own ``mpiexec`` job of
``python -m ortflow.trainer.tune_updates RUN_DIR``; every rank builds the trainer's runtime (the same session,
communicator and, with a global batch, the same per-rank split) and times updates on real batches: micro-batches
forward and backward, the gradient exchange, the optimizer step. Nothing is written but ``layout.json``: weights
change in memory only, no checkpoint is saved.
``distributed.num_ranks: auto`` (and ``--np auto``) then starts the recorded winner on a host with the same cores.
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

from ortflow.launch.layout import (
    MEMORY_SHARE,
    Host,
    Layout,
    LayoutError,
    divides,
    rank_memory_bytes,
    replica_layout,
    run_facts,
    write_tuned,
)
from ortflow.launch.local import find_mpiexec, launcher_flavor, rank_environment
from ortflow.protocol import TUNE_RESULT_TAG

log = logging.getLogger(__name__)


def candidates(host: Host, num_parameters: int, global_batch: int | None, fixed_batch: int | None,
               split: int = 1) -> list[Layout]:
    """The rule's layout, then one rank per CPU where the rule starts fewer (SMT, or its cap of 16 ranks), then half
    the rule's ranks with twice the threads down to the fewest ranks.

    ``split`` is the ranks one replica takes (``pipeline_parallel_size x horizontal_parallel_size``): every candidate
    starts whole replicas, and a global batch is split over the replicas, as training splits it.
    """
    unit = fixed_batch or 1

    def fits(ranks: int) -> bool:
        return ranks % split == 0 and (global_batch is None or divides(global_batch, ranks // split, unit))

    found = [replica_layout(host, num_parameters, global_batch, fixed_batch, split)]
    first = found[0].ranks
    fits_memory = host.cores * rank_memory_bytes(num_parameters) <= host.memory_bytes * MEMORY_SHARE
    if first < host.cores and fits_memory and fits(host.cores):
        found.append(Layout(host.cores, 1, "candidate: one rank per CPU (SMT siblings included, past the cap)"))
    ranks = first // 2
    while ranks >= split:
        if fits(ranks):
            found.append(Layout(ranks, max(1, host.cores // ranks), "candidate"))
        ranks //= 2
    if found[-1].ranks != split and fits(split):
        found.append(Layout(split, max(1, host.cores // split), "candidate"))
    return found


def tune_notes(cfg, record: dict) -> list[str]:
    """What a user of ``record`` (a layout.json) should know: the config does not start the winner (num_ranks is a
    number), or the candidates train different samples per update (a per-rank ``train.batch_size``)."""
    notes = []
    ranks = cfg.distributed.num_ranks
    if ranks != "auto":
        notes.append(f"distributed.num_ranks is {ranks} in this config, so training starts {ranks} rank(s): set "
                     "distributed.num_ranks: auto (or run `ortflow train RUN --np auto`) to train with the fastest")
    sizes = sorted({c["samples_per_update"] for c in record["candidates"]})
    if not cfg.train.global_batch_size and len(sizes) > 1:
        notes.append(f"the fastest trains {record['best']['samples_per_update']} samples per weight update, the "
                     f"candidates {sizes[0]} to {sizes[-1]} (train.batch_size is per rank): set "
                     "train.global_batch_size to train one batch on any layout")
    return notes


def check_tunable(cfg) -> None:
    """Refuse a run ``tune`` cannot measure: CUDA ranks take one GPU each, not a share of the cores.

    Raises:
        LayoutError: naming why and what to use instead.
    """
    if cfg.distributed.device == "cuda":
        raise LayoutError(
            "ortflow tune times CPU layouts (ranks x threads over this host's cores); with distributed.device cuda "
            "there is one rank per GPU: set distributed.num_ranks auto (every visible GPU) or a number, no tuning"
        )


def tune(cfg, host: Host, updates: int = 6, warmup: int = 2, mpiexec: str | None = None) -> Path:
    """Time every candidate layout on this host and record the results and the winner in ``layout.json``."""
    check_tunable(cfg)
    run_dir = Path(cfg.output_dir)
    facts = run_facts(run_dir)
    exe = find_mpiexec(mpiexec)
    flavor = launcher_flavor(exe)
    results = []
    dist = cfg.distributed
    split = dist.pipeline_parallel_size * dist.horizontal_parallel_size
    for layout in candidates(host, facts.num_parameters, cfg.train.global_batch_size, facts.fixed_batch, split):
        cmd = [str(exe), "-n", str(layout.ranks)] + (["--allow-run-as-root"] if flavor == "openmpi" else [])
        cmd += [sys.executable, "-m", "ortflow.trainer.tune_updates", str(run_dir), "--updates", str(updates),
                "--warmup", str(warmup)]  # fmt: skip
        env = rank_environment(layout.ranks, 1, layout.threads, host.cores)
        out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        found = re.search(TUNE_RESULT_TAG + r"(\{.*\})", out.stdout)
        if out.returncode or not found:
            detail = (out.stdout + out.stderr)[-3000:]
            raise LayoutError(f"tuning {layout.ranks} x {layout.threads} failed:\n{detail}")
        record = {"ranks": layout.ranks, "threads": layout.threads, **json.loads(found[1])}
        log.info("%d x %d: %.1f samples/s", layout.ranks, layout.threads, record["samples_per_s"])
        results.append(record)
    return write_tuned(run_dir, host, results)
