"""What every comparison shares: the benchmark's run folder, process launching, and min/median/max summaries.

Each contender runs in its own process tree (so thread pools and MPI start clean) and prints one line
``BENCH_RESULT {json}`` from rank 0; :func:`run_contender` starts it and returns that record.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

RESULT_TAG = "BENCH_RESULT "


@dataclass(frozen=True)
class Setup:
    """The measured workload and how processes are started."""

    shape: dict  # GPTShape fields
    batch_size: int  # samples per rank per step
    warmup_steps: int  # excluded from timing
    timed_steps: int
    display_steps: int  # trainer progress window (steps); warmup_steps and timed_steps are multiples of it
    mpiexec: tuple[str, ...]  # launcher prefix, e.g. (".venv/bin/mpiexec",) or ("mpirun", "--allow-run-as-root")
    python: str = sys.executable
    env: dict = field(default_factory=dict)

    @property
    def total_steps(self) -> int:
        return self.warmup_steps + self.timed_steps


def default_mpiexec() -> tuple[str, ...]:
    """$BENCH_MPIEXEC (split like a shell would), else the mpiexec beside this Python (the PyPI mpich wheel)."""
    if os.environ.get("BENCH_MPIEXEC"):
        return tuple(shlex.split(os.environ["BENCH_MPIEXEC"]))
    return (str(Path(sys.executable).parent / "mpiexec"),)


def summarize(values: list[float]) -> dict:
    """min / median / max / n of a list of measurements (None entries, failed runs, are dropped)."""
    kept = [v for v in values if v is not None]
    if not kept:
        return {"min": None, "median": None, "max": None, "n": 0}
    return {"min": min(kept), "median": statistics.median(kept), "max": max(kept), "n": len(kept)}


def commit(where: Path | None = None) -> str:
    """The commit of the checkout holding ``where`` (default: this package's), ``+dirty`` with uncommitted changes to
    tracked files, or ``unknown`` outside a git checkout."""
    here = where or Path(__file__).parent
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10, check=False).stdout.strip()  # fmt: skip
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=10, check=False).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (sha + ("+dirty" if dirty else "")) if sha else "unknown"


def gpu_names() -> str | None:
    """The GPUs ``nvidia-smi`` lists (name and memory, one entry per GPU), or None without it."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=False).stdout.strip()  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return "; ".join(line.strip() for line in out.splitlines() if line.strip()) or None


def host_info() -> dict:
    """Where the numbers come from: host, CPU, cores, GPUs, the commit measured, Python and package versions."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for name in ("numpy", "onnxruntime", "onnx", "torch", "mpi4py"):
        try:
            versions[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - a missing package is reported, not fatal
            versions[name] = None
    return {
        "host": socket.gethostname(), "cpu": cpu, "cores": len(os.sched_getaffinity(0)), "gpu": gpu_names(),
        "commit": commit(), "python": platform.python_version(), "versions": versions,
        "load_average_at_start": os.getloadavg(),  # other processes on the machine skew every timing
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }  # fmt: skip


def thread_env(threads: int) -> dict:
    """Environment pinning every thread pool a rank might start (OpenMP, MKL, OpenBLAS) to ``threads``."""
    n = str(threads)
    return {"OMP_NUM_THREADS": n, "MKL_NUM_THREADS": n, "OPENBLAS_NUM_THREADS": n}


def parse_result(output: str) -> dict | None:
    """The last ``BENCH_RESULT`` record in a process's output."""
    found = None
    for line in output.splitlines():
        at = line.find(RESULT_TAG)
        if at >= 0:
            found = json.loads(line[at + len(RESULT_TAG) :])
    return found


def run_command(cmd: list[str], env: dict, timeout: float, log: Path | None = None) -> tuple[int, str, float]:
    """Run ``cmd``; returns (exit status, output, wall seconds). Output is also written to ``log``."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **env},
            timeout=timeout, stdin=subprocess.DEVNULL, check=False,
        )  # fmt: skip
        code, out = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as err:
        code, out = 124, (err.stdout or b"").decode(errors="replace") if isinstance(err.stdout, bytes) else str(err)
    wall = time.perf_counter() - t0
    if log is not None:
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text(f"$ {shlex.join(cmd)}\n{out}\nexit {code} after {wall:.1f} s\n")
    return code, out, wall


def spawn_ranks(cmd: list[str], world: int, env: dict, timeout: float) -> tuple[int, str]:
    """Start ``world`` copies of ``cmd`` the way torchrun does (RANK, WORLD_SIZE, MASTER_ADDR/PORT); rank 0's output."""
    port = 29500 + (os.getpid() * 7 + int(time.time())) % 2000
    procs = []
    for rank in range(world):
        rank_env = {**os.environ, **env, "RANK": str(rank), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                    "MASTER_PORT": str(port)}  # fmt: skip
        out = subprocess.PIPE if rank == 0 else subprocess.DEVNULL
        procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, text=True, env=rank_env,
                                      stdin=subprocess.DEVNULL))  # fmt: skip
    try:
        output, _ = procs[0].communicate(timeout=timeout)
        codes = [p.wait(timeout=timeout) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        return 124, "timed out"
    return max(codes, key=abs), output


def add_shape_options(parser, shape: dict) -> None:
    """The GPT shape options of a layout bench (``--vocab-size``, ``--d-model``, ``--num-layers``, ``--num-heads``,
    ``--seq-len``), defaulting to ``shape``; :func:`set_shape` writes the parsed ones back into it."""
    parser.add_argument("--vocab-size", type=int, default=shape["vocab_size"],
                        help="rows of the token table and LM head (the byte-level text uses ids < 256)")
    for key in ("d_model", "num_layers", "num_heads", "seq_len"):
        parser.add_argument("--" + key.replace("_", "-"), type=int, default=shape[key])


def set_shape(shape: dict, args) -> None:
    """``shape`` updated from the options :func:`add_shape_options` added."""
    shape.update({key: getattr(args, key) for key in shape})


def fresh_dir(path: Path) -> Path:
    """An empty folder at ``path``."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another file system, or one without hard links
        shutil.copy2(source, target)


def link_configured(cfg, configured: Path) -> bool:
    """Give ``cfg``'s run folder the artifacts and data shards of the run folder ``configured``, as hard links, when
    configure would build the same artifacts for both (the same configure fingerprint: model, precision, layout;
    ``distributed.recompute_forward``, ``num_ranks`` or the batch schedule are outside it) and ``cfg``'s folder holds
    no artifacts yet. ``configure`` and ``prepare-data`` of ``cfg`` then verify and reuse them instead of building
    them again; both replace the files they write (a new file renamed into place), so the folders stay independent.

    Returns:
        Whether the folder was linked (False: ``configure`` of ``cfg`` builds its own artifacts).
    """
    from ortflow.configure.configure import fingerprint, read_configure_record

    target = Path(cfg.output_dir)
    record = read_configure_record(configured)
    if record is None or (target / "artifacts").exists() or record.get("fingerprint") != fingerprint(cfg):
        return False
    target.mkdir(parents=True, exist_ok=True)
    for name in ("artifacts", "data"):
        if (configured / name).is_dir():
            shutil.copytree(configured / name, target / name, copy_function=_link_or_copy)
    shutil.copy2(configured / "configure.json", target / "configure.json")  # configure records the new place
    return True


def in_processes(calls: list) -> list:
    """Each call (a picklable callable: a ``functools.partial`` of a module-level function) in a spawned process of
    its own, all at once; their results, in order. For configures, which are CPU-bound and single-process: a host with
    cores to spare builds two layouts' artifacts in the time of the slower one."""
    import concurrent.futures
    import multiprocessing

    if len(calls) < 2:
        return [call() for call in calls]
    with concurrent.futures.ProcessPoolExecutor(len(calls), mp_context=multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(call) for call in calls]
        return [future.result() for future in futures]


def random_tokens(rows: int, seq_len: int, vocab: int, seed: int):
    """[rows, seq_len + 1] token ids with some structure (a noisy repeating pattern) so that the loss can fall."""
    import numpy as np  # here: the GPU suite's driver imports this module with the standard library alone

    rng = np.random.default_rng(seed)
    base = (np.arange(seq_len + 1)[None, :] * rng.integers(1, 7, (rows, 1)) + rng.integers(0, vocab, (rows, 1)))
    noise = rng.random((rows, seq_len + 1)) < 0.1
    return np.where(noise, rng.integers(0, vocab, (rows, seq_len + 1)), base % vocab).astype(np.int64)


# The one result format of every benchmark: ``STEM.json`` (the record) and ``STEM.md`` (its report). Every record
# carries the command that produced it, the host (CPU, cores, date, load average) and the versions measured; the
# markdown gets the same facts under its title, so either file alone says how the numbers were taken.

def command_line() -> str:
    """The command as typed: ``python -m bench NAME ARGS`` under the CLI, the module's own argv otherwise."""
    return " ".join([sys.argv[0], shlex.join(sys.argv[1:])]).strip()


def host() -> dict:
    """``host_info`` at the time of writing."""
    info = host_info()
    info["load_average_when_written"] = info.pop("load_average_at_start", None)
    return info


def provenance(command: str, info: dict) -> list[str]:
    """The standard provenance block of every report: the command in a code block, then one line with the commit,
    the host (CPU and cores, GPUs where there are), Python, the package versions, the date and the load average.

    Args:
        command: the command as typed.
        info: :func:`host_info` or :func:`host` facts; missing ones are left out (``commit`` reads ``unknown``).
    """
    where = [f"{info['host']}:" if info.get("host") else "",
             f"{info['cpu']}," if info.get("cpu") else "",
             f"{info['cores']} cores" if info.get("cores") else ""]  # fmt: skip
    parts = [f"commit {info.get('commit') or 'unknown'}", " ".join(w for w in where if w).rstrip(",:")]
    if info.get("gpu"):
        parts.append(f"GPUs {info['gpu']}")
    if info.get("python"):
        parts.append(f"Python {info['python']}")
    versions = info.get("versions") or {}
    if isinstance(versions, dict):
        versions = ", ".join(f"{k} {v}" for k, v in versions.items() if v)
    parts.append(versions)
    when = f"written {info['date']}" if info.get("date") else ""
    for key, label in (("load_average_when_written", "load average then"), ("load_average_at_start",
                                                                           "load average at start")):
        if info.get(key) is not None:
            load = ", ".join(f"{x:.2f}" for x in info[key]) if isinstance(info[key], list | tuple) else info[key]
            when += f"{', ' if when else ''}{label} ({load})"
            break
    parts.append(when)
    line = "; ".join(p for p in parts if p)
    return ["```", command, "```", "", line[:1].upper() + line[1:] + "."]


def with_provenance(markdown: str, command: str, info: dict) -> str:
    """``markdown`` with :func:`provenance`'s block under its first ``#`` title (on top without one)."""
    lines = markdown.strip("\n").split("\n")
    title = lines[:1] if lines[0].startswith("# ") else []
    body = lines[len(title) :]
    while body and not body[0].strip():
        body.pop(0)
    return "\n".join([*title, *([""] if title else []), *provenance(command, info), "", *body]) + "\n"


def write_result(stem: Path, record: dict, markdown: str) -> tuple[Path, Path]:
    """Write ``stem.json`` and ``stem.md``; the record gains ``command`` and ``host`` unless it has them.

    Args:
        stem: the result's path without suffix (``bench/out/tensor-vm``).
        record: the measurements (JSON-serialisable); its ``command`` wins over the process's argv (a benchmark under
            mpiexec knows its launcher line), its ``host`` is completed with ``host``.
        markdown: the report; :func:`provenance`'s block goes under its first ``#`` title (or on top without one).

    Returns:
        The two paths written.
    """
    own = record.get("host")  # a benchmark's own host facts (or just its name) stay, under ours
    record = {"command": command_line(), **record, "host": {**(own if isinstance(own, dict) else {}), **host()}}
    stem.parent.mkdir(parents=True, exist_ok=True)
    json_path, md_path = stem.with_name(stem.name + ".json"), stem.with_name(stem.name + ".md")
    json_path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    md_path.write_text(with_provenance(markdown, record["command"], record["host"]))
    return json_path, md_path
