"""SuffixDecoding: drafts from suffix trees of the current request and of recent finished answers.

A tree stores every window tokens[i : i + depth] of the sequences added to it; a node's count is how
often its path occurred. To draft, the context's last m tokens are matched (m = 1, 2, ... while a match
exists), and a draft grows from the matched node along the most frequent child while the path
probability (product of child/parent count ratios) stays >= min_token_prob. Each candidate is scored by
the sum of its path probabilities (its expected accepted length); the best over all m and over the
request's own tree and the global tree wins. Written here in plain Python with
Arctic's rules (arctic-inference 0.3.0 is a source-only package on PyPI).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from specstand.drafters.base import Draft, Drafter, DraftingContext, HiddenRows, MethodSpec, SequenceView

# how well a draft (the tokens grown so far, the last one new) fits a composing drafter's rule: 0 best, larger
# worse, None not at all. A draft grows by the best-fitting of the KEEP_TRIES most frequent children.
Keep = Callable[[list[int]], int | None]
KEEP_TRIES = 4


class Candidate(NamedTuple):
    tokens: list[int]
    score: float  # expected accepted length: the sum of the path probabilities
    probs: list[float]  # path probability of each token (product of count ratios down to it)


ROOT = 0


class SuffixTree:
    """Nodes are ids into two flat lists, their counts and their children (token -> child id): a prompt adds
    tens of thousands of nodes, and as objects each would be scanned by CPython's cyclic collector on every
    full collection (measured in a 4-user server: 0.1-0.3 s pauses of the engine thread, several a minute).
    A dict of ints is never tracked by the collector, so these lists cost it one object each."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.counts = [0]
        self.children: list[dict[int, int]] = [{}]
        self._free: list[int] = []  # ids of removed nodes, reused before the lists grow
        self._open: list[int] = []  # deepest nodes of the windows still growing (appending mode)
        # appends since start_undo_log: (parent, token, child, whether the child was made), and the windows then
        self._undo: list[tuple[int, int, int, bool]] | None = None
        self._open_at_log: list[int] = []

    def count(self, path: list[int]) -> int:
        """How often `path` occurred (0: never)."""
        node = self._walk(path)
        return 0 if node is None else self.counts[node]

    def append(self, token: int) -> None:
        """Extend the one sequence this tree indexes by a token (every window ending here grows)."""
        counts, children, grown, log = self.counts, self.children, [], self._undo
        for node in [*self._open, ROOT]:
            child = children[node].get(token)
            made = child is None
            if made:
                child = children[node][token] = self._new_node()
            counts[child] += 1
            grown.append(child)
            if log is not None:
                log.append((node, token, child, made))
        # a window that reached max_depth stops growing; windows are ordered oldest first
        self._open = grown[1:] if len(grown) >= self.max_depth else grown

    def start_undo_log(self) -> None:
        """Record the appends from here on, so that `undo` can take them back (a request's answer)."""
        self._undo, self._open_at_log = [], self._open.copy()

    def undo(self) -> None:
        """Take back every append since `start_undo_log`: the counts, children and growing windows of then."""
        counts, children = self.counts, self.children
        for node, token, child, made in reversed(self._undo or []):
            counts[child] -= 1
            if made:  # newest first, so its own children are gone already
                del children[node][token]
                if child == len(counts) - 1:
                    counts.pop()
                    children.pop()
                else:
                    self._free.append(child)
        self._open, self._undo = self._open_at_log, None

    def add(self, tokens: list[int], delta: int = 1) -> None:
        """Add (delta=1) or remove (delta=-1) every window of an independent sequence."""
        counts, children = self.counts, self.children
        for i in range(len(tokens)):
            node = ROOT
            for token in tokens[i : i + self.max_depth]:
                child = children[node].get(token)
                if child is None:
                    child = children[node][token] = self._new_node()
                counts[child] += delta
                if counts[child] == 0:  # so is every count below it: the windows through it are gone
                    del children[node][token]
                    self._free_subtree(child)
                    break
                node = child

    def _new_node(self) -> int:
        if self._free:
            node = self._free.pop()  # its children were dropped when it was freed
            self.counts[node] = 0
            return node
        self.counts.append(0)
        self.children.append({})
        return len(self.counts) - 1

    def _free_subtree(self, node: int) -> None:
        stack = [node]
        while stack:
            node = stack.pop()
            stack.extend(self.children[node].values())
            self.children[node] = {}
            self._free.append(node)

    def best_draft(
        self, context: list[int], max_tokens: int, min_prob: float, max_spec_factor: float = 1.0,
        keep: Keep | None = None,
    ) -> Candidate:
        """The best-scoring draft over all match lengths m; a match of m tokens drafts at most
        m * max_spec_factor tokens (short matches are weak evidence). With `keep`, a draft grows only by
        tokens it accepts (the most frequent such child)."""
        best = Candidate([], 0.0, [])
        for m in range(1, min(len(context), self.max_depth - 1) + 1):
            node = self._walk(context[-m:])
            if node is None:
                break  # a longer suffix contains this one, so it cannot match either
            candidate = self._grow(node, min(max_tokens, int(m * max_spec_factor)), min_prob, keep)
            if candidate.score > best.score:
                best = candidate
        return best

    def _walk(self, tokens: list[int]) -> int | None:
        node: int | None = ROOT
        for token in tokens:
            node = self.children[node].get(token)
            if node is None:
                return None
        return node

    def _grow(self, node: int, max_tokens: int, min_prob: float, keep: Keep | None = None) -> Candidate:
        counts, draft, probs, prob = self.counts, [], [], 1.0
        while len(draft) < max_tokens and self.children[node]:
            if keep is None:
                token, child = max(self.children[node].items(), key=lambda item: counts[item[1]])
            else:
                ranked = sorted(self.children[node].items(), key=lambda item: -counts[item[1]])[:KEEP_TRIES]
                kept = _best_fit(ranked, draft, keep)
                if kept is None:
                    break
                token, child = kept
            prob *= counts[child] / counts[node]
            if prob < min_prob:
                break
            draft.append(token)
            probs.append(prob)
            node = child
        return Candidate(draft, sum(probs), probs)


