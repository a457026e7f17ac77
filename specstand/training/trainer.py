"""`specstand train`: online distillation of a drafter from the frozen target.

Every step takes one pack of training rows; the target computes their hidden states inside the loop
(kept in memory for later epochs, never written out), the drafter's loss is taken on response positions
only, AdamW with a linear warm-up/decay schedule updates the drafter. Checkpoints are written to a
temporary name and renamed, so an interrupted run resumes from the last one, step for step: the data
order and every random draw are functions of (seed, step), not of the run's history.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from array import array
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from specstand.drafters.nn import DrafterSpec, draft_vocabulary
from specstand.drafters.registry import is_block_method
from specstand.drafters.target_parts import TargetParts
from specstand.drafters.trained import build_model, drafter_state, load_own_weights, save_drafter, trained_parts
from specstand.files import write_atomic, write_text_atomic
from specstand.models import LoadedModel
from specstand.training.config import TrainConfig
from specstand.training.data import TrainRow, load_datasets, subset_turn
from specstand.training.distributed import World
from specstand.training.features import Pack, TargetFeatures, pack_rows, plan_packs
from specstand.training.losses import target_to_draft
from specstand.training.objectives import BLOCK_OBJECTIVES, chain_objective

TRAINER_STATE = "trainer.pt"
TRAIN_LOG = "train_log.jsonl"  # loss and acceptance per position, a line per step (rank 0)
TRAIN_PLOT = "train_log.png"


def tap_layers_for(config: TrainConfig, num_layers: int) -> list[int]:
    if is_block_method(config.method):
        return trained_parts(config.method).tap_layers(num_layers, config.num_taps)
    return trained_parts(config.method).tap_layers(num_layers)


def make_spec(config: TrainConfig, target: LoadedModel, mask_token_id: int) -> DrafterSpec:
    shape = target.decoder.shape
    intermediate = config.intermediate_size or min(target.decoder.shape.intermediate_size, 1536)
    config_file = Path(target.path) / "config.json"
    architectures = json.loads(config_file.read_text()).get("architectures") if config_file.is_file() else None
    arch = (architectures or [""])[0]
    block = is_block_method(config.method)
    return DrafterSpec(
        method=config.method, target=target.name, target_architecture=arch, target_vocab_size=shape.vocab_size,
        hidden_size=shape.hidden_size, num_heads=shape.num_heads, num_kv_heads=shape.num_kv_heads,
        head_dim=shape.head_dim, intermediate_size=intermediate,
        num_layers=config.num_layers or (2 if block else 1), rms_eps=shape.rms_eps,
        rope_theta=10000.0, tap_layers=tap_layers_for(config, shape.num_layers),
        draft_vocab_size=config.draft_vocab_size,
        block_size=config.block_size if block else 0, mask_token_id=mask_token_id,
        train_steps=0 if block else config.train_steps,
        qk_norm=block,  # Qwen3-style layers, as speculators' and z-lab's DFlash have
        sample_from_anchor=config.method == "dspark",  # DSpark's layout: the anchor row drafts first
        markov_rank=config.markov_rank if config.method == "dspark" else 0,
        enable_confidence_head=config.method == "dspark" and config.confidence_head,
        conv_kernel_size=config.conv_kernel_size if config.method == "dflash2" else 0,
        conv_group_size=config.conv_group_size, selector_rank=config.selector_rank if config.method == "dflash2" else 0,
        selector_top_k=config.selector_top_k,
    )


def pick_mask_token(target: LoadedModel, responses: list[list[int]]) -> int:
    """The block methods' mask: the tokenizer's pad token when it is not a stop token, else the lowest id never seen
    in a response (its embedding is a fixed, distinct vector; that is all a mask needs)."""
    pad = getattr(target.tokenizer, "pad_token_id", None)
    if pad is not None and pad not in target.stop_token_ids:
        return int(pad)
    seen = {t for r in responses for t in r}
    norms = target.decoder.weights.embed_tokens.float().norm(dim=-1)
    return next(i for i in range(len(norms)) if i not in seen and norms[i] > 0)


def learning_rate(config: TrainConfig, step: int) -> float:
    warmup = max(int(config.warmup * config.steps), 1)
    return config.lr * min(1.0, (step + 1) / warmup) * max(0.0, 1 - step / config.steps)


# what a resumed run may change: how long it trains, how often it saves, where the folder is, the card
RESUMABLE_CHANGES = {"steps", "save_every", "out"}


def rows_digest(rows: list[TrainRow]) -> str:
    """What the training rows hold (which rows, and their tokens), so that a resume can tell data folders
    written again under the same names from the ones the run began on."""
    digest = hashlib.sha256()
    for row in rows:
        digest.update(json.dumps(row.key).encode())
        digest.update(array("q", row.prompt_ids).tobytes() + b"|" + array("q", row.response_ids).tobytes())
    return digest.hexdigest()


def _save_state(out: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, step: int,
                running_q: torch.Tensor, config: TrainConfig, elapsed: float, data_digest: str) -> None:
    """The drafter's files first, the trainer state last, each renamed into place: a crash at any point
    leaves a state that names weights at least as new as itself, never a state ahead of its weights."""
    save_drafter(model, out)
    state = {"step": step, "model": drafter_state(model), "optimizer": optimizer.state_dict(),
             "running_q": running_q, "config": asdict(config), "spec": model.spec.to_json(), "elapsed_s": elapsed,
             "data_digest": data_digest}
    write_atomic(out / TRAINER_STATE, lambda tmp: torch.save(state, tmp))


def _load_state(path: Path, config: TrainConfig, data_digest: str) -> dict | None:
    """The saved trainer state (tensors and plain values only: nothing in it can run code), checked to be
    a run of this very configuration on the same rows (states saved before the rows' digest was kept are
    checked by configuration only)."""
    if not path.is_file():
        return None
    try:
        state = torch.load(path, weights_only=True)
    except Exception as error:  # noqa: BLE001 - any unreadable file: say which and why, once
        raise ValueError(f"cannot resume from {path}: {type(error).__name__}: {str(error).splitlines()[0]}") from None
    saved, wanted = state.get("config", {}), asdict(config)
    # a setting the saved run has and this version no longer does cannot change the run
    changed = sorted(k for k in wanted if k not in RESUMABLE_CHANGES and saved.get(k) != wanted[k])
    if changed:
        first = changed[0]
        raise ValueError(f"{path.parent} holds a run with {first}={saved.get(first)!r}, not {wanted.get(first)!r}"
                         f"{f' (and {len(changed) - 1} more changed)' if len(changed) > 1 else ''}; resume with the "
                         "same settings or use another --out")
    if state.get("data_digest", data_digest) != data_digest:
        raise ValueError(f"{path.parent} holds a run on other rows than {', '.join(config.data)} holds now (written "
                         "again since?); resume on the same data or use another --out")
    return state


class _Objective(torch.nn.Module):
    """The method's loss on a pack as a module's forward, so DistributedDataParallel can wrap it: returns
    (loss, per-position q or None, accepted per position)."""

    def __init__(self, model: torch.nn.Module, t2d: torch.Tensor, config: TrainConfig) -> None:
        super().__init__()
        self.model, self.t2d, self.config = model, t2d, config

    def forward(self, pack: Pack, generator: torch.Generator, running_q: torch.Tensor):
        if self.config.method in BLOCK_OBJECTIVES:
            return BLOCK_OBJECTIVES[self.config.method](self.model, pack, self.t2d, self.config, generator, running_q)
        loss, accepted = chain_objective(self.model, pack, self.t2d, self.config, soft=self.config.method == "eagle3")
        return loss, None, accepted


class _TrainLog:
    """train_log.jsonl: a line per step; a resumed run first drops the lines past its checkpoint."""

    def __init__(self, path: Path, start: int) -> None:
        self.path = path
        kept = []
        if path.is_file():
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] <= start:
                        kept.append(line)
                except (json.JSONDecodeError, KeyError, TypeError):
                    break  # a torn last line
        write_text_atomic(path, "".join(line + "\n" for line in kept))  # killed here, the log stays whole

    def append(self, step: int, loss: float, accepted: list[float]) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps({"step": step, "loss": round(loss, 5), "accepted": [round(a, 4) for a in accepted]})
                    + "\n")

    def plot(self, out: Path) -> None:
        import matplotlib.pyplot as plt

        fig = training_figure([json.loads(line) for line in self.path.read_text().splitlines()])
        write_atomic(out, fig.savefig)
        plt.close(fig)


def training_figure(entries: list[dict]):  # -> matplotlib Figure
    """Loss and acceptance per draft position over the steps of train_log.jsonl's `entries`: every position
    the drafter proposes (a 7-step chain's deep positions are where it differs from a 3-step one), shaded
    from the first to the last."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [e["step"] for e in entries]
    positions = len(entries[-1]["accepted"])
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.5))
    left.plot(steps, [e["loss"] for e in entries])
    left.set(xlabel="step", ylabel="loss", title="training loss")
    colours = plt.get_cmap("viridis")
    for position in range(positions):
        right.plot(steps, [e["accepted"][position] for e in entries], label=f"position {position}",
                   color=colours(position / max(positions - 1, 1)))
    right.set(xlabel="step", ylabel="acceptance", title="acceptance per draft position", ylim=(0, 1))
    right.legend(fontsize="small", ncol=2 if positions > 4 else 1)
    fig.tight_layout()
    return fig


