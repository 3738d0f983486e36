"""``ortflow example gpt|mlp DIR``: a runnable example (config + model, and data for the MLP) from the installed
package, so a user who ``pip install``-ed ortflow has something to run without the repository."""

from __future__ import annotations

import sysconfig
from importlib import resources
from pathlib import Path

import numpy as np

from ortflow.examples.gpt import build_gpt
from ortflow.examples.mlp import build_mlp

#: The GPT example's model: 0.87M parameters; one step at batch 8 x 64 tokens takes ~50 ms on one core.
GPT_SIZES = {"vocab_size": 256, "seq_len": 64, "d_model": 128, "num_layers": 4, "num_heads": 4, "seed": 0}
MLP_SIZES = {"num_features": 8, "hidden": 16, "num_classes": 3, "seed": 0}
KINDS = ("gpt", "mlp")


def stdlib_glob() -> str:
    """This Python's standard library sources: text that is on every machine (the GPT example's default data)."""
    return str(Path(sysconfig.get_paths()["stdlib"]) / "*.py")


def write_mlp_data(path: Path, rows: int = 2048, seed: int = 0) -> Path:
    """Synthetic 3-class data that the MLP can learn: the class follows the first two features."""
    rng = np.random.default_rng(seed)
    features = rng.normal(size=(rows, MLP_SIZES["num_features"])).astype(np.float32)
    labels = (features[:, 0] > 0).astype(np.int64) + (features[:, 1] > 1).astype(np.int64)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, features=features, labels=labels)
    return path


def write_example(kind: str, folder: Path, data: str | None = None) -> Path:
    """Write the example's config, model (and the MLP's data) into ``folder``.

    Args:
        kind: ``gpt`` or ``mlp``.
        folder: Where to write (created; existing example files are overwritten).
        data: The training glob to put in the config (default: the stdlib's ``*.py`` for gpt, ``data/train.npz`` for
            mlp, written here).

    Returns:
        The config file's path.

    Raises:
        ValueError: an unknown kind.
    """
    if kind not in KINDS:
        raise ValueError(f"unknown example '{kind}'; use one of {', '.join(KINDS)}")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if kind == "gpt":
        build_gpt(folder / "model.onnx", **GPT_SIZES)
        data = data or stdlib_glob()
    else:
        build_mlp(folder / "model.onnx", **MLP_SIZES)
        if data is None:
            write_mlp_data(folder / "data" / "train.npz")
            data = "data/train.npz"
    template = resources.files("ortflow.examples").joinpath("configs", f"{kind}.yaml").read_text()
    config = folder / "config.yaml"
    config.write_text(template.replace('"@TRAIN@"', _yaml_string(data)))
    return config


def _yaml_string(value: str) -> str:
    return "'" + value.replace("'", "''") + "'"
