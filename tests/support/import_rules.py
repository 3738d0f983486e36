"""The import checker behind tests/test_import_rules.py: reads every module of a package (imports inside functions
included) and reports what breaks the layer table, import cycles, private names imported across modules and imports
of the package's own modules or names that do not exist (an import inside a function fails only when it runs)."""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

#: Which top-level parts of ``ortflow`` each part may import (docs/design.md's table, plus the top-level modules it
#: leaves out). A part is a subpackage or a top-level module; "*" means any part. A part missing here is reported.
LAYERS: dict[str, set[str]] = {
    "config": set(),
    "graph": {"config", "tensor_slices"},
    "storage": {"config"},  # fsspec: remote folders, the sync of a run folder's local copy
    "dataprep": {"config", "storage"},
    "checkpoints": {"config", "processes", "storage", "tensor_slices"},
    "configure": {"config", "graph", "checkpoints", "engine", "artifacts_folder"},
    "trainer": {"config", "dataprep", "checkpoints", "engine", "processes", "gpus", "artifacts_folder", "cuda_libs",
                "protocol", "storage", "tensor_slices"},
    "launch": {"config", "processes", "gpus", "protocol"},
    "export": {"config", "checkpoints", "graph", "engine", "artifacts_folder"},
    "engine": {"cuda_libs"},  # the one module that imports onnxruntime.training; its CUDA libraries load first
    # Neutral homes below the stages: each imports nothing from ortflow but gpus (cuda_libs).
    "artifacts_folder": set(),  # the artifacts folder's on-disk format: configure writes it, ranks and export read it
    "cuda_libs": {"gpus"},  # the engine's CUDA libraries: the engine, the ranks and validate load or check them
    "tensor_slices": set(),  # a tensor-parallel rank's slice of a weight, and the merge: graph passes, checkpoints
    # exit statuses, environment variables and output tags between launchers and ranks; the late bound between
    # `ortflow automations` and flow runs
    "protocol": set(),
    # Plain functions the CLI and the tasks call: below orchestration, above the pipeline's stages.
    "validate": {"config", "dataprep", "graph", "configure", "checkpoints", "engine", "versions", "cuda_libs",
                 "storage"},
    "versions": {"config", "dataprep", "configure", "checkpoints", "version_configs"},
    "version_configs": {"config", "dataprep", "configure"},
    "runlock": set(),
    "processes": set(),  # is a local process alive, wait for its exit
    "gpus": set(),  # the GPUs the NVIDIA driver shows this process (ctypes only)
    "sample": set(),
    "examples": set(),
    "tasks": {"*"},
    "flows": {"config", "tasks"},
    "deployments": {"config", "flows", "processes", "protocol"},
    "cli": {"*"},
    "__main__": {"cli"},  # python -m ortflow
}

#: Single modules a part may import beyond its row, each with the reason.
EXTRA_EDGES: dict[tuple[str, str], str] = {
    ("export", "ortflow.dataprep.loader"): "evaluate reads the eval split's shards",
    ("validate", "ortflow.trainer.batchnorm"): "the refusal of a BatchNorm model that tensor-parallel ranks raise",
    ("sample", "ortflow.export.checksum"): "the exported model's checksum sidecar, checked before it is loaded",
    ("trainer", "ortflow.graph.gradients.padding_rows"): "the padding-row mask of a forward-once gradient graph, "
                                                         "built at rank start, as configure's training models have it",
    ("trainer", "ortflow.graph.gradients.leading_sums"): "the leading-axis sums as MatMuls of a forward-once gradient "
                                                           "graph, built at rank start, as configure's training models "
                                                           "have them",
    ("trainer", "ortflow.graph.gradients.same_gradients"): "which received tensors' gradients a forward-once gradient "
                                                            "graph, built at rank start, computes as one tensor, as "
                                                            "configure records them for the training models",
}

#: Private names imported across modules that are known and owned elsewhere: (importer, name) -> why.
PRIVATE_KNOWN: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    """One import statement's target as it resolves: ``module`` (and ``name`` from ``from module import name``)."""

    importer: str
    module: str
    name: str | None
    line: int


@dataclass
class Report:
    layer: list[str] = field(default_factory=list)
    cycles: list[list[str]] = field(default_factory=list)
    private: list[str] = field(default_factory=list)
    unresolved: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        return [*self.layer, *(" -> ".join([*c, c[0]]) for c in self.cycles), *self.private, *self.unresolved]


