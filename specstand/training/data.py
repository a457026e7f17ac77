"""`specstand train-data`: the target itself answers every call of a workload, so a drafter learns this
model's continuations, not a reference text. A row keeps prompt and response token ids (the loss is on
response tokens only); the held-out split is by turn, so no turn's calls sit on both sides."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from specstand.engine import Engine, EngineConfig, Request
from specstand.models import LoadedModel
from specstand.verification import SamplingParams
from specstand.workloads import Turn

ROWS = "rows.jsonl"
META = "meta.json"
HELDOUT_WORKLOAD = "heldout.jsonl"  # the held-out turns as a workload, for `specstand bench`


@dataclass
class TrainRow:
    turn_id: str
    call_id: str
    split: str  # train | heldout
    prompt_ids: list[int]
    response_ids: list[int]


def heldout_turn(turn_id: str, fraction: float) -> bool:
    """A stable split: the turn id's hash decides, whatever the order or the number of turns."""
    digest = int(hashlib.sha256(turn_id.encode()).hexdigest()[:8], 16)
    return digest / 0xFFFFFFFF < fraction


def prompt_ids(model: LoadedModel, call) -> list[int]:
    return model.encode_messages(call.messages, call.tools) if call.messages else model.encode_prompt(call.prompt)


def generate_rows(model: LoadedModel, turns: list[Turn], heldout: float, sampling: SamplingParams,
                  max_batch: int, max_seq_len: int) -> list[TrainRow]:
    """Answer every call (batched, no drafter: the answers are the target's, greedy by default)."""
    engine = Engine(model.decoder, None, EngineConfig(0, max_seq_len, max_batch))
    calls = [(turn, call) for turn in turns for call in turn.calls]
    pending: dict[int, tuple] = {}
    for turn, call in calls:
        ids = prompt_ids(model, call)
        max_tokens = min(call.max_tokens, max_seq_len - len(ids) - 1)
        if max_tokens < 1:
            continue  # the prompt alone fills the context
        request_id = engine.add_request(Request(ids, max_tokens, sampling, model.stop_token_ids))
        pending[request_id] = (turn, call, ids)
    rows = []
    with tqdm(total=len(pending), desc="answering", unit="call") as bar:
        while engine.has_work:
            for event in engine.step():
                if event.finished is None:
                    continue
                turn, call, ids = pending[event.request_id]
                split = "heldout" if heldout_turn(turn.turn_id, heldout) else "train"
                rows.append(TrainRow(turn.turn_id, call.id, split, ids, event.finished.output_ids))
                bar.update()
    order = {(t.turn_id, c.id): i for i, (t, c) in enumerate(calls)}
    return sorted(rows, key=lambda r: order[(r.turn_id, r.call_id)])


def save_rows(folder: Path, rows: list[TrainRow], meta: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{ROWS}.tmp"
    with tmp.open("w") as f:
        for row in rows:
            f.write(json.dumps(asdict(row)) + "\n")
    os.replace(tmp, folder / ROWS)
    meta = {**meta, "rows": len(rows), "heldout_rows": sum(r.split == "heldout" for r in rows),
            "response_tokens": sum(len(r.response_ids) for r in rows)}
    tmp = folder / f".{META}.tmp"
    tmp.write_text(json.dumps(meta, indent=1) + "\n")
    os.replace(tmp, folder / META)


def load_rows(folder: Path) -> tuple[dict, list[TrainRow]]:
    folder = Path(folder)
    if not (folder / ROWS).is_file() or not (folder / META).is_file():
        raise ValueError(f"{folder} is not a train-data folder ({ROWS} and {META} expected)")
    meta = json.loads((folder / META).read_text())
    rows = []
    with (folder / ROWS).open() as f:
        for number, line in enumerate(f, 1):
            try:
                rows.append(TrainRow(**json.loads(line)))
            except (json.JSONDecodeError, TypeError) as error:
                raise ValueError(f"{folder / ROWS} line {number}: not a train row ({error})") from None
    return meta, rows
