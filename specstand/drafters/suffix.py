"""SuffixDecoding: drafts from suffix trees of the current request and of recent finished answers.

A tree stores every window tokens[i : i + depth] of the sequences added to it; a node's count is how
often its path occurred. To draft, the context's last m tokens are matched (m = 1, 2, ... while a match
exists), and a draft grows from the matched node along the most frequent child while the path
probability (product of child/parent count ratios) stays >= min_token_prob. Each candidate is scored by
the sum of its path probabilities (its expected accepted length); the best over all m and over the
request's own tree and the global tree wins. Written here in plain Python with
Arctic's rules (arctic-inference 0.3.0 is a source-only package on PyPI); a request's tree leaves the paths
that occurred once as chains read from its tokens (SuffixTree's docstring).
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
# undo log entries: a chain node made under a parent, a count raised, a chain node shared (made into a node)
_MADE, _COUNTED, _SHARED = 0, 1, 2
Cursor = tuple[int, int]  # a node and how many tokens below it along its chain (0: the node itself)


class SuffixTree:
    """Nodes are ids into two flat lists, their counts and their children (token -> child id): a prompt adds
    thousands of nodes, and as objects each would be scanned by CPython's cyclic collector on every full
    collection (measured in a 4-user server: 0.1-0.3 s pauses of the engine thread, several a minute). A dict of
    ints is never tracked by the collector, so these lists cost it one object each.

    A tree indexes either one growing sequence (`append`, `undo`) or independent sequences (`add`), not both. An
    appending tree keeps a node that occurred once as a chain: its subtree is what followed that one occurrence,
    read from `tokens`. Windows of a prompt share few nodes (a 2000-token prompt of the demo: 2.5 shared nodes a
    token, 19 single ones), so appending steps only the windows still on shared nodes; a chain's next node is
    made when a second occurrence reaches it."""

    def __init__(self, max_depth: int) -> None:
        self.max_depth = max_depth
        self.counts = [0]
        self.children: list[dict[int, int]] = [{}]
        self.tokens: list[int] = []  # the sequence appended
        self._chains: dict[int, tuple[int, int]] = {}  # chain node -> (where its occurrence goes on in tokens, depth)
        self._free: list[int] = []  # ids of removed nodes, reused before the lists grow
        self._open: list[Cursor] = []  # (node, depth) of the growing windows on shared nodes, oldest first
        self._undo: list[tuple[int, ...]] | None = None  # appends since start_undo_log
        self._at_log: tuple[list[Cursor], int] = ([], 0)  # the growing windows and the length then

    def count(self, path: list[int]) -> int:
        """How often `path` occurred (0: never)."""
        cursor = self._walk(path)
        return 0 if cursor is None else self.counts[cursor[0]]

    def append(self, token: int) -> None:
        """Extend the one sequence this tree indexes by a token (every window ending here grows)."""
        counts, children, chains, log = self.counts, self.children, self._chains, self._undo
        self.tokens.append(token)
        grown = []
        for node, depth in [*self._open, (ROOT, 0)]:
            child = children[node].get(token)
            if child is None:  # the window leaves the shared nodes: from here it is a chain
                child = children[node][token] = self._new_node()
                counts[child] = 1
                chains[child] = (len(self.tokens), depth + 1)
                if log is not None:
                    log.append((_MADE, node, token, child))
                continue
            counts[child] += 1
            if counts[child] == 2:
                self._share(child)
            elif log is not None:
                log.append((_COUNTED, child))
            if depth + 1 < self.max_depth:  # a window of max_depth tokens stops growing
                grown.append((child, depth + 1))
        self._open = grown

    def _share(self, node: int) -> None:
        """A chain node's second occurrence: it becomes a node, and its first occurrence's next token a chain."""
        at, depth = self._chains.pop(node)
        made = -1
        if depth < self.max_depth:  # at < len(tokens): the first occurrence came before this one
            made = self.children[node][self.tokens[at]] = self._new_node()
            self.counts[made] = 1
            self._chains[made] = (at + 1, depth + 1)
        if self._undo is not None:
            self._undo.append((_SHARED, node, at, depth, made))

    def start_undo_log(self) -> None:
        """Record the appends from here on, so that `undo` can take them back (a request's answer)."""
        self._undo, self._at_log = [], (self._open.copy(), len(self.tokens))

    def undo(self) -> None:
        """Take back every append since `start_undo_log`: the nodes, counts, chains and growing windows of then.
        Without a log (none started, or taken back already) there is nothing to take back."""
        if self._undo is None:
            return
        counts, children, chains = self.counts, self.children, self._chains
        for entry in reversed(self._undo):
            if entry[0] == _COUNTED:
                counts[entry[1]] -= 1
            elif entry[0] == _MADE:
                _, parent, token, child = entry
                del children[parent][token]
                self._drop(child)
            else:
                _, node, at, depth, made = entry
                counts[node] = 1
                if made >= 0:
                    del children[node][self.tokens[at]]
                    self._drop(made)
                chains[node] = (at, depth)
        self._open, length = self._at_log
        del self.tokens[length:]
        self._undo = None

    def _drop(self, node: int) -> None:
        """Free a chain node taken back by undo (newest first, so nothing hangs below it)."""
        del self._chains[node]
        if node == len(self.counts) - 1:
            self.counts.pop()
            self.children.pop()
        else:
            self._free.append(node)

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
            cursor = self._walk(context[-m:])
            if cursor is None:
                break  # a longer suffix contains this one, so it cannot match either
            candidate = self._grow(cursor, min(max_tokens, int(m * max_spec_factor)), min_prob, keep)
            if candidate.score > best.score:
                best = candidate
                if best.score >= max_tokens:  # every token certain: no longer match can score higher
                    break
        return best

    def _walk(self, path: list[int]) -> Cursor | None:
        node, children, chains = ROOT, self.children, self._chains
        for i, token in enumerate(path):
            child = children[node].get(token)
            if child is None:  # a chain node has no children of its own: the path may go on along its chain
                chain = chains.get(node)
                return None if chain is None else self._walk_chain(node, chain, path[i:])
            node = child
        return node, 0

    def _walk_chain(self, node: int, chain: tuple[int, int], path: list[int]) -> Cursor | None:
        at, depth = chain
        if depth + len(path) > self.max_depth or self.tokens[at : at + len(path)] != path:
            return None
        return node, len(path)

    def _next(self, cursor: Cursor) -> list[tuple[int, Cursor]]:
        """The tokens that follow a cursor, in the order they first occurred, each with its cursor."""
        node, below = cursor
        chain = self._chains.get(node)
        if chain is None:
            return [(token, (child, 0)) for token, child in self.children[node].items()]
        at, depth = chain
        if depth + below < self.max_depth and at + below < len(self.tokens):
            return [(self.tokens[at + below], (node, below + 1))]
        return []

    def _most_frequent(self, cursor: Cursor) -> tuple[int, Cursor] | None:
        """The most frequent next token (the first to occur among equals) and its cursor; None at a leaf."""
        children = self.children[cursor[0]]
        if children:
            token, child = max(children.items(), key=lambda item: self.counts[item[1]])
            return token, (child, 0)
        options = self._next(cursor)  # a chain's one next token, if it goes on
        return options[0] if options else None

    def _grow(self, cursor: Cursor, max_tokens: int, min_prob: float, keep: Keep | None = None) -> Candidate:
        counts, draft, probs, prob = self.counts, [], [], 1.0
        while len(draft) < max_tokens:
            if keep is None:
                step = self._most_frequent(cursor)
            else:
                ranked = sorted(self._next(cursor), key=lambda option: -counts[option[1][0]])[:KEEP_TRIES]
                step = _best_fit(ranked, draft, keep)
            if step is None:
                break
            token, child = step
            prob *= counts[child[0]] / counts[cursor[0]]
            if prob < min_prob:
                break
            draft.append(token)
            probs.append(prob)
            cursor = child
        return Candidate(draft, sum(probs), probs)


def _best_fit(ranked: list[tuple[int, Cursor]], draft: list[int], keep: Keep) -> tuple[int, Cursor] | None:
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
    # call extends its last prompt): indexing a 2000-token prompt anew takes about 5 ms of the engine thread;
    # about 2 MB each
    max_cached_prompts: int = 8


class SuffixDrafter(Drafter):
    name = "suffix"

    def __init__(self, config: SuffixConfig | None = None) -> None:
        self.config = config or SuffixConfig()
        self.global_tree = SuffixTree(self.config.max_depth)
        self._responses: deque[list[int]] = deque()
        self._local: dict[int, SuffixTree] = {}  # request -> the tree of its prompt (and answer so far)
        # ended requests' prompt trees, newest last; the oldest drop out past max_cached_prompts
        self._idle: deque[SuffixTree] = deque(maxlen=self.config.max_cached_prompts)

    def begin(self, seq: SequenceView) -> None:
        prompt = seq.token_ids
        tree = self._idle_head(prompt)
        for token in prompt[len(tree.tokens) :]:
            tree.append(token)
        if self.config.max_cached_prompts > 0:
            tree.start_undo_log()  # the answer's windows are taken back when the request ends
        self._local[seq.request_id] = tree

    def _idle_head(self, prompt: list[int]) -> SuffixTree:
        """The idle tree of the longest cached prompt that `prompt` starts with (taken out of the cache), or a new
        tree: appending the rest of `prompt` gives the tree of appending it whole."""
        best, best_length = None, -1
        for i, tree in enumerate(self._idle):
            cached = tree.tokens
            if best_length < len(cached) <= len(prompt) and prompt[: len(cached)] == cached:
                best, best_length = i, len(cached)
        if best is None:
            return SuffixTree(self.config.max_depth)
        tree = self._idle[best]
        del self._idle[best]
        return tree

    def propose(self, seq: SequenceView, max_tokens: int, keep: Keep | None = None) -> Draft:
        """With `keep` (a composing drafter's rule, e.g. a schema's), drafts grow only by tokens it accepts."""
        if max_tokens <= 0:
            return Draft([])
        context = seq.token_ids[-self.config.max_depth :]
        cfg = self.config
        best = self._local[seq.request_id].best_draft(context, max_tokens, cfg.min_token_prob,
                                                      cfg.max_spec_factor, keep)
        if best.score < max_tokens:  # else the answers' tree cannot score higher (and a tie keeps the request's)
            shared = self.global_tree.best_draft(context, max_tokens, cfg.min_token_prob, cfg.max_spec_factor,
                                                 keep)
            best = max(best, shared, key=lambda candidate: candidate.score)
        return Draft(best.tokens, confidence=best.probs)

    def extend(self, seq: SequenceView, new_tokens: list[int], hidden: HiddenRows | None = None) -> None:
        tree = self._local[seq.request_id]
        for token in new_tokens:
            tree.append(token)

    def forget(self) -> None:
        self.global_tree = SuffixTree(self.config.max_depth)
        self._responses.clear()
        self._idle.clear()

    def end(self, seq: SequenceView) -> None:
        tree = self._local.pop(seq.request_id, None)
        if tree is not None and self.config.max_cached_prompts > 0:
            tree.undo()
            self._idle.append(tree)
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
