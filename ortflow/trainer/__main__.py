"""Rank entry point: ``python -m ortflow.trainer RUN_DIR`` (started by ``ortflow train`` under mpiexec); RUN_DIR may be
the URL of a run folder on object storage (:mod:`.remote_run`)."""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from pathlib import Path

# A rank validates its config with pydantic but has no use for pydantic plugins (observability hooks a package may
# register): looking for them reads the metadata of every installed distribution, in each of a job's ranks. Set
# PYDANTIC_DISABLE_PLUGINS to a value of your own (empty: load them all) to have ranks load them.
os.environ.setdefault("PYDANTIC_DISABLE_PLUGINS", "__all__")

from ortflow.artifacts_folder import verify_artifacts
from ortflow.checkpoints import CheckpointManager, run_owner
from ortflow.checkpoints.h5state import write_state
from ortflow.config.sealed import read_configure
from ortflow.config.storage import is_remote
from ortflow.protocol import EXIT_INTERRUPTED, EXIT_NONFINITE, EXIT_STOPPED, RANK_REFUSED
from ortflow.trainer import lifeline, output, remote_run
from ortflow.trainer.guards import NonFiniteError
from ortflow.trainer.loop import StopFlag, train
from ortflow.trainer.metrics import Progress, TensorBoardLog
from ortflow.trainer.outcome import out_of_memory
from ortflow.trainer.runtime import init_runtime, start_mpi

log = logging.getLogger("ortflow.trainer")



#: Repeats of a stop signal within this many seconds are the same request (a process manager signalling the whole
#: process tree at once reaches a rank directly, through the launcher and through ``ortflow train``).
_REPEAT_WINDOW_S = 5.0


def _install_stop_handlers(stop: StopFlag, clock=time.monotonic) -> None:
    first: list[float] = []

    def request_stop(signum: int, _frame: object) -> None:
        if stop.requested:
            if clock() - first[0] > _REPEAT_WINDOW_S:  # a signal sent again later means "now"
                raise KeyboardInterrupt
            return
        first.append(clock())
        stop.requested = True
        stop.signum = signum
        log.warning("%s received: stopping after the current weight update", signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)


