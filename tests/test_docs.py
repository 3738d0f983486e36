"""README and docs stay true to the code and to the repository: the commands it opens with, the generated config
reference, the CLI commands and options they name, the example config, every link, section link and path, and no
development history."""

import re
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ortflow.cli import app

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
sys.path.insert(0, str(ROOT / "tools"))
from update_config_reference import PAGE, render  # noqa: E402


def test_readme_opens_with_the_demo_the_venv_and_the_tests():
    first_block = README.split("```bash", 1)[1].split("```", 1)[0].strip().splitlines()
    assert [line.split("#")[0].strip() for line in first_block] == ["make demo", ". .venv/bin/activate", "make test"]


def test_readme_is_a_front_page():
    lines = README.splitlines()
    assert len(lines) <= 200, f"README has {len(lines)} lines: move detail into docs/"
    assert "```yaml" in README, "README shows no complete config"


def test_config_reference_is_current():
    text = PAGE.read_text()
    assert render(text) == text, "docs/config.md's field table is stale: run `make docs`"


def test_every_command_the_docs_use_exists():
    listed = CliRunner().invoke(app, ["--help"]).output
    used = set()
    for page in PAGES:
        text = page.read_text()
        blocks = "\n".join(re.findall(r"```bash\n(.*?)```", text, re.S))
        used |= set(re.findall(r"^ortflow ([a-z-]+)", blocks, re.M)) | set(re.findall(r"`ortflow ([a-z-]+)", text))
    assert used, "the docs name no ortflow commands"
    missing = sorted(c for c in used if c not in listed)
    assert not missing, f"the docs use commands the CLI lacks: {missing}"


def test_readme_config_validates(tmp_path):
    """The README's YAML is a complete config: with its model and corpus in place, `ortflow validate` accepts it."""
    from tests.support.exports import export_path

    block = re.search(r"```yaml\n(.*?)```", README, re.S).group(1)
    raw = yaml.safe_load(block)
    (tmp_path / "model.onnx").write_bytes(export_path("gpt2.onnx").read_bytes())
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("def f(x):\n    return x + 1\n" * 400)
    (tmp_path / "my.yaml").write_text(block)
    result = CliRunner().invoke(app, ["validate", str(tmp_path / "my.yaml")])
    assert result.exit_code == 0, result.output
    assert raw["model"]["path"] == "model.onnx"


def _links(text: str) -> list[str]:
    return re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", text)


#: Paths the docs name that a make target writes (git ignores them): path -> what writes it.
BUILT = {"examples/gpt/model.onnx": "make demo (ortflow example gpt)"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_and_paths_exist(page):
    text = page.read_text()
    missing = [link for link in _links(text) if "://" not in link and not (page.parent / link).exists()]
    # Repository paths named in backticks (`ortflow/...`, `tests/...`, `bench/...`, `tools/...`, `docs/...`).
    for path in re.findall(r"`((?:ortflow|tests|bench|tools|docs|examples)/[A-Za-z0-9_./-]+?)`", text):
        if path in BUILT:  # ignored by git, removed by make clean: named as what the demo builds
            assert (ROOT / ".gitignore").read_text().count(f"/{path}") and path in (ROOT / "Makefile").read_text()
            continue
        if not any(ch in path for ch in "*<{") and not (ROOT / path.rstrip("/")).exists():
            missing.append(path)
    assert not missing, f"{page.name} names what the repository lacks: {sorted(set(missing))}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_docs_describe_the_product_not_its_history(page):
    text = page.read_text()
    found = re.findall(r"\bwaves?\b|\bissues? #?\d+|ENGINE_NOTES|\blent\b|run\(kind|\.\./shared", text, re.I)
    assert not found, f"{page.name}: {sorted(set(found))}"


def _prose(text: str) -> str:
    """The page without the fenced code blocks that show sha256 examples (digests there are data, not history)."""
    return re.sub(r"```.*?```", lambda m: "" if "sha256" in m.group(0) else m.group(0), text, flags=re.S)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_docs_hold_no_run_logs(page):
    """Product docs, not a lab notebook: no commit hashes, no dated runs; measurements are cited from bench/reports/."""
    text = _prose(page.read_text())
    hashes = [t for t in re.findall(r"(?<![\w-])[0-9a-f]{7,40}(?![\w-])", text)
              if re.search(r"[a-f]", t) and re.search(r"[0-9]", t)]
    assert not hashes, f"{page.name} names commit-like hashes: {sorted(set(hashes))}"
    dates = re.findall(r"\b20\d\d-[01]\d-[0-3]\d\b(?![ T]\d\d:\d\d)", text)  # a timestamp in shown output is fine
    assert not dates, f"{page.name} holds dated runs {sorted(set(dates))}: cite the report in bench/reports/ instead"
    reports = re.findall(r"bench/reports/[A-Za-z0-9_.-]*[A-Za-z0-9_]", text)
    missing = sorted({r for r in reports if not (ROOT / r).exists()})
    assert not missing, f"{page.name} cites reports that bench/reports/ lacks: {missing}"


def _anchors(page: Path) -> set[str]:
    """The section anchors GitHub gives a page's headings (lower case, punctuation dropped, spaces to hyphens)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    headings = re.findall(r"^#{1,6} (.*)$", text, re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_to_sections_exist(page):
    """A link to `page.md#section` (or `#section` on the same page) names a heading the page has."""
    missing = []
    for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", page.read_text()):
        linked = page.parent / target if target else page
        if "://" not in target and linked.suffix == ".md" and linked.exists() and anchor not in _anchors(linked):
            missing.append(f"{target}#{anchor}")
    assert not missing, f"{page.name} links to sections that do not exist: {sorted(set(missing))}"


def _options() -> dict[str, set[str]]:
    """Every command's options (`checkpoint verify` for a subcommand), as the CLI defines them."""
    import typer.main

    found = {}

    def walk(group, prefix):
        for name, command in group.commands.items():
            if hasattr(command, "commands"):
                walk(command, f"{prefix}{name} ")
            found[prefix + name] = {o for p in command.params for o in (*p.opts, *p.secondary_opts) if o[0] == "-"}

    walk(typer.main.get_command(app), "")
    return found


def test_every_option_the_docs_give_a_command_exists():
    """`ortflow CMD ... --option` in a page's code spans and shell blocks: CMD has that option (and a subcommand such as
    `ortflow checkpoint verify` exists)."""
    options = _options()
    wrong = []
    for page in PAGES:
        text = page.read_text()
        lines = [*re.findall(r"`([^`\n]+)`", text),
                 *(line for block in re.findall(r"```(?:bash)?\n(.*?)```", text, re.S) for line in block.splitlines())]
        for line in lines:
            for command, rest in re.findall(r"\bortflow ((?:checkpoint )?[a-z-]+)([^|;#&`]*)", line):
                rest = re.split(r"\s(?:ortflow|prefect|mpiexec|python)\s", rest)[0]
                if command.startswith("checkpoint ") and command not in options:
                    wrong.append(f"{page.name}: ortflow {command}")
                wrong += [f"{page.name}: ortflow {command} {flag}"
                          for flag in re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", rest)
                          if command in options and flag not in options[command]]
    assert not wrong, f"the docs give commands options they lack: {sorted(set(wrong))}"
