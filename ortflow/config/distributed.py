"""Where the ranks run: processes, devices, parallel sizes, and the Slurm and Kubernetes launchers."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator

from ortflow.config.base import Section, resolve_path


class DistributedConfig(Section):
    """Processes, devices and parallelism. data x horizontal x pipeline parallel sizes = num_ranks."""

    num_ranks: Annotated[int, Field(gt=0)] | Literal["auto"] = Field(
        1,
        description="World size: processes mpiexec starts; auto picks ranks and threads for the host, one rank per "
        "visible GPU with device cuda (docs/layout.md).",
    )
    hostfile: Path | None = Field(None, description="MPI host file for multi-node runs (default: this machine only).")
    num_hosts: int = Field(1, gt=0, description="Hosts the ranks are spread over (must match the host file).")
    device: Literal["cpu", "cuda"] = Field("cpu", description="Execution provider of every rank.")
    threads_per_rank: int | None = Field(
        None, gt=0, le=4096,
        description="Intra-op threads per rank (default: cores / local ranks, at least 1; 1 on CUDA ranks sharing a "
        "host, docs/gpu.md).",
    )
    data_parallel_size: int | None = Field(
        None, gt=0, description="Data-parallel replicas (default: num_ranks / (horizontal x pipeline parallel sizes))."
    )
    horizontal_parallel_size: int = Field(
        1, gt=0,
        description="Tensor-parallel size hp: each attention block and MLP is split over hp neighbouring ranks "
        "(Megatron-style column/row split, heads divided; fp32, ZeRO-0; with pipeline_parallel_size each stage is "
        "split; docs/tensor-parallel.md).",
    )
    pipeline_parallel_size: int = Field(
        1, gt=0, description="Pipeline stages, one rank each per replica; micro-batches = gradient_accumulation_steps."
    )
    use_nccl: bool = Field(False, description="All-reduce gradients with NCCL on the GPU (needs CuPy and NCCL).")
    deterministic_compute: bool = Field(
        True,
        description="Repeatable training, so a resumed run ends bitwise identical to an uninterrupted one: asks the "
        "engine for its repeatable kernels (SessionOptions.use_deterministic_compute; CUDA cost in docs/gpu.md) and, "
        "on the CPU, reads trained embedding tables with GatherND, whose gradient does not depend on thread timing "
        "as the engine's Gather gradient does with threads_per_rank > 1 (docs/reliability.md).",
    )
    thread_spinning: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Whether the engine's intra-op threads spin while they wait for work (its default) or sleep; "
        "auto: sleep when several ranks on a host fill all its cores (ranks x threads >= cores), where spinning "
        "workers delay other ranks' main threads and the exchange waits for the slowest (docs/layout.md).",
    )
    reduce_sum_as_matmul: bool = Field(
        True,
        description="With device cuda and deterministic_compute: configure rewrites the training graph's sums over "
        "leading axes (bias gradients) as MatMuls with a ones vector, deterministic and fast on CUDA where the "
        "engine's deterministic ReduceSum is slow; false keeps the engine's ReduceSum (docs/mixed-precision.md).",
    )
    allreduce_dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto",
        description="Element type of the NCCL gradient all-reduce on device cuda: float16/bfloat16 halve the bytes "
        "sent (gradients pre-scaled by 1/ranks, summed in that type, back to float32); auto: float16 for fp16 mixed "
        "precision on several data-parallel GPU ranks (as fp16 training in DeepSpeed and Megatron-LM reduces), "
        "float32 otherwise (bf16 included); docs/mixed-precision.md.",
    )
    nccl_bucket_mb: float = Field(
        0.0, ge=0,
        description="NCCL gradient exchange of GPU ranks in buckets of about this many MB sent: NCCL reduces one "
        "bucket while the GPU packs the next and unpacks the last, with the norm's sums; 0: one bucket, the fastest "
        "on 4 NVLink GPUs (docs/gpu.md).",
    )
    exchange_bucket_mb: float = Field(
        0.0, ge=0,
        description="MPI gradient exchange in buckets of this many MB (each packed, reduced and scaled while in "
        "cache); 0: each run of back-to-back gradients reduced in place by one all-reduce, the small ones packed "
        "(docs/layout.md).",
    )
    enable_adasum: bool = Field(
        False,
        description="Combine the data-parallel ranks' contributions with Adasum instead of the mean: gradients for "
        "sgd, each rank's own optimizer delta for adamw and lamb (needs a power-of-two data_parallel_size).",
    )
    zero_stage: Literal[0, 1, 2, 3] = Field(
        0, description="ZeRO stage: 0 (every rank holds all optimizer state) or 1 (each rank updates its shard)."
    )
    collective_timeout_s: float = Field(
        600.0, ge=1.0, le=7 * 86400,
        description="Abort the job when a collective waits longer than this, naming the stalled ranks (1 s to 7 days).",
    )
    launcher: Literal["local", "slurm", "kubernetes"] = Field(
        "local",
        description="Who starts the ranks: local (mpiexec on this host, or the hosts of hostfile), slurm (an sbatch "
        "job, section slurm; docs/slurm.md) or kubernetes (a Kubeflow MPIJob, section kubernetes; "
        "docs/kubernetes.md).",
    )

    _resolve_path = field_validator("hostfile", mode="after")(resolve_path)

    @property
    def resolved_data_parallel_size(self) -> int:
        """data_parallel_size, defaulting to num_ranks / (horizontal x pipeline parallel sizes); None while num_ranks
        is auto."""
        if self.data_parallel_size or self.num_ranks == "auto":
            return self.data_parallel_size
        return max(1, self.num_ranks // (self.horizontal_parallel_size * self.pipeline_parallel_size))

    def default_threads(self, cores: int, local_ranks: int) -> int:
        """Intra-op threads per rank: ``threads_per_rank``, else the host's cores shared by its ranks; CUDA ranks that
        share a host get 1.

        On CUDA the pool only runs the graph's few host nodes (shapes), and at several ranks per host its threads'
        wake-ups delay the rank's kernel launches: on 4 H100s (64 cores, bench GPT, fp16, ``bench/gpu_threads.sh``,
        measured) the slowest rank's forward + backward took 16.3-18.1 ms with 16
        threads per rank and 15.9-16.3 ms with 1, the whole update 21.1-23.3 ms and 20.4-21.2 ms; bf16, fp32 and one
        GPU alone differ by about 2% either way.
        """
        if self.threads_per_rank:
            return self.threads_per_rank
        if self.device == "cuda" and local_ranks > 1:
            return 1
        return max(1, cores // max(1, local_ranks))


_SLURM_TIME = r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^\d+-\d+$"
_SBATCH_LINE = r"^--?[A-Za-z][^\n\r]*$"


class SlurmConfig(Section):
    """The sbatch job of distributed.launcher slurm: distributed.num_ranks ranks over num_nodes nodes."""

    num_nodes: int = Field(1, gt=0, description="Nodes of the allocation (#SBATCH --nodes); num_ranks / num_nodes "
                           "ranks start on each.")
    gpus_per_node: int = Field(0, ge=0, description="GPUs per node (#SBATCH --gpus-per-node); 0 asks for none.")
    cpus_per_rank: int | None = Field(
        None, gt=0, description="CPUs per rank (#SBATCH --cpus-per-task; default: distributed.threads_per_rank or 1)."
    )
    partition: str | None = Field(None, min_length=1, description="Partition (#SBATCH --partition; default: the "
                                  "cluster's default).")
    time_limit: str | None = Field(
        None, pattern=_SLURM_TIME,
        description="Wall-clock limit as Slurm writes it (MINUTES, HH:MM:SS or DAYS-HH:MM:SS; #SBATCH --time).",
    )
    account: str | None = Field(None, min_length=1, description="Account charged (#SBATCH --account).")
    extra_sbatch: list[Annotated[str, Field(pattern=_SBATCH_LINE)]] = Field(
        [], description='Further sbatch options, one per entry, each written as "#SBATCH <entry>" (e.g. "--qos=high", '
        '"--constraint=a100").',
    )
    setup: list[str] = Field(
        [], description="Shell lines the job runs before the ranks start (module load ..., source /path/venv/bin/"
        "activate); the nodes need ortflow's Python environment and the run folder at the same paths.",
    )
    stop_signal_s: int = Field(
        180, ge=0, le=86400,
        description="Seconds before the time limit that the job gets SIGTERM (#SBATCH --signal=B:TERM@N), so the "
        "ranks stop after the current update with a stop checkpoint; 0: no early signal.",
    )
    requeue: bool = Field(
        True, description="Let Slurm requeue the job after a preemption or node failure (#SBATCH --requeue); the "
        "requeued job resumes from the newest complete checkpoint.",
    )
    mpiexec: str | None = Field(
        None, description="MPI launcher the job runs inside the allocation (default: the mpiexec beside this Python, "
        "the bundled MPICH, which starts its processes on the allocated nodes with srun).",
    )
    poll_interval_s: float = Field(2.0, gt=0, le=600, description="Seconds between job state queries (scontrol).")


class KubernetesConfig(Section):
    """The Kubeflow MPIJob (kubeflow.org/v2beta1) of distributed.launcher kubernetes: a launcher pod runs mpirun,
    num_workers worker pods run distributed.num_ranks / num_workers ranks each."""

    image: str | None = Field(
        None, min_length=1, description="Container image of launcher and workers: ortflow's pinned environment with "
        "Open MPI and sshd (docs/kubernetes.md); required with launcher kubernetes.",
    )
    namespace: str = Field("default", pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", description="Namespace of the "
                           "MPIJob.")
    num_workers: int = Field(1, gt=0, description="Worker pods (replicas of the Worker); num_ranks / num_workers "
                             "ranks (slotsPerWorker) on each.")
    gpus_per_worker: int = Field(0, ge=0, description="nvidia.com/gpu limit of each worker pod.")
    cpu_per_worker: str | None = Field(None, pattern=r"^\d+(\.\d+)?m?$", description="CPU request and limit of "
                                       "each worker pod (Kubernetes quantity, e.g. 16 or 500m).")
    memory_per_worker: str | None = Field(None, pattern=r"^\d+(\.\d+)?([KMGTPE]i?)?$", description="Memory "
                                          "request and limit of each worker pod (e.g. 64Gi).")
    run_volume_claim: str = Field(
        "ortflow-runs", pattern=r"^[a-z0-9]([-.a-z0-9]*[a-z0-9])?$",
        description="PersistentVolumeClaim (ReadWriteMany) holding the run folder; launcher and workers mount it at "
        "output_dir's path, so the resolved config's paths hold inside the pods.",
    )
    service_account: str | None = Field(None, min_length=1, description="Service account of the pods (default: "
                                        "the namespace's).")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field("IfNotPresent", description="Pull policy "
                                                                          "of both containers.")
    python: str = Field("python", min_length=1, description="Python of ortflow's environment inside the image.")
    poll_interval_s: float = Field(5.0, gt=0, le=600, description="Seconds between MPIJob status reads.")
    stop_grace_s: int = Field(
        60, ge=0, le=3600,
        description="terminationGracePeriodSeconds of the pods: on cancel the MPIJob is deleted and the ranks get "
        "SIGTERM, stop after the current update with a stop checkpoint, and are killed after this many seconds.",
    )
