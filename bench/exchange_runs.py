"""Exchange contenders over the engine's memory runs (ortflow.trainer.comm.memory_runs), for bench/bench_exchange.py.

* ``posted-tensors``: the exchange before this one (one in-place collective per gradient of >= 16k values);
* ``runs-posted``: every large run all-reduced in place by its own ``Iallreduce``, the small runs and the scalars
  packed into one more, all posted before one wait; then one pass of the 1/N scale;
* ``runs-blocking``: the same collectives one after the other, blocking, each run scaled right after its reduction
  (while it is still in cache);
* ``runs-rsag``: each large run as an in-place ``Ireduce_scatter_block`` (all posted, one wait), this rank's block
  scaled by 1/N on its way to its place (a pass over 1/N of the bytes), then in-place ``Iallgather`` (all posted, one
  wait); values past the last whole block ride in the packed buffer;
* ``hindexed``: one ``Allreduce`` over an ``MPI.Create_hindexed`` datatype of the runs' absolute addresses
  (``MPI.BOTTOM``), then the scale; recorded as failed when the MPI library refuses it.
"""

from __future__ import annotations

import numpy as np

from ortflow.trainer.comm.memory_runs import common_runs, local_runs, run_view, split_runs


class RunPlan:
    """The runs every rank agrees on, their in-place views, and the packed buffer (small runs + scalars)."""

    def __init__(self, world, grads, num_scalars: int, tails: bool = False):
        sizes = [g.size for g in grads]
        mine = local_runs([g.__array_interface__["data"][0] for g in grads], sizes)
        large, self.small = split_runs(common_runs(world.allgather(mine)), sizes)
        self.views = [run_view(grads[r[0]], sum(sizes[i] for i in r)) for r in large]
        self.flats = [g.reshape(-1) for g in grads]
        self.size = world.Get_size()
        # rsag: each view's whole blocks go through reduce-scatter/all-gather; the rest (< size values) is packed
        self.tails = [v.size % self.size for v in self.views] if tails else [0] * len(self.views)
        small_values = sum(sizes[i] for i in self.small) + sum(self.tails)
        self.pack = np.empty(small_values + num_scalars, np.float32)

    def fill(self, scalars):
        at = 0
        for i in self.small:
            self.pack[at : at + self.flats[i].size] = self.flats[i]
            at += self.flats[i].size
        for view, tail in zip(self.views, self.tails, strict=True):
            if tail:
                self.pack[at : at + tail] = view[view.size - tail :]
                at += tail
        self.pack[at:] = scalars

    def drain(self, scalars, scale):
        at = 0
        for i in self.small:
            np.multiply(self.pack[at : at + self.flats[i].size], scale, out=self.flats[i])
            at += self.flats[i].size
        for view, tail in zip(self.views, self.tails, strict=True):
            if tail:
                np.multiply(self.pack[at : at + tail], scale, out=view[view.size - tail :])
                at += tail
        scalars[:] = self.pack[at:]


class RunsPosted:
    def __init__(self, mpi, world, grads, num_scalars):
        self.mpi, self.world, self.plan = mpi, world, RunPlan(world, grads, num_scalars)

    def __call__(self, grads, divisor, scalars):
        mpi, plan = self.mpi, self.plan
        plan.fill(scalars)
        requests = [self.world.Iallreduce(mpi.IN_PLACE, plan.pack, op=mpi.SUM)]
        requests += [self.world.Iallreduce(mpi.IN_PLACE, v, op=mpi.SUM) for v in plan.views]
        mpi.Request.Waitall(requests)
        scale = np.float32(1.0 / divisor)
        for v in plan.views:
            np.multiply(v, scale, out=v)
        plan.drain(scalars, scale)


class RunsBlocking:
    def __init__(self, mpi, world, grads, num_scalars):
        self.mpi, self.world, self.plan = mpi, world, RunPlan(world, grads, num_scalars)

    def __call__(self, grads, divisor, scalars):
        mpi, plan, scale = self.mpi, self.plan, np.float32(1.0 / divisor)
        for v in plan.views:
            self.world.Allreduce(mpi.IN_PLACE, v, op=mpi.SUM)
            np.multiply(v, scale, out=v)
        plan.fill(scalars)
        self.world.Allreduce(mpi.IN_PLACE, plan.pack, op=mpi.SUM)
        plan.drain(scalars, scale)


