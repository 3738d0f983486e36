"""The run configuration: one frozen pydantic model per section, loaded from YAML.

Field names follow ONNX Runtime's C++ ``TrainingRunner::Parameters`` where one applies
(``num_train_steps``, ``gradient_accumulation_steps``, ``display_loss_steps``, ``checkpoint_period``, ...).

Two kinds of checks live here:

* structural and cross-field checks run when a :class:`RunConfig` is built (pydantic), and
* file checks (:func:`check_files`) that need the disk: the model exists, is valid ONNX, and the engine can run it.

:func:`find_problems` runs both and returns every problem at once, so ``ortflow validate`` can list them all.
This module imports nothing from ortflow.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

#: Highest ONNX opset and IR version that onnxruntime-training 1.19.2 runs (docs/engine-notes.md).
MAX_OPSET = 21
MAX_IR_VERSION = 10

#: Name of the resolved config that configure writes into the run folder; every rank loads it again.
RESOLVED_CONFIG_NAME = "config.yaml"


class ConfigError(ValueError):
    """A config that cannot be used; ``problems`` lists every reason, each naming the field and the fix."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = problems
        where = f" in {source}" if source else ""
        super().__init__(f"{len(problems)} problem(s){where}:\n" + "\n".join(f"  - {p}" for p in problems))


#: Upper bound of counts and sizes (steps, rows, batch sizes): far beyond any real run, well inside int64 arithmetic.
MAX_COUNT = 2**31 - 1


def _is_number_field(annotation: Any) -> bool:
    kinds = getattr(annotation, "__args__", None) or (annotation,)
    return any(kind in (int, float) for kind in kinds) and bool not in kinds


class _Section(BaseModel):
    # allow_inf_nan=False: .inf / .nan in a float field is refused (it would train to NaN losses with exit 0).
    model_config = ConfigDict(frozen=True, extra="forbid", validate_default=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_as_numbers(cls, data: Any) -> Any:
        # pydantic reads `batch_size: true` as 1; a boolean in a number field is always a mistake.
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name)
                if field is None or not _is_number_field(field.annotation):
                    continue
                if isinstance(value, bool):
                    raise ValueError(f"{name} is `{str(value).lower()}`, a boolean; give a number")
                if isinstance(value, int) and abs(value) > MAX_COUNT:
                    raise ValueError(f"{name} is {value}, beyond any real run; give at most {MAX_COUNT}")
        return data


def _resolve(value: Path | None, info: ValidationInfo) -> Path | None:
    """Relative paths resolve against the config file's folder (passed as validation context ``base_dir``)."""
    if value is None:
        return None
    value = Path(value).expanduser()
    base = (info.context or {}).get("base_dir")
    if not value.is_absolute() and base is not None:
        value = Path(base) / value
    return value


LossName = Literal["cross_entropy", "mse", "bce_with_logits", "l1", "model_output"]


class ModelConfig(_Section):
    """The user's ONNX model and how it is turned into a training graph."""

    path: Path = Field(description="Path to the ONNX model to train (the reference's model_path).")
    loss: LossName = Field(
        "cross_entropy",
        description="Loss added by the engine: cross_entropy, mse, bce_with_logits, l1; or model_output when the "
        "model already outputs a scalar loss.",
    )
    loss_output: str | None = Field(
        None,
        description="Model output fed to the loss (default: the first output). With loss=model_output, the output "
        "that holds the loss.",
    )
    label_input: str = Field(
        "labels",
        description="Name of the label/target input the loss adds (cross_entropy: int64 labels [N] for scores "
        "[N, C], [B, T] for logits [B, T, V]).",
    )
    frozen: tuple[str, ...] = Field(
        (),
        description="fnmatch patterns of float initializers that are not trained (default: all float initializers "
        "are trained).",
    )
    ignore_index: int | None = Field(
        None,
        ge=-(2**31),
        lt=2**31,
        description="cross_entropy: the one label value the loss skips (e.g. -100 for padding). Any other label "
        "outside [0, classes) is refused by prepare-data.",
    )
    fuse_gelu: bool = Field(
        True,
        description="Replace the elementwise GELU an exporter writes (erf or tanh form) by the engine's one-kernel "
        "Gelu / FastGelu before training (docs/your-model.md); on CPU ranks the tanh form becomes "
        "x * sigmoid(x * (a + b x^2)) instead, the same function with a faster CPU gradient "
        "(docs/engine-kernels.md). The export writes it back as standard ops. Off with bf16 mixed precision.",
    )
    pipeline_cuts: tuple[str, ...] = Field(
        (),
        description="With distributed.pipeline_parallel_size P > 1: the P-1 tensor names where the model is cut into "
        "stages, in graph order (default: chosen to balance trainable parameters; docs/parallel.md).",
    )

    _resolve_path = field_validator("path", mode="after")(_resolve)


SourceFormat = Literal["auto", "parquet", "csv", "arrow", "jsonl", "npz", "text"]


class TextConfig(_Section):
    """How a plain-text corpus becomes fixed-length token windows."""

    seq_len: int = Field(128, gt=1, description="Tokens per window; inputs and labels are shifted by one token.")
    tokenizer: Path | None = Field(
        None, description="A local `tokenizers` JSON file; default: byte-level (vocabulary of 256)."
    )
    input_name: str = Field("input_ids", description="Model input that receives the token window.")
    label_name: str = Field("labels", description="Input that receives the next-token targets.")

    _resolve_path = field_validator("tokenizer", mode="after")(_resolve)


