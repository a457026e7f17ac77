"""Building and loading the extension: a build killed half way never blocks the next start."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from specstand import kernels
from tests.conftest import KERNEL_PATHS

pytestmark = pytest.mark.skipif(not KERNEL_PATHS, reason="the kernels do not build on this machine")


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load(tmp_path):
    """torch's build lock is a file its builder removes when done; a server stopped while it built the kernels
    left one behind, and the next start waited on it forever. A load now drops it once it is stale and goes on."""
    built = Path(kernels.load().__file__).parent  # this source version's build folder
    copy = tmp_path / "kernels" / built.name
    shutil.copytree(built, copy)
    (copy / "specstand.lock").unlink(missing_ok=True)
    left = copy / "lock"  # what a builder killed some minutes ago left
    left.touch()
    stale = time.time() - kernels.STALE_BUILD_LOCK_SECONDS - 1
    os.utime(left, (stale, stale))
    loaded = subprocess.run([sys.executable, "-c", "from specstand import kernels; print(kernels.load().__file__)"],
                            env={**os.environ, "SPECSTAND_HOME": str(tmp_path)}, capture_output=True, text=True,
                            timeout=300)
    assert loaded.returncode == 0, loaded.stderr
    assert Path(loaded.stdout.strip()).parent == copy
    assert not (copy / "lock").exists()


def test_a_lock_of_a_build_still_running_is_waited_for(tmp_path):
    """A fresh lock file may belong to a specstand from before the flock, building right now: a load waits for
    it rather than building beside it, and goes on once that builder removes it."""
    built = Path(kernels.load().__file__).parent
    copy = tmp_path / "kernels" / built.name
    shutil.copytree(built, copy)
    (copy / "specstand.lock").unlink(missing_ok=True)
    left = copy / "lock"
    left.touch()
    loading = subprocess.Popen([sys.executable, "-c", "from specstand import kernels; kernels.load()"],
                               env={**os.environ, "SPECSTAND_HOME": str(tmp_path)})
    try:
        time.sleep(5)
        assert loading.poll() is None and left.exists()  # still waiting, the other builder's lock untouched
        left.unlink()  # that builder finished
        assert loading.wait(timeout=300) == 0
    finally:
        loading.kill()


def test_a_build_that_failed_is_not_tried_again_in_the_process():
    """A load asks for the kernels several times (the path, the compiled forward, the dtype choice): on a broken
    toolchain each ask was another compile."""
    script = (
        "from specstand import kernels\n"
        "tries = []\n"
        "def failing():\n"
        "    tries.append(1)\n"
        "    raise kernels.KernelsUnavailable('the kernels did not build (test)')\n"
        "kernels._build = failing\n"
        "for _ in range(3):\n"
        "    try:\n"
        "        kernels.load()\n"
        "    except kernels.KernelsUnavailable as error:\n"
        "        assert 'did not build' in str(error)\n"
        "print(len(tries), kernels.chosen_path()[0])\n"
    )
    ran = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.split() == ["1", "python"]