class RunsRSAG:
    def __init__(self, mpi, world, grads, num_scalars):
        self.mpi, self.world = mpi, world
        self.plan = RunPlan(world, grads, num_scalars, tails=True)
        self.rank, self.size = world.Get_rank(), world.Get_size()
        self.blocks = [v[: v.size - t] for v, t in zip(self.plan.views, self.plan.tails, strict=True)]

    def __call__(self, grads, divisor, scalars):
        mpi, plan, world = self.mpi, self.plan, self.world
        plan.fill(scalars)
        requests = [world.Iallreduce(mpi.IN_PLACE, plan.pack, op=mpi.SUM)]
        requests += [world.Ireduce_scatter_block(mpi.IN_PLACE, b, op=mpi.SUM) for b in self.blocks]
        mpi.Request.Waitall(requests)
        scale, r = np.float32(1.0 / divisor), self.rank
        for b in self.blocks:  # this rank's sum sits at the front of the buffer; its place is block r
            c = b.size // self.size
            np.multiply(b[:c], scale, out=b[r * c : (r + 1) * c])
        requests = [world.Iallgather(mpi.IN_PLACE, b) for b in self.blocks]
        plan.drain(scalars, scale)
        mpi.Request.Waitall(requests)


class RunsAny(RunsPosted):
    """runs-posted, each run scaled as soon as its reduction completes (Waitany), while the others progress."""

    def __call__(self, grads, divisor, scalars):
        mpi, plan = self.mpi, self.plan
        plan.fill(scalars)
        requests = [self.world.Iallreduce(mpi.IN_PLACE, v, op=mpi.SUM) for v in plan.views]
        requests.append(self.world.Iallreduce(mpi.IN_PLACE, plan.pack, op=mpi.SUM))
        scale = np.float32(1.0 / divisor)
        for _ in range(len(requests)):
            i = mpi.Request.Waitany(requests)
            if i < len(plan.views):
                np.multiply(plan.views[i], scale, out=plan.views[i])
            else:
                plan.drain(scalars, scale)


