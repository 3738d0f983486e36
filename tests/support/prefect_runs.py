"""Run configs and process checks for the pipeline tests."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import yaml

from ortflow.config import RunConfig, config_from_dict
from ortflow.launch.job import STOP_GRACE_S

#: A liveness bound for a stopped run's final state: it comes once the ranks stopped (within the stop grace) and the
#: process that reports it (the flow-run process, or the job's guard, whose import of Prefect may still be running on
#: a loaded machine) has reported it.
FINAL_STATE_S = 2 * STOP_GRACE_S + 60


def mlp_config(root: Path, sources: dict[str, Path], name: str, **sections: dict) -> RunConfig:
    """A 2-rank MLP run under ``root/name``; ``sections`` update config sections."""
    raw = {
        "name": name,
        "output_dir": str(root / name),
        "model": {"path": str(sources["model"])},
        "data": {"train": [str(sources["data"])], "eval_fraction": 0.125, "rows_per_shard": 100},
        "train": {"batch_size": 4, "num_train_steps": 20, "display_loss_steps": 5, "evaluation_period": 10},
        "optimizer": {"learning_rate": 0.01},
        "distributed": {"num_ranks": 2, "threads_per_rank": 1},
        "checkpoint": {"period": 5, "max_num_checkpoints": 2},
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values} if isinstance(values, dict) else values
    return config_from_dict(raw)


def write_config(cfg: RunConfig, path: Path) -> Path:
    """The config as a YAML file (absolute paths)."""
    path.write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))
    return path


def processes_mentioning(text: str) -> list[int]:
    """Pids of live processes (not zombies) whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if text in cmdline and state != "Z":
            found.append(int(entry.name))
    return found


def rank_pids(run_dir: Path) -> list[int]:
    """Pids of the training ranks of a run (``python -u -m ortflow.trainer RUN_DIR``)."""
    return [pid for pid in processes_mentioning(str(run_dir)) if b"ortflow.trainer" in _cmdline(pid)
            and b"mpiexec" not in _cmdline(pid) and b"hydra" not in _cmdline(pid)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def wait_for(condition: Callable[[], object], timeout: float, what: str, interval: float = 0.2) -> object:
    """Poll ``condition`` until it returns something truthy; fail with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


def final_parameters(cfg: RunConfig) -> dict[str, np.ndarray]:
    """Trainable parameters of the run's newest complete checkpoint."""
    import h5py

    from ortflow.checkpoints import list_complete

    newest = list_complete(cfg.checkpoints_dir)[-1]
    with h5py.File(newest.path / "params.h5", "r") as f:  # plain h5py: one dataset per parameter
        return {ds.attrs["name"]: ds[()] for ds in f["parameters"].values() if ds.attrs["requires_grad"]}


def wait_for_periodic_checkpoint(output_dir: Path, timeout: float = 300) -> Path:
    """The version folder of a versioned run once its two ranks train and it has a complete checkpoint."""
    from ortflow.checkpoints import list_complete

    def ready():
        folders = list(Path(output_dir).glob("versions/*"))
        return folders and len(rank_pids(folders[0])) == 2 and list_complete(folders[0] / "checkpoints") and folders[0]

    return wait_for(ready, timeout, "two ranks training past a periodic checkpoint")


@contextlib.contextmanager
def sigint_taken() -> Iterator[None]:
    """Processes started in the block take SIGINT even where this one ignores it (a suite started in the background
    of a script does, and children inherit an ignored signal): a Prefect worker stops on SIGTERM by sending itself
    SIGINT, and one that ignores it keeps running until killed."""
    previous = signal.getsignal(signal.SIGINT)
    if previous == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a handler, reset to the default by exec
    try:
        yield
    finally:
        if previous == signal.SIG_IGN:
            signal.signal(signal.SIGINT, previous)
