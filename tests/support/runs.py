"""Helpers that make real, tiny run folders (configured and sharded) for the trainer's tests."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from ortflow.config import RunConfig, config_from_dict
from ortflow.configure.configure import configure
from ortflow.dataprep import prepare_data
from ortflow.examples.mlp import build_mlp
from ortflow.protocol import THREADS_ENV

MPIEXEC = str(Path(sys.executable).parent / "mpiexec")
#: Where jobs start (the folder pytest runs in). A job started from a background thread (:func:`start_ranks`) would
#: otherwise inherit whatever folder the test's own thread is in at that moment: configure builds split artifacts
#: inside a scratch folder it makes the current one, and renames it when done (mpiexec then cannot enter it).
_LAUNCH_DIR = os.getcwd()


def make_run(root: Path, name: str, *, num_rows: int = 512, model: Path | None = None, model_fields: dict | None = None,
             **sections) -> RunConfig:
    """Configure + shard an MLP classifier run under ``root/name``; ``sections`` override config sections and
    ``model_fields`` the model section's fields other than its path."""
    root.mkdir(parents=True, exist_ok=True)
    model = model or root / "mlp.onnx"
    if not model.exists():
        build_mlp(model, num_features=8, hidden=16, num_classes=3, seed=0)
    data = root / "data.npz"
    if not data.exists():
        rng = np.random.default_rng(0)
        features = rng.normal(size=(num_rows, 8)).astype(np.float32)
        labels = (features[:, 0] > 0).astype(np.int64) + (features[:, 1] > 1).astype(np.int64)
        np.savez(data, features=features, labels=labels)
    raw = {
        "name": name,
        "output_dir": str(root / name),
        "model": {"path": str(model), **(model_fields or {})},
        "data": {"train": [str(data)], "eval_fraction": 0.125, "rows_per_shard": 100},
        "train": {"batch_size": 4, "num_train_steps": 20, "display_loss_steps": 1, "evaluation_period": 0},
        "optimizer": {"learning_rate": 0.01},
        "checkpoint": {"period": 5, "max_num_checkpoints": 2},
    }
    for section, values in sections.items():
        raw[section] = {**raw.get(section, {}), **values} if isinstance(values, dict) else values
    cfg = config_from_dict(raw)
    _configure(cfg)
    prepare_data(cfg)
    return cfg


#: configure fingerprint -> the first run folder configured with it in this test process (:func:`reuse_configured`).
_CONFIGURED: dict[str, Path] = {}
#: Whether :func:`make_run` starts a run from a copy of an earlier run's artifacts with the same fingerprint (on for
#: the trainer's tests: tests/trainer/conftest.py).
REUSE_CONFIGURED = False


def _configure(cfg: RunConfig) -> None:
    """configure ``cfg``; with :data:`REUSE_CONFIGURED`, from a copy of the artifacts an earlier run of this process
    built from the same model bytes, model section and layout (the same configure fingerprint): configure verifies
    the copies against the copied record (checksums) and reuses them, as it does for a copied run folder."""
    from ortflow.configure.configure import CONFIGURE_RECORD_NAME, fingerprint

    if not REUSE_CONFIGURED:
        configure(cfg)
        return
    try:
        key = fingerprint(cfg)
    except OSError:  # a missing model: configure names it
        configure(cfg)
        return
    source = _CONFIGURED.get(key)
    if (source is not None and source != cfg.output_dir and (source / CONFIGURE_RECORD_NAME).exists()
            and not (cfg.output_dir / CONFIGURE_RECORD_NAME).exists()):
        _copy_configured(source, cfg.output_dir)
    result = configure(cfg)
    if source is None or not result.reused:
        _CONFIGURED[key] = cfg.output_dir


def _copy_configured(source: Path, target: Path) -> None:
    """Copy a configured run folder's artifacts (and torch-named model) and its configure record into ``target``."""
    from ortflow.configure.configure import CONFIGURE_RECORD_NAME
    from ortflow.configure.torch_model import TORCH_MODEL_DIR

    target.mkdir(parents=True, exist_ok=True)
    for folder in ("artifacts", TORCH_MODEL_DIR):
        if (source / folder).is_dir() and not (target / folder).exists():
            shutil.copytree(source / folder, target / folder)
    shutil.copy2(source / CONFIGURE_RECORD_NAME, target / CONFIGURE_RECORD_NAME)


def copied_run(source, make, root: Path, name: str, **sections):
    """``make(root, name, **sections)`` in a folder that holds a copy of ``source``'s configured artifacts (a run of
    the same model and layout: the same configure fingerprint): configure verifies the copies against the copied
    record and reuses them, recording their new place, instead of building them again."""
    target = root / name
    target.mkdir(parents=True)
    _copy_configured(source.output_dir, target)
    cfg = make(root, name, **sections)
    again = configure(cfg)
    assert again.reused and again.info["artifacts_dir"] == str(cfg.artifacts_dir), again.info["artifacts_dir"]
    return cfg