def train(
    config: TrainConfig, target: LoadedModel, log=print, features: TargetFeatures | None = None,
    world: World = World(),  # noqa: B008 - a frozen dataclass: one process
) -> torch.nn.Module:
    """Train (or resume) into config.out; returns the trained drafter model. `features` may be shared by
    several drafters trained on the same data in one process (it must tap their layers). Under torchrun
    (`world`), each rank takes its share of every step's rows; rank 0 writes the checkpoints and log."""
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    meta, rows = _training_rows(config)
    data_digest = rows_digest(rows)
    state = _load_state(out / TRAINER_STATE, config, data_digest)
    spec, draft_ids = _spec_and_vocabulary(config, target, rows, state)
    weights = target.decoder.weights
    model = build_model(spec, TargetParts(weights.embed_tokens, weights.lm_head), draft_ids)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=config.lr,
                                  betas=(0.9, 0.95), weight_decay=config.weight_decay)
    run = _Run(config, out, meta, rows, spec, model, optimizer, world,
               running_q=torch.zeros(max(getattr(model, "num_drafts", 1), 1)), data_digest=data_digest)
    if state is not None:
        mismatch = load_own_weights(model, state["model"])  # another version's layers: refused, not half-loaded
        if mismatch:
            raise ValueError(f"cannot resume from {out / TRAINER_STATE}: its drafter weights do not match this "
                             f"drafter ({mismatch}); use another --out")
        optimizer.load_state_dict(state["optimizer"])
        run.start, run.running_q, run.elapsed = state["step"], state["running_q"], state["elapsed_s"]
        log(f"resuming {spec.method} from step {run.start} of {config.steps} ({out / TRAINER_STATE})")
    t2d = target_to_draft(draft_ids, spec.target_vocab_size)
    max_len = min(config.max_len, target.decoder.max_positions)
    features = features or TargetFeatures(target.decoder, spec.tap_layers, max_len)
    if not set(spec.tap_layers) <= set(features.tap_layers):
        raise ValueError(f"the shared target features tap {features.tap_layers}, not {spec.tap_layers}")
    schedule = _schedule(config, [min(len(r.prompt_ids) + len(r.response_ids), max_len) for r in rows])
    model.train()
    objective = _Objective(model, t2d, config)
    if world.size > 1:  # averages the gradients over ranks in backward
        objective = torch.nn.parallel.DistributedDataParallel(objective, find_unused_parameters=True)
    run.steps(objective, schedule, features)
    model.eval()
    return model


