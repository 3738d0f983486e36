"""Ranks x threads for a host, and the per-rank batch that keeps a global batch the same on any layout.

Everything here is a pure function of numbers passed in (cores, memory, model size, batch sizes), so it is tested
without processes; :func:`host_resources` is the only reader of the machine. The batch split itself
(:func:`ortflow.config.plan_batch`) lives with the config, because every rank resolves its own batch with it too.

The rule (docs/layouts.md): the engine's intra-op threading scales poorly (2.4x
from 1 to 32 threads on a 32-core Xeon, 1.7x from 1 to 2 here) while data-parallel ranks of one thread each scale
well (16 x 1 reached 3.7x the tokens/s of 1 x 32 on that Xeon; 2 x 1 beat 1 x 2 by 1.15x on 2 cores). So ``auto``
starts one single-threaded rank per physical core (SMT siblings share one core's arithmetic units: the Xeon's 32
CPUs gave numpy's GEMM 13.6x one CPU's speed, and 16 x 1 was its fastest layout measured), as many as memory holds
(a rank holds parameters, gradients and the two AdamW moments, plus the engine's own working memory), and, when a
global batch is set, the most ranks that divide it, and at most 16 per host (the largest count measured to pay).
Physical cores left over go to the ranks as threads.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from ortflow.config import (
    BatchPlan,
    DistributedConfig,
    LayoutError,
    RunFacts,
    divides,
    fixed_batch_dim,
    nearest_multiples,
    plan_batch,
    run_facts,
)
from ortflow.config.atomic import write_text_atomic
from ortflow.gpus import gpu_count

__all__ = [
    "MAX_AUTO_RANKS", "BatchPlan", "Host", "Layout", "LayoutError", "RunFacts", "auto_layout", "divides",
    "fixed_batch_dim", "gpu_layout", "host_resources", "launch_layout", "nearest_multiples", "plan_batch", "read_tuned",
    "replica_layout",
    "run_facts", "write_tuned",
]

#: Bytes a rank holds per trainable fp32 parameter: the value, its gradient and AdamW's two moments.
STATE_BYTES_PER_PARAMETER = 16
#: A rank's memory beyond its parameters and optimizer state: interpreter, engine, graphs, activations of a small
#: micro-batch. Measured: 695 MB peak resident for a rank of the bench GPT (3.3 M parameters, 53 MB of state, batch
#: 8 x 128, attention included); rounded up to leave room for larger micro-batches.
RANK_BASE_BYTES = 1024 * 2**20
#: Share of the host's available memory that auto may plan for (the rest: page cache, the launcher, data shards).
MEMORY_SHARE = 0.8
#: The most ranks ``auto`` starts on one host: the largest count measured to pay (16 x 1 on the 32-CPU Xeon, where
#: each rank already ran at 0.56 of a lone rank's speed); beyond it, cores go to the ranks as threads (``ortflow tune``
#: also times one rank per CPU).
MAX_AUTO_RANKS = 16
#: The winner of ``ortflow tune``, kept in the run folder and reused by ``auto`` on a host of the same size.
TUNED_LAYOUT_FILE = "layout.json"


@dataclass(frozen=True)
class Host:
    """What a host offers the ranks: CPUs this process may use, available memory in bytes, and the physical cores
    behind those CPUs (None: as many as CPUs, e.g. when the topology cannot be read)."""

    cores: int
    memory_bytes: int
    physical_cores: int | None = None
    gpus: int | None = None  # None: ask the driver when a layout needs it (num_ranks auto with device cuda)

    @property
    def compute_cores(self) -> int:
        """Physical cores: what ``auto`` spreads ranks and threads over."""
        return min(self.physical_cores or self.cores, self.cores)


@dataclass(frozen=True)
class Layout:
    """Ranks per host x intra-op threads per rank, and why they were chosen."""

    ranks: int
    threads: int
    reason: str

    @property
    def pair(self) -> tuple[int, int]:
        """(ranks, threads)."""
        return self.ranks, self.threads


def rank_memory_bytes(num_parameters: int) -> int:
    """Memory one rank needs: fp32 parameters, gradients, AdamW moments, plus the engine's base."""
    return STATE_BYTES_PER_PARAMETER * num_parameters + RANK_BASE_BYTES


