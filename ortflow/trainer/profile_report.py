"""Reading the per-operator profiles a profiled run writes (:mod:`.profiling`): ``--profile A:B`` parsing and the
top-operators table of the run summary. The orchestrator and the CLI read these; nothing here needs numpy or the
engine."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

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