def _training_rows(config: TrainConfig) -> tuple[dict, list[TrainRow]]:
    """The data sets' metadata and their training rows with a response, in the configured share of turns."""
    meta, rows = load_datasets([Path(folder) for folder in config.data])
    rows = [r for r in rows if r.split == "train" and r.response_ids and subset_turn(r.turn_id, config.data_fraction)]
    if not rows:
        raise ValueError(f"{', '.join(config.data)} holds no training rows with a response"
                         + (f" in a {config.data_fraction} share of its turns" if config.data_fraction < 1 else ""))
    return meta, rows


def _spec_and_vocabulary(config: TrainConfig, target: LoadedModel, rows: list[TrainRow],
                         state: dict | None) -> tuple[DrafterSpec, torch.Tensor]:
    """The drafter's spec and draft vocabulary (draft id -> target id): a resumed run's own, else made
    from the target and the rows' responses."""
    if state is not None:
        return DrafterSpec.from_json(state["spec"]), state["model"]["d2t"]
    responses = [r.response_ids for r in rows]
    spec = make_spec(config, target, pick_mask_token(target, responses))
    draft_ids = draft_vocabulary(responses, config.draft_vocab_size, spec.target_vocab_size)
    spec.draft_vocab_size = len(draft_ids)
    return spec, draft_ids


