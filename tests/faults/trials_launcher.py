"""Fault trials on the launcher side: mpiexec, its proxy or ``ortflow train`` stopped (SIGSTOP), or Ctrl-Z.

A launcher stopped for good must not hang the job: the ranks never block on its output, and the job is aborted
within the collective timeout (+2 s) with the stopped process named. A launcher stopped briefly and continued goes on
to the end; so does a job whose ``ortflow train`` gets Ctrl-Z, which does not pause training.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from ortflow.config import RunConfig
from ortflow.protocol import EXIT_STALLED
from tests.faults import procs
from tests.faults.trials import Outcome, fresh_run

TIMEOUT_S = 5.0
STEPS = 400  # of a paused trial: it outlasts two pauses
REFUSED = "Ctrl-Z does not pause training"  # what `ortflow train` says when it gets SIGTSTP


def _victim(proc: subprocess.Popen, target: str) -> int:
    if target == "cli":
        return proc.pid
    if target == "launcher":
        return procs.launcher_of(proc.pid)
    return next(p for p in procs.descendants(proc.pid) if "hydra_pmi_proxy" in procs.cmdline(p))


def stopped_run(root: Path, name: str) -> RunConfig:
    """The configured run of a :func:`stopped_launcher_trial`."""
    return fresh_run(root, name, distributed={"collective_timeout_s": TIMEOUT_S},
                     train={"num_train_steps": 200000, "display_loss_steps": 1}, checkpoint={"period": 0})


def stopped_launcher_trial(root: Path, target: str, name: str, cfg: RunConfig | None = None) -> Outcome:
    """SIGSTOP ``target`` for good: every rank gone within timeout + 2 s, the job's exit names the stopped process;
    a stopped proxy is itself ended (not left stopped), nothing of the job is left and it exits 3. ``cfg``: the run
    :func:`stopped_run` configured (made here when None)."""
    category = f"stopped-{target}"
    cfg = cfg or stopped_run(root, name)
    proc = procs.start_train(cfg.output_dir)
    lines = procs.drain(proc)
    try:
        procs.wait_for_step(cfg.output_dir, 30, proc)
        victim = _victim(proc, target)
        tree = procs.descendants(proc.pid)
        ranks = [p for p in procs.ranks_of(proc.pid) if "hydra" not in procs.cmdline(p).split(" ")[0]
                 and p != procs.launcher_of(proc.pid)]  # mpiexec's own command line names the trainer too
        os.kill(victim, signal.SIGSTOP)
        start = time.monotonic()
        while procs.alive(ranks) and time.monotonic() - start < TIMEOUT_S + 30:
            time.sleep(0.02)
        took = time.monotonic() - start
        left = procs.alive(ranks)
        # A stopped proxy is ended with the job, not left stopped (nobody continues it here).
        kept = _left_within([victim], 15) if target == "proxy" else []
        try:
            os.kill(victim, signal.SIGCONT)  # a stopped `ortflow train` reports once continued
        except ProcessLookupError:
            pass  # a stopped mpiexec or proxy was killed with the job
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            return Outcome(category, False, f"ranks gone after {took:.1f} s, but `ortflow train` did not exit")
        if target == "proxy":
            kept += _left_within(tree, 15)
    finally:
        procs.kill_tree(proc.pid)
        proc.wait()
    text = "\n".join(lines.complete())  # to its last line: the reader thread may lag the exit on a busy host
    named = {"cli": "the launching process", "launcher": "'mpiexec'", "proxy": "hydra_pmi_proxy"}[target]
    status_ok = proc.returncode == EXIT_STALLED if target == "proxy" else proc.returncode != 0
    ok = not left and not kept and took <= TIMEOUT_S + 2.0 and status_ok and named in text and "stopped for" in text
    return Outcome(category, ok, f"ranks gone {took:.1f} s after the stop (timeout {TIMEOUT_S:g} s), exit "
                   f"{proc.returncode}, {named} {'named' if named in text else 'NOT named'}"
                   + (f", left behind: {[procs.cmdline(p) for p in kept]}" if kept else "")
                   + ("" if ok else f": {text[-600:]}"))


def _left_within(pids: list[int], seconds: float) -> list[int]:
    """Those of ``pids`` still alive after up to ``seconds``."""
    deadline = time.monotonic() + seconds
    while procs.alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return procs.alive(pids)


def paused_run(root: Path, name: str) -> RunConfig:
    """The configured run of a :func:`paused_trial`."""
    return fresh_run(root, name, distributed={"collective_timeout_s": TIMEOUT_S},
                     train={"num_train_steps": STEPS, "display_loss_steps": 1}, checkpoint={"period": 0})


def paused_trial(root: Path, targets: tuple[str, ...], name: str, cfg: RunConfig | None = None) -> Outcome:
    """Pause parts of one job in turn and continue them: its steps go on after each pause and it finishes (exit 0).

    ``tstp`` is Ctrl-Z on ``ortflow train`` (SIGTSTP, then SIGCONT as ``fg`` sends): it does not pause training, so
    the job runs on through it, says so, and finishes; the other targets are SIGSTOPped for half the timeout, then
    continued. ``cfg``: the run :func:`paused_run` configured (made here when None).
    """
    category = f"paused-{'-'.join(targets)}"
    cfg = cfg or paused_run(root, name)
    proc = procs.start_train(cfg.output_dir)
    lines = procs.drain(proc)
    held = []
    try:
        seen = procs.wait_for_step(cfg.output_dir, 30, proc)
        for target in targets:
            held.append(_pause(proc, target, lines))
            seen = procs.wait_for_step(cfg.output_dir, min(seen + 5, STEPS), proc)  # it runs on after the pause
        proc.wait(timeout=300)
    except subprocess.TimeoutExpired:
        return Outcome(category, False, "the job did not finish within 300 s of the resume")
    finally:
        procs.kill_tree(proc.pid)
        proc.wait()
    text = "\n".join(lines.complete())  # to its last line: the reader thread may lag the exit on a busy host
    ok = proc.returncode == 0 and "training finished" in text and ("tstp" not in targets or REFUSED in text)
    paused = ", ".join(f"{target} {hold:g} s" for target, hold in zip(targets, held, strict=False))
    return Outcome(category, ok, f"paused {paused}, exit {proc.returncode}" + ("" if ok else f": {text[-600:]}"))


def _pause(proc: subprocess.Popen, target: str, lines: list[str]) -> float:
    """Pause ``target`` of the job and continue it; returns how long it was held."""
    if target == "tstp":
        os.kill(proc.pid, signal.SIGTSTP)
        # `fg` only once `ortflow train` has said so: a SIGCONT discards a stop signal not yet delivered (the kernel
        # does, handler or not), and on a busy host the delivery can lag the ranks by several steps.
        procs.wait_for_line(lines, REFUSED, proc)
        os.kill(proc.pid, signal.SIGCONT)
        return 0.0
    victim, hold = _victim(proc, target), TIMEOUT_S / 2
    os.kill(victim, signal.SIGSTOP)
    time.sleep(hold)  # the pause itself, shorter than the collective timeout
    os.kill(victim, signal.SIGCONT)
    return hold
