"""Static-capacity KV cache with per-slot lengths.

Every slot owns `capacity` positions in every layer. A pass writes keys/values for the positions it
computes; which of them are *valid* is only the slot's `length`. Rolling back a rejected draft is
therefore O(1): set the length. Stale entries past the length are never read, because attention masks
keys by position (key position <= query position) and a later pass overwrites them.

Entries are stored in the model's dtype (bf16 for bf16 models: half the bytes a decode step reads per
cached position; the K/V rows are rounded to nearest even on every path, prompt or decode, so a position
holds the same bits however it was computed) and widened to fp32 where attention reads them.

The buffers start zeroed so that masked entries are finite: softmax gives them an exact 0 weight, and
0 * finite = 0 keeps the result bit-identical whatever was written there before.

Recurrent layers (linear attention, short convolutions) cannot be rolled back by a length alone: their
state after every draft position is kept and restored on rejection (StateCache, state_cache.py). The
engine only talks to `advance`, `rollback` and `reusable_length`, whichever cache a model has.
"""

from __future__ import annotations

import torch

# Prompts are computed in blocks of PREFILL_BLOCK positions aligned to multiples of it, each padded to the
# full block on the Python forward: a position's prompt K/V then depends on its block alone, so a cached
# prompt prefix (rounded down to a block) is bit-identical to computing the prompt afresh. The compiled
# forward's rows depend on nothing else in their pass, so there it holds whatever the blocks.
PREFILL_BLOCK = 64


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        shape = (num_layers, num_slots, num_kv_heads, capacity, head_dim)
        self.keys = torch.zeros(shape, dtype=dtype)
        self.values = torch.zeros(shape, dtype=dtype)
        self.capacity = capacity
        self.lengths = [0] * num_slots
        self._free = list(range(num_slots - 1, -1, -1))

    @property
    def store_off_reason(self) -> str | None:
        """Why a prefix store (engine/prefix_cache.py) cannot hold copies of this cache's heads; None: it can,
        since a head is its K/V alone."""
        return None

    @property
    def free_slots(self) -> int:
        return len(self._free)

    @property
    def free_slot_ids(self) -> list[int]:
        return list(self._free)

    def allocate(self, slot: int | None = None) -> int:
        """Take a free slot (a given one, e.g. to reuse what it still holds). Its length starts at 0;
        its buffers keep their contents until overwritten."""
        if not self._free:
            raise RuntimeError("no free KV cache slot")
        if slot is None:
            slot = self._free[-1]
        self._free.remove(slot)
        self.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        self.lengths[slot] = 0
        if slot not in self._free:  # freed twice, it would be handed to two requests
            self._free.append(slot)

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        """Give slot `dst` the first `length` positions of slot `src` (prefix reuse across requests)."""
        self.keys[:, dst, :, :length] = self.keys[:, src, :, :length]
        self.values[:, dst, :, :length] = self.values[:, src, :, :length]
        self.lengths[dst] = length

    def advance(self, slot: int, start: int, rows: int) -> None:
        """A pass computed `rows` rows of the slot from position `start` (its length before the pass)."""
        self.lengths[slot] = start + rows

    def reusable_length(self, slot: int, length: int, unit: int) -> int:
        """The longest head of at most `length` cached positions of `slot` that a prompt can start from:
        here any multiple of `unit`."""
        return length // unit * unit

    def set_length_for_timing(self, slot: int, length: int) -> None:
        """Give a slot `length` positions of whatever its buffers hold: for timing passes only."""
        self.lengths[slot] = length

    def rollback(self, slot: int, length: int) -> None:
        """Keep the first `length` positions of the slot; O(1)."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"invalid cache length {length}")
        self.lengths[slot] = length

