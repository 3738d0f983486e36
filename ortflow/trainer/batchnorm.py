"""BatchNormalization running statistics as torch keeps them, and the same on every rank.

The engine trains BatchNormalization with the batch's statistics and updates the running ones in place,
``running = m * running + (1 - m) * statistic``. Its CPU kernel takes the *biased* batch variance for ``running_var``
(ONNX's rule); its CUDA kernel (cuDNN's) the unbiased one, ``n / (n - 1)`` times it (``n`` values per channel), as
torch does: measured, a CUDA rank's increment of ``running_var`` over an update is ``n / (n - 1)`` times a CPU rank's
on the same batches (the torch CNN export, n = 512 and 128). After the ``k`` micro-batches of an update the engine's
variance is ``m^k v0 + sum_i (1 - m) m^(k-1-i) b_i`` (``v0``: the value before the update, ``b_i``: the batch
variances it took), so the rule asked for (``train.batchnorm_variance``) is ``m^k v0 + (v_engine - m^k v0) * r``,
``r`` the ratio of the asked-for variance to the engine's: ``n / (n - 1)`` for torch's rule on CPU, ``(n - 1) / n``
for the biased rule on CUDA, 1 otherwise. :meth:`RunningStats.after_update` applies it, in float64, once per update.

Each rank's engine updates its own copy from its own batches. Before every eval and every checkpoint
:meth:`RunningStats.sync` makes them one (``train.batchnorm_sync``):

* ``broadcast`` (default): rank 0's, as torch's DistributedDataParallel broadcasts rank 0's buffers before every
  forward (``broadcast_buffers=True``): rank 0's statistics only ever see rank 0's batches, in both.
* ``average``: the mean over the data-parallel ranks. The update is affine with the same coefficients on every rank,
  so averaging at sync points equals averaging after every update: the running mean is the one of the mean batch
  statistic over the ranks (SyncBatchNorm's running mean, with equal batches per rank), the running variance the mean
  of the ranks' running variances (SyncBatchNorm's would also count the spread of the ranks' batch means).

So the eval loss recorded during training, the checkpoint and ``ortflow evaluate`` all use one set of statistics,
whatever the number of ranks.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)


class RunningStats:
    """The rank's BatchNormalization running statistics (see the module docstring).

    Args:
        layers: The model's BatchNorm layers, configure.json's ``batchnorm`` entries (``node``, ``mean``, ``var``,
            ``momentum``, ``per_row``: ortflow/graph/exports/batchnorm_stats.py).
        parameters: ``name -> engine parameter`` (``.data`` reads; writable views on CPU, ``.data = x`` on devices).
        comm: The data-parallel group.
        batch_size: Rows per micro-batch on this rank.
        micro_batches: Micro-batches per update.
        variance: ``unbiased`` (torch) or ``biased`` (the engine's).
        sync: ``broadcast`` or ``average``.
        on_device: The parameters live in device buffers (a CUDA rank: the engine's running variance is unbiased).
    """

    def __init__(self, layers, parameters, comm, batch_size: int, micro_batches: int, variance: str, sync: str,
                 on_device: bool = False):
        self.layers, self.comm, self.sync_rule, self.on_device = list(layers), comm, sync, on_device
        self.params = parameters
        self.names = [n for layer in self.layers for n in (layer["mean"], layer["var"])]
        unbiased = variance == "unbiased"
        self.correct = unbiased != on_device  # the engine's rule differs from the one asked for
        self.factors = []
        for layer in self.layers:
            n = None if layer["per_row"] is None else batch_size * layer["per_row"]
            if (unbiased or on_device) and (n is None or n < 2):
                why = "its input's shape after the channel dim is unknown" if n is None else f"n = {n}"
                fix = ("set train.batchnorm_variance: biased, or give" if not on_device else
                       "on GPUs the engine's own rule is the unbiased one and the biased rule is derived from it; give")
                raise ValueError(
                    f"BatchNormalization '{layer['node']}': torch's unbiased running variance needs n >= 2 values per "
                    f"channel and batch ({why}); {fix} the model static spatial dims / a larger train.batch_size"
                )
            mk = layer["momentum"] ** micro_batches
            ratio = 1.0 if not self.correct else n / (n - 1) if unbiased else (n - 1) / n
            self.factors.append((mk, ratio))
        self.dirty = False
        self.before = self._read() if self.correct else {}

    def _read(self) -> dict[str, np.ndarray]:
        return {n: np.array(self.params[n].data, dtype=np.float64) for n in self.names}

    def _write(self, values: dict[str, np.ndarray]) -> None:
        for name, value in values.items():
            value = np.asarray(value, dtype=np.float32).reshape(np.shape(self.params[name].data))
            if self.on_device:
                self.params[name].data = np.ascontiguousarray(value)
            else:
                self.params[name].data[...] = value

    def after_update(self) -> None:
        """After an update's micro-batches: the running variance the engine wrote -> torch's (unbiased) one."""
        if not self.layers:
            return
        self.dirty = True
        if not self.correct:
            return
        now = self._read()
        fixed = {}
        for layer, (mk, ratio) in zip(self.layers, self.factors, strict=True):
            start = mk * self.before[layer["var"]]
            fixed[layer["var"]] = start + (now[layer["var"]] - start) * ratio
        self._write(fixed)
        self.before = self._read()

    def sync(self) -> None:
        """Make every rank's statistics rank 0's (broadcast) or their mean (average); only after a change."""
        if not self.dirty:
            return
        self.dirty = False
        if self.comm.size == 1:
            return
        values = self._read()
        flat = np.concatenate([values[n].reshape(-1) for n in self.names])
        if self.sync_rule == "average":
            # Sync point: every rank's statistics summed, so each holds their mean.
            flat = self.comm.allreduce_sum(flat, "batchnorm statistics") / self.comm.size
        else:
            # Sync point: rank 0's statistics to every rank (DistributedDataParallel's broadcast_buffers).
            flat = np.asarray(self.comm.broadcast(flat, "batchnorm statistics"), dtype=np.float64)
        out, at = {}, 0
        for name in self.names:
            size = values[name].size
            out[name] = flat[at:at + size]
            at += size
        self._write(out)
        if self.correct:
            self.before = self._read()


def recorded_layers(run_dir: Path, model_path: Path) -> list[dict]:
    """The model's BatchNorm layers as configure recorded them (configure.json ``batchnorm``).

    Raises:
        ValueError: the record predates that entry and the model has BatchNormalization nodes (re-run configure).
    """
    try:
        record = json.loads((Path(run_dir) / "configure.json").read_text())
    except (OSError, ValueError):
        record = {}
    if "batchnorm" in record:
        return list(record["batchnorm"])
    import onnx  # here: only a record written before the entry needs it, and ranks start without onnx otherwise

    graph = onnx.load(str(model_path), load_external_data=False).graph  # a record written before the entry
    if any(n.op_type == "BatchNormalization" for n in graph.node):
        raise ValueError(f"{run_dir}/configure.json does not list the model's BatchNorm layers: re-run "
                         "`ortflow configure CONFIG` (it rebuilds the artifacts)")
    return []


def refuse_tensor_parallel(layers: list[dict]) -> None:
    """Tensor-parallel pieces keep no BatchNormalization statistics of their own: refuse such a model by name (the
    node's, and its running mean's: a dynamo export's node names say only the op, its tensor names are torch's)."""
    if layers:
        raise ValueError(
            f"BatchNormalization '{layers[0]['node']}' (running mean '{layers[0]['mean']}'): its running statistics "
            "are kept in data-parallel and pipeline layouts, not with distributed.horizontal_parallel_size > 1; set "
            "it to 1"
        )


def for_model(model) -> RunningStats:
    """The running statistics of a rank model's BatchNorm layers (none: every method does nothing).

    A pipeline stage holds its own layers and syncs them over its replicas (``model.replicas``); tensor-parallel pieces
    keep none, so a BatchNorm model is refused there by name.
    """
    layers = recorded_layers(model.run_dir, model.cfg.model.path)
    if model.dims.tp > 1:
        refuse_tensor_parallel(layers)
    params = {name: p for part in model.engine_parts() for name, p in part.state.parameters}
    layers = [la for la in layers if la["mean"] in params and la["var"] in params]
    comm = model.replicas  # the replicas of this rank's part
    train = model.cfg.train
    if layers:
        log.info("rank %d: %d BatchNormalization layer(s): running_var %s, %s across ranks", model.comm.rank,
                 len(layers), train.batchnorm_variance, train.batchnorm_sync)
    return RunningStats(layers, params, comm, train.batch_size, train.gradient_accumulation_steps,
                        train.batchnorm_variance, train.batchnorm_sync, on_device=model.buffers.on_device)
