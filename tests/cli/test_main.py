"""The command line as a whole: the console entry point, one-line failures, tracebacks on demand, help everywhere."""

from __future__ import annotations

import argparse
import subprocess
import sys

from tests.cli import run_cli


def test_console_entry_point_has_no_traceback(tiny_model_dir):
    done = subprocess.run(
        [sys.executable, "-m", "specstand.cli", "generate", "--model", str(tiny_model_dir), "--prompt", "w1",
         "--max-tokens", "-5"],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode != 0
    assert done.stderr.strip() == "specstand: error: --max-tokens must be > 0"


def test_debug_prints_the_traceback(capsys, monkeypatch):
    argv = ("generate", "--model", "/no/such/model", "--prompt", "w1")
    code, _, err = run_cli(capsys, *argv)
    assert code == 1 and len(err.strip().splitlines()) == 1 and "Traceback" not in err
    monkeypatch.setenv("SPECSTAND_DEBUG", "1")
    code, _, err = run_cli(capsys, *argv)
    lines = err.strip().splitlines()
    assert code == 1 and lines[0].startswith("Traceback")
    assert lines[-1].startswith("specstand: error: cannot load model")


def _options(parser: argparse.ArgumentParser):
    """Every argument of every command, as (command, argument)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                yield from _options(sub)
        elif not isinstance(action, argparse._HelpAction):
            yield parser.prog, action


def test_every_flag_of_every_command_has_help():
    from specstand.cli import build_parser

    found = list(_options(build_parser()))
    assert len(found) > 100  # the walk reached the commands' own flags
    missing = [f"{command} {'/'.join(action.option_strings) or action.dest}" for command, action in found
               if not (action.help or "").strip()]
    assert missing == []
