"""`specstand models` (list, fetch the presets) and `specstand doctor` (what this CPU gets)."""

from __future__ import annotations

import argparse
from collections.abc import Callable

from specstand.cli.common import CliError, CliParser, log


def add_parsers(commands: argparse._SubParsersAction) -> None:
    models = commands.add_parser("models", help="list or fetch the model presets")
    models_cmd = models.add_subparsers(dest="models_command", required=True, parser_class=CliParser)
    models_cmd.add_parser("list", help="show the presets and whether they are cached")
    fetch = models_cmd.add_parser("fetch", help="download and convert a preset once")
    fetch.add_argument("name", help="the preset (see `specstand models list`)")

    commands.add_parser("doctor", help="CPU features, the kernel path chosen, peak compute and memory bandwidth")


def cmd_models(args: argparse.Namespace) -> None:
    from specstand.models.presets import PRESETS, fetch, is_fetched, preset_dir

    if args.models_command == "list":
        for name in PRESETS:
            state = f"cached in {preset_dir(name)}" if is_fetched(name) else "not fetched"
            print(f"{name:24s} {state}")
        return
    if args.name not in PRESETS:
        raise CliError(f"unknown model preset {args.name!r} (presets: {', '.join(PRESETS)})")
    print(fetch(args.name, log=log))


def cmd_doctor(args: argparse.Namespace) -> None:
    from specstand import kernels
    from specstand.models import dtype_choice
    from specstand.models.presets import PRESETS, is_fetched, preset_dir

    for line in kernels.describe():
        print(line)
    fetched = {name: preset_dir(name) for name in PRESETS if is_fetched(name)}
    for line in dtype_choice.describe(fetched) if fetched else ["presets: none fetched (specstand models fetch NAME)"]:
        print(line)


COMMANDS: dict[str, Callable[[argparse.Namespace], None]] = {"models": cmd_models, "doctor": cmd_doctor}
