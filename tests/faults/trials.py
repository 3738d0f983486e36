"""Fault trials: each injects one fault into a real 2-rank job (or its files) and checks the property that must hold.

Every trial returns a :class:`Outcome` (category, whether the property held, and what was seen); the CI tests in this
folder run a few of each and assert them, ``campaign.py`` (``make faults``) runs many and records the figures.
"""

from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ortflow.checkpoints import CheckpointError, list_complete, verify
from ortflow.config import RunConfig
from ortflow.trainer.metrics import read_progress
from tests.faults import procs
from tests.support.runs import final_parameters, make_run, run_ranks

INJECT = str(Path(__file__).with_name("inject.py"))
#: The job every kill trial trains: 2 ranks, long enough to be hit anywhere, checkpoints every 5 updates.
KILL_RUN = {"distributed": {"num_ranks": 2}, "train": {"num_train_steps": 300, "display_loss_steps": 1},
            "checkpoint": {"period": 5, "max_num_checkpoints": 2}}


@dataclass
class Outcome:
    """One trial: its category, whether the property held, and the evidence."""

    category: str
    ok: bool
    detail: str
    owner: str = ""  # the piece of work a failure belongs to, when it is not this suite's (e.g. "run lock")


def fresh_run(root: Path, name: str, **sections) -> RunConfig:
    """A configured, sharded MLP run (shared model and data under ``root``)."""
    merged = {k: dict(v) for k, v in KILL_RUN.items()}
    for key, value in sections.items():
        merged[key] = {**merged.get(key, {}), **value}
    return make_run(root, name, **merged)


def reference_parameters(root: Path, steps: int = KILL_RUN["train"]["num_train_steps"]) -> dict[str, np.ndarray]:
    """Final parameters of the uninterrupted job of ``steps`` updates (computed once per root)."""
    cfg = fresh_run(root, "reference", train={"num_train_steps": steps})
    if not list_complete(cfg.checkpoints_dir):
        out = run_ranks(cfg, timeout=300)
        if out.returncode:
            raise RuntimeError(f"the reference run failed: {out.stdout[-2000:]}")
    return final_parameters(cfg)


def _same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _all_verify(cfg: RunConfig) -> str | None:
    for info in list_complete(cfg.checkpoints_dir):
        try:
            verify(info.path)
        except CheckpointError as err:
            return str(err)
    return None


def _resume_to_end(cfg: RunConfig) -> subprocess.CompletedProcess:
    """``ortflow train`` on the run, launched from this process (its ranks are real; only the command's start-up is
    spared)."""
    return procs.ortflow_here("train", str(cfg.output_dir))


# -- kills anywhere ----------------------------------------------------------------------------------------------------


def kill_trial(root: Path, reference: dict, target: str, rng: random.Random, name: str) -> Outcome:
    """SIGKILL a rank, the launcher or ``ortflow train`` at a random step; resume; parameters equal the reference."""
    cfg = fresh_run(root, name)
    at, left = _kill_running(cfg, target, rng.randint(2, 250), rng)
    return _resumed_outcome(cfg, reference, f"kill-{target}", f"killed near step {at}", left)


def _kill_running(cfg: RunConfig, target: str, step: int, rng: random.Random) -> tuple[int, list[int]]:
    """Start ``ortflow train`` on the run and SIGKILL ``target`` once it reaches ``step``; returns the step seen and
    the processes still alive 10 s after the kill."""
    proc = procs.start_train(cfg.output_dir)
    procs.drain(proc)  # nobody else reads its output here
    try:
        at = procs.wait_for_step(cfg.output_dir, step, proc)
        time.sleep(rng.random() * 0.05)  # anywhere inside a step, an eval or a checkpoint write
        if target == "rank":
            pids = [rng.choice(procs.ranks_of(proc.pid))]
        elif target == "launcher":
            pids = [procs.launcher_of(proc.pid)]
        else:
            pids = [proc.pid]
        everything = [proc.pid, *procs.descendants(proc.pid)]
        for pid in pids:
            os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while procs.alive(everything) and time.monotonic() < deadline:
            time.sleep(0.02)
        left = procs.alive(everything)
    finally:
        procs.kill_tree(proc.pid)
        proc.wait()
    return at, left


