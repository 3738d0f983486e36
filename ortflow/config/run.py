"""The whole run (:class:`RunConfig`) and the rules that join its sections."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pydantic import Field, ValidationInfo, field_validator, model_validator

from ortflow.config.base import Section, resolve_path
from ortflow.config.clusters import KubernetesConfig, SlurmConfig
from ortflow.config.distributed import DistributedConfig
from ortflow.config.model_data import DataConfig, ModelConfig, TrainConfig
from ortflow.config.optimizer import LRScheduleConfig, OptimizerConfig, PrecisionConfig
from ortflow.config.outputs import (
    CheckpointConfig,
    ExportConfig,
    PipelineConfig,
    ScheduleConfig,
    TensorBoardConfig,
    VersionsConfig,
)
from ortflow.config.storage import StorageConfig, remote_output_dir, remote_problems


class RunConfig(Section):
    """The whole run. Every path may be relative to the config file's folder."""

    name: str = Field("ortflow-run", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="Run and deployment name.")
    output_dir: Path = Field(description="Run folder: artifacts, shards, checkpoints, logs and the exported model. "
                             "A URL (s3://, gs://, az://) keeps the run folder on object storage (docs/operations.md).")
    model: ModelConfig = Field(description="The ONNX model and its loss.")
    data: DataConfig = Field(description="Training and evaluation data.")
    train: TrainConfig = Field(description="Loop hyper-parameters.")
    optimizer: OptimizerConfig = Field(OptimizerConfig(), description="Optimizer.")
    lr_schedule: LRScheduleConfig = Field(LRScheduleConfig(), description="Learning-rate schedule.")
    precision: PrecisionConfig = Field(PrecisionConfig(), description="Mixed precision.")
    distributed: DistributedConfig = Field(DistributedConfig(), description="Ranks, devices, parallelism.")
    slurm: SlurmConfig = Field(SlurmConfig(), description="The Slurm job of distributed.launcher slurm.")
    kubernetes: KubernetesConfig = Field(KubernetesConfig(), description="The MPIJob of distributed.launcher "
                                         "kubernetes.")
    checkpoint: CheckpointConfig = Field(CheckpointConfig(), description="Checkpoints and retention.")
    tensorboard: TensorBoardConfig = Field(TensorBoardConfig(), description="TensorBoard logging.")
    export: ExportConfig = Field(ExportConfig(), description="Inference model export.")
    schedule: ScheduleConfig = Field(ScheduleConfig(), description="Deployment schedule.")
    pipeline: PipelineConfig = Field(PipelineConfig(), description="Stage retries, timeouts, run-folder lock.")
    versions: VersionsConfig = Field(VersionsConfig(), description="Model versions of scheduled runs.")
    storage: StorageConfig = Field(StorageConfig(), description="Object storage of a remote output_dir.")

    _resolve_path = field_validator("output_dir", mode="after")(resolve_path)

    @model_validator(mode="before")
    @classmethod
    def _remote_output_dir(cls, data: object, info: ValidationInfo) -> object:
        # Runs before the field checks: a URL output_dir becomes storage.remote_dir plus its local copy.
        return remote_output_dir(data, (info.context or {}).get("base_dir"))

    # Derived paths: one place decides the run folder's layout.
    @property
    def artifacts_dir(self) -> Path:
        return self.output_dir / "artifacts"

    @property
    def data_dir(self) -> Path:
        return self.output_dir / "data"

    @property
    def checkpoints_dir(self) -> Path:
        return self.checkpoint.dir or self.output_dir / "checkpoints"

    @property
    def tensorboard_dir(self) -> Path:
        return self.tensorboard.log_dir or self.output_dir / "tensorboard"

    @property
    def export_path(self) -> Path:
        return self.export.path or self.output_dir / "export" / "model.onnx"

    def gradient_allreduce_dtype(self, data_parallel_ranks: int) -> str:
        """``distributed.allreduce_dtype`` resolved for ``data_parallel_ranks`` NCCL ranks: ``auto`` is float16 for
        fp16 mixed precision where the half-precision exchange applies (GPU ranks, the data-parallel NCCL all-reduce,
        more than one rank), float32 otherwise; one rank reduces nothing, so it keeps float32 whatever is set."""
        dist, prec = self.distributed, self.precision
        if data_parallel_ranks <= 1:
            return "float32"
        if dist.allreduce_dtype != "auto":
            return dist.allreduce_dtype
        fp16 = prec.use_mixed_precision and not prec.use_bfloat16
        return "float16" if fp16 and dist.device == "cuda" and dist.use_nccl and not _others(dist) else "float32"

    @model_validator(mode="after")
    def _cross_checks(self) -> RunConfig:
        problems = _cross_field_problems(self)
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def section_fingerprint(self, *sections: str) -> str:
        """sha256 of the named sections' resolved values: a cache key that changes when they do."""
        data = self.model_dump(mode="json", include=set(sections) if sections else None)
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def _tensor_parallel_problems(cfg: RunConfig) -> list[str]:
    """What tensor parallelism needs of the devices, with the fix."""
    dist, problems = cfg.distributed, []
    if (dist.device == "cuda") != dist.use_nccl:
        problems.append("distributed.horizontal_parallel_size > 1 sums activations with MPI on CPU ranks and with "
                        "NCCL on GPU ranks: set use_nccl true with device cuda, false with device cpu")
    return problems


