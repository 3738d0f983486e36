"""Shared-memory segments that MPICH ranks leave when they die before ``MPI_Finalize`` (killed, or aborting on an
error) are removed by the launcher once the job has ended (``ortflow.processes.remove_orphan_segments``): each is a
few MB of memory that would otherwise stay in ``/dev/shm`` until the host reboots."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from ortflow.processes import MPICH_SHM_PREFIX, SHM_DIR, remove_orphan_segments


def test_only_unmapped_segments_written_since_the_job_started_are_removed(tmp_path):
    since = time.time() - 60
    names = {"orphan": "mpich_shm_1", "mapped": "mpich_shm_2", "older": "mpich_shm_3", "other": "other_4"}
    paths = {k: tmp_path / v for k, v in names.items()}
    for path in paths.values():
        path.write_bytes(b"\0" * 4096)
        os.utime(path, (since + 30, since + 30))
    os.utime(paths["older"], (since - 30, since - 30))  # written before the job started: not the job's
    holder = subprocess.Popen([sys.executable, "-c", "import mmap, sys, time\n"
                               "f = open(sys.argv[1], 'r+b'); m = mmap.mmap(f.fileno(), 0)\n"
                               "print('mapped', flush=True); time.sleep(60)", str(paths["mapped"])],
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert holder.stdout.readline().strip() == "mapped"
        removed = remove_orphan_segments(since, directory=str(tmp_path), prefix="mpich_shm_", settle_s=0.2)
    finally:
        holder.kill()
        holder.wait()
    assert removed == [str(paths["orphan"])]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(n for k, n in names.items() if k != "orphan")


def test_a_job_whose_ranks_fail_leaves_no_segment_behind(tmp_path, caplog):
    from ortflow.launch.local import launch
    from tests.support.runs import MPIEXEC, make_run

    cfg = make_run(tmp_path, "broken", distributed={"num_ranks": 2})
    (cfg.output_dir / "artifacts" / "training_model.onnx").write_bytes(b"altered")  # every rank stops after MPI init
    started = time.time()
    with caplog.at_level(logging.INFO, logger="ortflow.launch.local"):
        result = launch(cfg.output_dir, 2, mpiexec=MPIEXEC, on_line=lambda line: None)
    returned = time.time()
    assert result.returncode != 0 and "does not match its sha256" in "\n".join(result.error_lines)
    # The job's own clean-up removed its ranks' segments, unless a job that another test process launched in between
    # reclaimed them first (every launch removes what earlier jobs left): either way none may be left. With no other
    # launch at that moment, only this job's clean-up can remove them, so a broken clean-up fails the check below.
    cleaned = "shared-memory segment(s) the job's ranks left" in caplog.text
    # No unmapped segment written while the job ran is left (one written in the last moments may be another test's).
    left = [p for p in Path(SHM_DIR).glob(f"{MPICH_SHM_PREFIX}*")
            if started <= _mtime(p) <= returned - 1.5 and not _mapped(p)]
    assert left == [], (left, cleaned)


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def _mapped(path: Path) -> bool:
    for maps in Path("/proc").glob("[0-9]*/maps"):
        try:
            if str(path) in maps.read_text():
                return True
        except OSError:
            continue
    return False
