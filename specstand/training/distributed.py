"""Data-parallel training under `torchrun`: each rank takes its share of every step's rows (and computes
their target features itself), DistributedDataParallel averages the gradients, and rank 0 alone writes
checkpoints and logs. One process is the same code with a world of one.

The data order is a function of (seed, step) and the checkpoint holds no rank or world size, so a run
resumes with any number of ranks.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1

    @property
    def main(self) -> bool:
        return self.rank == 0

    def share(self, items: list) -> list:
        """This rank's part of a step's items: every size-th one from its rank on."""
        return items[self.rank :: self.size]

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """The mean over ranks, element by element, of values that may be NaN where a rank saw nothing."""
        if self.size == 1:
            return values
        seen = ~torch.isnan(values)
        both = torch.stack([torch.where(seen, values, 0.0), seen.to(values.dtype)])
        dist.all_reduce(both)
        return both[0] / both[1]  # NaN where no rank saw anything


def start() -> World:
    """Join the process group torchrun describes in the environment, or a world of one when not launched
    by torchrun. The backend is gloo even where CUDA is present: the drafter's tensors and the target's
    features (computed by the CPU runner) live in host memory, and nccl reduces only device tensors."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size == 1:
        return World()
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    return World(dist.get_rank(), dist.get_world_size())


def stop(world: World) -> None:
    if world.size > 1 and dist.is_initialized():
        dist.destroy_process_group()
