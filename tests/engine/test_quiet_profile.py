import logging
import os
import random
import subprocess
import sys
import time

import pytest

from specstand.engine.quiet_profile import (
    CpuTimes,
    contention,
    cpu_times,
    others_cpus,
    profile_when_quiet,
    quiet_wait_s,
)


class ScriptedHost:
    """Two CPUs, a clock that waits advance, and neighbours: they keep both CPUs busy until `busy_until`, and
    take `during[i]` CPUs while profile i runs (one second)."""

    def __init__(self, busy_until: float, during: list[float]) -> None:
        self.busy_until, self.during = busy_until, list(during)
        self.now = self.busy = 0.0
        self.profiles = 0

    def load(self) -> CpuTimes:
        return CpuTimes({"cpu0": self.busy / 2, "cpu1": self.busy / 2}, 0.0)

    def sleep(self, seconds: float) -> None:
        self.busy += 2 * max(0.0, min(self.now + seconds, self.busy_until) - self.now)
        self.now += seconds

    def clock(self) -> float:
        return self.now

    def profile(self) -> int:
        self.profiles += 1
        self.busy += self.during.pop(0)
        self.now += 1.0
        return self.profiles


def taken(host: ScriptedHost, wait_s: float) -> int:
    return profile_when_quiet(host.profile, 2, host.load, host.sleep, host.clock, wait_s, random.Random(0))


def test_a_profile_waits_for_neighbours_that_load_to_leave_the_cpus(caplog):
    host = ScriptedHost(busy_until=20.0, during=[0.1])
    with caplog.at_level(logging.WARNING):
        assert taken(host, 120.0) == 1  # one profile, after they left
    assert host.now >= 21.0 and "waiting for other processes" in caplog.text


def test_a_profile_taken_beside_busy_neighbours_is_taken_again():
    host = ScriptedHost(busy_until=0.0, during=[2.0, 1.0, 0.1])
    assert taken(host, 120.0) == 3  # the third: others took 0.1 CPU of two, 5% of each thread


def test_a_host_that_never_quiets_keeps_the_quietest_profile_within_the_wait(caplog):
    host = ScriptedHost(busy_until=0.0, during=[2.0, 0.5, 1.5] * 20)
    with caplog.at_level(logging.WARNING):
        assert taken(host, 10.0) == 2  # the one while others took the least
    assert host.profiles >= 3 and host.now <= 11.75  # a last window may start before the deadline
    assert "other processes took 25% of this one's CPU time" in caplog.text


def test_neighbours_busy_past_the_wait_still_leave_one_profile(caplog):
    host = ScriptedHost(busy_until=float("inf"), during=[2.0] * 5)
    with caplog.at_level(logging.WARNING):
        assert taken(host, 10.0) == 1
    assert 10.0 <= host.now <= 11.75 and "took 100%" in caplog.text  # windows to the deadline, one profile


def test_without_cpu_readings_the_profile_is_taken_once():
    host = ScriptedHost(busy_until=float("inf"), during=[2.0])
    assert profile_when_quiet(host.profile, 2, lambda: None, host.sleep, host.clock, 30.0) == 1
    assert host.profiles == 1 and host.now == 1.0  # the profile alone: no window watched


def test_contention_counts_others_beyond_the_spare_cpus_per_thread():
    def reading(busy: float, own: float, cpus: int = 4) -> CpuTimes:
        return CpuTimes({f"cpu{n}": busy / cpus for n in range(cpus)}, own)

    assert others_cpus(reading(0, 0), reading(0.04, 0), 0.01) == 0.0  # 4 ticks: below the floor
    assert others_cpus(reading(0, 0), reading(1.0, 1.0), 1.0) == 0.0  # all of it this process's own
    assert others_cpus(reading(0, 0), reading(3.0, 1.0), 1.0) == pytest.approx(2.0)
    assert contention(reading(0, 0), reading(3.0, 1.0), 1.0, threads=2) == 0.0  # 2 others on the 2 spare CPUs
    assert contention(reading(0, 0), reading(3.0, 1.0), 1.0, threads=4) == pytest.approx(0.5)
    gone = CpuTimes({"cpu0": 1.0}, 1.0)  # cpu1 taken offline: its counter's history is not a burst of work
    assert others_cpus(CpuTimes({"cpu0": 0.0, "cpu1": 0.0}, 0.0), gone, 1.0) == 0.0


def test_cpu_readings_see_a_busy_neighbour_process():
    if cpu_times() is None:
        pytest.skip("no /proc/stat listing this process's CPUs")
    spin = "import time\nprint('spinning', flush=True)\nt = time.time()\nwhile time.time() - t < 2:\n  pass"
    neighbour = subprocess.Popen([sys.executable, "-c", spin], stdout=subprocess.PIPE, text=True)
    try:
        assert neighbour.stdout.readline().strip() == "spinning"
        before, started = cpu_times(), time.perf_counter()
        time.sleep(0.5)
        after = cpu_times()
    finally:
        neighbour.kill()
        neighbour.wait()
    assert others_cpus(before, after, time.perf_counter() - started) > 0.5  # it kept about one CPU busy


def test_cpu_readings_count_only_this_process_cpus_and_leave_guest_time_in_user(tmp_path):
    if not hasattr(os, "sched_getaffinity"):
        pytest.skip("no CPU affinity on this system")
    allowed = sorted(os.sched_getaffinity(0))
    lines = ["cpu  9 9 9 9 9 9 9 9 0 0"]
    lines += [f"cpu{n} 100 0 50 1000 7 0 0 10 40 0" for n in allowed]  # guest 40 is part of user's 100
    lines += [f"cpu{max(allowed) + 1} 99999 0 0 0 0 0 0 0 0 0", "intr 1 2 3", ""]
    stat = tmp_path / "stat"
    stat.write_text("\n".join(lines))
    reading = cpu_times(str(stat))
    assert set(reading.busy_s) == {f"cpu{n}" for n in allowed}
    assert sum(reading.busy_s.values()) == pytest.approx(160 * len(allowed) / os.sysconf("SC_CLK_TCK"))
    stat.write_text("cpu  1 2 3 4 5 6 7 8 0 0\ncpu99999 1 2 3 4 5 6 7 8 0 0\n")  # none of this process's CPUs
    assert cpu_times(str(stat)) is None


def test_the_wait_limit_comes_from_the_environment_or_says_what_is_wrong(monkeypatch):
    monkeypatch.delenv("SPECSTAND_QUIET_WAIT_S", raising=False)
    assert quiet_wait_s() == 120.0 and quiet_wait_s(10.0) == 10.0  # a server's limit, and generate's
    monkeypatch.setenv("SPECSTAND_QUIET_WAIT_S", "7.5")
    assert quiet_wait_s() == 7.5 and quiet_wait_s(10.0) == 7.5
    monkeypatch.setenv("SPECSTAND_QUIET_WAIT_S", "soon")
    with pytest.raises(ValueError, match="SPECSTAND_QUIET_WAIT_S must be a number of seconds"):
        quiet_wait_s()