#: Whether the ranks of :func:`rank_command` run one intra-op thread each where their config leaves the count to the
#: host (on for the trainer's tests: tests/trainer/conftest.py). A rank alone on the 2-core test machine would
#: otherwise take both cores with spinning threads for graphs too small to share (a quarter of a one-rank job's CPU,
#: measured), beside the other test process's jobs; ranks that share the host take one each anyway.
ONE_THREAD = False


def named_past_the_check(cfg: RunConfig, folder: Path, refusal: str) -> RunConfig:
    """``cfg`` naming ``folder``, a checkpoint of another split, with ``checkpoint.checkpoint_to_load_path``: configure
    refuses to record it (its error holds ``refusal``), so it is written into the run folder past that check, for the
    ranks' own check (which also guards a run folder on object storage, where the commands leave it to the ranks)."""
    from ortflow.config import ConfigError, write_resolved_config

    named = cfg.model_copy(update={"checkpoint": cfg.checkpoint.model_copy(
        update={"checkpoint_to_load_path": Path(folder)})})
    try:
        configure(named)
    except ConfigError as err:
        assert refusal in str(err), err
    else:
        raise AssertionError(f"configure recorded {folder}, a checkpoint of another split")
    write_resolved_config(named)
    return named


def rank_command(cfg: RunConfig, script: str | None = None, *args: str) -> list[str]:
    """mpiexec command for the run's ranks: the real entry point, or a test script wrapping it."""
    target = [script, *args] if script else ["-m", "ortflow.trainer"]
    threads = ["-genv", THREADS_ENV, "1"] if ONE_THREAD else []
    return [MPIEXEC, "-n", str(cfg.distributed.num_ranks), *threads, "-prepend-rank", sys.executable, "-u", *target,
            str(cfg.output_dir)]


def run_ranks(
    cfg: RunConfig, script: str | None = None, *args: str, timeout: float = 120
) -> subprocess.CompletedProcess:
    """Run the job to its end; output (both streams) in ``.stdout``."""
    return _run(rank_command(cfg, script, *args), timeout)


def _run(command: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
                          env=env, stdin=subprocess.DEVNULL, check=False, cwd=_LAUNCH_DIR)


_BACKGROUND = None


def start_ranks(cfg: RunConfig, timeout: float = 600):
    """Start the job and return at once: a future of :func:`run_ranks`'s result (``.result()`` waits for it), so that
    the test can configure its next run while this one trains."""
    return _pool().submit(_run, rank_command(cfg), timeout)


def _pool():
    from concurrent.futures import ThreadPoolExecutor

    global _BACKGROUND
    if _BACKGROUND is None:
        _BACKGROUND = ThreadPoolExecutor(4, thread_name_prefix="ranks")
    return _BACKGROUND


def start_script_ranks(cfg: RunConfig, script: str, *args: str, timeout: float = 120):
    """Start the job of a test script wrapping the entry point (:func:`run_ranks`) and return at once: a future of
    ``(result, seconds the job ran)``, so that a job that mostly waits (a rank made to hang) overlaps the test's other
    jobs."""
    import time

    command = rank_command(cfg, script, *args)

    def timed():
        started = time.monotonic()
        out = _run(command, timeout)
        return out, time.monotonic() - started

    return _pool().submit(timed)


def run_ranks_together(*cfgs: RunConfig, timeout: float = 300,
                       envs: list[dict] | None = None) -> list[subprocess.CompletedProcess]:
    """Run several independent jobs at once (each its own mpiexec, its own run folder) to their ends; like
    :func:`run_ranks` for each, in order (``envs``: each job's extra environment variables). A job still running
    after ``timeout`` seconds is killed with the others and raises ``subprocess.TimeoutExpired``."""
    import tempfile
    import time

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    logs = [tempfile.TemporaryFile("w+") for _ in cfgs]  # files, not pipes: no job waits for its reader
    procs = [subprocess.Popen(rank_command(cfg), stdout=log, stderr=subprocess.STDOUT, text=True,
                              env={**env, **extra}, stdin=subprocess.DEVNULL)
             for cfg, log, extra in zip(cfgs, logs, envs or [{}] * len(cfgs), strict=True)]
    deadline = time.monotonic() + timeout
    try:
        for proc in procs:
            proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
    except subprocess.TimeoutExpired:
        for proc in procs:
            proc.kill()
            proc.wait()
        raise
    finally:
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
            log.close()
    return [subprocess.CompletedProcess(proc.args, proc.returncode, out) for proc, out in
            zip(procs, outputs, strict=True)]


