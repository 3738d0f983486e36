"""Single-process collectives, heartbeats and the collective watchdog (no MPI needed)."""

import threading

import numpy as np

from ortflow.trainer.comm import Heartbeats, SingleProcessComm, Watchdog, describe_stall, launched_by_mpi


def test_single_process_average_scales_by_divisor_in_place():
    grads = [np.full((2, 3), 4.0, np.float32), np.full(5, 2.0, np.float32)]
    views = [g.view() for g in grads]
    scalars = np.array([1.5, 0.0], np.float32)
    SingleProcessComm().average_gradients(views, 4.0, scalars)
    assert np.all(grads[0] == 1.0) and np.all(grads[1] == 0.5)  # scaled where they live
    assert scalars.tolist() == [1.5, 0.0]


def test_single_process_allreduce_and_broadcast_are_identity():
    comm = SingleProcessComm()
    assert comm.allreduce_sum(np.array([3.0, 2.0]), "x").tolist() == [3.0, 2.0]
    assert comm.broadcast({"a": 1}, "x") == {"a": 1}


def test_launched_by_mpi_detects_launcher_environment():
    assert launched_by_mpi({"PMI_RANK": "0", "PMI_SIZE": "2"})
    assert launched_by_mpi({"OMPI_COMM_WORLD_SIZE": "2"})
    assert not launched_by_mpi({"HOME": "/root"})


def test_stall_message_names_the_ranks_that_did_not_arrive(tmp_path):
    beats = [Heartbeats(tmp_path, rank, 3) for rank in range(3)]
    beats[0].write(7, "gradient all-reduce")
    beats[1].write(6, "eval loss")  # behind: still in collective #6
    beats[2].write(7, "gradient all-reduce")
    message = describe_stall(beats[0], 7, "gradient all-reduce", 30.0, now=beats[0].read(1)[1] + 40)
    assert "rank 1" in message and "'eval loss'" in message and "40 s ago" in message
    assert "rank 2" not in message and "rank 0" not in message


def test_stall_message_names_a_rank_that_never_started(tmp_path):
    beat = Heartbeats(tmp_path, 0, 2)
    beat.write(1, "choose checkpoint")
    assert "rank 1 (no heartbeat" in describe_stall(beat, 1, "choose checkpoint", 5.0, now=0.0)


def test_watchdog_fires_only_when_a_collective_overruns(tmp_path):
    now = [0.0]
    fired = threading.Event()
    messages = []

    def on_timeout(msg):
        messages.append(msg)
        fired.set()

    dog = Watchdog(1.0, Heartbeats(tmp_path, 0, 1), on_timeout, clock=lambda: now[0])
    try:
        dog.enter("gradient all-reduce")
        now[0] = 0.5
        assert not fired.wait(0.3)  # within the timeout: quiet
        dog.leave()
        now[0] = 10.0
        assert not fired.wait(0.3)  # outside any collective: quiet
        dog.enter("eval loss")
        now[0] = 12.0
        assert fired.wait(2.0)
        assert "collective #2 'eval loss'" in messages[0]
    finally:
        dog.close()
