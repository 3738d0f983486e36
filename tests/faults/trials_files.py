"""Fault trials on files and inputs: bit flips and truncations, a full disk, concurrent runs, fuzzed inputs."""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import traceback
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from ortflow.artifacts_folder import ArtifactsDamaged, verify_artifacts
from ortflow.checkpoints import CheckpointError, list_complete, verify
from ortflow.config import ConfigError, check_model_file, config_from_dict
from ortflow.config.sealed import read_configure
from ortflow.dataprep import DataError, verify_data
from tests.faults import procs
from tests.faults.trials import KILL_RUN, Outcome, _resume_to_end, _same, fresh_run
from tests.support.runs import final_parameters, run_ranks

#: File kinds a resume trusts, and the owner of their integrity when it is not this suite's work.
FILE_KINDS = {"checkpoint": "", "optimizer": "", "meta": "", "manifest": "", "shard": "", "artifact": ""}


def trained_run(root: Path):
    """A finished 2-rank run with checkpoints (made once per root)."""
    cfg = fresh_run(root, "trained", train={"num_train_steps": 20})
    if not list_complete(cfg.checkpoints_dir):
        out = run_ranks(cfg, timeout=300)
        if out.returncode:
            raise RuntimeError(out.stdout[-2000:])
    return cfg


def _target(cfg, kind: str) -> Path:
    newest = list_complete(cfg.checkpoints_dir)[-1].path
    return {"checkpoint": newest / "params.h5", "optimizer": newest / "optimizer.h5", "meta": newest / "meta.json",
            "manifest": cfg.data_dir / "manifest.json", "shard": cfg.data_dir / "train-00000.arrow",
            "artifact": cfg.artifacts_dir / "training_model.onnx"}[kind]


def corruption_trial(root: Path, kind: str, mode: str, rng: random.Random) -> Outcome:
    """Flip one random bit of (or truncate) one file a resume trusts: the reader must refuse it, naming the file."""
    cfg = trained_run(root)
    path = _target(cfg, kind)
    original = path.read_bytes()
    try:
        data = bytearray(original)
        if mode == "flip":
            at = rng.randrange(len(data) * 8)
            data[at // 8] ^= 1 << (at % 8)
            what = f"bit {at} of {len(original) * 8}"
        else:
            cut = rng.randrange(len(data))
            data = data[:cut]
            what = f"cut to {cut} of {len(original)} bytes"
        path.write_bytes(bytes(data))
        try:
            if kind in ("checkpoint", "optimizer", "meta"):
                verify(path.parent)
            elif kind == "artifact":
                verify_artifacts(cfg.artifacts_dir, read_configure(cfg.output_dir))
            else:
                verify_data(cfg.data_dir)
        except (CheckpointError, DataError, ArtifactsDamaged) as err:
            named = path.name in str(err)
            return Outcome(f"{mode}-{kind}", named, f"{what}: detected{'' if named else ' (file not named)'}: "
                           f"{str(err)[:160]}")
        except Exception as err:  # noqa: BLE001 - anything else is a crash, not a detection
            return Outcome(f"{mode}-{kind}", False, f"{what}: crashed: {type(err).__name__}: {err}")
        return Outcome(f"{mode}-{kind}", False, f"{what}: NOT detected", FILE_KINDS[kind])
    finally:
        path.write_bytes(original)


def disk_full_trial(root: Path, mount: Path) -> Outcome:
    """Checkpoints on a full tmpfs: the job fails with a message naming the space, the earlier checkpoint intact."""
    cfg = fresh_run(root, "diskfull", train={"num_train_steps": 40},
                    checkpoint={"dir": str(mount / "ckpt"), "period": 5, "max_num_checkpoints": 5})
    # Leave room for about two checkpoints: the third write hits "no space left on device" inside h5py.
    params = (cfg.artifacts_dir / "checkpoint").stat().st_size  # parameters only; with Adam moments about 3x
    per_checkpoint = 3 * params + 32768  # params.h5 + optimizer.h5 headers (~9 KB each) + meta.json + the folder
    free = shutil.disk_usage(mount).free
    with open(mount / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - int(2.5 * per_checkpoint)))
    try:
        out = run_ranks(cfg, timeout=120)
    finally:
        (mount / "filler").unlink()
    complete = list_complete(cfg.checkpoints_dir)
    intact = all(_verifies(c.path) for c in complete)
    named = "Free disk space" in out.stdout or "No space left" in out.stdout
    ok = out.returncode != 0 and bool(complete) and intact and named and "Traceback" not in out.stdout
    return Outcome("disk-full", ok, f"exit {out.returncode}; {len(complete)} checkpoint(s) kept, "
                   f"{'intact' if intact else 'DAMAGED'}; space {'named' if named else 'NOT named'}; traceback "
                   f"{'yes' if 'Traceback' in out.stdout else 'no'}")


