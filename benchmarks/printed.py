"""What a benchmark prints, kept so that `--out` gets the same lines."""

from __future__ import annotations

from pathlib import Path


class Printed:
    """say = Printed(); say("a line"); ...; say.write(args.out)"""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def __call__(self, line: str = "") -> None:
        print(line, flush=True)
        self.lines.append(line)

    def write(self, path: Path | None) -> None:
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\n".join(self.lines) + "\n")
