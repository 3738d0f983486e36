"""What crosses the process boundary (exit statuses, environment variables, output tags) is defined once, in
ortflow.protocol, and both sides read it from there."""

from __future__ import annotations

import ast
from pathlib import Path

from ortflow import protocol

ROOT = Path(protocol.__file__).parent
NAMES = [n for n in vars(protocol) if n.isupper()]


def _literals(path: Path) -> set:
    return {node.value for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Constant)}


def test_no_module_but_protocol_spells_a_boundary_string():
    strings = {getattr(protocol, n) for n in NAMES if isinstance(getattr(protocol, n), str)}
    assert {"ORTFLOW_TUNE ", "ORTFLOW_NUM_RANKS", ".ranks"} <= strings
    found = {(str(p.relative_to(ROOT)), s) for p in ROOT.rglob("*.py") if p.name != "protocol.py"
             for s in _literals(p) & strings}
    assert not found, f"import these from ortflow.protocol instead: {sorted(found)}"


def test_both_sides_import_the_exit_statuses_and_tags_from_protocol():
    def imported(module: str) -> set[str]:
        tree = ast.parse((ROOT.parent / (module.replace(".", "/") + ".py")).read_text())
        return {a.name for node in ast.walk(tree)
                if isinstance(node, ast.ImportFrom) and node.module == "ortflow.protocol" for a in node.names}

    assert {"EXIT_STOPPED", "EXIT_INTERRUPTED", "EXIT_NONFINITE"} <= imported("ortflow.trainer.__main__")
    assert "EXIT_NONFINITE" in imported("ortflow.tasks.training")
    assert {"EXIT_STOPPED", "EXIT_INTERRUPTED"} <= imported("ortflow.cli.train_command")
    assert "TUNE_RESULT_TAG" in imported("ortflow.trainer.tune_updates") & imported("ortflow.launch.tune")
    assert "HEARTBEAT_DIR" in imported("ortflow.launch.local") & imported("ortflow.trainer.runtime")


def test_the_exit_statuses_are_distinct_and_fit_a_process_status():
    codes = [getattr(protocol, n) for n in NAMES if n.startswith("EXIT_")]
    assert len(codes) == len(set(codes)) and all(0 < c < 256 for c in codes)
