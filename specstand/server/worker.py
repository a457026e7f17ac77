"""Runs the engine in one background thread and feeds it requests from the asyncio server.

Continuous batching: each engine step admits waiting requests into free cache slots and advances every
running one by one shared target pass. The inbox is bounded; a full inbox is reported as overload.

The engine thread also builds what it runs (loading the model, profiling passes), so that every parallel
region of the process starts from this one thread. OpenMP keeps a team of threads for each thread that starts
parallel work; with a second team (a model loaded on the main thread) libgomp counts more threads than cores
and stops spinning between regions, so each of a pass's ~200 regions waited for a sleeping thread to wake:
SmolLM2's decode passes took 18-22 ms against 10 on two AVX2 cores (benchmarks/server_overhead.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

from specstand.engine import Engine, EngineTimes, Request, StepEvent
from specstand.server.metrics import ServerMetrics

logger = logging.getLogger(__name__)


class Overloaded(RuntimeError):
    pass


@dataclass
class _Ticket:
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue
    engine_id: int | None = None


class EngineWorker:
    def __init__(self, build: Callable[[], tuple[Engine, ServerMetrics]], max_queue: int,
                 stall_s: float = 300.0) -> None:
        """`build`: what the engine thread runs first (loading the model too, where it does): the engine to run
        and the metrics it counts into."""
        self._build = build
        self.engine: Engine
        self.metrics: ServerMetrics
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self.max_queue = max_queue
        self.stall_s = stall_s  # work waiting and no engine step finished for this long: unhealthy
        self._cond = threading.Condition()
        self._inbox: deque[tuple[int, Request]] = deque()
        self._cancelled: dict[int, str] = {}  # ticket -> its outcome on /metrics
        self._forget_requested = False
        self._tickets: dict[int, _Ticket] = {}
        self._by_engine_id: dict[int, int] = {}
        self._ids = itertools.count()
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="specstand-engine", daemon=True)
        self._progress = time.monotonic()  # when the engine last finished a step, went idle, or work came to it
        self._crash = ""
        self._idle_since: float | None = None  # when the engine thread began waiting for work (None: busy)

    def start(self) -> None:
        """Start the engine thread; returns once it has built the engine, raises what building raised."""
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error

    def problem(self) -> str:
        """Why the server cannot serve now ("" when it can): the engine thread died, or it has work and
        has not finished a step for stall_s seconds."""
        if self._crash:
            return f"the engine thread died: {self._crash}"
        if not self._thread.is_alive():
            return "the engine thread is not running"
        with self._cond:
            busy = bool(self._tickets)
        stalled = time.monotonic() - self._progress
        if busy and stalled > self.stall_s:
            return f"no engine step finished for {stalled:.0f} s with requests in flight"
        return ""

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=10)

    def submit(self, request: Request) -> tuple[int, asyncio.Queue]:
        """Queue a request; its StepEvents (and finally an exception or the finished event) arrive on the
        returned queue. Raises ValueError for a request the engine cannot take, Overloaded when full."""
        self.engine.check_request(request)
        with self._cond:
            if len(self._tickets) >= self.max_queue:
                raise Overloaded(f"server busy: {len(self._tickets)} requests in flight (limit {self.max_queue})")
            if not self._tickets:  # a stall counts from when work came, not from when the idle began
                self._progress = time.monotonic()
            ticket_id = next(self._ids)
            ticket = _Ticket(asyncio.get_running_loop(), asyncio.Queue())
            self._tickets[ticket_id] = ticket
            self._inbox.append((ticket_id, request))
            self.metrics.set_waiting(len(self._tickets))
            self._cond.notify()
        return ticket_id, ticket.events

    def forget_history(self) -> None:
        """Have the engine thread forget cached prompts and earlier answers before it takes the next
        request (requests submitted after this call find nothing of those before it)."""
        with self._cond:
            self._forget_requested = True
            self._cond.notify()

    def cancel(self, ticket_id: int, outcome: str = "cancelled") -> None:
        """Drop a request: its client hung up or timed out ("cancelled"), or a stop string ended its answer
        ("finished"). The engine's work on it so far is counted on /metrics under that outcome."""
        with self._cond:
            if ticket_id in self._tickets:
                self._cancelled[ticket_id] = outcome
                self._cond.notify()

    def _run(self) -> None:
        try:
            self.engine, self.metrics = self._build()
        except BaseException as error:  # noqa: BLE001 - start() raises it on the caller's thread
            self._build_error = error
            return
        finally:
            self._built.set()
        try:
            self._loop()
        except BaseException as error:  # noqa: BLE001 - recorded for /health, then the thread ends
            logger.critical("the engine thread died", exc_info=error)
            self._crash = f"{type(error).__name__}: {error}"
            raise

    def account_idle(self) -> None:
        """Count the engine thread's idle time up to now into the metrics (before they are read)."""
        with self._cond:
            self._count_idle(still_idle=True)

    def _count_idle(self, still_idle: bool) -> None:
        """Add the idle time since it was last counted (call with the lock held)."""
        if self._idle_since is not None:
            now = time.perf_counter()
            self.metrics.add_idle_seconds(now - self._idle_since)
            self._idle_since = now if still_idle else None

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not (self._stopped or self._inbox or self._cancelled or self._forget_requested
                           or self.engine.has_work):
                    self._progress = time.monotonic()
                    if self._idle_since is None:
                        self._idle_since = time.perf_counter()
                    self._cond.wait()
                self._count_idle(still_idle=False)
                if self._stopped:
                    return
                before, started = replace(self.engine.times), time.perf_counter()
                if self._forget_requested:
                    self.engine.forget_history()
                    self._forget_requested = False
                self._take_inbox()
            try:
                events = self.engine.step()
            except Exception as error:  # keep serving: fail the requests in flight, reset the engine
                self._fail_all(error)
                self._account_step(before, time.perf_counter() - started)
                continue
            self._progress = time.monotonic()
            for event in events:
                self._deliver(event)
            self._account_step(before, time.perf_counter() - started)

    def _account_step(self, before: EngineTimes, seconds: float) -> None:
        """A step's phases into the metrics; taking requests in and handing events out count as other engine
        work, so the phases add up to the thread's time."""
        times = self.engine.times
        phases = EngineTimes(times.prompt - before.prompt, times.decode - before.decode, times.draft - before.draft)
        phases.other = seconds - phases.accounted  # the engine's own other work and the worker's part of the step
        with self._cond:
            self.metrics.add_engine_seconds(phases)
            store = self.engine.prefix_cache.store
            self.metrics.set_store_bytes(store.nbytes if store is not None else 0)
            cost = self.engine.estimated_pass_cost
            if cost is not None:
                for rows in sorted({1, self.engine.width}):
                    self.metrics.set_pass_seconds_estimated(rows, cost(rows))

    def _take_inbox(self) -> None:
        while self._inbox:
            ticket_id, request = self._inbox.popleft()
            if ticket_id in self._cancelled:
                continue
            engine_id = self.engine.add_request(request)
            self._tickets[ticket_id].engine_id = engine_id
            self._by_engine_id[engine_id] = ticket_id
        for ticket_id, outcome in self._cancelled.items():
            ticket = self._tickets.pop(ticket_id, None)
            if ticket is None:
                continue  # it finished before the hang-up was seen
            stats = None
            if ticket.engine_id is not None:
                stats = self.engine.abort(ticket.engine_id)
                self._by_engine_id.pop(ticket.engine_id, None)
            if stats is not None:  # its prompt, passes and drafts so far were work the engine did
                self.metrics.record(stats, outcome)
            else:
                self.metrics.record_outcome("cancelled")  # still queued
        self._cancelled.clear()
        self.metrics.set_waiting(len(self._tickets))

    def _deliver(self, event: StepEvent) -> None:
        ticket_id = self._by_engine_id.get(event.request_id)
        if ticket_id is None:
            return
        with self._cond:
            ticket = self._tickets.get(ticket_id)
            if event.finished is not None:
                self._tickets.pop(ticket_id, None)
                self._by_engine_id.pop(event.request_id, None)
                outcome = "failed" if event.finished.finish_reason == "error" else "finished"
                self.metrics.record(event.finished.stats, outcome)
                self.metrics.set_waiting(len(self._tickets))
        if ticket is not None:
            ticket.loop.call_soon_threadsafe(ticket.events.put_nowait, event)

    def _fail_all(self, error: Exception) -> None:
        logger.error("an engine step failed; failing the %d requests in flight and resetting the engine",
                     len(self._tickets), exc_info=error)
        with self._cond:
            tickets = list(self._tickets.values())
            self._tickets.clear()
            self._by_engine_id.clear()
            self._inbox.clear()
            self.engine.reset()
            self.metrics.set_waiting(0)
            self.metrics.record_outcome("failed", len(tickets))
        for ticket in tickets:
            ticket.loop.call_soon_threadsafe(ticket.events.put_nowait, error)
