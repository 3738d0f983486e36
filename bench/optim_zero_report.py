"""One table from ``python -m bench optim-zero`` runs at several rank counts.

Each run: ``mpiexec -n N python -m bench optim-zero --out DIR/optim-zero-Nranks.md``.

    python -m bench optim-zero-report DIR [--out DIR/optim-zero-scaling.md]

Reads ``DIR/optim-zero-<N>ranks.json``; per rank count: the ZeRO-0 and ZeRO-1 update times (mean over ranks and the
slowest rank), ZeRO-1's update relative to the 1-rank update (goal: close to 1/N), the step times and their ratio
(goal: ZeRO-1 not slower), and the optimizer state per rank.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from bench.record import write_result


def table(results: list[dict]) -> str:
    """Markdown rows for results sorted by rank count; the smallest rank count is the reference."""
    results = sorted(results, key=lambda r: r["ranks"])
    base = results[0]
    ref = base["stages"]["ZeRO-0"]["update"]
    lines = [
        f"Reference: the ZeRO-0 update at {base['ranks']} rank(s), {ref:.1f} ms; {base['num_parameters']:,} "
        "parameters. ms are medians over rounds; 'mean' over ranks, 'slowest' the slowest rank.", "",
        "| ranks | ZeRO-0 update | ZeRO-1 update mean | ZeRO-1 slowest | ZeRO-1 / reference | 1/N | ZeRO-0 step | "
        "ZeRO-1 step | step ZeRO-1/ZeRO-0 | state ZeRO-0 MiB | state ZeRO-1 MiB |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        z0, z1, n = r["stages"]["ZeRO-0"], r["stages"]["ZeRO-1"], r["ranks"]
        lines.append(
            f"| {n} | {z0['update']:.1f} | {z1['update']:.1f} | {z1['update_slowest']:.1f} | "
            f"{z1['update_slowest'] / ref:.2f} | {1 / n:.2f} | {z0['step']:.1f} | {z1['step']:.1f} | "
            f"{z1['step'] / z0['step']:.2f} | {z0['state_mib']:.1f} | {z1['state_mib']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    files = sorted(args.folder.glob("optim-zero-*ranks.json"))
    if not files:
        print(f"no optim-zero-*ranks.json in {args.folder}", file=sys.stderr)
        return 1
    runs = [json.loads(f.read_text()) for f in files]
    text = "# ZeRO-1 vs ZeRO-0 by rank count (CPU)\n\n" + table(runs)
    print(text)
    write_result((args.out or args.folder / "optim-zero-scaling.md").with_suffix(""), {"runs": runs}, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
