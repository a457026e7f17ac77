"""Replay timing against a fake endpoint with known latencies, in virtual time from 0: the loop's clock jumps to the
next timer whenever every task waits, so the times below are exact however busy the host is."""

import asyncio
import selectors

import pytest

from specstand.bench.replay import Answer, assign_turns, replay
from specstand.workloads import Call, Turn

LATENCY_S = {"a": 0.10, "b": 0.20, "c": 0.10, "d": 0.10, "s": 0.15, "quick": 0.5, "slow": 1.0}
TOLERANCE_S = 1e-6  # the virtual clock's resolution


class _VirtualClock(selectors.DefaultSelector):
    """A selector that, when nothing is ready and the loop would sleep until its next timer, moves the clock
    there instead. (looptime does this, but its pytest plugin needs pytest-asyncio and breaks every fixture
    without it.)"""

    now = 0.0

    def select(self, timeout=None):
        ready = super().select(0)
        if ready or timeout is None:  # no timer: only i/o can wake the loop
            return ready or super().select(timeout)
        self.now += timeout
        return []


class _VirtualTimeLoop(asyncio.SelectorEventLoop):
    def __init__(self):
        self._clock = _VirtualClock()
        super().__init__(self._clock)

    def time(self) -> float:
        return self._clock.now


def _run(coroutine):
    loop = _VirtualTimeLoop()
    try:
        return loop.run_until_complete(coroutine)
    finally:
        loop.close()


def _now() -> float:
    return asyncio.get_running_loop().time()


class FakeEndpoint:
    def __init__(self, fail: set[str] = frozenset()):
        self.fail = fail
        self.active = 0
        self.max_active = 0
        self.starts: list[float] = []
        self.cancelled: list[str] = []

    async def complete(self, call):
        self.starts.append(_now())
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await asyncio.sleep(LATENCY_S[call.id])
            if call.id in self.fail:
                raise RuntimeError("boom")
            return Answer(f"answer {call.id}", 3)
        except asyncio.CancelledError:
            self.cancelled.append(call.id)
            raise
        finally:
            self.active -= 1


def _turn(turn_id):
    # a -> (b, c after a 50 ms pause) -> d: d starts at max(0.1 + 0.2, 0.1 + 0.05 + 0.1) = 0.3, ends at 0.4
    return Turn(turn_id, [
        Call(id="a", prompt="p"),
        Call(id="b", prompt="p", depends_on=["a"]),
        Call(id="c", prompt="p", depends_on=["a"], delay_ms=50),
        Call(id="d", prompt="p", depends_on=["b", "c"]),
    ])


def test_turn_time_follows_dependencies_and_delays():
    records, wall = _run(replay([_turn("t0")], FakeEndpoint(), users=1))
    (record,) = records
    assert record.duration == pytest.approx(0.40, abs=TOLERANCE_S)
    starts = {c.call_id: c.start - record.start for c in record.calls}
    assert starts["a"] == pytest.approx(0.0, abs=TOLERANCE_S)
    assert starts["b"] == pytest.approx(0.10, abs=TOLERANCE_S)
    assert starts["c"] == pytest.approx(0.15, abs=TOLERANCE_S)
    assert starts["d"] == pytest.approx(0.30, abs=TOLERANCE_S)
    assert wall == pytest.approx(0.40, abs=TOLERANCE_S)


def test_users_replay_their_turns_one_after_another_in_parallel():
    turns = [_turn(f"t{i}") for i in range(4)]
    endpoint = FakeEndpoint()
    records, wall = _run(replay(turns, endpoint, users=2))
    assert sorted(r.turn_id for r in records) == [f"t{i}" for i in range(4)]
    assert all(r.duration == pytest.approx(0.40, abs=TOLERANCE_S) for r in records)
    assert wall == pytest.approx(0.80, abs=TOLERANCE_S)  # two turns in a row per user, users in parallel
    assert endpoint.max_active == 4  # b and c of both users at once


def test_assignment_keeps_every_user_busy():
    turns = [_turn(f"t{i}") for i in range(3)]
    plan = assign_turns(turns, 5)
    assert len(plan) == 5 and all(len(own) == 1 for own in plan)
    assert {t.turn_id for own in plan for t in own} == {"t0", "t1", "t2"}
    assert [len(own) for own in assign_turns(turns, 2)] == [2, 2]


