"""The commands' ``--help`` prose wraps at the terminal's width, not at the docstrings' line breaks."""

from __future__ import annotations

from typer.testing import CliRunner

from ortflow.cli import app
from ortflow.cli.app import reflow


def test_a_paragraph_of_a_command_help_is_one_line_on_a_wide_terminal():
    result = CliRunner().invoke(app, ["validate", "--help"], env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    # "column and" ends a docstring line, "the first rows'" starts the next: one line of the help
    assert "every data source, column and the first rows' dtypes and shapes" in result.output


def test_reflow_joins_a_paragraph_s_lines_and_keeps_lists_and_indented_lines():
    doc = "First line\ngoes on.\n\nA paragraph\nof two lines.\n\n- a list item\n- another\n\nText\n    indented"
    assert reflow(doc) == ("First line goes on.\n\nA paragraph of two lines.\n\n- a list item\n- another\n\n"
                           "Text\n    indented")