def chained_kill_trial(root: Path, reference: dict, rng: random.Random, name: str,
                       steps: int = KILL_RUN["train"]["num_train_steps"]) -> Outcome:
    """One run of ``steps`` updates (the reference's) killed three times, each kill resumed by the next job: rank 0
    inside the checkpoint write of a random update, then a random rank, then ``ortflow train`` at random steps; every
    checkpoint verifies after each kill and the final parameters equal the reference."""
    cfg = fresh_run(root, name, train={"num_train_steps": steps})
    update = rng.choice([10, 15, 20, 25])
    out = run_ranks(cfg, INJECT, f"kill-write:0:{update}", timeout=120)
    if out.returncode == 0:
        return Outcome("kill-chain", False, "the injected kill did not happen")
    what = [f"rank 0 killed in the write of step {update}"]
    for target in ("rank", "cli"):
        damaged = _all_verify(cfg)
        if damaged:
            return Outcome("kill-chain", False, f"{'; '.join(what)}: a checkpoint was damaged: {damaged}")
        # A step this job reaches (the progress record before it is the killed job's), before the end.
        step = min((read_progress(cfg.output_dir) or {}).get("step", 0) + rng.randint(2, steps // 3), steps - 5)
        at, left = _kill_running(cfg, target, step, rng)
        what.append(f"{target} killed near step {at}")
        if left:
            return Outcome("kill-chain", False, f"{'; '.join(what)}: processes {left} outlived the kill by 10 s")
    return _resumed_outcome(cfg, reference, "kill-chain", "; ".join(what), [])


def _resumed_outcome(cfg: RunConfig, reference: dict, category: str, what: str, left: list[int]) -> Outcome:
    damaged = _all_verify(cfg)
    out = _resume_to_end(cfg)
    if left:
        return Outcome(category, False, f"{what}: processes {left} outlived the kill by 10 s")
    if damaged:
        return Outcome(category, False, f"{what}: a checkpoint was damaged: {damaged}")
    if out.returncode:
        return Outcome(category, False, f"{what}: resume failed ({out.returncode}): {out.stdout[-800:]}")
    same = _same(final_parameters(cfg), reference)
    return Outcome(category, same, f"{what}: resumed {'bit-identical' if same else 'to DIFFERENT parameters'}")


def kill_in_save_trial(root: Path, reference: dict, phase: str, rng: random.Random, name: str) -> Outcome:
    """Rank 0 is SIGKILLed inside a checkpoint write (``write``) or inside retention (``retention``); resume."""
    cfg = fresh_run(root, name)
    # Retention deletes only once max_num_checkpoints (2) are kept: from the third save (step 15) on.
    update = rng.choice([15, 20, 25] if phase == "retention" else [10, 15, 20, 25])
    out = run_ranks(cfg, INJECT, f"kill-{phase}:0:{update}", timeout=120)
    if out.returncode == 0:
        return Outcome(f"kill-during-{phase}", False, "the injected kill did not happen")
    return _resumed_outcome(cfg, reference, f"kill-during-{phase}", f"rank 0 killed in the {phase} of step {update}",
                            [])


# -- stop signals ------------------------------------------------------------------------------------------------------


def signal_run(root: Path, name: str) -> RunConfig:
    """The configured run of a :func:`signal_trial`."""
    return fresh_run(root, name, train={"num_train_steps": 200000, "display_loss_steps": 5}, checkpoint={"period": 0})


def signal_trial(root: Path, target: str, sig: int, name: str, cfg: RunConfig | None = None) -> Outcome:
    """SIGTERM/SIGINT to part of the job: every rank stops at one update, a stop checkpoint, exit 128+sig, in grace.
    ``cfg``: the run :func:`signal_run` configured (made here when None)."""
    category = f"stop-{signal.Signals(sig).name}-{target}"
    cfg = cfg or signal_run(root, name)
    proc = procs.start_train(cfg.output_dir)
    try:
        procs.wait_for_step(cfg.output_dir, 10, proc)
        everything = [proc.pid, *procs.descendants(proc.pid)]
        start = time.monotonic()
        procs.signal_target(proc, target, sig)
        out, _ = proc.communicate(timeout=60)
        took = time.monotonic() - start
    except subprocess.TimeoutExpired:
        procs.kill_tree(proc.pid)
        return Outcome(category, False, "the job did not stop within 60 s")
    time.sleep(0.3)
    left = procs.alive(everything)
    digests = re.findall(r"rank (\d) parameters sha256 ([0-9a-f]{64}) at step (\d+)", out)
    steps = [c.step for c in list_complete(cfg.checkpoints_dir)]
    want = 128 + sig
    problems = []
    if proc.returncode != want:
        problems.append(f"exit {proc.returncode}, want {want}")
    if len(steps) != 1:
        problems.append(f"checkpoints {steps}, want one stop checkpoint")
    if len({(s, d) for _, d, s in digests}) != 1 or len(digests) != 2:
        problems.append(f"ranks did not stop at one update with equal parameters: {digests}")
    if steps and out.count(f"stop requested: ranks stopped together after step {steps[-1]}") != 2:
        problems.append("the ranks' stop lines did not reach the output of ortflow train")
    if left:
        problems.append(f"processes {left} left")
    if took > 30:
        problems.append(f"took {took:.1f} s, beyond the 30 s grace")
    detail = "; ".join(problems) or f"stopped at step {steps[0]} in {took:.1f} s, exit {want}"
    return Outcome(category, not problems, detail)


def orphan_trial(root: Path, target: str, name: str) -> Outcome:
    """SIGKILL ``ortflow train``, the launcher or a proxy: every rank exits within 2 s."""
    cfg = fresh_run(root, name, train={"num_train_steps": 200000, "display_loss_steps": 20}, checkpoint={"period": 0})
    proc = procs.start_train(cfg.output_dir)
    try:
        procs.wait_for_step(cfg.output_dir, 20, proc)
        ranks = procs.ranks_of(proc.pid)
        tree = procs.descendants(proc.pid)
        victim = {"cli": proc.pid, "launcher": procs.launcher_of(proc.pid)}.get(target) or next(
            p for p in tree if "hydra_pmi_proxy" in procs.cmdline(p))
        start = time.monotonic()
        os.kill(victim, signal.SIGKILL)
        while procs.alive(ranks) and time.monotonic() - start < 10:
            time.sleep(0.02)
        took = time.monotonic() - start
    finally:
        procs.kill_tree(proc.pid)
        proc.wait()
    return Outcome(f"orphan-{target}", took <= 2.0, f"ranks gone {took:.2f} s after the {target} was killed")


# -- hangs -------------------------------------------------------------------------------------------------------------


def hang_trial(root: Path, victim: int, inside: bool, name: str, timeout_s: float = 5.0) -> Outcome:
    """SIGSTOP one rank (inside the same collective, or before it): abort within timeout + 2 s, the rank named."""
    category = "hang-inside" if inside else "hang-before"
    cfg = fresh_run(root, name, distributed={"collective_timeout_s": timeout_s}, checkpoint={"period": 0})
    mode = f"{'stop' if inside else 'stop-before'}:{victim}:{random.Random(name).randint(3, 30)}"
    out = run_ranks(cfg, INJECT, mode, timeout=120)
    ended = time.time()
    times = [float(line.split()[1]) for line in (cfg.output_dir / "fault-times.txt").read_text().splitlines()]
    took = ended - max(times)  # the hang starts when the last rank waits on the stopped one
    named = re.search(rf"stalled: [^.]*rank {victim} \(", out.stdout)
    others = re.search(rf"stalled: [^.]*rank {1 - victim} \(", out.stdout)
    ok = out.returncode != 0 and bool(named) and not others and took <= timeout_s + 2.0
    return Outcome(category, ok, f"exit {out.returncode}, aborted {took:.1f} s after the hang began "
                   f"(timeout {timeout_s} s), rank {victim} {'named' if named else 'NOT named'}")
