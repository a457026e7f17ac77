"""`specstand train-data`: the target itself answers every call of a workload, so a drafter learns this
model's continuations, not a reference text. A row keeps prompt and response token ids (the loss is on
response tokens only); the held-out split is by turn, so no turn's calls sit on both sides.

Answers come from specstand's own engine in batches, sped up by a training-free drafter (lossless: the
answers are the target's own). Each finished answer is appended to a partial file as it comes, so a
killed run resumes where it stopped, without duplicate or lost rows; sampled answers (several per call)
draw from a seed of their own per (call, sample), so a resumed run samples what an uninterrupted one would."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tqdm import tqdm

from specstand.drafters import Drafter
from specstand.engine import Engine, EngineConfig, Request
from specstand.files import write_atomic, write_text_atomic
from specstand.models import LoadedModel
from specstand.verification import SamplingParams
from specstand.workloads import Turn

ROWS = "rows.jsonl"
META = "meta.json"
PARTIAL = ".rows.partial.jsonl"  # the rows of a run in progress; gone once rows.jsonl is written
HELDOUT_WORKLOAD = "heldout.jsonl"  # the held-out turns as a workload, for `specstand bench`


@dataclass
class TrainRow:
    turn_id: str
    call_id: str
    split: str  # train | heldout
    prompt_ids: list[int]
    response_ids: list[int]
    sample: int = 0  # which of the call's sampled answers (always 0 for greedy ones)

    @property
    def key(self) -> tuple[str, str, int]:
        return self.turn_id, self.call_id, self.sample


class PartialRows:
    """The rows of a run in progress in `folder`, one JSON line each, appended and flushed as answers
    finish. Its first line is the run's configuration: a resumed run must match it. A torn last line (the
    process killed mid-write) is dropped on opening."""

    def __init__(self, folder: Path, config: dict) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        self.path = folder / PARTIAL
        self.rows: list[TrainRow] = []
        lines = self.path.read_text().split("\n") if self.path.is_file() else []
        if lines and lines[0]:
            if json.loads(lines[0]) != {"config": config}:
                raise ValueError(f"{self.path} holds rows of another configuration; remove it or write elsewhere")
            for line in lines[1:]:
                try:
                    self.rows.append(TrainRow(**json.loads(line)))
                except (json.JSONDecodeError, TypeError):
                    break  # the torn tail of a killed write; everything before it is whole
        good = [json.dumps({"config": config})] + [json.dumps(asdict(row)) for row in self.rows]
        write_text_atomic(self.path, "\n".join(good) + "\n")  # rewritten whole: a kill here loses no row
        self._file = self.path.open("a")

    def append(self, row: TrainRow) -> None:
        self._file.write(json.dumps(asdict(row)) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()


def call_seed(seed: int, turn_id: str, call_id: str, sample: int) -> int:
    """A sampled answer's own seed: the same whatever else is answered in the run, or in which order."""
    return int(hashlib.sha256(f"{seed}/{turn_id}/{call_id}/{sample}".encode()).hexdigest()[:15], 16)


def _hash_share(key: str) -> float:
    """Where a key falls in [0, 1], by its hash: stable whatever the order or the number of keys."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


def heldout_turn(turn_id: str, fraction: float) -> bool:
    """A stable split: the turn id's hash decides, whatever the order or the number of turns."""
    return _hash_share(turn_id) < fraction


def subset_turn(turn_id: str, fraction: float) -> bool:
    """A stable share of the turns, independent of the held-out split (another salt) and nested: the turns
    kept at a fraction are kept at every larger one, so a data-size curve adds data, never swaps it."""
    return _hash_share(f"subset/{turn_id}") < fraction


def prompt_ids(model: LoadedModel, call) -> list[int]:
    return model.encode_messages(call.messages, call.tools) if call.messages else model.encode_prompt(call.prompt)


@dataclass
class _Job:
    """One answer to get: a call's prompt ids, its budget and sampling (a seed of its own when sampled)."""

    turn_id: str
    call_id: str
    sample: int
    prompt_ids: list[int]
    max_tokens: int
    sampling: SamplingParams
    tools: list[dict] | None = None  # the call's tools, for a drafter that follows their schemas