def module_names(root: Path) -> dict[str, Path]:
    """``package.sub.module`` -> file, for every ``.py`` file under the package folder ``root``."""
    names = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def imports_of(module: str, path: Path) -> list[Import]:
    """Every import in the file, at any depth (inside functions too); relative imports resolved."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [Import(module, alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            found += [Import(module, base, alias.name, node.lineno) for alias in node.names]
    return found


def top_level_names(path: Path) -> set[str]:
    """Names a module defines at its top level (inside top-level ``if``/``try`` blocks too): what
    ``from module import name`` can find without importing it."""
    names: set[str] = set()
    body = list(ast.parse(path.read_text()).body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            body += [*node.body, *getattr(node, "orelse", []), *getattr(node, "finalbody", []),
                     *(h for handler in getattr(node, "handlers", []) for h in handler.body)]
    return names


def _unresolved(imp: Import, modules: dict[str, Path], defined: dict[str, set[str]]) -> str | None:
    """Why the import of one of the package's own modules or names cannot succeed (None when it can)."""
    if imp.module not in modules:
        return f"{imp.importer}:{imp.line} imports {imp.module}, which is not a module of the package"
    if imp.name and imp.name != "*" and f"{imp.module}.{imp.name}" not in modules:
        if imp.module not in defined:
            defined[imp.module] = top_level_names(modules[imp.module])
        if imp.name not in defined[imp.module]:
            return f"{imp.importer}:{imp.line} imports {imp.name} from {imp.module}, which does not define it"
    return None


def unresolved_from_outside(root: Path, folders: list[Path]) -> list[str]:
    """Imports of the package at ``root`` that cannot succeed, made by the scripts and tests under ``folders``."""
    top, modules, defined = root.name, module_names(root), {}
    found = []
    for folder in folders:
        for path in sorted(folder.rglob("*.py")):
            name = ".".join(path.relative_to(folder.parent).with_suffix("").parts)
            for imp in imports_of(name, path):
                if (imp.module == top or imp.module.startswith(top + ".")) and \
                        (missing := _unresolved(imp, modules, defined)) is not None:
                    found.append(missing)
    return found


def _part(module: str, top: str) -> str | None:
    parts = module.split(".")
    return parts[1] if parts[0] == top and len(parts) > 1 else None


def check(root: Path, layers: dict[str, set[str]] | None, extra_edges: dict[tuple[str, str], str] | None = None,
          private_known: dict[tuple[str, str], str] | None = None) -> Report:
    """Check the package at folder ``root`` against ``layers`` (None skips the table); cycles, private names and
    unresolved imports always."""
    top = root.name
    modules = module_names(root)
    report = Report()
    graph: dict[str, set[str]] = {m: set() for m in modules}
    defined: dict[str, set[str]] = {}
    for module, path in modules.items():
        for imp in imports_of(module, path):
            if imp.module != top and not imp.module.startswith(top + "."):
                continue
            if (missing := _unresolved(imp, modules, defined)) is not None:
                report.unresolved.append(missing)
            # ``from pkg import sub`` imports the submodule; ``from mod import name`` the module.
            target = f"{imp.module}.{imp.name}" if imp.name and f"{imp.module}.{imp.name}" in modules else imp.module
            if target in modules and target != module:
                graph[module].add(target)
            where = f"{module}:{imp.line}"
            if imp.name and imp.name.startswith("_") and not imp.name.startswith("__") and target == imp.module \
                    and imp.module != module and (module, imp.name) not in (private_known or {}):
                report.private.append(f"{where} imports the private name {imp.name} from {imp.module}")
            if layers is None:
                continue
            mine, theirs = _part(module, top), _part(target, top)
            if mine is None or theirs is None or theirs == mine:
                continue
            if mine not in layers:
                report.layer.append(f"{where}: {mine} is not in the layer table")
                continue
            allowed = layers[mine]
            if "*" in allowed or theirs in allowed or (mine, target) in (extra_edges or {}):
                continue
            report.layer.append(f"{where} ({mine}) imports {target} ({theirs}), which {mine} may not import")
    report.cycles = cycles(graph)
    return report


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each strongly connected component of more than one module, as one cycle through it (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(_cycle_through(sorted(component), graph))
    return found


def _cycle_through(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle from the component's first module back to itself (the path shown in the failure)."""
    members, start = set(component), component[0]
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & members):
                if child == start:
                    return paths[node]
                if child not in paths:
                    paths[child] = [*paths[node], child]
                    following.append(child)
        frontier = following
    return component