def run_rank(run_dir: Path | str) -> int:
    """Train this rank to the end (or to a stop request); returns the process exit status."""
    from ortflow.dataprep.loader import EvalLoader, TrainLoader, verify_data

    stop = StopFlag()
    _install_stop_handlers(stop)
    lifeline.die_with_parent()  # the launcher's proxy (our parent) died: the job is gone, so is this rank
    lifeline.follow_launcher()  # `ortflow train` (or the flow) died: exit within a second, not at the next print
    own_copy = is_remote(str(run_dir))  # no filesystem shared with the other ranks: each has its own local copy
    if own_copy:
        try:
            run_dir = remote_run.materialize(str(run_dir))
        except (ValueError, OSError) as err:  # ConfigError, StorageError: their messages say what to do
            log.error("%s", err)
            return 1
    run_dir = Path(run_dir)
    try:
        cfg, comm = start_mpi(run_dir)
    except (ValueError, OSError) as err:  # an edited or damaged config.yaml: its message says what to do
        log.error("%s", err)
        return 1
    try:
        if comm.rank == 0:
            verify_artifacts(cfg.artifacts_dir, read_configure(cfg.output_dir))  # a flipped bit in a file or its record
            verify_data(cfg.data_dir)  # and a corrupt or changed shard fail here, before the engine loads anything
        # Sync point: no rank loads the artifacts or reads shards before rank 0 has verified them.
        comm.barrier("verify data")
        rt = init_runtime(run_dir, cfg, comm)
        cfg = rt.cfg  # with a global batch, the per-rank batch and accumulation for this world size
        shard, shards = rt.data_shard()
        loader = TrainLoader(cfg.data_dir, cfg.train.batch_size, shard, shards, prefetch=cfg.data.prefetch_batches)
        evals = EvalLoader(cfg.data_dir, cfg.train.resolved_eval_batch_size, shard, shards, cfg.train.max_eval_rows)
        writer = comm.rank == 0
        # Under ZeRO-1 (or Adasum's per-rank states) every rank writes its optimizer file, and in a pipeline every stage
        # its files, into one temporary folder named after rank 0's pid.
        per_rank = rt.exchange.per_rank_state or rt.dims.split
        shared = (comm.barrier, comm.broadcast(os.getpid(), "checkpoint token")) if per_rank else None
        manager = CheckpointManager(
            cfg.checkpoints_dir, cfg.checkpoint.period, cfg.checkpoint.max_num_checkpoints, is_writer=writer,
            writer=write_state, shared=shared, owner=run_owner(cfg) if writer else None,
            mirror=remote_run.checkpoint_mirror(cfg, shared[1] if shared else os.getpid()) if writer or own_copy
            else None, own_copies=own_copy,
        )
        start = rt.resume.step if rt.resume else 0
        tb = cfg.tensorboard
        tensorboard = TensorBoardLog(cfg.tensorboard_dir, tb.scalar_names, tb.histogram_names,
                                     resumed_from=start if rt.resume else None) if writer else None
        progress = Progress(rt.run_dir, cfg.train.num_weight_updates, start) if writer else None
        try:
            result = train(
                rt, loader.iter_from, evals, manager, tensorboard,
                progress, stop, tokens_per_sample=loader.tokens_per_sample,
            )
        finally:
            loader.close()  # join the prefetch thread: none may still run while the interpreter exits
            if tensorboard is not None:
                tensorboard.close()
        # Sync point: rank 0 may still be writing the final checkpoint; nobody reports success before it is done.
        comm.barrier("finish")
        comm.close()
        if not result.stopped:
            return 0
        return EXIT_INTERRUPTED if stop.signum == signal.SIGINT else EXIT_STOPPED
    except NonFiniteError as err:  # raised on every rank at the same update (same all-reduced values): no abort
        if comm.rank == 0:
            log.error("%s", err)
        comm.close()
        return EXIT_NONFINITE
    except ValueError as err:  # ortflow's own errors (data, checkpoint, config) say what to do: no traceback
        # A refusal repeats on a retry; a failed write (a full disk, a lost file server) may pass, so it is no refusal.
        how = ": " if isinstance(err.__cause__, OSError | RuntimeError) else f" {RANK_REFUSED}"
        log.error("rank %d%s%s; stopping every rank", comm.rank, how, err)
        comm.abort(1)
        return 1  # not reached under MPI (Abort ends the process); no traceback either way
    except BaseException as err:
        reason = out_of_memory(err)
        if reason is not None:  # the engine's C++ trace would say nothing a user can act on
            log.error("rank %d %s; stopping every rank", comm.rank, reason)
            comm.abort(1)
            return 1
        log.exception("rank %d failed; stopping every rank", comm.rank)
        comm.abort(1)
        raise


def _one_line_os_errors(unraisable) -> None:
    """An OSError raised where Python cannot pass it on (h5py closing a file on a full disk, in a finalizer) is one
    log line, not a traceback beside the checkpoint's own message; anything else keeps the default report."""
    if isinstance(unraisable.exc_value, OSError):
        log.warning("while cleaning up: %s", unraisable.exc_value)
        return
    sys.__unraisablehook__(unraisable)


def main(argv: list[str] | None = None) -> int:
    """Parse the run folder and train this rank."""
    parser = argparse.ArgumentParser(prog="python -m ortflow.trainer", description=__doc__)
    parser.add_argument("run_dir", help="A configured run folder (holds config.yaml and artifacts/), or its URL on "
                        "object storage (s3://, gs://, az://).")
    args = parser.parse_args(argv)
    output.never_block()  # a launcher that stops reading (stopped, wedged) must never stall this rank
    sys.unraisablehook = _one_line_os_errors
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S", force=True
    )
    return run_rank(args.run_dir)


if __name__ == "__main__":
    sys.exit(main())
