"""Speculative decoding of one request, written to be read: the algorithm the engine runs, without
batching, prompt chunks, prefix reuse, adaptive budgets or failure isolation. Its answers are the
engine's (tests/engine/test_reference.py)."""

from __future__ import annotations

import torch

from specstand.drafters import Draft, Drafter, HiddenRows, SequenceView
from specstand.runner import PassInput, TargetRunner
from specstand.runner.exactness import row_unit
from specstand.runner.target import TargetModel
from specstand.verification import SamplingParams, verify


def speculate(model: TargetModel, drafter: Drafter | None, prompt_ids: list[int], max_tokens: int, k: int = 5,
              stop_token_ids: tuple[int, ...] = (), sampling: SamplingParams | None = None,
              seed: int = 0) -> list[int]:
    """The answer to `prompt_ids`: each step the drafter proposes up to `k` tokens, one target pass over
    [last token, *draft] verifies them, the cache rolls back to what was accepted."""
    sampling, generator = sampling or SamplingParams(), torch.Generator().manual_seed(seed)
    runner = TargetRunner(model, 1, len(prompt_ids) + max_tokens + 2 * (k + 1))
    unit = row_unit(runner, k + 1)  # pass rows padded to a multiple of it keep each row's bits (exactness.py)
    taps = drafter.tap_layers if drafter is not None else ()
    seq = SequenceView(0, list(prompt_ids), len(prompt_ids), sampling.temperature)
    slot = runner.cache.allocate()
    output = runner.prefill(slot, seq.token_ids, taps)
    if drafter is not None:
        drafter.begin(seq)
    verdict = verify([], None, output.logits, sampling, generator)  # the prompt's last row: the first token
    hidden = HiddenRows(0, output.taps)
    while True:
        tokens = verdict.tokens[: max_tokens - len(seq.output_ids)]
        stop = next((i for i, t in enumerate(tokens) if t in stop_token_ids), None)
        seq.token_ids.extend(tokens if stop is None else tokens[: stop + 1])
        if stop is not None or len(seq.output_ids) == max_tokens:
            break
        if drafter is not None:  # what the target emitted, and the hidden rows of the positions it cached
            drafter.extend(seq, tokens, hidden if taps else None)
        budget = min(k, max_tokens - len(seq.output_ids) - 1)  # the pass emits one token past the draft
        draft = drafter.propose(seq, budget).cut(budget) if drafter is not None and budget > 0 else Draft([])
        start = len(seq.token_ids) - 1  # the last emitted token is not in the cache yet
        rows = [seq.token_ids[-1], *draft.tokens]
        output = runner.run([PassInput(slot, rows)], -(-len(rows) // unit) * unit, taps)[0]
        verdict = verify(draft.tokens, draft.probs, output.logits, sampling, generator)
        runner.cache.rollback(slot, start + 1 + verdict.accepted)  # the pending token and the accepted draft
        hidden = HiddenRows(start, {layer: t[: verdict.accepted + 1] for layer, t in output.taps.items()})
    if drafter is not None:
        drafter.end(seq)
    return seq.output_ids
