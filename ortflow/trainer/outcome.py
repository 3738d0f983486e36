"""How a rank is asked to stop (a signal) and how its training loop ended."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class StopFlag:
    """Set by a signal handler; honoured by every rank at the same weight update."""

    requested: bool = False
    signum: int = 0  # the signal this rank received (0: none; it stops because another rank did)


@dataclass(frozen=True)
class TrainResult:
    """How a rank's loop ended."""

    step: int
    global_cursor: int
    train_loss: float | None
    eval_loss: float | None
    stopped: bool