def generate_rows(model: LoadedModel, turns: list[Turn], heldout: float, sampling: SamplingParams,
                  max_batch: int, max_seq_len: int, drafter: Drafter | None = None, k: int = 5, samples: int = 1,
                  partial: PartialRows | None = None, endpoint: str | None = None) -> list[TrainRow]:
    """Answer every call `samples` times, greedy by default: with specstand's engine in batches of
    `max_batch` (`drafter` speeds it up without changing an answer), or from the OpenAI-compatible server
    at `endpoint` (`max_batch` calls at a time). Rows already in `partial` are kept, not answered again,
    and new ones are appended to it as they come."""
    if samples > 1 and sampling.greedy:
        raise ValueError("several answers per call need sampling (temperature > 0)")
    wanted = [(turn, call, sample) for turn in turns for call in turn.calls for sample in range(samples)]
    rows = list(partial.rows) if partial is not None else []
    done = {row.key for row in rows}
    jobs = []
    for turn, call, sample in wanted:
        if (turn.turn_id, call.id, sample) in done:
            continue
        ids = prompt_ids(model, call)
        max_tokens = min(call.max_tokens, max_seq_len - len(ids) - 1)
        if max_tokens < 1:
            continue  # the prompt alone fills the context
        params = sampling if sampling.greedy else replace(
            sampling, seed=call_seed(sampling.seed or 0, turn.turn_id, call.id, sample))
        jobs.append(_Job(turn.turn_id, call.id, sample, ids, max_tokens, params, call.tools))
    answers = (_answer_remotely(endpoint, jobs, max_batch) if endpoint else
               _answer_locally(model, jobs, drafter, k, max_batch, max_seq_len))
    with tqdm(total=len(jobs) + len(rows), initial=len(rows), desc="answering", unit="call") as bar:
        for job, output_ids in answers:
            split = "heldout" if heldout_turn(job.turn_id, heldout) else "train"
            row = TrainRow(job.turn_id, job.call_id, split, job.prompt_ids, output_ids, job.sample)
            rows.append(row)
            if partial is not None:
                partial.append(row)
            bar.update()
    order = {(t.turn_id, c.id, s): i for i, (t, c, s) in enumerate(wanted)}
    return sorted(rows, key=lambda r: order[r.key])


def _answer_locally(model: LoadedModel, jobs: list[_Job], drafter: Drafter | None, k: int, max_batch: int,
                    max_seq_len: int) -> Iterator[tuple[_Job, list[int]]]:
    engine = Engine(model.decoder, drafter, EngineConfig(k if drafter is not None else 0, max_seq_len, max_batch))
    pending = {engine.add_request(Request(job.prompt_ids, job.max_tokens, job.sampling, model.stop_token_ids,
                                          job.tools)): job
               for job in jobs}
    while engine.has_work:
        for event in engine.step():
            if event.finished is not None:
                yield pending[event.request_id], event.finished.output_ids


def _answer_remotely(endpoint: str, jobs: list[_Job], concurrency: int) -> Iterator[tuple[_Job, list[int]]]:
    """Each job through the server's /v1/completions with its prompt as token ids (so the server computes
    exactly this prompt); the answer's token ids come from vLLM's `return_token_ids` or specstand's own
    `specstand.token_ids`. The hidden states are computed later, by the training-side target pass."""
    import httpx

    base = endpoint.rstrip("/")
    # idle connections dropped after 2 s, before the server's own keep-alive (5 s in uvicorn, so in vLLM) can
    # close one just as a call goes out on it
    with httpx.Client(timeout=600, limits=httpx.Limits(keepalive_expiry=2.0)) as client:
        served = client.get(f"{base}/v1/models").raise_for_status().json()["data"][0]["id"]

        def answer(job: _Job) -> tuple[_Job, list[int]]:
            body = {"model": served, "prompt": job.prompt_ids, "max_tokens": job.max_tokens,
                    "temperature": job.sampling.temperature, "seed": job.sampling.seed, "return_token_ids": True,
                    "skip_special_tokens": False}
            reply = client.post(f"{base}/v1/completions", json=body)
            if reply.status_code != 200:
                raise EndpointError(f"{base} answered {reply.status_code}: {reply.text[:200]}")
            data = reply.json()
            ids = data["choices"][0].get("token_ids") or data.get("specstand", {}).get("token_ids")
            if ids is None:
                raise EndpointError(f"{base} returns no answer token ids (vLLM needs return_token_ids support)")
            return job, list(ids)

        with ThreadPoolExecutor(max(concurrency, 1)) as pool:
            futures = [pool.submit(answer, job) for job in jobs]
            try:
                for future in as_completed(futures):
                    yield future.result()
            finally:  # a failed call or a kill: what has not started yet is not sent
                for future in futures:
                    future.cancel()


