"""Per-operator profiling of chosen weight updates (``train.profile_steps: [start, end]``, ``--profile A:B``).

What onnxruntime-training 1.19.2 allows (checked): profiling is a ``SessionOptions`` flag (``enable_profiling``,
``profile_file_prefix``) read when a session is created, and the training ``Module`` exposes no ``end_profiling``;
the trace file is written when the session is destroyed. So profiling cannot be switched on and off in the trainer's
own session. Instead, for updates ``start..end``, the forward and backward passes run in a second ``Module`` created
with profiling on, over the same ``CheckpointState``: it shares the parameters (the optimizer's updates are seen by
both), but allocates its own gradient buffers, so after its backward passes its gradients are copied into the
trainer's buffers (the ones the exchange and the optimizer use). Measured on the CPU build: a run with such an
interlude ends with bit-identical parameters to one without. After ``end`` the second module is dropped, which writes
the Chrome trace; it is moved to ``<run>/profile/rank-<R>.json`` (open it in chrome://tracing or Perfetto).

:func:`top_operators` reads a trace into the table the run summary shows (op type, calls, total and mean time, share).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

log = logging.getLogger("ortflow.trainer")

PROFILE_DIR = "profile"
#: Overrides train.profile_steps for one launch (``ortflow train --profile A:B`` sets it for the ranks).
PROFILE_ENV = "ORTFLOW_PROFILE_STEPS"


def parse_steps(text: str) -> tuple[int, int]:
    """``"A:B"`` (or ``"A"``) -> (A, B), 1-based weight updates, inclusive."""
    first, _, last = text.partition(":")
    try:
        start, end = int(first), int(last or first)
    except ValueError:
        raise ValueError(f"--profile {text!r}: expected START:END weight updates, e.g. 10:14") from None
    if not 1 <= start <= end:
        raise ValueError(f"--profile {text!r}: need 1 <= START <= END")
    return start, end


class _Timed:
    """A module whose calls are timed (the forward+backward time the table is checked against)."""

    def __init__(self, module: object):
        self.module, self.seconds, self.calls = module, 0.0, 0

    def __call__(self, *inputs):
        start = time.perf_counter()
        out = self.module(*inputs)
        self.seconds += time.perf_counter() - start
        self.calls += 1
        return out


class StepProfiler:
    """Runs updates ``start..end`` (1-based, inclusive) in a profiling session; a no-op when ``steps`` is None."""

    def __init__(self, rt, steps: tuple[int, int] | None):
        self.rt, self.steps = rt, steps
        self._session: _Timed | None = None
        self._grads: list | None = None
        self.trace: Path | None = None
        if steps is not None and rt.device != "cpu":
            raise ValueError("train.profile_steps needs distributed.device cpu (GPU profiling is not wired up yet)")

    @classmethod
    def for_run(cls, rt) -> StepProfiler:
        """The profiler the config (or ``ORTFLOW_PROFILE_STEPS``) asks for."""
        override = os.environ.get(PROFILE_ENV)
        steps = parse_steps(override) if override else rt.cfg.train.profile_steps
        return cls(rt, tuple(steps) if steps else None)

    def module_for(self, step: int):
        """The module that runs update ``step``'s forward and backward passes."""
        if self.steps is None or not self.steps[0] <= step <= self.steps[1]:
            return self.rt.module
        if self._session is None:
            self._grads = self.rt.gradient_buffers()  # the trainer's buffers, pinned before the second module exists
            self._session = _Timed(self._open())
        return self._session

    def _open(self):
        from ortflow.engine import api
        from ortflow.trainer.runtime import available_cores, session_options, spin_wait

        rt = self.rt
        spin = spin_wait(rt.cfg, rt.comm.local_size, rt.threads, available_cores())
        options = session_options(rt.threads, rt.cfg.distributed.deterministic_compute, spin)
        options.enable_profiling = True
        options.profile_file_prefix = str(self._folder() / f".rank-{self.rt.comm.rank}")
        art = self.rt.cfg.artifacts_dir
        # No eval model: its session would write a second trace under the same name.
        module = api.Module(str(art / "training_model.onnx"), self.rt.state, None, device="cpu",
                            session_options=options)  # fmt: skip
        module.train()
        log.info("rank %d profiling updates %d..%d", self.rt.comm.rank, *self.steps)
        return module

    def _folder(self) -> Path:
        folder = self.rt.run_dir / PROFILE_DIR
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    def after_backward(self, step: int) -> None:
        """On a profiled update: hand its gradients to the trainer's buffers; after the last one, write the trace."""
        if self._session is None or step < self.steps[0]:
            return
        params = self.rt.state.parameters
        for name, mine in zip(self.rt.trainable, self._grads, strict=True):
            np.copyto(mine, params[name].grad)  # the profiling module's buffer for this parameter
        self._session.module.lazy_reset_grad()
        if step >= self.steps[1]:
            self.close()

    def close(self) -> None:
        """Drop the profiling session (ONNX Runtime writes the trace then) and move the trace into place."""
        if self._session is None:
            return
        timed, self._session = self._session, None
        measured, calls = timed.seconds, timed.calls
        timed.module = None  # the loop may still hold the wrapper: drop the session itself, which writes the trace
        gc.collect()
        folder, rank = self._folder(), self.rt.comm.rank
        written = sorted(folder.glob(f".rank-{rank}_*.json"), key=lambda p: p.stat().st_size)
        if not written:
            log.warning("rank %d: the engine wrote no profile into %s", rank, folder)
            return
        self.trace = folder / f"rank-{rank}.json"
        os.replace(written[-1], self.trace)
        for extra in written[:-1]:
            extra.unlink(missing_ok=True)
        meta = {"steps": list(self.steps), "forward_backward_s": measured, "calls": calls}
        (folder / f"rank-{rank}.meta.json").write_text(json.dumps(meta))
        if rank == 0:
            rows = top_operators(self.trace)
            (folder / "top_ops.md").write_text(markdown_table(rows, meta))
            top = markdown_table(rows[:10], meta, kernels_ms=sum(r["total_ms"] for r in rows))
            log.info("profile of updates %d..%d: %s (top 10 of %d op types)\n%s", *self.steps, self.trace, len(rows),
                     top)  # fmt: skip


