"""Where specstand keeps its files, and files written whole or not at all: a crash mid-write never leaves a torn
checkpoint, data file or report under its final name. Every module that writes results goes through here."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path


def specstand_home() -> Path:
    """The folder for what specstand fetches, builds and measures once per machine: models, data, kernel builds,
    dtype costs ($SPECSTAND_HOME, by default ~/.cache/specstand)."""
    return Path(os.environ.get("SPECSTAND_HOME", Path.home() / ".cache" / "specstand"))


@contextmanager
def locked(path: Path) -> Iterator[None]:
    """An exclusive flock on `path` (made if missing) while the block runs, so that processes reading, changing
    and writing one file take turns; the kernel drops it if its holder dies."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        yield


def write_atomic(path: Path, write: Callable[[Path], object]) -> None:
    """Calls write(tmp) for a hidden name beside `path` (same suffix, so writers that go by it still do; this
    process's own, so two processes writing one file never share it), flushes it to disk, then renames it over
    `path` in one step; a failed write removes it."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{os.getpid()}.tmp{path.suffix}")
    try:
        write(tmp)
        with tmp.open("rb") as written:
            os.fsync(written.fileno())
        os.replace(tmp, path)
    except BaseException:  # a failed or interrupted write leaves no half file behind either
        tmp.unlink(missing_ok=True)
        raise


def sync_tree(folder: Path) -> None:
    """Flushes every file under `folder` to disk, for a folder about to appear by a rename: after a power cut
    the rename can survive while file data still in the page cache does not, leaving empty files under the
    final name."""
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            with path.open("rb") as file:
                os.fsync(file.fileno())


def write_text_atomic(path: Path, text: str) -> None:
    write_atomic(path, lambda tmp: tmp.write_text(text))
