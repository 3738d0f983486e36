"""The one result format of every benchmark: ``STEM.json`` (the record) and ``STEM.md`` (its report).

Every record carries what makes a measurement a report: the command that produced it, the host (CPU, cores, date,
load average at start) and the versions of the libraries measured (``bench.common.host_info``). The markdown gets the
same facts under its title, so either file alone says how the numbers were taken.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

from bench.common import host_info


def command_line() -> str:
    """The command as typed: ``python -m bench NAME ARGS`` under the CLI, the module's own argv otherwise."""
    return " ".join([sys.argv[0], shlex.join(sys.argv[1:])]).strip()


def commit() -> str:
    """The checkout's commit (``+dirty`` with uncommitted changes), or ``unknown`` outside a git checkout."""
    here = Path(__file__).parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10, check=False).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10, check=False).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha + ("+dirty" if dirty else "")) if sha else "unknown"


def host() -> dict:
    """``bench.common.host_info`` at the time of writing, with the commit measured."""
    info = host_info()
    info["load_average_when_written"] = info.pop("load_average_at_start", None)
    info.setdefault("commit", commit())
    return info


def provenance(record: dict) -> list[str]:
    """Markdown lines naming the command, host and versions of ``record``."""
    h = record["host"]
    versions = ", ".join(f"{k} {v}" for k, v in h.get("versions", {}).items() if v)
    return ["```", record["command"], "```", "",
            f"{h.get('host')}: {h.get('cpu')}, {h.get('cores')} cores; commit {h.get('commit', 'unknown')}; "
            f"Python {h.get('python')}; {versions}; written {h.get('date')}, load average then "
            f"{h.get('load_average_when_written')}."]  # fmt: skip


def write_result(stem: Path, record: dict, markdown: str) -> tuple[Path, Path]:
    """Write ``stem.json`` and ``stem.md``; the record gains ``command`` and ``host`` unless it has them.

    Args:
        stem: the result's path without suffix (``bench/results/tensor-vm``).
        record: the measurements (JSON-serialisable); its ``command`` wins over the process's argv (a benchmark under
            mpiexec knows its launcher line), its ``host`` is completed with ``bench.common.host_info``.
        markdown: the report; the provenance lines go under its first ``#`` title (or on top without one).

    Returns:
        The two paths written.
    """
    own = record.get("host")  # a benchmark's own host facts (or just its name) stay, under ours
    record = {"command": command_line(), **record, "host": {**(own if isinstance(own, dict) else {}), **host()}}
    lines = markdown.strip("\n").split("\n")
    title = lines[:1] if lines[0].startswith("# ") else []
    body = lines[len(title):]
    while body and not body[0].strip():
        body.pop(0)
    lines = [*title, *([""] if title else []), *provenance(record), "", *body]
    stem.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = stem.with_name(stem.name + ".json"), stem.with_name(stem.name + ".md")
    json_path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    md_path.write_text("\n".join(lines) + "\n")
    return json_path, md_path
