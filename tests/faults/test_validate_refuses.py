"""`ortflow validate` refuses what later stages would crash or mislead on, naming the problem, and configure never
writes over a user's file: a recursive local function (configure died with SIGSEGV), NaN weights, an input with a
fixed dim of size 0, external data shorter than declared, ``output_dir: .``, ``/proc/x`` and over-long names."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
import yaml
from onnx import helper, numpy_helper

from ortflow.examples.mlp import build_mlp
from tests.faults import procs

pytestmark = [pytest.mark.faults]


def _config(folder: Path, model: Path, output_dir: str = "runs/run", name: str = "config.yaml") -> Path:
    data = folder / "data.npz"
    if not data.exists():
        rng = np.random.default_rng(0)
        np.savez(data, features=rng.normal(size=(64, 8)).astype(np.float32), labels=rng.integers(0, 3, 64))
    path = folder / name
    path.write_text(yaml.safe_dump({"name": "run", "output_dir": output_dir, "model": {"path": model.name},
                                    "data": {"train": ["data.npz"]}, "train": {"batch_size": 4, "num_train_steps": 4}}))
    return path


def _mlp(folder: Path) -> onnx.ModelProto:
    build_mlp(folder / "base.onnx", num_features=8, hidden=16, num_classes=3, seed=0)
    return onnx.load(str(folder / "base.onnx"))


def _recursive(folder: Path) -> Path:
    model = _mlp(folder)
    body = [helper.make_node("Again", ["x"], ["y"], domain="local")]
    model.functions.append(helper.make_function("local", "Again", ["x"], ["y"], body,
                                                opset_imports=[helper.make_opsetid("", 17),
                                                               helper.make_opsetid("local", 1)]))
    model.opset_import.append(helper.make_opsetid("local", 1))
    out = model.graph.output[0].name
    for node in model.graph.node:
        node.output[:] = [f"{o}_pre" if o == out else o for o in node.output]
    model.graph.node.append(helper.make_node("Again", [f"{out}_pre"], [out], domain="local"))
    onnx.save(model, str(folder / "model.onnx"))
    return folder / "model.onnx"


def _nan_weights(folder: Path) -> Path:
    model = _mlp(folder)
    tensor = next(t for t in model.graph.initializer if len(t.dims) == 2)
    values = numpy_helper.to_array(tensor).copy()
    values[0, 0] = np.nan
    tensor.CopyFrom(numpy_helper.from_array(values, tensor.name))
    onnx.save(model, str(folder / "model.onnx"))
    return folder / "model.onnx"


def _zero_batch(folder: Path) -> Path:
    model = _mlp(folder)
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = 0
    onnx.save(model, str(folder / "model.onnx"))
    return folder / "model.onnx"


def _short_external(folder: Path) -> Path:
    model = _mlp(folder)
    onnx.save(model, str(folder / "model.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
              location="weights.bin", size_threshold=0)
    data = folder / "weights.bin"
    data.write_bytes(data.read_bytes()[:-64])
    return folder / "model.onnx"


MODELS = {
    "recursive function": (_recursive, "calls itself"),
    "NaN weights": (_nan_weights, "NaN"),
    "zero batch dim": (_zero_batch, "size 0"),
    "short external data": (_short_external, "weights.bin"),
}


def _ortflow(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """A process of its own: a model can crash the engine (a SIGSEGV is status 139, not a test run's crash)."""
    return subprocess.run([procs.ORTFLOW, *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=300, stdin=subprocess.DEVNULL, cwd=cwd)


def _ortflow_here(*args: str, cwd: Path, monkeypatch) -> subprocess.CompletedProcess:
    """Config and data refusals (no engine): what the command says and its status, in this process."""
    monkeypatch.chdir(cwd)
    return procs.ortflow_here(*args)


@pytest.mark.parametrize("case", sorted(MODELS))
def test_model_problems_are_named_by_validate_and_configure_without_a_crash(tmp_path, case):
    make, words = MODELS[case]
    config = _config(tmp_path, make(tmp_path))
    for args in (["validate", str(config)], ["validate", "--deep", str(config)], ["configure", str(config)]):
        out = _ortflow(*args, cwd=tmp_path)
        assert out.returncode == 1, (args, out.returncode, out.stdout[-2000:])  # 139 was a SIGSEGV
        assert "Traceback" not in out.stdout and words in out.stdout and "model.path" in out.stdout, out.stdout


def test_configure_never_writes_over_the_users_config(tmp_path, monkeypatch):
    build_mlp(tmp_path / "model.onnx", num_features=8, hidden=16, num_classes=3, seed=0)
    config = _config(tmp_path, tmp_path / "model.onnx", output_dir=".")
    original = config.read_bytes()
    out = _ortflow_here("validate", str(config), cwd=tmp_path, monkeypatch=monkeypatch)
    assert out.returncode == 1 and "output_dir" in out.stdout, out.stdout
    out = _ortflow_here("configure", str(config), cwd=tmp_path, monkeypatch=monkeypatch)
    assert out.returncode == 1 and "Traceback" not in out.stdout and "output_dir" in out.stdout, out.stdout
    assert config.read_bytes() == original


@pytest.mark.parametrize("output_dir", ["/proc/ortflow-run", "runs/" + "n" * 300])
def test_unusable_output_paths_are_refused_by_validate_and_named_by_configure(tmp_path, output_dir, monkeypatch):
    build_mlp(tmp_path / "model.onnx", num_features=8, hidden=16, num_classes=3, seed=0)
    config = _config(tmp_path, tmp_path / "model.onnx", output_dir=output_dir)
    for command in ("validate", "configure"):
        out = _ortflow_here(command, str(config), cwd=tmp_path, monkeypatch=monkeypatch)
        assert out.returncode == 1 and "Traceback" not in out.stdout and "output_dir" in out.stdout, out.stdout


def _second_source(folder: Path, case: str) -> str:
    rng = np.random.default_rng(1)
    features, labels = rng.normal(size=(64, 8)).astype(np.float32), rng.integers(0, 3, 64)
    if case == "other feature width":
        features = features[:, :6]
    elif case == "float labels":
        labels = rng.random(64)
    else:  # a NaN feature and an out-of-range label in one source: both are named
        features[3, 2], labels[5] = np.nan, -5
    np.savez(folder / "second.npz", features=features, labels=labels)
    return "second.npz"


DATA = {"other feature width": ["shape [6]"], "float labels": ["labels", "whole numbers"],
        "NaN and a bad label": ["non-finite", "class labels [-5]"]}


@pytest.mark.parametrize("case", sorted(DATA))
def test_validate_checks_every_source_and_names_every_problem(tmp_path, case, monkeypatch):
    build_mlp(tmp_path / "model.onnx", num_features=8, hidden=16, num_classes=3, seed=0)
    config = _config(tmp_path, tmp_path / "model.onnx")
    raw = yaml.safe_load(config.read_text())
    raw["data"]["train"].append(_second_source(tmp_path, case))
    config.write_text(yaml.safe_dump(raw))
    out = _ortflow_here("validate", str(config), cwd=tmp_path, monkeypatch=monkeypatch)
    assert out.returncode == 1 and "Traceback" not in out.stdout, out.stdout
    for words in DATA[case]:
        assert words in out.stdout and "second.npz" in out.stdout, (words, out.stdout)
