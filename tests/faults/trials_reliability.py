"""Fault trials for the run's boundaries: a checkpoint folder shared by two runs, outputs corrupted between runs,
bad input files and configs, and a full or read-only disk. Each returns an :class:`~.trials.Outcome`."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import time
from pathlib import Path

import numpy as np
import yaml

from ortflow.checkpoints import list_complete
from ortflow.checkpoints.retention import retain_checkpoints
from ortflow.export import export_model
from ortflow.tasks.caching import outputs_intact
from tests.faults import procs
from tests.faults import trials_files as files
from tests.faults.trials import Outcome
from tests.support.runs import build_mlp, make_run, run_ranks


def _ortflow(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([procs.ORTFLOW, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL, cwd=cwd,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})


# -- one checkpoint folder, two runs -------------------------------------------------------------------------------


def shared_dir_trial(root: Path, concurrent: bool, name: str) -> Outcome:
    """Two runs with one checkpoint.dir: the second is refused (lock while both train, else the first's identity),
    naming the other run, and the first run's checkpoints are untouched."""
    category = f"shared-checkpoint-dir-{'concurrent' if concurrent else 'sequential'}"
    shared = {"dir": str(root / name / "shared")}
    first = make_run(root / name, "first", distributed={"num_ranks": 1}, checkpoint=shared,
                     train={"num_train_steps": 100000 if concurrent else 10})
    second = make_run(root / name, "second", distributed={"num_ranks": 1}, checkpoint=shared)
    job = None
    if concurrent:
        job = procs.start_train(first.output_dir)
        procs.drain(job)
        procs.wait_for_step(first.output_dir, 3, job)
    else:
        out = run_ranks(first, timeout=300)
        if out.returncode:
            return Outcome(category, False, f"the first run failed: {out.stdout[-400:]}")
    before = [(c.path.name, c.meta.get("meta_sha256")) for c in list_complete(first.checkpoints_dir)]
    try:
        out = _ortflow("train", str(second.output_dir))
    finally:
        if job is not None:
            job.send_signal(signal.SIGTERM)
            job.wait(timeout=120)
    after = [(c.path.name, c.meta.get("meta_sha256")) for c in list_complete(first.checkpoints_dir)]
    named = ("in use by" in out.stdout) if concurrent else ("run 'first'" in out.stdout)
    untouched = concurrent or before == after
    ok = out.returncode != 0 and named and untouched and "Traceback" not in out.stdout
    return Outcome(category, ok, f"second run exit {out.returncode}, {'refused naming' if named else 'NOT naming'} "
                   f"the other run, first run's checkpoints {'untouched' if untouched else 'CHANGED'}"
                   + ("" if ok else f": {out.stdout[-400:]}"))


# -- outputs corrupted between two runs ----------------------------------------------------------------------------


def finished_run(root: Path):
    """A trained, retained and exported 1-rank run (made once per root)."""
    cfg = make_run(root, "finished", distributed={"num_ranks": 1}, train={"num_train_steps": 10})
    if not cfg.export_path.exists():
        out = run_ranks(cfg, timeout=300)
        if out.returncode:
            raise RuntimeError(out.stdout[-2000:])
        retain_checkpoints(cfg)
        export_model(cfg.output_dir, cfg.export_path, config=cfg)
    return cfg


RERUN_KINDS = {"training_model": "configure", "eval_model": "configure", "shard": "prepare_data",
               "params": "train", "optimizer": "train", "export": "export"}


def _rerun_target(cfg, kind: str) -> Path:
    newest = list_complete(cfg.checkpoints_dir)[-1].path
    return {"training_model": cfg.artifacts_dir / "training_model.onnx",
            "eval_model": cfg.artifacts_dir / "eval_model.onnx", "shard": cfg.data_dir / "train-00000.arrow",
            "params": newest / "params.h5", "optimizer": newest / "optimizer.h5", "export": cfg.export_path}[kind]


def rerun_corruption_trial(root: Path, kind: str, mode: str, rng: random.Random) -> Outcome:
    """Flip a bit of (or truncate) a finished stage's output: its cache is no longer trusted, so a rerun redoes it;
    for the exported model, ``ortflow export --verify`` fails too."""
    cfg = finished_run(root)
    stage, path = RERUN_KINDS[kind], _rerun_target(cfg, kind)
    original = path.read_bytes()
    try:
        data = bytearray(original)
        if mode == "flip":
            at = rng.randrange(len(data) * 8)
            data[at // 8] ^= 1 << (at % 8)
            what = f"bit {at} of {len(original) * 8}"
        else:
            data = data[: rng.randrange(len(data))]
            what = f"cut to {len(data)} of {len(original)} bytes"
        path.write_bytes(bytes(data))
        trusted = outputs_intact(cfg, stage)
        verified = None
        if kind == "export":
            verified = _ortflow("export", "--verify", str(path)).returncode == 0
    finally:
        path.write_bytes(original)
    ok = not trusted and not verified
    return Outcome(f"rerun-{mode}-{kind}", ok, f"{what}: the {stage} cache {'TRUSTED' if trusted else 'not trusted'}"
                   + ("" if verified is None else f", export --verify {'PASSED' if verified else 'failed'}"))


# -- bad input -----------------------------------------------------------------------------------------------------

INPUT_CASES = ("nan-label", "null-label", "duplicate-header", "npz-0d", "int64-beyond-float32", "model-dev-zero",
               "model-fifo", "huge-yaml-comment", "duplicate-yaml-key", "sexagesimal", "warmup-past-end",
               "missing-init-from", "batch-beyond-rows", "eval-fraction-0.999")


def _source(folder: Path, case: str) -> tuple[str, dict]:
    """The training source (path) and config changes for an input case."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 8)), np.arange(64) % 3
    rows = [",".join(f"{v:.4f}" for v in x[i]) + f",{y[i]}" for i in range(64)]
    header = ",".join(f"f{i}" for i in range(8)) + ",labels"
    cols = {"features": "f*"}
    if case == "nan-label":
        rows[5] = rows[5].rsplit(",", 1)[0] + ",nan"
    elif case == "null-label":
        path = folder / "d.jsonl"
        path.write_text("".join(json.dumps({"features": list(x[i]), "labels": None if i == 7 else int(y[i])}) + "\n"
                                for i in range(64)))
        return str(path), {}
    elif case == "duplicate-header":
        header = header.replace("f7", "f6")
        cols = {"features": ["f0", "f1", "f2", "f3", "f4", "f5", "f6", "f6"]}
    elif case == "npz-0d":
        path = folder / "d.npz"
        np.savez(path, features=np.float32(1.0), labels=np.int64(0))
        return str(path), {}
    elif case == "int64-beyond-float32":
        rows = [",".join(str(2**25 + 1 + i) for _ in range(8)) + f",{y[i]}" for i in range(64)]
    path = folder / "d.csv"
    path.write_text(header + "\n" + "\n".join(rows) + "\n")
    return str(path), {"columns": cols}


def bad_input_trial(root: Path, case: str) -> Outcome:
    """One bad input: ``validate`` and ``prepare-data`` (after configure) both refuse it with a message, no
    traceback, within 60 s."""
    folder = root / f"input-{case}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    model = folder / "mlp.onnx"
    build_mlp(model, num_features=8, hidden=4, num_classes=3, seed=0)
    source, data = _source(folder, case)
    raw = {"output_dir": str(folder / "run"), "model": {"path": str(model)},
           "data": {"train": source, **data}, "train": {"batch_size": 4, "num_train_steps": 8}}
    text = None
    if case == "model-dev-zero":
        raw["model"]["path"] = "/dev/zero"
    elif case == "model-fifo":
        os.mkfifo(folder / "model.fifo")
        raw["model"]["path"] = str(folder / "model.fifo")
    elif case == "warmup-past-end":
        raw["lr_schedule"] = {"name": "cosine", "warmup_steps": 8}
    elif case == "missing-init-from":
        raw["checkpoint"] = {"init_from": str(folder / "nowhere" / "step-00000010")}
    elif case == "batch-beyond-rows":
        raw["train"]["batch_size"] = 100
    elif case == "eval-fraction-0.999":
        raw["data"]["eval_fraction"] = 0.999
    text = yaml.safe_dump(raw)
    if case == "huge-yaml-comment":
        text += "# " + "x" * (10 << 20) + "\n"
    elif case == "duplicate-yaml-key":
        text += "train: {batch_size: 8, num_train_steps: 8}\n"
    elif case == "sexagesimal":
        text = text.replace("num_train_steps: 8", "num_train_steps: 1:30")
    config = folder / "config.yaml"
    config.write_text(text)
    start = time.monotonic()
    outs = [_ortflow("validate", str(config), timeout=120)]
    if _ortflow("configure", str(config), timeout=300).returncode == 0:  # the value cases: configured, then sharded
        outs.append(_ortflow("prepare-data", str(config), timeout=120))
    took = time.monotonic() - start
    text_out = "\n".join(o.stdout for o in outs)
    refused = all(o.returncode == 1 for o in outs)
    traceback = "Traceback" in text_out or "Exception ignored" in text_out
    ok = refused and not traceback and took < 60
    first = next((line for line in text_out.splitlines() if line.strip().startswith("- ") or "error" in line), "")
    return Outcome(f"input-{case}", ok, f"{'refused' if refused else 'ACCEPTED'} by {len(outs)} command(s) in "
                   f"{took:.1f} s, traceback {'YES' if traceback else 'no'}: {first.strip()[:160]}"
                   + ("" if ok else f" | {text_out[-600:]}"))


# -- a full or read-only disk --------------------------------------------------------------------------------------

DISK_CASES = ("full-prepare-data", "full-retain", "full-configure", "full-export", "ro-train", "ro-configure",
              "ro-export", "ro-run")


def disk_trial(root: Path, case: str) -> Outcome:
    """A command on a full or read-only tmpfs: exit 1 naming the disk and the folder, no traceback, no temp files."""
    cfg = finished_run(root)
    mount = root / f"mnt-{case}"
    if not files.tmpfs(mount, "4m"):
        return Outcome(f"disk-{case}", True, "SKIPPED: needs root for a tmpfs", "skipped")
    try:
        run = mount / "run"
        shutil.copytree(cfg.output_dir, run)
        raw = cfg.model_dump(mode="json")
        raw["output_dir"] = str(run)
        config = root / f"config-{case}.yaml"
        config.write_text(yaml.safe_dump(raw))
        args = {
            "full-prepare-data": ["prepare-data", str(config), "--set", "data.rows_per_shard=50"],
            "full-retain": ["retain", str(config), "--set", "checkpoint.max_num_checkpoints=5"],
            "full-configure": ["configure", str(config), "--set", f"output_dir={mount / 'fresh'}"],
            "full-export": ["export", str(run), "-o", str(mount / "out" / "model.onnx")],
            "ro-train": ["train", str(run)],
            "ro-configure": ["configure", str(config), "--set", "optimizer.learning_rate=0.5"],
            "ro-export": ["export", str(run), "-o", str(mount / "model.onnx")],
            "ro-run": ["run", str(config), "--from", "configure"],
        }[case]
        if case.startswith("full"):
            with open(mount / "filler", "wb") as f:
                try:
                    while True:
                        f.write(b"\0" * 65536)
                except OSError:
                    pass
        else:
            subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
        out = _ortflow(*args)
        temps = [p.name for p in mount.rglob("*") if ".tmp" in p.name or ".building-" in p.name]
    finally:
        files.untmpfs(mount)
    what = "the disk is full" if case.startswith("full") else "read-only"
    named = what in out.stdout and str(mount) in out.stdout
    traceback = "Traceback" in out.stdout or "Errno" in out.stdout
    ok = out.returncode != 0 and named and not traceback and not temps
    return Outcome(f"disk-{case}", ok, f"exit {out.returncode}, {'named' if named else 'NOT named'}, traceback "
                   f"{'YES' if traceback else 'no'}, temp files {temps or 'none'}" + ("" if ok else f": "
                                                                                    f"{out.stdout[-400:]}"))
