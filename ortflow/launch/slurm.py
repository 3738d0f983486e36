"""The Slurm launcher: the training job as an ``sbatch`` script, watched with ``scontrol``, stopped with ``scancel``.

The script asks for ``slurm.num_nodes`` nodes with ``num_ranks / num_nodes`` tasks each and starts the ranks with the
MPI launcher inside the allocation (the bundled MPICH's ``mpiexec`` detects the allocation and starts its processes
on the allocated nodes with ``srun``; Open MPI's ``mpirun`` does the same). It runs that launcher in its own process
group and passes SIGTERM on to the group, exactly as ``ortflow train`` does on one host, so:

* cancel (``scancel --batch --signal=TERM``): every rank stops after the same update, writes a stop checkpoint and
  the job ends with status 143;
* the time limit: Slurm sends SIGUSR1 ``slurm.stop_signal_s`` before it (``--signal=B:USR1@N``); the ranks stop the
  same way and, once they have, the job requeues itself (``scontrol requeue``): the next allocation resumes from the
  stop checkpoint under the same job id, so a run of any length finishes over as many allocations as it needs,
  none of them a failure (Slurm records the allocation as requeued and the last one as completed);
* a requeue or preemption (``--requeue``): Slurm stops the ranks, queues the job again under the same id, and the
  script starts over, resuming from the newest complete checkpoint. The output file is opened for appending, so one
  file holds every attempt; each attempt's first line names it, and a failure summary quotes that attempt only;
* an outside ``scancel``: the ranks stop with a stop checkpoint and the run stops, saying so; it is not submitted
  again (``ortflow train`` resumes it);
* a job that can never start (its pending reason says so, e.g. ``PartitionConfig``) is cancelled and the run fails
  with that reason; any other pending reason is shown every minute.

The job id is kept in ``RUN/slurm/job.json``: a second submission for the same run folder (a retried task, ``ortflow
train`` again) attaches to a job that is still queued or running instead of starting a second writer.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ortflow.config import RunConfig
from ortflow.launch.job import JobState, LaunchError, Phase
from ortflow.launch.local import (
    LAUNCHER_HOST_ENV,
    LAUNCHER_PID_ENV,
    build_command,
    find_mpiexec,
    launcher_flavor,
)
from ortflow.protocol import EXIT_STOPPED as STOPPED
from ortflow.protocol import NUM_RANKS_ENV, THREADS_ENV

log = logging.getLogger(__name__)

#: Folder of the run folder that holds the job record, the script, and each job's output and exit status.
SLURM_DIR = "slurm"
JOB_RECORD = "job.json"
#: Slurm job states after which the job runs no more (a requeued job goes back to PENDING instead).
ENDED_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
                "PREEMPTED", "SPECIAL_EXIT", "REVOKED"}  # fmt: skip
PENDING_STATES = {"PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "CONFIGURING", "RESV_DEL_HOLD"}
#: Pending reasons that do not clear while the job and the cluster's configuration stay as they are.
NEVER_STARTS = {"PartitionConfig", "PartitionNodeLimit", "PartitionTimeLimit", "BadConstraints", "InvalidAccount",
                "InvalidQOS", "AccountNotAllowed", "QOSNotAllowed", "DependencyNeverSatisfied",
                "AssocMaxNodesPerJobLimit", "AssocMaxCpuPerJobLimit", "QOSMaxNodePerJobLimit", "QOSMaxCpuPerJobLimit",
                "QOSMaxWallDurationPerJobLimit", "AssocMaxWallDurationPerJobLimit"}  # fmt: skip


#: Seconds the watcher waits for a controller that does not answer (restarting, overloaded) before it gives up on the
#: job; the job itself runs on, and ``ortflow train`` attaches to it later.
CONTROLLER_GRACE_S = 600.0
#: What scontrol says of a job the controller no longer knows (ended longer than MinJobAge ago).
FORGOTTEN = "Invalid job id"


def _commands() -> dict[str, str]:
    found = {name: shutil.which(name) for name in ("sbatch", "scontrol", "scancel")}
    missing = [name for name, path in found.items() if not path]
    if missing:
        raise LaunchError(
            f"distributed.launcher slurm: {', '.join(missing)} not found on PATH: run from a host with the Slurm "
            "client commands (a login node), or use launcher local"
        )
    return found  # type: ignore[return-value]


def threads_per_rank(cfg: RunConfig) -> int:
    """CPUs each rank gets (``--cpus-per-task``) and uses as intra-op threads."""
    return cfg.slurm.cpus_per_rank or cfg.distributed.threads_per_rank or 1


def rank_command(cfg: RunConfig, run_dir: Path, mpiexec: Path | None, flavor: str,
                 python: str = sys.executable) -> list[str]:
    """How the job starts the ranks: the MPI launcher inside the allocation, or ``srun --mpi=PLUGIN``."""
    ranks, slurm = int(cfg.distributed.num_ranks), cfg.slurm
    python = slurm.python or python
    if slurm.launch == "srun":  # the site's process manager: every task of the allocation is a rank
        command = ["srun", f"--mpi={slurm.srun_mpi}", "--kill-on-bad-exit=1", f"--ntasks={ranks}", "--label",
                   python, "-u", "-P", "-m", "ortflow.trainer", str(run_dir)]  # fmt: skip
    else:
        command = build_command(run_dir, ranks, mpiexec, flavor, python=python)
    at = len(command) - 6  # python -u -P -m ortflow.trainer RUN: a container runner goes before the python
    return command[:at] + list(slurm.rank_prefix) + command[at:]


def render_script(cfg: RunConfig, run_dir: Path, mpiexec: Path | None, flavor: str,
                  python: str = sys.executable) -> str:
    """The sbatch script of the run: resources from ``cfg.slurm``, the ranks started with ``mpiexec`` (or srun).

    Args:
        cfg: The run config (distributed.num_ranks a number, a multiple of slurm.num_nodes).
        run_dir: The run folder, at the same path on every node.
        mpiexec: The MPI launcher on the nodes (None with slurm.launch srun).
        flavor: ``mpich`` or ``openmpi`` (its command-line options differ).
        python: The Python of ortflow's environment on the nodes.
    """
    slurm, ranks = cfg.slurm, int(cfg.distributed.num_ranks)
    threads = threads_per_rank(cfg)
    out = run_dir / SLURM_DIR
    lines = [
        "#!/bin/bash",
        f"#SBATCH --job-name={cfg.name}",
        f"#SBATCH --nodes={slurm.num_nodes}",
        f"#SBATCH --ntasks-per-node={ranks // slurm.num_nodes}",
        f"#SBATCH --cpus-per-task={threads}",
        f"#SBATCH --output={out}/job-%j.out",
        "#SBATCH --open-mode=append",
        f"#SBATCH --chdir={run_dir}",
        "#SBATCH --requeue" if slurm.requeue else "#SBATCH --no-requeue",
    ]
    if slurm.gpus_per_node:
        lines.append(f"#SBATCH --gpus-per-node={slurm.gpus_per_node}")
    for option, value in (("partition", slurm.partition), ("time", slurm.time_limit), ("account", slurm.account)):
        if value:
            lines.append(f"#SBATCH --{option}={value}")
    if slurm.stop_signal_s:
        lines.append(f"#SBATCH --signal=B:USR1@{slurm.stop_signal_s}")
    lines += [f"#SBATCH {entry}" for entry in slurm.extra_sbatch]
    command = rank_command(cfg, run_dir, mpiexec, flavor, python)
    env = {"OMP_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads, "MKL_NUM_THREADS": threads,
           THREADS_ENV: threads, NUM_RANKS_ENV: ranks, "PYTHONUNBUFFERED": 1}  # fmt: skip
    lines += [
        "",
        "# SIGTERM (scancel) and SIGUSR1 (the time limit's --signal) stop the ranks after the same update with a stop",
        "# checkpoint: the ranks' launcher runs in its own process group, which gets SIGTERM. A signal that comes",
        "# before the ranks start (during the setup) keeps them from starting.",
        "pid=",
        "limit=0",
        "stopping=0",
        'stop_ranks() { if [ -n "$pid" ]; then kill -TERM -- -"$pid" 2>/dev/null; fi; }',
        'trap \'stopping=1; echo "ortflow: SIGTERM: ranks stop after this update"; stop_ranks\' TERM',
        'trap \'limit=1; echo "ortflow: the time limit is near: ranks stop after this update"; stop_ranks\' USR1',
        "",
        "# Set up the environment of the ranks (slurm.setup).",
        *slurm.setup,
        "",
    ]
    lines += [f"export {name}={value}" for name, value in env.items()]
    lines += [
        "export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}",
        f"unset {LAUNCHER_PID_ENV} {LAUNCHER_HOST_ENV}  # the ranks outlive the submitting process",
        'echo "ortflow: slurm job $SLURM_JOB_ID attempt ${SLURM_RESTART_COUNT:-0} on $SLURM_JOB_NODELIST"',
        f"status={STOPPED}",
        'if [ $limit = 0 ] && [ $stopping = 0 ]; then',
        f"    setsid {shlex.join(command)} &",
        "    pid=$!",
        '    if [ $limit = 1 ] || [ $stopping = 1 ]; then stop_ranks; fi  # a signal just before pid was known',
        "    while :; do wait $pid; status=$?; kill -0 $pid 2>/dev/null || break; done",
        "    wait $pid; status=$?",
        "fi",
        f"echo $status > {shlex.quote(str(out))}/job-$SLURM_JOB_ID.status",
        'echo "ortflow: ranks exited with status $status"',
        *_requeue_lines(slurm.requeue),
        "exit $status",
        "",
    ]
    return "\n".join(lines)


def _requeue_lines(requeue: bool) -> list[str]:
    """After a stop at the time limit: requeue the job (the next allocation resumes), or say why it ends here."""
    if not requeue:
        return ["if [ $limit = 1 ] && [ $status != 0 ]; then",
                '    echo "ortflow: stopped at the time limit; slurm.requeue is off: resume with ortflow train"',
                "fi"]  # fmt: skip
    return [
        "if [ $limit = 1 ] && [ $status != 0 ]; then  # stopped (or kept from starting) by the time limit",
        "    trap '' TERM  # the requeue ends this allocation: nothing left to stop",
        '    if scontrol requeue "$SLURM_JOB_ID"; then',
        '        echo "ortflow: stopped at the time limit (status $status): requeued; the next allocation resumes '
        'from the newest complete checkpoint"',
        "        exit 0",
        "    fi",
        '    echo "ortflow: error: scontrol requeue $SLURM_JOB_ID failed: the run stops at its stop checkpoint"',
        "fi",
    ]


class SlurmJob:
    """A Slurm batch job of one run folder: its output file, its state from ``scontrol``.

    Args:
        job_id: Slurm's job id.
        run_dir: The run folder (its ``slurm/`` holds the job's output and exit status).
        commands: Paths of ``scontrol`` and ``scancel``.
        env: Environment of those commands.
        run: Runs one command and returns its result (default: a subprocess; tests pass a fake controller).
    """

    launcher = "slurm"

    def __init__(self, job_id: str, run_dir: Path, commands: dict[str, str], env: dict[str, str] | None = None,
                 run: Callable[..., subprocess.CompletedProcess] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.job_id = job_id
        self.clock = clock
        self._silent_since: float | None = None  # the controller has not answered since then
        self._notices: list[str] = []  # the watcher's own lines, passed on with the job's output
        self.run_dir = run_dir
        self.commands = commands
        self.env = env
        self._run = run or self._subprocess
        self.output = run_dir / SLURM_DIR / f"job-{job_id}.out"
        self._offset = 0
        self._partial = ""
        self._last = JobState(Phase.PENDING, "PENDING", known=False)  # a guess until the controller answers
        self._answered = False  # the controller has said the job's state at least once
        self._stopping = False  # this watcher asked the job to stop (cancel, kill)

    def _subprocess(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(args, capture_output=True, text=True, env=self.env, timeout=120, check=False)

    def read_output(self) -> list[str]:
        notices, self._notices = self._notices, []
        return notices + self._read_file()

    def _read_file(self) -> list[str]:
        try:
            with self.output.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        text = self._partial + data.decode("utf-8", errors="replace")
        lines = text.split("\n")
        self._partial = lines.pop()
        return lines

    def poll(self) -> JobState:
        try:
            out = self._run(self.commands["scontrol"], "show", "job", "-o", self.job_id)
        except subprocess.TimeoutExpired as err:
            out = subprocess.CompletedProcess(err.cmd, 124, "", f"no answer within {err.timeout:.0f} s")
        if out.returncode and FORGOTTEN not in out.stderr:  # the controller did not answer: the job runs on
            return self._unanswered(" ".join(out.stderr.split()) or f"scontrol exit status {out.returncode}")
        fields = dict(item.split("=", 1) for item in out.stdout.split() if "=" in item) if out.returncode == 0 else {}
        state = fields.get("JobState", "")
        self._answered = True
        if self._silent_since is not None:
            self._silent_since = None
            self._notices.append(f"ortflow: the Slurm controller answers again: slurm job {self.job_id} is "
                                 f"{state or 'no longer known'}")
        if not state:  # the controller forgot the job (MinJobAge): its script left the exit status
            status = self.run_dir / SLURM_DIR / f"job-{self.job_id}.status"
            try:
                code = int(status.read_text().strip())
            except (OSError, ValueError):
                code = 1
            self._last = JobState(Phase.ENDED, f"no longer known to Slurm ({out.stderr.strip()})", code)
        elif state in ENDED_STATES:
            self._last = self._ended(state, fields)
        else:
            phase = Phase.PENDING if state in PENDING_STATES else Phase.RUNNING
            reason = fields.get("Reason", "None")
            self._last = JobState(phase, state if reason == "None" else f"{state} ({reason})")
            if phase is Phase.PENDING and reason in NEVER_STARTS:
                self._last = self._never_starts(state, reason)
        return self._last

    def _unanswered(self, said: str) -> JobState:
        """The job's last known state while the controller is silent; after :data:`CONTROLLER_GRACE_S` the watch
        ends (the job is neither cancelled nor forgotten: ``ortflow train`` attaches to it)."""
        now = self.clock()
        if self._silent_since is None:
            self._silent_since = now
            self._notices.append(f"ortflow: the Slurm controller does not answer ({said}): still watching slurm job "
                                 f"{self.job_id}")
        elif now - self._silent_since >= CONTROLLER_GRACE_S:
            return JobState(Phase.ENDED, f"the Slurm controller has not answered for {CONTROLLER_GRACE_S:.0f} s "
                            f"({said}): slurm job {self.job_id} may still run; `ortflow train {self.run_dir}` "
                            "attaches to it once the controller answers", 1)
        return self._last

    def _ended(self, state: str, fields: dict[str, str]) -> JobState:
        code, _, sig = fields.get("ExitCode", "1:0").partition(":")
        returncode = 128 + int(sig) if sig.isdigit() and int(sig) else int(code) if code.isdigit() else 1
        if state != "COMPLETED" and returncode == 0:
            returncode = 1  # cancelled while pending, timed out, node failure: not a success
        if state == "CANCELLED" and not self._stopping:  # scancel from outside: the user's decision stands
            return JobState(Phase.ENDED, f"slurm job {self.job_id} was cancelled outside ortflow (scancel); it is "
                            f"not submitted again: resume with `ortflow train {self.run_dir}`", STOPPED, retry=False)
        return JobState(Phase.ENDED, state, returncode)

    def _never_starts(self, state: str, reason: str) -> JobState:
        """Cancel a job whose pending reason cannot clear; the run fails with the reason."""
        self.kill()
        return JobState(Phase.ENDED, f"slurm job {self.job_id} can never start ({state}, Reason={reason}): it was "
                        "cancelled; change the request (slurm.partition, num_nodes, distributed.num_ranks, "
                        "gpus_per_node, time_limit; `ortflow validate` checks it) or ask the cluster's admins", 1,
                        retry=False)

    def cancel(self) -> None:
        if not self._answered:  # a stop before the first poll: a running job's ranks must not be killed unasked
            self.poll()
        if self._last.phase is Phase.ENDED:
            return
        self._stopping = True
        if self._answered and self._last.phase is Phase.PENDING:  # nothing started: nothing to checkpoint
            self.kill()
            return
        out = self._run(self.commands["scancel"], "--batch", "--signal=TERM", self.job_id)
        if out.returncode:
            log.warning("scancel --batch --signal=TERM %s: %s", self.job_id, out.stderr.strip())

    def kill(self) -> None:
        self._stopping = True
        out = self._run(self.commands["scancel"], self.job_id)
        if out.returncode:
            log.warning("scancel %s: %s", self.job_id, out.stderr.strip())


def submit(cfg: RunConfig, run_dir: Path | None = None, python: str = sys.executable,
           env: dict[str, str] | None = None) -> SlurmJob:
    """Submit the run's training job with sbatch, or attach to the run's job that is still queued or running.

    Args:
        cfg: The run config (distributed.launcher slurm).
        run_dir: The run folder (default: cfg.output_dir); the same path on every node.
        python: The Python of ortflow's environment on the nodes.
        env: Environment of the Slurm commands (default: this process's); the job inherits it.

    Raises:
        LaunchError: no Slurm client commands, no MPI launcher, or sbatch refused the job (its message included).
    """
    commands = _commands()
    run_dir = Path(run_dir or cfg.output_dir).resolve()
    folder = run_dir / SLURM_DIR
    folder.mkdir(parents=True, exist_ok=True)
    base = dict(env if env is not None else os.environ)
    for name in (LAUNCHER_PID_ENV, LAUNCHER_HOST_ENV):
        base.pop(name, None)
    record = folder / JOB_RECORD
    previous = _previous_job(record)
    if previous:
        job = SlurmJob(previous, run_dir, commands, base)
        state = job.poll()
        if state.phase is not Phase.ENDED:
            job.read_output()  # earlier attempts' lines are already in their logs
            log.info("attaching to slurm job %s of %s, still %s", previous, run_dir, state.detail)
            return job
    script = folder / "train.sbatch"
    script.write_text(script_text(cfg, run_dir, python))
    out = subprocess.run([commands["sbatch"], "--parsable", str(script)], capture_output=True, text=True, env=base,
                         timeout=120, check=False)  # fmt: skip
    if out.returncode or not re.match(r"^\d+", out.stdout.strip()):
        raise LaunchError(f"sbatch refused the job ({script}): {(out.stderr or out.stdout).strip()}")
    job_id = out.stdout.strip().split(";")[0]
    record.write_text(json.dumps({"job_id": job_id, "script": str(script)}) + "\n")
    log.info("submitted slurm job %s (%s)", job_id, script)
    return SlurmJob(job_id, run_dir, commands, base)


def script_text(cfg: RunConfig, run_dir: Path, python: str = sys.executable) -> str:
    """The run's sbatch script with the launcher found here (slurm.mpiexec or the bundled MPICH's)."""
    if cfg.slurm.launch == "srun":
        return render_script(cfg, run_dir, None, "srun", python)
    try:
        exe = find_mpiexec(cfg.slurm.mpiexec)
    except LaunchError:
        if not cfg.slurm.mpiexec:
            raise LaunchError(f"no MPI launcher found (neither beside {sys.executable} nor mpiexec on PATH): install "
                              "ortflow with its pinned dependencies (the mpich wheel brings mpiexec) or name the "
                              "nodes' launcher in slurm.mpiexec") from None
        raise LaunchError(f"slurm.mpiexec {cfg.slurm.mpiexec} not found or not executable here: give the path of the "
                          "MPI launcher (the same on the nodes), or unset it for the bundled MPICH") from None
    return render_script(cfg, run_dir, exe, launcher_flavor(exe), python)


def _previous_job(record: Path) -> str | None:
    try:
        return str(json.loads(record.read_text())["job_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
