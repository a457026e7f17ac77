"""Helpers of the CLI tests."""

from __future__ import annotations

from specstand.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """`specstand ARGV` in this process: exit code, stdout, stderr."""
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err
