"""The bounded fault-injection set for CI: a few trials of each kind, each asserting its property.

The long campaign (``make faults``, tests/faults/campaign.py) runs the same trials many times and records figures.
"""

from __future__ import annotations

import random
import signal

import pytest

from tests.faults import trials
from tests.faults import trials_files as files

# Every test takes signal_trials, so the stop-signal jobs start with the module's first test and run beside it.
pytestmark = [pytest.mark.mpi, pytest.mark.faults, pytest.mark.usefixtures("signal_trials")]

#: The kill and concurrency trials here train runs of this many updates (the campaign's are longer): room for three
#: kills at random steps, each resumed.
STEPS = 60


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return tmp_path_factory.mktemp("faults")


@pytest.fixture(scope="module")
def reference(root):
    return trials.reference_parameters(root, STEPS)


SIGNAL_TEST = "test_a_stop_signal_stops_every_rank_at_one_update_with_a_checkpoint"


@pytest.fixture(scope="module")
def signal_trials(request, root):
    """The stop-signal trials of this module's selected tests, started at once in threads (their runs configured
    here first: configure is not thread-safe): their jobs train and stop beside the tests that run meanwhile, with
    30 s of grace for the stop. Maps ``(target, signal)`` to the future of the trial's outcome."""
    from concurrent.futures import ThreadPoolExecutor

    chosen = [item.callspec.params for item in request.session.items
              if getattr(item, "module", None) is request.module and item.originalname == SIGNAL_TEST]  # fmt: skip
    runs = {(p["target"], p["sig"]): trials.signal_run(root, f"stop-{p['target']}-{p['sig']}") for p in chosen}
    with ThreadPoolExecutor(max(1, len(runs)), thread_name_prefix="signal-trial") as pool:
        yield {(target, sig): pool.submit(trials.signal_trial, root, target, sig, f"stop-{target}-{sig}", cfg)
               for (target, sig), cfg in runs.items()}  # fmt: skip


def alone(signal_trials: dict) -> None:
    """Wait for the stop-signal jobs to end: the orphan and hang trials time how fast ranks react (to a dead launcher,
    a stopped rank) and run with no job beside them."""
    for future in signal_trials.values():
        future.exception()


def check(outcome: trials.Outcome) -> None:
    assert outcome.ok, f"{outcome.category}: {outcome.detail}"


def test_a_kill_inside_checkpointing_then_of_a_random_rank_then_of_the_cli_each_resume_bit_identical(root, reference):
    check(trials.chained_kill_trial(root, reference, random.Random("chain"), "kill-chain", STEPS))


# A signal to `ortflow train` alone (given twice, then repeated): test_stops.py asserts the same there.
@pytest.mark.parametrize("target, sig", [("all", signal.SIGTERM), ("all", signal.SIGINT)])
def test_a_stop_signal_stops_every_rank_at_one_update_with_a_checkpoint(signal_trials, target, sig):
    check(signal_trials[target, sig].result(timeout=300))


@pytest.mark.parametrize("target", ["cli", "proxy"])
def test_ranks_exit_within_two_seconds_of_their_launcher(root, signal_trials, target):
    alone(signal_trials)
    check(trials.orphan_trial(root, target, f"orphan-{target}"))


@pytest.mark.parametrize("victim, inside", [(1, True)])
def test_a_sigstopped_rank_is_named_and_the_job_aborted_in_time(root, signal_trials, victim, inside):
    alone(signal_trials)
    check(trials.hang_trial(root, victim, inside, f"hang-{victim}-{inside}"))


@pytest.mark.parametrize("mode", ["flip", "truncate"])
@pytest.mark.parametrize("kind", list(files.FILE_KINDS))
def test_a_damaged_file_is_detected_and_named(root, kind, mode):
    for seed in range(2):
        check(files.corruption_trial(root, kind, mode, random.Random(f"{kind}{mode}{seed}")))


def test_a_full_disk_fails_the_job_cleanly_and_keeps_the_earlier_checkpoint(root):
    mount = root / "tmpfs"
    if not files.tmpfs(mount):
        pytest.skip("needs root to mount a small tmpfs (the disk-full trial)")
    try:
        check(files.disk_full_trial(root, mount))
    finally:
        files.untmpfs(mount)


def test_concurrent_runs_on_one_folder_end_sound(root, reference):
    check(files.concurrent_trial(root, reference, "concurrent", STEPS))


def test_fuzzed_configs_give_messages_never_crashes(root):
    base = trials.fresh_run(root, "fuzzbase").model_dump(mode="json")
    rng = random.Random(0)
    for _ in range(60):
        check(files.fuzz_config_trial(base, rng))


def test_fuzzed_models_give_messages_never_crashes(root, reference):
    rng = random.Random(1)
    for _ in range(15):
        check(files.fuzz_model_trial(root / "mlp.onnx", root, rng))


def test_fuzzed_data_is_refused_or_sound(root, reference):
    rng = random.Random(2)
    for i in range(3):
        check(files.fuzz_data_trial(root, rng, f"fuzzdata-{i}"))


def test_campaign_report_names_the_commit_and_what_a_survivor_of_each_category_showed():
    from tests.faults.campaign import markdown

    record = {"started": "2026-01-01T00:00:00Z", "minutes": 1.0, "command": "make faults", "commit": "abc1234",
              "machine": "m", "trials": 3, "survived": 2, "failed": 1,
              "by_category": {"stopped-launcher": {"group": "stalled", "trials": 2, "survived": 2, "failed": 0,
                                                   "failures": [],
                                                   "example": "ranks gone 5.1 s after the stop, 'mpiexec' named"},
                              "flip-meta": {"group": "integrity", "trials": 1, "survived": 0, "failed": 1,
                                            "failures": [{"detail": "bit 3 | NOT detected", "owner": ""}]}}}
    text = markdown(record)
    assert "Commit: abc1234" in text
    assert "| stalled | stopped-launcher | 2 | 2 | 0 |  | ranks gone 5.1 s after the stop, 'mpiexec' named |" in text
    assert "| integrity | flip-meta | 1 | 0 | 1 | this suite |  |" in text
    assert "- flip-meta: bit 3 | NOT detected" in text
