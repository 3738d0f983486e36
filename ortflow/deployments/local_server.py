"""The temporary Prefect server (API and UI) of ``ortflow run`` when no ``PREFECT_API_URL`` is configured.

Prefect would start one itself, in the same process group as ``ortflow run``: a Ctrl-C in the terminal (SIGINT to the
whole group) then stops the server while the flow still reports its final state and publishes its artifacts, and the
flow waits on client retries. A ``kill -9`` of ``ortflow run`` leaves Prefect's server running. This server instead

* runs in a session of its own, so signals meant for ``ortflow run``'s group never reach it;
* gets SIGKILL from the kernel when the thread that started it dies (``PR_SET_PDEATHSIG``), so it never outlives a
  killed ``ortflow run``;
* is the API of every thread of ``ortflow run`` while it runs (Prefect's process-global settings and the environment
  name it too, not only the settings of the flow's context), so no thread ever starts a Prefect server of its own in
  ``ortflow run``'s process group, where a Ctrl-C would crash it with a traceback in the terminal;
* is stopped by ``ortflow run`` once the flow run has its final state and the buffered logs and events are sent;
* starts on a new database (a new ``PREFECT_HOME``) from ortflow's cached empty database of this Prefect version
  (``~/.cache/ortflow/``), which the first start of a temporary server on a new database leaves there: its 100-odd
  schema migrations and block registrations take seconds of CPU that every later new database is spared: a server
  on such a copy neither checks its migrations nor registers its blocks at start (unless
  ``PREFECT_SERVER_DATABASE_MIGRATE_ON_START`` or ``PREFECT_SERVER_REGISTER_BLOCKS_ON_START`` is set), which takes
  a fifth off the CPU of its start;
* is given the database file whose state it reads, seeds and keeps (``PREFECT_SERVER_DATABASE_CONNECTION_URL``), and
  keeps or copies only a migrated database: a server on a copy of anything else would skip its migrations and find
  no tables;
* skips the migration check on an existing database already at the schema of that cached empty database (every
  later run in the same ``PREFECT_HOME``): its migrations would change nothing (about 2 s of CPU per start);
* sends no usage heartbeat to Prefect (``PREFECT_SERVER_ANALYTICS_ENABLED=false`` unless set), so an offline run
  logs no error about it.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path

log = logging.getLogger(__name__)

#: Seconds to wait for the temporary server to answer (its database migrations are slow on a loaded machine).
STARTUP_TIMEOUT_S = 180.0
_PR_SET_PDEATHSIG = 1
#: The server's start-up work a copy of the cached empty database makes needless (each setting's names, the first is
#: Prefect's own): its schema migrations and its block registrations, seconds of CPU per start.
_START_CHECKS = (("PREFECT_SERVER_DATABASE_MIGRATE_ON_START", "PREFECT_API_DATABASE_MIGRATE_ON_START"),
                 ("PREFECT_SERVER_REGISTER_BLOCKS_ON_START", "PREFECT_API_BLOCKS_REGISTER_ON_START"))


#: The prefix of a SQLite database's connection URL.
SQLITE_URL = "sqlite+aiosqlite:///"


def _die_with_parent() -> None:  # runs in the forked child, before exec
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def _listening_socket() -> socket.socket:
    """A socket bound to a free local port, handed to the server process: asking for a free port and giving the
    server its number would leave a moment in which another process (another ``ortflow run``) takes it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
    except OSError:
        sock.close()
        raise
    return sock


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
            return resp.status == 200
    except OSError:
        return False


