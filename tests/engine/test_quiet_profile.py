import logging
import os
import random
import subprocess
import sys
import time

import pytest

from specstand.engine.quiet_profile import BUSY_SHARE, CpuTimes, cpu_times, others_share, profile_when_quiet


class ScriptedLoad:
    """CPU readings around each profile: `shares[i]` of others' CPU over profile i's wall time."""

    def __init__(self, shares: list[float]) -> None:
        self.shares, self.readings = list(shares), 0
        self.busy = 0.0

    def __call__(self) -> CpuTimes:
        if self.readings % 2 == 1:  # after a profile: others used shares[i] CPUs over its (tiny) wall time
            self.busy += self.shares.pop(0) * 1000.0
        self.readings += 1
        return CpuTimes(self.busy, 0.0)


def profiles():
    count = 0

    def profile() -> int:
        nonlocal count
        count += 1
        time.sleep(0.001)
        return count

    return profile


def test_a_profile_taken_beside_busy_neighbours_is_taken_again_after_pauses():
    pauses = []
    result = profile_when_quiet(profiles(), ScriptedLoad([1e9, 1e9, 0.0]), pauses.append, wait_s=30.0,
                                rng=random.Random(0))
    assert result == 3  # the third, quiet profile
    assert len(pauses) == 2 and 0.25 <= pauses[0] <= 0.75 and 0.5 <= pauses[1] <= 1.5  # growing, jittered


def test_a_machine_that_never_quiets_keeps_the_quietest_profile_and_says_so(caplog):
    pauses = []
    with caplog.at_level(logging.WARNING):
        result = profile_when_quiet(profiles(), ScriptedLoad([3e9, 1e9, 2e9] * 20), pauses.append, wait_s=5.0,
                                    rng=random.Random(0))
    assert sum(pauses) <= 5.0 and len(pauses) >= 2
    assert result % 3 == 2  # a profile taken while others used the least
    assert "other processes used" in caplog.text


def test_without_cpu_readings_the_profile_is_taken_once():
    pauses = []
    assert profile_when_quiet(profiles(), lambda: None, pauses.append, wait_s=30.0) == 1 and pauses == []


def test_a_few_ticks_of_others_do_not_count_as_busy():
    assert others_share(CpuTimes(0.0, 0.0), CpuTimes(0.04, 0.0), 0.01) == 0.0  # 4 ticks: below the floor
    assert others_share(CpuTimes(0.0, 0.0), CpuTimes(1.5, 1.0), 1.0) == pytest.approx(0.5)
    assert others_share(CpuTimes(0.0, 0.0), CpuTimes(1.0, 1.0), 1.0) == 0.0  # all of it our own


def test_cpu_readings_tell_a_busy_neighbour_from_this_process_own_work():
    if cpu_times() is None:
        pytest.skip("no /proc/stat on this system")
    before, started = cpu_times(), time.perf_counter()
    while time.perf_counter() - started < 0.5:  # our own work: not others'
        pass
    after = cpu_times()
    assert after.own - before.own >= 0.3
    spin = "import time\nt = time.perf_counter()\nwhile time.perf_counter() - t < 1.0: pass"
    neighbour = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.2)  # its interpreter started
        before, started = cpu_times(), time.perf_counter()
        time.sleep(0.6)
        after = cpu_times()
    finally:
        neighbour.wait()
    assert others_share(before, after, time.perf_counter() - started) > BUSY_SHARE


def test_cpu_readings_count_only_the_cpus_this_process_may_run_on(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    outside = max(allowed) + 1
    lines = ["cpu  9 9 9 9 9 9 9 9 0 0"]
    lines += [f"cpu{n} 100 0 50 1000 7 0 0 10 0 0" for n in allowed]
    lines += [f"cpu{outside} 99999 0 0 0 0 0 0 0 0 0", "intr 1 2 3"]
    stat = tmp_path / "stat"
    stat.write_text("\n".join(lines) + "\n")
    assert cpu_times(str(stat)).busy == pytest.approx(160 * len(allowed) / os.sysconf("SC_CLK_TCK"))
