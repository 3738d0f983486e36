"""`make test`, the command CI runs (.ci/run execs it), fails whenever pytest does, also when no test was collected
(pytest's status 5: a wrong path or marker must not pass as a green suite); its files start slowest first."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]


def make_test(folder: Path) -> subprocess.CompletedProcess:
    """`make test` on ``folder`` only, in this process (no xdist workers), without re-installing (``-o setup``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "MAKE"))}
    return subprocess.run(
        ["make", "-C", str(ROOT), "-o", "setup", "test", "TEST_WORKERS=0", f"BIN={Path(sys.executable).parent}",
         f"PYTEST_ARGS=-p no:cacheprovider {folder}"],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_test_fails_when_no_test_is_collected_and_passes_when_the_tests_do(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = make_test(empty)
    assert out.returncode != 0 and "no tests ran" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    (tmp_path / "one" / "test_one.py").parent.mkdir()
    (tmp_path / "one" / "test_one.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
    out = make_test(tmp_path / "one")
    assert out.returncode == 0 and "1 passed" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]
    # And ortflow's bytecode is current, so the processes the suite starts do not compile it from source.
    stale = [str(p) for p in (ROOT / "ortflow").rglob("*.py") if not _current_bytecode(p)]
    assert not stale, stale[:5]


def _current_bytecode(source: Path) -> bool:
    """Whether the interpreter would load ``source`` from its cached bytecode (a .pyc recording its mtime and size)."""
    import importlib.util

    cached = Path(importlib.util.cache_from_source(str(source)))
    if not cached.exists():
        return False
    header, stat = cached.read_bytes()[:16], source.stat()
    return (int.from_bytes(header[8:12], "little") == int(stat.st_mtime) & 0xFFFFFFFF
            and int.from_bytes(header[12:16], "little") == stat.st_size & 0xFFFFFFFF)


def test_files_start_slowest_first_and_keep_their_tests_in_order(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from tests import conftest

    table = tmp_path / "durations.json"
    table.write_text('{"tests/b.py": 50.0, "tests/c.py": 900.5}')
    monkeypatch.setattr(conftest, "TABLE", table)
    ids = ["tests/a.py::t1", "tests/b.py::t2", "tests/b.py::t1", "tests/c.py::t", "tests/d.py::t", "tests/a.py::t0"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    conftest.pytest_collection_modifyitems(None, items)
    assert [i.nodeid for i in items] == ["tests/c.py::t", "tests/b.py::t2", "tests/b.py::t1", "tests/a.py::t1",
                                         "tests/a.py::t0", "tests/d.py::t"]  # unlisted files: pytest's order
