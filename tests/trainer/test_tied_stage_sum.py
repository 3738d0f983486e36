"""The sum of a tied weight's gradients over pipeline stages (parallel/schedule.py ``sum_across_stages``), with two
stages as two threads: every holder ends with the sum in stage order, and on GPU ranks the host copies travel over the
process group, never over the GPU's point-to-point links (where two holders that both send first wait forever for
each other's receive: NCCL queues a send and the receive after it on one stream)."""

from __future__ import annotations

import queue
import threading

import numpy as np

from ortflow.trainer.parallel.schedule import sum_across_stages


class HostLink:
    """The process group of two stages in one process: sends do not wait for their receiver, as MPI's Isend."""

    def __init__(self, boxes: dict, rank: int):
        self.boxes, self.rank, self.sent = boxes, rank, 0

    @property
    def host(self):
        return self

    def send(self, array, dest, tag):
        self.boxes[(self.rank, dest, tag)].put(np.array(array, copy=True))
        self.sent += 1

    def recv(self, source, tag, label):
        return self.boxes[(source, self.rank, tag)].get(timeout=10)

    def wait_sends(self, label):
        pass

    def copy_to_host(self, buffer):
        return np.array(buffer, copy=True)

    def copy_from_host(self, buffer, values):
        buffer[...] = values


class Buffer:
    """A device buffer: only the communicator's copies reach its values."""

    def __init__(self, values):
        self.values = np.array(values, dtype=np.float32)


class GPULink:
    """A GPU pipeline group: copies device buffers to and from the host; its own send and receive are NCCL's."""

    def __init__(self, host: HostLink):
        self._host = host

    @property
    def host(self):
        return self._host

    def send(self, array, dest, tag):
        raise AssertionError("a tied gradient went over the GPU point-to-point link")

    recv = send

    def copy_to_host(self, buffer):
        return buffer.values.copy()

    def copy_from_host(self, buffer, values):
        buffer.values[...] = values


def _two_stages(make_link, make_buffer):
    boxes = {(a, b, t): queue.Queue() for a in (0, 1) for b in (0, 1) for t in range(8)}
    rng = np.random.default_rng(0)
    grads = [{"wte": make_buffer(rng.normal(size=6)), "pos": make_buffer(rng.normal(size=3))} for _ in (0, 1)]
    shared = {"wte": [0, 1], "pos": [0, 1]}
    expected = {name: grads[0][name] + grads[1][name] if isinstance(grads[0][name], np.ndarray)
                else grads[0][name].values + grads[1][name].values for name in shared}  # fmt: skip
    links = [make_link(HostLink(boxes, stage)) for stage in (0, 1)]
    errors = []

    def run(stage):
        try:
            sum_across_stages(links[stage], stage, shared, grads[stage].__getitem__)
        except BaseException as err:  # noqa: BLE001 - reported by the test
            errors.append(err)

    threads = [threading.Thread(target=run, args=(stage,)) for stage in (0, 1)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=20)
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads)
    return grads, expected, links


def test_host_holders_end_with_the_stage_order_sum():
    grads, expected, _ = _two_stages(lambda host: host, lambda v: np.array(v, dtype=np.float32))
    for stage in (0, 1):
        for name, total in expected.items():
            np.testing.assert_array_equal(grads[stage][name], total)


def test_gpu_holders_send_their_host_copies_over_the_process_group():
    grads, expected, links = _two_stages(GPULink, Buffer)
    for stage in (0, 1):
        for name, total in expected.items():
            np.testing.assert_array_equal(grads[stage][name].values, total)
        assert links[stage].host.sent == 2  # one host copy of each tied gradient to the other stage
