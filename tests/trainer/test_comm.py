"""Single-process collectives, heartbeats and the collective watchdog (no MPI needed)."""

import threading
import time

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


def test_a_silent_rank_inside_the_same_collective_is_named_a_live_one_is_not(tmp_path):
    beats = [Heartbeats(tmp_path, rank, 3) for rank in range(3)]
    for beat in beats:
        beat.write(7, "gradient all-reduce")  # everyone entered the same collective
    now = beats[0].read(0)[1] + 30
    beats[0].beat(now - 0.5)
    beats[1].beat(now - 25)  # SIGSTOPped 25 s ago: its watchdog thread stopped beating
    beats[2].beat(now - 0.5)
    message = describe_stall(beats[0], 7, "gradient all-reduce", 30.0, now=now, stale_s=2.0)
    assert "rank 1 (stopped or wedged: no sign of life for 25 s, inside collective #7" in message
    assert "rank 2" not in message and "rank 0" not in message and "none found" not in message


def test_the_watchdog_thread_beats_while_the_rank_waits(tmp_path):
    beats = Heartbeats(tmp_path, 0, 1)
    dog = Watchdog(10.0, beats, lambda msg: None)
    try:
        first = beats.last_beat(0)
        dog.enter("barrier")  # the main thread now waits; the beat must go on without it
        time.sleep(2.5)
        assert beats.last_beat(0) > first + 1.0
    finally:
        dog.close()


def test_a_timed_out_rank_leaves_its_message_for_the_launcher(tmp_path):
    beat = Heartbeats(tmp_path, 3, 4)
    path = beat.leave_message("ERROR: collective #2 'barrier' waited 9 s; stalled: rank 1")
    assert path.name == "stall-rank-00003.txt" and "stalled: rank 1" in path.read_text()
    Heartbeats(tmp_path, 3, 4)  # the next run of this rank removes the old message
    assert not path.exists()
