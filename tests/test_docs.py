"""README stays true to the code: the two commands, the config reference, and the CLI commands it names."""

import re
import sys
from pathlib import Path

from typer.testing import CliRunner

from ortflow.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
sys.path.insert(0, str(ROOT / "tools"))
from update_readme import render  # noqa: E402


def test_readme_opens_with_the_two_commands():
    first_block = README.split("```bash", 1)[1].split("```", 1)[0].strip().splitlines()
    assert [line.split("#")[0].strip() for line in first_block] == ["make demo", "make test"]


def test_config_reference_is_current():
    assert render(README) == README, "README's config reference is stale: run `make docs`"


def test_every_command_the_readme_uses_exists():
    listed = CliRunner().invoke(app, ["--help"]).output
    blocks = "\n".join(re.findall(r"```bash\n(.*?)```", README, re.S))
    used = set(re.findall(r"^ortflow ([a-z-]+)", blocks, re.M)) | set(re.findall(r"`ortflow ([a-z-]+)", README))
    assert used, "README names no ortflow commands"
    missing = sorted(c for c in used if c not in listed)
    assert not missing, f"README uses commands the CLI lacks: {missing}"


def test_ci_runs_the_readme_test_command():
    assert "exec make test" in (ROOT / ".ci" / "run").read_text()
