"""Write tests/durations.json, the seconds each test file took, from the output of a `--durations=0` run.

`make test` starts the slowest files first (tests/conftest.py reads the table), so that the two test processes end
together. Refresh the table after tests are added or made faster:

    .venv/bin/python -m pytest -n 2 --dist loadfile --no-loadscope-reorder --durations=0 | tee durations.log
    .venv/bin/python tools/test_durations.py durations.log
"""

from __future__ import annotations

import json
import re
import sys
from collections import defaultdict
from pathlib import Path

TABLE = Path(__file__).resolve().parents[1] / "tests" / "durations.json"
LINE = re.compile(r"^([\d.]+)s (?:call|setup|teardown)\s+(\S+?)(?:::\S*)?$", re.M)


def per_file(log: str) -> dict[str, float]:
    """Seconds per test file (setup, call and teardown of each of its tests) in a `--durations=0` report."""
    totals: dict[str, float] = defaultdict(float)
    for seconds, node in LINE.findall(log):
        totals[node] += float(seconds)
    return {name: round(total, 1) for name, total in sorted(totals.items(), key=lambda kv: (-kv[1], kv[0]))}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    totals = per_file(Path(argv[0]).read_text())
    if not totals:
        print(f"{argv[0]}: no `--durations=0` lines (run pytest with --durations=0)", file=sys.stderr)
        return 1
    TABLE.write_text(json.dumps(totals, indent=1) + "\n")
    print(f"{TABLE}: {len(totals)} files, {sum(totals.values()):.0f} s in all")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
