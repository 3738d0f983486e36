"""TensorBoard event files that ortflow frames itself (ortflow/trainer/event_records.py) read back with TensorBoard's
own reader, checksums included."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.backend.event_processing.event_file_loader import RawEventFileLoader
from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import masked_crc32c as tensorboard_masked_crc32c

from ortflow.trainer.event_records import crc32c, masked_crc32c
from ortflow.trainer.metrics import TensorBoardLog


def test_crc32c_is_castagnolis_and_masked_as_tensorboard_masks_it():
    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    rng = np.random.default_rng(0)
    for size in (0, 1, 8, 255, 4099):
        data = rng.integers(0, 256, size, dtype=np.uint8).tobytes()
        assert masked_crc32c(data) == tensorboard_masked_crc32c(data), size


def test_scalars_and_histograms_read_back_with_tensorboards_reader_from_files_of_their_own(tmp_path):
    first = TensorBoardLog(tmp_path, ("train/loss",), ("w*",))
    first.scalars(1, {"train/loss": 2.5, "other": 1.0})
    first.histograms(1, {"w1": np.arange(12, dtype=np.float32), "bias": np.ones(3, np.float32)})
    first.close()
    second = TensorBoardLog(tmp_path, ("train/loss",), ())  # the same second, the same process: another file
    second.scalars(2, {"train/loss": 1.5})
    second.close()
    files = sorted(tmp_path.glob("events.out.tfevents.*"))
    assert len(files) == 2
    # The raw loader checks each record's length and payload checksums as it reads.
    assert [len(list(RawEventFileLoader(str(f)).Load())) for f in files] == [3, 2]  # version event first
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    assert [(s.step, s.value) for s in events.Scalars("train/loss")] == [(1, 2.5), (2, 1.5)]
    assert events.Tags()["histograms"] == ["params/w1"]
    assert events.Histograms("params/w1")[0].histogram_value.max == 11.0


def test_a_folder_that_takes_no_event_file_is_a_refusal_naming_the_field_not_a_traceback():
    # rank 0 turns a ValueError into one line naming the problem; a raw PermissionError printed a traceback. Without an
    # OSError as its cause the rank reports it as a refusal, which the flow does not retry: permissions do not heal.
    with pytest.raises(ValueError, match=r"^tensorboard.log_dir: cannot write an event file in /sys/kernel \(") as err:
        TensorBoardLog(Path("/sys/kernel"), ("train/loss",), ())
    assert err.value.__cause__ is None
