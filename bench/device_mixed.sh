#!/usr/bin/env bash
# Mixed precision on the lent GPU machines, after shared/gpu/unpack.sh has unpacked the carried environment to /tmp/g
# (docs/gpu.md). Run from a copy of the repository (ortflow/, tests/, bench/): `bash bench/device_mixed.sh STAGES`,
# STAGES a comma-separated list of: probe (which ops train in fp16/bf16), tests (tests/gpu/test_gpu_mixed_precision.py),
# bench1 (bench_mixed.py on 1 GPU), bench2 (the same on 2 GPUs; needs bench1's prepared runs in the same call),
# sums (tests/gpu/test_gpu_sums_allreduce.py: the MatMul rewrite of the leading-axis sums and the fp16/bf16
# all-reduce), profile (bench/profile_determinism.py on fp16-plainreduce vs fp16, CUDA_LAUNCH_BLOCKING=1; prepares
# the two runs unless bench1 did). PRECS names bench_mixed.py precisions with variant suffixes (-nondet,
# -plainreduce, -allreduce16, -allreducebf16); MODES the PyTorch contenders ("" for none).
# Logs, probe.json and mixed.{json,md} land in $OUT (default bench/results/mixed-logs).
set -u
STAGES=",${1:-probe,tests,bench1,bench2},"
OUT=${OUT:-bench/results/mixed-logs}; mkdir -p "$OUT"
source "$(dirname "$0")/device_env.sh"  # G, PY and the environment of the carried engine
nvidia-smi -L
W=/tmp/mp; L=$W/logs; mkdir -p $L
t() { local name=$1; shift; echo "== $name $(date +%T)" | tee -a "$OUT/all.log"; timeout "$@" 2>&1 | tee "$L/$name.log" >> "$OUT/all.log"; tail -6 "$L/$name.log"; }
has() { [[ $STAGES == *",$1,"* ]]; }
if has probe; then
  t probe 240 $PY bench/probe_precision.py $W/probe; cp $W/probe/probe.json "$OUT/" 2>/dev/null
  tar -czf "$OUT/probe-placements.tgz" -C $W/probe $(cd $W/probe && ls placements-*.txt) 2>/dev/null
fi
if has tests; then
  t pytest-mixed 420 env PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 $PY -m pytest -q -s -p no:cacheprovider -rs \
    tests/gpu/test_gpu_mixed_precision.py
fi
if has sums; then
  t pytest-sums 420 env PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 $PY -m pytest -q -s -p no:cacheprovider -rs \
    tests/gpu/test_gpu_sums_allreduce.py
fi
TORCH="env -u PYTHONPATH -u LD_LIBRARY_PATH python3 -m torch.distributed.run --standalone"
PRECS=${PRECS:-fp32 fp16 fp16-softmax16 bf16}; MODES=${MODES-tf32 bf16 compile}  # which contenders (env overrides)
if has bench1; then
  t prepare 300 $PY bench/bench_mixed.py prepare $W/b --precisions "${PRECS// /,}"
  for p in $PRECS; do t ortflow-$p-1 120 mpiexec -n 1 $PY bench/bench_mixed.py steps $W/b/$p; done
  for m in $MODES; do t torch-$m-1 240 $TORCH --nproc_per_node=1 bench/bench_mixed.py torch $m; done
fi
if has bench2; then
  for p in $PRECS; do t ortflow-$p-2 120 mpiexec -n 2 $PY bench/bench_mixed.py steps $W/b/$p; done
  for m in $MODES; do t torch-$m-2 240 $TORCH --nproc_per_node=2 bench/bench_mixed.py torch $m; done
fi
if has profile; then
  for p in fp16-plainreduce fp16; do
    [ -d $W/b/$p/artifacts ] || t prepare-$p 120 $PY bench/bench_mixed.py prepare $W/b --precisions $p
  done
  t profile 180 env CUDA_LAUNCH_BLOCKING=1 $PY bench/profile_determinism.py $W/b/fp16-plainreduce $W/b/fp16
fi
if has bench1 || has bench2; then $PY bench/bench_mixed.py report "$L" "$OUT"; fi
