#!/usr/bin/env bash
# The 1B Llama (tools/make_large_llama.py --size 1b, 1.12B parameters, 4.5 GB of fp32 weights in external data) on
# 2 GPUs: ortflow data-parallel with ZeRO-1 in fp16 and in bf16, then PyTorch FSDP2 + torch.compile (bf16) on the same
# shape, batch and data rule; tokens/s and model FLOPs utilisation in OUT/large-llama.md (bench/large_llama.py).
# LAYOUTS="dp pp tp" also trains the model in one pipeline stage per GPU and split by tensor parallelism (each layout
# in each of PRECISIONS, default "fp16 bf16"; stages and pieces keep their activations, recompute_forward: false);
# RECOMPUTE=1 adds to each pp and tp run a contender with
# distributed.recompute_forward: true, "... (recompute)", configured from the same artifacts (hard links) and trained
# right after it; TORCH=0 leaves PyTorch out.
# Run from the repository root on a host with the GPU engine installed:
#
#   ORTFLOW_PY=/path/to/python3.11 TORCH_PY=python3 bash bench/large_llama.sh
#
# ORTFLOW_PY: the Python with ortflow's GPU environment; TORCH_PY: a Python with PyTorch for CUDA (transformers is
# used when it imports there); MPIEXEC: the MPI launcher; GPUS (2), SIZE (1b), BATCH (8 per GPU), SEQ (512), STEPS
# (14; the first 4 are left out of the timing); OUT: where the logs and the report go.
set -u
cd "$(dirname "$0")/.."
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0}  # NVLink multicast off: NCCL's NVLS init fails on some hosts
export PYTHONUNBUFFERED=1
ORTFLOW_PY=${ORTFLOW_PY:-python3}
TORCH_PY=${TORCH_PY:-python3}
MPIEXEC=${MPIEXEC:-$(command -v mpiexec || echo "$(dirname "$ORTFLOW_PY")/mpiexec")}
OUT=${OUT:-bench/out/large-llama}
GPUS=${GPUS:-2}; SIZE=${SIZE:-1b}
WORK=(--gpus "$GPUS" --batch "${BATCH:-8}" --seq "${SEQ:-512}" --steps "${STEPS:-14}" --warmup 4)
mkdir -p "$OUT"
start=$(date +%s)
"$ORTFLOW_PY" tools/make_large_llama.py "$OUT/llama.onnx" --size "$SIZE" > "$OUT/0-model.log" 2>&1 \
  || { cat "$OUT/0-model.log"; exit 1; }
echo "model written in $(( $(date +%s) - start )) s: $(cat "$OUT/0-model.log")"
# PyTorch trains on the GPUs while every layout and precision configures on the CPUs (the engine builds each training
# graph in one process; the host has cores to spare), so the GPUs do not wait for configure.
LAYOUTS=${LAYOUTS:-dp}; PRECISIONS=${PRECISIONS:-fp16 bf16}; RECOMPUTE=${RECOMPUTE:-0}
# The variants of a layout: its own run, and with RECOMPUTE=1 on a split layout the recomputing one.
variants() { if [ "$RECOMPUTE" = 1 ] && [ "$1" != dp ]; then echo "kept recompute"; else echo kept; fi; }
if [ "${TORCH:-1}" != 0 ]; then
  "$TORCH_PY" -m torch.distributed.run --standalone --nproc_per_node "$GPUS" bench/torch_llama.py \
    --summary "$OUT/0-model.log" "${WORK[@]}" > "$OUT/3-torch.log" 2>&1 &
fi
for l in $LAYOUTS; do
  for p in $PRECISIONS; do
    (  # a recomputing variant after the layout's own configure, whose artifacts it reuses
      for v in $(variants "$l"); do
        flag=(); tag=""; [ "$v" = kept ] || { flag=(--recompute); tag=-recompute; }
        "$ORTFLOW_PY" bench/large_llama.py configure "$OUT" "$p" --layout "$l" ${flag[@]+"${flag[@]}"} \
          "${WORK[@]}" > "$OUT/1-configure-$p-$l$tag.log" 2>&1
      done
    ) &
  done
done
wait
echo "configured (and PyTorch done) in $(( $(date +%s) - start )) s"
[ "${TORCH:-1}" = 0 ] || grep '^RESULT' "$OUT/3-torch.log" || tail -20 "$OUT/3-torch.log"
for l in $LAYOUTS; do
  for p in $PRECISIONS; do
    for v in $(variants "$l"); do
      flag=(); tag=""; [ "$v" = kept ] || { flag=(--recompute); tag=-recompute; }
      "$ORTFLOW_PY" bench/large_llama.py train "$OUT" "$p" --layout "$l" ${flag[@]+"${flag[@]}"} \
        "${WORK[@]}" --mpiexec "$MPIEXEC" > "$OUT/2-train-$p-$l$tag.log" 2>&1
      grep '^RESULT' "$OUT/2-train-$p-$l$tag.log" || tail -20 "$OUT/2-train-$p-$l$tag.log"
    done
  done
done
command="bash bench/large_llama.sh"
[ "$LAYOUTS" = dp ] || command="LAYOUTS=\"$LAYOUTS\" $command"
[ "$PRECISIONS" = "fp16 bf16" ] || command="PRECISIONS=\"$PRECISIONS\" $command"
[ "$RECOMPUTE" != 1 ] || command="RECOMPUTE=1 $command"
[ "${TORCH:-1}" != 0 ] || command="TORCH=0 $command"
"$ORTFLOW_PY" bench/large_llama.py report "$OUT" --size "$SIZE" "${WORK[@]}" --command "$command"
echo "total $(( $(date +%s) - start )) s; report: $OUT/large-llama.md"
