#!/usr/bin/env bash
# ortflow `--np auto` against PyTorch at its best layout and mode on one many-core CPU host, in one command.
#
#   bash bench/many_core.sh                       # every core of this host; report in bench/results/
#   CORES=64 OUT=/tmp/out bash bench/many_core.sh # parameterised by core count and output folder
#
# Needs only what the pinned set installs (ortflow's dependencies, the bench extra's torch, mpi4py with an mpiexec
# beside the Python, a system mpirun, or $BENCH_MPIEXEC) and, for torch.compile, a C++ compiler; no network. Where the
# Python has torch but lacks ortflow's pinned pieces, the cp312 wheels in .whl/ (docs/benchmarks.md) are installed
# into /tmp/site first. Three phases, each
# a `python -m bench.bench_layout` run on the bench GPT (bench/torch_gpt.py, d 256, 4 layers, seq 128) at one global
# batch (GLOBAL_BATCH, default 4 x CORES samples per weight update, for every contender):
#
#   1. layouts: PyTorch DDP eager at LAYOUTS (default CORES/2 x 2, CORES x 1, CORES/4 x 4), one short round;
#   2. modes: at the fastest of those, torch.compile, bf16 autocast and both (bf16 only where the CPU has bf16
#      instructions), one short round; PyTorch's fastest row of phases 1-2 is "PyTorch at its best layout and mode";
#   3. final: ortflow auto against the TOP (2) fastest of those rows, ROUNDS (3) interleaved rounds, each ratio
#      paired within a round; the goal is judged against the fastest PyTorch row of each round.
#
# TORCH_BEST=RxT:MODE[,RxT:MODE] skips phases 1-2. Every phase rewrites its report after each contender, so a run cut short keeps
# what it measured. Expected wall time on 64 cores: about 7-8 minutes (phase 2's first torch.compile dominates; its
# inductor cache in /tmp makes phase 3's compile quick). Knobs: CORES, GLOBAL_BATCH, LAYOUTS, MODES, TOP, ROUNDS, STEPS,
# WARMUP, PYTHON, OUT, WORK; BENCH_MPIEXEC (default: the mpiexec beside PYTHON, else the system mpirun).
set -euo pipefail
SCRIPT=$(realpath "$0")
cd "$(dirname "$SCRIPT")/.."

CORES=${CORES:-$(nproc)}
GLOBAL_BATCH=${GLOBAL_BATCH:-$((4 * CORES))}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-6}
WARMUP=${WARMUP:-4}
TOP=${TOP:-2}
OUT=${OUT:-bench/results}
WORK=${WORK:-/tmp/ortflow-many-core}
STAMP=$(date -u +%Y%m%d-%H%M)
NAME=${NAME:-many-core-${CORES}c-$STAMP}
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# A host whose Python has torch but not ortflow's pinned pieces (a device machine): the cp312 wheels carried in .whl/
# (docs/benchmarks.md) go into /tmp/site, nothing is downloaded.
if ! "$PYTHON" -c "import importlib.util as u, sys; sys.exit(u.find_spec('onnxruntime.training') is None)" 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:/tmp/site-jit:$PYTHONPATH"
fi
# CPU only: PyTorch stays off any GPU, and NVLink multicast stays off in every child; Open MPI may run as root.
export CUDA_VISIBLE_DEVICES="" NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$WORK/inductor-cache}
# Each DDP rank compiles its own graph: one compile process per rank, not a pool of CORES workers per rank.
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}
if [ "$CORES" -lt "$(nproc)" ] && [ -z "${MANY_CORE_PINNED:-}" ]; then  # the first CORES cores only, for everybody
  MANY_CORE_PINNED=1 exec taskset -c "0-$((CORES - 1))" bash "$SCRIPT" "$@"
fi
if [ -z "${BENCH_MPIEXEC:-}" ]; then  # the mpiexec beside PYTHON (the PyPI mpich wheel), else the system's
  LAUNCHER="$(dirname "$(command -v "$PYTHON")")/mpiexec"
  [ -x "$LAUNCHER" ] || LAUNCHER=$(command -v mpirun || command -v mpiexec || echo mpiexec)
  if "$LAUNCHER" --version 2>&1 | grep -qiE "open mpi|open-rte|openrte"; then
    # Open MPI binds ranks to cores or sockets by default: a rank's threads need the cores of its share.
    LAUNCHER="$LAUNCHER --bind-to none --oversubscribe$([ "$(id -u)" = 0 ] && echo " --allow-run-as-root")"
  fi
  export BENCH_MPIEXEC=$LAUNCHER
fi
mkdir -p "$OUT" "$WORK"
LOG="$OUT/$NAME.log"
say() { echo "[$(date -u +%H:%M:%S)] $*" | tee -a "$LOG"; }

# Check the environment first: a missing piece is named here, not 5 minutes in.
"$PYTHON" - <<'EOF' 2>&1 | tee -a "$LOG"
import importlib, shutil, sys
missing = [m for m in ("ortflow", "onnxruntime", "onnx", "torch", "mpi4py") if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"many_core.sh: {sys.executable} lacks {missing}: install the pinned set with the bench extra")
import onnxruntime, torch
print(f"python {sys.version.split()[0]}, torch {torch.__version__}, onnxruntime {onnxruntime.__version__}, "
      f"g++ {'found' if shutil.which('g++') else 'MISSING: torch.compile modes are skipped'}")