def _split_problems(cfg: RunConfig) -> list[str]:
    """What a split model (pipeline stages, tensor parallelism) does not combine with, each with the reason and fix."""
    dist, prec, problems = cfg.distributed, cfg.precision, []
    split = "distributed.pipeline_parallel_size > 1" if dist.pipeline_parallel_size > 1 else \
        "distributed.horizontal_parallel_size > 1"
    if (dist.zero_stage or dist.enable_adasum) and dist.device == "cuda":
        problems.append(
            f"{split} on device cuda averages each stage's or slice's gradients over its replicas (ZeRO-0; ZeRO-1 and "
            "Adasum over the replicas of a stage or a tensor-parallel slice run on CPU ranks): set "
            "distributed.zero_stage 0 and enable_adasum false with it, or device cpu"
        )
    if prec.use_mixed_precision and dist.pipeline_parallel_size > 1 and dist.horizontal_parallel_size > 1:
        problems.append(
            "distributed.pipeline_parallel_size > 1 with horizontal_parallel_size > 1 trains in fp32: mixed precision "
            "(fp16 with loss scaling, bf16) is built for data parallelism, pipeline stages and tensor parallelism "
            "each alone; set precision.use_mixed_precision false with both, or split the model one way"
        )
    return problems


def _launcher_problems(cfg: RunConfig) -> list[str]:
    """What a scheduler launcher needs from distributed: a fixed rank count that its nodes or pods share evenly."""
    dist = cfg.distributed
    if dist.launcher == "local":
        return []
    section, count, unit = (("slurm", cfg.slurm.num_nodes, "num_nodes") if dist.launcher == "slurm"
                            else ("kubernetes", cfg.kubernetes.num_workers, "num_workers"))  # fmt: skip
    problems = []
    if dist.num_ranks == "auto":
        problems.append(f"distributed.num_ranks auto measures this host, not the {section} nodes: give a number of "
                        f"ranks with launcher {dist.launcher}")
    elif dist.num_ranks % count:
        problems.append(f"distributed.num_ranks ({dist.num_ranks}) must be a multiple of {section}.{unit} ({count}): "
                        "every node runs the same number of ranks")
    if dist.hostfile is not None or dist.num_hosts != 1:
        problems.append(f"distributed.hostfile and num_hosts are for launcher local; with launcher {dist.launcher} "
                        f"the scheduler places the ranks ({section}.{unit}): unset them")
    if dist.launcher == "kubernetes":
        problems += _kubernetes_problems(cfg)
    return problems


def _kubernetes_problems(cfg: RunConfig) -> list[str]:
    """The image is named, and the run and checkpoint folders lie where the pods mount the claim."""
    k8s = cfg.kubernetes
    problems = []
    if not k8s.image:
        problems.append("distributed.launcher kubernetes needs kubernetes.image: the container image with ortflow's "
                        "environment (docker/Dockerfile, docs/clusters.md)")
    mount = Path(k8s.run_volume_mount_path)
    for what, folder in (("output_dir", cfg.output_dir), ("checkpoint.dir", cfg.checkpoints_dir)):
        if not Path(folder).is_relative_to(mount):
            problems.append(f"{what} {folder} is not under kubernetes.run_volume_mount_path {mount}, where the pods "
                            "mount the claim: set run_volume_mount_path to the folder the claim holds (the same path "
                            f"here and in the pods), or put {what} under it")
    return problems


