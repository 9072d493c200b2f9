"""One `disagg` command: every subcommand is reachable from it and names itself in its help."""

from __future__ import annotations

import pytest

from disagg import cli

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("command", sorted(cli.DELEGATED) + ["generate"])
def test_every_subcommand_answers_help_as_disagg_command(command, capsys):
    with pytest.raises(SystemExit) as done:
        cli.main([command, "--help"])
    assert done.value.code == 0
    assert f"disagg {command}" in capsys.readouterr().out


def test_the_top_level_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    out = capsys.readouterr().out
    assert all(name in out for name in [*cli.DELEGATED, "generate"])


def test_an_unknown_subcommand_is_refused(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["frobnicate"])
    assert done.value.code == 2
    assert "invalid choice" in capsys.readouterr().err