class EndpointError(RuntimeError):
    pass


def save_rows(folder: Path, rows: list[TrainRow], meta: dict) -> None:
    folder.mkdir(parents=True, exist_ok=True)

    def write_rows(tmp: Path) -> None:  # line by line: a large data set is never one string in memory
        with tmp.open("w") as f:
            for row in rows:
                f.write(json.dumps(asdict(row)) + "\n")

    write_atomic(folder / ROWS, write_rows)
    meta = {**meta, "rows": len(rows), "heldout_rows": sum(r.split == "heldout" for r in rows),
            "response_tokens": sum(len(r.response_ids) for r in rows)}
    write_text_atomic(folder / META, json.dumps(meta, indent=1) + "\n")


def recorded_model(folder: Path) -> tuple[str, Path] | None:
    """The target whose answers a train-data folder holds (finished: its meta.json; in progress: its partial
    rows' configuration), and the file that says so; None for a folder without either."""
    for path in (Path(folder) / META, Path(folder) / PARTIAL):
        if not path.is_file():
            continue
        try:
            with path.open() as f:
                data = json.loads(f.read() if path.name == META else f.readline())
        except (OSError, json.JSONDecodeError):
            continue  # not ours to judge here: reading the rows reports it
        if not isinstance(data, dict):
            continue  # likewise
        model = data.get("model") if path.name == META else (data.get("config") or {}).get("model")
        if isinstance(model, str):
            return model, path
    return None


def load_rows(folder: Path) -> tuple[dict, list[TrainRow]]:
    folder = Path(folder)
    if not (folder / ROWS).is_file() or not (folder / META).is_file():
        raise ValueError(f"{folder} is not a train-data folder ({ROWS} and {META} expected)")
    try:
        meta = json.loads((folder / META).read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{folder / META}: not valid JSON ({error})") from None
    if not isinstance(meta, dict):
        raise ValueError(f"{folder / META}: a {type(meta).__name__}, not a JSON object")
    rows = []
    with (folder / ROWS).open() as f:
        for number, line in enumerate(f, 1):
            try:
                rows.append(TrainRow(**json.loads(line)))
            except (json.JSONDecodeError, TypeError) as error:
                raise ValueError(f"{folder / ROWS} line {number}: not a train row ({error})") from None
    return meta, rows


def _check_split(folders: list[Path], metas: list[dict], rows: list[TrainRow]) -> None:
    """Folders split by another held-out share would train on turns that another holds out (and evaluate on
    them): refused."""
    train = {row.turn_id for row in rows if row.split == "train"}
    both = sorted({row.turn_id for row in rows if row.split == "heldout"} & train)
    if both:
        shares = ", ".join(f"{folder}: {meta.get('heldout_share', '?')}" for folder, meta in zip(folders, metas,
                                                                                             strict=True))
        raise ValueError(f"turn {both[0]!r} ({len(both)} in all) is trained on in one folder and held out in "
                         f"another (held-out shares {shares}); write them with one --heldout")


def load_datasets(folders: list[Path]) -> tuple[dict, list[TrainRow]]:
    """The rows of several train-data folders, in order, with one meta: their counts summed, the
    workloads listed. All must come from the same target and dtype: rows of two targets cannot train one
    drafter."""
    metas, rows = [], []
    for folder in folders:
        meta, more = load_rows(folder)
        metas.append(meta)
        rows += more
    _check_split(folders, metas, rows)
    first = metas[0]
    for folder, meta in zip(folders[1:], metas[1:], strict=True):
        if (meta.get("model"), meta.get("dtype")) != (first.get("model"), first.get("dtype")):
            raise ValueError(f"{folder} holds answers of {meta.get('model')} ({meta.get('dtype')}), "
                             f"{folders[0]} of {first.get('model')} ({first.get('dtype')})")
    if len(metas) == 1:
        return first, rows
    merged = {**first, "workloads": [w for m in metas for w in m.get("workloads", [])],
              "sources": sorted({s for m in metas for s in m.get("sources", [])}),
              "folders": [str(f) for f in folders]}
    for key in ("rows", "heldout_rows", "response_tokens", "seconds"):
        merged[key] = sum(m.get(key, 0) for m in metas)
    return merged, rows