def _best_fit(ranked: list[tuple[int, int]], draft: list[int], keep: Keep) -> tuple[int, int] | None:
    """The first child (most frequent first) that fits best; a perfect fit (0) ends the search."""
    best, best_fit = None, None
    for item in ranked:
        fit = keep([*draft, item[0]])
        if fit is not None and (best_fit is None or fit < best_fit):
            best, best_fit = item, fit
            if fit == 0:
                break
    return best


@dataclass(frozen=True)
class SuffixConfig:
    max_depth: int = 24
    min_token_prob: float = 0.1
    max_spec_factor: float = 1.0
    max_cached_responses: int = 10_000
    # prompts' trees kept, once their requests end, to start later prompts that extend them (an agent's next
    # call extends its last prompt): indexing a 2000-token prompt anew took 15-20 ms of the engine thread a
    # call; about 10 MB each
    max_cached_prompts: int = 8


class SuffixDrafter(Drafter):
    name = "suffix"

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config or SuffixConfig()
        self.global_tree = SuffixTree(self.config.max_depth)
        self._responses: deque[list[int]] = deque()
        self._local: dict[int, tuple[list[int], SuffixTree]] = {}  # request -> its prompt, its tree
        # ended requests' prompt trees, newest last; the oldest drop out past max_cached_prompts
        self._idle: deque[tuple[list[int], SuffixTree]] = deque(maxlen=self.config.max_cached_prompts)

    def begin(self, seq: SequenceView) -> None:
        prompt = list(seq.token_ids)
        tree, start = self._idle_head(prompt)
        for token in prompt[start:]:
            tree.append(token)
        if self.config.max_cached_prompts > 0:
            tree.start_undo_log()  # the answer's windows are taken back when the request ends
        self._local[seq.request_id] = (prompt, tree)

    def _idle_head(self, prompt: list[int]) -> tuple[SuffixTree, int]:
        """The idle tree of the longest cached prompt that `prompt` starts with (taken out of the cache) and that
        prompt's length, or a new tree and 0: appending the rest gives the nodes of appending `prompt` whole."""
        best, best_length = None, -1
        for i, (cached, _) in enumerate(self._idle):
            if best_length < len(cached) <= len(prompt) and prompt[: len(cached)] == cached:
                best, best_length = i, len(cached)
        if best is None:
            return SuffixTree(self.config.max_depth), 0
        _, tree = self._idle[best]
        del self._idle[best]
        return tree, best_length

    def propose(self, seq: SequenceView, max_tokens: int, keep: Keep | None = None) -> Draft:
        """With `keep` (a composing drafter's rule, e.g. a schema's), drafts grow only by tokens it accepts."""
        if max_tokens <= 0:
            return Draft([])
        context = seq.token_ids[-self.config.max_depth :]
        cfg = self.config
        local = self._local[seq.request_id][1].best_draft(context, max_tokens, cfg.min_token_prob, cfg.max_spec_factor,
                                                       keep)
        shared = self.global_tree.best_draft(context, max_tokens, cfg.min_token_prob, cfg.max_spec_factor, keep)
        best = max(local, shared, key=lambda candidate: candidate.score)
        return Draft(best.tokens, confidence=best.probs)

    def extend(self, seq: SequenceView, new_tokens: list[int], hidden: HiddenRows | None = None) -> None:
        tree = self._local[seq.request_id][1]
        for token in new_tokens:
            tree.append(token)

    def forget(self) -> None:
        self.global_tree = SuffixTree(self.config.max_depth)
        self._responses.clear()
        self._idle.clear()

    def end(self, seq: SequenceView) -> None:
        local = self._local.pop(seq.request_id, None)
        if local is not None and self.config.max_cached_prompts > 0:
            prompt, tree = local
            tree.undo()
            self._idle.append((prompt, tree))
        response = seq.output_ids
        if not response or self.config.max_cached_responses <= 0:
            return
        self.global_tree.add(response)
        self._responses.append(response)
        if len(self._responses) > self.config.max_cached_responses:
            self.global_tree.add(self._responses.popleft(), delta=-1)


def _make(context: DraftingContext) -> SuffixDrafter:
    return SuffixDrafter()


METHOD = MethodSpec("suffix", "SuffixDecoding over this request's and earlier answers", make=_make,
                    vllm_names=("suffix",))
