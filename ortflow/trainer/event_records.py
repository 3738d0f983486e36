"""TensorBoard event files written without TensorBoard's writer: its import (the summary plugins, TensorFlow's stubs,
fsspec) costs rank 0 about a quarter of a second of CPU at start, for a few framed records per update.

An event file is a sequence of records (TFRecord framing): the payload's length as a little-endian uint64, the masked
CRC-32C of those 8 bytes, the payload (a serialised ``tensorboard.compat.proto.event_pb2.Event``), and the masked
CRC-32C of the payload. The first event names the file version (``brain.Event:2``), as TensorBoard's
``EventFileWriter`` writes it; readers (TensorBoard, ``RawEventFileLoader``) check both checksums.
"""

from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from pathlib import Path
from typing import BinaryIO

_CRC32C_POLY = 0x82F63B78  # Castagnoli, reflected
_TABLE: list[int] = []
_FILES = itertools.count()  # the last part of a file's name: files opened in one second by one process differ


def _table() -> list[int]:
    if not _TABLE:
        for byte in range(256):
            crc = byte
            for _ in range(8):
                crc = (crc >> 1) ^ _CRC32C_POLY if crc & 1 else crc >> 1
            _TABLE.append(crc)
    return _TABLE


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli) of ``data``."""
    table, crc = _table(), 0xFFFFFFFF
    for byte in data:
        crc = table[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def masked_crc32c(data: bytes) -> int:
    """The CRC as TFRecord stores it: rotated right by 15 bits plus a constant."""
    crc = crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def write_record(stream: BinaryIO, payload: bytes) -> None:
    """Append one framed record to ``stream``."""
    header = struct.pack("<Q", len(payload))
    stream.write(header + struct.pack("<I", masked_crc32c(header)))
    stream.write(payload + struct.pack("<I", masked_crc32c(payload)))


class EventFile:
    """A new event file in ``log_dir``, named as TensorBoard's writer names its files, opened with the version event.

    Args:
        log_dir: The run's TensorBoard folder (created if missing).
    """

    def __init__(self, log_dir: Path | str):
        from tensorboard.compat.proto import event_pb2  # the protos alone: a few hundredths of a second

        self._event_pb2 = event_pb2
        log_dir = Path(log_dir)
        log_dir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(_FILES)}"
        self.path = log_dir / name
        self._file = self.path.open("wb")
        version = event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2",
                                  source_metadata=event_pb2.SourceMetadata(writer="ortflow"))
        write_record(self._file, version.SerializeToString())
        self.flush()

    def add_event(self, event) -> None:
        """Append an ``event_pb2.Event`` (written to disk at the next :meth:`flush` or :meth:`close`)."""
        write_record(self._file, event.SerializeToString())

    def flush(self) -> None:
        """Hand what was written to the operating system (TensorBoard reads the file while it grows)."""
        self._file.flush()

    def close(self) -> None:
        """Flush and close the file."""
        self._file.close()
