"""KV cache plus recurrent state (short convolutions, linear attention) with exact rollback.

A recurrent layer's state after position t cannot be recovered from a length: rolling back a rejected
draft must restore the state exactly as it was after the last accepted row. (The seed stand's production
engine did not, and broke 72% of JSON answers on a hybrid model, more the more often drafted and
undrafted passes alternated.) So the state of every row of a short pass (a decode or verify pass) is kept
as a checkpoint, and `rollback(slot, length)` restores the one at `length`. Prompt passes keep block
boundaries and their last row only.

We keep snapshots rather than recompute from an older checkpoint. Measured on a random Qwen3.5-shaped
target (hidden 1024, 6 DeltaNet layers of 16 x 128 x 128, 6.5 MB of state per position; bf16, amx
linears, 2 cores): keeping all 8 rows' states made an 8-row verify pass 3-5 ms slower (46-49 against
43-44 ms), while recomputing from the pass's start would cost a further pass (a 1-row one is 30 ms) on
every partly rejected draft. The price is memory: K + 1 states per running slot.

Checkpoints at multiples of `checkpoint_every` positions outlive their pass: prefix reuse restarts a
prompt from them (the Python forward computes prompts in blocks of that size, so a block boundary is where
a cached head is bit-identical to a fresh one). At most `max_checkpoints` of them are kept per slot, the
longest heads first. The state at a slot's current length is always its newest checkpoint.

Every state tensor is a new tensor written once (the forwards never update one in place), so slots may
share them: copying a prefix copies references.
"""

from __future__ import annotations

import torch

from specstand.runner.kv_cache import KVCache


class StateCache(KVCache):
    def __init__(
        self,
        num_attention_layers: int,
        num_slots: int,
        num_kv_heads: int,
        capacity: int,
        head_dim: int,
        dtype: torch.dtype,
        state_specs: list[tuple[tuple[int, ...], torch.dtype]],
        checkpoint_every: int,
        max_checkpoints: int = 32,
    ) -> None:
        super().__init__(num_attention_layers, num_slots, num_kv_heads, capacity, head_dim, dtype)
        self.state_specs = state_specs  # (shape, dtype) of each state tensor of a slot
        self.checkpoint_every = checkpoint_every
        self.max_checkpoints = max_checkpoints
        self._zero = [torch.zeros(shape, dtype=dtype) for shape, dtype in state_specs]  # before position 0
        # slot -> {length: [state after `length` positions, one tensor per state index]}
        self.checkpoints: list[dict[int, list[torch.Tensor]]] = [{} for _ in range(num_slots)]
        self._pending: list[dict[int, list[torch.Tensor | None]]] = [{} for _ in range(num_slots)]

    @property
    def store_off_reason(self) -> str | None:
        if not self.state_specs:
            return None
        return ("recurrent layers' state is kept only at a slot's own checkpoints, and a checkpoint per stored "
                "block would cost a whole state (megabytes) per block")

    def state(self, slot: int, index: int) -> torch.Tensor:
        """State `index` of the slot at its current length."""
        length = self.lengths[slot]
        return self._zero[index] if length == 0 else self.checkpoints[slot][length][index]

    def rows_to_keep(self, start: int, rows: int, every_row: bool) -> list[int]:
        """Which rows of a pass of `rows` rows from `start` get a checkpoint: every row of a decode or
        verify pass (any of them may be where verification stops); of a prompt pass, block boundaries
        and its last row."""
        if every_row:
            return list(range(rows))
        return [i for i in range(rows) if (start + i + 1) % self.checkpoint_every == 0 or i == rows - 1]

    def record(self, slot: int, index: int, start: int, states: dict[int, torch.Tensor]) -> None:
        """A forward's states of index `index` after rows {row: state} of the pass from `start`."""
        for row, state in states.items():
            self._pending[slot].setdefault(start + row + 1, [None] * len(self.state_specs))[index] = state

    def advance(self, slot: int, start: int, rows: int) -> None:
        """The pass from `start` kept `rows` rows: their states become checkpoints, the slot's length
        start + rows. Checkpoints past `start` belonged to rolled-back rows and go."""
        pending, self._pending[slot] = self._pending[slot], {}
        if not self.state_specs:
            super().advance(slot, start, rows)
            return
        end = start + rows
        if end not in pending or any(s is None for s in pending[end]):
            raise RuntimeError(f"the forward saved no recurrent state for slot {slot} at length {end}")
        # what stays below the pass: durable heads and the state it started from (rollback(slot, start))
        kept = {k: v for k, v in self.checkpoints[slot].items()
                if k == start or (k < start and k % self.checkpoint_every == 0)}
        kept.update({k: v for k, v in pending.items() if start < k <= end})
        # at most max_checkpoints heads below the pass: the shortest go first
        heads = sorted(k for k in kept if k < start)
        for k in heads[: max(0, len(heads) - self.max_checkpoints)]:
            del kept[k]
        self.checkpoints[slot] = kept
        self.lengths[slot] = end

    def rollback(self, slot: int, length: int) -> None:
        """Keep the first `length` positions: the state goes back to its checkpoint at `length`."""
        if not 0 <= length <= self.capacity:
            raise ValueError(f"invalid cache length {length}")
        if length and self.state_specs and length not in self.checkpoints[slot]:
            raise ValueError(f"slot {slot} holds no recurrent state at length {length}")
        self.checkpoints[slot] = {k: v for k, v in self.checkpoints[slot].items() if k <= length}
        self.lengths[slot] = length

    def copy_prefix(self, src: int, dst: int, length: int) -> None:
        if length and self.state_specs and length not in self.checkpoints[src]:
            raise ValueError(f"slot {src} holds no recurrent state at length {length}")
        super().copy_prefix(src, dst, length)
        self.checkpoints[dst] = {k: v for k, v in self.checkpoints[src].items() if k <= length}

    def reusable_length(self, slot: int, length: int, unit: int) -> int:
        """The longest head of at most `length` positions that a prompt can start from: a multiple of
        `unit` with a checkpoint."""
        if not self.state_specs:
            return super().reusable_length(slot, length, unit)
        return max((k for k in self.checkpoints[slot] if k <= length and k % unit == 0), default=0)

    def set_length_for_timing(self, slot: int, length: int) -> None:
        super().set_length_for_timing(slot, length)
        if length:
            self.checkpoints[slot][length] = self._zero
