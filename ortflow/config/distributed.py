"""Where the ranks run: processes, devices, parallel sizes (the Slurm and Kubernetes sections: ``clusters``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError, ValidationInfo, field_validator

from ortflow.config.base import Section, resolve_path

_POSITIVE_INT = TypeAdapter(Annotated[int, Field(gt=0)])
_BOOL = TypeAdapter(bool)


class DistributedConfig(Section):
    """Processes, devices and parallelism. data x tensor x pipeline parallel sizes = num_ranks."""

    num_ranks: Annotated[int, Field(gt=0)] | Literal["auto"] = Field(
        1,
        description="World size: processes mpiexec starts; auto picks ranks and threads for the host, one rank per "
        "visible GPU with device cuda (docs/layouts.md).",
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
        None, gt=0, description="Data-parallel replicas (default: num_ranks / (tensor x pipeline parallel sizes))."
    )
    horizontal_parallel_size: int = Field(
        1, gt=0,
        description="Tensor-parallel size tp (the key keeps its TrainingRunner name): each attention block and MLP is "
        "split over tp neighbouring ranks (Megatron-style column/row split, heads divided; every exchange on CPU "
        "ranks, ZeRO-0 and mixed precision on GPU ranks; with pipeline_parallel_size each stage is split, in fp32; "
        "docs/layouts.md).",
    )
    pipeline_parallel_size: int = Field(
        1, gt=0, description="Pipeline stages, one rank each per replica; micro-batches = gradient_accumulation_steps."
    )
    recompute_forward: bool | Literal["auto"] = Field(
        "auto",
        description="With pipeline or tensor parallelism, true: every pipeline stage but the last, and every "
        "tensor-parallel piece but the last, runs each micro-batch's forward twice (a forward to send, then again "
        "inside its backward call) and keeps only the tensors it received in between (less memory, one more forward); "
        "false: the forward runs once and its activations are kept until the backward (at most P - s micro-batches on "
        "stage s of P, 1F1B); auto: kept, the choice measured faster on CPU ranks and on GPUs (docs/layouts.md, "
        "docs/gpu.md).",
    )
    recompute_subgraphs: tuple[str, ...] = Field(
        (),
        description="Where a forward runs once and its activations are kept (see recompute_forward): the engine's "
        "memory-optimizer plans, 'SUBGRAPH:1:COUNT' (e.g. 'Gelu+:1:-1': every GELU's output recomputed in the "
        "backward instead of kept; COUNT -1 = all), trading compute for activation memory; the subgraphs a model "
        "offers are those the engine's memory optimizer lists. Refused where no forward keeps its activations: an "
        "unsplit model, or recompute_forward true (docs/layouts.md).",
    )
    use_nccl: bool = Field(False, description="All-reduce gradients with NCCL on the GPU (needs CuPy and NCCL).")
    deterministic_compute: bool = Field(
        True,
        description="Repeatable training, so a resumed run ends bitwise identical to an uninterrupted one: asks the "
        "engine for its repeatable kernels (SessionOptions.use_deterministic_compute; CUDA cost in docs/gpu.md) and, "
        "on the CPU, reads trained embedding tables with GatherND, whose gradient does not depend on thread timing "
        "as the engine's Gather gradient does with threads_per_rank > 1 (docs/reliability.md).",
    )
    cuda_graphs: bool = Field(
        False,
        description="With device cuda, for the whole model (data parallelism, ZeRO-1, Adasum): configure cuts the "
        "training graph so that the CUDA provider records the training call once and replays it as a CUDA graph "
        "instead of launching every kernel from the host; where the engine cannot record the model's call, the rank "
        "says so and launches every kernel. Ends bitwise equal to the launched call (fp32 and fp16). Opt-in: every "
        "micro-batch of an update must have the shape of the update's first (docs/gpu.md).",
    )
    thread_spinning: Literal["auto", "on", "off"] = Field(
        "auto",
        description="Whether the engine's intra-op threads spin while they wait for work (its default) or sleep; "
        "auto: sleep when several ranks on a host fill all its cores (ranks x threads >= cores), where spinning "
        "workers delay other ranks' main threads and the exchange waits for the slowest (docs/layouts.md).",
    )
    reduce_sum_as_matmul: bool = Field(
        True,
        description="With device cuda and deterministic_compute: configure rewrites the training graphs' sums over "
        "leading axes (bias gradients; the whole model's, each pipeline stage's and tensor-parallel piece's, and the "
        "ranks their forward-once gradient graphs) as MatMuls with a ones vector, deterministic and fast on CUDA "
        "where the engine's deterministic ReduceSum is slow; false keeps the engine's ReduceSum (docs/gpu.md).",
    )
    allreduce_dtype: Literal["auto", "float32", "float16", "bfloat16"] = Field(
        "auto",
        description="Element type of the NCCL gradient all-reduce on device cuda: float16/bfloat16 halve the bytes "
        "sent (gradients pre-scaled by 1/ranks, summed in that type, back to float32); auto: float16 for fp16 mixed "
        "precision on several data-parallel GPU ranks (as fp16 training in DeepSpeed and Megatron-LM reduces), "
        "float32 otherwise (bf16 included); docs/gpu.md.",
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
        "(docs/layouts.md).",
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
        "job, section slurm; docs/clusters.md) or kubernetes (a Kubeflow MPIJob, section kubernetes; "
        "docs/clusters.md).",
    )

    _resolve_path = field_validator("hostfile", mode="after")(resolve_path)

    @field_validator("num_ranks", "recompute_forward", mode="before")
    @classmethod
    def _value_or_auto(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic refuses a bad value of `int | Literal["auto"]` once per member, under its internal names
        # ("num_ranks.constrained-int: ...", "num_ranks.literal['auto']: ..."): one problem naming what works instead.
        if value == "auto":
            return value
        if info.field_name == "num_ranks":
            allowed, member = "a positive number of ranks or auto", _POSITIVE_INT
        else:
            allowed, member = "true, false or auto", _BOOL
        try:
            return member.validate_python(value)
        except ValidationError:
            raise ValueError(f"{value!r} is not {allowed}") from None

    def recomputes_forward(self) -> bool:
        """``recompute_forward`` resolved: true or false as written; ``auto`` keeps (pipeline stages and
        tensor-parallel pieces measure faster keeping on CPU ranks and on GPUs, where a CUDA stage's messages go over
        NCCL: docs/gpu.md)."""
        return self.recompute_forward is True

    def activations_line(self, batchnorm_stages: list[int] = ()) -> str | None:
        """What the split layout's parts do with their activations, in words (``ortflow validate``'s plan); None for
        an unsplit model. ``batchnorm_stages``: the pipeline stages before the last whose forward switches BatchNorm
        to batch statistics, which recompute whatever ``recompute_forward`` says."""
        pp, tp = self.pipeline_parallel_size, self.horizontal_parallel_size
        if pp == 1 and tp == 1:
            return None
        parts = "tensor-parallel pieces but the loss's" if tp > 1 else "pipeline stages but the last"
        recompute = self.recomputes_forward()
        how = ("run the forward again in the backward call" if recompute else
               "run each micro-batch's forward once and keep its activations until its backward")
        line = f"activations: {parts} {how} (distributed.recompute_forward {str(self.recompute_forward).lower()})"
        if batchnorm_stages and not recompute:
            line += (f", except stage(s) {list(batchnorm_stages)}, whose forward switches BatchNorm to batch "
                     "statistics: they run the forward again in the backward call")
        return line

    @field_validator("recompute_subgraphs")
    @classmethod
    def _plans(cls, plans: tuple[str, ...]) -> tuple[str, ...]:
        bad = [p for p in plans if not re.fullmatch(r"[A-Za-z0-9_]+(\+[A-Za-z0-9_]+)*\+:1:(-1|[1-9][0-9]*)", p)]
        if bad:
            raise ValueError(f"{bad} are not memory-optimizer plans: write 'SUBGRAPH:1:COUNT', a subgraph of op types "
                             "each followed by '+' (e.g. 'Gelu+:1:-1', 'FusedMatMul+Add+Softmax+:1:2')")
        return plans

    @property
    def resolved_data_parallel_size(self) -> int:
        """data_parallel_size, defaulting to num_ranks / (tensor x pipeline parallel sizes); None while num_ranks
        is auto."""
        if self.data_parallel_size or self.num_ranks == "auto":
            return self.data_parallel_size
        return max(1, self.num_ranks // (self.horizontal_parallel_size * self.pipeline_parallel_size))

    def default_threads(self, cores: int, local_ranks: int) -> int:
        """Intra-op threads per rank: ``threads_per_rank``, else the host's cores shared by its ranks; CUDA ranks that
        share a host get 1.

        On CUDA the pool only runs the graph's few host nodes (shapes), and at several ranks per host its threads'
        wake-ups delay the rank's kernel launches: on 4 H100s (64 cores, bench GPT, fp16,
        measured) the slowest rank's forward + backward took 16.3-18.1 ms with 16
        threads per rank and 15.9-16.3 ms with 1, the whole update 21.1-23.3 ms and 20.4-21.2 ms; bf16, fp32 and one
        GPU alone differ by about 2% either way.
        """
        if self.threads_per_rank:
            return self.threads_per_rank
        if self.device == "cuda" and local_ranks > 1:
            return 1
        return max(1, cores // max(1, local_ranks))