def _verifies(path: Path) -> bool:
    try:
        verify(path)
        return True
    except CheckpointError:
        return False


def concurrent_trial(root: Path, reference: dict, name: str,
                     steps: int = KILL_RUN["train"]["num_train_steps"]) -> Outcome:
    """Two ``ortflow train`` on one run folder at once (``steps`` updates, the reference's): either one refuses, or
    both end with sound checkpoints."""
    cfg = fresh_run(root, name, train={"num_train_steps": steps})
    a, b = procs.start_train(cfg.output_dir), procs.start_train(cfg.output_dir)
    outs = [p.communicate(timeout=300)[0] for p in (a, b)]
    codes = sorted([a.returncode, b.returncode])
    damaged = [c.path.name for c in list_complete(cfg.checkpoints_dir) if not _verifies(c.path)]
    if damaged:
        return Outcome("concurrent", False, f"exits {codes}; damaged checkpoints {damaged}", "run lock")
    refused = codes[0] == 0 and codes[1] != 0 and any("lock" in o.lower() for o in outs)
    if codes == [0, 0] or refused:
        # A job that exited 0 trained to the end; a resume runs only if the checkpoints say otherwise.
        newest = list_complete(cfg.checkpoints_dir)
        out = _resume_to_end(cfg) if not newest or newest[-1].step < steps else subprocess.CompletedProcess([], 0, "")
        how = "one refused (locked)" if refused else "both ran (no run lock yet)"
        if out.returncode:
            return Outcome("concurrent", False, f"{how}; the final resume failed ({out.returncode}): "
                           f"{out.stdout[-4000:]} | first jobs: {outs[0][-400:]} | {outs[1][-400:]}")
        same = _same(final_parameters(cfg), reference)
        detail = "" if same else f" | first jobs: {outs[0][-600:]} | {outs[1][-600:]}"
        return Outcome("concurrent", same, f"{how}; final parameters {'equal' if same else 'DIFFER'}{detail}",
                       "" if refused else "run lock")
    return Outcome("concurrent", False, f"exits {codes}: {outs[0][-300:]} | {outs[1][-300:]}", "run lock")


# -- fuzzed inputs -----------------------------------------------------------------------------------------------------

_WEIRD = [True, False, None, 0, -1, 10**30, -(10**30), 1e-300, math.inf, -math.inf, math.nan, "", "x" * 300,
          "[/x]", "\0", [], {}, [1, 2], {"a": 1}, 0.5, 2**31, "1e3", "true", "~"]


def fuzz_config_trial(base: dict, rng: random.Random) -> Outcome:
    """A valid config with one to three fields replaced by odd values: a ConfigError or a sound config, no crash."""
    raw = json.loads(json.dumps(base))
    for _ in range(rng.randint(1, 3)):
        section = rng.choice([k for k, v in raw.items() if isinstance(v, dict)] + ["name", "output_dir", "nope"])
        value = rng.choice(_WEIRD)
        if isinstance(raw.get(section), dict) and raw[section] and rng.random() < 0.85:
            raw[section][rng.choice(list(raw[section]) + ["unknown_field"])] = value
        else:
            raw[section] = value
    try:
        cfg = config_from_dict(raw)
    except ConfigError as err:
        return Outcome("fuzz-config", all(p.strip() for p in err.problems), f"refused: {err.problems[0][:100]}")
    except Exception as err:  # noqa: BLE001
        return Outcome("fuzz-config", False, f"crash {type(err).__name__}: {err} for {raw}")
    floats = [v for v in _numbers(cfg.model_dump()) if isinstance(v, float)]
    sound = all(math.isfinite(v) for v in floats) and cfg.train.batch_size <= 2**31
    return Outcome("fuzz-config", sound, "accepted" + ("" if sound else f" with non-finite values: {raw}"))


