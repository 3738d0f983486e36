"""Two simulated hosts on one machine: ranks in two network + UTS namespaces, MPICH launching across them.

Each namespace has its own hostname and address (a veth pair, 10.19.x.1 and .2); the run folder is shared (one
filesystem). MPI sees two nodes of one rank each (local size 1) and exchanges over TCP between the addresses, as it
would between machines. Needs root (``ip netns``); skipped otherwise.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.faults import procs
from tests.support.runs import make_run

pytestmark = [pytest.mark.mpi, pytest.mark.faults]
NSEXEC = str(Path(__file__).with_name("nsexec.sh"))


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


@pytest.fixture
def two_hosts():
    """Two namespaces joined by a veth pair; yields their host names; removed afterwards."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
        pytest.skip("needs root, ip and unshare to make network namespaces")
    tag = f"of{os.getpid() % 100000}"
    hosts, net = (f"{tag}a", f"{tag}b"), f"10.{19 + os.getpid() % 200}.{os.getpid() % 250}"
    try:
        for host in hosts:
            sh("ip", "netns", "add", host)
            Path(f"/etc/netns/{host}").mkdir(parents=True, exist_ok=True)
            Path(f"/etc/netns/{host}/hosts").write_text(
                f"127.0.0.1 localhost\n{net}.1 {hosts[0]}\n{net}.2 {hosts[1]}\n")
        sh("ip", "link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb")
        for i, host in enumerate(hosts):
            dev = f"{tag}v{'ab'[i]}"
            sh("ip", "link", "set", dev, "netns", host)
            sh("ip", "netns", "exec", host, "ip", "addr", "add", f"{net}.{i + 1}/24", "dev", dev)
            sh("ip", "netns", "exec", host, "ip", "link", "set", dev, "up")
            sh("ip", "netns", "exec", host, "ip", "link", "set", "lo", "up")
    except (subprocess.CalledProcessError, OSError) as err:
        pytest.skip(f"cannot make network namespaces here: {err}")
    yield hosts
    for host in hosts:
        subprocess.run(["ip", "netns", "del", host], capture_output=True, check=False)
        shutil.rmtree(f"/etc/netns/{host}", ignore_errors=True)


def digests(output: str) -> dict[tuple[int, int], str]:
    found = re.findall(r"rank (\d+) parameters sha256 ([0-9a-f]{64}) at step (\d+)", output)
    return {(int(rank), int(step)): digest for rank, digest, step in found}


def test_two_hosts_train_to_the_same_parameters_as_two_local_ranks(tmp_path, two_hosts):
    first, second = two_hosts
    hostfile = tmp_path / "hosts"
    hostfile.write_text(f"{first}:1\n{second}:1\n")
    train = {"num_train_steps": 10}  # two checkpoints (period 5)
    local = make_run(tmp_path, "local", distributed={"num_ranks": 2, "threads_per_rank": 1}, train=train)
    spread = make_run(tmp_path, "spread", distributed={"num_ranks": 2, "threads_per_rank": 1, "num_hosts": 2,
                                                       "hostfile": str(hostfile)}, train=train)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HYDRA_LAUNCHER": "ssh", "HYDRA_LAUNCHER_EXEC": NSEXEC}
    # `ortflow train` itself runs on the first host, as a user would run it on the head node.
    across = subprocess.run(
        ["ip", "netns", "exec", first, "unshare", "--uts", "sh", "-c",
         f"hostname {first}; exec {procs.ORTFLOW} train {spread.output_dir}"],
        capture_output=True, text=True, env=env, timeout=300, check=False)
    alone = procs.ortflow_here("train", str(local.output_dir))  # on this host, in this process
    out_across, out_alone = across.stdout + across.stderr, alone.stdout
    assert across.returncode == 0, out_across[-3000:]
    assert alone.returncode == 0, out_alone[-3000:]
    # Two nodes of one rank each (MPI's shared-memory split), against one node of two ranks.
    assert "rank 0/2 (local 0/1)" in out_across and "rank 1/2 (local 0/1)" in out_across
    assert "rank 1/2 (local 1/2)" in out_alone
    seen_across, seen_alone = digests(out_across), digests(out_alone)
    assert seen_across and seen_across == seen_alone  # every checkpoint step, both ranks: bit-identical parameters
