"""The shape of the package a newcomer reads: small modules, small functions, imports that only go down the
layers docs/architecture.md draws, and no block of code written twice."""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "specstand"
MAX_MODULE_LINES = 450
MAX_FUNCTION_LINES = 60
DUPLICATE_LINES = 6

# docs/architecture.md, "Layers": a package imports only from packages of a lower layer
LAYERS = {
    "files": 0,
    "kernels": 1,
    "runner": 2,
    "verification": 3, "drafters": 3, "models": 3,
    "engine": 4, "workloads": 4,
    "server": 5, "training": 5, "interop": 5, "recorder": 5,
    "bench": 6,
    "cli": 7,
}


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def package_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE).parts
    return parts[0] if len(parts) > 1 else parts[0].removesuffix(".py")


def test_every_package_has_a_layer():
    packages = {package_of(path) for path in modules()} - {"__init__"}
    assert packages == set(LAYERS)


def test_no_module_is_longer_than_the_limit():
    lines = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in modules()}
    long = {name: n for name, n in lines.items() if n > MAX_MODULE_LINES}
    assert long == {}


def test_no_function_is_longer_than_the_limit():
    long = {}
    for path in modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long[f"{path.relative_to(PACKAGE)}:{node.name}"] = lines
    assert long == {}


def imported_packages(path: Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] if node.module != "specstand" else [f"specstand.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        found |= {name.split(".")[1] for name in names if name.startswith("specstand.")}
    return found


def test_imports_only_go_down_the_layers():
    upward = []
    for path in modules():
        own = package_of(path)
        if own == "__init__":
            continue
        for other in imported_packages(path) - {own}:
            if LAYERS[other] >= LAYERS[own]:
                upward.append(f"{path.relative_to(PACKAGE)} imports {other}")
    assert upward == []


def normalized_lines(path: Path) -> list[tuple[int, str]]:
    """Code lines stripped of indentation; blank lines, comments, imports and lone brackets do not count."""
    kept = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        text = line.strip()
        if not text or text.startswith(("#", "import ", "from ")) or re.fullmatch(r"[\)\]\}:,]*", text):
            continue
        kept.append((number, text))
    return kept


def test_no_block_is_written_twice():
    seen: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for path in modules():
        lines = normalized_lines(path)
        for start in range(len(lines) - DUPLICATE_LINES + 1):
            window = tuple(text for _, text in lines[start : start + DUPLICATE_LINES])
            seen[window].append(f"{path.relative_to(PACKAGE)}:{lines[start][0]}")
    twice = [places for places in seen.values() if len(places) > 1]
    assert twice == []


def test_imports_are_absolute():
    """The layer check reads absolute imports only: a relative one would pass it unchecked."""
    relative = [f"{path.relative_to(PACKAGE)}:{node.lineno}" for path in modules()
                for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.ImportFrom) and node.level]
    assert relative == []
