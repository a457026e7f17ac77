import random

import pytest

from specstand.drafters import SequenceView, SuffixConfig
from specstand.drafters.suffix import SuffixDrafter, SuffixTree


def test_appending_tree_counts_every_window():
    tree = SuffixTree(max_depth=3)
    for token in [1, 2, 1, 2, 1]:
        tree.append(token)
    assert tree.count([1]) == 3 and tree.count([2]) == 2
    assert tree.count([1, 2]) == 2
    assert tree.count([1, 2, 1]) == 2
    assert tree.count([1, 2, 1, 2]) == 0  # depth is capped at 3


def test_add_and_remove_are_inverse():
    tree = SuffixTree(max_depth=4)
    tree.add([1, 2, 3, 4, 5])
    tree.add([1, 2, 9])
    tree.add([1, 2, 9], delta=-1)
    reference = SuffixTree(max_depth=4)
    reference.add([1, 2, 3, 4, 5])

    def dump(tree, node=0):
        return {t: (tree.counts[c], dump(tree, c)) for t, c in tree.children[node].items()}

    assert dump(tree) == dump(reference)


def test_removed_nodes_are_reused():
    tree = SuffixTree(max_depth=4)
    tree.add([1, 2, 3, 4, 5])
    size = len(tree.counts)
    for _ in range(3):
        tree.add([6, 7, 8])
        tree.add([6, 7, 8], delta=-1)
    assert len(tree.counts) == size + 6  # the windows of [6, 7, 8] once, their ids reused after
    assert tree.count([6]) == 0 and tree.count([1, 2, 3]) == 1


def test_draft_follows_the_most_frequent_path_while_probable():
    tree = SuffixTree(max_depth=8)
    for seq in ([7, 1, 2, 3, 4], [7, 1, 2, 3, 4], [7, 1, 2, 3, 4], [7, 1, 2, 5, 6]):
        tree.add(seq)
    draft, score, probs = tree.best_draft([9, 7, 1, 2], max_tokens=4, min_prob=0.5)
    assert draft == [3, 4]  # after [7, 1, 2] the path 3 has probability 3/4, then 4 keeps it at 3/4
    assert probs == [0.75, 0.75] and score == 0.75 + 0.75
    assert tree.best_draft([9, 7, 1, 2], max_tokens=4, min_prob=0.8)[0] == []


def test_draft_is_no_longer_than_the_match():
    tree = SuffixTree(max_depth=8)
    tree.add([5, 1, 2, 3, 4, 6])
    assert tree.best_draft([9, 5], max_tokens=4, min_prob=0.1)[0] == [1]
    assert tree.best_draft([9, 5, 1], max_tokens=4, min_prob=0.1)[0] == [2, 3]
    assert tree.best_draft([9, 5, 1], max_tokens=4, min_prob=0.1, max_spec_factor=2.0)[0] == [2, 3, 4, 6]


def test_global_tree_learns_finished_answers_and_evicts_old_ones():
    drafter = SuffixDrafter(SuffixConfig(max_cached_responses=1))
    answer = [10, 11, 12, 13, 14, 15]
    first = SequenceView(0, [1, 2] + answer, 2)
    drafter.begin(first)
    drafter.end(first)
    second = SequenceView(1, [3, 4, 10, 11, 12], 2)
    drafter.begin(second)
    assert drafter.propose(second, 3).tokens == [13, 14, 15]
    drafter.end(SequenceView(1, [3, 4, 20, 21], 2))  # evicts the first answer
    third = SequenceView(2, [5, 10, 11, 12], 1)
    drafter.begin(third)
    assert drafter.propose(third, 3).tokens == []


def test_forget_drops_earlier_answers():
    drafter = SuffixDrafter()
    first = SequenceView(0, [1, 2, 10, 11, 12, 13], 2)
    drafter.begin(first)
    drafter.end(first)
    drafter.forget()
    second = SequenceView(1, [3, 10, 11], 1)
    drafter.begin(second)
    assert drafter.propose(second, 2).tokens == []
    drafter.end(SequenceView(1, [3, 20, 21, 22], 1))  # it learns again after forgetting
    third = SequenceView(2, [4, 20, 21], 1)
    drafter.begin(third)
    assert drafter.propose(third, 1).tokens == [22]


def test_local_tree_follows_extensions():
    drafter = SuffixDrafter()
    seq = SequenceView(0, [1, 2, 3, 4, 9], 5)
    drafter.begin(seq)
    for token in [1, 2]:
        seq.token_ids.append(token)
        drafter.extend(seq, [token])
    assert drafter.propose(seq, 2).tokens[:2] == [3, 4]


def _nodes(tree, node=0):
    """The tree as it is held: each node's count, its chain (if it is one) and its children, by token."""
    return {t: (tree.counts[c], tree._chains.get(c), _nodes(tree, c)) for t, c in tree.children[node].items()}


def _paths(tree, cursor=(0, 0)):
    """The tree as it reads: each path's count and what follows it, chains read out."""
    return {t: (tree.counts[c[0]], _paths(tree, c)) for t, c in tree._next(cursor)}


