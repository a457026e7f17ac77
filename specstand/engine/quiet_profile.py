"""A pass profile taken while no other process competes for this process's CPUs.

Adaptive verification prices passes from a profile timed at start. Servers started together profile while
their neighbours load models and profile too: on two AVX2 cores three SmolLM2 servers started at once timed a
plain step at 22 ms against 5-7 ms alone, and a 6-row verify at 3.2 plain steps against 1.8-2.4; one of them
then drafted in half as many passes as its twin (benchmarks/results/stand/README.md). The running corrections
learn the shape only from passes of more rows, which a verify priced too high rarely gets to run. So the
profile waits for other processes to leave the CPUs (three Qwen servers started together load for over a
minute), and is taken again where they competed during it: the busy time of the CPUs this process may run on
(Linux's /proc/stat) less its own, beyond the CPUs its threads leave spare.
"""

from __future__ import annotations

import logging
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

from specstand.engine.adaptive import PassCost, profile_pass_cost
from specstand.runner import PassInput, TargetRunner

logger = logging.getLogger(__name__)
T = TypeVar("T")

# Others' CPUs beyond the spare ones, per thread of this process, above which the profile is taken again: on
# two threads a quarter of a core, about what slows each thread by an eighth (a server's HTTP loop, a client
# polling it, take a few percent). And at least 5 clock ticks of others, so that a profile of a few ticks is
# not taken again for one tick of a daemon.
BUSY_PER_THREAD = 0.125
BUSY_MIN_S = 0.05
QUIET_WAIT_S = 120.0  # start-up's limit (profiles and waits), past a neighbour's model load, then the quietest
WAIT_ENV = "SPECSTAND_QUIET_WAIT_S"  # overrides it (tests set 0: whether a test waits must not depend on the host)
WINDOW_S = 0.5  # a window watched before each try, times a random 0.5-1.5


@dataclass(frozen=True)
class CpuTimes:
    """CPU seconds so far: `busy_s` of each CPU this process may run on, by any process; `own_s`: this one's
    (every thread, not its children: they compete like any other process)."""

    busy_s: dict[str, float]
    own_s: float


def cpu_times(stat_path: str = "/proc/stat") -> CpuTimes | None:
    """None where /proc/stat cannot be read or names none of this process's CPUs (a container that numbers
    them its own way): the profile is then taken once, as before there was a check."""
    try:
        with open(stat_path) as f:
            lines = f.read().splitlines()
        allowed = {f"cpu{n}" for n in os.sched_getaffinity(0)}
        tick = os.sysconf("SC_CLK_TCK")
        busy = {}
        for line in lines:
            name, *fields = line.split() or [""]
            if name in allowed:
                user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
                busy[name] = (user + nice + system + irq + softirq + steal) / tick  # user includes guest
    except (OSError, ValueError, AttributeError):  # AttributeError: no sched_getaffinity off Linux
        return None
    if not busy:
        logger.debug("/proc/stat lists none of this process's CPUs: the pass profile is taken once")
        return None
    own = os.times()
    return CpuTimes(busy, own.user + own.system)


def others_cpus(before: CpuTimes, after: CpuTimes, wall_s: float) -> float:
    """Other processes' CPUs on average between two readings (0 below BUSY_MIN_S of CPU seconds); CPUs missing
    from either reading (taken offline, or out of the affinity since) are left out."""
    shared = before.busy_s.keys() & after.busy_s.keys()
    busy = sum(after.busy_s[cpu] - before.busy_s[cpu] for cpu in shared)
    others = busy - (after.own_s - before.own_s)
    return others / max(wall_s, 1e-9) if others >= BUSY_MIN_S else 0.0


def contention(before: CpuTimes, after: CpuTimes, wall_s: float, threads: int) -> float:
    """Others' CPUs beyond those this process's `threads` leave spare, per thread: the share of its threads'
    time they could have taken."""
    spare = max(0, len(before.busy_s.keys() & after.busy_s.keys()) - threads)
    return max(0.0, others_cpus(before, after, wall_s) - spare) / max(threads, 1)


def quiet_wait_s(default: float = QUIET_WAIT_S) -> float:
    """How long start-up may wait for quiet CPUs: `default`, unless WAIT_ENV says otherwise."""
    text = os.environ.get(WAIT_ENV, str(default))
    try:
        return max(0.0, float(text))
    except ValueError:
        raise ValueError(f"{WAIT_ENV} must be a number of seconds, not {text!r}") from None


def quiet_window(threads: int, load: Callable[[], CpuTimes | None], sleep: Callable[[float], None],
                 clock: Callable[[], float], rng: random.Random) -> bool:
    """Whether others left this process's CPUs alone while it watched, idle, for a window of random length (so
    that servers waiting together do not all find the same moment quiet)."""
    before, started = load(), clock()
    sleep(WINDOW_S * rng.uniform(0.5, 1.5))
    after = load()
    return before is None or after is None or contention(before, after, clock() - started, threads) <= BUSY_PER_THREAD


def profile_when_quiet(profile: Callable[[], T], threads: int, load: Callable[[], CpuTimes | None] = cpu_times,
                       sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic,
                       wait_s: float | None = None, rng: random.Random | None = None) -> T:
    """`profile()` once a watched window was quiet, taken again while others' contention during it was above
    BUSY_PER_THREAD, for up to `wait_s` seconds in all (default: quiet_wait_s()); then the quietest one taken,
    with a warning. At least one profile is always taken."""
    deadline = clock() + (quiet_wait_s() if wait_s is None else wait_s)
    if load() is None:  # nothing to watch: no window is waited for
        return profile()
    rng = rng or random.Random()
    quietest: tuple[float, T] | None = None  # (contention, profile)
    said = False
    while True:
        while clock() < deadline and not quiet_window(threads, load, sleep, clock, rng):
            if not said:  # neighbours loading or profiling: a profile taken now would be taken again
                logger.warning("waiting for other processes to leave this one's CPUs before timing its passes "
                               "(up to %.0f s; %s sets the limit)", deadline - clock(), WAIT_ENV)
                said = True
        before, started = load(), clock()
        result = profile()
        after, wall = load(), clock() - started
        if before is None or after is None:
            return result
        share = contention(before, after, wall, threads)
        if share <= BUSY_PER_THREAD:
            return result
        if quietest is None or share < quietest[0]:
            quietest = (share, result)
        if clock() + wall > deadline:  # another try would end past the deadline
            break
    logger.warning("the pass profile was timed while other processes took %.0f%% of this one's CPU time: "
                   "adaptive verification corrects it from the passes it runs", 100 * quietest[0])
    return quietest[1]


def profile_target_passes(runner: TargetRunner, row_unit: int, max_rows: int, wait_s: float) -> PassCost:
    """Time the target's passes of 1 .. max_rows rows in a scratch slot (before any request takes one), once
    no other process keeps this one's CPUs busy: servers started together profile while their neighbours
    load, and such a profile is taken again."""
    slot = runner.cache.allocate()

    def run_pass(rows: int, cached: int) -> None:  # what the cache holds does not change the time
        runner.cache.set_length_for_timing(slot, cached)
        runner.run([PassInput(slot, [0] * rows)], -(-rows // row_unit) * row_unit)

    try:
        max_rows, context = min(max_rows, runner.capacity // 2), min(1024, runner.capacity // 2)
        return profile_when_quiet(lambda: profile_pass_cost(run_pass, max_rows, context), torch.get_num_threads(),
                                  wait_s=wait_s)
    finally:
        runner.cache.release(slot)