def start_server(timeout_s: float = STARTUP_TIMEOUT_S, on_wait: Callable[[float], None] | None = None,
                 every_s: float = 10.0) -> tuple[subprocess.Popen, str]:
    """Start Prefect's API and UI on a free local port in its own session; returns the process and API URL. The port
    is bound here and the socket handed to the server, so concurrent starts never race for a port.

    Args:
        timeout_s: Seconds to wait for it to answer.
        on_wait: Called with the seconds waited so far, every ``every_s`` while the server is not up yet.
        every_s: Seconds between ``on_wait`` calls.

    Raises:
        RuntimeError: the server exited or did not answer within ``timeout_s``.
    """
    import prefect

    with _listening_socket() as listener:  # the server process gets its own copy
        env, database, new_database = _server_environment(listener.getsockname()[1])
        # --fd: the server serves on the socket bound here (uvicorn's option for a socket a process manager passes).
        command = [sys.executable, "-m", "uvicorn", "--app-dir", str(Path(prefect.__file__).parent.parent),
                   "--factory", "prefect.server.api.server:create_app", "--fd", str(listener.fileno()),
                   "--log-level", "error", "--lifespan", "on"]
        proc = subprocess.Popen(command, env=env, stdin=subprocess.DEVNULL, start_new_session=True,
                                pass_fds=(listener.fileno(),),
                                preexec_fn=_die_with_parent)  # noqa: PLW1509 - only prctl runs before exec
    url = env["PREFECT_UI_API_URL"]
    start = time.monotonic()
    deadline, next_report = start + timeout_s, start + every_s
    try:
        while not _healthy(url):
            now = time.monotonic()
            if on_wait is not None and now >= next_report:
                on_wait(now - start)
                next_report += every_s
            if proc.poll() is not None or now > deadline:
                raise RuntimeError(
                    f"the temporary Prefect server did not start within {timeout_s:.0f} s (exit status "
                    f"{proc.poll()}); start one with `prefect server start` and set PREFECT_API_URL, then run again"
                )
            time.sleep(0.25)
    except BaseException:  # a stop signal while it starts, too
        stop_server(proc)
        raise
    if new_database:  # migrated and its blocks registered; nothing else is written before a flow runs
        _keep_empty(database)
    return proc, url


def _server_environment(port: int) -> tuple[dict[str, str], Path | None, bool]:
    """The temporary server's environment for ``port``, its SQLite database file (None for another database) and
    whether that database is new and not seeded from the cached empty one (then kept as that cache once it started)."""
    from prefect.settings import get_current_settings

    env = {
        **os.environ,
        **get_current_settings().to_environment_variables(exclude_unset=True),
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
        "PREFECT_UI_API_URL": f"http://127.0.0.1:{port}/api",  # the UI's calls go to this port, not the default
    }
    env.pop("PREFECT_API_URL", None)
    # Prefect's server sends an anonymous usage heartbeat when it starts; offline it logs an error for it into the
    # terminal of `ortflow run`. The temporary server sends none, unless the environment asks for it.
    env.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    database = _sqlite_file(get_current_settings())
    if database is not None:  # the server's database is the one checked, seeded and kept here, whatever else names one
        env["PREFECT_SERVER_DATABASE_CONNECTION_URL"] = f"{SQLITE_URL}{database}"
        env.pop("PREFECT_API_DATABASE_CONNECTION_URL", None)  # the setting's former name
    fresh = database is not None and not database.exists()
    seeded = fresh and _seed(database)
    new_database = fresh and not seeded
    # A copy is at this Prefect version's schema with its blocks registered: nothing to check or write. An existing
    # database at that schema has nothing to migrate (Prefect remembers the blocks it registered there).
    checks = _START_CHECKS if seeded else _START_CHECKS[:1] if not fresh and _at_current_schema(database) else ()
    for names in checks:
        if not any(name in env for name in names):
            env[names[0]] = "false"
    return env, database, new_database


def empty_database_cache() -> Path:
    """Where the empty database of this Prefect version is kept (``$XDG_CACHE_HOME/ortflow``, default
    ``~/.cache/ortflow``)."""
    import prefect

    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "ortflow"
    return root / f"prefect-{prefect.__version__}-empty.db"


def _sqlite_file(settings) -> Path | None:
    """The server's SQLite database file (None for another database)."""
    url = settings.server.database.connection_url
    url = url.get_secret_value() if hasattr(url, "get_secret_value") else str(url or "")
    return Path(url[len(SQLITE_URL):]) if url.startswith(SQLITE_URL) and ":memory:" not in url else None


def _at_current_schema(database: Path | None) -> bool:
    """Whether the existing SQLite ``database`` has the schema revision of this Prefect version's cached empty
    database (False when either cannot be read)."""
    cached = empty_database_cache()
    if database is None or not cached.is_file():
        return False
    try:
        revisions = [_schema_revisions(path) for path in (database, cached)]
    except sqlite3.Error:
        return False
    return bool(revisions[0]) and revisions[0] == revisions[1]


