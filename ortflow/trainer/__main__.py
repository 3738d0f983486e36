"""Rank entry point: ``python -m ortflow.trainer RUN_DIR`` (started by ``ortflow train`` under mpiexec)."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
from pathlib import Path

from ortflow.trainer.checkpoints import CheckpointManager
from ortflow.trainer.loop import StopFlag, train
from ortflow.trainer.metrics import Progress, TensorBoardLog
from ortflow.trainer.runtime import init_runtime, start_mpi

log = logging.getLogger("ortflow.trainer")

#: Exit status of a run stopped by SIGINT/SIGTERM after a clean checkpoint (128 + SIGTERM, as shells report it).
EXIT_STOPPED = 143


def _install_stop_handlers(stop: StopFlag) -> None:
    def request_stop(signum: int, _frame: object) -> None:
        if stop.requested:  # a second signal means "now"
            raise KeyboardInterrupt
        stop.requested = True
        log.warning("%s received: stopping after the current weight update", signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)


def run_rank(run_dir: Path) -> int:
    """Train this rank to the end (or to a stop request); returns the process exit status."""
    from ortflow.dataprep.loader import EvalLoader, TrainLoader, verify_data

    stop = StopFlag()
    _install_stop_handlers(stop)
    cfg, comm = start_mpi(run_dir)
    try:
        rt = init_runtime(run_dir, cfg, comm)
        if comm.rank == 0:
            verify_data(cfg.data_dir)  # a corrupt or changed shard fails here, before any step
        # Sync point: no rank reads shards before rank 0 has verified them.
        comm.barrier("verify data")
        shard, shards = rt.data_shard()
        loader = TrainLoader(cfg.data_dir, cfg.train.batch_size, shard, shards, prefetch=cfg.data.prefetch_batches)
        evals = EvalLoader(cfg.data_dir, cfg.train.resolved_eval_batch_size, shard, shards)
        writer = comm.rank == 0
        manager = CheckpointManager(
            cfg.checkpoints_dir, cfg.checkpoint.period, cfg.checkpoint.max_num_checkpoints, is_writer=writer,
            **rt.checkpoint_writer(),
        )
        start = rt.resume.step if rt.resume else 0
        tb = cfg.tensorboard
        tensorboard = TensorBoardLog(cfg.tensorboard_dir, tb.scalar_names, tb.histogram_names) if writer else None
        progress = Progress(rt.run_dir, cfg.train.num_weight_updates, start) if writer else None
        try:
            result = train(
                rt, loader.iter_from, lambda: evals.batches(cfg.train.max_eval_batches), manager, tensorboard,
                progress, stop, tokens_per_sample=loader.tokens_per_sample,
            )
        finally:
            if tensorboard is not None:
                tensorboard.close()
        # Sync point: rank 0 may still be writing the final checkpoint; nobody reports success before it is done.
        comm.barrier("finish")
        comm.close()
        return EXIT_STOPPED if result.stopped else 0
    except BaseException:
        log.exception("rank %d failed; stopping every rank", comm.rank)
        comm.abort(1)
        raise


def main(argv: list[str] | None = None) -> int:
    """Parse the run folder and train this rank."""
    parser = argparse.ArgumentParser(prog="python -m ortflow.trainer", description=__doc__)
    parser.add_argument("run_dir", type=Path, help="A configured run folder (holds config.yaml and artifacts/).")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", force=True
    )
    return run_rank(args.run_dir)


if __name__ == "__main__":
    sys.exit(main())
