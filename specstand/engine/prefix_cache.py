"""Prefix reuse: a new prompt starts from the longest head of it that is already computed.

Two places hold computed heads:
- the slots: a slot keeps the tokens whose K/V it holds after its request ends (a running slot holds its
  prompt so far), until a new request takes it;
- the store: finished requests' K/V copied out of their slot in blocks of `block` tokens, each keyed by
  a sha256 of its tokens and the block before it (vLLM's automatic prefix caching; a weak hash would let
  two heads that collide share K/V, and one user's context reach another's answer), kept in host memory
  under a byte budget and dropped least recently used first. An agent's system prompt and tool
  definitions are the same for every call it makes, so they outlive the slots that computed them.

Exactness: a position's K/V hold the same bits however they were computed (kv_cache.py), and copies keep
them, so a head from a slot or from the store gives the rows a cold prompt would. Where prompts are
computed in prefill blocks (torch's GEMMs), heads are whole prefill blocks (`unit`).

The store copies K/V tensors only: a target with recurrent state (StateCache with state specs) or a
module cache (the transformers fallback) holds more than K/V per position, so the store is off there
(each cache's `store_off_reason`); reuse from slots goes on as before.
"""

from __future__ import annotations

import hashlib
import os
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from specstand.runner.kv_cache import KVCache

STORE_BLOCK = 16  # tokens per stored block where any head length is exact (compiled prompts)
# the store's default budget: a share of the memory free at start, capped (vLLM's CPU KV space defaults to 4 GiB)
DEFAULT_STORE_SHARE = 0.25
DEFAULT_STORE_CAP = 4 << 30


def default_store_bytes() -> int:
    """The prefix store's budget where none is given: a quarter of the memory available now, at most 4 GiB
    (a bench may run several servers side by side, each with its own store)."""
    import psutil

    return int(min(DEFAULT_STORE_CAP, DEFAULT_STORE_SHARE * psutil.virtual_memory().available))


@dataclass
class _Block:
    parent: bytes | None  # key of the block before it (None: the first block)
    keys: torch.Tensor  # [layers, kv_heads, block, head_dim]
    values: torch.Tensor
    taps: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [block, hidden]

    @property
    def nbytes(self) -> int:
        tensors = [self.keys, self.values, *self.taps.values()]
        return sum(t.numel() * t.element_size() for t in tensors)


class PrefixStore:
    """Hashed blocks of K/V (and tapped hidden rows) in host memory, LRU under `budget_bytes`.

    A block is looked up and inserted only with the chain of blocks before it, and a chain is touched from
    its last block back to its first: a block is then never more recently used than its parent, so the
    least recently used block has no children and eviction never cuts a chain in the middle."""

    def __init__(self, block: int, budget_bytes: int) -> None:
        self.block = block
        self.budget_bytes = budget_bytes
        self.nbytes = 0
        self._blocks: OrderedDict[bytes, _Block] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def clear(self) -> None:
        self._blocks.clear()
        self.nbytes = 0

    def _chain(self, tokens: list[int]) -> list[bytes]:
        """The key of every whole block of `tokens`: the digest of the block's tokens after its parent's key,
        so a key stands for the whole head up to the block's end."""
        chain, parent = [], b""
        for start in range(0, len(tokens) - self.block + 1, self.block):
            parent = hashlib.sha256(parent + array("q", tokens[start : start + self.block]).tobytes()).digest()
            chain.append(parent)
        return chain

    def _touch(self, keys: list[bytes]) -> None:
        for key in reversed(keys):
            self._blocks.move_to_end(key)

    def lookup(self, tokens: list[int]) -> list[_Block]:
        """The stored blocks that head `tokens`, in order (marked used)."""
        found, keys = [], []
        for key in self._chain(tokens):
            block = self._blocks.get(key)
            if block is None:
                break
            found.append(block)
            keys.append(key)
        self._touch(keys)
        return found

    def insert(self, tokens: list[int], cache: KVCache, slot: int, taps: dict[int, torch.Tensor]) -> None:
        """Store the whole blocks of `tokens`, whose K/V are the first positions of `slot` (and whose tapped
        rows are `taps`), that are not stored yet; then evict down to the budget."""
        keys = self._chain(tokens)
        for index, key in enumerate(keys):
            if key in self._blocks:
                continue
            span = slice(index * self.block, (index + 1) * self.block)
            block = _Block(keys[index - 1] if index else None, cache.keys[:, slot, :, span].clone(),
                           cache.values[:, slot, :, span].clone(),
                           {layer: rows[span].clone() for layer, rows in taps.items()})
            self._blocks[key] = block
            self.nbytes += block.nbytes
        self._touch(keys)
        while self.nbytes > self.budget_bytes and self._blocks:
            self._drop(next(iter(self._blocks)))

    def _drop(self, key: bytes) -> None:
        self.nbytes -= self._blocks.pop(key).nbytes


@dataclass
class Placed:
    """A new request's slot and the head it starts from."""

    slot: int
    reused: int  # positions whose K/V the slot holds already
    taps: dict[int, torch.Tensor]  # their tapped hidden rows
    from_store: int  # of those, positions copied from the store


