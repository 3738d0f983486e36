"""Tensor parallelism for real: a 2-layer GPT split over 2 ranks (``mpiexec -n 2``) and 2 x 2 (``-n 4``), trained,
killed and resumed, merged, exported and warm-started."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from ortflow.checkpoints import list_complete
from ortflow.checkpoints.h5state import read_params
from ortflow.checkpoints.tp import tp_file
from tests.support.parallel_runs import (
    EVERY,
    SEQ,
    assert_export_equals_eval_graph,
    gpt_run,
    h5_arrays,
    initial_parameters,
    kill_after_first_checkpoint,
    losses,
    newest,
)
from tests.support.runs import (
    copied_run,
    named_past_the_check,
    run_ranks,
    run_ranks_together,
    start_ranks,
    start_script_ranks,
)

pytestmark = pytest.mark.mpi

# The split changes where fp32 sums are rounded: a row-split MatMul's tp partial products are added after the local
# dot products (the unsplit MatMul adds all terms in one), and a split region's input gradient is summed the same way;
# each such sum differs by a few ulps. With SGD that reaches the weights as is: measured max |diff| 3.7e-9 after 4
# updates (tp 2, and tp 2 x dp 2, lr 1e-2; about one ulp of a 0.02 weight), so SGD is held to 1e-7. AdamW's step
# m / (sqrt(v) + eps) normalizes each entry: an entry whose gradient is at rounding level (~1e-7) gets a step of
# up to ~lr whatever its sign, so a few-ulp change there moves that weight by up to ~lr per update. Measured max
# |diff| 4.0e-5 (h1.mlp.proj.weight) with lr 1e-3 vs a largest move of 4.0e-3; AdamW is held to 0.1 lr = 1e-4. A
# wrong split (a missing all-reduce, a bias added twice, a wrong slice) moves weights by ~lr and fails both.
ATOL = {"sgd": 1e-7, "adamw": 1e-4}
LR = {"sgd": 1e-2, "adamw": 1e-3}


def torch_run(root: Path, name: str, **sections):
    """A run on the torch-export-shaped GPT (fused QKV + Split, single-output LayerNorm, Concat head reshapes)."""
    from tests.support.gpt import torch_gpt

    model = root / "torchgpt.onnx"
    if not model.exists():
        torch_gpt(model, layers=2, width=32, heads=4, vocab=256, seq=SEQ, batch=2)
    return gpt_run(root, name, model_path=model, **sections)


def digests(output: str) -> dict[int, tuple[str, str]]:
    """rank -> (sha256 of its parameters, of its replicated parameters), at the last checkpoint."""
    found = re.findall(r"rank (\d+) parameters sha256 ([0-9a-f]{64}) \(replicated ([0-9a-f]{64})\)", output)
    return {int(rank): (whole, replicated) for rank, whole, replicated in found}


# Every run of the 2-layer GPT here checkpoints after each update (EVERY), so the split runs also serve as the
# uninterrupted references of the kill-and-resume tests.


@pytest.fixture(scope="module")
def configured(tmp_path_factory):
    """The 2-layer GPT configured unsplit and for tp 2 (the artifacts depend on the model and the split, not on the
    ranks, optimizer or steps): each run of this module starts from a copy of one of them (``copied_run``)."""
    root = tmp_path_factory.mktemp("configured")
    return {tp: gpt_run(root, f"tp{tp}", distributed={"num_ranks": tp, "horizontal_parallel_size": tp})
            for tp in (1, 2)}


def tp_run(configured: dict, root: Path, name: str, **sections):
    """:func:`gpt_run` on a copy of the configured artifacts of its tensor-parallel size (and on its model file: the
    model's path is part of the configure fingerprint)."""
    tp = sections.get("distributed", {}).get("horizontal_parallel_size", 1)
    return copied_run(configured[tp], gpt_run, root, name, model_path=configured[tp].model.path, **sections)


@pytest.fixture(scope="module")
def hung(configured, tmp_path_factory):
    """The tp 2 job whose rank 1 hangs in its first micro-batch (fault_tensor.py), started with the module's first runs
    (:func:`trained`): it waits out its collective timeout while they train. The future of its output and the seconds
    it ran."""
    cfg = tp_run(configured, tmp_path_factory.mktemp("hang"), "hang", distributed={
        "num_ranks": 2, "horizontal_parallel_size": 2, "collective_timeout_s": 2.0})
    return start_script_ranks(cfg, str(Path(__file__).with_name("fault_tensor.py")), timeout=60)


@pytest.fixture(scope="module")
def trained(configured, tmp_path_factory, gpt_unsplit, hung):
    """The unsplit and split runs of each (tp, ranks, rule), made once for every test that asks (:func:`runs_of`);
    the one-rank AdamW run is the session's (tests/trainer/conftest.py), shared with test_pipe_tensor_mpi.py. The
    hung job starts first."""
    return {"configured": configured, "factory": tmp_path_factory, "unsplit": gpt_unsplit}


def split_sections(ranks: int, rule: str, tp: int = 2) -> dict:
    """The config sections of the split run of :func:`runs_of` (its kill-and-resume twins use the same)."""
    return {"distributed": {"num_ranks": ranks, "horizontal_parallel_size": tp}, "checkpoint": EVERY,
            "optimizer": {"name": rule, "learning_rate": LR[rule]}}


# The SGD runs start from the weights of the one-rank AdamW run's last checkpoint (a whole-model params.h5) and train
# 4 updates of a global batch of 8 (on tp 2 x dp 1 each update reads 8 samples), evals after 2 and 4: they are the
# SGD comparison, the warm-start test and the global-batch test at once.
WARM_TRAIN = {"global_batch_size": 8, "num_train_steps": 4, "gradient_accumulation_steps": 1, "evaluation_period": 2}


def warm_start(trained: dict) -> Path:
    """The checkpoint the SGD runs start from: the one-rank AdamW run's last (4 updates)."""
    whole, job = trained["unsplit"]
    assert job.result().returncode == 0, job.result().stdout
    return newest(whole)


def sections_of(trained: dict, ranks: int, rule: str, tp: int) -> dict:
    """:func:`split_sections`, from :func:`warm_start` with :data:`WARM_TRAIN` for SGD."""
    sections = split_sections(ranks, rule, tp)
    if rule == "sgd":
        sections.update(train=WARM_TRAIN, checkpoint={**EVERY, "init_from": str(warm_start(trained))})
    return sections


#: The (tp, ranks, rule) of every pair of :func:`runs_of`, in the order they start.
PAIRS = [(2, 2, "adamw"), (2, 4, "adamw"), (2, 2, "sgd")]


def runs_of(trained: dict, tp: int, ranks: int, rule: str):
    """tp 1 on ranks / tp replicas and tp ``tp`` on ``ranks`` ranks (``rule``; 4 updates, evals after 2 and 4; SGD
    from :func:`warm_start`), run to their end: (whole, split, whole's output, split's output). The first test that
    asks configures every pair of :data:`PAIRS`, each run starting to train as soon as it is configured (independent
    jobs, side by side: no assertion depends on their order or speed; the SGD pair once the run it starts from is
    done)."""
    if "jobs" not in trained:
        trained["jobs"] = {}
        for key in PAIRS:
            trained["jobs"][key] = _start_pair(trained, *key)
    key = (tp, ranks, rule)
    if key not in trained:
        (whole, job1), (split, job2) = trained["jobs"][key]
        out1, out2 = job1.result(), job2.result()
        assert out1.returncode == 0, out1.stdout
        assert out2.returncode == 0, out2.stdout
        trained[key] = whole, split, out1, out2
    return trained[key]


def _start_pair(trained: dict, tp: int, ranks: int, rule: str):
    """Configure and start the pair of :func:`runs_of`: ((whole, its job), (split, its job))."""
    root = trained["factory"].mktemp(f"tp{tp}x{ranks // tp}-{rule}")
    split = tp_run(trained["configured"], root, f"tp{tp}x{ranks // tp}", **sections_of(trained, ranks, rule, tp))
    split_job = start_ranks(split, timeout=300)
    if ranks == tp and rule == "adamw":  # the session's unsplit run: the same model, data, optimizer, checkpoints
        return trained["unsplit"], (split, split_job)
    whole = tp_run(trained["configured"], root, "tp1", **sections_of(trained, ranks // tp, rule, 1))
    return (whole, start_ranks(whole, timeout=300)), (split, split_job)


@pytest.mark.parametrize("tp,ranks,rule", [(2, 2, "adamw"), (2, 2, "sgd"), (2, 4, "adamw")])
def test_split_trains_to_the_unsplit_parameters(trained, tp, ranks, rule):
    whole, split, out1, out2 = runs_of(trained, tp, ranks, rule)
    p1, p2 = read_params(newest(whole)), read_params(newest(split))  # the split one's slices merged
    assert sorted(p1) == sorted(p2)
    worst = max(float(np.abs(p1[n] - p2[n]).max()) for n in p1)
    initial = read_params(warm_start(trained)) if rule == "sgd" else initial_parameters(whole)
    moved = max(float(np.abs(p1[n] - initial[n]).max()) for n in p1)
    print(f"tp {tp} on {ranks} ranks, {rule}: max |param diff| vs tp 1: {worst}; largest move in training {moved}")
    assert worst < ATOL[rule] and moved > 10 * ATOL[rule]  # the runs trained, and to the same place
    kept = [int(k) for k in re.findall(r"pieces \((\d+) keep their activations\)", out2.stdout)]
    assert len(kept) == ranks and min(kept) > 0  # every rank's pieces ran their forward once (all but the loss's)
    np.testing.assert_allclose(losses(out2.stdout), losses(out1.stdout), rtol=1e-5)
    evals = [[float(x) for x in re.findall(r"eval_loss ([0-9.e+-]+)", o.stdout)] for o in (out1, out2)]
    assert len(evals[1]) == 2
    np.testing.assert_allclose(evals[1], evals[0], rtol=1e-5)  # eval through the pieces
    seen = digests(out2.stdout)  # rank = replica * tp + t
    assert len(seen) == ranks and len({r for _, r in seen.values()}) == 1  # replicated: bitwise equal on every rank
    for rank in range(tp, ranks):  # each rank's slices equal its replica-0 peer's, and differ from other tp ranks'
        assert seen[rank][0] == seen[rank % tp][0]
    assert seen[0][0] != seen[1][0]


def test_a_torch_shaped_gpt_with_fused_qkv_trains_to_the_unsplit_parameters(tmp_path):
    opt = {"name": "sgd", "learning_rate": LR["sgd"]}
    whole = torch_run(tmp_path, "tp1", distributed={"num_ranks": 1}, optimizer=opt)
    split = torch_run(tmp_path, "tp2", distributed={"num_ranks": 2, "horizontal_parallel_size": 2}, optimizer=opt)
    out1, out2 = run_ranks_together(whole, split, timeout=300)
    assert out1.returncode == 0, out1.stdout
    assert out2.returncode == 0, out2.stdout
    p1, p2 = read_params(newest(whole)), read_params(newest(split))
    initial = initial_parameters(whole)
    worst = max(float(np.abs(p1[n] - p2[n]).max()) for n in p1)
    moved = max(float(np.abs(p1[n] - initial[n]).max()) for n in p1)
    print(f"torch-shaped GPT tp 2, sgd: max |param diff| vs tp 1: {worst}; largest move {moved}")
    # The bound per entry: ATOL plus 2 ulps of the entry (the split sums differ by a few ulps; one ulp of an entry
    # >= 1 is 1.19e-7, beyond an absolute 1e-7), as in test_tensor_vocab_mpi.
    over = {n: float((np.abs(p1[n] - p2[n]) - ATOL["sgd"] - 2 * np.spacing(np.abs(p1[n]))).max()) for n in p1}
    assert max(over.values()) < 0, {n: v for n, v in over.items() if v >= 0}
    assert moved > 1e3 * worst
    assert p2["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)  # merged back from the per-part slices


@pytest.fixture(scope="module")
def straight(trained):
    """The finished tp 2 run on 2 ranks (AdamW, 4 updates, a checkpoint after each), shared by the merge/export test
    (its last checkpoint) and the resharding test (its step-2 one)."""
    return runs_of(trained, 2, 2, "adamw")[1]


# As 2 replicas of tp 2: replica 0's two tensor-parallel ranks write and every rank reads the files a tp 2 run on 2
# ranks writes and reads (the same file names, asserted below), and the replicas resume alike.
@pytest.mark.parametrize("ranks", [4], ids=["tp2xdp2"])
def test_kill_and_resume_is_bitwise_identical(trained, ranks):
    """A tp 2 run (as 2 replicas on 4 ranks) killed after its first checkpoint resumes from it and ends with every
    tensor-parallel rank's files bitwise those of the uninterrupted run (:func:`runs_of`)."""
    straight = runs_of(trained, 2, ranks, "adamw")[1]
    resumed = tp_run(trained["configured"], straight.output_dir.parent, "resumed", **split_sections(ranks, "adamw"))
    done = kill_after_first_checkpoint(resumed, wait_s=180)
    assert done and done[-1] < 4, done
    out = run_ranks(resumed, timeout=300)
    assert out.returncode == 0, out.stdout
    assert f"starting from step {done[-1]}" in out.stdout
    folder = newest(resumed)
    assert {f.name for f in folder.iterdir()} == {"meta.json"} | {tp_file(k, t, 2) for k in ("params", "optimizer")
                                                                  for t in range(2)}
    for kind in ("params", "optimizer"):  # every tensor-parallel rank's own files, bit for bit
        for t in range(2):
            assert h5_arrays(newest(straight) / tp_file(kind, t, 2)) == h5_arrays(folder / tp_file(kind, t, 2))


def test_slices_merge_into_whole_tensors_and_export_equals_the_unsplit_eval_graph(tmp_path, straight):
    import h5py

    from ortflow.checkpoints.tools import merge
    from ortflow.export.model import export_model

    split = straight
    folder = newest(split)  # step 4
    with h5py.File(folder / tp_file("params", 1, 2), "r") as f:  # rank 1 holds half of a split weight
        q = next(ds for ds in f["parameters"].values() if ds.attrs["name"] == "h0.attn.q.weight")
        assert q.shape == (32, 16) and q.attrs["tp_axis"] == 1
    params = read_params(folder)
    assert params["h0.attn.q.weight"].shape == (32, 32) and params["h0.mlp.proj.weight"].shape == (128, 32)
    merged = merge(folder, tmp_path / "merged.h5")
    assert merged.step == 4
    with h5py.File(tmp_path / "merged.h5", "r") as f:
        whole = {ds.attrs["name"]: ds[()] for ds in f["parameters"].values()}
        moments = {ds.attrs["name"]: ds[()] for ds in f["optimizer"]["exp_avg"].values()}
    assert all(np.array_equal(whole[n], params[n]) for n in params)
    assert moments["h0.mlp.fc.weight"].shape == (32, 128) and np.abs(moments["h0.mlp.fc.weight"]).max() > 0
    out = tmp_path / "model.onnx"
    result = export_model(split.output_dir, out, config=split)
    assert max(result.verification.max_abs_diff.values()) <= 1e-5
    # Independently: the exported model equals the unsplit eval graph fed with the merged trained parameters.
    assert_export_equals_eval_graph(split, out, params)
    initial = initial_parameters(split)
    assert any(not np.array_equal(initial[n], params[n]) for n in params)  # trained, not the initial weights


def test_an_unsplit_run_resumes_the_merged_slices_and_a_split_run_refuses_another_size(tmp_path, configured,
                                                                                       straight):
    folder = next(c.path for c in list_complete(straight.checkpoints_dir) if c.step == 2)
    whole = tp_run(configured, tmp_path, "tp1", distributed={"num_ranks": 1},
                   train={"num_train_steps": 8, "evaluation_period": 0},
                   checkpoint={"checkpoint_to_load_path": str(folder)})
    out = run_ranks(whole)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "starting from step 2" in out.stdout  # params and AdamW moments merged from both ranks' files
    back = named_past_the_check(
        tp_run(configured, tmp_path, "tp2again", distributed={"num_ranks": 2, "horizontal_parallel_size": 2},
               train={"num_train_steps": 12, "evaluation_period": 0}),
        newest(whole), "was written with distributed.horizontal_parallel_size 1 but this run has 2")
    out = run_ranks(back)
    assert out.returncode != 0
    assert "was written with distributed.horizontal_parallel_size 1 but this run has 2" in out.stdout, \
        out.stdout[-3000:]
    # The way out names this config's own fix: the same checkpoint as a warm start, its weights sliced for tp 2.
    assert f"checkpoint.init_from: {newest(whole)} in place of checkpoint.checkpoint_to_load_path" in out.stdout


def test_a_warm_start_from_a_whole_model_checkpoint_slices_its_weights(trained):
    """The SGD runs of :func:`runs_of` start from a whole-model checkpoint (:func:`warm_start`): the tp 2 run slices
    its weights, trains on from them and ends where the unsplit run does."""
    whole, split, _, out2 = runs_of(trained, 2, 2, "sgd")
    assert "starting from the weights of" in out2.stdout
    p1, p2 = read_params(newest(whole)), read_params(newest(split))
    reference = read_params(warm_start(trained))  # the weights both started from
    assert max(float(np.abs(p1[n] - p2[n]).max()) for n in p1) < ATOL["sgd"]
    assert max(float(np.abs(p1[n] - reference[n]).max()) for n in p1) > 1e3 * ATOL["sgd"]  # it trained on from there


def test_a_global_batch_is_split_over_the_replicas_not_the_tensor_parallel_ranks(trained):
    split = runs_of(trained, 2, 2, "sgd")[1]  # global batch 8 on tp 2 x dp 1, 4 updates
    info = list_complete(split.checkpoints_dir)[-1]
    assert info.step == 4 and info.meta["global_cursor"] == info.step * 8, info.meta


def test_a_hung_tensor_parallel_rank_is_named_when_its_peer_times_out(hung):
    out, seconds = hung.result()
    assert out.returncode != 0
    assert "'tensor-parallel activation sum' waited" in out.stdout, out.stdout[-3000:]
    assert "stalled: rank 1" in out.stdout, out.stdout[-3000:]
    assert seconds < 40


def test_pieces_recorded_without_their_partial_sends_are_refused_naming_configure(tmp_path, configured):
    """A ``tensor.json`` whose pieces do not say which sends are partial sums (each replicated level a piece of its
    own) is refused by the ranks before they train, naming the fix (configure's fingerprint names the cut)."""
    import json

    cfg = tp_run(configured, tmp_path, "stale", distributed={"num_ranks": 2, "horizontal_parallel_size": 2})
    path = cfg.artifacts_dir / "tensor" / "tensor.json"
    record = json.loads(path.read_text())
    for info in record["pieces"]:
        del info["partial_sends"], info["replicated_parameters"]
    path.write_text(json.dumps(record))
    out = run_ranks(cfg)
    assert out.returncode != 0
    assert "without partial_sends in their record" in out.stdout and "re-run `ortflow configure`" in out.stdout, \
        out.stdout[-3000:]
    assert "Traceback" not in out.stdout  # the rank's own error: one line, no traceback
    assert not list_complete(cfg.checkpoints_dir)
