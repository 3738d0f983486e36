"""Where a step's wall time goes: per-phase counters the loop advances with one ``lap`` per phase boundary.

A lap costs one clock read and one dict update (well under a microsecond), so the breakdown is always on. Phases:

* ``data``: waiting for the loader's next micro-batch;
* ``forward_backward``: the engine's forward and backward passes;
* ``comm``: the gradient exchange itself, and ``comm_wait``: the part of the exchange spent waiting for the slowest
  rank. Without a barrier (which would cost a second collective) the wait is estimated as the time in the exchange
  minus the fastest exchange seen so far in this run: the fastest one is the closest to a pure transfer. At one rank
  both are the cost of scaling the gradients;
* ``norm_clip``: the gradient norm (when clipping, or on display steps) and clipping, with the loop's bookkeeping;
* ``update``: the optimizer step and resetting the gradients (the engine's work, as in a bare loop);
* ``eval``, ``checkpoint`` (with the parameter-digest check before it), and ``other``: reporting (progress line,
  TensorBoard), the learning rate and the seed.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from pathlib import Path

from ortflow.config.atomic import write_text_atomic

PHASES = ("data", "forward_backward", "comm", "comm_wait", "norm_clip", "update", "eval", "checkpoint", "other")
#: Short labels for the progress line.
LABELS = {"data": "data", "forward_backward": "fwd+bwd", "comm": "comm", "comm_wait": "wait", "norm_clip": "norm",
          "update": "update",
          "eval": "eval", "checkpoint": "ckpt", "other": "other"}  # fmt: skip
TIMING_FILE = "timing.json"
#: Display windows kept for timing.json (a window's seconds per phase; benchmarks skip the warm-up windows).
MAX_WINDOWS = 2000


class PhaseTimer:
    """Per-phase wall-time counters for the current display window and for the whole run."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.window = dict.fromkeys(PHASES, 0.0)
        self.total = dict.fromkeys(PHASES, 0.0)
        self.windows: list[dict[str, float]] = []  # each finished window's seconds (the last MAX_WINDOWS)
        self.bare_comm = math.inf
        self._last = clock()

    def lap(self, phase: str) -> None:
        """Charge the time since the previous lap to ``phase``."""
        now = self.clock()
        spent = now - self._last
        self._last = now
        self.window[phase] += spent
        self.total[phase] += spent

    def lap_exchange(self) -> None:
        """Charge the time since the previous lap to the exchange, split into transfer and waiting (estimate)."""
        now = self.clock()
        spent = now - self._last
        self._last = now
        self.bare_comm = min(self.bare_comm, spent)
        for phase, value in (("comm", self.bare_comm), ("comm_wait", spent - self.bare_comm)):
            self.window[phase] += value
            self.total[phase] += value

    def training_seconds(self) -> float:
        """Wall time of the window without eval and checkpointing (what throughput is computed from)."""
        return sum(self.window.values()) - self.window["eval"] - self.window["checkpoint"]

    def shares(self, counters: dict[str, float] | None = None) -> dict[str, float]:
        """Each phase's share of the window's (or the given counters') wall time, 0..1."""
        counters = self.window if counters is None else counters
        wall = sum(counters.values())
        return {p: (counters[p] / wall if wall > 0 else 0.0) for p in PHASES}

    def describe(self) -> str:
        """``fwd+bwd 96.1% data 0.2% ...`` for the progress line: phases above 0.05%, largest first."""
        shares = self.shares()
        kept = sorted((s, p) for p, s in shares.items() if s >= 0.0005)
        return " ".join(f"{LABELS[p]} {s * 100:.1f}%" for s, p in reversed(kept))

    def scalars(self) -> dict[str, float]:
        """TensorBoard scalars ``time/<phase>``: the window's shares."""
        return {f"time/{p}": s for p, s in self.shares().items()}

    def new_window(self) -> None:
        """Keep the finished window's counters and start the next window's."""
        self.windows.append(self.window)
        del self.windows[:-MAX_WINDOWS]
        self.window = dict.fromkeys(PHASES, 0.0)

    def summary(self) -> dict:
        """The whole run's seconds and shares per phase (``timing.json``)."""
        return {"seconds": dict(self.total), "shares": self.shares(self.total), "wall_s": sum(self.total.values()),
                "bare_exchange_s": None if math.isinf(self.bare_comm) else self.bare_comm,
                "windows": self.windows}  # fmt: skip

    def write_summary(self, run_dir: Path) -> Path:
        """Write :meth:`summary` into the run folder (atomically)."""
        path = Path(run_dir) / TIMING_FILE
        write_text_atomic(path, json.dumps(self.summary(), indent=2))
        return path


def read_timing(run_dir: Path) -> dict | None:
    """The run's ``timing.json``, or None."""
    try:
        return json.loads((Path(run_dir) / TIMING_FILE).read_text())
    except (OSError, ValueError):
        return None