def _numbers(tree):
    if isinstance(tree, dict):
        for value in tree.values():
            yield from _numbers(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            yield from _numbers(value)
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        yield tree


def fuzz_model_trial(model: Path, scratch: Path, rng: random.Random) -> Outcome:
    """A model file with random bytes flipped or cut: problems listed, never a crash."""
    data = bytearray(model.read_bytes())
    for _ in range(rng.randint(1, 8)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    if rng.random() < 0.3:
        data = data[: rng.randrange(len(data))]
    path = scratch / "fuzzed.onnx"
    path.write_bytes(bytes(data))
    try:
        problems = check_model_file(path)
    except Exception as err:  # noqa: BLE001
        return Outcome("fuzz-model", False, f"crash {type(err).__name__}: {err}\n{traceback.format_exc()[-400:]}")
    return Outcome("fuzz-model", True, f"{len(problems)} problem(s)" + (f": {problems[0][:100]}" if problems else ""))


def fuzz_data_trial(root: Path, rng: random.Random, name: str) -> Outcome:
    """Training data with NaN/inf/huge features or bad labels: refused by prepare-data, or the shards are sound."""
    from tests.support.runs import make_run

    n = 64
    features = np.random.default_rng(rng.randrange(2**32)).normal(size=(n, 8))
    labels = np.arange(n) % 3
    for _ in range(rng.randint(0, 3)):
        row, col = rng.randrange(n), rng.randrange(8)
        choice = rng.randrange(6)
        if choice == 0:
            features[row, col] = rng.choice([math.nan, math.inf, -math.inf])
        elif choice == 1:
            features[row, col] = rng.choice([1e39, -1e300, 3.5e38])
        elif choice == 2:
            labels[row] = rng.choice([-1, 3, 4, 2**40, -(2**40), -100])
        elif choice == 3:
            features[row, col] = rng.choice([1e30, -1e-30, 0.0])  # extreme but legal
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    source = folder / "data.npz"
    np.savez(source, features=features, labels=labels)
    try:
        cfg = make_run(folder, "run", model=root / "mlp.onnx", data={"train": [str(source)]})
    except DataError as err:
        return Outcome("fuzz-data", "Traceback" not in str(err), f"refused: {str(err)[:120]}")
    except Exception as err:  # noqa: BLE001
        return Outcome("fuzz-data", False, f"crash {type(err).__name__}: {err}")
    # Accepted: nothing in the shards may train a wrong model.
    x, y = _shard_values(cfg.data_dir)
    sound = bool(np.isfinite(x).all() and ((y >= 0) & (y < 3)).all())
    return Outcome("fuzz-data", sound, "accepted, shards sound" if sound else "accepted BAD values: silently wrong")


def _shard_values(data_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    xs, ys = [], []
    for path in sorted(data_dir.glob("*.arrow")):
        with pa.memory_map(str(path)) as mm:
            table = ipc.open_file(mm).read_all()
        xs.append(np.asarray(table.column("features").combine_chunks().flatten()))
        ys.append(np.asarray(table.column("labels").combine_chunks()))
    return np.concatenate(xs), np.concatenate(ys)


def tmpfs(mount: Path, size: str = "2m") -> bool:
    """Mount a small tmpfs at ``mount`` (root only); False where that is not possible."""
    mount.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return False
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount)],
                            capture_output=True, check=False)
    return result.returncode == 0


def untmpfs(mount: Path) -> None:
    subprocess.run(["umount", "-l", str(mount)], capture_output=True, check=False)
