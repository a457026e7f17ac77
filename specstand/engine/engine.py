"""The engine: admits requests, asks the drafter, verifies with one target pass, rolls back, counts.

One step = every running request proposes a draft (its own length), all of them go through ONE target
pass, each is verified on its own rows, its cache rolls back to what was accepted, stats are recorded.
Invariant between steps: a running request's cache holds every token but the last emitted one, which
is the first row of its next pass.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
from collections import deque
from dataclasses import dataclass

import torch

from specstand.drafters import Draft, Drafter, HiddenRows, SequenceView
from specstand.engine.adaptive import AdaptiveVerifier, PassCost
from specstand.engine.prefix_cache import PrefixCache, common_prefix
from specstand.engine.quiet_profile import QUIET_WAIT_S, profile_target_passes, quiet_wait_s
from specstand.engine.request import GenerationResult, Request, StepEvent
from specstand.engine.running import Running, Work
from specstand.engine.stats import DecodeStats, EngineTimes
from specstand.runner import PassInput, PassOutput, TargetRunner
from specstand.runner.exactness import row_unit
from specstand.runner.runner import PREFILL_BLOCK, PROMPT_CHUNK
from specstand.runner.target import TargetModel
from specstand.verification import Verdict, verify

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    num_speculative_tokens: int = 5  # K: the most draft tokens verified per pass
    max_seq_len: int = 2048  # cache capacity of one request: prompt + answer + K + 1
    max_batch: int = 1  # requests decoded together (cache slots)
    prefix_reuse: bool = True  # start a prompt from the longest cached head (slots and store)
    # host memory for finished requests' heads beyond the slots (engine/prefix_cache.py); 0: slots only
    prefix_store_bytes: int = 0
    # verify only the draft tokens that pay for their rows (engine/adaptive.py); False: every draft at fixed K
    adaptive: bool = True
    # the most start-up waits for quiet CPUs to time its passes (SPECSTAND_QUIET_WAIT_S overrides it)
    profile_wait_s: float = QUIET_WAIT_S

    def __post_init__(self) -> None:
        if self.num_speculative_tokens < 0:
            raise ValueError("the number of speculative tokens (K) must be >= 0")
        if self.max_batch < 1:
            raise ValueError("max_batch must be >= 1")
        if self.prefix_store_bytes < 0:
            raise ValueError("the prefix store's budget must be >= 0 bytes")


class ExactnessError(RuntimeError):
    pass


class Engine:
    def __init__(self, model: TargetModel, drafter: Drafter | None, config: EngineConfig) -> None:
        self.config = config
        self.drafter = drafter
        self.runner = TargetRunner(model, config.max_batch, config.max_seq_len)
        self.width = config.num_speculative_tokens + 1
        self.tap_layers = drafter.tap_layers if drafter is not None else ()
        # pass shapes fixed to whole units of rows, so greedy output cannot depend on draft lengths
        self.row_unit = row_unit(self.runner, self.width)
        # whether greedy answers are guaranteed token-identical to plain decoding
        self.exact = self.row_unit != 0
        if self.row_unit == 0 and model.exact_by_design:
            raise ExactnessError(
                "this machine's kernels round differently for different pass shapes even when padded; "
                "exact greedy decoding is not possible here, and this target is served exactly or not at all"
            )
        self.row_unit = self.row_unit or 1  # the fallback forward runs on, not exact, and says so
        # Prefix reuse. Where prompt rows compute exactly as decode rows (the compiled forward takes prompts),
        # any cached head is reusable, a finished request's answer included; elsewhere only whole prefill
        # blocks of a prompt are (decode passes round differently from torch's prompt GEMMs).
        self._reuse_answers = self.runner.compiled_prompts
        self.prefix_cache = PrefixCache(self.runner.cache, config.prefix_reuse,
                                        1 if self._reuse_answers else PREFILL_BLOCK, self._reuse_answers,
                                        self.tap_layers, config.prefix_store_bytes)
        if self.prefix_cache.store_off_reason:
            logger.warning("no prefix store beyond the slots for this target: %s", self.prefix_cache.store_off_reason)
        self.times = EngineTimes()  # where the engine's time went, summed over its steps
        self._adaptive = (
            AdaptiveVerifier(self._profile_pass_cost(), max_depth=config.num_speculative_tokens)
            if config.adaptive and drafter is not None else None
        )
        self._waiting: deque[tuple[int, Request, float]] = deque()  # (id, request, when it was added)
        self._running: dict[int, Running] = {}
        self._next_id = 0

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def answer_room(self, prompt_tokens: int) -> int:
        """The most tokens an answer to a prompt this long may ask for: its last pass still needs room for a
        whole pass of rows (a draft, or the row unit exact passes are padded to). Reads configuration only."""
        return self.runner.capacity - prompt_tokens - max(self.width, self.row_unit) + 1

    def check_request(self, request: Request) -> None:
        """Raise ValueError if the request can never fit; reads configuration only (thread-safe)."""
        if request.max_tokens > self.answer_room(len(request.prompt_ids)):
            raise ValueError(
                f"prompt ({len(request.prompt_ids)} tokens) + max_tokens ({request.max_tokens}) exceed the "
                f"context of {self.runner.capacity} tokens"
            )

    def add_request(self, request: Request) -> int:
        self.check_request(request)
        request_id = self._next_id
        self._next_id += 1
        self._waiting.append((request_id, request, time.perf_counter()))
        return request_id

    def abort(self, request_id: int) -> DecodeStats | None:
        """Drop a request; returns what it cost so far where it had begun (None while it waited)."""
        self._waiting = deque(item for item in self._waiting if item[0] != request_id)
        state = self._running.pop(request_id, None)
        if state is None:
            return None
        self._release(state)
        return state.stats

    def reset(self) -> None:
        """Drop every request (after a failure); cached prompts are forgotten too."""
        for request_id in list(self._running):
            self.abort(request_id)
        self._waiting.clear()
        self.prefix_cache.clear()

    def forget_history(self) -> None:
        """Forget what earlier requests left behind: the heads cached in free slots and in the prefix store,
        and the drafter's memory of earlier answers. Requests in flight keep their own caches."""
        self.prefix_cache.clear(self.runner.cache.free_slot_ids)
        if self.drafter is not None:
            self.drafter.forget()

    def generate(self, requests: list[Request]) -> list[GenerationResult]:
        ids = [self.add_request(r) for r in requests]
        results: dict[int, GenerationResult] = {}
        while self.has_work:
            for event in self.step():
                if event.finished is not None:
                    results[event.request_id] = event.finished
        return [results[i] for i in ids]

    def step(self) -> list[StepEvent]:
        """Admit what fits, then advance every running request by one shared target pass: decoding ones
        by a verified draft, new ones by a chunk of their prompt where prompts run compiled (so decoding
        never stalls behind a long prompt; elsewhere prompts are computed whole on admission). A failure
        in one request's admission, draft, pass, verification or emission finishes that request alone
        with finish_reason "error" (its slot freed); the others go on."""
        started, timed = time.perf_counter(), self.times.accounted
        events = self._admit()
        if not self.runner.compiled_prompts:
            events += self._prefill_whole_prompts()
        work = self._drafted_work(events) + self._prompt_chunks()
        for item, output in self._timed_pass(work, events):
            try:
                if item.draft is None:
                    events += self._prompt_progress(item.request_id, item.state, output)
                else:
                    events.append(self._verified(item.request_id, item.state, item.draft, output))
            except Exception as error:  # noqa: BLE001
                events.append(self._fail(item.request_id, item.state, error))
        # admission, verification, emission: what the step spent outside passes and drafting
        self.times.other += time.perf_counter() - started - (self.times.accounted - timed)
        return events

    def _drafted_work(self, events: list[StepEvent]) -> list[Work]:
        """Every decoding request's rows for this pass: its pending token and its draft (cut to its share
        of the budget under adaptive verification)."""
        decoding = [(request_id, state) for request_id, state in self._running.items() if state.decoding]
        drafting = self._adaptive is None or self._adaptive.should_draft()
        started = time.perf_counter()
        states = [state for _, state in decoding]
        drafts = self._propose(states, self._probed(states)) if drafting else [Draft([])] * len(decoding)
        proposals = []
        for (request_id, state), draft in zip(decoding, drafts, strict=True):
            if isinstance(draft, Exception):  # the drafter failed this request only
                events.append(self._fail(request_id, state, draft))
            else:
                proposals.append((request_id, state, draft))
        if self._adaptive is not None and drafting and proposals:
            self._adaptive.record_draft_time(time.perf_counter() - started)
            contexts = [len(state.seq.token_ids) - 1 for _, state, _ in proposals]  # cached positions
            drafts = self._adaptive.trim([draft for _, _, draft in proposals], contexts, [r for r, _, _ in proposals])
            proposals = [(r, state, draft) for (r, state, _), draft in zip(proposals, drafts, strict=True)]
            unpaid = not self._adaptive.drafting_pays
            for _, state, _ in proposals:  # its drafter ran this step, and the step did not pay
                state.stats.probes += unpaid and state.drafted_upto == len(state.seq.token_ids)
        return [Work(r, state, [state.seq.token_ids[-1], *draft.tokens], draft) for r, state, draft in proposals]

    def _timed_pass(self, work: list[Work], events: list[StepEvent]) -> list[tuple[Work, PassOutput]]:
        """The shared pass, its time split between prompt and decode rows by their count; a pass of decode
        rows only also tells adaptive verification what it cost."""
        started = time.perf_counter()
        done = self._pass(work, events)
        seconds = time.perf_counter() - started
        rows = sum(len(item.tokens) for item in work)
        prompt_rows = sum(len(item.tokens) for item in work if item.draft is None)
        if rows:
            self.times.prompt += seconds * prompt_rows / rows
            self.times.decode += seconds * (rows - prompt_rows) / rows
        if self._adaptive is not None and done and not prompt_rows:
            keys = sum(len(item.tokens) * (len(item.state.seq.token_ids) - 1) for item in work)
            self._adaptive.pass_cost.observe(rows, seconds, keys)
        return done

    def _verified(self, request_id: int, state: Running, draft: Draft, output: PassOutput) -> StepEvent:
        verdict = verify(draft.tokens, draft.probs, output.logits, state.request.sampling, state.generator)
        if self._adaptive is not None:
            self._adaptive.observe(draft, verdict.accepted, request_id)
        cache_start = len(state.seq.token_ids) - 1
        self.runner.cache.rollback(state.slot, cache_start + 1 + verdict.accepted)  # pending + accepted
        hidden = HiddenRows(cache_start, {k: t[: verdict.accepted + 1] for k, t in output.taps.items()})
        if self._reuse_answers and self.tap_layers:
            state.answer_taps.append(hidden.taps)
        return self._emit(request_id, state, verdict, len(draft.tokens), hidden)

    def _prompt_chunks(self) -> list[Work]:
        """Up to PROMPT_CHUNK rows of the prompts still being computed, oldest request first."""
        chunks, budget = [], PROMPT_CHUNK
        for request_id, state in self._running.items():
            if state.decoding or budget == 0:
                continue
            tokens = state.seq.token_ids[state.prompt_done : min(state.seq.prompt_len, state.prompt_done + budget)]
            chunks.append(Work(request_id, state, tokens, None))
            budget -= len(tokens)
        return chunks

    def _prefill_whole_prompts(self) -> list[StepEvent]:
        """Where prompts run on torch's GEMMs: each new prompt in passes of its own, before the shared pass."""
        events = []
        for request_id, state in list(self._running.items()):
            if state.decoding:
                continue
            try:
                started = time.perf_counter()
                output = self.runner.prefill(state.slot, state.seq.token_ids[: state.seq.prompt_len], self.tap_layers)
                self.times.prompt += time.perf_counter() - started
                events += self._prompt_progress(request_id, state, output)
            except Exception as error:  # noqa: BLE001 - this prompt failed; the next may not
                events.append(self._fail(request_id, state, error))
        return events

    def _prompt_progress(self, request_id: int, state: Running, output: PassOutput) -> list[StepEvent]:
        """Record a computed stretch of a prompt; after its last, emit the first answer token."""
        state.prompt_done = self.runner.cache.lengths[state.slot]
        slot, prompt = state.slot, state.seq.token_ids[: state.seq.prompt_len]
        taps = {}
        if self.tap_layers:
            state.prompt_taps.append(output.taps)
            taps = {k: torch.cat([p[k] for p in state.prompt_taps]) for k in self.tap_layers}
        self.prefix_cache.computed(slot, prompt[: state.prompt_done], taps)  # later prompts may reuse it already
        if not state.decoding:
            return []
        verdict = verify([], None, output.logits, state.request.sampling, state.generator)
        return [self._emit(request_id, state, verdict, 0, HiddenRows(0, self.prefix_cache.taps(slot)))]

    def _pass(self, work: list[Work], events: list[StepEvent]) -> list[tuple[Work, PassOutput]]:
        """One target pass over every request's rows: [(work, output)]. If it raises, each request gets a
        pass of its own (a row computes the same either way), so that a request whose rows cannot be
        computed fails alone (its event appended to `events`)."""
        if not work:
            return []
        try:
            return list(zip(work, self._run(work), strict=True))
        except Exception as error:  # noqa: BLE001
            if len(work) == 1:
                events.append(self._fail(work[0].request_id, work[0].state, error))
                return []
        done = []
        for item in work:
            try:
                done.append((item, self._run([item])[0]))
            except Exception as error:  # noqa: BLE001
                events.append(self._fail(item.request_id, item.state, error))
        return done

    def _run(self, work: list[Work]) -> list[PassOutput]:
        rows = max(len(item.tokens) for item in work)
        width = -(-rows // self.row_unit) * self.row_unit  # row_unit is 1 or >= self.width
        inputs = [
            PassInput(item.state.slot, item.tokens,
                      "all" if item.draft is not None else "last" if item.last_of_prompt else "none")
            for item in work
        ]
        return self.runner.run(inputs, width, self.tap_layers)

    @property
    def estimated_pass_cost(self) -> PassCost | None:
        """Adaptive verification's pass costs as the passes run so far have corrected them (None without it)."""
        return self._adaptive.pass_cost if self._adaptive is not None else None

    def pass_cost(self) -> PassCost:
        """Seconds of a target pass by rows (adaptive verification's profile, else one of up to K + 1 rows
        taken now): call it before any request, as it runs passes in a scratch slot."""
        estimated = self.estimated_pass_cost
        return estimated if estimated is not None else self._profile_pass_cost(self.width)

    def _profile_pass_cost(self, max_rows: int | None = None) -> PassCost:
        """Target passes of 1 .. max_batch * (K + 1) rows, timed before any request (quiet_profile.py)."""
        return profile_target_passes(self.runner, self.row_unit, max_rows or self.config.max_batch * self.width,
                                     quiet_wait_s(self.config.profile_wait_s))

    def _fail(self, request_id: int, state: Running, error: Exception) -> StepEvent:
        """Finish one request with its error and free its slot."""
        self._running.pop(request_id, None)
        self.prefix_cache.forget(state.slot)
        self.runner.cache.release(state.slot)
        if self.drafter is not None:
            with contextlib.suppress(Exception):  # the request has failed already; whatever it held goes
                self.drafter.end(state.seq)
        logger.error("engine request %d failed", request_id, exc_info=error)
        result = GenerationResult(request_id, list(state.request.prompt_ids), state.seq.output_ids, "error",
                                  state.stats, f"{type(error).__name__}: {error}")
        return StepEvent(request_id, [], result)

    def _admit(self) -> list[StepEvent]:
        """Give waiting requests free slots and their cached prompt heads; their prompts are computed from
        the next pass on. A request whose head another prompt is computing right now waits for it."""
        events, deferred = [], []
        while self._waiting and self.runner.cache.free_slots:
            request_id, request, queued_at = self._waiting.popleft()
            if self._head_in_progress(request.prompt_ids):
                deferred.append((request_id, request, queued_at))
                continue
            placed = self.prefix_cache.place(request.prompt_ids)
            seed = request.sampling.seed if request.sampling.seed is not None else random.getrandbits(63)
            stats = DecodeStats(prompt_tokens=len(request.prompt_ids), cached_prompt_tokens=placed.reused,
                                stored_prompt_tokens=placed.from_store,
                                queue_seconds=time.perf_counter() - queued_at)
            state = Running(
                request=request,
                seq=SequenceView(request_id, list(request.prompt_ids), len(request.prompt_ids),
                                 request.sampling.temperature, request.tools, request.response_format),
                slot=placed.slot,
                generator=torch.Generator().manual_seed(seed),
                stats=stats,
                prompt_done=placed.reused,
                prompt_taps=[placed.taps] if placed.taps else [],
            )
            self._running[request_id] = state
            try:
                if self.drafter is not None:
                    self.drafter.begin(state.seq)
            except Exception as error:  # noqa: BLE001 - this request failed; the next may not
                events.append(self._fail(request_id, state, error))
        self._waiting.extendleft(reversed(deferred))
        return events

    def _head_in_progress(self, prompt: list[int]) -> bool:
        """Whether a prompt being computed shares at least a prefill block more of `prompt`'s head than any
        cache holds now: waiting a pass or two for it saves computing that head twice."""
        if not self.config.prefix_reuse:
            return False
        coming = min(max((common_prefix(state.seq.token_ids[: state.seq.prompt_len], prompt)
                          for state in self._running.values() if not state.decoding), default=0), len(prompt) - 1)
        # the cheap bound first: cached_length scans every slot's head and the store
        return coming >= PREFILL_BLOCK and coming - self.prefix_cache.cached_length(prompt) >= PREFILL_BLOCK

    def _probed(self, states: list[Running]) -> int | None:
        """The one request a probe drafts for, or None (all of them). A drafter that reads the target's
        hidden rows first catches up on every row it missed, a whole new prompt or the tokens of a pause:
        probing every running request would cost that many catch-ups for outcomes that one request gives.
        So until drafting has been found to pay (`AdaptiveVerifier.drafting_pays`), it drafts for the
        request it lags least."""
        if self._adaptive is None or not self.tap_layers or len(states) < 2 or self._adaptive.drafting_pays:
            return None
        return min(range(len(states)), key=lambda i: len(states[i].seq.token_ids) - states[i].drafted_upto)

    def _propose(self, states: list[Running], only: int | None = None) -> list[Draft | Exception]:
        """Every decoding request's draft (or request `only`'s alone), in one drafter call (block drafters
        batch their passes); if that call fails, each request is asked alone, so a failure costs only the
        request it belongs to."""
        # never draft past max_tokens (the pass emits accepted drafts + 1 target token), nor, where each
        # draft token costs a drafter step, deeper than adaptive verification last found worth verifying
        depth = self.config.num_speculative_tokens
        if self._adaptive is not None and self.drafter is not None and self.drafter.cost_grows_with_depth:
            depth = self._adaptive.depth
        budgets = [min(depth, s.request.max_tokens - s.emitted - 1) if only in (None, i) else 0
                   for i, s in enumerate(states)]
        if self.drafter is None or not any(b > 0 for b in budgets):
            return [Draft([]) for _ in states]
        for state, budget in zip(states, budgets, strict=True):
            if budget > 0:
                state.drafted_upto = len(state.seq.token_ids)
                state.stats.drafter_runs += 1
        started = time.perf_counter()
        try:
            drafts: list[Draft | Exception] = list(self.drafter.propose_many([s.seq for s in states], budgets))
        except Exception:  # noqa: BLE001 - find out which request it was
            drafts = [self._propose_alone(s.seq, b) for s, b in zip(states, budgets, strict=True)]
        seconds = time.perf_counter() - started
        self.times.draft += seconds
        for state in states:
            state.stats.draft_seconds += seconds / len(states)
        return [d if isinstance(d, Exception) else d.cut(max(b, 0)) for d, b in zip(drafts, budgets, strict=True)]

    def _propose_alone(self, seq: SequenceView, budget: int) -> Draft | Exception:
        try:
            return self.drafter.propose(seq, budget) if budget > 0 else Draft([])
        except Exception as error:  # noqa: BLE001
            return error

    def _emit(self, request_id: int, state: Running, verdict: Verdict, drafted: int, hidden: HiddenRows) -> StepEvent:
        request = state.request
        tokens = verdict.tokens[: request.max_tokens - state.emitted]
        stop_at = next((i for i, t in enumerate(tokens) if t in request.stop_token_ids), None)
        if stop_at is not None:
            tokens = tokens[: stop_at + 1]
        state.stats.record_pass(drafted, verdict.accepted, len(tokens))
        state.seq.token_ids.extend(tokens)
        if stop_at is None and state.emitted < request.max_tokens:
            # only a request that goes on tells its drafter: a stop token or max_tokens may cut the pass's
            # tokens short of the hidden rows it computed
            if self.drafter is not None:
                self.drafter.extend(state.seq, tokens, hidden if self.tap_layers else None)
            return StepEvent(request_id, tokens)
        del self._running[request_id]
        self._release(state)
        result = GenerationResult(
            request_id=request_id,
            prompt_ids=list(request.prompt_ids),
            output_ids=state.seq.output_ids,
            finish_reason="stop" if stop_at is not None else "length",
            stats=state.stats,
        )
        return StepEvent(request_id, tokens, result)

    def _release(self, state: Running) -> None:
        """Free a finished or aborted request's slot. Where answers are reusable, the slot keeps its prompt
        and answer as a cached head (positions below the cache length hold the K/V of those tokens)."""
        self.prefix_cache.release(state.slot, state.seq.token_ids, state.answer_taps)
        self.runner.cache.release(state.slot)
        if self.drafter is not None:
            try:  # the answer is whole: a drafter that fails to forget it fails no request
                self.drafter.end(state.seq)
            except Exception:  # noqa: BLE001
                logger.exception("the drafter failed to end request %d's sequence", state.seq.request_id)