class DataConfig(_Section):
    """Training and evaluation data (the reference's train_data_dir / test_data_dir) and how it is sharded."""

    train: tuple[str, ...] = Field(
        description="Training source(s): files or glob patterns (relative ones resolve against the config's folder)."
    )
    test: tuple[str, ...] = Field(
        (), description="Evaluation source(s); when empty, eval_fraction of the training rows is held out."
    )
    format: SourceFormat = Field("auto", description="Source format; auto picks it from the file extension.")
    columns: dict[str, str | tuple[str, ...]] = Field(
        {},
        description="Model input name -> source column, list of columns, or glob pattern ('f*', natural order f0, "
        "f1, ..., f10); several columns of one value each are stacked into one [k] row (default: the column named "
        "like the input).",
    )
    eval_fraction: float = Field(0.1, ge=0.0, lt=1.0, description="Share of rows held out for eval when test is empty.")
    rows_per_shard: int = Field(65536, gt=0, description="Rows per Arrow shard file (the last may be short).")
    text: TextConfig = Field(TextConfig(), description="Settings for format=text corpora.")
    memory_budget_mb: int = Field(256, gt=0, description="Memory the sharder and loader may use for buffers.")
    prefetch_batches: int = Field(2, ge=0, description="Batches the loader prepares ahead in a background thread.")

    @field_validator("train", "test", mode="before")
    @classmethod
    def _one_or_many(cls, value: Any) -> Any:
        value = (value,) if isinstance(value, (str, Path)) else value
        if isinstance(value, (list, tuple)) and any(isinstance(v, str) and not v.strip() for v in value):
            raise ValueError(
                "an entry is empty (an unset environment variable in a deployment's template?); give a file or glob"
            )
        return value

    @field_validator("train", "test", mode="after")
    @classmethod
    def _resolve_sources(cls, value: tuple[str, ...], info: ValidationInfo) -> tuple[str, ...]:
        return tuple(str(_resolve(Path(v), info)) for v in value)

    @field_validator("train", mode="after")
    @classmethod
    def _train_not_empty(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("give at least one training file or glob pattern")
        return value


class TrainConfig(_Section):
    """Loop hyper-parameters. Steps are micro-batches, as in the reference; weight updates = steps / accumulation."""

    batch_size: int = Field(gt=0, le=2**24, description="Samples per micro-batch per rank.")
    eval_batch_size: int | None = Field(
        None, gt=0, le=2**24, description="Samples per eval batch per rank (default: batch_size)."
    )
    num_train_steps: int = Field(
        gt=0, description="Forward/backward passes per rank; must be a multiple of gradient_accumulation_steps."
    )
    gradient_accumulation_steps: int = Field(1, gt=0, description="Micro-batches summed before each weight update.")
    global_batch_size: int | None = Field(
        None, gt=0,
        description="Samples per weight update on any layout: per-rank batch (<= batch_size) and accumulation are "
        "derived from the ranks; num_train_steps then counts weight updates (leave gradient_accumulation_steps 1).",
    )
    display_loss_steps: int = Field(10, gt=0, description="Show the loss (mean over ranks) every this many updates.")
    evaluation_period: int = Field(
        100, ge=0, description="Evaluate every this many weight updates (0: only at the end)."
    )
    max_eval_rows: int | None = Field(
        None, gt=0,
        description="Evaluate only the first this many rows of the eval split, shared over the ranks: the same rows "
        "on any layout, and what `ortflow evaluate` uses (default: the whole split).",
    )
    batchnorm_variance: Literal["unbiased", "biased"] = Field(
        "unbiased",
        description="BatchNormalization running_var update: unbiased (torch: the batch variance times n / (n - 1), "
        "n values per channel) or biased (ONNX's rule, the engine's own).",
    )
    batchnorm_sync: Literal["broadcast", "average"] = Field(
        "broadcast",
        description="How the ranks' BatchNormalization running statistics become one before every eval and "
        "checkpoint: broadcast (rank 0's, as DistributedDataParallel's broadcast_buffers) or average (the mean over "
        "the data-parallel ranks; docs/batchnorm.md).",
    )
    seed: int = Field(0, ge=0, lt=2**31, description="Seed for shuffling and any randomness in the run.")
    profile_steps: tuple[int, int] | None = Field(
        None,
        description="Profile these weight updates [start, end] (1-based, inclusive) with the engine's per-operator "
        "profiler: a Chrome trace per rank in <output_dir>/profile/ and a top-operators table.",
    )

    @property
    def num_weight_updates(self) -> int:
        """Optimizer steps in the whole run."""
        return self.num_train_steps // self.gradient_accumulation_steps

    @property
    def resolved_eval_batch_size(self) -> int:
        """eval_batch_size, defaulting to batch_size."""
        return self.eval_batch_size or self.batch_size

    @model_validator(mode="before")
    @classmethod
    def _renamed(cls, data: Any) -> Any:
        if isinstance(data, dict) and "max_eval_batches" in data:
            raise ValueError("train.max_eval_batches counted batches per rank, so the eval rows changed with the "
                             "layout; use train.max_eval_rows: N (the first N rows of the eval split, on any layout)")
        return data

    @model_validator(mode="after")
    def _steps_multiple(self) -> TrainConfig:
        if self.profile_steps and not 1 <= self.profile_steps[0] <= self.profile_steps[1]:
            raise ValueError(f"train.profile_steps {list(self.profile_steps)}: need [start, end], 1 <= start <= end")
        if self.global_batch_size and self.gradient_accumulation_steps != 1:
            raise ValueError(
                "train.gradient_accumulation_steps is derived from train.global_batch_size and the ranks: leave it "
                "at 1 (or unset global_batch_size)"
            )
        if self.num_train_steps % self.gradient_accumulation_steps:
            k = self.gradient_accumulation_steps
            lower = self.num_train_steps // k * k
            raise ValueError(
                f"train.num_train_steps ({self.num_train_steps}) must be a multiple of "
                f"train.gradient_accumulation_steps ({k}); use {lower or k} or {lower + k}"
            )
        return self


class ParamGroupConfig(_Section):
    """One parameter group: its parameters (fnmatch patterns, first matching group wins) and what differs for them."""

    params: tuple[str, ...] = Field(
        min_length=1,
        description="fnmatch patterns of parameter names in this group; a parameter belongs to the first group with "
        "a matching pattern, parameters matched by no group to the optimizer section's own settings.",
    )
    lr_scale: float | None = Field(
        None, gt=0, le=1e6, description="The group's rate = the scheduled rate x lr_scale (default 1)."
    )
    learning_rate: float | None = Field(
        None, gt=0, le=1e3,
        description="The group's peak rate, scheduled like optimizer.learning_rate (the same as lr_scale = "
        "learning_rate / optimizer.learning_rate); give lr_scale or learning_rate, not both.",
    )
    weight_decay: float | None = Field(
        None, ge=0, le=1e3, description="The group's weight decay (default: optimizer.weight_decay)."
    )
    betas: tuple[float, float] | None = Field(
        None, description="The group's (beta1, beta2) for adamw and lamb (default: optimizer.beta1, beta2)."
    )

    @model_validator(mode="after")
    def _consistent(self) -> ParamGroupConfig:
        if self.lr_scale is not None and self.learning_rate is not None:
            raise ValueError("optimizer.groups: give lr_scale or learning_rate, not both")
        if self.betas is not None and not all(0 <= b < 1 for b in self.betas):
            raise ValueError(f"optimizer.groups betas {list(self.betas)}: each must be in [0, 1)")
        return self


class OptimizerConfig(_Section):
    """Optimizer (the reference's training_optimizer_name) and its hyper-parameters (docs/optimizer.md)."""

    name: Literal["adamw", "sgd", "lamb"] = Field(
        "adamw", description="adamw, sgd or lamb; applied by ortflow to the engine's buffers (docs/optimizer.md)."
    )
    rule: Literal["torch", "engine"] = Field(
        "torch",
        description="AdamW arithmetic: torch (torch.optim.AdamW) or engine (ONNX Runtime's adam_mode=1, epsilon added "
        "to the uncorrected sqrt(v); continues runs started before ortflow owned the update bit for bit).",
    )
    learning_rate: float = Field(1e-3, gt=0, le=1e3, description="Peak learning rate, reached at the end of warm-up.")
    beta1: float = Field(0.9, ge=0, lt=1, description="AdamW/Lamb first-moment decay.")
    beta2: float = Field(0.999, ge=0, lt=1, description="AdamW/Lamb second-moment decay.")
    epsilon: float = Field(
        1e-8, gt=0, le=1.0, description="AdamW/Lamb epsilon (rule torch: added to the bias-corrected sqrt(v))."
    )
    weight_decay: float = Field(
        0.0, ge=0, le=1e3, description="Weight decay: decoupled for adamw and lamb, added to the gradient (L2) for sgd."
    )
    no_weight_decay: tuple[str, ...] = Field(
        (), description="fnmatch patterns of parameter names without weight decay (e.g. '*bias', '*norm*')."
    )
    groups: tuple[ParamGroupConfig, ...] = Field(
        (),
        description="Parameter groups [{params: [patterns], lr_scale or learning_rate, weight_decay, betas}]: the "
        "first group whose pattern matches a parameter is its group; parameters matched by none use this section's "
        "settings; no_weight_decay still applies inside every group (docs/optimizer.md).",
    )
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum (0: plain SGD).")
    dampening: float = Field(0.0, ge=0, le=1, description="SGD momentum dampening (as torch.optim.SGD).")
    nesterov: bool = Field(False, description="SGD Nesterov momentum (needs momentum > 0 and dampening 0).")
    ratio_min: float = Field(0.0, ge=0, description="Lamb: lower bound of the trust ratio ||p|| / ||r||.")
    ratio_max: float | None = Field(None, gt=0, description="Lamb: upper bound of the trust ratio (default: none).")
    max_grad_norm: float | None = Field(
        None, gt=0, description="Clip the global gradient norm to this value before the step (default: no clipping)."
    )

    @model_validator(mode="after")
    def _consistent(self) -> OptimizerConfig:
        if self.nesterov and (self.momentum == 0 or self.dampening != 0):
            raise ValueError("optimizer.nesterov needs optimizer.momentum > 0 and optimizer.dampening 0")
        if self.name == "sgd" and any(g.betas is not None for g in self.groups):
            raise ValueError("optimizer.groups: betas apply to adamw and lamb, not sgd; remove them")
        if self.ratio_max is not None and self.ratio_max < self.ratio_min:
            raise ValueError(
                f"optimizer.ratio_max ({self.ratio_max}) must be >= optimizer.ratio_min ({self.ratio_min})"
            )
        return self


def param_group_index(names: list[str] | tuple[str, ...], opt: OptimizerConfig) -> list[int]:
    """The ``optimizer.groups`` index of each parameter name; the first group with a matching pattern wins, and
    ``len(opt.groups)`` (the implicit last group, the section's own settings) holds the parameters no group matches."""
    return [next((k for k, g in enumerate(opt.groups) if any(fnmatch.fnmatchcase(n, p) for p in g.params)),
                 len(opt.groups)) for n in names]


def param_group_problems(names: list[str] | tuple[str, ...], opt: OptimizerConfig) -> list[str]:
    """``optimizer.groups`` patterns that match no trainable parameter, or only parameters an earlier group holds."""
    problems, claimed = [], {}
    for k, group in enumerate(opt.groups):
        for pattern in group.params:
            matched = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
            if not matched:
                problems.append(f"optimizer.groups[{k}].params: '{pattern}' matches no trainable parameter; fix the "
                                f"pattern (parameters are named as in the ONNX model, e.g. "
                                f"{', '.join(repr(n) for n in list(names)[:3])})")
            elif all(claimed.get(n, k) < k for n in matched):
                earlier = sorted({claimed[n] for n in matched})
                problems.append(f"optimizer.groups[{k}].params: '{pattern}' matches only parameters of "
                                f"optimizer.groups{earlier} (the first matching group wins); remove it or move the "
                                "group before them")
        for n in names:
            if any(fnmatch.fnmatchcase(n, p) for p in group.params):
                claimed.setdefault(n, k)
    return problems


class LRScheduleConfig(_Section):
    """Learning-rate schedule, computed from the weight-update step and set before every optimizer step.

    Update s (0-based) of T uses learning_rate * f(s); docs/optimizer.md gives every formula.
    """

    name: Literal["constant", "linear", "cosine", "polynomial"] = Field(
        "constant",
        description="Shape after warm-up, as Hugging Face's get_*_schedule_with_warmup, with "
        "p = (s - W) / max(1, T - W) and r = min_lr_ratio: constant f = 1; linear f = r + (1 - r) * max(0, 1 - p); "
        "cosine f = r + (1 - r) * (1 + cos(pi p)) / 2; polynomial f = r + (1 - r) * (1 - p) ** power.",
    )
    warmup_steps: int = Field(
        0, ge=0, description="W: weight updates of linear warm-up, f = s / W for s < W (the first update uses lr 0)."
    )
    min_lr_ratio: float = Field(
        0.0, ge=0, le=1, description="r: decay ends at learning_rate * min_lr_ratio (linear, cosine, polynomial)."
    )
    power: float = Field(1.0, gt=0, le=1e3, description="Exponent of polynomial decay.")
    indexing: Literal["huggingface", "training_runner"] = Field(
        "huggingface",
        description="huggingface: the formulas above; training_runner: ONNX Runtime TrainingRunner's indexing, "
        "warm-up f = (s + 1) / W and p = (s - W) / max(1, T - W - 1) (the peak is used twice, the last update "
        "uses exactly r).",
    )


class PrecisionConfig(_Section):
    """Mixed precision (the reference's use_mixed_precision, use_bfloat16, loss_scale)."""

    use_mixed_precision: bool = Field(
        False, description="Compute in FP16 (or BF16) with FP32 master weights; GPUs only (docs/mixed-precision.md)."
    )
    use_bfloat16: bool = Field(False, description="Use BF16 instead of FP16 for mixed precision.")
    loss_scale: float = Field(0.0, ge=0, description="Static loss scale; 0 selects dynamic loss scaling (FP16 only).")
    initial_loss_scale: float = Field(
        2.0**16, ge=1, description="Starting scale of dynamic loss scaling (a power of two keeps scaling exact)."
    )
    loss_scale_growth_interval: int = Field(
        2000, ge=1, description="Clean weight updates in a row before a dynamic loss scale doubles."
    )
    fp32_ops: tuple[str, ...] = Field(
        (
            "LayerNormalization", "Softmax", "LogSoftmax", "ReduceMean", "ReduceSum", "ReduceSumSquare", "ReduceL2",
            "ReduceLogSumExp", "ReduceProd", "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss",
        ),
        description="Op types computed in FP32 (inputs cast up, outputs kept FP32); everything else runs in FP16/BF16. "
        "With bf16, LayerNormalization stays FP32 even when left out (the engine has no bf16 SkipLayerNormalization).",
    )


class DistributedConfig(_Section):
    """Processes, devices and parallelism. data x horizontal x pipeline parallel sizes = num_ranks."""

    num_ranks: Annotated[int, Field(gt=0)] | Literal["auto"] = Field(
        1,
        description="World size: processes mpiexec starts; auto picks ranks and threads for the host "
        "(docs/layout.md).",
    )
    hostfile: Path | None = Field(None, description="MPI host file for multi-node runs (default: this machine only).")
    num_hosts: int = Field(1, gt=0, description="Hosts the ranks are spread over (must match the host file).")
    device: Literal["cpu", "cuda"] = Field("cpu", description="Execution provider of every rank.")
    threads_per_rank: int | None = Field(
        None, gt=0, le=4096, description="Intra-op threads per rank (default: cores / local ranks, at least 1)."
    )
    data_parallel_size: int | None = Field(
        None, gt=0, description="Data-parallel replicas (default: num_ranks / (horizontal x pipeline parallel sizes))."
    )
    horizontal_parallel_size: int = Field(
        1, gt=0,
        description="Tensor-parallel size hp: each attention block and MLP is split over hp neighbouring ranks "
        "(Megatron-style column/row split, heads divided; fp32, ZeRO-0; with pipeline_parallel_size each stage is "
        "split, CPU ranks only; docs/tensor-parallel.md).",
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
    allreduce_dtype: Literal["float32", "float16", "bfloat16"] = Field(
        "float32",
        description="Element type of the NCCL gradient all-reduce on device cuda: float16/bfloat16 halve the bytes "
        "sent (gradients pre-scaled by 1/ranks, summed in that type, back to float32); docs/mixed-precision.md.",
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

    _resolve_path = field_validator("hostfile", mode="after")(_resolve)

    @property
    def resolved_data_parallel_size(self) -> int:
        """data_parallel_size, defaulting to num_ranks / (horizontal x pipeline parallel sizes); None while num_ranks
        is auto."""
        if self.data_parallel_size or self.num_ranks == "auto":
            return self.data_parallel_size
        return max(1, self.num_ranks // (self.horizontal_parallel_size * self.pipeline_parallel_size))


class CheckpointConfig(_Section):
    """Checkpoints: the reference's checkpoints_dir, checkpoint_period, max_num_checkpoints, checkpoint_to_load_path."""

    dir: Path | None = Field(None, description="Checkpoint folder (default: <output_dir>/checkpoints).")
    period: int = Field(100, ge=0, description="Save every this many weight updates (0: only the final one).")
    max_num_checkpoints: int = Field(3, gt=0, description="Newest complete checkpoints kept while training.")
    checkpoint_to_load_path: Path | None = Field(
        None, description="Resume from this checkpoint (default: the newest complete one in dir, if any)."
    )
    init_from: Path | None = Field(
        None, description="Warm start: a checkpoint folder whose weights training starts from at step 0 (the optimizer "
        "state starts fresh), unless dir already holds a checkpoint to resume. Set by versions.policy continue."
    )

    _resolve_paths = field_validator("dir", "checkpoint_to_load_path", "init_from", mode="after")(_resolve)


class TensorBoardConfig(_Section):
    """TensorBoard event files, written by rank 0."""

    log_dir: Path | None = Field(None, description="Event folder (default: <output_dir>/tensorboard).")
    scalar_names: tuple[str, ...] = Field(
        (
            "train/loss", "eval/loss", "train/learning_rate", "train/grad_norm", "train/samples_per_s",
            "train/tokens_per_s", "train/loss_scale", "train/skipped_updates", "time/data", "time/forward_backward",
            "time/comm", "time/comm_wait", "time/norm_clip", "time/update", "time/eval", "time/checkpoint",
            "time/other",
        ),
        description="Scalars to log; any subset of the default (time/*: each phase's share of the window's wall time).",
    )
    histogram_names: tuple[str, ...] = Field((), description="fnmatch patterns of parameters whose histograms to log.")

    @field_validator("scalar_names", mode="after")
    @classmethod
    def _known_scalars(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        known = cls.model_fields["scalar_names"].default  # the default logs every scalar ortflow writes
        unknown = [name for name in value if name not in known]
        if unknown:
            raise ValueError(f"unknown scalar(s) {unknown} would silently log nothing; choose from {list(known)}")
        return value

    _resolve_path = field_validator("log_dir", mode="after")(_resolve)


class ExportConfig(_Section):
    """The inference model made from a checkpoint."""

    path: Path | None = Field(None, description="Where to write the model (default: <output_dir>/export/model.onnx).")
    outputs: tuple[str, ...] = Field((), description="Graph outputs to keep (default: the model's original outputs).")
    optimize: bool = Field(False, description="Apply ONNX Runtime's offline graph optimization.")
    quantize: bool = Field(False, description="Dynamic int8 quantization, with the eval accuracy change reported.")
    tolerance: float = Field(1e-4, gt=0, description="Max abs difference to the eval graph accepted by verification.")
    precision: Literal["fp32", "compute"] = Field(
        "fp32", description="fp32, or the mixed-precision compute type (fp16/bf16 weights and activations)."
    )

    _resolve_path = field_validator("path", mode="after")(_resolve)


class ScheduleConfig(_Section):
    """When a served deployment runs the pipeline."""

    cron: str | None = Field(None, description="Cron expression, e.g. '0 3 * * *'.")
    interval_s: float | None = Field(None, gt=0, description="Seconds between runs.")
    timezone: str = Field("UTC", description="Timezone of the cron expression.")

    @model_validator(mode="after")
    def _one_kind(self) -> ScheduleConfig:
        if self.cron and self.interval_s:
            raise ValueError("schedule: set either cron or interval_s, not both")
        return self


class PipelineConfig(_Section):
    """How the Prefect pipeline runs its stages: retries, timeouts, and waiting for a busy run folder."""

    retries: int = Field(2, ge=0, description="Retries of configure, prepare_data, retain and export after a crash or "
                         "I/O error (errors that would repeat are never retried).")
    retry_delays_s: tuple[float, ...] = Field(
        (2.0, 10.0), description="Seconds before each retry of those stages (the last value repeats)."
    )
    train_retries: int = Field(2, ge=0, description="Retries of the train stage; each resumes from the newest "
                               "complete checkpoint of its own run folder.")
    train_retry_delays_s: tuple[float, ...] = Field((5.0, 30.0), description="Seconds before each train retry.")
    stage_timeout_s: float | None = Field(
        None, gt=0, description="Time limit of configure, prepare_data, retain and export each (default: none)."
    )
    train_timeout_s: float | None = Field(
        None, gt=0, description="Time limit of one train attempt; the ranks are stopped when it passes (default: none)."
    )
    wait_for_lock: bool = Field(
        False, description="When another run holds the run folder, wait for it instead of failing at once."
    )
    lock_timeout_s: float | None = Field(
        None, gt=0, description="With wait_for_lock, fail after waiting this long (default: wait as long as it takes)."
    )


class VersionsConfig(_Section):
    """Model versions: what a deployment or scheduled run (or `ortflow run --new-version`) trains."""

    policy: Literal["retrain", "continue"] = Field(
        "retrain", description="retrain: start from model.path's weights; continue: warm-start from the previous "
        "successful version's checkpoint, on the current data (refused when the model file or the model or optimizer "
        "sections changed)."
    )
    continue_from: Literal["final", "best"] = Field(
        "final", description="With policy continue: the previous version's final checkpoint or its best by eval loss."
    )
    skip_unchanged: bool = Field(
        False, description="Skip the run (recorded as skipped) when config, model, data and versions.policy are "
        "unchanged since the last successful version (a policy change always trains)."
    )
    keep: int | None = Field(
        None, ge=1, le=100000, description="Completed versions to keep (the newest ones; null keeps all). After a "
        "version completes, older completed versions and the failed or stopped ones older than them are deleted, "
        "except pinned versions, `latest`, and a version a running one warm-starts from; `ortflow runs --prune` "
        "does the same on demand."
    )
    pinned: tuple[str, ...] = Field(
        (), description="Version names that are never pruned (e.g. the one in production)."
    )


_SLURM_TIME = r"^(\d+-)?\d+(:\d{1,2}){0,2}$|^\d+-\d+$"
_SBATCH_LINE = r"^--?[A-Za-z][^\n\r]*$"


class SlurmConfig(_Section):
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


class KubernetesConfig(_Section):
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


class RunConfig(_Section):
    """The whole run. Every path may be relative to the config file's folder."""

    name: str = Field("ortflow-run", pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$", description="Run and deployment name.")
    output_dir: Path = Field(description="Run folder: artifacts, shards, checkpoints, logs and the exported model.")
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

    _resolve_path = field_validator("output_dir", mode="after")(_resolve)

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
    """What tensor parallelism does not combine with yet, each with the fix."""
    dist, hp, problems = cfg.distributed, cfg.distributed.horizontal_parallel_size, []
    if dist.pipeline_parallel_size > 1 and dist.device == "cuda":
        problems.append(f"distributed.horizontal_parallel_size {hp} with pipeline_parallel_size "
                        f"{dist.pipeline_parallel_size} runs on CPU ranks only for now: use device cpu, or one of "
                        "them (the other 1) on GPUs")
    if dist.zero_stage or dist.enable_adasum:
        problems.append("distributed.horizontal_parallel_size > 1 averages each slice's gradients over its replicas "
                        "(ZeRO-0): set distributed.zero_stage 0 and enable_adasum false with it")
    if cfg.precision.use_mixed_precision:
        problems.append("distributed.horizontal_parallel_size > 1 trains in fp32: set precision.use_mixed_precision "
                        "false with it")
    if (dist.device == "cuda") != dist.use_nccl:
        problems.append("distributed.horizontal_parallel_size > 1 sums activations with MPI on CPU ranks and with "
                        "NCCL on GPU ranks: set use_nccl true with device cuda, false with device cpu")
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
    if dist.launcher == "kubernetes" and not cfg.kubernetes.image:
        problems.append("distributed.launcher kubernetes needs kubernetes.image: the container image with ortflow's "
                        "environment (docs/kubernetes.md)")
    return problems


def _cross_field_problems(cfg: RunConfig) -> list[str]:
    """Checks that span sections, each naming the field and what would be valid."""
    problems: list[str] = []
    dist, prec = cfg.distributed, cfg.precision
    if dist.num_ranks == "auto":
        if dist.data_parallel_size is not None:
            problems.append("distributed.data_parallel_size needs a number of ranks: unset it with num_ranks auto")
    elif (
        product := dist.resolved_data_parallel_size * dist.horizontal_parallel_size * dist.pipeline_parallel_size
    ) != dist.num_ranks:
        problems.append(
            f"distributed: data_parallel_size ({dist.resolved_data_parallel_size}) x horizontal_parallel_size "
            f"({dist.horizontal_parallel_size}) x pipeline_parallel_size ({dist.pipeline_parallel_size}) = {product} "
            f"must equal distributed.num_ranks ({dist.num_ranks})"
        )
    if dist.horizontal_parallel_size > 1:
        problems += _tensor_parallel_problems(cfg)
    cuts = cfg.model.pipeline_cuts
    if cuts and len(cuts) != dist.pipeline_parallel_size - 1:
        problems.append(
            f"model.pipeline_cuts names {len(cuts)} tensor(s) but distributed.pipeline_parallel_size "
            f"{dist.pipeline_parallel_size} needs {dist.pipeline_parallel_size - 1}; list one cut per stage boundary "
            "or leave it empty to choose them automatically"
        )
    if dist.pipeline_parallel_size > 1 and (dist.zero_stage or dist.enable_adasum):
        problems.append(
            "distributed.pipeline_parallel_size > 1 averages each stage's gradients over its replicas (ZeRO-0): set "
            "distributed.zero_stage 0 and enable_adasum false with it"
        )
    if dist.pipeline_parallel_size > 1 and prec.use_mixed_precision:
        problems.append(
            "distributed.pipeline_parallel_size > 1 trains the stages in fp32: set precision.use_mixed_precision "
            "false with it"
        )
    dp = dist.resolved_data_parallel_size
    if dist.enable_adasum and dp and dp & (dp - 1):
        problems.append(
            f"distributed.enable_adasum needs a power-of-two number of data-parallel ranks (its tree pairs ranks "
            f"level by level), got {dp}: use {1 << (dp.bit_length() - 1)} or {1 << dp.bit_length()} ranks"
        )
    if dist.enable_adasum and dist.zero_stage:
        problems.append("distributed.enable_adasum combines whole per-rank updates: use zero_stage 0 with it")
    split = max(dist.pipeline_parallel_size, dist.horizontal_parallel_size) > 1
    others = dist.zero_stage or dist.enable_adasum or split
    if dist.allreduce_dtype != "float32" and (dist.device != "cuda" or others):
        problems.append(
            f"distributed.allreduce_dtype {dist.allreduce_dtype} is implemented for the data-parallel NCCL all-reduce "
            "of GPU ranks only (device cuda, use_nccl, zero_stage 0, no Adasum, no pipeline or tensor parallelism; "
            "MPI and CPU ranks reduce in float32): set those, or allreduce_dtype float32"
        )
    if dist.zero_stage > 1:
        problems.append(f"distributed.zero_stage {dist.zero_stage} is not supported; use 0 or 1 (state sharding)")
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
    if cfg.lr_schedule.warmup_steps >= updates > 0:
        problems.append(
            f"lr_schedule.warmup_steps {cfg.lr_schedule.warmup_steps} is not shorter than the run's {updates} weight "
            f"update(s): the rate would never reach its peak; use fewer warm-up steps or train longer"
        )
    return problems


# ---------------------------------------------------------------------------------------------------------------------
# YAML
#
# PyYAML follows YAML 1.1, where ``1:30`` is the number 90 (base 60), ``010`` is 8 (octal) and a key given twice
# silently keeps its last value. A config written by a person means none of these, so configs load with plain scalars
# resolved by the YAML 1.2 core schema (``010`` is 10, ``0o10`` is 8, ``1:30`` stays text for the field to refuse) and
# a mapping that names a key twice is refused, naming the key and both lines.

#: Configs are a few kilobytes; anything this large is a mistake (a data file given as the config, a huge comment).
#: The pure-Python parser (whose errors quote the offending line) reads this much in about half a second.
MAX_CONFIG_BYTES = 1 << 20


class DuplicateKeyError(yaml.YAMLError):
    """A mapping names one key twice."""


def _core_schema_resolvers() -> dict:
    """PyYAML's implicit resolvers with the YAML 1.1 bool/int/float rules replaced by YAML 1.2 core schema ones."""
    kept = {
        first: [(tag, regexp) for tag, regexp in entries
                if tag not in ("tag:yaml.org,2002:bool", "tag:yaml.org,2002:int", "tag:yaml.org,2002:float")]
        for first, entries in yaml.resolver.Resolver.yaml_implicit_resolvers.items()
    }
    rules = [
        ("tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), "tTfF"),
        ("tag:yaml.org,2002:int", re.compile(r"^(?:[-+]?[0-9]+|0o[0-7]+|0x[0-9a-fA-F]+)$"), "-+0123456789"),
        ("tag:yaml.org,2002:float", re.compile(
            r"^(?:[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?|[-+]?\.(?:inf|Inf|INF)|\.(?:nan|NaN|NAN))$"),
         "-+.0123456789"),
    ]
    for tag, regexp, firsts in rules:
        for first in firsts:
            kept.setdefault(first, []).append((tag, regexp))
    return kept


class _StrictLoader(yaml.SafeLoader):
    """Safe loading with YAML 1.2 numbers and booleans, refusing duplicate keys."""

    yaml_implicit_resolvers = _core_schema_resolvers()

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                line = seen.setdefault(key, key_node.start_mark.line + 1)
            except TypeError:  # an unhashable key: the constructor names it
                continue
            if line != key_node.start_mark.line + 1:
                raise DuplicateKeyError(
                    f"the key '{key}' appears twice (lines {line} and {key_node.start_mark.line + 1}); the second "
                    f"would silently replace the first: keep one"
                )
        return super().construct_mapping(node, deep=deep)


def _int_1_2(loader: _StrictLoader, node: yaml.ScalarNode) -> int:
    text = loader.construct_scalar(node)
    if text.startswith("0o"):
        return int(text[2:], 8)
    if text.startswith("0x"):
        return int(text[2:], 16)
    return int(text)  # decimal, leading zeros included: 010 is ten


def _float_1_2(loader: _StrictLoader, node: yaml.ScalarNode) -> float:
    text = loader.construct_scalar(node).lower()
    if text.endswith(".inf"):
        return float("-inf") if text.startswith("-") else float("inf")
    return float("nan") if text == ".nan" else float(text)


_StrictLoader.add_constructor("tag:yaml.org,2002:int", _int_1_2)
_StrictLoader.add_constructor("tag:yaml.org,2002:float", _float_1_2)


def load_yaml(text: str) -> Any:
    """Parse one YAML document with :class:`_StrictLoader` (YAML 1.2 numbers and booleans, no duplicate keys).

    Raises:
        yaml.YAMLError: the text is not valid YAML, or a mapping names a key twice (:class:`DuplicateKeyError`).
    """
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader


# ---------------------------------------------------------------------------------------------------------------------
# Loading


def _set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    keys = dotted.split(".")
    node = tree
    for key in keys[:-1]:
        child = node.setdefault(key, {})
        if not isinstance(child, dict):
            raise ConfigError([f"--set {dotted}: '{key}' is a value, not a section"])
        node = child
    node[keys[-1]] = value


def parse_overrides(overrides: list[str] | tuple[str, ...]) -> list[tuple[str, Any]]:
    """Parse ``a.b=c`` overrides; values are read as YAML scalars/lists (``3`` -> int, ``[a, b]`` -> list)."""
    parsed = []
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError([f"--set '{item}': expected KEY=VALUE, e.g. train.batch_size=8"])
        try:
            value = load_yaml(raw) if raw.strip() else None
        except yaml.YAMLError as err:
            problem = str(err).replace("\n", " ")
            raise ConfigError([f"--set '{item}': the value is not valid YAML ({problem}); quote it: {key}='\"...\"'"]) \
                from None
        parsed.append((key.strip(), value))
    return parsed


def _format_validation_error(err: ValidationError) -> list[str]:
    problems = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"])
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown field; check the spelling (docs/config.md lists every field)"
        elif e["type"] == "missing":
            msg = "required field is missing"
        problems.extend(m if not loc or m.startswith(loc) else f"{loc}: {m}" for m in msg.split("\n"))
    return problems


def config_from_dict(raw: dict[str, Any], base_dir: Path | None = None, source: str | None = None) -> RunConfig:
    """Build a RunConfig from a plain dict, raising :class:`ConfigError` with every problem."""
    if not isinstance(raw, dict):
        problems = ["the config must be a YAML mapping of sections (name, output_dir, model, data, train, ...)"]
        raise ConfigError(problems, source)
    try:
        return RunConfig.model_validate(raw, context={"base_dir": base_dir})
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err), source) from None


def read_config_dict(path: Path | str, overrides: list[str] | tuple[str, ...] = ()) -> dict[str, Any]:
    """Read YAML with the safe loader and apply ``--set`` overrides."""
    path = Path(path)
    try:
        refusal = regular_file_problem(path, MAX_CONFIG_BYTES, "a config")
        if refusal:
            raise ConfigError([refusal], str(path))
        text = path.read_bytes().decode("utf-8")
    except OSError as err:
        raise ConfigError([f"cannot read config file: {err.strerror}; check the path"], str(path)) from None
    except UnicodeDecodeError as err:
        raise ConfigError(
            [f"not UTF-8 text (byte {err.object[err.start]:#04x} at offset {err.start}); save the file as UTF-8"],
            str(path),
        ) from None
    try:
        raw = load_yaml(text) or {}
    except DuplicateKeyError as err:
        raise ConfigError([str(err)], str(path)) from None
    except yaml.YAMLError as err:
        raise ConfigError([f"not valid YAML: {err}"], str(path)) from None
    except RecursionError:
        raise ConfigError(["nested too deeply to read (YAML nesting of hundreds of levels); flatten it"], str(path)) \
            from None
    if not isinstance(raw, dict):
        raise ConfigError(["the config must be a YAML mapping of sections"], str(path))
    for key, value in parse_overrides(overrides):
        _set_dotted(raw, key, value)
    return raw


def load_config(path: Path | str, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load and validate a config file; relative paths resolve against its folder."""
    path = Path(path).resolve()
    return config_from_dict(read_config_dict(path, overrides), base_dir=path.parent, source=str(path))


def apply_overrides(cfg: RunConfig, overrides: list[str] | tuple[str, ...], base_dir: Path | None = None) -> RunConfig:
    """A copy of ``cfg`` with ``--set``-style overrides applied and validated like the CLI's.

    Args:
        cfg: The config to start from.
        overrides: ``KEY=VALUE`` items (``train.num_train_steps=50``).
        base_dir: Folder that relative paths in the values resolve against (default: the current folder).

    Raises:
        ConfigError: an override is malformed or makes the config invalid.
    """
    if not overrides:
        return cfg
    raw = cfg.model_dump(mode="json")
    for key, value in parse_overrides(overrides):
        _set_dotted(raw, key, value)
    return config_from_dict(raw, base_dir=base_dir or Path.cwd(), source="overrides " + " ".join(overrides))


def dump_config(cfg: RunConfig) -> str:
    """The resolved config as YAML (absolute paths), loadable by :func:`load_config`."""
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


def write_resolved_config(cfg: RunConfig, run_dir: Path | None = None) -> Path:
    """Write the resolved config into the run folder (atomically) and return its path."""
    run_dir = Path(run_dir or cfg.output_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    target = run_dir / RESOLVED_CONFIG_NAME
    tmp = target.with_suffix(".yaml.tmp")
    try:
        tmp.write_text(dump_config(cfg))
        tmp.replace(target)
    finally:  # a full disk leaves no half-written file beside the config
        tmp.unlink(missing_ok=True)
    return target


def load_run_config(run_dir: Path | str) -> RunConfig:
    """Load the resolved config a configured run folder holds (what every rank does at start)."""
    path = Path(run_dir) / RESOLVED_CONFIG_NAME
    if not path.exists():
        raise ConfigError([f"{path} does not exist: run `ortflow configure CONFIG` first"], str(run_dir))
    return load_config(path)


# ---------------------------------------------------------------------------------------------------------------------
# File checks


#: Protocol buffers cannot hold more than 2 GiB: larger models keep their weights in external data files.
MAX_MODEL_BYTES = 2 << 30


def regular_file_problem(path: Path, max_bytes: int, what: str) -> str | None:
    """Why ``path`` cannot be read whole as ``what``: not a regular file (a device or FIFO reads forever), or too large.

    Returns None when it can be read.
    """
    import stat

    try:
        st = path.stat()
    except OSError as err:
        return f"cannot read {path}: {err.strerror}; check the path"
    if not stat.S_ISREG(st.st_mode):
        return f"{path} is not a regular file (a device, FIFO or folder); give the path of {what} file"
    if st.st_size > max_bytes:
        return (f"{path} holds {st.st_size} bytes, more than {what} can ({max_bytes}); check that the path names "
                f"{what} file")
    return None


def check_model_file(path: Path) -> list[str]:
    """Problems with the ONNX model file: missing, not ONNX, opset/IR too new, external data outside its folder."""
    import onnx  # local: only file checks need it

    if not path.exists():
        return [f"model.path: {path} does not exist; check the path (relative paths start at the config's folder)"]
    refusal = regular_file_problem(path, MAX_MODEL_BYTES, "an ONNX model")
    if refusal:
        return [f"model.path: {refusal}"]
    try:
        proto = onnx.load(str(path), load_external_data=False)
    except Exception as err:  # noqa: BLE001 - onnx raises several types for bad files
        return [f"model.path: {path} is not a valid ONNX model ({type(err).__name__}: {err}); re-export it"]
    problems = []
    if proto.ir_version > MAX_IR_VERSION:
        problems.append(
            f"model.path: IR version {proto.ir_version} is newer than the engine runs (<= {MAX_IR_VERSION}); re-export "
            f"with onnx 1.17 or set `model.ir_version = {MAX_IR_VERSION}` before saving"
        )
    for opset in proto.opset_import:
        if opset.domain in ("", "ai.onnx") and opset.version > MAX_OPSET:
            problems.append(
                f"model.path: opset {opset.version} is newer than the engine runs (<= {MAX_OPSET}); re-export with "
                f"opset_version={MAX_OPSET} (torch.onnx.export) or opset_imports=[make_opsetid('', {MAX_OPSET})]"
            )
    folder = path.resolve().parent
    problems.extend(_short_initializers(proto))
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                if "\0" in entry.value:
                    problems.append(
                        f"model.path: initializer '{tensor.name}' names its external data file {entry.value!r}, "
                        "which holds a NUL byte (a damaged model); re-export it"
                    )
                    continue
                target = (folder / entry.value).resolve()
                if not target.is_relative_to(folder):
                    problems.append(
                        f"model.path: initializer '{tensor.name}' keeps its data at '{entry.value}', outside the "
                        f"model's folder; refused for safety: move the data file next to the model"
                    )
                elif not target.exists():
                    problems.append(f"model.path: external data file '{entry.value}' of '{tensor.name}' is missing")
    if not problems:
        try:
            onnx.checker.check_model(str(path))
        except Exception as err:  # noqa: BLE001
            problems.append(f"model.path: the ONNX checker rejects {path.name}: {err}")
    return problems


def _short_initializers(proto: Any) -> list[str]:
    """Initializers whose stored bytes do not fill their declared shape (the engine fails without naming them)."""
    import math

    import onnx

    problems = []
    for tensor in proto.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL or not tensor.HasField("raw_data"):
            continue
        try:
            itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        except (KeyError, ValueError, TypeError):
            continue
        want = math.prod(tensor.dims) * itemsize
        if len(tensor.raw_data) != want:
            problems.append(
                f"model.path: initializer '{tensor.name}' declares shape {list(tensor.dims)} ({want} bytes) but holds "
                f"{len(tensor.raw_data)} bytes; the model file is damaged or was edited: re-export it"
            )
    return problems


def check_files(cfg: RunConfig) -> list[str]:
    """Checks that need the disk: the model file, the host file, the tokenizer, the output folder."""
    problems = check_model_file(cfg.model.path)
    if cfg.output_dir.exists() and not cfg.output_dir.is_dir():
        problems.append(f"output_dir: {cfg.output_dir} is a file, not a folder; choose another output_dir")
    if cfg.distributed.hostfile is not None and not cfg.distributed.hostfile.exists():
        problems.append(f"distributed.hostfile: {cfg.distributed.hostfile} does not exist")
    tok = cfg.data.text.tokenizer
    if tok is not None and not tok.exists():
        problems.append(f"data.text.tokenizer: {tok} does not exist")
    for field, folder in (("init_from", cfg.checkpoint.init_from),
                          ("checkpoint_to_load_path", cfg.checkpoint.checkpoint_to_load_path)):
        if folder is not None and not folder.exists():
            problems.append(f"checkpoint.{field}: {folder} does not exist; give a checkpoint folder (step-N) or remove "
                            f"the field")
    return problems


def find_problems(path: Path | str, overrides: list[str] | tuple[str, ...] = ()) -> tuple[RunConfig | None, list[str]]:
    """Every problem with a config file at once: YAML, fields, cross-field rules, then the files it names."""
    try:
        cfg = load_config(path, overrides)
    except ConfigError as err:
        return None, err.problems
    return cfg, check_files(cfg)


# ---------------------------------------------------------------------------------------------------------------------
# Reference documentation


def reference_markdown() -> str:
    """A markdown table of every config field with its type, default and description (docs/config.md)."""

    def rows(model: type[BaseModel], prefix: str) -> list[str]:
        out = []
        for name, field in model.model_fields.items():
            annotation = field.annotation
            if isinstance(annotation, type) and issubclass(annotation, BaseModel):
                out.extend(rows(annotation, f"{prefix}{name}."))
                continue
            kind = str(annotation).replace("typing.", "").replace("pathlib.", "").replace("<class '", "")
            kind = kind.replace("'>", "").replace("ortflow.config.", "").replace("|", "\\|")
            default = "*required*" if field.is_required() else f"`{json.dumps(field.default, default=str)}`"
            out.append(f"| `{prefix}{name}` | {kind} | {default} | {field.description} |")
            item = (getattr(annotation, "__args__", None) or (None,))[0]
            if isinstance(item, type) and issubclass(item, BaseModel):  # a list of sections: each entry's fields
                out.extend(rows(item, f"{prefix}{name}[]."))
        return out

    header = ["| field | type | default | meaning |", "|---|---|---|---|"]
    return "\n".join(header + rows(RunConfig, ""))


# --- How a global batch splits over ranks: read by the launching process and by every rank. ---


class LayoutError(ValueError):
    """No layout or batch split satisfies the constraints; the message names the field and valid choices."""


@dataclass(frozen=True)
class BatchPlan:
    """How a global batch splits: per-rank micro-batch x accumulation steps x ranks = global batch."""

    batch_size: int
    accumulation: int
    ranks: int

    @property
    def global_batch(self) -> int:
        return self.batch_size * self.accumulation * self.ranks


def divides(global_batch: int, ranks: int, unit: int) -> bool:
    """Whether ``ranks`` micro-batches of a multiple of ``unit`` can make up ``global_batch`` samples."""
    return global_batch % (ranks * unit) == 0


def nearest_multiples(value: int, unit: int) -> list[int]:
    """The multiples of ``unit`` closest to ``value`` from below and above (one entry if value is one)."""
    below = value // unit * unit
    return [value] if below == value else [m for m in (below, below + unit) if m > 0]


def plan_batch(global_batch: int, ranks: int, max_batch: int, fixed_batch: int | None = None) -> BatchPlan:
    """Per-rank micro-batch and accumulation steps so that ranks x batch x steps = ``global_batch``.

    The micro-batch is the largest divisor of the rank's share that is <= ``max_batch`` (fewest accumulation
    steps), or exactly ``fixed_batch`` when the model's batch dim is fixed.

    Raises:
        LayoutError: naming the nearest global batch sizes and rank counts that work.
    """
    unit = fixed_batch or 1
    if global_batch % (ranks * unit):
        sizes = nearest_multiples(global_batch, ranks * unit)
        counts = [r for r in range(1, 2 * ranks + 1) if divides(global_batch, r, unit)]
        near = sorted(counts, key=lambda r: (abs(r - ranks), r))[:3]
        fixed = f" and the model's fixed batch dim {unit}" if fixed_batch else ""
        raise LayoutError(
            f"train.global_batch_size {global_batch} cannot be split over {ranks} rank(s){fixed}: use a global batch "
            f"of {' or '.join(map(str, sizes))}, or {' or '.join(map(str, sorted(near))) or 'no other'} rank(s)"
        )
    share = global_batch // ranks
    if fixed_batch:
        return BatchPlan(fixed_batch, share // fixed_batch, ranks)
    batch = next(b for b in range(min(max_batch, share), 0, -1) if share % b == 0)
    return BatchPlan(batch, share // batch, ranks)


def fixed_batch_dim(inputs: list[dict], merged_rows: dict[str, int] | None = None) -> int | None:
    """The model's fixed batch dim from configure.json's ``train_inputs`` (None when the batch dim is symbolic).

    Args:
        inputs: ``[{"name", "dtype", "shape"}]`` of the training model's inputs.
        merged_rows: For inputs whose batch and sequence dims the loader merges (a GPT's ``labels [B*T]``), the
            rows' leading dim ``T`` (from the data manifest); their fixed dim counts ``B*T`` values.
    """
    merged_rows = merged_rows or {}
    found = set()
    for item in inputs:
        shape = item.get("shape") or []
        if shape and isinstance(shape[0], int) and shape[0] > 0:
            per_row = merged_rows.get(item["name"], 1)
            found.add(shape[0] // per_row if shape[0] % per_row == 0 else shape[0])
    if len(found) > 1:
        raise LayoutError(f"model inputs fix different batch sizes {sorted(found)}; re-export with one batch dim")
    return found.pop() if found else None


@dataclass(frozen=True)
class RunFacts:
    """What the run folder says about the model: trainable parameters and a fixed batch dim."""

    num_parameters: int
    fixed_batch: int | None


def run_facts(run_dir: Path) -> RunFacts:
    """Model size and fixed batch dim from configure.json (and the data manifest's merged inputs, if prepared)."""
    run_dir = Path(run_dir)
    try:
        record = json.loads((run_dir / "configure.json").read_text())
    except (OSError, ValueError):
        raise LayoutError(f"{run_dir}/configure.json is missing: run `ortflow configure CONFIG` first") from None
    merged = {}
    try:
        manifest = json.loads((run_dir / "data" / "manifest.json").read_text())
        merged = {i["name"]: i["row_shape"][0] for i in manifest.get("inputs", []) if i.get("merge_leading_dims")}
    except (OSError, ValueError, KeyError, IndexError):
        pass
    return RunFacts(int(record.get("num_parameters", 0)), fixed_batch_dim(record.get("train_inputs", []), merged))


def rank_config(cfg: RunConfig, world: int, run_dir: Path) -> RunConfig:
    """The config a rank trains with: with train.global_batch_size, the per-rank batch and accumulation for
    ``world`` ranks (run length in weight updates unchanged); otherwise ``cfg`` itself.

    Raises:
        LayoutError: the global batch cannot be split over ``world`` ranks (names the nearest valid choices).
    """
    train = cfg.train
    if not train.global_batch_size:
        return cfg
    plan = plan_batch(train.global_batch_size, world, train.batch_size, run_facts(run_dir).fixed_batch)
    steps = train.num_weight_updates * plan.accumulation
    resolved = train.model_copy(
        update={"batch_size": plan.batch_size, "gradient_accumulation_steps": plan.accumulation,
                "num_train_steps": steps}  # fmt: skip
    )
    return cfg.model_copy(update={"train": resolved})
