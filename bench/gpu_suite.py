"""The GPU suite: ortflow against PyTorch at its best on 1, 2 and 4 GPUs, ZeRO-1, and the real exports in fp16/bf16.

Run by ``bench/gpu_suite.sh`` (docs/design.md). Only the standard library is imported here: the rows run in
subprocesses with the Python of ortflow (``--ortflow-py``, with the GPU engine) and the Python of PyTorch
(``--torch-py``), so a broken environment fails its rows, not the suite.

Phases, in priority order, each row skipped once the time budget (``--budget-s``) cannot hold it:

1. setup: the machine (``nvidia-smi``), versions, the kernel-table and Adasum tests (tests/gpu/test_gpu_cuda_kernels.py,
   test_gpu_adasum.py: 2 and 4 GPUs) while the bench GPT's runs (``bench/bench_mixed.py prepare``) and the fixture
   runs are configured, in parallel (CPU);
2. round 1: at each GPU count (1, 2, 4) the ortflow rows (fp32, fp16, bf16 defaults; fp16 with ZeRO-1 at the largest
   count) and one PyTorch process (``bench/torch_contender.py``: eager and compile, DDP beyond one GPU with the tuned
   bucket size, FSDP2 beyond one GPU (per-block compile with DDP on request), strict fp32 at one GPU) that compiles
   each mode once and then times every round's window, the modes interleaved (a compile costs about half a minute per
   mode);
3. the committed GPT-2 and BERT exports trained 60 updates through the CLI in fp32, fp16 and bf16, one GPU each
   (several at once, one per GPU: these give final losses, not times);
4. rounds 2 and 3: ortflow's rows again, in the same order (new processes each round).

Every row's output goes to ``logs/<row>.log`` (tarred into ``logs.tgz``); a row that fails is reported with its
error tail and the rest continue. ``gpu-suite.json`` and ``gpu-suite.md`` hold the command, commit, GPU model,
versions, the per-round times, medians with their spread, weak scaling, the ZeRO figures and the fixture losses.
``--dry-run`` prints the plan (every command) and writes the report without running anything.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FIXTURES = ("gpt2", "bert")
FIXTURE_STEPS = 60


@dataclass
class Row:
    """One command of the suite and what came of it."""

    name: str
    phase: str
    cmd: list[str]
    timeout_s: float
    estimate_s: float
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    world: int = 1
    round: int = 0
    status: str = "planned"
    seconds: float = 0.0
    results: list[dict] = field(default_factory=list)
    error_tail: str = ""

    def as_dict(self) -> dict:
        return {"name": self.name, "phase": self.phase, "world": self.world, "round": self.round,
                "status": self.status, "seconds": round(self.seconds, 1), "command": shlex.join(self.cmd),
                "results": self.results, "error_tail": self.error_tail}  # fmt: skip


def world_mismatch(row: Row, mpiexec: str) -> str | None:
    """Why a row's results are not a ``row.world``-GPU measurement: its ranks report another world size (a launcher
    whose MPI is not mpi4py's starts N singletons of world 1), or a multi-rank row reports none; None when they match.
    """
    worlds = [r["world"] for r in row.results if "world" in r]
    if row.world > 1 and row.results and not worlds:
        return f"the ranks report no world size; asked for {row.world}"
    wrong = sorted({w for w in worlds if w != row.world})
    if not wrong:
        return None
    return (f"the ranks report world size {', '.join(map(str, wrong))}, asked for {row.world}: {mpiexec} started "
            f"singletons (mpi4py is built against another MPI; `ortflow doctor --mpiexec {mpiexec}` names the fix)")


class Suite:
    """The plan's commands and their execution under one time budget."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.work = Path(args.work)
        self.logs = self.work / "logs"
        self.started = time.monotonic()
        self.rows: list[Row] = []
        self.port = 29511
        cpu = args.device == "cpu"
        self.precisions = args.precisions.split(",")
        self.ortflow_env = {"PYTHONPATH": os.pathsep.join(p for p in [args.ortflow_pythonpath, str(REPO)] if p),
                            "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # fmt: skip
        self.torch_env = {"PYTHONUNBUFFERED": "1", "TORCHINDUCTOR_CACHE_DIR": str(self.work / "inductor-cache"),
                          "OMP_NUM_THREADS": "1" if cpu else os.environ.get("OMP_NUM_THREADS", "4")}  # fmt: skip

    # -- running ---------------------------------------------------------------------------------------------------
    def left(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.started)

    def execute(self, row: Row) -> Row:
        """Run one row (or say why not); parse its RESULT lines."""
        self.rows.append(row)
        if self.args.dry_run:
            print(f"[plan] {row.name}: {shlex.join(row.cmd)}", flush=True)
            return row
        if self.left() < row.estimate_s:
            row.status = "skipped"
            row.error_tail = f"time budget: {self.left():.0f} s left, row needs ~{row.estimate_s:.0f} s"
            print(f"[skip] {row.name}: {row.error_tail}", flush=True)
            return row
        timeout = max(5.0, min(row.timeout_s, self.left()))
        log = self.logs / f"{row.name}.log"
        start = time.monotonic()
        print(f"[run ] {row.name} (timeout {timeout:.0f} s, {self.left():.0f} s left)", flush=True)
        env = {k: v for k, v in os.environ.items() if k not in row.env.get("_unset", "").split(",")}
        env.update({k: v for k, v in row.env.items() if not k.startswith("_")})
        with log.open("w") as out:
            out.write(f"$ {shlex.join(row.cmd)}\n")
            out.flush()
            try:
                proc = subprocess.Popen(row.cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=row.cwd,
                                        start_new_session=True)  # fmt: skip
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)  # the launcher and every rank it started
                proc.wait()
                code = "timeout"
            except OSError as err:
                code = f"could not start: {err}"
        row.seconds = time.monotonic() - start
        text = log.read_text(errors="replace")
        row.results = [json.loads(line[line.index("{") :]) for line in text.splitlines()
                       if line.lstrip().startswith("RESULT {") or " RESULT {" in line]  # fmt: skip
        failed = [r for r in row.results if r.get("status") == "failed"]
        wrong_world = world_mismatch(row, self.args.mpiexec)
        if code == 0 and not failed and not wrong_world:
            row.status = "ok"
        elif wrong_world:  # never an N-GPU row made of singletons
            row.status, row.results = "failed", []
            row.error_tail = f"{wrong_world}\nexit {code}\n" + text[-2000:]
        else:
            row.status = "failed" if code != "timeout" else "timeout"
            row.error_tail = f"exit {code}\n" + text[-2500:]
        print(f"[{row.status}] {row.name} in {row.seconds:.0f} s", flush=True)
        return row

    def execute_parallel(self, rows: list[Row]) -> None:
        """Rows that do not compete for a GPU (or each use their own), side by side; each still gets its log."""
        if self.args.dry_run or len(rows) < 2:
            for row in rows:
                self.execute(row)
            return
        import concurrent.futures

        with concurrent.futures.ThreadPoolExecutor(len(rows)) as pool:
            list(pool.map(self.execute, rows))

    # -- the rows --------------------------------------------------------------------------------------------------
    def mpiexec(self, ranks: int) -> list[str]:
        return [self.args.mpiexec, "-n", str(ranks)]

    def torchrun(self, ranks: int) -> list[str]:
        self.port += 1
        return [self.args.torch_py, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc_per_node={ranks}",
                "--master_addr=127.0.0.1", f"--master_port={self.port}"]  # fmt: skip

    def setup_rows(self) -> tuple[list[Row], list[Row]]:
        """(rows on the CPU: the configures; rows on GPU 0: the kernel test)."""
        a, py = self.args, self.args.ortflow_py
        root = str(self.work / "b")
        cpu_rows = [Row("prepare-model", "setup", [py, "bench/bench_mixed.py", "prepare", root, "--precisions", "",
                        "--shape", a.shape, "--device", a.device], 300, 20, self.ortflow_env, str(REPO))]
        configure = [Row(f"prepare-{p}", "setup", [py, "bench/bench_mixed.py", "prepare", root, "--precisions", p,
                         "--shape", a.shape, "--device", a.device, "--reuse-model"], 300, 30, self.ortflow_env,
                         str(REPO))
                 for p in self.precisions + ([f"{a.zero_precision}-zero1"] if a.zero else [])]
        fixtures = [Row(f"fixture-config-{m}-{p}", "setup", [py, "bench/gpu_suite_fixtures.py", "configure",
                        str(self.work / "fx"), m, p, "--device", a.device, "--steps", str(FIXTURE_STEPS)], 300, 30,
                        self.ortflow_env, str(REPO))
                    for m in FIXTURES for p in a.fixture_precisions.split(",") if p]
        gpu_rows = []
        pytest = [py, "-m", "pytest", "-q", "-s", "-rs", "-p", "no:cacheprovider"]
        test_env = {**self.ortflow_env, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
        if a.device == "cuda" and a.gpu_tests:
            gpu_rows.append(Row("kernel-table-test", "setup", [*pytest, "tests/gpu/test_gpu_cuda_kernels.py"], 240, 60,
                                test_env, str(REPO)))  # fmt: skip
            gpu_rows.append(Row("adasum-test", "setup", [*pytest, "tests/gpu/test_gpu_adasum.py"], 300, 60,
                                test_env, str(REPO)))  # fmt: skip
        return [*cpu_rows, *configure, *fixtures], gpu_rows

    def ortflow_row(self, precision: str, world: int, rnd: int) -> Row:
        a = self.args
        cmd = [*self.mpiexec(world), a.ortflow_py, "bench/bench_mixed.py", "steps", str(self.work / "b" / precision),
               "--steps", str(a.steps), "--warmup", str(a.warmup)]  # fmt: skip
        return Row(f"r{rnd}-ortflow-{precision}-x{world}", f"round {rnd}", cmd, 240, 8 + 2 * world, self.ortflow_env,
                   str(REPO), world, rnd)  # fmt: skip

    def torch_row(self, world: int, rnds: int) -> Row:
        """All of PyTorch's rounds at one GPU count in one process: each mode compiled once, windows interleaved."""
        a = self.args
        one = ["eager", "compile", "cudagraphs", "fp32"]  # CUDA graphs on one GPU only (no NCCL inside a capture)
        modes = one if world == 1 else ["eager", "compile", "blockcompile", "fsdp2"]
        modes = [m for m in modes if m in a.torch_modes.split(",")]
        cmd = [*self.torchrun(world), "bench/torch_contender.py", "--modes", ",".join(modes), "--device", a.device,
               "--shape", a.shape, "--steps", str(a.steps), "--warmup", str(a.warmup), "--rounds", str(rnds),
               "--compile-backend", a.compile_backend]  # fmt: skip
        if world > 1:
            cmd += ["--tune-buckets"]
        compiles = sum(m not in ("eager", "fp32") for m in modes)
        estimate = 20 + 40 * compiles + 3 * rnds * len(modes)
        rnd = 1
        env = {**self.torch_env, "_unset": "PYTHONPATH,LD_LIBRARY_PATH"}  # the machine's own PyTorch and its libs
        return Row(f"r{rnd}-torch-x{world}", f"round {rnd}", cmd, 420, estimate, env, str(REPO), world, rnd)

    def fixture_rows(self) -> list[list[Row]]:
        """Training runs in batches of one per GPU."""
        a, gpus = self.args, max(1, self.args.gpus)
        rows = []
        for m in FIXTURES:
            for p in [p for p in a.fixture_precisions.split(",") if p]:
                cmd = [a.ortflow_py, "bench/gpu_suite_fixtures.py", "train", str(self.work / "fx"), m, p,
                       "--ortflow-py", a.ortflow_py, "--mpiexec", a.mpiexec]  # fmt: skip
                rows.append(Row(f"fixture-{m}-{p}", "fixtures", cmd, 300, 45, dict(self.ortflow_env), str(REPO)))
        if a.device == "cuda":
            for i, row in enumerate(rows):
                row.env["CUDA_VISIBLE_DEVICES"] = str(i % gpus)
        return [rows[i : i + gpus] for i in range(0, len(rows), gpus)]

    def run(self) -> None:
        a = self.args
        self.logs.mkdir(parents=True, exist_ok=True)
        worlds = [w for w in (1, 2, 4) if w <= max(a.gpus, 1) and str(w) in a.worlds.split(",")]
        cpu_rows, gpu_rows = self.setup_rows()
        self.execute(cpu_rows[0])  # the ONNX GPT once, then every configure in parallel beside the kernel test
        self.execute_parallel(cpu_rows[1:] + gpu_rows)
        for rnd in range(1, a.rounds + 1):
            for world in worlds:
                for precision in self.precisions:
                    self.execute(self.ortflow_row(precision, world, rnd))
                if a.zero and world == worlds[-1] and world > 1:
                    self.execute(self.ortflow_row(f"{a.zero_precision}-zero1", world, rnd))
                if a.torch_modes and rnd == 1:
                    self.execute(self.torch_row(world, a.rounds))
            if rnd == 1:
                for batch in self.fixture_rows():
                    self.execute_parallel(batch)


def machine_info(args: argparse.Namespace) -> dict:
    """GPU model, driver, commit and versions (each probe may fail: its error is recorded instead)."""

    def probe(cmd: list[str], env: dict | None = None) -> str:
        try:
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env, cwd=REPO)
            return (out.stdout.strip() or out.stderr.strip()[-500:]) if out.returncode == 0 else \
                f"failed ({out.returncode}): {out.stderr.strip()[-500:]}"
        except (OSError, subprocess.TimeoutExpired) as err:
            return f"failed: {err}"

    ortflow_env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [args.ortflow_pythonpath, str(REPO)] if p)}
    torch_env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_LIBRARY_PATH")}
    versions = ("import importlib.metadata as m, platform, json; d = {'python': platform.python_version()}\n"
                "for p in {names}:\n"
                "    try: d[p] = m.version(p)\n"
                "    except Exception: pass\n"
                "print(json.dumps(d))")  # fmt: skip
    ortflow_pkgs = ["onnxruntime-training", "onnxruntime", "onnx", "numpy", "cupy-cuda12x", "cupy-cuda11x", "mpi4py",
                    "mpich", "ortflow"]  # fmt: skip
    return {
        "gpus": probe(["nvidia-smi", "--query-gpu=index,name,memory.total,driver_version", "--format=csv,noheader"]),
        "topology": probe(["nvidia-smi", "topo", "-m"]),
        "commit": os.environ.get("ORTFLOW_COMMIT") or probe(["git", "rev-parse", "HEAD"]),
        "ortflow_python": probe([args.ortflow_py, "-c", versions.replace("{names}", repr(ortflow_pkgs))], ortflow_env),
        "torch_python": probe([args.torch_py, "-c", "import torch, json, platform; print(json.dumps({'python': "
                               "platform.python_version(), 'torch': torch.__version__, 'cuda': torch.version.cuda}))"],
                              torch_env),  # fmt: skip
        "mpiexec": " ".join(probe([args.mpiexec, "--version"]).split()[:8]) if shutil.which(args.mpiexec) else
        f"{args.mpiexec} not found",
        "cpus": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    from bench.report import write_gpu_suite_report as write_report

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="folder for gpu-suite.json, gpu-suite.md and logs.tgz")
    parser.add_argument("--work", default="/tmp/gpu-suite", help="scratch folder (run folders, logs)")
    parser.add_argument("--ortflow-py", default=sys.executable, help="Python with ortflow's GPU environment")
    parser.add_argument("--ortflow-pythonpath", default="", help="prepended to the repository on PYTHONPATH")
    parser.add_argument("--torch-py", default="python3", help="Python with PyTorch (CUDA)")
    parser.add_argument("--mpiexec", default="mpiexec")
    parser.add_argument("--budget-s", type=float, default=540.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gpus", type=int, default=-1, help="default: what nvidia-smi lists")
    parser.add_argument("--worlds", default="1,2,4")
    parser.add_argument("--precisions", default="fp32,fp16,bf16")
    parser.add_argument("--fixture-precisions", default="fp32,fp16,bf16")
    parser.add_argument("--no-zero", dest="zero", action="store_false", help="skip the ZeRO-1 row")
    parser.add_argument("--zero-precision", default="fp16", help="the precision measured with and without ZeRO-1")
    parser.add_argument("--torch-modes", default="eager,compile,cudagraphs,fsdp2,fp32",
                        help="of eager, compile, cudagraphs (one GPU: torch.compile with CUDA graphs), blockcompile "
                        "(DDP over blocks compiled one by one), fsdp2, fp32; '' for none")  # fmt: skip
    parser.add_argument("--no-gpu-tests", dest="gpu_tests", action="store_false",
                        help="skip tests/gpu/test_gpu_cuda_kernels.py and test_gpu_adasum.py in the setup")
    parser.add_argument("--compile-backend", default="inductor")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="cpu: test the suite itself")
    parser.add_argument("--shape", choices=["bench", "tiny"], default="bench")
    parser.add_argument("--dry-run", action="store_true", help="print the plan and write it as the report")
    args = parser.parse_args(argv)
    if args.gpus < 0:
        found = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True) if shutil.which("nvidia-smi") \
            else None
        args.gpus = len([ln for ln in found.stdout.splitlines() if ln.startswith("GPU ")]) if found else 0
    if args.device == "cuda" and args.gpus == 0 and not args.dry_run:
        parser.error("no GPU found (nvidia-smi -L): pass --gpus N, or --device cpu to test the suite")
    suite = Suite(args)
    info = {} if args.dry_run else machine_info(args)
    try:
        suite.run()
    finally:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        write_report(out, suite.rows, info, args, time.monotonic() - suite.started)
        if suite.logs.exists():
            with tarfile.open(out / "logs.tgz", "w:gz") as tar:
                tar.add(suite.logs, arcname="logs")
    failed = [r.name for r in suite.rows if r.status in ("failed", "timeout")]
    print(f"suite: {len(suite.rows)} rows, {len(failed)} failed: {failed}" if failed else
          f"suite: {len(suite.rows)} rows, none failed", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())