def final_parameters(cfg: RunConfig) -> dict[str, np.ndarray]:
    """Trainable parameters of the newest checkpoint of a run."""
    from ortflow.checkpoints import list_complete

    return checkpoint_parameters(list_complete(cfg.checkpoints_dir)[-1].path)


def checkpoint_parameters(folder: Path) -> dict[str, np.ndarray]:
    """Trainable parameters of one checkpoint folder (a run without pipeline stages)."""
    import h5py

    with h5py.File(folder / "params.h5", "r") as f:  # plain h5py: one dataset per parameter
        return {ds.attrs["name"]: ds[()] for ds in f["parameters"].values() if ds.attrs["requires_grad"]}


#: The text the GPT runs train on: Python source (six of ortflow's modules as they once were), fixed, so that the data
#: and every loss computed from it stay the same while the code changes (the GPU precision tests' bounds hold on it).
CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "corpus.txt"


def text_corpus(root: Path) -> Path:
    """:data:`CORPUS` copied under ``root`` (once)."""
    path = root / "corpus.txt"
    if not path.exists():
        path.write_bytes(CORPUS.read_bytes())
    return path


def make_text_run(root: Path, name: str, **sections) -> RunConfig:
    """Configure + shard a tiny byte-level GPT run on text (:data:`CORPUS`) under ``root/name``."""
    from ortflow.examples.gpt import build_gpt

    root.mkdir(parents=True, exist_ok=True)
    model = root / "gpt.onnx"
    if not model.exists():
        build_gpt(model, seq_len=16, d_model=32, num_layers=1, num_heads=2)
    data = {"train": [str(text_corpus(root))], "format": "text", "text": {"seq_len": 16}, "eval_fraction": 0.05}
    base = {"data": data}
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values}
    return make_run(root, name, model=model, **base)


def kill_when(cfg: RunConfig, proc: subprocess.Popen, min_step: int) -> int:
    """SIGKILL the whole job once progress shows ``min_step`` updates; returns the step seen. The launcher, its
    proxies and the ranks (MPICH starts each in a session of its own, out of the launcher's group) are all gone when
    it returns, so no rank writes a checkpoint after the caller has counted them."""
    import time

    import pytest

    from ortflow.trainer.metrics import read_progress

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        progress = read_progress(cfg.output_dir)
        if progress and progress["step"] >= min_step:
            kill_job(proc)
            return progress["step"]
        if proc.poll() is not None:
            pytest.fail("the job ended before it could be killed")
        time.sleep(0.002)
    pytest.fail("no progress within 60 s")


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL the launcher ``proc`` (started in a session of its own), its proxies and its ranks, and return once
    every one of them is gone: MPICH starts each proxy and rank in a session of its own, out of the launcher's group,
    so a signal to the group alone would leave the ranks a moment to finish a checkpoint."""
    import time

    import pytest

    from ortflow.processes import kill_tree, launcher_tree

    job = [pid for pid, _name, _state in launcher_tree(proc.pid, ranks=True) if pid != proc.pid]
    kill_tree(proc.pid)
    proc.wait()
    deadline = time.monotonic() + 60
    while any(_alive(pid) for pid in job):
        if time.monotonic() > deadline:
            pytest.fail(f"processes {[pid for pid in job if _alive(pid)]} of the killed job outlived SIGKILL by 60 s")
        time.sleep(0.005)


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not ended (a zombie has; its parent may be gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def kill_and_resume(cfg: RunConfig, min_step: int, end_step: int, timeout: float = 120,
                    beside: RunConfig | tuple[RunConfig, ...] = ()) -> str:
    """Start the job, SIGKILL it past ``min_step`` updates, check it was cut between checkpoints before
    ``end_step``, run it again and check that it resumed from its newest checkpoint; returns the resumed output.
    ``beside``: independent jobs (the uninterrupted reference) run to their ends meanwhile."""
    from concurrent.futures import ThreadPoolExecutor

    others = (beside,) if isinstance(beside, RunConfig) else tuple(beside)
    with ThreadPoolExecutor(1) as pool:
        references = pool.submit(run_ranks_together, *others, timeout=timeout) if others else None
        out = _kill_and_resume(cfg, min_step, end_step, timeout)
        for done in references.result() if references else ():
            assert done.returncode == 0, done.stdout[-3000:]
    return out


def _kill_and_resume(cfg: RunConfig, min_step: int, end_step: int, timeout: float) -> str:
    from ortflow.checkpoints import list_complete

    proc = subprocess.Popen(rank_command(cfg), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    kill_when(cfg, proc, min_step)
    before = [info.step for info in list_complete(cfg.checkpoints_dir)]
    assert before and max(before) < end_step, before  # interrupted between checkpoints, before the end
    resumed = run_ranks(cfg, timeout=timeout)
    assert resumed.returncode == 0, resumed.stdout
    assert f"starting from step {max(before)}" in resumed.stdout, (before, resumed.stdout[-3000:])
    return resumed.stdout
