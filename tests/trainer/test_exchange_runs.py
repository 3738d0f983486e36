"""The exchange's memory runs (ortflow.trainer.comm.memory_runs): which gradients are reduced together, in place."""

import numpy as np
import pytest

from ortflow.trainer.comm.memory_runs import RunPlan, common_runs, local_runs, plan_key, run_view, split_runs


def _carve(order: list[int], sizes: list[int], gap_after: set[int] = frozenset()) -> list[np.ndarray]:
    """Gradients as views of one arena, laid out in ``order``, with a 16-value gap after the indices in gap_after."""
    arena = np.zeros(sum(sizes) + 16 * len(sizes), np.float32)
    grads: list = [None] * len(sizes)
    at = 0
    for i in order:
        grads[i] = arena[at : at + sizes[i]].reshape(sizes[i], 1)
        at += sizes[i] + (16 if i in gap_after else 0)
    return grads


def _addresses(grads):
    return [g.__array_interface__["data"][0] for g in grads]


def test_local_runs_follow_addresses_and_break_at_gaps():
    sizes = [4, 8, 2, 6]
    grads = _carve([2, 0, 3, 1], sizes, gap_after={3})
    assert local_runs(_addresses(grads), sizes) == [[2, 0, 3], [1]]


def test_local_runs_leave_out_empty_gradients():
    sizes = [4, 0, 3]
    grads = _carve([0, 1, 2], sizes)
    assert local_runs(_addresses(grads), sizes) == [[0, 2]]


def test_common_runs_cut_where_any_rank_differs():
    rank0 = [[0, 1, 2, 3], [4, 5]]
    rank1 = [[0, 1], [2, 3, 4, 5]]  # 1 -> 2 and 3 -> 4 not adjacent here; 4 -> 5 adjacent on both
    assert common_runs([rank0, rank1]) == [[0, 1], [2, 3], [4, 5]]
    assert common_runs([rank0, [[1, 0, 2, 3, 4, 5]]]) == [[0], [1], [2, 3], [4, 5]]  # order matters too
    assert common_runs([rank0, rank0]) == rank0


def test_split_runs_packs_the_small_ones():
    sizes = [10, 10, 5, 100]
    large, small = split_runs([[0, 1], [2], [3]], sizes, min_values=20)
    assert large == [[0, 1], [3]] and small == [2]


def test_run_view_writes_through_to_every_gradient_of_the_run():
    sizes = [3, 5, 2]
    grads = _carve([0, 1, 2], sizes)
    view = run_view(grads[0], sum(sizes))
    view[:] = np.arange(10, dtype=np.float32)
    np.testing.assert_array_equal(grads[1].reshape(-1), [3, 4, 5, 6, 7])
    np.testing.assert_array_equal(grads[2].reshape(-1), [8, 9])


def test_run_plan_packs_small_runs_with_the_scalars_and_drains_them_scaled():
    sizes = [40, 30, 3, 2]
    grads = _carve([0, 1, 2, 3], sizes, gap_after={1, 2})  # runs [0, 1], [2], [3]
    for i, g in enumerate(grads):
        g[...] = i + 1
    plan = RunPlan(grads, 2, allgather=lambda mine: [mine], min_values=10)
    assert [v.size for v in plan.views] == [70] and plan.small == [2, 3]
    scalars = np.array([5.0, 1.0], np.float32)
    plan.fill(scalars)
    np.testing.assert_array_equal(plan.pack, [3, 3, 3, 4, 4, 5, 1])
    plan.pack *= 2  # as a sum over two identical ranks
    plan.drain(scalars, np.float32(0.5))
    np.testing.assert_array_equal(grads[2].reshape(-1), [3, 3, 3])
    np.testing.assert_array_equal(grads[3].reshape(-1), [4, 4])
    np.testing.assert_array_equal(scalars, [10.0, 2.0])
    assert plan.key == plan_key(grads, 2) and plan.key != plan_key([g.copy() for g in grads], 2)


def test_run_plan_refuses_a_non_contiguous_gradient():
    grads = [np.zeros((4, 4), np.float32)[:, :2]]
    with pytest.raises(TypeError, match="not contiguous"):
        RunPlan(grads, 2, allgather=lambda mine: [mine])


def test_run_plan_keeps_the_arrays_of_its_key_alive():
    # The key is the gradients' identities: the plan must hold the arrays themselves (views of them are not enough),
    # or a new array could take a freed one's identity and be matched to a stale plan.
    import gc
    import weakref

    grads = _carve([0, 1], [30, 20])
    refs = [weakref.ref(g) for g in grads]
    plan = RunPlan(grads, 2, allgather=lambda mine: [mine], min_values=10)
    del grads
    gc.collect()
    assert all(r() is not None for r in refs) and plan.key == plan_key([r() for r in refs], 2)
