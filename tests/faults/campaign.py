"""The long fault campaign (``make faults``): many trials of every kind, figures written to bench/out/
(the curated report: bench/reports/faults-campaign.md).

Usage: python -m tests.faults.campaign [--scale 1.0] [--only GROUP,...] [--out bench/out/faults-campaign]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import signal
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from tests.faults import trials
from tests.faults import trials_files as files
from tests.faults import trials_launcher as launcher
from tests.faults import trials_run_folder as folder


def plan(scale: float, only: str = "") -> list[tuple[str, callable]]:
    """(category group, zero-argument trial) for the whole campaign."""
    from tests.faults import trials_reliability as rel  # it imports Prefect; the report (markdown) does not need it

    n = lambda count: max(1, round(count * scale))  # noqa: E731
    rng = random.Random(19)
    root = Path(tempfile.mkdtemp(prefix="ortflow-faults-"))
    ref = {}

    def reference():
        if not ref:
            ref["p"] = trials.reference_parameters(root)
        return ref["p"]

    jobs = []
    for target in ("rank", "launcher", "cli"):
        for i in range(n(15)):
            jobs.append(("kills", lambda t=target, i=i: trials.kill_trial(root, reference(), t, rng, f"k-{t}-{i}")))
    for phase in ("write", "retention"):
        for i in range(n(10)):
            jobs.append(("kills", lambda p=phase, i=i: trials.kill_in_save_trial(root, reference(), p, rng,
                                                                                   f"s-{p}-{i}")))
    for target in ("cli", "launcher", "group", "all"):
        for sig in (signal.SIGTERM, signal.SIGINT):
            for i in range(n(2)):
                jobs.append(("stops", lambda t=target, s=sig, i=i: trials.signal_trial(root, t, s, f"st-{t}-{s}-{i}")))
    for target in ("cli", "launcher", "proxy"):
        for i in range(n(3)):
            jobs.append(("orphans", lambda t=target, i=i: trials.orphan_trial(root, t, f"o-{t}-{i}")))
    for i in range(n(10)):
        jobs.append(("hangs", lambda i=i: trials.hang_trial(root, i % 2, i % 3 != 0, f"h-{i}")))
    for kind in files.FILE_KINDS:
        for mode in ("flip", "truncate"):
            for _ in range(n(15)):
                jobs.append(("integrity", lambda k=kind, m=mode: files.corruption_trial(root, k, m, rng)))
    jobs.append(("disk-full", lambda: _disk_full(root)))
    for i in range(n(3)):
        jobs.append(("concurrent", lambda i=i: files.concurrent_trial(root, reference(), f"c-{i}")))
    for damage in folder.RECORD_DAMAGE:
        for command in folder.COMMANDS:
            jobs.append(("run-folder", lambda d=damage, c=command: folder.record_trial(root, d, c, rng)))
    for truncate in (False, True):
        for _ in range(n(4)):
            jobs.append(("run-folder", lambda t=truncate: folder.config_edit_trial(root, t, rng)))
    for move in (False, True):
        for i in range(n(2)):
            jobs.append(("run-folder", lambda m=move, i=i: folder.copy_move_trial(root, m, f"cm-{m}-{i}")))
    for sig in (signal.SIGINT, signal.SIGTERM):
        for i in range(n(4)):
            jobs.append(("stops", lambda s=sig, i=i: folder.double_signal_trial(root, s, rng, f"ds-{s}-{i}")))
    for concurrent in (False, True):
        for i in range(n(3)):
            jobs.append(("ownership", lambda c=concurrent, i=i: rel.shared_dir_trial(root, c, f"sh-{c}-{i}")))
    for target in ("cli", "launcher", "proxy"):
        for i in range(n(3)):
            jobs.append(("stalled", lambda t=target, i=i: launcher.stopped_launcher_trial(root, t, f"sl-{t}-{i}")))
    for target in ("tstp", "cli", "launcher", "proxy"):
        for i in range(n(2)):
            jobs.append(("stalled", lambda t=target, i=i: launcher.paused_trial(root, (t,), f"pa-{t}-{i}")))
    for kind in rel.RERUN_KINDS:
        for mode in ("flip", "truncate"):
            for _ in range(n(8)):
                jobs.append(("rerun", lambda k=kind, m=mode: rel.rerun_corruption_trial(root, k, m, rng)))
    jobs += [("inputs", lambda c=case: rel.bad_input_trial(root, c)) for case in rel.INPUT_CASES]
    jobs += [("disk-paths", lambda c=case: rel.disk_trial(root, c)) for case in rel.DISK_CASES]
    base = {}

    def fuzz_config():
        if not base:
            base["raw"] = trials.fresh_run(root, "fuzzbase").model_dump(mode="json")
        return files.fuzz_config_trial(base["raw"], rng)

    jobs += [("fuzz", fuzz_config) for _ in range(n(250))]
    jobs += [("fuzz", lambda: (reference(), files.fuzz_model_trial(root / "mlp.onnx", root, rng))[1])
             for _ in range(n(40))]
    jobs += [("fuzz", lambda i=i: (reference(), files.fuzz_data_trial(root, rng, f"fd-{i}"))[1]) for i in range(n(30))]
    wanted = [w for w in only.split(",") if w]
    return [(group, job) for group, job in jobs
            if not wanted or any(w == group or w in _names(job) for w in wanted)]


def _names(job) -> str:
    """The constants a trial lambda was bound with (its kind, phase or target), for --only."""
    return " ".join(str(v) for v in (job.__defaults__ or ()))


def _disk_full(root: Path) -> trials.Outcome:
    mount = root / "tmpfs"
    if not files.tmpfs(mount):
        return trials.Outcome("disk-full", True, "SKIPPED: needs root for a tmpfs", "skipped")
    try:
        return files.disk_full_trial(root, mount)
    finally:
        files.untmpfs(mount)


def markdown(record: dict) -> str:
    """The campaign's figures as a markdown table (bench/reports/faults-campaign.md)."""
    lines = [
        f"# Fault campaign, {record['started']} ({record['minutes']} min)", "",
        f"Command: `{record['command']}`  ", f"Commit: {record.get('commit', 'not recorded')}  ",
        f"Machine: {record['machine']}", "",
        f"**{record['survived']} of {record['trials']} trials survived, {record['failed']} failed.**", "",
        "| group | category | trials | survived | failed | failures belong to | what a survivor showed |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, entry in sorted(record["by_category"].items(), key=lambda kv: (kv[1].get("group", ""), kv[0])):
        owners = sorted({f["owner"] or "this suite" for f in entry["failures"]})
        lines.append(f"| {entry.get('group', '')} | {name} | {entry['trials']} | {entry['survived']} | "
                     f"{entry['failed']} | {', '.join(owners)} | {_cell(entry.get('example', ''))} |")
    failures = [(n, f) for n, e in record["by_category"].items() for f in e["failures"]]
    if failures:
        lines += ["", "## Failures", ""] + [f"- {n}: {f['detail'][:300]}" for n, f in failures[:40]]
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    """One table cell: the run's temporary folder elided, pipes escaped, at most 160 characters."""
    text = " ".join(text.split())
    for marker in ("/tmp/ortflow-faults-",):
        while marker in text:
            start = text.index(marker)
            end = text.find("/", start + len(marker))
            text = text[:start] + "…" + (text[end:] if end > 0 else "")
    return text.replace("|", "\\|")[:160]


def _commit() -> str:
    """The commit the campaign ran on, and whether the working tree had changes."""
    import subprocess

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=30).stdout.strip()
        except OSError:
            return ""

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "not a git checkout"
    return head + (" with local changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--scale", type=float, default=1.0, help="Multiply every trial count.")
    parser.add_argument("--out", type=Path, default=Path("bench/out/faults-campaign"))
    parser.add_argument("--only", default="", help="Run only these groups (comma-separated: kills, stops, orphans, "
                        "hangs, integrity, disk-full, concurrent, fuzz, ownership, run-folder, stalled, rerun, "
                        "inputs, disk-paths), or the trials whose lambda names this phase or kind.")
    args = parser.parse_args(argv)
    start, commit = time.time(), _commit()
    by_category: dict[str, dict] = defaultdict(lambda: {"trials": 0, "survived": 0, "failed": 0, "failures": []})
    for group, job in plan(args.scale, args.only):
        try:
            outcome = job()
        except Exception as err:  # noqa: BLE001 - a trial that crashes is a failed trial, recorded
            outcome = trials.Outcome(group, False, f"trial crashed: {type(err).__name__}: {err}")
        entry = by_category[outcome.category]
        entry["group"] = group
        entry["trials"] += 1
        entry["survived" if outcome.ok else "failed"] += 1
        if outcome.ok and not entry.get("example"):
            entry["example"] = outcome.detail[:400]
        if not outcome.ok:
            entry["failures"].append({"detail": outcome.detail[:400], "owner": outcome.owner})
        print(f"{'ok  ' if outcome.ok else 'FAIL'} {outcome.category}: {outcome.detail[:200]}", flush=True)
    total = sum(e["trials"] for e in by_category.values())
    survived = sum(e["survived"] for e in by_category.values())
    record = {
        "command": "make faults  (.venv/bin/python -m tests.faults.campaign " + " ".join(sys.argv[1:]) + ")",
        "commit": commit,
        "machine": f"{platform.node()} {platform.machine()}, Python {platform.python_version()}",
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start)),
        "minutes": round((time.time() - start) / 60, 1),
        "trials": total, "survived": survived, "failed": total - survived,
        "by_category": dict(sorted(by_category.items())),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(record))
    print(f"{survived}/{total} trials survived; figures in {args.out.with_suffix('.json')}")
    return 0 if survived == total else 1


if __name__ == "__main__":
    sys.exit(main())
