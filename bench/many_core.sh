#!/usr/bin/env bash
# ortflow `--np auto` against PyTorch at its best layout and mode on one many-core CPU host, in one command.
#
#   bash bench/many_core.sh                       # every core of this host; report in bench/results/
#   CORES=64 OUT=/tmp/out bash bench/many_core.sh # parameterised by core count and output folder
#
# Needs only what the pinned set installs (ortflow's dependencies, the bench extra's torch, mpi4py with an mpiexec
# beside the Python or in $BENCH_MPIEXEC) and, for torch.compile, a C++ compiler; no network. Three phases, each
# a `python -m bench.bench_layout` run on the bench GPT (bench/torch_gpt.py, d 256, 4 layers, seq 128) at one global
# batch (GLOBAL_BATCH, default 4 x CORES samples per weight update, for every contender):
#
#   1. layouts: PyTorch DDP eager at LAYOUTS (default CORES/2 x 2, CORES x 1, CORES/4 x 4), one short round;
#   2. modes: at the fastest of those, torch.compile, bf16 autocast and both (bf16 only where the CPU has bf16
#      instructions), one short round; PyTorch's fastest row of phases 1-2 is "PyTorch at its best layout and mode";
#   3. final: ortflow auto against that row, ROUNDS (3) interleaved rounds, the ratio paired within each round.
#
# TORCH_BEST=RxT:MODE skips phases 1-2. Every phase rewrites its report after each contender, so a run cut short keeps
# what it measured. Expected wall time on 64 cores: about 7-8 minutes (phase 2's first torch.compile dominates; its
# inductor cache in /tmp makes phase 3's compile quick). Knobs: CORES, GLOBAL_BATCH, LAYOUTS, MODES, ROUNDS, STEPS,
# WARMUP, PYTHON, OUT, WORK; BENCH_MPIEXEC (default: the mpiexec beside PYTHON, else the system mpirun).
set -euo pipefail
SCRIPT=$(realpath "$0")
cd "$(dirname "$SCRIPT")/.."

CORES=${CORES:-$(nproc)}
GLOBAL_BATCH=${GLOBAL_BATCH:-$((4 * CORES))}
ROUNDS=${ROUNDS:-3}
STEPS=${STEPS:-6}
WARMUP=${WARMUP:-4}
OUT=${OUT:-bench/results}
WORK=${WORK:-/tmp/ortflow-many-core}
STAMP=$(date -u +%Y%m%d-%H%M)
NAME=${NAME:-many-core-${CORES}c-$STAMP}
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$WORK/inductor-cache}
# Each DDP rank compiles its own graph: one compile process per rank, not a pool of CORES workers per rank.
export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}
if [ "$CORES" -lt "$(nproc)" ] && [ -z "${MANY_CORE_PINNED:-}" ]; then  # the first CORES cores only, for everybody
  MANY_CORE_PINNED=1 exec taskset -c "0-$((CORES - 1))" bash "$SCRIPT" "$@"
fi
if [ -z "${BENCH_MPIEXEC:-}" ] && [ ! -x "$(dirname "$(command -v "$PYTHON")")/mpiexec" ]; then
  if command -v mpirun >/dev/null; then  # a system Open MPI (as root it must be told that is fine)
    export BENCH_MPIEXEC="mpirun --bind-to none$([ "$(id -u)" = 0 ] && echo ' --allow-run-as-root')"
  fi
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
best_of() {  # the best_torch label of a bench_layout report, without its "torch " prefix
  "$PYTHON" -c "import json,sys; b=json.load(open(sys.argv[1])).get('best_torch'); print(b.split(' ',1)[1] if b else '')" "$1"
}

if [ -z "${TORCH_BEST:-}" ]; then
  say "phase 1: PyTorch eager layouts $LAYOUTS"
  layout_bench "$NAME-layouts" --ortflow "" --torch "$LAYOUTS" --rounds 1 --warmup 2 --steps 4 --display 2
  BEST_LAYOUT=$(best_of "$OUT/$NAME-layouts.json")
  [ -n "$BEST_LAYOUT" ] || { say "every PyTorch layout failed: see $OUT/$NAME-layouts-logs"; exit 1; }
  CANDIDATES="$BEST_LAYOUT"
  for mode in $MODES; do CANDIDATES="$CANDIDATES,$BEST_LAYOUT:$mode"; done
  say "phase 2: modes at $BEST_LAYOUT: $CANDIDATES"
  # Warm-up long enough for torch.compile's first compile, which the timed steps must not include.
  layout_bench "$NAME-modes" --ortflow "" --torch "$CANDIDATES" --rounds 1 --warmup 4 --steps 4 --display 2
  TORCH_BEST=$(best_of "$OUT/$NAME-modes.json")
  [ -n "$TORCH_BEST" ] || TORCH_BEST=$BEST_LAYOUT
fi
say "phase 3: ortflow auto vs PyTorch $TORCH_BEST, $ROUNDS interleaved rounds"
layout_bench "$NAME" --ortflow auto --torch "$TORCH_BEST" --rounds "$ROUNDS" --warmup "$WARMUP" --steps "$STEPS" \
  --display 2
"$PYTHON" - "$OUT/$NAME.json" <<'EOF' | tee -a "$LOG"
import json, sys
r = json.load(open(sys.argv[1]))
for label, v in r["ratios"].items():
    if v:
        print(f"{label}: min {v[0]:.3f} / median {v[1]:.3f} / max {v[2]:.3f}"
              f" (goal: median >= 1.1, every round >= 1.0: {'met' if v[1] >= 1.1 and v[0] >= 1.0 else 'NOT met'})")
EOF
say "done: $OUT/$NAME.md (phases 1-2: $NAME-layouts.md, $NAME-modes.md; log $LOG)"
