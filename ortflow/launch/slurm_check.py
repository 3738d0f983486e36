"""The Slurm request of a run against the cluster, before anything runs (``ortflow validate``, the flow's first
step): the partition exists, its nodes have the slots the ranks need, and ``sbatch --test-only`` accepts the job
script that training would submit. A request Slurm could never start is refused before configure and data
preparation, naming what to change."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from ortflow.config import RunConfig
from ortflow.launch.job import LaunchError
from ortflow.launch.slurm import script_text, threads_per_rank

Runner = Callable[..., subprocess.CompletedProcess]


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)


def request_problems(cfg: RunConfig, run: Runner = _run, python: str = sys.executable,
                     which: Callable[[str], str | None] = shutil.which) -> list[str]:
    """What stops the run's Slurm job from ever starting on this cluster (empty: Slurm would take it).

    Args:
        cfg: The run config (distributed.launcher slurm; other launchers have nothing to check here).
        run: Runs one Slurm command (tests pass a fake cluster).
        python: The Python of ortflow's environment on the nodes.
        which: Finds a command on PATH (tests pass their own).
    """
    if cfg.distributed.launcher != "slurm":
        return []
    missing = [name for name in ("sbatch", "sinfo", "scontrol") if not which(name)]
    if missing:
        return [f"distributed.launcher slurm: {', '.join(missing)} not found on PATH: validate and run from a host "
                "with the Slurm client commands (a login node), or use launcher local"]
    listed = _ask(run, "sinfo", "-h", "-o", "%P")
    if listed.returncode:  # nothing else can be checked, and sbatch would fail the same way
        said = " ".join((listed.stderr or listed.stdout).replace("sinfo: ", "").split()) or \
            f"exit status {listed.returncode}"
        return [f"the Slurm controller does not answer (sinfo: {said}): validate and run where the Slurm commands "
                "reach it (a login node; SLURM_CONF names the cluster's slurm.conf), or use launcher local"]
    problems = _partition_problems(cfg, run, listed)
    try:
        script = script_text(cfg, Path(cfg.output_dir).resolve(), python)
    except LaunchError as err:
        return problems + [str(err)]
    with tempfile.NamedTemporaryFile("w", suffix=".sbatch", prefix="ortflow-check-") as f:
        f.write(script)
        f.flush()
        out = _ask(run, "sbatch", "--test-only", f.name)
    if out.returncode:
        said = " ".join((out.stderr or out.stdout).replace("sbatch: error:", "").split())
        problems.append(f"sbatch --test-only refuses the run's job ({said}): change the slurm section or "
                        "distributed.num_ranks (`ortflow render` prints the script)")
    return problems


def _ask(run: Runner, *args: str) -> subprocess.CompletedProcess:
    """One Slurm command; one that does not answer in time (an unreadable slurm.conf retries for a minute) fails."""
    try:
        return run(*args)
    except subprocess.TimeoutExpired as err:
        return subprocess.CompletedProcess(args, 124, "", f"no answer within {err.timeout:.0f} s")


def _partition_problems(cfg: RunConfig, run: Runner, listed: subprocess.CompletedProcess) -> list[str]:
    """The partition exists and has num_nodes nodes with room for num_ranks / num_nodes ranks each (``listed``:
    sinfo's partitions)."""
    slurm = cfg.slurm
    names = [name.rstrip("*") for name in listed.stdout.split()]
    default = next((name.rstrip("*") for name in listed.stdout.split() if name.endswith("*")), None)
    partition = slurm.partition or default
    if slurm.partition and slurm.partition not in names:
        return [f"slurm.partition {slurm.partition!r} does not exist on this cluster (partitions: "
                f"{', '.join(names) or 'none listed'}): name one of them"]
    if partition is None:
        return []  # no default partition: sbatch --test-only says what it makes of that
    nodes = _ask(run, "sinfo", "-h", "-N", "-p", partition, "-o", "%N %c")
    cpus: dict[str, int] = {}
    for line in nodes.stdout.splitlines():
        name, _, count = line.partition(" ")
        if count.strip().isdigit():
            cpus[name] = int(count)
    if not cpus:
        return []
    per_node = (int(cfg.distributed.num_ranks) // slurm.num_nodes) * threads_per_rank(cfg)
    fitting = sum(1 for count in cpus.values() if count >= per_node)
    if fitting < slurm.num_nodes:
        return [f"the job asks for {slurm.num_nodes} node(s) with {per_node} CPUs each (distributed.num_ranks "
                f"{cfg.distributed.num_ranks} over slurm.num_nodes {slurm.num_nodes}, {threads_per_rank(cfg)} CPU(s) "
                f"per rank), but partition {partition} has {fitting} such node(s) (CPUs per node: "
                f"{', '.join(f'{n}={c}' for n, c in sorted(cpus.items()))}): ask for fewer ranks per node or more "
                "nodes"]
    return []
