"""``ortflow run`` in a terminal: SIGINT/SIGTERM stop the ranks (and Prefect's temporary server, when the run started
one), and the ranks' stop lines reach the terminal; ``--verbose`` shows the log lines there too; an offline run logs no
telemetry error; a new database starts from the cached empty one. What a run prints, and a failed stage's message:
tests/prefect/test_run_terminal.py."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.support.prefect_runs import mlp_config, rank_pids, wait_for, write_config

pytestmark = pytest.mark.prefect

ORTFLOW = str(Path(sys.executable).parent / "ortflow")


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory) -> Path:
    """The XDG cache of this module's runs: the first temporary server on a new database keeps the empty database
    there, the later ones start from a copy."""
    return tmp_path_factory.mktemp("xdg-cache")


def _temporary_server_env(tmp_path: Path, cache_home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path / "prefect-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_SERVER_UI_ENABLED="false", OMP_NUM_THREADS="1",  # no API URL: a temporary server
               XDG_CACHE_HOME=str(cache_home))
    return env


def _flow_runs(database: Path) -> int:
    import sqlite3

    with sqlite3.connect(database) as db:
        return db.execute("SELECT count(*) FROM flow_run").fetchone()[0]


def test_the_temporary_servers_port_is_held_from_its_choice_until_the_server_serves_on_it(tmp_path, cache_home,
                                                                                         monkeypatch):
    """Concurrent ``ortflow run`` starts never race for a port: when the server process starts, its port is already
    bound (another process binding it fails), and the server answers on it."""
    import errno
    import socket

    from prefect.settings import PREFECT_HOME, temporary_settings

    from ortflow.deployments import local_server

    for name, value in _temporary_server_env(tmp_path, cache_home).items():
        monkeypatch.setenv(name, value)
    for name in [n for n in os.environ if n.startswith("PREFECT_") and n not in ("PREFECT_HOME",
                 "PREFECT_SERVER_ANALYTICS_ENABLED", "PREFECT_SERVER_UI_ENABLED")]:  # fmt: skip
        monkeypatch.delenv(name)
    taken = []
    popen = subprocess.Popen

    def start(command, **kwargs):
        port = int(kwargs["env"]["PREFECT_UI_API_URL"].rsplit(":", 1)[1].split("/")[0])
        with socket.socket() as other:  # another process asking for the same port before the server starts
            try:
                other.bind(("127.0.0.1", port))
            except OSError as err:
                taken.append(err.errno)
        return popen(command, **kwargs)

    monkeypatch.setattr(local_server.subprocess, "Popen", start)
    home = tmp_path / "prefect-home"
    # This process read its Prefect settings when it first imported Prefect: they must name the home set above.
    with temporary_settings(updates={PREFECT_HOME: home}):
        proc, url = local_server.start_server(timeout_s=120)
    try:
        assert taken == [errno.EADDRINUSE]
        assert local_server._healthy(url)
    finally:
        local_server.stop_server(proc)
    # the server migrated the new database in that home, and that database is the empty one kept for later servers
    assert local_server._migrated(home / "prefect.db") and local_server._migrated(local_server.empty_database_cache())


def test_a_new_database_starts_from_the_cached_empty_one_which_the_first_new_database_leaves_and_one_at_its_schema_skips_migrations(  # noqa: E501
    tmp_path, monkeypatch
):
    import sqlite3

    from ortflow.deployments import local_server

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cached = local_server.empty_database_cache()
    assert cached.parent == tmp_path / "cache" / "ortflow"
    first = tmp_path / "home-1" / "prefect.db"
    assert not local_server._seed(first) and not first.exists()  # nothing cached yet: the server creates it
    first.parent.mkdir()
    with sqlite3.connect(first) as db:  # what the server leaves once it has migrated it
        db.execute("CREATE TABLE alembic_version (version_num TEXT)")
        db.execute("INSERT INTO alembic_version VALUES ('head')")
    local_server._keep_empty(first)
    second = tmp_path / "home-2" / "prefect.db"
    assert local_server._seed(second)
    with sqlite3.connect(second) as db:
        assert db.execute("SELECT version_num FROM alembic_version").fetchall() == [("head",)]
    assert sorted(p.name for p in cached.parent.iterdir()) == [cached.name]  # no partial copy left
    # A later start on an existing database skips the migration check only where it would change nothing.
    assert local_server._at_current_schema(second)
    with sqlite3.connect(first) as db:
        db.execute("UPDATE alembic_version SET version_num = 'older'")
    assert not local_server._at_current_schema(first)
    assert not local_server._at_current_schema(tmp_path / "home-3" / "prefect.db")  # none there


def test_only_a_migrated_database_is_kept_or_copied_as_the_empty_one_and_none_is_created(tmp_path, monkeypatch):
    """A database that is missing or was never migrated (what a server that used another file leaves) is neither
    kept as the cached empty database nor created; a cached file that is no migrated database seeds nothing: a
    server on such a copy would skip its migrations and find no tables, and every later run would wait on it."""
    import sqlite3

    from ortflow.deployments import local_server

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    cached = local_server.empty_database_cache()
    missing = tmp_path / "home-1" / "prefect.db"
    local_server._keep_empty(missing)
    assert not missing.exists() and not missing.parent.exists() and not cached.exists()
    bare = tmp_path / "bare.db"
    sqlite3.connect(bare).close()  # a SQLite file without a schema
    local_server._keep_empty(bare)
    assert not cached.exists()
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"")  # a cache left empty
    fresh = tmp_path / "home-2" / "prefect.db"
    assert not local_server._seed(fresh) and not fresh.exists()


def test_the_temporary_server_is_given_the_database_ortflow_checks_seeds_and_keeps(tmp_path, monkeypatch):
    """The server's environment names the SQLite database whose state ortflow reads, seeds and keeps, also where the
    environment names another home than this process's settings (read when Prefect was first imported): else the
    server would migrate one file while ortflow kept another, never migrated, as the empty database."""
    from prefect.settings import PREFECT_HOME, temporary_settings

    from ortflow.deployments import local_server

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # empty: nothing is seeded anywhere
    with temporary_settings(restore_defaults={PREFECT_HOME}):  # this process's settings: the default home
        monkeypatch.setenv("PREFECT_HOME", str(tmp_path / "elsewhere"))  # set after they were read
        monkeypatch.setenv("PREFECT_API_DATABASE_CONNECTION_URL", f"sqlite+aiosqlite:///{tmp_path / 'other.db'}")
        env, database, _ = local_server._server_environment(4200)
    assert database is not None and not str(database).startswith(str(tmp_path))
    assert env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] == f"sqlite+aiosqlite:///{database}"
    assert "PREFECT_API_DATABASE_CONNECTION_URL" not in env  # the setting's former name, naming another file


def _start_training(tmp_path: Path, mlp_sources, name: str, cache_home: Path, server_env: dict[str, str] | None = None,
                    env: dict[str, str] | None = None, args: tuple[str, ...] = ()
                    ) -> tuple[subprocess.Popen, object, list[int]]:
    """``ortflow run --new-version [ARGS]`` of a long run in a process group of its own (as a terminal starts it),
    once its two ranks train; returns the process, the config and every process it started (the server included).

    With ``server_env`` (the session server's environment) the run reports to that server; else it starts its own
    temporary server (with ``env``, default :func:`_temporary_server_env`), which must run in a session of its own."""
    cfg = mlp_config(tmp_path, mlp_sources, name,
                     train={"num_train_steps": 4000000, "display_loss_steps": 20, "evaluation_period": 0},
                     checkpoint={"period": 1000000})
    config_file = write_config(cfg, tmp_path / f"{name}.yaml")
    proc = subprocess.Popen([ORTFLOW, "run", *args, str(config_file), "--new-version"],
                            env=server_env or env or _temporary_server_env(tmp_path, cache_home),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)

    def training() -> bool:
        return proc.poll() is not None or any(
            len(rank_pids(folder)) == 2 and (folder / "progress.json").exists()
            for folder in cfg.output_dir.glob("versions/*"))

    try:
        wait_for(training, 300, "two ranks training")
    except AssertionError as err:  # no run left behind, and what it printed
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # its server dies with it (PR_SET_PDEATHSIG)
        try:
            printed = proc.communicate(timeout=30)[0].decode()[-3000:]
        except subprocess.TimeoutExpired:
            printed = "(its output stayed open)"
        raise AssertionError(f"{err}; ortflow run printed:\n{printed}") from None
    assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
    family = _descendants(proc.pid)
    servers = [p for p in family if "uvicorn" in _cmdline(p) and "prefect.server" in _cmdline(p)]
    # No thread of the run started a Prefect server of its own in the terminal's process group (a Ctrl-C there would
    # crash it with a traceback); without a configured server, ortflow's own runs in a session of its own.
    assert len(servers) == (0 if server_env else 1), [_cmdline(p) for p in family]
    assert all(os.getsid(server) == server != os.getpgid(proc.pid) for server in servers), servers
    return proc, cfg, family


def _assert_cached_empty_database(cache_home: Path) -> None:
    """The empty database a new database starts from: kept by the first server on a new database, never a run in
    it (checked once the run is stopped: its ranks train meanwhile)."""
    import prefect

    assert _flow_runs(cache_home / "ortflow" / f"prefect-{prefect.__version__}-empty.db") == 0


def _stop(proc: subprocess.Popen, sig: int, to_group: bool, times: int) -> tuple[str, float]:
    """Send ``sig`` ``times`` times to ``ortflow run`` alone or to its process group; its output and the seconds it
    took to exit."""
    try:
        sent = time.monotonic()
        for _ in range(times):  # a second Ctrl-C, or a process manager repeating itself, keeps the stop clean
            os.killpg(proc.pid, sig) if to_group else proc.send_signal(sig)
            time.sleep(0.3)
        out = proc.communicate(timeout=120)[0].decode()
        return out, time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _assert_stopped(proc: subprocess.Popen, cfg, family: list[int], sig: int, out: str, took: float) -> Path:
    """A stopped run: exit 128 + the signal, a stop checkpoint named in the terminal, each rank's stop line there,
    the version ``stopped``, the flow run's final state in the log file, and no process left; returns the log file."""
    from ortflow.checkpoints import list_complete
    from ortflow.versions import read_registry

    assert proc.returncode == 128 + sig, out[-3000:]
    assert took < 30, f"ortflow run took {took:.0f} s to stop"
    assert f"stopped by {signal.Signals(sig).name}" in out and "Traceback" not in out, out[-3000:]
    wait_for(lambda: not any(_alive(p) for p in family), 30, "every process ortflow run started to exit")
    (entry,) = read_registry(cfg.output_dir)
    assert entry["status"] == "stopped", (entry, out[-3000:])
    stop_checkpoints = list_complete(Path(entry["path"]) / "checkpoints")
    assert stop_checkpoints and stop_checkpoints[-1].step % 1000000 != 0  # written on the stop, not by the period
    assert str(stop_checkpoints[-1].path) in out  # the message names it
    # Each rank's stop line (a warning) reaches the terminal; rank 0's checkpoint line is in the log file.
    step = stop_checkpoints[-1].step
    assert out.count(f"stop requested: ranks stopped together after step {step} (checkpoint saved)") == 2, out[-3000:]
    log_file = Path(re.search(r"the log is in (\S+)", out)[1])
    log = log_file.read_text()
    assert f"saved checkpoint {stop_checkpoints[-1].path}" in log, log[-3000:]
    assert re.search(r"prefect.flow_runs '.*' \| Finished in state (Crashed|Cancelled)", log), log[-3000:]
    assert "httpx" not in out  # the terminal shows ortflow's lines, not HTTP requests
    return log_file


#: Each signal, once and repeated, to ``ortflow run`` alone and to its whole process group. A signal to the group
#: also reaches everything the run started in it: those runs start their own temporary server (which must not get
#: it); the others report to the session's server, as a run with PREFECT_API_URL set does. SIGTERM once to the
#: group: the kill -9 test's next run.
@pytest.mark.parametrize(("sig", "to_group", "times"), [
    (signal.SIGINT, False, 1), (signal.SIGINT, True, 2), (signal.SIGTERM, False, 2),
])
def test_a_stop_signal_to_ortflow_run_leaves_a_stop_checkpoint_a_final_state_and_no_process(
    mlp_sources, tmp_path, cache_home, request, sig, to_group, times
):
    server_env = None if to_group else request.getfixturevalue("prefect_server")
    proc, cfg, family = _start_training(tmp_path, mlp_sources, "stopped", cache_home, server_env)
    out, took = _stop(proc, sig, to_group, times)
    if server_env is None:
        _assert_cached_empty_database(cache_home)
    _assert_stopped(proc, cfg, family, sig, out, took)


#: ``ortflow run`` whose flow run has completed at once; the summary takes a while, and a stop signal (the late
#: repeat of one sent twice, a process manager's) arrives while it is being reported or while the process exits.
_LATE_SIGNAL_RUN = """
import os, signal, sys, time
from ortflow.cli import main, run_flow

class Completed:
    name = "Completed"
    def is_completed(self): return True
    def result(self): return None

def report_summary(*_args):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.3)
    print("summary reported", flush=True)

def exiting():
    os.kill(os.getpid(), signal.SIGTERM)  # the interpreter is shutting down
    time.sleep(0.3)

import atexit
atexit.register(exiting)
run_flow._run_flow = lambda cfg, flow, received: Completed()
run_flow._report_summary = report_summary
sys.argv = ["ortflow", "run", sys.argv[1], "--new-version"]
main()
"""


def test_a_stop_signal_after_the_flow_run_ended_changes_neither_the_exit_status_nor_the_report(
    mlp_sources, tmp_path
):
    config_file = write_config(mlp_config(tmp_path, mlp_sources, "late"), tmp_path / "late.yaml")
    done = subprocess.run([sys.executable, "-c", _LATE_SIGNAL_RUN, str(config_file)], capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]  # not 143, nor killed by the signal (-15) while exiting
    assert "summary reported" in out and "Traceback" not in out, out[-3000:]
    assert "SIGTERM: the flow run has ended; ortflow run is exiting" in out, out[-3000:]


def _offline(env: dict[str, str]) -> dict[str, str]:
    """Offline: every request that would leave the host goes to a proxy that refuses connections; the temporary
    server on 127.0.0.1 is reached directly. Prefect's analytics setting is left as a user's environment has it."""
    env = {k: v for k, v in env.items() if k != "PREFECT_SERVER_ANALYTICS_ENABLED"}
    env.update(HTTPS_PROXY="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9", ALL_PROXY="http://127.0.0.1:9",
               NO_PROXY="127.0.0.1,localhost")
    return env


def test_kill_9_of_ortflow_run_leaves_no_server_behind_and_the_next_offline_run_marks_its_flow_run_crashed_logs_no_telemetry_error_and_stops_on_sigterm_to_its_group(  # noqa: E501
    mlp_sources, tmp_path, cache_home
):
    import sqlite3

    from ortflow.versions import read_registry

    proc, cfg, family = _start_training(tmp_path, mlp_sources, "killed", cache_home)
    proc.kill()
    proc.wait()
    wait_for(lambda: not any(_alive(p) for p in family), 30, "the temporary server and the ranks to exit")
    _assert_cached_empty_database(cache_home)
    (entry,) = read_registry(cfg.output_dir)
    database = tmp_path / "prefect-home" / "prefect.db"

    def state() -> tuple[str, str, str]:
        with sqlite3.connect(database) as db:
            return db.execute("SELECT name, state_type, state_name FROM flow_run WHERE id = ?",
                              (entry["flow_run_id"],)).fetchone()

    name, state_type, _ = state()
    assert state_type == "RUNNING"  # nobody was left to report its end
    # The next `ortflow run` on this machine (another config), offline, talks to a temporary server on the same
    # database; it trains until SIGTERM reaches its whole process group (the server, in a session of its own, must
    # not get it).
    proc, short, family = _start_training(tmp_path, mlp_sources, "next", cache_home, args=("-v",),
                                          env=_offline(_temporary_server_env(tmp_path, cache_home)))
    out, took = _stop(proc, signal.SIGTERM, True, 1)
    log = _assert_stopped(proc, short, family, signal.SIGTERM, out, took).read_text()
    assert f"flow run {name} was still Running, but its process is gone: marked Crashed" in out, out[-3000:]
    assert state()[1:] == ("CRASHED", "Crashed")
    lines = out.splitlines()
    assert lines[0].startswith("ortflow run next:"), lines[:3]  # printed at once, before the server starts
    assert any(line.startswith("starting a temporary Prefect server") for line in lines[:3]), lines[:3]
    port = re.search(r"Prefect server at http://127\.0\.0\.1:(\d+) until this run ends", out)[1]
    assert f"View at http://127.0.0.1:{port}/runs/flow-run/" in out  # Prefect's link (-v), on the real port
    assert "Beginning flow run" in out and "launching:" in out  # -v: the log's lines reach the terminal too
    assert "telemetry" not in out.lower(), out[-3000:]
    assert "telemetry" not in log.lower(), log[-3000:]