def test_undo_takes_back_an_answer_exactly():
    tree = SuffixTree(max_depth=4)
    for token in [1, 2, 3, 1, 2]:
        tree.append(token)
    before = (_nodes(tree), list(tree._open), list(tree.tokens), len(tree.counts))
    tree.start_undo_log()
    for token in [3, 9, 1, 2, 9, 9]:  # new windows, new nodes, chains made nodes, counts on old ones
        tree.append(token)
    assert _nodes(tree) != before[0]
    tree.undo()
    assert (_nodes(tree), tree._open, tree.tokens, len(tree.counts)) == before


def test_undo_without_a_log_takes_nothing_back():
    tree = SuffixTree(max_depth=4)
    for token in [1, 2]:
        tree.append(token)
    tree.undo()  # no log started
    tree.start_undo_log()
    tree.append(3)
    tree.undo()
    tree.undo()  # the log is spent
    assert tree.tokens == [1, 2] and tree.count([1, 2]) == 1 and tree.count([2, 3]) == 0


def _drafts_over(prompts: list[list[int]], cached: int) -> list[list[int]]:
    """Each prompt is a request: two drafts, one accepted token between them; requests 2 and 3 overlap."""
    drafter, made = SuffixDrafter(SuffixConfig(max_depth=6, max_cached_prompts=cached)), []
    views = [SequenceView(i, list(prompt), len(prompt)) for i, prompt in enumerate(prompts)]
    for i, seq in enumerate(views):
        drafter.begin(seq)
        made.append(drafter.propose(seq, 4).tokens)
        seq.token_ids.append(2)
        drafter.extend(seq, [2])
        made.append(drafter.propose(seq, 4).tokens)
        if i != 2:  # request 2 is still running while request 3 (its own prompt again) begins
            drafter.end(seq)
    drafter.end(views[2])
    return made


def test_drafts_do_not_depend_on_cached_prompt_trees():
    prompts = [[1, 2, 3, 4, 5, 1, 2, 3]]
    for extra in ([6, 1, 2, 7], [1, 2, 3, 4], [8, 8, 1, 2]):
        prompts.append(prompts[-1] + extra)  # an agent's calls: each prompt extends the one before
    prompts[3:3] = [list(prompts[2]), [5, 4, 3, 2, 1]]  # the same prompt twice at once, then an unrelated one
    assert _drafts_over(prompts, 0) == _drafts_over(prompts, 8)
    assert any(_drafts_over(prompts, 8))


def test_cached_prompt_trees_are_bounded_reused_and_forgotten():
    drafter = SuffixDrafter(SuffixConfig(max_cached_prompts=2))
    for i in range(4):
        seq = SequenceView(i, [i, i + 1, i + 2], 3)
        drafter.begin(seq)
        drafter.end(seq)
    assert [tree.tokens for tree in drafter._idle] == [[2, 3, 4], [3, 4, 5]]
    kept = drafter._idle[0]
    longer = SequenceView(9, [2, 3, 4, 7], 4)
    drafter.begin(longer)  # starts from the cached tree of [2, 3, 4], taken out of the cache while in use
    assert drafter._local[9] is kept and [tree.tokens for tree in drafter._idle] == [[3, 4, 5]]
    longer.token_ids += [8, 2]
    drafter.extend(longer, [8, 2])  # its answer
    drafter.end(longer)
    assert [tree.tokens for tree in drafter._idle] == [[3, 4, 5], [2, 3, 4, 7]]
    fresh = SuffixTree(SuffixConfig().max_depth)
    for token in [2, 3, 4, 7]:
        fresh.append(token)
    assert _nodes(kept) == _nodes(fresh) and kept._open == fresh._open  # the answer's windows are gone
    drafter.forget()
    assert not drafter._idle


@pytest.mark.parametrize("seed", range(20))
def test_appending_reads_as_adding_the_sequence_whole(seed):
    """Chains are how an appending tree is held, not what it says: every path's count and every draft equal
    those of a tree that added the sequence's windows outright, also after answers are taken back."""
    rng = random.Random(seed)
    depth = rng.choice([2, 3, 5, 8])
    tree = SuffixTree(depth)
    for _ in range(3):
        for _ in range(rng.randrange(1, 30)):
            tree.append(rng.randrange(4))  # four tokens: many shared windows and repeats
        answer_from = len(tree.tokens)
        tree.start_undo_log()
        for _ in range(rng.randrange(0, 12)):
            tree.append(rng.randrange(5))
        _assert_reads_as_added(tree, rng)
        if rng.random() < 0.7:
            tree.undo()
            assert len(tree.tokens) == answer_from
            _assert_reads_as_added(tree, rng)


def _assert_reads_as_added(tree, rng):
    added = SuffixTree(tree.max_depth)
    added.add(tree.tokens)
    assert _paths(tree) == _paths(added)
    for _ in range(20):
        context = [rng.randrange(5) for _ in range(rng.randrange(1, 10))]
        assert tree.best_draft(context, 6, 0.1, 2.0) == added.best_draft(context, 6, 0.1, 2.0)