class RunsRSAGBlocking(RunsRSAG):
    """Run by run, blocking: reduce-scatter into a scratch block, scale it into its place, all-gather in place."""

    def __init__(self, mpi, world, grads, num_scalars):
        super().__init__(mpi, world, grads, num_scalars)
        self.scratch = np.empty(max((b.size // self.size for b in self.blocks), default=0), np.float32)

    def __call__(self, grads, divisor, scalars):
        mpi, plan, world = self.mpi, self.plan, self.world
        scale, r = np.float32(1.0 / divisor), self.rank
        for b in self.blocks:
            c = b.size // self.size
            world.Reduce_scatter_block(b, self.scratch[:c], op=mpi.SUM)
            np.multiply(self.scratch[:c], scale, out=b[r * c : (r + 1) * c])
            world.Allgather(mpi.IN_PLACE, b)
        plan.fill(scalars)
        world.Allreduce(mpi.IN_PLACE, plan.pack, op=mpi.SUM)
        plan.drain(scalars, scale)


class PostedTensors:
    """The exchange before the memory runs (until 2026-11-23 06:20 UTC): gradients of >= 16k values all-reduced in
    place one collective each, the small ones and the scalars packed, all posted at once, then the scale."""

    def __init__(self, mpi, world, grads, num_scalars):
        self.mpi, self.world = mpi, world
        self.large = [g.reshape(-1) for g in grads if g.size >= 16384]
        self.small = [g.reshape(-1) for g in grads if g.size < 16384]
        self.pack = np.empty(sum(f.size for f in self.small) + num_scalars, np.float32)

    def __call__(self, grads, divisor, scalars):
        mpi, pack = self.mpi, self.pack
        at = 0
        for f in self.small:
            pack[at : at + f.size] = f
            at += f.size
        pack[at:] = scalars
        requests = [self.world.Iallreduce(mpi.IN_PLACE, pack, op=mpi.SUM)]
        requests += [self.world.Iallreduce(mpi.IN_PLACE, f, op=mpi.SUM) for f in self.large]
        mpi.Request.Waitall(requests)
        scale = np.float32(1.0 / divisor)
        for f in self.large:
            np.multiply(f, scale, out=f)
        at = 0
        for f in self.small:
            np.multiply(pack[at : at + f.size], scale, out=f)
            at += f.size
        scalars[:] = pack[at:]


class RunsMeanOp(RunsPosted):
    """2 ranks only: the runs reduced with a user-defined op that adds and scales in one go (each value is combined
    exactly once at 2 ranks, so this is the sum times 1/N, bit for bit); no scale pass afterwards."""

    def __init__(self, mpi, world, grads, num_scalars):
        if world.Get_size() != 2:
            raise ValueError("the fused mean op is exact at 2 ranks only")
        super().__init__(mpi, world, grads, num_scalars)
        self.scale = np.float32(1.0)

        def add_scaled(inbuf, inoutbuf, datatype):
            a, b = np.frombuffer(inbuf, np.float32), np.frombuffer(inoutbuf, np.float32)
            np.add(a, b, out=b)
            np.multiply(b, self.scale, out=b)

        self.op = mpi.Op.Create(add_scaled, commute=True)

    def __call__(self, grads, divisor, scalars):
        mpi, plan = self.mpi, self.plan
        self.scale = np.float32(1.0 / divisor)
        plan.fill(scalars)
        requests = [self.world.Iallreduce(mpi.IN_PLACE, plan.pack, op=mpi.SUM)]
        requests += [self.world.Iallreduce(mpi.IN_PLACE, v, op=self.op) for v in plan.views]
        mpi.Request.Waitall(requests)
        plan.drain(scalars, self.scale)


class BareScaled:
    """Diagnostic, not an exchange: the bare all-reduce plus the mean's one scale pass over the same buffer."""

    def __init__(self, mpi, world, grads, num_scalars):
        self.mpi, self.world = mpi, world
        self.flat = np.ones(sum(g.size for g in grads) + num_scalars, np.float32)

    def __call__(self, grads, divisor, scalars):
        self.world.Allreduce(self.mpi.IN_PLACE, self.flat, op=self.mpi.SUM)
        np.multiply(self.flat, np.float32(1.0 / divisor), out=self.flat)


class BareRuns(RunsPosted):
    """Diagnostic, not an exchange: the runs' collectives as ortflow posts them, without the scale or the pack."""

    def __call__(self, grads, divisor, scalars):
        mpi = self.mpi
        mpi.Request.Waitall([self.world.Iallreduce(mpi.IN_PLACE, v, op=mpi.SUM) for v in self.plan.views])


class BareNonblocking(BareScaled):
    """Diagnostic: the bare all-reduce of the same numpy buffer as ``bare``, posted non-blocking and waited for."""

    def __call__(self, grads, divisor, scalars):
        self.world.Iallreduce(self.mpi.IN_PLACE, self.flat, op=self.mpi.SUM).Wait()


class BareRunsBlocking(RunsPosted):
    """Diagnostic: the runs' collectives blocking, one after the other, without the scale or the pack."""

    def __call__(self, grads, divisor, scalars):
        for v in self.plan.views:
            self.world.Allreduce(self.mpi.IN_PLACE, v, op=self.mpi.SUM)


class Hindexed:
    def __init__(self, mpi, world, grads, num_scalars):
        self.mpi, self.world, self.plan = mpi, world, RunPlan(world, grads, num_scalars)
        views = self.plan.views
        self.type = mpi.FLOAT.Create_hindexed([v.size for v in views],
                                              [mpi.Get_address(v) for v in views]).Commit()  # fmt: skip

    def __call__(self, grads, divisor, scalars):
        mpi, plan = self.mpi, self.plan
        self.world.Allreduce(mpi.IN_PLACE, [mpi.BOTTOM, 1, self.type], op=mpi.SUM)
        scale = np.float32(1.0 / divisor)
        for v in plan.views:
            np.multiply(v, scale, out=v)
        plan.fill(scalars)
        self.world.Allreduce(mpi.IN_PLACE, plan.pack, op=mpi.SUM)
        plan.drain(scalars, scale)


CONTENDERS = {
    "posted-tensors": PostedTensors, "runs-posted": RunsPosted, "runs-any": RunsAny, "runs-blocking": RunsBlocking,
    "runs-rsag": RunsRSAG, "runs-rsag-blocking": RunsRSAGBlocking, "runs-meanop": RunsMeanOp, "hindexed": Hindexed,
    "bare-scaled": BareScaled, "bare-runs": BareRuns, "bare-nonblocking": BareNonblocking,
    "bare-runs-blocking": BareRunsBlocking,
}
