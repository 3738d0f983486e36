"""tools/rewrite_tests.py: pytest's cache of rewritten test modules, written ahead of `make test`'s workers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

from _pytest.assertion.rewrite import _read_pyc

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("rewrite_tests", ROOT / "tools" / "rewrite_tests.py")
tool = importlib.util.module_from_spec(spec)
sys.modules["rewrite_tests"] = tool
spec.loader.exec_module(tool)


def _names(code) -> set[str]:
    names = set(code.co_varnames) | set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_code"):
            names |= _names(const)
    return names


def test_writes_rewritten_code_that_pytest_reads_and_rewrites_only_a_changed_module(tmp_path):
    module = tmp_path / "test_example.py"
    module.write_text("def test_one():\n    x = 1\n    assert x == 2\n")
    (tmp_path / "helper.py").write_text("assert True\n")

    assert tool.test_modules([tmp_path]) == [module]  # what pytest rewrites, not every module
    assert tool.rewrite(module) is True
    code = _read_pyc(module, tool.cache_path(module))  # pytest's own reader accepts the entry
    assert code is not None and any(name.startswith("@py_assert") for name in _names(code))
    assert tool.rewrite(module) is False  # up to date: left as it is

    module.write_text("def test_one():\n    assert 3 == 2\n")
    assert _read_pyc(module, tool.cache_path(module)) is None  # pytest refuses the stale entry...
    assert tool.rewrite(module) is True  # ...and the tool writes it again
    assert _read_pyc(module, tool.cache_path(module)) is not None