def _schedule(config: TrainConfig, lengths: list[int]) -> list[list[int]]:
    """The rows of every step, packed epoch after epoch: a pure function of the seed, so resuming replays
    the same order."""
    schedule: list[list[int]] = []
    epoch = 0
    while len(schedule) < config.steps:
        generator = torch.Generator().manual_seed(config.seed * 7919 + epoch)
        order = torch.randperm(len(lengths), generator=generator).tolist()
        schedule += plan_packs(lengths, config.pack_tokens, order)
        epoch += 1
    return schedule


@dataclass
class _Run:
    """A run's drafter, optimizer and rows, and where its steps stand: what a checkpoint saves."""

    config: TrainConfig
    out: Path
    meta: dict
    rows: list[TrainRow]
    spec: DrafterSpec
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    world: World
    running_q: torch.Tensor
    data_digest: str  # rows_digest(rows)
    start: int = 0
    elapsed: float = 0.0

    def steps(self, objective: torch.nn.Module, schedule: list[list[int]], features: TargetFeatures) -> None:
        """The steps from `start` on; rank 0 logs each and saves every `save_every` and at the end."""
        config, world = self.config, self.world
        train_log = _TrainLog(self.out / TRAIN_LOG, self.start) if world.main else None
        began = time.perf_counter() - self.elapsed
        bar = tqdm(range(self.start, config.steps), initial=self.start, total=config.steps,
                   desc=f"train {self.spec.method}", disable=not world.main)
        for step in bar:
            mean_loss, accepted = self._step(objective, step, schedule[step], features)
            bar.set_postfix_str(f"loss {mean_loss:.3f} accepted@pos {' '.join(f'{a:.2f}' for a in accepted.tolist())}")
            if train_log is not None:
                train_log.append(step + 1, float(mean_loss), accepted.tolist())
            if world.main and ((step + 1) % config.save_every == 0 or step + 1 == config.steps):
                self._save(step + 1, accepted, began)
        if train_log is not None and self.start < config.steps:
            train_log.plot(self.out / TRAIN_PLOT)

    def _save(self, steps: int, accepted: torch.Tensor, began: float) -> None:
        """A checkpoint after `steps` steps, its card's figures in the spec."""
        self.spec.trained = {"data": self.meta, "steps": steps, "train_rows": len(self.rows),
                             "seconds": round(time.perf_counter() - began, 1),
                             "last_accepted_per_position": [round(a, 3) for a in accepted.tolist()]}
        _save_state(self.out, self.model, self.optimizer, steps, self.running_q, self.config,
                    time.perf_counter() - began, self.data_digest)

    def _step(self, objective: torch.nn.Module, step: int, row_ids: list[int],
              features: TargetFeatures) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step; returns the loss and acceptance per position, averaged over the ranks."""
        config, world = self.config, self.world
        # this rank's rows of the step; a rank left without one computes a row at zero weight, as every
        # rank must take part in the gradients' all-reduce
        share = world.share(row_ids)
        mine = share or row_ids[:1]
        pack = pack_rows([features.row(self.rows[i].prompt_ids, self.rows[i].response_ids) for i in mine],
                         self.spec.tap_layers)
        for group in self.optimizer.param_groups:
            group["lr"] = learning_rate(config, step)
        generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step + world.rank * 7_919)
        loss, q, accepted = objective(pack, generator, self.running_q)
        if not share:
            loss = loss * 0.0
        if q is not None:
            q = world.mean(q)
            self.running_q = torch.where(torch.isnan(q), self.running_q, 0.9 * self.running_q + 0.1 * q)
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return world.mean(loss.detach()[None])[0], world.mean(accepted.detach())