def _world_size_problem(dist: DistributedConfig, product: int) -> str:
    """The ranks do not split into the parallel sizes: the sizes as they multiply, and the fix. Without
    data_parallel_size (derived as num_ranks / (tensor x pipeline parallel sizes)) the fix is a multiple of the split;
    with it, the product or leaving data_parallel_size unset."""
    split = dist.horizontal_parallel_size * dist.pipeline_parallel_size
    sizes = (f"horizontal_parallel_size ({dist.horizontal_parallel_size}) x pipeline_parallel_size "
             f"({dist.pipeline_parallel_size})")
    if dist.data_parallel_size is None:
        multiples = ", ".join(str(split * k) for k in range(1, 4))
        return (f"distributed.num_ranks {dist.num_ranks} is not a multiple of {sizes} = {split}, the ranks of one "
                f"model replica: set num_ranks to a multiple of {split} ({multiples}, ...; data_parallel_size is "
                f"num_ranks / {split}), or change the parallel sizes")
    return (f"distributed: data_parallel_size ({dist.data_parallel_size}) x {sizes} = {product} must equal "
            f"distributed.num_ranks ({dist.num_ranks}): set num_ranks to {product}, or leave data_parallel_size unset "
            f"(it defaults to num_ranks / {split})")


def _cross_field_problems(cfg: RunConfig) -> list[str]:
    """Checks that span sections, each naming the field and what would be valid."""
    problems: list[str] = remote_problems(cfg.storage, {"checkpoint.dir": cfg.checkpoint.dir,
                                                         "tensorboard.log_dir": cfg.tensorboard.log_dir})
    dist, prec = cfg.distributed, cfg.precision
    if dist.num_ranks == "auto":
        if dist.data_parallel_size is not None:
            problems.append("distributed.data_parallel_size needs a number of ranks: unset it with num_ranks auto")
    elif (
        product := dist.resolved_data_parallel_size * dist.horizontal_parallel_size * dist.pipeline_parallel_size
    ) != dist.num_ranks:
        problems.append(_world_size_problem(dist, product))
    if dist.horizontal_parallel_size > 1:
        problems += _tensor_parallel_problems(cfg)
    cuts = cfg.model.pipeline_cuts
    if cuts and len(cuts) != dist.pipeline_parallel_size - 1:
        problems.append(
            f"model.pipeline_cuts names {len(cuts)} tensor(s) but distributed.pipeline_parallel_size "
            f"{dist.pipeline_parallel_size} needs {dist.pipeline_parallel_size - 1}; list one cut per stage boundary "
            "or leave it empty to choose them automatically"
        )
    if dist.pipeline_parallel_size > 1 or dist.horizontal_parallel_size > 1:
        problems += _split_problems(cfg)
    dp = dist.resolved_data_parallel_size
    if dist.enable_adasum and dp and dp & (dp - 1):
        problems.append(
            f"distributed.enable_adasum needs a power-of-two number of data-parallel ranks (its tree pairs ranks "
            f"level by level), got {dp}: use {1 << (dp.bit_length() - 1)} or {1 << dp.bit_length()} ranks"
        )
    if dist.enable_adasum and dist.zero_stage:
        problems.append("distributed.enable_adasum combines whole per-rank updates: use zero_stage 0 with it")
    if dist.allreduce_dtype not in ("auto", "float32") and (dist.device != "cuda" or _others(dist)):
        problems.append(
            f"distributed.allreduce_dtype {dist.allreduce_dtype} is implemented for the data-parallel NCCL all-reduce "
            "and the ZeRO-1 reduce-scatter of GPU ranks only (device cuda, use_nccl, no Adasum, no pipeline or tensor "
            "parallelism; MPI and CPU ranks reduce in float32): set those, or allreduce_dtype float32"
        )
    if dist.zero_stage > 1:
        problems.append(f"distributed.zero_stage {dist.zero_stage} is not supported; use 0 or 1 (state sharding)")
    if dist.recompute_subgraphs and (max(dist.pipeline_parallel_size, dist.horizontal_parallel_size) == 1
                                     or dist.recomputes_forward()):
        problems.append(_recompute_subgraphs_problem(dist))
    if cfg.train.profile_steps and dist.device == "cuda":
        problems.append("train.profile_steps traces CPU ranks only (the engine's GPU trace is not wired up): profile "
                        "with distributed.device cpu, or remove train.profile_steps")
    if dist.device == "cuda" and not dist.use_nccl:
        problems.append(
            "distributed.device cuda needs distributed.use_nccl: true: CUDA gradients stay on the GPU and are averaged "
            "there with NCCL (the engine gives no host views of them), also on a single rank"
        )
    # device: cuda and use_nccl need the machine (the GPU engine, CUDA libraries, GPUs, CuPy/NCCL): each rank checks
    # them at start with a clear error (trainer.runtime.select_device, comm.NCCLComm); `ortflow doctor` lists them.
    problems += _launcher_problems(cfg)
    if dist.num_hosts > 1 and dist.hostfile is None:
        problems.append(f"distributed.num_hosts is {dist.num_hosts}: give distributed.hostfile listing the hosts")
    if dist.num_ranks != "auto" and dist.num_ranks < dist.num_hosts:
        problems.append(f"distributed.num_ranks ({dist.num_ranks}) must be >= distributed.num_hosts ({dist.num_hosts})")
    gb = cfg.train.global_batch_size
    if gb and dist.num_ranks != "auto" and gb % dist.num_ranks:
        lower = gb // dist.num_ranks * dist.num_ranks
        problems.append(
            f"train.global_batch_size {gb} cannot be split over distributed.num_ranks {dist.num_ranks}: use "
            f"{' or '.join(str(v) for v in (lower, lower + dist.num_ranks) if v > 0)}, or num_ranks auto"
        )
    if prec.use_bfloat16 and not prec.use_mixed_precision:
        problems.append("precision.use_bfloat16 needs precision.use_mixed_precision: true")
    if prec.use_mixed_precision and dist.device != "cuda":
        problems.append(
            "precision.use_mixed_precision needs distributed.device: cuda: the CPU build of onnxruntime-training has "
            "no fp16/bf16 training kernels; on CPUs train in fp32 (use_mixed_precision: false), or on GPUs install "
            "the GPU engine (docs/gpu.md)"
        )
    if prec.use_bfloat16 and prec.loss_scale:
        problems.append("precision.loss_scale applies to fp16 only (bf16 has fp32's range): set it to 0")
    if cfg.export.precision == "compute" and not prec.use_mixed_precision:
        problems.append("export.precision compute needs precision.use_mixed_precision: true (or use fp32)")
    if cfg.model.ignore_index is not None and cfg.model.loss != "cross_entropy":
        problems.append(f"model.ignore_index applies to cross_entropy only (model.loss is {cfg.model.loss}); remove it")
    if cfg.model.loss == "model_output" and cfg.model.loss_output is None:
        problems.append("model.loss is model_output: name the output that holds the loss in model.loss_output")
    updates = cfg.train.num_weight_updates
    profiled = cfg.train.profile_steps
    if profiled and profiled[1] > updates:
        problems.append(f"train.profile_steps {list(profiled)} ends after the run's {updates} weight update(s): "
                        f"profile updates within 1..{updates}, e.g. [{min(profiled[0], updates)}, {updates}]")
    if cfg.lr_schedule.warmup_steps >= updates > 0:
        problems.append(
            f"lr_schedule.warmup_steps {cfg.lr_schedule.warmup_steps} is not shorter than the run's {updates} weight "
            f"update(s): the rate would never reach its peak; use fewer warm-up steps or train longer"
        )
    return problems


def _recompute_subgraphs_problem(dist: DistributedConfig) -> str:
    """Why ``recompute_subgraphs`` would change nothing, and the fix: its plans apply where a forward runs once and
    keeps its activations until the backward (the engine's memory optimizer works on the separate forward and backward
    calls' gradient graph, not on the training call's model)."""
    if dist.recomputes_forward():
        why = "recompute_forward true runs every forward again in the backward call and keeps nothing"
    else:
        why = ("an unsplit model trains in the engine's training call, whose activations the memory optimizer does "
               "not plan")
    return (f"distributed.recompute_subgraphs {list(dist.recompute_subgraphs)} would recompute nothing: {why}. Its "
            "plans apply to pipeline stages but the last and tensor-parallel pieces but the loss's, which keep their "
            "activations (recompute_forward auto or false); remove recompute_subgraphs, or split the model with "
            "pipeline_parallel_size or horizontal_parallel_size > 1")


def _others(dist) -> bool:
    """Whether the exchange is something else than the data-parallel all-reduce or ZeRO-1's reduce-scatter (Adasum,
    pp or tp groups)."""
    split = max(dist.pipeline_parallel_size, dist.horizontal_parallel_size) > 1
    return bool(dist.enable_adasum or split)