def _schema_revisions(database: Path) -> set[str]:
    """The schema revisions (Alembic's) a SQLite database records, read only (a missing file is an error, not a new
    database)."""
    with contextlib.closing(sqlite3.connect(f"{database.resolve().as_uri()}?mode=ro", uri=True)) as db:
        return {row[0] for row in db.execute("SELECT version_num FROM alembic_version")}


def _migrated(database: Path) -> bool:
    """Whether ``database`` is a SQLite database that records a schema revision (a server migrated it)."""
    try:
        return bool(_schema_revisions(database))
    except sqlite3.Error:
        return False


def _seed(database: Path) -> bool:
    """Copy the cached empty database to ``database`` (a new one); False when there is none to copy, or only a file
    that is no migrated database (a server on a copy of it would neither migrate nor find its tables)."""
    cached = empty_database_cache()
    if not cached.is_file() or not _migrated(cached):
        return False
    database.parent.mkdir(parents=True, exist_ok=True)
    partial = database.with_name(f".{database.name}.{os.getpid()}")
    try:
        shutil.copyfile(cached, partial)
        os.replace(partial, database)
    except OSError as err:  # the server creates it then
        partial.unlink(missing_ok=True)
        log.debug("could not copy the cached empty Prefect database: %s", err)
        return False
    return True


def _keep_empty(database: Path) -> None:
    """Keep a consistent copy of the just-created ``database`` as this Prefect version's empty database (best
    effort: a cache). Only a migrated database is kept, and ``database`` is read, never created."""
    if not _migrated(database):
        log.debug("not keeping %s as the empty Prefect database: it is no migrated database", database)
        return
    cached = empty_database_cache()
    partial = cached.with_name(f".{cached.name}.{os.getpid()}")
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.closing(sqlite3.connect(f"{database.resolve().as_uri()}?mode=ro", uri=True)) as source, \
                contextlib.closing(sqlite3.connect(partial)) as copy:
            source.backup(copy)
        os.replace(partial, cached)
    except (OSError, sqlite3.Error) as err:
        partial.unlink(missing_ok=True)
        log.debug("could not keep the empty Prefect database: %s", err)


def stop_server(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGTERM the server's session, SIGKILL it after ``grace_s``."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def _drain() -> None:
    """Send the logs and events still buffered in this process while the server is up."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):
            worker.drain_all(timeout=15)


@contextlib.contextmanager
def api_server(say: Callable[[str], None] | None = None) -> Iterator[str]:
    """The Prefect API for this process: ``PREFECT_API_URL`` when set, else a temporary server for the block.

    Args:
        say: Prints a line for the user: one when a temporary server starts, then one every 10 s until it answers.

    Yields:
        The API URL the flow reports to.
    """
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL, temporary_settings

    configured = PREFECT_API_URL.value()
    if configured:
        yield configured
        return
    say = say or (lambda line: None)
    say("starting a temporary Prefect server (no PREFECT_API_URL is set; the first start on a machine takes longest)")
    proc, url = start_server(on_wait=lambda waited: say(f"  still starting the Prefect server ({waited:.0f} s)"))
    say(f"Prefect server at {url.removesuffix('/api')} until this run ends")
    try:
        # Its UI is on the same port: Prefect's "View at" link points there, not at the default port.
        ui_url = url.removesuffix("/api")
        with _process_wide(url, ui_url), temporary_settings(updates={PREFECT_API_URL: url, PREFECT_UI_URL: ui_url}):
            try:
                yield url
            finally:
                _drain()
    finally:
        stop_server(proc)


@contextlib.contextmanager
def _process_wide(api_url: str, ui_url: str) -> Iterator[None]:
    """``PREFECT_API_URL``/``PREFECT_UI_URL`` for every thread of this process for the block: in the environment and
    in Prefect's process-global settings, which a thread started without a copy of the caller's context reads (a
    Prefect client there would otherwise start a server of its own)."""
    from prefect.context import refresh_global_settings_context

    saved = {name: os.environ.get(name) for name in ("PREFECT_API_URL", "PREFECT_UI_URL")}
    os.environ.update(PREFECT_API_URL=api_url, PREFECT_UI_URL=ui_url)
    refresh_global_settings_context()
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        refresh_global_settings_context()
