"""The `specstand` command line. Every failure ends in one readable line and a non-zero exit code.

Each command family lives in its own module (models, serving, stand, drafters) with its parsers and its
commands; this module assembles them and turns failures into that line.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

from specstand.cli import drafters, models, serving, stand
from specstand.cli.common import CliError, CliParser

DEBUG_ENV = "SPECSTAND_DEBUG"  # set to 1: a failure prints its full traceback instead of one line
FAMILIES = (models, serving, stand, drafters)  # in the order `specstand --help` lists their commands
COMMANDS = {name: command for family in FAMILIES for name, command in family.COMMANDS.items()}


def build_parser() -> argparse.ArgumentParser:
    parser = CliParser(prog="specstand", description="Lossless speculative decoding for LLM agents.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=CliParser)
    for family in FAMILIES:
        family.add_parsers(commands)
    return parser


def main(argv: list[str] | None = None) -> int:
    try:
        args = build_parser().parse_args(argv)
        COMMANDS[args.command](args)
    except CliError as error:
        _print_failure(str(error))
        return 2
    except (ValueError, RuntimeError, OSError) as error:
        _print_failure(str(error).splitlines()[0] if str(error) else type(error).__name__)
        return 1
    except KeyboardInterrupt:
        print("specstand: interrupted", file=sys.stderr)
        return 130
    return 0


def _print_failure(message: str) -> None:
    """One line; the whole traceback first where SPECSTAND_DEBUG=1."""
    if os.environ.get(DEBUG_ENV) == "1":
        traceback.print_exc()
    print(f"specstand: error: {message}", file=sys.stderr)
