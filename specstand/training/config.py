"""`TrainConfig`: every setting of one drafter's training run (what `specstand train` fills from its flags).

Its own module so that the trainer and the objectives both read it without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass

from specstand.drafters.registry import is_block_method, trained_methods


@dataclass
class TrainConfig:
    method: str
    data: list[str]  # train-data folders, their rows in order
    out: str
    steps: int = 500
    lr: float = 1e-3
    weight_decay: float = 0.01
    warmup: float = 0.05  # share of steps with a linearly rising rate; then linear decay to 0
    pack_tokens: int = 2048
    max_len: int = 2048
    seed: int = 0
    data_fraction: float = 1.0  # train on this share of the training turns (a stable, nested subset)
    save_every: int = 50
    num_layers: int = 0  # 0: the method's default (block methods 2, eagle3/mtp 1)
    intermediate_size: int = 0  # 0: the target's, capped at 1536 (sized for a CPU)
    draft_vocab_size: int = 8192
    num_taps: int = 5  # block methods: target layers read, spread over depth
    block_size: int = 8  # block methods
    anchors: int = 64  # block methods: blocks trained per pack
    dpace_alpha: float = 0.5  # block methods: D-PACE smoothing
    position_weighting: str = ""  # block methods: dpace | exp (exp(-k/4)); "": dspark exp, the others dpace
    markov_rank: int = 256  # dspark
    confidence_head: bool = True  # dspark
    conv_kernel_size: int = 2  # dflash2
    conv_group_size: int = 16  # dflash2
    selector_rank: int = 256  # dflash2
    selector_top_k: int = 16  # dflash2
    selector_alpha: float = 1.0  # dflash2: weight of the ranker's loss beside the unary one
    train_steps: int = 3  # eagle3/mtp: unrolled training-time-test steps

    def __post_init__(self) -> None:
        if self.method not in trained_methods():
            raise ValueError(f"unknown trained method {self.method!r} (choose from {', '.join(trained_methods())})")
        if self.steps < 1 or self.save_every < 1 or self.pack_tokens < 16:
            raise ValueError("--steps and --save-every must be >= 1, --pack-tokens >= 16")
        if not 0 < self.data_fraction <= 1:
            raise ValueError(f"--data-fraction {self.data_fraction} is not in (0, 1]")
        if not self.data:
            raise ValueError("no --data folder")
        if is_block_method(self.method) and self.block_size < 2:
            raise ValueError("a block drafter's block needs at least 2 positions")
        if self.position_weighting not in ("", "dpace", "exp"):
            raise ValueError(f"--position-weighting {self.position_weighting!r} is not dpace or exp")

    @property
    def weighting(self) -> str:
        return self.position_weighting or ("exp" if self.method == "dspark" else "dpace")

    @property
    def decay(self) -> float:
        """eagle3/mtp: the weight of unrolled step s is decay**(s-1)."""
        return {"eagle3": 0.8, "mtp": 0.6}.get(self.method, 1.0)
