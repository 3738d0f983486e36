"""The summary of a `bench/gpu_tests.sh` run: every collected test as PASS, FAIL, ERROR, SKIP, NOT RUN (the budget
ran out), CRASH (the test process died in it) or DONE (it finished before the process died, its result only in the
log), from the JUnit file, the collected plan and the progress events of `tests/gpu/progress.py`.

    python bench/gpu_tests_summary.py XML PLAN PROGRESS PYTEST_STATUS > gpu-tests-summary.txt

Exits 0 when tests were collected and each passed or skipped, else 1: the run's verdict, whatever pytest's own exit
status was (it is 1 when pytest's session limit is reached as the last test ends).
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

GOOD = {"PASS", "SKIP"}


def outcomes(xml: Path, plan: Path, progress: Path, status: int) -> list[tuple[str, str, float, str]]:
    """(status, node, seconds, why) for every planned test, then for any other the run reported."""
    planned = [line.strip() for line in plan.read_text().splitlines() if "::" in line] if plan.exists() else []
    seen: dict[str, tuple[str, float, str]] = {}
    if xml.exists():
        for case in ET.parse(xml).iter("testcase"):
            if not case.get("name"):  # the placeholder an interrupted session leaves
                continue
            node = case.get("classname", "").replace(".", "/") + ".py::" + case.get("name", "")
            result, why = "PASS", ""
            for kind, label in (("failure", "FAIL"), ("error", "ERROR"), ("skipped", "SKIP")):
                found = case.find(kind)
                if found is not None:
                    message = found.get("message")
                    result, why = label, message.splitlines()[0][:160] if message else ""
                    break
            seen[node] = (result, float(case.get("time", 0)), why)
    # A test that started and never finished: the test process died in it (the JUnit file is then missing or partial).
    lines = progress.read_text().splitlines() if progress.exists() else []
    events = [json.loads(line) for line in lines if line.strip()]
    started = {e["node"] for e in events if e["event"] == "start"}
    finished = {e["node"] for e in events if e["event"] == "finish"}
    for node in started - finished:
        seen[node] = ("CRASH", 0.0, f"the test process died in this test (pytest exit status {status})")
    rows = []
    for node in planned + [n for n in seen if n not in planned]:
        if node not in seen and node in finished and not xml.exists():
            seen[node] = ("DONE", 0.0, "finished before the test process died (its result is in gpu-tests.log)")
        result, seconds, why = seen.get(node, ("NOT RUN", 0.0, "time budget or an interrupted run"))
        rows.append((result, node, seconds, why))
    return rows


def main(argv: list[str]) -> int:
    xml, plan, progress, status = Path(argv[0]), Path(argv[1]), Path(argv[2]), int(argv[3])
    rows = outcomes(xml, plan, progress, status)
    counts: dict[str, int] = {}
    for result, node, seconds, why in rows:
        counts[result] = counts.get(result, 0) + 1
        print(f"{result:8} {seconds:7.1f} s  {node}" + (f"  -- {why}" if why else ""))
    print("totals: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 0 if counts and set(counts) <= GOOD else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
