"""A real Slurm cluster on one host for the tests: munged, slurmctld and one slurmd per node (two nodes of one CPU
each by default, told apart by their names and ports) started as root in a temporary folder.

Needs Debian's ``slurm-wlm`` and ``munge`` packages and root (the daemons switch users and own their spool folders);
:func:`unavailable` says why a machine cannot run it, so the tests skip with that reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "squeue", "scancel", "scontrol")


def unavailable() -> str | None:
    """Why this machine cannot start the test cluster, or None when it can."""
    missing = [name for name in DAEMONS + CLIENTS
               if not (shutil.which(name) or Path(f"/usr/sbin/{name}").exists())]  # fmt: skip
    if missing:
        return (f"Slurm test cluster: {', '.join(missing)} not installed (apt-get install slurm-wlm munge; "
                ".ci/run installs them when run as root)")
    if os.geteuid() != 0:
        return "Slurm test cluster: the daemons need root (run as root, as .ci/run does in CI)"
    return None


def _daemon(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _config(root: Path, nodes: list[str], cpus: int, munge_socket: Path) -> str:
    host = socket.gethostname().split(".")[0]
    lines = [
        "ClusterName=ortflowtest",
        f"SlurmctldHost={host}",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"SlurmctldPort={_free_port()}",
        "AuthType=auth/munge",
        # cred_expire: a requeued job waits this long before it may start again (120 s by default; 5 s is the least
        # slurmctld accepts).
        f"AuthInfo=socket={munge_socket},cred_expire=5",
        f"StateSaveLocation={root}/state",
        f"SlurmdSpoolDir={root}/spool-%n",  # %n: the node's name, one slurmd per node
        f"SlurmctldPidFile={root}/slurmctld.pid",
        f"SlurmdPidFile={root}/slurmd-%n.pid",
        f"SlurmctldLogFile={root}/slurmctld.log",
        f"SlurmdLogFile={root}/slurmd-%n.log",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "MpiDefault=none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        # The nodes' CPUs are the configured ones: slurmd does not drain a node whose host has fewer.
        "SlurmdParameters=config_overrides",
        "ReturnToService=2",
        "SchedulerType=sched/backfill",
        # The main scheduler looks at pending jobs every second (60 s by default): a requeued job starts as soon as
        # its hold (cred_expire) ends.
        "SchedulerParameters=sched_interval=1",
        "JobRequeue=1",
        "KillWait=30",
        "MinJobAge=600",
        "SlurmctldTimeout=30",
        "SlurmdTimeout=60",
        "InactiveLimit=0",
    ]
    lines += [f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={_free_port()} CPUs={cpus} State=UNKNOWN"
              for node in nodes]  # fmt: skip
    lines += [f"PartitionName=debug Nodes={','.join(nodes)} Default=YES MaxTime=INFINITE State=UP", ""]
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(pid_files: list[Path]) -> None:
    """SIGTERM every daemon at once and wait for each to exit (SIGKILL after 30 s): each takes a few seconds."""
    pids = []
    for pid_file in pid_files:
        try:
            pids.append(int(pid_file.read_text().strip()))
        except (OSError, ValueError):
            continue
        with contextlib.suppress(ProcessLookupError):
            os.kill(pids[-1], signal.SIGTERM)
    deadline = time.monotonic() + 30
    while pids and time.monotonic() < deadline:
        pids = [pid for pid in pids if _alive(pid)]
        time.sleep(0.1)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@contextlib.contextmanager
def slurm_cluster(root: Path, num_nodes: int = 2, cpus: int = 1) -> Iterator[dict[str, str]]:
    """Start munged, slurmctld and a slurmd for each of ``num_nodes`` nodes (``cpus`` CPUs each) with a config in
    ``root``; yields the environment for the clients (``SLURM_CONF``) and stops every daemon (by its pid file) when
    the block ends."""
    nodes = [f"node{i + 1}" for i in range(num_nodes)]
    for sub in ("state", "munge"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    key, socket_path, munge_pid = root / "munge" / "munge.key", root / "munge" / "munge.socket", root / "munged.pid"
    conf = root / "slurm.conf"
    conf.write_text(_config(root, nodes, cpus, socket_path))
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    env = {**os.environ, "SLURM_CONF": str(conf)}
    started: list[Path] = []
    try:
        subprocess.run([_daemon("munged"), "--force", f"--key-file={key}", f"--socket={socket_path}",
                        f"--pid-file={munge_pid}", f"--log-file={root}/munged.log", f"--seed-file={root}/munge.seed"],
                       check=True, env=env, capture_output=True)  # fmt: skip
        started.append(munge_pid)
        subprocess.run([_daemon("slurmctld"), "-f", str(conf)], check=True, env=env, capture_output=True)
        started.append(root / "slurmctld.pid")
        for node in nodes:
            (root / f"spool-{node}").mkdir(exist_ok=True)
            subprocess.run([_daemon("slurmd"), "-f", str(conf), "-N", node], check=True, env=env, capture_output=True)
            started.append(root / f"slurmd-{node}.pid")
        _wait_idle(env, root, num_nodes)
        yield env
    finally:
        _stop(started)


def _wait_idle(env: dict[str, str], root: Path, num_nodes: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    states: list[str] = []
    while time.monotonic() < deadline:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=env, capture_output=True, text=True)
        states = out.stdout.split()
        if len(states) == num_nodes and all(state.startswith("idle") for state in states):
            return
        time.sleep(0.5)
    logs = "\n".join(path.read_text()[-2000:] for path in sorted(root.glob("slurm*.log")))
    raise RuntimeError(f"the test Slurm nodes are not idle after {timeout_s:.0f} s (states {states}):\n{logs}")


if __name__ == "__main__":  # a cluster to try things by hand: python -m tests.launch.slurm_cluster ROOT
    import sys

    with slurm_cluster(Path(sys.argv[1])) as cluster_env:
        # Blocked only now: the daemons started above must not inherit a mask that would keep SIGTERM from them.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})  # sigwait below receives them
        print(f"export SLURM_CONF={cluster_env['SLURM_CONF']}", flush=True)
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
