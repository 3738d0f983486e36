#!/usr/bin/env bash
# bench/exchange_memory.py on the 32-CPU device machine's Open MPI (issue 20): a bare all-reduce on numpy memory vs
# the engine's gradient run, as allocated / advised / refaulted onto huge pages, at 2 and 16 ranks, with the
# launcher's binding as the layout bench uses it (none) and bound to cores. Same wheels as bench/device_cpu_layout.sh:
#   run(kind="nvidia-h200-x2", command="OUT=\$OUT bash bench/device_exchange_memory.sh", carry=[".whl"])
# Knobs: RANKS (2,16), BINDS (none,core), ROUNDS (10).
set -uo pipefail
source "$(dirname "$0")/device_cpu_env.sh"  # OUT, PYTHON, PYTHONPATH, CPU-only environment
{ uname -a; lscpu | grep -E "^(Model name|Socket|Core|Thread|CPU\(s\)|NUMA)"; ompi_info --param btl vader -l 9 2>/dev/null \
  | grep -E "single_copy|eager_limit" | head -4; } | tee "$OUT/exchange-memory-host.txt"
IFS=, read -r -a ranks <<< "${RANKS:-2,16}"; IFS=, read -r -a binds <<< "${BINDS:-none,core}"
for b in "${binds[@]}"; do for n in "${ranks[@]}"; do
  echo "== $n ranks, --bind-to $b"
  timeout 120 mpirun --allow-run-as-root --oversubscribe --bind-to "$b" -n "$n" "$PYTHON" -m bench.exchange_memory \
    --rounds "${ROUNDS:-10}" --out "$OUT" --label="-bind-$b" 2>&1 | grep -v "^EXCHANGE_MEMORY" | tail -6
done; done
