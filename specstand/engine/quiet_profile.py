"""A pass profile taken while no other process uses this process's CPUs.

Adaptive verification prices passes from a profile timed at start. Servers started together profile while
their neighbours load models and profile too: on two AVX2 cores three SmolLM2 servers started at once timed a
plain step at 22 ms against 6 ms alone, and a 6-row verify at 3.2 plain steps against 2.1; one of them then
drafted in 15% of its passes against 35% (benchmarks/results/stand/README.md). The running corrections learn
the shape only from passes of more rows, which a verify priced too high rarely gets to run. So the profile is
taken again, after a pause, while other processes keep the CPUs busy: the CPUs' busy time (Linux's
/proc/stat, every CPU this process may run on) less this process's own says how much of the window others had.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")

# others' CPU seconds per second of the profile's wall time above which the profile is taken again: a quarter
# of a core (a server's HTTP loop, a client polling it, take a few percent); and at least 5 clock ticks, so that
# a profile of a few ticks is not retaken for one tick of a daemon
BUSY_SHARE = 0.25
BUSY_MIN_S = 0.05
QUIET_WAIT_S = 30.0  # how long start-up waits for a quiet window before it keeps the quietest profile
PAUSES_S = (0.5, 1.0, 2.0, 4.0)  # between tries, each scaled by a random 0.5-1.5 so servers fall out of step


@dataclass(frozen=True)
class CpuTimes:
    """CPU seconds so far: `busy` of the CPUs this process may run on, by any process; `own`: this one's."""

    busy: float
    own: float


def cpu_times(stat_path: str = "/proc/stat") -> CpuTimes | None:
    """None where /proc/stat cannot be read (not Linux): the profile is then taken once, as it was."""
    try:
        with open(stat_path) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    allowed = {f"cpu{n}" for n in os.sched_getaffinity(0)} if hasattr(os, "sched_getaffinity") else None
    ticks = 0
    for line in lines:
        name, *fields = line.split()
        if not name.startswith("cpu") or name == "cpu" or (allowed is not None and name not in allowed):
            continue
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
        ticks += user + nice + system + irq + softirq + steal  # steal: a hypervisor ran someone else
    own = os.times()
    return CpuTimes(ticks / os.sysconf("SC_CLK_TCK"), own.user + own.system)


def others_share(before: CpuTimes, after: CpuTimes, wall_s: float) -> float:
    """Other processes' CPU seconds per wall second between two readings (0 below BUSY_MIN_S of them)."""
    others = (after.busy - before.busy) - (after.own - before.own)
    return others / max(wall_s, 1e-9) if others >= BUSY_MIN_S else 0.0


def profile_when_quiet(profile: Callable[[], T], load: Callable[[], CpuTimes | None] = cpu_times,
                       sleep: Callable[[float], None] = time.sleep, wait_s: float | None = None,
                       rng: random.Random | None = None) -> T:
    """`profile()`, taken again after a pause while others' share of the CPUs during it was above BUSY_SHARE,
    for up to `wait_s` seconds of pauses (default QUIET_WAIT_S); then the quietest one taken, with a warning."""
    wait_s = QUIET_WAIT_S if wait_s is None else wait_s
    rng = rng or random.Random()
    best: tuple[float, T] | None = None
    waited, tries = 0.0, 0
    while True:
        before, started = load(), time.perf_counter()
        result = profile()
        after, wall = load(), time.perf_counter() - started
        if before is None or after is None:
            return result
        share = others_share(before, after, wall)
        if best is None or share < best[0]:
            best = (share, result)
        if share <= BUSY_SHARE:
            return result
        pause = PAUSES_S[min(tries, len(PAUSES_S) - 1)] * rng.uniform(0.5, 1.5)
        tries += 1
        if waited + pause > wait_s:
            logger.warning("the pass profile was timed while other processes used %.2f CPUs: adaptive "
                           "verification corrects it from the passes it runs", best[0])
            return best[1]
        sleep(pause)
        waited += pause
