"""Confidence-scheduled, load-aware verification: how many draft tokens each request sends to the target.

Every step each request's draft position i gets a survival score, the estimated probability that it and
every position before it are accepted (a running product of per-position acceptance estimates). With R
requests in the step, verifying the B most likely positions of all of them emits R + (sum of their
survival scores) tokens in expectation and costs the draft plus one pass of R + B rows, so the step takes
the B that maximises tokens per second, and each request keeps its share of that global top B. Under
load a pass of many rows costs more, so drafts shrink; when no budget beats plain decoding, drafting
itself pauses (and is probed again later, so the estimates stay fresh).

Tokens per second over all requests is not what a user feels: a request whose draft fails waits on the
others' longer pass and gets one token, as plain decoding would have given it in a shorter step. So each
request keeps a ledger of the seconds it has fallen behind plain decoding (each step's predicted cost
against the tokens it got, priced at a plain step), and only budgets that keep every request within its
allowance (one plain step plus a small share of the plain time of what it has got so far) are taken.

Cutting a draft never changes an answer: the target verifies whatever prefix is left.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from specstand.drafters import Draft


@dataclass
class AcceptanceModel:
    """P(draft position i is accepted | every earlier one was) = sigmoid(w . [1, confidence, i]), where
    `confidence` is the drafter's own per-token signal (a logit margin, a match count, a path probability:
    any scale). Refit online by a few Newton steps on the latest outcomes every `refit_every` updates. A
    calibrated confidence (DSpark's confidence head: a logit of the acceptance) is used as it is until the
    first fit, which then starts from the identity, w = (0, 1, 0)."""

    prior: float = 0.5  # the estimate before any outcome is seen
    window: int = 4096  # outcomes kept for the fit
    refit_every: int = 100
    first_fit: int = 8  # drafts (or eight times as many outcomes) before the first fit
    l2: float = 1e-2
    _features: list[tuple[float, float]] = field(default_factory=list)
    _labels: list[float] = field(default_factory=list)
    _weights: np.ndarray | None = None
    _since_fit: int = 0
    _calibrated: bool = False

    @property
    def fitted(self) -> bool:
        return self._weights is not None

    def probabilities(self, confidence: list[float], calibrated: bool = False) -> np.ndarray:
        if self._weights is None:
            if calibrated:
                return sigmoid(np.asarray(confidence, dtype=np.float64))
            return np.full(len(confidence), self.prior)
        x = self._design(np.asarray(confidence, dtype=np.float64), np.arange(len(confidence), dtype=np.float64))
        return sigmoid(x @ self._weights)

    def observe(self, confidence: list[float], drafted: int, accepted: int, calibrated: bool = False) -> None:
        """A verified draft of `drafted` tokens had its first `accepted` accepted: positions up to the first
        rejection are outcomes; positions after it were never judged."""
        self._calibrated = self._calibrated or calibrated
        for i in range(min(drafted, accepted + 1)):
            self._features.append((confidence[i], float(i)))
            self._labels.append(1.0 if i < accepted else 0.0)
        if len(self._labels) > self.window:
            del self._features[: -self.window], self._labels[: -self.window]
        self._since_fit += 1
        first = not self.fitted and (self._since_fit >= self.first_fit or len(self._labels) >= 8 * self.first_fit)
        if first or self._since_fit >= self.refit_every:
            self.fit()

    @staticmethod
    def _design(confidence: np.ndarray, position: np.ndarray) -> np.ndarray:
        return np.stack([np.ones_like(confidence), confidence, position], axis=1)

    def fit(self) -> None:
        """Refit on the outcomes kept (also called by adaptive verification after a probe's outcomes)."""
        self._since_fit = 0
        data = np.asarray(self._features, dtype=np.float64)
        labels = np.asarray(self._labels, dtype=np.float64)
        x = self._design(data[:, 0], data[:, 1])
        w = np.array([0.0, 1.0, 0.0]) if self._calibrated else np.zeros(3)

        def loss(w: np.ndarray) -> float:
            z = x @ w
            return float(np.sum(np.logaddexp(0.0, z) - labels * z) + 0.5 * self.l2 * w @ w)

        for _ in range(8):  # Newton's method on the L2-regularised log loss, steps halved until it falls
            p = sigmoid(x @ w)
            gradient = x.T @ (p - labels) + self.l2 * w
            hessian = (x * (p * (1 - p))[:, None]).T @ x + self.l2 * np.eye(3)
            step, current = np.linalg.solve(hessian, gradient), loss(w)
            while loss(w - step) > current and np.abs(step).max() > 1e-6:
                step /= 2
            w = w - step
            # more confidence never means less acceptance, for any drafter's signal: a fit on a few outcomes
            # could otherwise invert it (seen: suffix drafts paused for good after eight 1-token rejections)
            w[1] = max(w[1], 0.0)
        self._weights = w


# a one-row pass this many passes old or newer is the reference a pass of more rows is measured against
PLAIN_REFERENCE_PASSES = 32


@dataclass
class PassCost:
    """Seconds of one target pass by its total rows and the cached positions they attend over (keys): the
    profile (interpolated between its row counts, plus a cost per row-key for attention) follows the passes
    actually run. Every pass moves a scale of the whole profile (memory bandwidth drifts, neighbours load the
    host). The profile's shape, what a pass of more rows costs against a one-row pass, is measured too: each
    such pass against the latest one-row pass, and the row counts around it move slowly toward that ratio
    times the one-row point, so a start-up profile taken on a busy machine (several servers profiling at
    once) does not keep a wrong shape for life. Without recent one-row passes the shape stays as it is: the
    scale alone cannot be told from it."""

    rows: list[int]
    seconds: list[float]
    per_key: float = 0.0  # seconds per row per cached position it attends over
    scale: float = 1.0
    rate: float = 0.1  # how far one observed pass moves the scale toward itself
    shape_rate: float = 0.02  # and one compared with a recent one-row pass moves the row counts around it
    _plain: float = field(default=0.0, repr=False)  # the latest one-row pass's seconds, attention left out
    _since_plain: int = field(default=PLAIN_REFERENCE_PASSES + 1, repr=False)

    def __call__(self, rows: int, keys: float = 0.0) -> float:
        return self.scale * self._profiled(rows, keys)

    def observe(self, rows: int, seconds: float, keys: float = 0.0) -> None:
        predicted = self._profiled(rows, keys)
        if predicted <= 0:
            return
        self.scale = (1 - self.rate) * self.scale + self.rate * seconds / predicted
        without_attention = seconds - self.scale * self.per_key * keys
        if rows <= self.rows[0]:
            self._plain, self._since_plain = without_attention, 0
            return
        self._since_plain += 1
        if self._plain > 0 and self._since_plain <= PLAIN_REFERENCE_PASSES:
            self._reshape(rows, self.seconds[0] * without_attention / self._plain)

    def _reshape(self, rows: int, wanted: float) -> None:
        """Move the profiled seconds of the row counts around `rows` toward making their interpolation `wanted`
        (each by its interpolation weight, by at most 2 * shape_rate of itself a pass), keeping more rows never
        cheaper than fewer. `wanted` comes from the passes alone, so noise in it averages out."""
        now = float(np.interp(rows, self.rows, self.seconds))
        if now <= 0 or wanted <= 0:
            return
        step = self.shape_rate * (min(2.0, max(0.5, wanted / now)) - 1.0)
        upper = min(int(np.searchsorted(self.rows, rows)), len(self.rows) - 1)
        lower = max(upper - 1, 0)
        span = self.rows[upper] - self.rows[lower]
        weight_upper = 1.0 if span == 0 else min(1.0, (rows - self.rows[lower]) / span)
        for index, weight in ((lower, 1.0 - weight_upper), (upper, weight_upper)):
            if index > 0:  # the one-row point is the reference
                self.seconds[index] *= 1.0 + step * weight
        self.seconds = [float(s) for s in np.maximum.accumulate(self.seconds)]

    def _profiled(self, rows: int, keys: float) -> float:
        return float(np.interp(rows, self.rows, self.seconds)) + self.per_key * keys


def profile_pass_cost(run_pass: Callable[[int, int], None], max_rows: int, context: int, repeats: int = 3) -> PassCost:
    """Time `run_pass(rows, cached)` at 1, 2, 4, ... up to max_rows rows over an empty cache, then the
    largest of them over `context` cached positions for the attention term (medians of `repeats`, after
    one warm-up each)."""

    def timed(rows: int, cached: int) -> float:
        run_pass(rows, cached)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            run_pass(rows, cached)
            times.append(time.perf_counter() - start)
        return float(np.median(times))

    counts = sorted({min(2**i, max_rows) for i in range(max_rows.bit_length() + 1)})
    seconds = list(np.maximum.accumulate([timed(rows, 0) for rows in counts]))  # more rows never cost less
    per_key = max(0.0, (timed(counts[-1], context) - seconds[-1]) / (counts[-1] * context)) if context else 0.0
    return PassCost(counts, seconds, per_key)


def choose_budget(survival: list[np.ndarray], verify_cost: Callable[[int, float], float], draft_cost: float,
                  contexts: list[int] | None = None, allowance: list[float] | None = None) -> list[int]:
    """Draft tokens to verify per request: the B most likely positions over all requests, B maximising
    (requests + their summed survival) / (draft_cost + verify_cost(requests + B rows, the keys they
    attend over)); request r's rows each attend over its `contexts[r]` cached positions.

    With `allowance`, request r may be charged at most `allowance[r]` seconds beyond what plain decoding
    would have taken for the tokens it expects (1 + its summed survival, at a plain pass each): budgets
    past any request's allowance are out, and if every budget is, the one that overshoots least is taken."""
    requests = len(survival)
    contexts = contexts or [0] * requests
    ranked = sorted(((float(s), r) for r, row in enumerate(survival) for s in row), reverse=True)
    keys = float(sum(contexts))
    plain = verify_cost(requests, keys)
    # the most seconds a step may take for each request: its expected tokens at plain passes + allowance
    limits = [plain + a for a in allowance] if allowance is not None else [math.inf] * requests

    def judged(expected: float, seconds: float) -> tuple[bool, float]:
        """Sort key: within every allowance first, then tokens per second (or the least overshoot)."""
        overshoot = seconds - min(limits, default=math.inf)
        return (True, expected / seconds) if overshoot <= 0 else (False, -overshoot)

    expected, best_budget = float(requests), 0
    best = judged(expected, draft_cost + plain)
    for budget, (score, r) in enumerate(ranked, start=1):
        expected += score
        keys += contexts[r]
        limits[r] += score * plain
        value = judged(expected, draft_cost + verify_cost(requests + budget, keys))
        if value > best:
            best, best_budget = value, budget
    counts = [0] * requests
    for _, r in ranked[:best_budget]:
        counts[r] += 1
    return counts


@dataclass
class AdaptiveVerifier:
    """The per-engine state of adaptive verification: acceptance model, pass costs, draft cost, pauses."""

    pass_cost: PassCost
    acceptance: AcceptanceModel = field(default_factory=AcceptanceModel)
    # a step's drafting time: the median of the latest ones (a drafter's first proposal for a request also
    # reads its prompt, and the first after a pause the rows it missed: those must not set the price)
    draft_times: deque[float] = field(default_factory=lambda: deque(maxlen=15))
    max_pause: int = 16  # the doubling backoff (1, 2, 4 ... steps without drafting) stops here
    # a drafting step that plain decoding would have beaten is "a probe": pauses stretch until probes cost at
    # most this share of the plain steps between them (what a probe loses against plain decoding: a drafter as
    # slow as two plain steps, about 40 steps), a share halved by each further probe in a row that did not pay
    # either (80, 160 ... steps): a drafter that never pays on this traffic (a trained one off its domain, whose
    # probes read every new prompt) then costs ever less, down to least_probe_share; a cheap one (a lookup)
    # still comes back within max_pause steps where draft rows are nearly free
    probe_share: float = 0.05
    least_probe_share: float = 0.005
    # bounds a pause bought by one freak probe; far above what real probes buy, so the share above holds
    # (at 256, probes that each read four new 1.5k-token prompts into SmolLM2's DFlash added a third to the
    # time of plain decoding in `make demo`'s 4-user runs)
    longest_pause: int = 4096
    max_depth: int = 5  # K: the most draft tokens a request is asked for
    # a request may fall behind plain decoding by one plain step plus this share of the plain time of its
    # tokens (a lag that only grows would block every request's drafts behind one whose drafts fail)
    lag_share: float = 0.05
    # one draft position past the budget is verified every this many steps that cut a draft (see _explore)
    explore_every: int = 8
    depth: int = field(init=False)  # how deep to draft next: one past the deepest share the last budget gave
    _pause: int = 0  # steps left without drafting
    _backoff: int = 0
    _misses: int = 0  # budgeted steps in a row that plain decoding would have beaten
    _cut_steps: int = 0  # budgeted steps that cut a draft
    _probing: bool = False  # the first drafting step after a pause verifies a token of every draft
    _probe_step: bool = False  # this step is such a probe: its outcomes refit the estimate at once
    _paid: bool = False  # the latest budgeted step was faster than plain decoding would have been
    _ledger: dict[int, _Ledger] = field(default_factory=dict)  # request id -> its account
    _step: _Step | None = None  # the step `trim` cut, until the next (None: a step without drafting)

    def __post_init__(self) -> None:
        self.depth = self.max_depth

    def should_draft(self) -> bool:
        self._probe_step, self._step = False, None
        if self._pause > 0:
            self._pause -= 1
            self._probing = self._pause == 0
            return False
        return True

    @property
    def drafting_pays(self) -> bool:
        """Whether the latest budgeted step found drafting faster than plain decoding. Until one has (the
        warm-up before the first fit, the first budget after it, every probe after a pause), a drafting step
        is for outcomes more than tokens."""
        return self._paid

    @property
    def draft_seconds(self) -> float:
        return float(np.median(self.draft_times)) if self.draft_times else 0.0

    def record_draft_time(self, seconds: float) -> None:
        self.draft_times.append(seconds)

    def trim(self, drafts: list[Draft], contexts: list[int], request_ids: list[int] | None = None) -> list[Draft]:
        """Cut each draft (of a request with `contexts[i]` cached positions) to its share of the step's
        budget; pause drafting if no budget paid for it. Until the acceptance estimate has outcomes to
        stand on (or the drafter's confidence is calibrated), drafts are verified whole: cutting them on a
        guess would starve the estimate of the outcomes it needs. With `request_ids` (stable across
        steps) each request's ledger bounds the budget, and the step is charged to it in `observe`."""
        request_ids = list(range(len(drafts))) if request_ids is None else request_ids
        self._ledger = {r: self._ledger.get(r, _Ledger()) for r in request_ids}  # the finished drop out
        keys = sum(contexts)
        requests, plain_seconds = len(drafts), self.pass_cost(len(drafts), keys)
        this_draft = self.draft_times[-1] if self.draft_times else 0.0
        budgeted = any(d.tokens for d in drafts) and (
            self.acceptance.fitted or any(d.calibrated for d in drafts))
        if budgeted:
            counts, expected = self._budget(drafts, contexts, request_ids, plain_seconds)
        else:
            counts = [len(d.tokens) for d in drafts]
        drafted_keys = keys + sum(n * c for n, c in zip(counts, contexts, strict=True))
        drafted_pass = self.pass_cost(requests + sum(counts), drafted_keys)
        self._step = _Step(this_draft + drafted_pass, plain_seconds, requests)
        if budgeted:
            self._pause_if_plain_is_faster(requests, expected, drafted_pass, plain_seconds, this_draft)
        return [d.cut(n) for d, n in zip(drafts, counts, strict=True)]

    def _budget(self, drafts: list[Draft], contexts: list[int], request_ids: list[int],
                plain_seconds: float) -> tuple[list[int], float]:
        """Each request's share of the step's budget, and the tokens the shares expect to get accepted."""
        survival = [np.cumprod(self.acceptance.probabilities(_confidence(d), d.calibrated)) for d in drafts]
        allowance = [self._ledger[r].allowance(plain_seconds, self.lag_share) for r in request_ids]
        counts = choose_budget(survival, self.pass_cost, self.draft_seconds, contexts, allowance)
        if self._probing:  # outcomes keep the estimates honest even while they advise against drafting
            counts = [max(n, min(1, len(d.tokens))) for n, d in zip(counts, drafts, strict=True)]
            self._probing, self._probe_step = False, True
        # a chain drafter's cost grows with its depth: draft no deeper than the budget went, plus one to
        # see whether the next position would pay
        self.depth = min(max(counts) + 1, self.max_depth)
        if not self._probe_step and any(counts):
            self._explore(counts, drafts, survival)
        return counts, sum(float(s[:n].sum()) for s, n in zip(survival, counts, strict=True))

    def _explore(self, counts: list[int], drafts: list[Draft], survival: list[np.ndarray]) -> None:
        """Every `explore_every`-th step that verified a budget and cut a draft, verify one position more of
        the cut draft most likely to pass it. A position past every budget is never judged, so an estimate
        that undervalues it would otherwise stand for good (seen: suffix decoding's paths of probability 1
        cut to one token for whole runs, by a position weight fit on a handful of early failures)."""
        cut = [r for r, (n, d) in enumerate(zip(counts, drafts, strict=True)) if n < len(d.tokens)]
        if not cut:
            return
        self._cut_steps += 1
        if self._cut_steps % self.explore_every == 0:
            counts[max(cut, key=lambda r: survival[r][counts[r]])] += 1

    def _pause_if_plain_is_faster(self, requests: int, expected: float, drafted_pass: float, plain_seconds: float,
                                  this_draft: float) -> None:
        """Pause drafting when the step's budget is slower than plain decoding would have been."""
        self._paid = (requests + expected) / (self.draft_seconds + drafted_pass) >= requests / plain_seconds
        if not self._paid:
            self._misses = min(self._misses + 1, 16)
            share = max(self.probe_share / 2 ** (self._misses - 1), self.least_probe_share)
            self._backoff = min(max(2 * self._backoff, 1), self.max_pause)
            # what this step lost against plain decoding: its drafting, and the rows it added to the pass less
            # the plain time of the tokens they are expected to give (on two AVX2 cores a probe's one row a
            # request costs most of a pass: priced at its drafting alone, a lookup probed every max_pause steps)
            lost = this_draft + drafted_pass - plain_seconds * (requests + expected) / requests
            paid_for = math.ceil(max(lost, 0.0) / (share * plain_seconds))
            self._pause = min(max(self._backoff, paid_for), self.longest_pause)
        else:
            self._backoff, self._misses = 0, 0

    def observe(self, draft: Draft, accepted: int, request_id: int | None = None) -> None:
        """A verified draft had `accepted` tokens accepted; the request (if given) is charged the step."""
        if request_id is not None:
            ledger = self._ledger.setdefault(request_id, _Ledger())
            ledger.tokens += 1 + accepted
            if self._step is not None:  # a drafting step: what it cost beyond plain passes for these tokens
                ledger.lag += self._step.seconds - (1 + accepted) * self._step.plain_seconds
        if self._probe_step and self._step is not None:
            self._judge_probe(accepted)
        if draft.tokens:
            self.acceptance.observe(_confidence(draft), len(draft.tokens), accepted, draft.calibrated)
            if self._probe_step and self.acceptance.fitted:  # probes are rare: waiting for 100 outcomes
                self.acceptance.fit()  # would keep a stale estimate pausing for the rest of the calls

    def _judge_probe(self, accepted: int) -> None:
        """A probe's pause was set on the estimate it was sent to test; once all its outcomes are in, a probe
        that was in fact faster than plain decoding ends the pause and the misses: the estimate, refit on its
        outcomes, decides the next step. (Judged on the prediction alone, a drafter whose first drafts failed,
        suffix decoding before it has seen an answer, kept stretching its pauses while its probes paid: a
        fresh server drafted in a third of the passes a settled one did.)"""
        step = self._step
        step.tokens += 1 + accepted
        step.observed += 1
        if step.observed == step.requests and step.tokens * step.plain_seconds >= step.requests * step.seconds:
            self._pause, self._backoff, self._misses, self._paid = 0, 0, 0, True

    def lag(self, request_id: int) -> float:
        """Seconds request `request_id` is behind plain decoding, as the cost model predicts (< 0: ahead)."""
        return self._ledger[request_id].lag if request_id in self._ledger else 0.0


@dataclass
class _Step:
    """What `trim` predicted for the step it cut, for the ledgers."""

    seconds: float  # this step's drafting plus the pass of every row kept
    plain_seconds: float  # one plain pass of the same requests
    requests: int
    tokens: int = 0  # what its requests got, as their outcomes come in (a probe is judged on them)
    observed: int = 0


@dataclass
class _Ledger:
    """One request's account against plain decoding."""

    lag: float = 0.0  # seconds behind plain decoding (< 0: ahead)
    tokens: int = 0  # tokens it has got

    def allowance(self, plain_seconds: float, share: float) -> float:
        """Seconds this step may still put it behind: one plain step, plus `share` of the plain time of the
        tokens it has got (so one unlucky step early on does not stop drafting for good), less its lag."""
        return plain_seconds * (1.0 + share * self.tokens) - self.lag


def sigmoid(z: np.ndarray) -> np.ndarray:
    return np.exp(-np.logaddexp(0.0, -z))  # never overflows, however large a logit margin gets


def _confidence(draft: Draft) -> list[float]:
    return draft.confidence if draft.confidence is not None else [0.0] * len(draft.tokens)