def auto_layout(
    host: Host, num_parameters: int, global_batch: int | None = None, fixed_batch: int | None = None
) -> Layout:
    """The rule: one single-threaded rank per physical core, bounded by memory, by :data:`MAX_AUTO_RANKS` and by the
    global batch's divisors.

    Args:
        host: Cores and available memory.
        num_parameters: Trainable parameters of the model (fp32).
        global_batch: Samples per weight update when fixed (train.global_batch_size), else None.
        fixed_batch: The model's fixed batch dim, if any: every micro-batch must be exactly this.

    Raises:
        LayoutError: not even one replica with its optimizer state fits the memory, or no rank count divides the
            global batch.
    """
    need = rank_memory_bytes(num_parameters)
    by_memory = int(host.memory_bytes * MEMORY_SHARE // need)
    if by_memory < 1:
        raise LayoutError(
            f"distributed.num_ranks auto: one rank needs about {need / 2**30:.1f} GiB (parameters, gradients, AdamW "
            f"moments, engine) but this host has {host.memory_bytes / 2**30:.1f} GiB available; free memory or use a "
            "larger host"
        )
    cores = host.compute_cores
    ranks = max(1, min(cores, by_memory, MAX_AUTO_RANKS))
    why = (f"{cores} physical cores" if ranks == cores else f"memory for {by_memory} replicas" if ranks == by_memory
           else f"at most {MAX_AUTO_RANKS} ranks per host, of {cores} physical cores")  # fmt: skip
    if cores < host.cores:
        why += f" of {host.cores} CPUs"
    if global_batch is not None:
        unit = fixed_batch or 1
        fitting = [r for r in range(ranks, 0, -1) if divides(global_batch, r, unit)]
        if not fitting:
            raise LayoutError(
                f"train.global_batch_size {global_batch} is not a multiple of the model's fixed batch dim {unit}: use "
                f"{', '.join(map(str, nearest_multiples(global_batch, unit)))}"
            )
        if fitting[0] != ranks:
            why += f", largest rank count <= {ranks} dividing global batch {global_batch}"
        ranks = fitting[0]
    return Layout(ranks, max(1, cores // ranks), f"auto: {why}; 1 rank per physical core (docs/layouts.md)")


def replica_layout(host: Host, num_parameters: int, global_batch: int | None = None, fixed_batch: int | None = None,
                   split: int = 1) -> Layout:
    """The rule (:func:`auto_layout`) for a model whose replica takes ``split`` ranks (``pipeline_parallel_size x
    horizontal_parallel_size``): the most whole replicas up to the rule's ranks whose count splits the global batch;
    one replica, its ranks sharing the cores, on a host with fewer cores than a replica takes.

    Raises:
        LayoutError: as :func:`auto_layout`.
    """
    rule = auto_layout(host, num_parameters, None if split > 1 else global_batch, fixed_batch)
    unit = fixed_batch or 1
    fitting = [r for r in range(rule.ranks, 0, -1)
               if r % split == 0 and (global_batch is None or divides(global_batch, r // split, unit))]
    ranks = fitting[0] if fitting else split
    if ranks == rule.ranks:
        return rule
    return Layout(ranks, max(1, host.cores // ranks),
                  f"{rule.reason}; whole replicas of pipeline x tensor-parallel {split} rank(s)")


def physical_cores(cpus: set[int], sysfs: Path = Path("/sys/devices/system/cpu")) -> int | None:
    """Distinct physical cores (package, core id) behind ``cpus``, from sysfs; None when it cannot be read."""
    found = set()
    try:
        for cpu in cpus:
            topology = sysfs / f"cpu{cpu}" / "topology"
            package, core = (topology / "physical_package_id").read_text(), (topology / "core_id").read_text()
            found.add((package.strip(), core.strip()))
    except OSError:
        return None
    return len(found) or None


def host_resources() -> Host:
    """CPUs this process may use, their physical cores, and the memory available to it (MemAvailable, bounded by a
    cgroup limit)."""
    cpus = os.sched_getaffinity(0)
    cores = len(cpus)
    available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            available = min(available, int(limit))
    except (OSError, ValueError):
        pass
    return Host(cores, available, physical_cores(cpus))


def read_tuned(run_dir: Path, host: Host) -> Layout | None:
    """The layout ``ortflow tune`` recorded for a host with the same cores, else None."""
    try:
        record = json.loads((Path(run_dir) / TUNED_LAYOUT_FILE).read_text())
    except (OSError, ValueError):
        return None
    if record.get("host", {}).get("cores") != host.cores:
        return None
    best = record["best"]
    return Layout(int(best["ranks"]), int(best["threads"]), f"tuned: {best.get('samples_per_s', 0):.1f} samples/s")


def write_tuned(run_dir: Path, host: Host, results: list[dict]) -> Path:
    """Record the candidates' measured throughput and the winner (highest samples/s)."""
    best = max(results, key=lambda r: r["samples_per_s"])
    path = Path(run_dir) / TUNED_LAYOUT_FILE
    write_text_atomic(path, json.dumps({"host": asdict(host), "best": best, "candidates": results}, indent=2))
    return path


def launch_layout(
    cfg, run_dir: Path, host: Host, ranks: int | str | None = None, threads: int | None = None
) -> tuple[Layout, BatchPlan | None]:
    """The layout ``ortflow train`` starts, and the batch split it implies (checked before any rank starts).

    Args:
        cfg: The run config.
        run_dir: The configured run folder (configure.json, layout.json of ``ortflow tune``).
        host: This host's cores and memory.
        ranks: ``--np``: a number, ``"auto"``, or None for distributed.num_ranks.
        threads: ``--threads``, or None for distributed.threads_per_rank (default: cores / local ranks; 1 on CUDA
            ranks sharing a host).

    Raises:
        LayoutError: no layout fits, or the global batch cannot be split over the chosen ranks.
    """
    dist, train = cfg.distributed, cfg.train
    split = dist.pipeline_parallel_size * dist.horizontal_parallel_size  # the ranks of one replica
    wanted = ranks if ranks is not None else dist.num_ranks
    facts = run_facts(run_dir) if wanted == "auto" or train.global_batch_size else None
    if wanted == "auto" and dist.device == "cuda":
        layout = gpu_layout(host, dist)
    elif wanted == "auto":
        tuned = read_tuned(run_dir, host)
        if tuned is not None and (tuned.ranks % split or train.global_batch_size and not divides(
            train.global_batch_size, tuned.ranks * dist.num_hosts // split, facts.fixed_batch or 1
        )):  # fmt: skip
            tuned = None  # the recorded winner makes no whole replicas, or they cannot split this global batch
        layout = tuned or replica_layout(host, facts.num_parameters, _per_host(train.global_batch_size, dist.num_hosts),
                                         facts.fixed_batch, split)  # fmt: skip
        layout = Layout(layout.ranks * dist.num_hosts, layout.threads, layout.reason)
    else:
        local = -(-int(wanted) // dist.num_hosts)
        layout = Layout(int(wanted), dist.default_threads(host.cores, local),
                        "distributed.num_ranks" if ranks is None else "--np")
    if threads or dist.threads_per_rank:
        layout = Layout(layout.ranks, threads or dist.threads_per_rank, layout.reason)
    if layout.ranks % split:  # every rank would refuse it at start
        raise LayoutError(
            f"{layout.ranks} rank(s) ({layout.reason}) do not make whole replicas of pipeline_parallel_size "
            f"{dist.pipeline_parallel_size} x horizontal_parallel_size {dist.horizontal_parallel_size} = {split} "
            f"rank(s): use a multiple of {split} ({', '.join(str(split * k) for k in range(1, 4))}, ...)"
        )
    plan = None
    if train.global_batch_size:  # split over the data-parallel replicas, as every rank splits it (rank_config)
        replicas = max(1, layout.ranks // split)
        plan = plan_batch(train.global_batch_size, replicas, train.batch_size, facts.fixed_batch)
    return layout, plan


def gpu_layout(host: Host, dist: DistributedConfig) -> Layout:
    """``num_ranks: auto`` on CUDA: one rank per GPU visible on this host (NCCL needs a GPU per rank), on each of
    ``num_hosts`` hosts, with the CUDA default of engine threads.

    Raises:
        LayoutError: no GPU is visible here.
    """
    gpus, why = (host.gpus, None) if host.gpus is not None else gpu_count()
    if not gpus:
        raise LayoutError(
            f"distributed.num_ranks auto with device cuda starts one rank per GPU, but {why or 'no GPU is visible'}: "
            "run `ortflow doctor`, or give distributed.num_ranks"
        )
    return Layout(gpus * dist.num_hosts, dist.default_threads(host.cores, gpus),
                  f"auto: one rank per GPU, {gpus} visible on this host")


def _per_host(global_batch: int | None, num_hosts: int) -> int | None:
    if global_batch is None or global_batch % num_hosts:
        return global_batch if num_hosts == 1 else None
    return global_batch // num_hosts
