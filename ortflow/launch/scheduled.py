"""Run the training job through the scheduler that ``distributed.launcher`` names, and record which job it was
(``RUN/launch.json``, :func:`ortflow.launch.job.write_record`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ortflow.config import RunConfig
from ortflow.launch.job import Job, LaunchResult, watch, write_record


def submit(cfg: RunConfig, run_dir: Path) -> tuple[Job, float, float]:
    """Submit (or attach to) the run's job; returns it with its poll interval and stop grace period in seconds."""
    if cfg.distributed.launcher == "slurm":
        from ortflow.launch import slurm
        from ortflow.launch.job import STOP_GRACE_S

        return slurm.submit(cfg, run_dir), cfg.slurm.poll_interval_s, STOP_GRACE_S + 30  # + slurmstepd start
    if cfg.distributed.launcher == "kubernetes":
        from ortflow.launch import kubernetes

        k8s = cfg.kubernetes
        return kubernetes.submit(cfg), k8s.poll_interval_s, k8s.stop_grace_s + 30  # + pod termination
    raise ValueError(f"distributed.launcher {cfg.distributed.launcher!r} is not a scheduler: use launch.local")


def render_job(cfg: RunConfig, run_dir: Path | None = None) -> str:
    """What would be submitted for the run, as text, submitting nothing: the sbatch script (launcher slurm) or the
    MPIJob manifest as YAML, checked strictly against the MPI Operator's CRD schema (launcher kubernetes).

    Raises:
        ValueError: launcher local (nothing is submitted); ManifestError (a ValueError) for a manifest the CRD's
            schema refuses.
        LaunchError: no MPI launcher found for the Slurm script.
    """
    run_dir = Path(run_dir or cfg.output_dir).resolve()
    if cfg.distributed.launcher == "slurm":
        from ortflow.launch.slurm import script_text

        return script_text(cfg, run_dir)
    if cfg.distributed.launcher == "kubernetes":
        import yaml

        from ortflow.launch import mpijob

        manifest = mpijob.render(cfg)
        mpijob.validate(manifest)
        return yaml.safe_dump(manifest, sort_keys=False, width=120)
    raise ValueError("distributed.launcher local submits nothing to render: mpiexec starts the ranks here (set "
                     "distributed.launcher slurm or kubernetes, or pass --launcher)")


def run_scheduled(cfg: RunConfig, run_dir: Path | None = None, on_line: Callable[[str], None] = print,
                  forward_signals: bool = False, deadline: float | None = None,
                  received: list[int] | None = None) -> LaunchResult:
    """Submit the run's training job to its scheduler, stream its output until it ends, record its id.

    Args:
        cfg: The run config (distributed.launcher slurm or kubernetes).
        run_dir: The run folder (default: cfg.output_dir).
        on_line: Receives every output line.
        forward_signals: SIGTERM/SIGINT to this process cancel the job (``ortflow train``).
        deadline: ``time.monotonic()`` value at which the job is stopped and ``TimeLimitReached`` raised.
        received: With ``forward_signals``, stop signals received before the job was submitted (it is cancelled as
            soon as it is); later ones are added.
    """
    run_dir = Path(run_dir or cfg.output_dir)
    job, poll_s, grace_s = submit(cfg, run_dir)
    write_record(run_dir, job.launcher, job.job_id)
    on_line(f"ortflow: {job.launcher} job {job.job_id}")
    return watch(job, on_line, poll_s=poll_s, grace_s=grace_s, forward_signals=forward_signals, deadline=deadline,
                 received=received)