EOF
BF16=$(grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo && echo 1 || echo 0)
HAVE_CXX=$(command -v g++ >/dev/null && echo 1 || echo 0)
if [ -z "${MODES:-}" ]; then
  MODES=""
  [ "$HAVE_CXX" = 1 ] && MODES="compile"
  [ "$BF16" = 1 ] && MODES="$MODES bf16" && [ "$HAVE_CXX" = 1 ] && MODES="$MODES compile-bf16"
fi
if [ -z "${LAYOUTS:-}" ]; then
  LAYOUTS="$((CORES / 2))x2,${CORES}x1"
  [ "$CORES" -ge 8 ] && LAYOUTS="$LAYOUTS,$((CORES / 4))x4"
fi
say "host $(hostname), $CORES cores ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)), bf16=$BF16," \
    "global batch $GLOBAL_BATCH, commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown), load $(cut -d' ' -f1-3 /proc/loadavg)"

layout_bench() {  # name, then bench_layout arguments
  local name=$1; shift
  "$PYTHON" -m bench.bench_layout --global-batch "$GLOBAL_BATCH" --work "$WORK" --out "$OUT" --name "$name" "$@" \
    2>&1 | tee -a "$LOG" | grep -E '^round|FAILED' || true
}
best_of() {  # the N fastest PyTorch rows (median samples/s) of bench_layout reports, comma-joined, "torch " dropped
  local n=$1; shift
  "$PYTHON" - "$n" "$@" <<'EOF'
import json, os, sys
rows = {}
for path in sys.argv[2:]:
    if os.path.exists(path):
        rows.update({k: v["samples_per_s"][1] for k, v in json.load(open(path))["rows"].items()
                     if k.startswith("torch ") and v["samples_per_s"]})
print(",".join(k.split(" ", 1)[1] for k in sorted(rows, key=rows.get, reverse=True)[: int(sys.argv[1])]))
EOF
}

if [ -z "${TORCH_BEST:-}" ]; then
  say "phase 1: PyTorch eager layouts $LAYOUTS"
  layout_bench "$NAME-layouts" --ortflow "" --torch "$LAYOUTS" --rounds 1 --warmup 2 --steps 4 --display 2
  BEST_LAYOUT=$(best_of 1 "$OUT/$NAME-layouts.json")
  [ -n "$BEST_LAYOUT" ] || { say "every PyTorch layout failed: see $OUT/$NAME-layouts-logs"; exit 1; }
  CANDIDATES=""
  for mode in $MODES; do CANDIDATES="$CANDIDATES${CANDIDATES:+,}$BEST_LAYOUT:$mode"; done
  if [ -n "$CANDIDATES" ]; then
    say "phase 2: modes at $BEST_LAYOUT: $CANDIDATES"
    # The first steps of torch.compile compile; they are warm-up, never timed.
    layout_bench "$NAME-modes" --ortflow "" --torch "$CANDIDATES" --rounds 1 --warmup 2 --steps 4 --display 2
  fi
  # The screening rounds are short: the final phase takes the TOP fastest rows, so a noisy pick cannot flatter ortflow.
  TORCH_BEST=$(best_of "$TOP" "$OUT/$NAME-layouts.json" "$OUT/$NAME-modes.json")
fi
say "phase 3: ortflow auto vs PyTorch $TORCH_BEST, $ROUNDS interleaved rounds"
layout_bench "$NAME" --ortflow auto --torch "$TORCH_BEST" --rounds "$ROUNDS" --warmup "$WARMUP" --steps "$STEPS" \
  --display 2
"$PYTHON" - "$OUT/$NAME.json" <<'EOF' | tee -a "$LOG"
import json, statistics, sys
r = json.load(open(sys.argv[1]))
for label, v in r["ratios"].items():
    if v:
        print(f"{label}: min {v[0]:.3f} / median {v[1]:.3f} / max {v[2]:.3f}")
auto = {x["round"]: x["samples_per_s"] for x in r["runs"].get("ortflow auto", []) if x["samples_per_s"]}
best = {}
for label, runs in r["runs"].items():
    for x in runs if label.startswith("torch ") else []:
        if x["samples_per_s"]:
            best[x["round"]] = max(best.get(x["round"], 0.0), x["samples_per_s"])
ratios = [auto[k] / best[k] for k in sorted(auto) if k in best]
if ratios:
    met = statistics.median(ratios) >= 1.1 and min(ratios) >= 1.0
    print(f"ortflow auto / PyTorch's fastest row in each round: {' '.join(f'{x:.3f}' for x in ratios)}; median "
          f"{statistics.median(ratios):.3f} (goal: median >= 1.1 and every round >= 1.0: {'met' if met else 'NOT met'})")
EOF
say "done: $OUT/$NAME.md (phases 1-2: $NAME-layouts.md, $NAME-modes.md; log $LOG)"
