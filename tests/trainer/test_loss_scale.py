"""Loss scaling: the skip/halve/grow rule, its checkpoint state, and what configure builds for fp16 (on the CPU)."""

from __future__ import annotations

import json
import math

import numpy as np

from ortflow.config import PrecisionConfig
from ortflow.trainer import loss_scale
from ortflow.trainer.loss_scale import INPUT_NAME, LossScaler


def test_overflow_skips_halves_and_clean_updates_grow_the_scale():
    scaler = loss_scale.from_config(PrecisionConfig(use_mixed_precision=True, loss_scale_growth_interval=3), None)
    assert scaler.enabled and scaler.dynamic and scaler.scale == 2.0**16
    assert scaler.update(1.5) and scaler.update(2.0)
    assert not scaler.update(math.inf)  # skip
    assert scaler.scale == 2.0**15 and scaler.skipped_updates == 1 and scaler.clean_updates == 0
    assert not scaler.update(math.nan) and scaler.scale == 2.0**14 and scaler.skipped_updates == 2
    for _ in range(3):
        assert scaler.update(0.5)
    assert scaler.scale == 2.0**15 and scaler.clean_updates == 0  # grew after 3 clean updates in a row
    assert scaler.report() == {"loss_scale": 2.0**15, "skipped_updates": 2}


def test_static_scale_never_changes_but_still_skips_overflow():
    scaler = loss_scale.from_config(PrecisionConfig(use_mixed_precision=True, loss_scale=128.0), None)
    assert not scaler.dynamic
    assert not scaler.update(math.inf) and scaler.scale == 128.0 and scaler.skipped_updates == 1
    for _ in range(5000):
        scaler.update(1.0)
    assert scaler.scale == 128.0


def test_scale_is_fed_as_a_float32_scalar_and_off_for_bf16_and_fp32():
    scaler = LossScaler(enabled=True, scale=8.0)
    feeds = {"input_ids": np.zeros((2, 3), np.int64)}
    fed = scaler.feed(feeds)
    assert fed[INPUT_NAME].dtype == np.float32 and fed[INPUT_NAME].shape == () and float(fed[INPUT_NAME]) == 8.0
    assert INPUT_NAME not in feeds  # the loader's dict is not modified
    for prec in (PrecisionConfig(), PrecisionConfig(use_mixed_precision=True, use_bfloat16=True)):
        off = loss_scale.from_config(prec, None)
        assert not off.enabled and off.feed(feeds) is feeds and off.update(math.inf) and off.scale == 1.0
        assert loss_scale.checkpoint_state(off) is None and off.report() == {}


def test_checkpoint_state_round_trips_through_meta_json():
    prec = PrecisionConfig(use_mixed_precision=True, loss_scale_growth_interval=4)
    scaler = loss_scale.from_config(prec, None)
    for norm in (1.0, math.inf, 1.0, 2.0):
        scaler.update(norm)
    meta = json.loads(json.dumps({loss_scale.META_KEY: loss_scale.checkpoint_state(scaler)}))
    resumed = loss_scale.from_config(prec, loss_scale.saved_state(meta))
    assert resumed == scaler
    assert loss_scale.from_config(prec, loss_scale.saved_state({})).scale == prec.initial_loss_scale


def test_the_configs_default_fp32_ops_are_the_autocast_pass_default():
    from ortflow.graph.precision.autocast import DEFAULT_FP32_OPS

    assert PrecisionConfig().fp32_ops == DEFAULT_FP32_OPS  # config.py imports nothing from ortflow: kept in step here