def top_operators(trace: Path | str | list, limit: int | None = None) -> list[dict]:
    """Per op type: calls, total and mean kernel time (ms), share of all kernel time; largest total first.

    Args:
        trace: A Chrome-trace file written by ONNX Runtime's profiler (or its parsed list of events).
        limit: Keep this many rows (default: all).
    """
    events = trace if isinstance(trace, list) else json.loads(Path(trace).read_text())
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in events:
        if event.get("cat") == "Node" and event.get("name", "").endswith("_kernel_time"):
            entry = totals[event.get("args", {}).get("op_name", "?")]
            entry[0] += 1
            entry[1] += float(event.get("dur", 0)) / 1000.0  # microseconds -> ms
    grand = sum(t for _, t in totals.values())
    rows = [{"op_type": op, "calls": int(calls), "total_ms": total, "mean_ms": total / calls,
             "share": total / grand if grand else 0.0} for op, (calls, total) in totals.items()]  # fmt: skip
    rows.sort(key=lambda r: -r["total_ms"])
    return rows[:limit] if limit else rows


def markdown_table(rows: list[dict], meta: dict | None = None, kernels_ms: float | None = None) -> str:
    """The top-operators table as markdown, with the traced kernel total (default: the rows') against the measured
    forward+backward time."""
    lines = ["| op type | calls | total ms | mean ms | share |", "|---|---|---|---|---|"]
    lines += [f"| {r['op_type']} | {r['calls']} | {r['total_ms']:.2f} | {r['mean_ms']:.3f} | {r['share'] * 100:.1f}% |"
              for r in rows]  # fmt: skip
    if meta:
        kernels = sum(r["total_ms"] for r in rows) if kernels_ms is None else kernels_ms
        lines.append("")
        lines.append(f"Updates {meta['steps'][0]}..{meta['steps'][1]}: kernels {kernels:.1f} ms in all, "
                     f"forward+backward measured {meta['forward_backward_s'] * 1000:.1f} ms.")  # fmt: skip
    return "\n".join(lines)


def top_operators_table(run_dir: Path | str, limit: int = 15) -> list[dict] | None:
    """Rank 0's top operators of a profiled run (for the run summary and the Prefect artifact), or None."""
    trace = Path(run_dir) / PROFILE_DIR / "rank-0.json"
    return top_operators(trace, limit) if trace.exists() else None

