"""The import rules of docs/design.md: each package imported in a fresh interpreter, every module's imports read (inside
functions too) against the layer table, no import cycles, no private names imported across modules."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.import_rules import (
    EXTRA_EDGES,
    LAYERS,
    PRIVATE_KNOWN,
    check,
    imports_of,
    module_names,
    unresolved_from_outside,
)

ROOT = Path(__file__).resolve().parents[1] / "ortflow"
REPORT = check(ROOT, LAYERS, EXTRA_EDGES, PRIVATE_KNOWN)


def test_every_import_follows_the_layer_table():
    assert not REPORT.layer, "\n".join(REPORT.layer)


def test_no_import_cycles_even_through_imports_inside_functions():
    assert not REPORT.cycles, "\n".join(" -> ".join([*c, c[0]]) for c in REPORT.cycles)


def test_no_private_name_is_imported_across_modules():
    assert not REPORT.private, "\n".join(REPORT.private)


def test_every_import_of_ortflow_names_a_module_or_name_that_exists():
    # An import inside a function is resolved only when the function runs: a moved or renamed name breaks a rare path
    # (a stop report, an error message) long after the change.
    assert not REPORT.unresolved, "\n".join(REPORT.unresolved)


def test_every_import_of_ortflow_in_tests_bench_and_tools_exists():
    missing = unresolved_from_outside(ROOT, [ROOT.parent / "tests", ROOT.parent / "bench", ROOT.parent / "tools"])
    assert not missing, "\n".join(missing)


def test_every_listed_exception_is_still_used():
    # An exception nobody needs any more would hide the next breach of the same kind.
    found = {(m, i.module, i.name) for m, path in module_names(ROOT).items() for i in imports_of(m, path)}
    for part, target in EXTRA_EDGES:
        assert any(m.startswith(f"ortflow.{part}") and (mod == target or f"{mod}.{name}" == target)
                   for m, mod, name in found), (part, target)
    for module, name in PRIVATE_KNOWN:
        assert any(m == module and n == name for m, _, n in found), (module, name)


def plant(tmp_path: Path, files: dict[str, str]) -> Path:
    """A package ``pkg`` under ``tmp_path`` with the given module sources (``sub/__init__.py`` style paths)."""
    root = tmp_path / "pkg"
    for rel, text in {"__init__.py": "", **files}.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        for folder in path.relative_to(root).parents:
            (root / folder / "__init__.py").touch()
        path.write_text(text)
    return root


TABLE = {"config": set(), "trainer": {"config"}}


def test_the_checker_passes_a_package_that_keeps_the_rules(tmp_path):
    root = plant(tmp_path, {"config/__init__.py": "LIMIT = 1\n",
                            "trainer/loop.py": "from pkg.config import LIMIT\nfrom .steps import step\n",
                            "trainer/steps.py": "def step():\n    from pkg import config\n    return config.LIMIT\n"})
    assert check(root, TABLE).problems() == []


def test_the_checker_finds_a_cycle_hidden_in_a_function(tmp_path):
    root = plant(tmp_path, {"trainer/a.py": "import pkg.trainer.b\n",
                            "trainer/b.py": "def later():\n    from pkg.trainer import a\n    return a\n",
                            "trainer/c.py": "from pkg.trainer import a\n"})
    assert check(root, TABLE).cycles == [["pkg.trainer.a", "pkg.trainer.b"]]


def test_the_checker_finds_a_private_name_imported_across_modules(tmp_path):
    root = plant(tmp_path, {"trainer/a.py": "def _helper():\n    return 1\n",
                            "trainer/b.py": "from .a import _helper\n",
                            "trainer/c.py": "def f():\n    from pkg.trainer.a import _helper\n    return _helper\n"})
    private = check(root, TABLE).private
    assert len(private) == 2 and all("_helper from pkg.trainer.a" in p for p in private), private


def test_the_checker_finds_a_layer_breach_inside_a_function_and_an_unlisted_part(tmp_path):
    root = plant(tmp_path, {"config/__init__.py": "def f():\n    from pkg.trainer import loop\n    return loop\n",
                            "trainer/loop.py": "", "tools.py": "import pkg.config\n"})
    layer = check(root, TABLE).layer
    assert any(p.startswith("pkg.config:2 (config) imports pkg.trainer.loop") for p in layer), layer
    assert any("tools is not in the layer table" in p for p in layer), layer


def test_the_checker_finds_an_import_of_a_moved_name_inside_a_function(tmp_path):
    root = plant(tmp_path, {"trainer/events.py": "def announce():\n    return 1\n",
                            "trainer/runs.py": "if True:\n    LIMIT = 2\n",
                            "trainer/stop.py": "def report():\n    from pkg.trainer.runs import announce\n"
                                               "    from pkg.trainer.runs import LIMIT\n"
                                               "    from pkg.trainer import gone\n    return announce, LIMIT, gone\n"})
    assert check(root, TABLE).unresolved == [
        "pkg.trainer.stop:2 imports announce from pkg.trainer.runs, which does not define it",
        "pkg.trainer.stop:4 imports gone from pkg.trainer, which does not define it"]


def loaded_by(module: str) -> set[str]:
    """Top-level names of everything in sys.modules after importing ``module`` in a fresh interpreter."""
    code = f"import sys, json, {module}; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return set(json.loads(out.strip().splitlines()[-1]))


@pytest.mark.parametrize(
    ("module", "forbidden"),
    [
        ("ortflow.config", {"ortflow.dataprep", "ortflow.trainer", "ortflow.export", "prefect", "mpi4py",
                            "onnxruntime"}),
        ("ortflow.dataprep", {"ortflow.trainer", "ortflow.export", "ortflow.tasks", "prefect", "mpi4py",
                              "onnxruntime.training"}),
        ("ortflow.trainer.loop", {"prefect", "ortflow.tasks", "ortflow.flows"}),
        # a rank imports what its role needs, when it needs it: onnx for pipeline stages, h5py at the first checkpoint
        # file, TensorBoard's protos on rank 0 (ortflow frames the records), the shard readers (not the preparation)
        ("ortflow.trainer.__main__", {"prefect", "ortflow.tasks", "ortflow.flows", "mpi4py", "onnx", "h5py",
                                      "tensorboard", "ortflow.dataprep"}),
        ("ortflow.engine", {"onnx", "onnxruntime.tools", "flatbuffers"}),  # artifacts and onnxblock: when asked for
        ("ortflow.dataprep.loader", {"ortflow.dataprep.preparation", "pyarrow.compute", "pyarrow.parquet", "onnx"}),
        ("ortflow.export", {"prefect", "mpi4py", "ortflow.tasks"}),
        ("ortflow.launch.local", {"prefect", "mpi4py", "onnxruntime", "ortflow.trainer", "ortflow.tasks"}),
        ("ortflow.launch.layout", {"prefect", "mpi4py", "onnxruntime", "ortflow.trainer", "ortflow.tasks"}),
        ("ortflow.graph.exports.batch_dims", {"prefect", "mpi4py", "onnxruntime", "ortflow.trainer",
                                              "ortflow.dataprep"}),
        ("ortflow.validate", {"prefect", "mpi4py", "onnxruntime.training", "ortflow.tasks"}),  # engine: --deep only
        # `ortflow --help` and every command start without what takes seconds to import (each command imports it),
        # nor the config's pydantic models: the commands that read a config import them when they run
        ("ortflow.cli", {"prefect", "onnx", "onnxruntime", "h5py", "pyarrow", "kubernetes", "mpi4py", "ortflow.tasks",
                         "pydantic", "yaml", "numpy", "ortflow.config", "ortflow.checkpoints", "ortflow.launch"}),
        # each served flow run and `ortflow run` import the flows: Prefect and the config, not the ranks' numerics
        ("ortflow.flows", {"numpy", "onnx", "onnxruntime", "h5py", "pyarrow", "mpi4py", "kubernetes"}),
        # `ortflow run` starts its temporary server without the serving half of the package (Prefect's runner)
        ("ortflow.deployments.local_server", {"ortflow.deployments.serving", "prefect.runner",
                                              "prefect.deployments.runner"}),
    ],
)
def test_package_does_not_pull_in_what_it_must_not(module, forbidden):
    loaded = loaded_by(module)
    assert not (forbidden & loaded), f"{module} imports {sorted(forbidden & loaded)}"


def test_ranks_never_import_prefect_and_mpi_waits_for_a_launcher():
    # A rank's entry point imports the trainer; MPI is initialised only by comm.create_communicator under mpiexec.
    loaded = loaded_by("ortflow.trainer.__main__")
    assert "prefect" not in loaded and "mpi4py" not in loaded


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


MODULES = {p.relative_to(ROOT.parent).with_suffix("").as_posix().replace("/", "."): _imports(p)
           for p in ROOT.rglob("*.py")}


def who_imports(prefix: str) -> set[str]:
    return {mod for mod, names in MODULES.items() if any(n == prefix or n.startswith(prefix + ".") for n in names)}


def test_only_comm_imports_mpi_nccl_or_cupy():
    assert who_imports("mpi4py") == {"ortflow.trainer.comm.mpi"}
    assert who_imports("cupy") <= {"ortflow.trainer.comm.nccl", "ortflow.trainer.optim.device"}


def test_only_the_engine_module_imports_onnxruntime_training():
    assert who_imports("onnxruntime.training") == {"ortflow.engine"}


def test_only_trainer_export_and_build_reach_the_engine():
    users = who_imports("ortflow.engine")
    allowed = ("ortflow.trainer.", "ortflow.export.", "ortflow.configure.")
    assert users and all(u.startswith(allowed) for u in users), users


def test_only_orchestration_layers_import_prefect():
    allowed = ("ortflow.tasks", "ortflow.flows", "ortflow.deployments", "ortflow.cli")
    offenders = {m for m in who_imports("prefect") if not m.startswith(allowed)}
    assert not offenders, offenders


def test_flows_call_only_config_and_tasks():
    for module, names in MODULES.items():
        if module.startswith("ortflow.flows"):
            ours = {n for n in names if n.startswith("ortflow")}
            allowed = ("ortflow.config", "ortflow.tasks", "ortflow.flows")
            assert all(n == "ortflow" or n.startswith(allowed) for n in ours), (module, ours)


def test_graph_passes_import_nothing_from_ortflow_outside_graph_but_the_slicing_of_a_weight():
    # ortflow.tensor_slices imports nothing from ortflow (numpy only): the split's slicing, shared with checkpoints
    for module, names in MODULES.items():
        if module.startswith("ortflow.graph"):
            ours = {n for n in names if n.startswith("ortflow") and n != "ortflow.tensor_slices"}
            assert all(n.startswith("ortflow.graph") for n in ours), (module, ours)
    slices = MODULES["ortflow.tensor_slices"]
    assert not {n for n in slices if n.startswith("ortflow")}, slices


def test_launchers_import_only_the_config_the_process_and_gpu_helpers_and_the_protocol_from_ortflow():
    found = {m: names for m, names in MODULES.items() if m.startswith("ortflow.launch")}
    assert "ortflow.launch.local" in found, sorted(found)
    for module, names in found.items():
        ours = {n for n in names if n.startswith("ortflow")}
        # processes, gpus and protocol import nothing from ortflow (the standard library only)
        allowed = ("ortflow.config", "ortflow.launch", "ortflow.processes", "ortflow.gpus", "ortflow.protocol")
        assert all(n == "ortflow" or n.startswith(allowed) for n in ours), (module, ours)


def test_config_imports_nothing_from_ortflow_outside_itself():
    config = {m: names for m, names in MODULES.items() if m == "ortflow.config" or m.startswith("ortflow.config.")}
    assert len(config) > 1, "the config package has no modules"
    for module, names in config.items():
        outside = {n for n in names if n.startswith("ortflow") and not n.startswith("ortflow.config")}
        assert not outside, (module, outside)


def test_no_torch_and_no_pickle_anywhere():
    # (onnxruntime itself imports torch when it is installed, e.g. by the bench extra: the runtime never needs it.)
    assert not who_imports("torch")
    assert not who_imports("pickle") and not who_imports("cloudpickle")
    project = (ROOT.parent / "pyproject.toml").read_text()
    runtime = project.split("dependencies = [", 1)[1].split("]", 1)[0]
    assert "torch" not in runtime


def test_no_two_modules_share_a_name():
    # A file name says what the room holds; two rooms of the same name (three `pipeline.py`, two `base.py`) make every
    # traceback and every "see X.py" ambiguous.
    by_name: dict[str, list[str]] = {}
    for path in ROOT.rglob("*.py"):
        if path.name not in ("__init__.py", "__main__.py"):  # a package's own files, named by Python
            by_name.setdefault(path.stem, []).append(str(path.relative_to(ROOT)))
    shared = {name: paths for name, paths in by_name.items() if len(paths) > 1}
    assert not shared, f"module names used more than once: {shared}"


def test_every_module_imports():
    # A module nothing imports any more can keep an import of a module that is gone; importing each one finds it.
    import importlib
    import pkgutil

    import ortflow

    broken = {}
    for info in pkgutil.walk_packages(ortflow.__path__, "ortflow."):
        try:
            importlib.import_module(info.name)
        except Exception as err:  # noqa: BLE001 - collected and reported together
            broken[info.name] = repr(err)
    assert not broken, broken
