"""Loss scaling for fp16 training: the scale fed to the graph, the skip/halve/grow rule, and its checkpoint state.

The training graph multiplies the loss by its ``loss_scale`` input (:data:`INPUT_NAME`, added by configure), so the
fp16 backward carries gradients ``scale`` times larger and small ones do not flush to zero. The trainer divides the
scale out in the gradient average it already does (the communicator's divisor becomes ``k * world * scale``), so
the engine's fp32 gradient buffers hold true gradients when the norm is taken and the optimizer runs.

Every rank holds the same averaged gradients and computes the same norm (on the device with NCCL, bit for bit), so
every rank takes the same decision: a non-finite norm skips that update everywhere, halves a dynamic scale and counts
the skip; ``growth_interval`` clean updates in a row double it (as PyTorch's GradScaler and the C++ reference's
``LossScaler``). A static scale (``precision.loss_scale > 0``) never changes; an overflow still skips the update.
Scales are powers of two, so scaling and unscaling are exact in binary floating point.

bf16 has fp32's exponent range: no scaling (the scaler is disabled and the graph has no scale input).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np

from ortflow.artifacts_folder import LOSS_SCALE_INPUT

#: Name of the training graph's scalar input that multiplies the loss.
INPUT_NAME = LOSS_SCALE_INPUT  # the graph input configure adds (ortflow.artifacts_folder)
MIN_SCALE = 1.0
MAX_SCALE = 2.0**24


@dataclass
class LossScaler:
    """The current scale and its counters (the part of a run's state that checkpoints keep).

    Attributes:
        enabled: Whether the graph takes a scale (fp16 mixed precision); when False every method is a no-op.
        scale: The factor the loss is multiplied by.
        dynamic: Halve on overflow and grow after ``growth_interval`` clean updates.
        growth_interval: Clean updates in a row before the scale doubles.
        clean_updates: Clean updates since the scale last changed.
        skipped_updates: Updates skipped because the gradient norm was not finite (whole run, resumes included).
    """

    enabled: bool = False
    scale: float = 1.0
    dynamic: bool = False
    growth_interval: int = 2000
    clean_updates: int = 0
    skipped_updates: int = 0

    @property
    def needs_norm(self) -> bool:
        """Whether every update needs the gradient norm (to detect overflow)."""
        return self.enabled

    def feed(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The batch's feeds plus the scale input (the feeds themselves when scaling is off)."""
        if not self.enabled:
            return feeds
        return {**feeds, INPUT_NAME: np.array(self.scale, dtype=np.float32)}

    def update(self, grad_norm: float | None) -> bool:
        """Record one update's gradient norm; True when the optimizer should step, False to skip this update."""
        if not self.enabled:
            return True
        if grad_norm is None or not math.isfinite(grad_norm):
            self.skipped_updates += 1
            self.clean_updates = 0
            if self.dynamic:
                self.scale = max(self.scale / 2.0, MIN_SCALE)
            return False
        self.clean_updates += 1
        if self.dynamic and self.clean_updates >= self.growth_interval:
            self.scale = min(self.scale * 2.0, MAX_SCALE)
            self.clean_updates = 0
        return True

    def report(self) -> dict[str, float | int]:
        """Fields for the progress line and TensorBoard (empty when scaling is off)."""
        return {"loss_scale": self.scale, "skipped_updates": self.skipped_updates} if self.enabled else {}


def from_config(precision, saved: dict | None) -> LossScaler:
    """The scaler for a run's ``precision`` section, continuing from a checkpoint's saved state when given.

    Args:
        precision: ``RunConfig.precision``.
        saved: What :func:`checkpoint_state` stored in the checkpoint being resumed, or None.
    """
    enabled = bool(precision.use_mixed_precision and not precision.use_bfloat16)
    if not enabled:
        return LossScaler()
    dynamic = precision.loss_scale == 0
    scaler = LossScaler(
        enabled=True,
        scale=float(precision.initial_loss_scale if dynamic else precision.loss_scale),
        dynamic=dynamic,
        growth_interval=precision.loss_scale_growth_interval,
    )
    if saved:
        scaler.scale = float(saved["scale"]) if dynamic else scaler.scale
        scaler.clean_updates = int(saved["clean_updates"])
        scaler.skipped_updates = int(saved["skipped_updates"])
    return scaler


#: The key of the scaler's state in a checkpoint's meta.json (with HDF5 checkpoints: their ``extra_state``).
META_KEY = "loss_scale"


def saved_state(meta: dict) -> dict | None:
    """The scaler's state stored in a checkpoint's metadata, or None."""
    return meta.get(META_KEY)


def checkpoint_state(scaler: LossScaler) -> dict | None:
    """What a checkpoint keeps of the scaler (None when scaling is off); :func:`from_config` reads it back."""
    if not scaler.enabled:
        return None
    state = asdict(scaler)
    return {key: state[key] for key in ("scale", "dynamic", "clean_updates", "skipped_updates")}
