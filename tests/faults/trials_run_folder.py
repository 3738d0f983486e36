"""Fault trials for the run folder's own files and identity, and for repeated stop signals: a damaged or missing
``configure.json``, an edited or truncated ``config.yaml``, a copied and a moved run folder, a double Ctrl-C or
SIGTERM. Each returns an :class:`~.trials.Outcome` (the campaign's group ``run-folder``)."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

from ortflow.checkpoints import list_complete
from ortflow.config import RESOLVED_CONFIG_NAME, load_yaml
from tests.faults import procs
from tests.faults.trials import Outcome, fresh_run

RECORD_DAMAGE = ("deleted", "truncated", "edited")
COMMANDS = ("train", "evaluate", "export")


def _ortflow(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([procs.ORTFLOW, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300, stdin=subprocess.DEVNULL, env={**os.environ, "OMP_NUM_THREADS": "1"})


def _short(root: Path, name: str, checkpoint: dict | None = None):
    return fresh_run(root, name, train={"num_train_steps": 4},
                     checkpoint={"period": 2, "max_num_checkpoints": 5, **(checkpoint or {})})


def _args(command: str, run: Path) -> list[str]:
    return {"train": ["train", str(run)], "evaluate": ["evaluate", str(run), "--checkpoint", "initial"],
            "export": ["export", str(run), "--checkpoint", "initial"]}[command]


def record_trial(root: Path, damage: str, command: str, rng: random.Random) -> Outcome:
    """``configure.json`` deleted, truncated at a random byte or with one value edited: the command stops, naming
    it and ``ortflow configure``, and trains or writes nothing."""
    category = f"configure-json-{damage}-{command}"
    cfg = _short(root, f"rec-{damage}-{command}")
    record = cfg.output_dir / "configure.json"
    text = record.read_text()
    if damage == "deleted":
        record.unlink()
    elif damage == "truncated":
        record.write_text(text[: rng.randrange(len(text))])
    else:
        info = json.loads(text)
        info["num_parameters"] += rng.randrange(1, 100)
        record.write_text(json.dumps(info, indent=2))
    out = _ortflow(*_args(command, cfg.output_dir))
    ok = (out.returncode != 0 and "Traceback" not in out.stdout and "configure.json" in out.stdout
          and "ortflow configure" in out.stdout and not list_complete(cfg.checkpoints_dir)
          and not cfg.export_path.exists())
    return Outcome(category, ok, f"exit {out.returncode}" + ("" if ok else f": {out.stdout[-600:]}"))


def config_edit_trial(root: Path, truncate: bool, rng: random.Random) -> Outcome:
    """``config.yaml`` edited (another learning rate) or truncated at a random byte: ``ortflow train`` refuses it
    naming the file and the fixes; an edit is taken with ``--accept-changed-config``."""
    category = f"config-yaml-{'truncated' if truncate else 'edited'}"
    cfg = _short(root, f"cfg-{'t' if truncate else 'e'}-{rng.randrange(10**6)}")
    path = cfg.output_dir / RESOLVED_CONFIG_NAME
    text = path.read_text()
    if truncate:
        path.write_text(text[: rng.randrange(len(text))])
    else:
        raw = load_yaml(text)
        raw["optimizer"]["learning_rate"] = rng.choice([0.5, 0.05, 0.001])
        path.write_text(json.dumps(raw))
    out = _ortflow("train", str(cfg.output_dir))
    ok = (out.returncode != 0 and "Traceback" not in out.stdout and "config.yaml" in out.stdout
          and "--accept-changed-config" in out.stdout and not list_complete(cfg.checkpoints_dir))
    detail = f"refused: exit {out.returncode}"
    if ok and not truncate:
        accepted = _ortflow("train", str(cfg.output_dir), "--accept-changed-config")
        ok = accepted.returncode == 0 and bool(list_complete(cfg.checkpoints_dir))
        detail += f"; accepted: exit {accepted.returncode}"
    return Outcome(category, ok, detail + ("" if ok else f": {out.stdout[-600:]}"))


def copy_move_trial(root: Path, move: bool, name: str) -> Outcome:
    """A trained run folder moved (it resumes with its id, nothing at the old place) or copied with a shared
    ``checkpoint.dir`` (the copy is refused, the original's checkpoints stay byte for byte)."""
    category = "run-folder-moved" if move else "run-folder-copied"
    shared = {"dir": str(root / f"{name}-shared")} if not move else {}
    cfg = _short(root, name, checkpoint=shared)
    first = _ortflow("train", str(cfg.output_dir))
    if first.returncode != 0:
        return Outcome(category, False, f"the first training failed: {first.stdout[-600:]}")
    before = {c.path.name: (c.path / "params.h5").read_bytes() for c in list_complete(cfg.checkpoints_dir)}
    other = root / f"{name}-{'moved' if move else 'copy'}"
    (shutil.move if move else shutil.copytree)(cfg.output_dir, other)
    path = other / RESOLVED_CONFIG_NAME
    raw = load_yaml(path.read_text())
    raw["train"]["num_train_steps"] = 6
    path.write_text(json.dumps(raw))
    out = _ortflow("train", str(other), "--accept-changed-config")
    if move:
        steps = {c.step: c.meta["run"]["run_id"] for c in list_complete(other / "checkpoints")}
        ok = out.returncode == 0 and max(steps, default=0) == 6 and len(set(steps.values())) == 1 \
            and not cfg.output_dir.exists()
    else:
        after = {c.path.name: (c.path / "params.h5").read_bytes() for c in list_complete(cfg.checkpoints_dir)}
        ok = out.returncode != 0 and "Traceback" not in out.stdout and str(cfg.output_dir) in out.stdout \
            and after == before
    return Outcome(category, ok, f"exit {out.returncode}" + ("" if ok else f": {out.stdout[-600:]}"))


def double_signal_trial(root: Path, sig: int, rng: random.Random, name: str) -> Outcome:
    """SIGINT or SIGTERM twice to ``ortflow train``, a random 0.1-2 s apart: exit 128 + the signal with a stop
    checkpoint, no "training failed", and no process of the job left."""
    category = f"double-{signal.Signals(sig).name}"
    cfg = fresh_run(root, name, train={"num_train_steps": 100000}, checkpoint={"period": 100000})
    proc = procs.start_train(cfg.output_dir)
    lines = procs.drain(proc)
    gap = rng.uniform(0.1, 2.0)
    try:
        procs.wait_for_step(cfg.output_dir, 2, proc)
        tree = procs.descendants(proc.pid)
        os.kill(proc.pid, sig)
        time.sleep(gap)  # the user's second press
        os.kill(proc.pid, sig)
        code = proc.wait(timeout=120)
    finally:
        procs.kill_tree(proc.pid)
    deadline = time.monotonic() + 10
    while procs.alive(tree) and time.monotonic() < deadline:
        time.sleep(0.05)
    text = "\n".join(lines)
    ok = code == 128 + sig and "training failed" not in text and bool(list_complete(cfg.checkpoints_dir)) \
        and not procs.alive(tree)
    return Outcome(category, ok, f"{gap:.2f} s apart: exit {code}" + ("" if ok else f": {text[-600:]}"))
