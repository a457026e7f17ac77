"""Decode statistics, per request and aggregated. Tau counts ALL target passes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class DecodeStats:
    target_passes: int = 0  # every pass that emitted tokens: the prefill and each decode/verify step
    passes_with_draft: int = 0
    drafter_runs: int = 0  # steps its drafter proposed for it (a draft cut to nothing still cost the run)
    probes: int = 0  # of those, steps adaptive verification found slower than plain decoding would have been
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    emitted_tokens: int = 0
    drafted_per_position: list[int] = field(default_factory=list)  # drafts that reached position i
    accepted_per_position: list[int] = field(default_factory=list)  # ... and were accepted there
    prompt_tokens: int = 0  # its prompt's length
    cached_prompt_tokens: int = 0  # prompt positions reused from an earlier call's cache (slots or store)
    stored_prompt_tokens: int = 0  # of those, positions copied from the prefix store
    draft_seconds: float = 0.0  # time its drafter spent proposing (its share of batched proposals)
    queue_seconds: float = 0.0  # from being added to the engine until it got a slot

    def record_pass(self, drafted: int, accepted: int, emitted: int) -> None:
        self.target_passes += 1
        self.emitted_tokens += emitted
        if drafted == 0:
            return
        self.passes_with_draft += 1
        self.drafted_tokens += drafted
        self.accepted_tokens += accepted
        _grow(self.drafted_per_position, drafted)
        _grow(self.accepted_per_position, drafted)
        for i in range(drafted):
            self.drafted_per_position[i] += 1
        for i in range(accepted):
            self.accepted_per_position[i] += 1

    def merge(self, other: DecodeStats) -> None:
        for name in ("target_passes", "passes_with_draft", "drafter_runs", "probes",
                     "drafted_tokens", "accepted_tokens", "emitted_tokens",
                     "prompt_tokens", "cached_prompt_tokens", "stored_prompt_tokens", "draft_seconds", "queue_seconds"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in ((self.drafted_per_position, other.drafted_per_position),
                             (self.accepted_per_position, other.accepted_per_position)):
            _grow(mine, len(theirs))
            for i, value in enumerate(theirs):
                mine[i] += value

    @property
    def tau(self) -> float:
        """Emitted tokens per target pass, over all passes (the honest figure)."""
        return self.emitted_tokens / self.target_passes if self.target_passes else 0.0

    @property
    def tau_per_draft(self) -> float:
        """vLLM's figure: 1 + accepted / drafts, over passes that carried a draft only."""
        return 1 + self.accepted_tokens / self.passes_with_draft if self.passes_with_draft else 1.0

    @property
    def acceptance_per_position(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position, strict=True)]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["tau"] = round(self.tau, 4)
        out["tau_per_draft_vllm"] = round(self.tau_per_draft, 4)
        out["acceptance_per_position"] = [round(a, 4) for a in self.acceptance_per_position]
        return out


@dataclass
class EngineTimes:
    """Where an engine's time went, in seconds summed over its steps: these four add up to the time spent
    in `Engine.step` (the server adds the time its engine thread waited for work)."""

    prompt: float = 0.0  # target passes, their share on prompt rows (a pass's time split by rows)
    decode: float = 0.0  # target passes, their share on decode/verify rows
    draft: float = 0.0  # drafters proposing
    other: float = 0.0  # admission (head copies), verification, emission, drafter bookkeeping

    @property
    def accounted(self) -> float:
        """The time of passes and drafting: what a step's own clock does not attribute to `other`."""
        return self.prompt + self.decode + self.draft


def _grow(values: list[int], length: int) -> None:
    values.extend([0] * (length - len(values)))
