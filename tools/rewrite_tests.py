"""Write pytest's cache of the assertion-rewritten test modules (``__pycache__/*-pytest-*.pyc``) on every core.

pytest rewrites the ``assert`` statements of each test module (``test_*.py``, ``conftest.py``) when it imports it and
caches the result, but not where ``PYTHONDONTWRITEBYTECODE`` is set: then each of ``make test``'s worker processes
rewrites every module of the suite at collection, about half of its collection time. ``make test`` runs this first;
the workers find the cache (pytest checks each entry against the hash of its source) and only read it.

Usage: ``python tools/rewrite_tests.py FOLDER...``. It uses pytest's own rewriting and cache format (internal names of
the pinned pytest); with a pytest that lacks them it writes nothing and says so, and pytest rewrites as before.
"""

from __future__ import annotations

import ast
import os
import sys
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

try:
    from _pytest.assertion.rewrite import PYC_TAIL, _read_pyc, _write_pyc_fp, get_cache_dir, rewrite_asserts
except ImportError as err:  # another pytest: the workers rewrite the modules themselves
    PYC_TAIL = None
    _MISSING = str(err)


def cache_path(module: Path) -> Path:
    """Where pytest looks for ``module``'s rewritten code."""
    return get_cache_dir(module) / (module.name[:-3] + PYC_TAIL)


def rewrite(module: Path) -> bool:
    """Write ``module``'s rewritten code where pytest reads it, unless an up-to-date entry is there; True if written."""
    import importlib.util

    pyc = cache_path(module)
    if _read_pyc(module, pyc) is not None:
        return False
    source = module.read_bytes()
    tree = ast.parse(source, filename=str(module))
    rewrite_asserts(tree, source, str(module))  # the pinned pytest's default (no assertion-pass hook)
    code = compile(tree, str(module), "exec", dont_inherit=True)
    pyc.parent.mkdir(exist_ok=True)
    partial = pyc.with_name(f"{pyc.name}.{os.getpid()}")
    with open(partial, "wb") as fp:
        _write_pyc_fp(fp, importlib.util.source_hash(source), code)
    partial.replace(pyc)  # atomic: a pytest reading it meanwhile sees the old entry or the new one
    return True


def test_modules(folders: list[Path]) -> list[Path]:
    """The modules pytest rewrites under ``folders``: ``test_*.py``, ``*_test.py`` and ``conftest.py``."""
    found = set()
    for folder in folders:
        for pattern in ("test_*.py", "*_test.py", "conftest.py"):
            found.update(p for p in folder.rglob(pattern) if "__pycache__" not in p.parts)
    return sorted(found)


def main(argv: list[str]) -> int:
    if PYC_TAIL is None:
        print(f"rewrite_tests: this pytest has no {_MISSING.split()[-1]}; its workers rewrite the test modules")
        return 0
    modules = test_modules([Path(a) for a in argv] or [Path("tests")])
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        written = sum(pool.map(rewrite, modules, chunksize=8))
    print(f"rewrite_tests: {written} of {len(modules)} test modules rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