class PrefixCache:
    """The heads each slot holds and the store behind them; gives a new prompt a slot with its longest
    cached head."""

    def __init__(self, cache: KVCache, enabled: bool, unit: int, keep_answers: bool, tap_layers: tuple[int, ...],
                 store_bytes: int) -> None:
        self.cache = cache
        self.enabled = enabled
        self.unit = unit  # a reused head is a multiple of this many positions
        self.keep_answers = keep_answers  # a finished answer's K/V are reusable (not prompt blocks only)
        self.tap_layers = tap_layers
        self.store_off_reason = cache.store_off_reason if enabled and store_bytes > 0 else None
        store_on = enabled and store_bytes > 0 and self.store_off_reason is None
        self.store = PrefixStore(max(STORE_BLOCK, unit) // unit * unit, store_bytes) if store_on else None
        self._heads: dict[int, list[int]] = {}  # slot -> the tokens whose K/V its first positions hold
        # slot -> the target's tapped hidden rows of those tokens: a drafter that reads them gets the whole
        # prompt even when its head came from the cache
        self._taps: dict[int, dict[int, torch.Tensor]] = {}
        self._last_use: dict[int, int] = {}  # slot -> when its request ended (free slots are evicted LRU)
        self._clock = 0

    def heads(self) -> list[list[int]]:
        return list(self._heads.values())

    def clear(self, slots: list[int] | None = None) -> None:
        """Forget the heads of `slots` (every slot: None) and everything stored."""
        for slot in list(self._heads) if slots is None else slots:
            self.forget(slot)
        if self.store is not None:
            self.store.clear()

    def forget(self, slot: int) -> None:
        self._heads.pop(slot, None)
        self._taps.pop(slot, None)
        self._last_use.pop(slot, None)

    def cached_length(self, prompt: list[int]) -> int:
        """How many head positions of `prompt` some slot or the store holds now (not yet rounded)."""
        return max(self._slot_head(prompt)[1], self._stored_length(prompt))

    def _slot_head(self, prompt: list[int]) -> tuple[int | None, int]:
        """The slot whose head shares the most with `prompt` (a free one among equals) and how much."""
        free = self.cache.free_slot_ids
        donor, common = None, 0
        if self.enabled:
            for slot, head in self._heads.items():
                n = common_prefix(head, prompt)
                if n > common or (n == common and n and slot in free):
                    donor, common = slot, n
        return donor, common

    def _stored_length(self, prompt: list[int]) -> int:
        if self.store is None:
            return 0
        return len(self.store.lookup(prompt[: len(prompt) - 1])) * self.store.block

    def place(self, prompt: list[int]) -> Placed:
        """Take a free slot for `prompt` holding its longest reusable head (never its last token: its logits
        are needed)."""
        donor, common = self._slot_head(prompt)
        free = self.cache.free_slot_ids
        reuse = 0 if donor is None else self.cache.reusable_length(donor, min(common, len(prompt) - 1), self.unit)
        stored = self.store.lookup(prompt[: len(prompt) - 1]) if self.store is not None else []
        if stored and len(stored) * self.store.block > reuse:
            return self._place_from_store(stored)
        others = [slot for slot in free if slot != donor]
        # take the donor itself where that loses nothing it held, or no other slot is free
        if reuse and donor in free and (len(self._heads[donor]) <= reuse or not others):
            target = donor
        else:
            target = self._evictable(others or free)
        self.cache.allocate(target)
        if reuse and target != donor:
            self.cache.copy_prefix(donor, target, reuse)
        else:
            self.cache.rollback(target, reuse)
        taps = {k: t[:reuse] for k, t in self._taps.get(donor, {}).items()} if reuse else {}
        self.forget(target)  # its K/V above `reuse` are about to change
        return Placed(target, reuse, taps, 0)

    def _place_from_store(self, blocks: list[_Block]) -> Placed:
        target = self._evictable(self.cache.free_slot_ids)
        self.cache.allocate(target)
        size = self.store.block
        for index, block in enumerate(blocks):
            span = slice(index * size, (index + 1) * size)
            self.cache.keys[:, target, :, span] = block.keys
            self.cache.values[:, target, :, span] = block.values
        reused = len(blocks) * size
        self.cache.rollback(target, reused)
        taps = {k: torch.cat([b.taps[k] for b in blocks]) for k in self.tap_layers} if self.tap_layers else {}
        self.forget(target)
        return Placed(target, reused, taps, reused)

    def _evictable(self, slots: list[int]) -> int:
        """The slot least likely to be wanted: one with no head, else the one unused longest."""
        return min(slots, key=lambda slot: (slot in self._heads, self._last_use.get(slot, -1)))

    def computed(self, slot: int, tokens: list[int], taps: dict[int, torch.Tensor]) -> None:
        """Slot `slot` now holds the K/V of `tokens` (a prompt so far) and their tapped rows: later prompts
        may reuse them already."""
        self._heads[slot] = tokens
        if self.tap_layers:
            self._taps[slot] = taps

    def taps(self, slot: int) -> dict[int, torch.Tensor]:
        return self._taps.get(slot, {})

    def release(self, slot: int, tokens: list[int], answer_taps: list[dict[int, torch.Tensor]]) -> None:
        """The request in `slot` ended holding `tokens` (its prompt and answer). The slot keeps what stays
        reusable as its head, and the store a copy of it, before the slot is freed."""
        if slot in self._heads:
            if self.keep_answers:
                held = min(self.cache.lengths[slot], len(tokens))
                self._heads[slot] = tokens[:held]
                if self.tap_layers:
                    parts = [self._taps[slot], *answer_taps]
                    self._taps[slot] = {k: torch.cat([p[k] for p in parts])[:held] for k in self.tap_layers}
            if self.store is not None:
                taps = self._taps.get(slot, {})
                # a head is stored only as far as its tapped rows go (a drafter must get them all)
                held = min([len(self._heads[slot]), *(len(rows) for rows in taps.values())])
                self.store.insert(self._heads[slot][:held], self.cache, slot, taps)
        self._clock += 1
        self._last_use[slot] = self._clock


def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens `a` and `b` share."""
    return len(os.path.commonprefix([a, b]))
