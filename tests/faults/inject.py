"""Test-only rank entry: the real ``run_rank`` with one fault injected (mpiexec -n N python inject.py MODE RUN_DIR).

Modes:
  nan-grad:R:U  - rank R writes NaN into its gradients before the all-reduce of weight update U.
  stop:R:U      - rank R is SIGSTOPped while it waits inside weight update U's all-reduce (the others arrive 2 s
                  later, so they wait in the same collective as the stopped rank).
  stop-before:R:U - rank R SIGSTOPs itself just before weight update U's all-reduce.
  kill-write:0:U  - rank 0 SIGKILLs itself inside the checkpoint write of step U (state file written, no meta.json).
  kill-retention:0:U - rank 0 SIGKILLs itself while retention deletes an old checkpoint after saving step U
                  (meta.json of the old one removed, its folder not yet).
  oom:R:U       - rank R's engine fails as the CUDA engine does out of GPU memory, before weight update U's all-reduce
                  (the error text of a real run, a 1.12B Llama at tensor parallel 2 on an H200).
"""

import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path

import numpy as np

import ortflow.trainer.__main__ as entry

mode, run_dir = sys.argv[1], Path(sys.argv[2])
kind, victim, update = mode.split(":")[0], int(mode.split(":")[1]), int(mode.split(":")[2])
real_start = entry.start_mpi
ENGINE_OOM = (
    "/onnxruntime_src/orttraining/orttraining/training_api/module.cc:649 onnxruntime::common::Status "
    "onnxruntime::training::api::Module::EvalStep(const std::vector<OrtValue>&, std::vector<OrtValue>&) "
    "[ONNXRuntimeError] : 1 : FAIL : /onnxruntime_src/onnxruntime/core/providers/cuda/cuda_call.cc:123 "
    "std::conditional_t<THRW, void, onnxruntime::common::Status> onnxruntime::CudaCall(ERRTYPE, const char*, const "
    "char*, ERRTYPE, const char*, const char*, int) [with ERRTYPE = cublasStatus_t; bool THRW = true] CUBLAS failure "
    "3: CUBLAS_STATUS_ALLOC_FAILED ; GPU=1 ; hostname=vm ; file=/onnxruntime_src/onnxruntime/core/providers/cuda/"
    "cuda_stream_handle.cc ; line=74 ; expr=cublasCreate(&cublas_handle_); "
)


def start_with_fault(path):
    cfg, comm = real_start(path)
    real_average = comm.average_gradients
    calls = [0]

    def average(grads, divisor, scalars):
        calls[0] += 1
        if calls[0] != update:
            return real_average(grads, divisor, scalars)
        with open(run_dir / "fault-times.txt", "a") as f:  # when each rank reached the faulty update
            f.write(f"{comm.rank} {time.time() + (2.0 if kind == 'stop' and comm.rank != victim else 0.0)}\n")
        if comm.rank != victim:
            if kind == "stop":
                time.sleep(2.0)
            return real_average(grads, divisor, scalars)
        if kind == "oom":
            raise RuntimeError(ENGINE_OOM)
        if kind == "nan-grad":
            grads[0].reshape(-1)[0] = np.nan
        elif kind == "stop-before":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif kind == "stop":
            threading.Timer(0.5, os.kill, args=(os.getpid(), signal.SIGSTOP)).start()
        return real_average(grads, divisor, scalars)

    comm.average_gradients = average
    return cfg, comm


def kill_in_checkpoints():
    """Patch the checkpoint manager so that rank 0 dies inside the write or the retention of step ``update``."""
    from ortflow import checkpoints
    from ortflow.checkpoints import manager  # retention calls manager.delete_checkpoint: patch it there

    real_save, real_delete = checkpoints.CheckpointManager.save, manager.delete_checkpoint
    saving = [0]

    def save(self, step, state, meta):
        saving[0] = step
        if kind == "kill-write" and step == update and self.is_writer:
            real_writer = self._writer

            def writer(state, path):
                real_writer(state, path)
                os.kill(os.getpid(), signal.SIGKILL)

            self._writer = writer
        return real_save(self, step, state, meta)

    def delete(path):
        if kind == "kill-retention" and saving[0] == update:
            (Path(path) / checkpoints.META_FILE).unlink(missing_ok=True)
            os.kill(os.getpid(), signal.SIGKILL)
        real_delete(path)

    checkpoints.CheckpointManager.save = save
    manager.delete_checkpoint = delete


if kind.startswith("kill-"):
    kill_in_checkpoints()
else:
    entry.start_mpi = start_with_fault
logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", force=True)
sys.exit(entry.run_rank(run_dir))
