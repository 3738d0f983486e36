"""What crosses the process boundary between a launcher and its ranks, defined once for both sides.

The launching side (``ortflow train``, the Prefect task, ``ortflow tune``, the Slurm and Kubernetes launchers) and
the ranks (``python -m ortflow.trainer``, ``python -m ortflow.trainer.tune_updates``) agree on these exit statuses,
environment variables and output tags; ``ortflow automations`` and the flow runs agree on the late bound's name. This
module imports nothing, so either side may import it.
"""

from __future__ import annotations

#: A run stopped by SIGTERM after a clean stop checkpoint (128 + SIGTERM, as shells report it).
EXIT_STOPPED = 143
#: ... and by SIGINT (Ctrl-C) alone: 128 + SIGINT.
EXIT_INTERRUPTED = 130
#: A weight update's loss or gradient norm was not finite (every rank stops at the same update; a retry would resume
#: from the last good checkpoint and diverge again).
EXIT_NONFINITE = 4
#: A job aborted because a rank or a launcher process stalled: a rank's collective watchdog, or ``ortflow train``
#: when ``mpiexec`` or a proxy stays stopped longer than the collective timeout.
EXIT_STALLED = 3
#: A rank whose launcher died ended itself (128 + SIGKILL, what the launcher's own death would have reported).
EXIT_ORPHANED = 137

#: The rank count the launcher chose (``--np``, ``auto``, the tuned winner): ranks accept it over the config's.
NUM_RANKS_ENV = "ORTFLOW_NUM_RANKS"
#: Threads per rank chosen by the launcher (``--threads``, or the auto layout), read by every rank.
THREADS_ENV = "ORTFLOW_THREADS_PER_RANK"
#: The pid and host of the launching ``ortflow`` process: a rank exits when it is gone.
LAUNCHER_PID_ENV = "ORTFLOW_LAUNCHER_PID"
LAUNCHER_HOST_ENV = "ORTFLOW_LAUNCHER_HOST"

#: The run folder's folder where each rank's collective watchdog keeps its heartbeat and leaves a stall report.
HEARTBEAT_DIR = ".ranks"

#: How a rank's refusal to start under another MPI's launcher begins (the train task does not retry it).
MPI_MISMATCH = "MPI launcher mismatch"

#: What a rank's error line says after the rank's name when ortflow refused to go on (a config, data, checkpoint or path
#: error, each naming its fix): the same job would be refused again, so the train task does not retry it.
RANK_REFUSED = "refused: "

#: ``ortflow tune``: rank 0 prints its measurement as one line, this tag then a JSON object.
TUNE_RESULT_TAG = "ORTFLOW_TUNE "

#: The Prefect Variable through which ``ortflow automations --late-after`` tells flow runs when they are late: a run
#: still running that many seconds after it started emits ``ortflow.flow-run.late`` (``ortflow/tasks/events.py``).
LATE_AFTER_VARIABLE = "ortflow_late_after_s"
