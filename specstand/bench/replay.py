"""Replay whole agent turns under U concurrent users.

Each user replays its turns one after another. Inside a turn a call starts when all its dependencies
have finished plus its recorded delay, so independent calls run in parallel, as the agent ran them.

The load stays at U until the last counted turn ends: a user done with its own turns goes on replaying
uncounted filler turns (the next ones in its cyclic order) meanwhile, whose calls are cancelled once every
user is done. Otherwise the turns left at the end would run with fewer users than U beside them, and a
method that finishes some turns early would see its last turns served by a lighter machine.

Users start together by default (as vLLM's benchmark sends its requests at once), so at U > 1 their prompts
come together and their decoding comes together. With a stagger of S seconds, user u starts u * S seconds in:
the load ramps from 1 to U users over the first (U - 1) * S seconds, and the users' phases stay apart. Nothing
replays before a user starts: any turn replayed early would leave its prompts in the server's cache and its
answers in a drafter's memory for the user that counts it later.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from specstand.workloads import Call, Turn


@dataclass
class Answer:
    text: str
    completion_tokens: int
    finish_reason: str = ""  # "stop", or "length" when max_tokens cut the answer
    tool_calls: list[dict] | None = None  # the calls the server read out of the answer: [{"name", "arguments"}]


class Endpoint(Protocol):
    async def complete(self, call: Call) -> Answer: ...


@dataclass
class CallRecord:
    turn_id: str
    call_id: str
    stage: str
    start: float
    end: float
    text: str = ""
    completion_tokens: int = 0
    finish_reason: str = ""
    error: str = ""
    tool_calls: list[dict] | None = None  # as Answer.tool_calls

    @property
    def latency(self) -> float:
        return self.end - self.start


@dataclass
class TurnRecord:
    turn_id: str
    user: int
    start: float
    end: float
    calls: list[CallRecord] = field(default_factory=list)

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def failed(self) -> bool:
        return any(c.error for c in self.calls)


def turns_per_user(turns: list[Turn], users: int) -> int:
    """Counted turns per user: ceil(len(turns) / users), so every turn is replayed at least once."""
    return max(1, math.ceil(len(turns) / users))


def cyclic_order(turns: list[Turn], users: int, user: int) -> Iterator[Turn]:
    """A user's turns, endlessly: the workload's cyclic order from the user's own offset. Its first
    turns_per_user are counted; the ones after are the fillers that keep the load up (those whose counted
    replay has begun: replay)."""
    start = user * turns_per_user(turns, users)
    return (turns[(start + i) % len(turns)] for i in itertools.count())


def assign_turns(turns: list[Turn], users: int) -> list[list[Turn]]:
    """Every user's counted turns."""
    return [list(itertools.islice(cyclic_order(turns, users, u), turns_per_user(turns, users)))
            for u in range(users)]


async def replay(
    turns: list[Turn],
    endpoint: Endpoint,
    users: int,
    on_turn: Callable[[TurnRecord], None] = lambda record: None,
    stagger_s: float = 0.0,
) -> tuple[list[TurnRecord], float]:
    """Returns the counted turn records (in completion order) and the wall time until the last of them
    ended; the fillers' calls still in flight then are cancelled (the client hangs up; a server aborts them).
    `stagger_s`: user u starts u * stagger_s seconds in."""
    if stagger_s < 0:
        raise ValueError("the users' stagger must be >= 0 seconds")
    records: list[TurnRecord] = []
    begun: set[str] = set()  # turns whose counted replay has begun
    started = _now()
    all_done = asyncio.Event()
    users_done = 0
    wall = 0.0

    async def user(index: int) -> None:
        nonlocal users_done, wall
        await asyncio.sleep(index * stagger_s)
        order = cyclic_order(turns, users, index)
        for turn in itertools.islice(order, turns_per_user(turns, users)):
            begun.add(turn.turn_id)
            record = await _replay_turn(turn, endpoint, index)
            records.append(record)
            on_turn(record)
        users_done += 1
        if users_done == users:
            wall = _now() - started
            all_done.set()
            return
        # fillers, until every user is done with its counted turns; then nothing of them is waited for (on a
        # slow CPU their last calls took seconds after every 4-user run)
        fillers = asyncio.ensure_future(_fill(order, begun, endpoint, index))
        await all_done.wait()
        fillers.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await fillers

    await asyncio.gather(*(user(i) for i in range(users)))
    return records, wall


def _now() -> float:
    """The event loop's clock, so that a test can run the replay in virtual time."""
    return asyncio.get_running_loop().time()


async def _fill(order: Iterator[Turn], begun: set[str], endpoint: Endpoint, user: int) -> None:
    """Uncounted turns of a user's cyclic order, until cancelled: only those whose counted replay has begun, as
    a turn served before its user counts it would leave its prompts and answers cached for that user (a
    staggered user not started yet, or one still on its earlier turns). The user's own counted turns have, so
    every cycle of `order` replays at least one."""
    for turn in order:
        if turn.turn_id in begun:
            await _replay_turn(turn, endpoint, user)


async def _replay_turn(turn: Turn, endpoint: Endpoint, user: int) -> TurnRecord:
    """Replays one turn."""
    record = TurnRecord(turn.turn_id, user, _now(), 0.0)
    done: dict[str, asyncio.Future] = {c.id: asyncio.get_running_loop().create_future() for c in turn.calls}

    async def run(call: Call) -> None:
        for dep in call.depends_on:
            await done[dep]
        if call.delay_ms:
            await asyncio.sleep(call.delay_ms / 1000)
        entry = CallRecord(turn.turn_id, call.id, call.stage, _now(), 0.0)
        try:
            answer = await endpoint.complete(call)
            entry.text, entry.completion_tokens = answer.text, answer.completion_tokens
            entry.finish_reason, entry.tool_calls = answer.finish_reason, answer.tool_calls
        except Exception as error:  # a failed call is recorded, and its dependants still run
            entry.error = f"{type(error).__name__}: {error}"[:300]
        entry.end = _now()
        record.calls.append(entry)
        done[call.id].set_result(None)

    await asyncio.gather(*(run(c) for c in turn.calls))
    record.end = _now()
    return record
