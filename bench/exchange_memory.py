"""Why a bare all-reduce is slower on the engine's gradient memory than on a numpy buffer (issue 20, Open MPI).

On the 32-CPU device machine (Open MPI 4.1.6) one ``Allreduce(IN_PLACE)`` of the bench GPT's 13.3 MB of gradients cost
1.55x (2 ranks) / 1.94x (16 ranks) on the engine's own gradient run what it cost on a numpy buffer of the same bytes
(bench/results/exchange-vm-*-20261123-0726*.md, ``bare-runs`` against ``bare``). Candidates: the pages (numpy asks
for transparent huge pages for its large arrays; the engine's arena does not, and ``MADV_COLLAPSE`` needs Linux >=
6.1), the values (the old bench summed a buffer of ones without rescaling, so ``bare`` ran on inf after ~130 calls),
and where the memory lies (NUMA). Run under the launcher::

    mpirun -n 2 python -m bench.exchange_memory [--rounds 10] [--calls 10]

Buffers, all the same bytes, each refilled from the same finite random values before every timed call (untimed, so
every call reduces freshly written memory, as after a backward pass):

* ``numpy``: ``np.empty`` (numpy advises huge pages for it);
* ``numpy-4k``: ``np.empty`` with numpy's huge-page advice off (4 KiB pages);
* ``engine``: the engine's gradient run as the engine allocated it (no advice);
* ``engine-advised``: the same run after ortflow's ``advise_huge_pages`` (``MADV_HUGEPAGE`` + ``MADV_COLLAPSE``);
* ``engine-refault``: the same run after ``refault_huge_pages`` (contents copied out, the whole 2 MiB pages dropped
  with ``MADV_DONTNEED`` after ``MADV_HUGEPAGE``, copied back, so the kernel faults them in as huge pages on kernels
  without ``MADV_COLLAPSE``).

Prints, per rank 0: the kernel, THP settings, each buffer's AnonHugePages share (from /proc/self/smaps), and per
buffer min / median / max over rounds of the round's median call and its ratio to ``numpy`` within the round.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import os
import platform
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.bench_exchange import engine_gradients
from ortflow.trainer.comm import runs

_MADV_DONTNEED, _MADV_HUGEPAGE = 4, 14


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def huge_share(a: np.ndarray) -> float:
    """Share of ``a``'s bytes in mappings' AnonHugePages (approximate: the mappings that overlap it)."""
    lo, hi = _address(a), _address(a) + a.nbytes
    huge = size = 0
    overlap = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()
            if head and "-" in head[0] and len(head[0]) > 8 and all(c in "0123456789abcdef-" for c in head[0]):
                start, end = (int(x, 16) for x in head[0].split("-"))
                overlap = start < hi and end > lo
            elif overlap and head[0] == "AnonHugePages:":
                huge += int(head[1]) * 1024
            elif overlap and head[0] == "Rss:":
                size += int(head[1]) * 1024
    return round(huge / size, 3) if size else 0.0


def refault_huge_pages(view: np.ndarray) -> bool:
    """Back the whole 2 MiB pages inside ``view`` with huge pages on kernels without ``MADV_COLLAPSE``: advise
    ``MADV_HUGEPAGE``, save the contents, drop the pages (``MADV_DONTNEED``: they read as zeros and fault in again,
    now as huge pages), write the contents back. Only safe while nothing else touches that memory."""
    start = _address(view)
    lo = -(-start // runs._HUGE_PAGE) * runs._HUGE_PAGE
    hi = (start + view.nbytes) // runs._HUGE_PAGE * runs._HUGE_PAGE
    if hi <= lo:
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    inner = view[(lo - start) // 4 : (hi - start) // 4]
    saved = inner.copy()
    if libc.madvise(ctypes.c_void_p(lo), hi - lo, _MADV_HUGEPAGE) != 0:
        return False
    if libc.madvise(ctypes.c_void_p(lo), hi - lo, _MADV_DONTNEED) != 0:
        return False
    inner[...] = saved
    return True


def _read(path: str) -> str:
    try:
        return Path(path).read_text().strip()
    except OSError as err:
        return f"({err})"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.exchange_memory")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--label", default="")
    args = parser.parse_args(argv)
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    with tempfile.TemporaryDirectory() as tmp:
        keep, grads = engine_gradients(world, None, Path(tmp), "trainer")
        sizes = [g.size for g in grads]
        found = runs.local_runs([_address(g) for g in grads], sizes)
        first = min(found, key=lambda r: _address(grads[r[0]]))
        big = max(found, key=lambda r: sum(sizes[i] for i in r))
        values = sum(sizes[i] for i in big)
        source = np.random.default_rng(rank).standard_normal(values).astype(np.float32)
        buffers = {"numpy": np.empty(values, np.float32)}
        core = getattr(np, "_core", None) or np.core
        setter = getattr(core.multiarray, "_set_madvise_hugepage", None)
        if setter is not None:
            before = setter(False)
            buffers["numpy-4k"] = np.empty(values, np.float32)
            setter(before)
        engine_run = runs.run_view(grads[big[0]], values)
        # three engine-memory variants need three distinct runs: take the same run at three moments instead
        buffers["engine"] = engine_run
        for b in buffers.values():
            b[...] = source
        facts = {"runs": len(found), "run_values": values, "first_run": first == big}
        stages = [("engine", None), ("engine-advised", runs.advise_huge_pages),
                  ("engine-refault", refault_huge_pages)]  # fmt: skip
        table: dict[str, list[float]] = {}
        hp: dict[str, float] = {}

        def timed(buf: np.ndarray) -> float:
            calls = []
            for _ in range(args.calls + 1):
                np.copyto(buf, source)
                world.Barrier()
                t0 = time.perf_counter()
                world.Allreduce(MPI.IN_PLACE, buf, op=MPI.SUM)
                calls.append(time.perf_counter() - t0)
            return float(np.median(calls[1:])) * 1e3

        for stage, advise in stages:
            if advise is not None:
                facts[f"{stage}: advice taken"] = bool(advise(engine_run))
            buffers["engine"] = engine_run
            names = list(buffers)
            for b in names:
                hp[b if b != "engine" else stage] = huge_share(buffers[b])
            for r in range(args.rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    key = stage if name == "engine" else name
                    table.setdefault(key, []).append(timed(buffers[name]))
        del keep
    shares = world.gather(hp, root=0)
    if rank != 0:
        return
    base = table["numpy"]
    rows = {}
    for name, ms in table.items():
        # numpy was timed in every stage: compare each stage's rounds with numpy's rounds of the same stage
        ref = base[: len(ms)] if name in ("numpy", "numpy-4k") else None
        if ref is None:
            idx = [s for s, _ in stages].index(name)
            ref = base[idx * args.rounds : (idx + 1) * args.rounds]
        ratio = [m / b for m, b in zip(ms, ref, strict=False)]
        rows[name] = {"ms": [round(min(ms), 3), round(float(np.median(ms)), 3), round(max(ms), 3)],
                      "ratio": [round(min(ratio), 3), round(float(np.median(ratio)), 3), round(max(ratio), 3)]}
    result = {"label": args.label, "ranks": world.Get_size(), "bytes": 4 * values, "kernel": platform.release(),
              "thp_enabled": _read("/sys/kernel/mm/transparent_hugepage/enabled"),
              "thp_defrag": _read("/sys/kernel/mm/transparent_hugepage/defrag"),
              "mpi": MPI.Get_library_version().splitlines()[0].strip("\x00"), "facts": facts,
              "huge_share_rank0": shares[0], "huge_share_min": {k: min(s[k] for s in shares) for k in shares[0]},
              "rows": rows, "cpus": os.cpu_count()}  # fmt: skip
    print("EXCHANGE_MEMORY " + json.dumps(result), flush=True)
    for name, row in rows.items():
        print(f"  {name:16s} median call ms {row['ms']}  ratio to numpy {row['ratio']}  "
              f"huge pages (min over ranks) {result['huge_share_min'].get(name)}")  # fmt: skip
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / f"exchange-memory-{world.Get_size()}r{args.label}.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