def test_load_stays_at_u_until_the_last_counted_turn_ends():
    # user 0 replays the 0.4 s turn, user 1 the 0.15 s one and then fillers (the next turns of its cycle)
    turns = [_turn("long"), Turn("short", [Call(id="s", prompt="p")])]
    endpoint = FakeEndpoint()
    records, wall = _run(replay(turns, endpoint, users=2))
    assert sorted(r.turn_id for r in records) == ["long", "short"]  # fillers are not counted
    assert wall == pytest.approx(0.40, abs=TOLERANCE_S)  # until the last counted turn, not the fillers' end
    starts = endpoint.starts
    # counted calls: 5; user 1's filler ("long" again from 0.15 s) starts a, b and c by 0.3 s, and its d
    # (due at 0.45 s) never starts: the last counted turn ended at 0.4 s
    assert len(starts) == 5 + 3
    assert all(t < wall for t in starts)
    # the filler's b (due to end at 0.45 s) was cancelled when the last counted turn ended at 0.4 s; its c ends
    # then too, on either side of the cancel
    assert "b" in endpoint.cancelled and set(endpoint.cancelled) <= {"b", "c"} and endpoint.active == 0


def test_a_fillers_call_in_flight_is_cancelled_when_the_last_counted_turn_ends():
    # user 0: its counted quick turn (0-0.5 s), then the slow one as a filler (0.5-1.5 s); user 1: its counted
    # slow turn (0-1 s). At 1 s the filler's call has half a second to go: it is cancelled, not waited for.
    turns = [Turn("quick", [Call(id="quick", prompt="p")]), Turn("slow", [Call(id="slow", prompt="p")])]
    endpoint = FakeEndpoint()

    async def timed():
        records, wall = await replay(turns, endpoint, users=2)
        return records, wall, _now()

    records, wall, returned = _run(timed())
    assert sorted(r.turn_id for r in records) == ["quick", "slow"]
    assert endpoint.cancelled == ["slow"] and endpoint.active == 0
    assert wall == pytest.approx(1.0, abs=TOLERANCE_S)
    assert returned == pytest.approx(1.0, abs=TOLERANCE_S)  # the filler would have run to 1.5 s


def test_a_filler_never_serves_a_turn_before_the_user_who_counts_it_begins_it():
    """User 0 is done with its quick turn at 0.15 s, before user 1 starts its own at 0.3 s: filling with that
    one then would leave its prompt and answer cached for user 1's count. (So would a filler that, its prompts
    cached, overtakes a user still on an earlier turn.)"""
    turns = [Turn("q0", [Call(id="s", prompt="p")]), Turn("q1", [Call(id="s", prompt="p")])]
    served: list[tuple[float, str]] = []
    owner = {id(call): turn.turn_id for turn in turns for call in turn.calls}

    class Logged(FakeEndpoint):
        async def complete(self, call):
            served.append((_now(), owner[id(call)]))
            return await super().complete(call)

    records, _ = _run(replay(turns, Logged(), users=2, stagger_s=0.3))
    counted_start = {r.turn_id: r.start for r in records}
    assert set(counted_start) == {"q0", "q1"} and len(served) > 2  # user 0 filled while user 1 waited
    assert all(at >= counted_start[turn_id] for at, turn_id in served)


def test_staggered_users_start_apart_and_nothing_replays_before_a_user_starts():
    # stagger 0.22 s: user 1 starts at 0.22 s, user 2 at 0.44 s; before its start a user sends nothing (a turn
    # replayed early would leave its prompts and answers cached for the user that counts it later)
    turns = [_turn("t0"), _turn("t1")]
    endpoint = FakeEndpoint()
    records, wall = _run(replay(turns, endpoint, users=3, stagger_s=0.22))
    assert sorted(r.user for r in records) == [0, 1, 2]
    for record in records:
        assert record.start == pytest.approx(0.22 * record.user, abs=TOLERANCE_S)
        assert record.duration == pytest.approx(0.40, abs=TOLERANCE_S)
    first_calls = sorted(t for t in endpoint.starts)[:3]  # each user's "a", then user 0's b and c
    assert first_calls[0] == pytest.approx(0.0, abs=TOLERANCE_S)
    assert sum(1 for t in endpoint.starts if t < 0.22) == 3  # user 0's a, b, c only
    assert wall == pytest.approx(0.44 + 0.40, abs=TOLERANCE_S)
    with pytest.raises(ValueError, match="stagger"):
        _run(replay(turns, endpoint, users=2, stagger_s=-1))


def test_a_failed_call_is_recorded_and_the_turn_finishes():
    records, _ = _run(replay([_turn("t0")], FakeEndpoint(fail={"b"}), users=1))
    (record,) = records
    assert record.failed
    errors = {c.call_id: c.error for c in record.calls}
    assert errors["b"].startswith("RuntimeError") and errors["d"] == ""
