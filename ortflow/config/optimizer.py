"""The update's sections: the optimizer and its parameter groups, the LR schedule, mixed precision."""

from __future__ import annotations

import fnmatch
from typing import Literal

from pydantic import Field, model_validator

from ortflow.config.base import Section


class ParamGroupConfig(Section):
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


class OptimizerConfig(Section):
    """Optimizer (the reference's training_optimizer_name) and its hyper-parameters (docs/training.md)."""

    name: Literal["adamw", "sgd", "lamb"] = Field(
        "adamw", description="adamw, sgd or lamb; applied by ortflow to the engine's buffers (docs/training.md)."
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
        "settings; no_weight_decay still applies inside every group (docs/training.md).",
    )
    momentum: float = Field(0.0, ge=0, lt=1, description="SGD momentum (0: plain SGD).")
    dampening: float = Field(0.0, ge=0, le=1, description="SGD momentum dampening (as torch.optim.SGD).")
    nesterov: bool = Field(False, description="SGD Nesterov momentum (needs momentum > 0 and dampening 0).")
    ratio_min: float = Field(0.0, ge=0, description="Lamb: lower bound of the trust ratio ||p|| / ||r||.")
    ratio_max: float | None = Field(None, gt=0, description="Lamb: upper bound of the trust ratio (default: none).")
    max_grad_norm: float | None = Field(
        None, gt=0, description="Clip the global gradient norm to this value before the step (default: no clipping)."
    )

    @property
    def label(self) -> str:
        """The rule as recorded in optimizer files: ``adamw/torch``, ``adamw/engine``, ``sgd``, ``lamb``."""
        return f"adamw/{self.rule}" if self.name == "adamw" else self.name

    @property
    def state_names(self) -> tuple[str, ...]:
        """The per-element state the rule keeps and a resumed checkpoint must hold (the trainer's rules keep these)."""
        if self.name == "sgd":
            return ("momentum",) if self.momentum > 0 else ()
        return ("exp_avg", "exp_avg_sq")

    @model_validator(mode="after")
    def _consistent(self) -> OptimizerConfig:
        unused = [
            f"optimizer.{field} applies to {_listed(users)}, not {self.name}; remove it (or set optimizer.name: "
            f"{users[0]})"
            for field, users in _USED_BY.items()
            if self.name not in users and getattr(self, field) != type(self).model_fields[field].default
        ]  # a run folder's config.yaml writes every field: the others' defaults are no choice, a changed value is
        if unused:
            raise ValueError("\n".join(unused))
        if self.nesterov and (self.momentum == 0 or self.dampening != 0):
            raise ValueError("optimizer.nesterov needs optimizer.momentum > 0 and optimizer.dampening 0")
        if self.name == "sgd" and any(g.betas is not None for g in self.groups):
            raise ValueError("optimizer.groups: betas apply to adamw and lamb, not sgd; remove them")
        if self.ratio_max is not None and self.ratio_max < self.ratio_min:
            raise ValueError(
                f"optimizer.ratio_max ({self.ratio_max}) must be >= optimizer.ratio_min ({self.ratio_min})"
            )
        return self


def _listed(names: tuple[str, ...]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


#: The hyper-parameters that only some optimizers use; a changed value under another optimizer is refused, not ignored.
_USED_BY = {
    "rule": ("adamw",),
    "beta1": ("adamw", "lamb"), "beta2": ("adamw", "lamb"), "epsilon": ("adamw", "lamb"),
    "momentum": ("sgd",), "dampening": ("sgd",), "nesterov": ("sgd",),
    "ratio_min": ("lamb",), "ratio_max": ("lamb",),
}  # fmt: skip


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


class LRScheduleConfig(Section):
    """Learning-rate schedule, computed from the weight-update step and set before every optimizer step.

    Update s (0-based) of T uses learning_rate * f(s); docs/training.md gives every formula.
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

    @model_validator(mode="after")
    def _used(self) -> LRScheduleConfig:
        unused = [
            f"lr_schedule.{field} applies to {_listed(users)}, not {self.name}; remove it (or set lr_schedule.name "
            f"to {'it' if len(users) == 1 else 'one of them'})"
            for field, users in (("min_lr_ratio", ("linear", "cosine", "polynomial")), ("power", ("polynomial",)))
            if self.name not in users and getattr(self, field) != type(self).model_fields[field].default
        ]  # a run folder's config.yaml writes every field: a default is no choice, a changed value is
        if unused:
            raise ValueError("\n".join(unused))
        return self


#: Ops of the default fp32 list that bf16 computes in bf16 when ``precision.fp32_ops`` is not set.
BF16_COMPUTE_OPS = ("Softmax",)


class PrecisionConfig(Section):
    """Mixed precision (the reference's use_mixed_precision, use_bfloat16, loss_scale)."""

    use_mixed_precision: bool = Field(
        False, description="Compute in FP16 (or BF16) with FP32 master weights; GPUs only (docs/gpu.md)."
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
        "Unset with bf16: this list without Softmax (bf16 in and out, accumulated in FP32 inside the engine's kernel, "
        "as Megatron-LM's fused softmax). With bf16, LayerNormalization stays FP32 even when left out (the engine has "
        "no bf16 SkipLayerNormalization).",
    )

    @model_validator(mode="after")
    def _bf16_softmax(self) -> PrecisionConfig:
        if self.use_bfloat16 and "fp32_ops" not in self.model_fields_set:
            object.__setattr__(self, "fp32_ops", tuple(op for op in self.fp32_ops if op not in BF16_COMPUTE_OPS))
        return self
