"""The bench: start or reach each target, replay the workload under each U, interleaved, and report."""

from __future__ import annotations

import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import httpx
from tqdm import tqdm

from specstand import kernels
from specstand.bench.endpoints import OpenAIEndpoint
from specstand.bench.replay import assign_turns, replay
from specstand.bench.report import WARM_WORDS, write_report
from specstand.bench.summary import RunResult
from specstand.models.loading import encode_messages, encode_prompt, resolve_model_path
from specstand.workloads import Call, Turn

SERVER_START_TIMEOUT_S = 600


# What a run may find cached when it begins: "system", the workload's shared heads (a server that has served
# the same agent before: an agent's every call repeats its system prompt and tools), or "none" (cold).
WARM_STATES = tuple(WARM_WORDS)
FIXED = "@fixed"  # a bench method name's suffix: serve that method at fixed K (adaptive verification is the default)
GAUGES = ("specstand:prefix_store_bytes", "specstand:tau", "specstand:requests_waiting", "specstand:exact",
          "specstand:num_speculative_tokens", "specstand:pass_seconds_profiled", "specstand:pass_seconds_estimated")


def bench_method(name: str) -> str:
    """A bench method name as the stand reports it: METHOD+adaptive, the spelling from before adaptive
    verification became the default, is METHOD."""
    return name.removesuffix("+adaptive")


@dataclass
class Target:
    name: str
    url: str
    k: int | None = None
    process: subprocess.Popen | None = None
    log: Path | None = None
    command: str | None = None  # the shell command that starts it (an endpoint the bench may restart)


def _run_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Counters as the run's increase; gauges (profiled pass costs, the store's size) as they stand after it.
    Nothing (no metrics for the run) where the scrape before it failed or a counter went down (the server
    restarted during it): the totals since the server's start are not the run's."""
    counters = [key for key in after if not key.startswith(GAUGES)]
    if counters and (not before or any(after[key] < before.get(key, 0.0) for key in counters)):
        return {}
    return {key: after[key] if key.startswith(GAUGES) else after[key] - before.get(key, 0.0) for key in after}


def server_gone(target: Target) -> str | None:
    """Why a server the bench started is no longer running (None: it runs, or the bench did not start it)."""
    if target.process is None or target.process.poll() is None:
        return None
    code = target.process.returncode
    killed = " (SIGKILL: on Linux most often the out-of-memory killer)" if code == -signal.SIGKILL else ""
    return f"the {target.name} server exited with code {code}{killed}; its calls fail from here on; log: {target.log}"


@dataclass
class BenchConfig:
    workload: str
    users: list[int]
    repeats: int
    out_dir: Path
    baseline: str
    extra: dict = field(default_factory=dict)
    api_key: str | None = None  # sent to every target (never written to the report)
    warm: tuple[str, ...] = ("system",)  # the states runs begin in (WARM_STATES), each a table of its own
    stagger_s: float = 0.0  # user u starts u * stagger_s seconds into a run (bench/replay.py)


def settling_turn(turn: Turn) -> Turn:
    """A turn without its agent's delays: the warm-up, served before the first run and not recorded. It meets
    every first-call cost (the server's first prompt and decode passes, the drafter's first request) and lets
    adaptive verification's estimates settle on this traffic, as on a server that has served the same agent:
    they outlive the per-run reset, and after the first call alone a suffix server's first run got tau 1.73
    over all passes against 2.02-2.11 in its later runs (before 401b5fa, 1.45 against 2.04-2.16)."""
    return Turn(turn.turn_id, [replace(call, delay_ms=0.0) for call in turn.calls], turn.source)


def shared_heads(turns: list[Turn]) -> list[Call]:
    """One call per distinct head the workload's chat calls begin with (their leading system messages and
    the tools they offer), asking for one token after a one-word user message: replayed before a run, they
    leave a server with what it would hold after serving the same agent, and nothing of the turns' own
    messages or answers. Raw-prompt calls have no such head."""
    heads: dict[str, Call] = {}
    for call in (c for turn in turns for c in turn.calls if c.messages is not None):
        system = []
        for message in call.messages:
            if message.get("role") != "system":
                break
            system.append(message)
        if not system and not call.tools:
            continue
        key = json.dumps([system, call.tools], sort_keys=True)
        if key not in heads:
            heads[key] = Call(f"warm-{len(heads)}", [*system, {"role": "user", "content": "Hi"}], max_tokens=1,
                              tools=call.tools)
    return list(heads.values())


async def warm_up(endpoint: OpenAIEndpoint, heads: list[Call]) -> str | None:
    """Leave the workload's shared heads in `endpoint`'s cache (see shared_heads). Returns why that failed, or
    None: a target that cannot answer fails its run's calls too, which the report counts, and the bench goes
    on with the others."""
    for call in heads:
        try:
            await endpoint.complete(call)
        except Exception as error:  # noqa: BLE001 - whatever the client or the server raised, said once
            return f"{type(error).__name__}: {error}"
    return None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(method: str, model: str, k: int | None, max_batch: int, dtype: str, max_seq_len: int,
                 drafter: Path | None = None, speculative_config: str | None = None) -> Target:
    """`specstand serve` in its own process (its own threads, so targets do not share the engine).
    k None: the method's default (DFlash: its block size - 1). A method is served with adaptive verification;
    one named METHOD@fixed verifies every draft at fixed K. With `speculative_config` (vLLM's JSON) the server
    is configured by it, and `method` only names the target."""
    port = _free_port()
    log = Path(tempfile.mkstemp(prefix=f"specstand-serve-{method}-", suffix=".log")[1])
    cmd = [sys.executable, "-m", "specstand.cli", "serve", "--model", model,
           "--port", str(port), "--max-batch", str(max_batch), "--dtype", dtype, "--max-seq-len", str(max_seq_len),
           "--served-model-name", model]
    if speculative_config is not None:
        cmd += ["--speculative-config", speculative_config]
    else:
        base = method.removesuffix(FIXED)
        cmd += ["--method", base] + (["--no-adaptive"] if base != method else [])
        cmd += ["--k", str(k)] if k is not None else []
        cmd += ["--drafter", str(drafter)] if drafter is not None else []
    with log.open("w") as sink:
        process = subprocess.Popen(cmd, stdout=sink, stderr=subprocess.STDOUT, env=os.environ.copy())
    return Target(method, f"http://127.0.0.1:{port}", None, process, log)  # its K: on its /metrics


def workload_context(turns: list[Turn], model: str, k: int) -> int:
    """The context a server needs for every call of `turns`: its longest prompt (through the model's chat
    template) + its answer budget + K + 1, rounded up to 256 and capped at the model's own limit."""
    from transformers import AutoConfig, AutoTokenizer

    path = resolve_model_path(model, log=lambda _: None)
    tokenizer = AutoTokenizer.from_pretrained(path)
    longest = 0
    for call in (c for turn in turns for c in turn.calls):
        if call.messages is not None:
            tokens = len(encode_messages(tokenizer, call.messages, call.tools))
        else:
            tokens = len(encode_prompt(tokenizer, call.prompt or ""))
        longest = max(longest, tokens + call.max_tokens + k + 1)
    limit = getattr(AutoConfig.from_pretrained(path), "max_position_embeddings", None) or longest
    return min(-(-longest // 256) * 256, limit)


def wait_ready(target: Target) -> None:
    deadline = time.time() + SERVER_START_TIMEOUT_S
    while time.time() < deadline:
        if target.process is not None and target.process.poll() is not None:
            tail = target.log.read_text().strip().splitlines()[-1:] if target.log else []
            raise RuntimeError(f"server for {target.name} exited: {tail[0] if tail else 'no output'}")
        try:
            status = httpx.get(f"{target.url}/health", timeout=2).status_code
            if status == 404:  # a server without the route (llama-cpp-python's): ready once it lists models
                status = httpx.get(f"{target.url}/v1/models", timeout=2).status_code
            if status == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server for {target.name} did not become ready in {SERVER_START_TIMEOUT_S}s")


def start_endpoint(target: Target) -> None:
    """Start `target.command` (a peer server at target.url) in a session of its own and wait until it answers."""
    log = Path(tempfile.mkstemp(prefix=f"specstand-peer-{target.name}-", suffix=".log")[1])
    with log.open("w") as sink:
        target.process = subprocess.Popen(target.command, shell=True, stdout=sink, stderr=subprocess.STDOUT,
                                          start_new_session=True)
    target.log = log
    wait_ready(target)


def restart_endpoint(target: Target) -> None:
    """Stop the peer the bench started and start it again: a fresh state for a server with no reset route."""
    stop_servers([target])
    start_endpoint(target)


async def _restarted(target: Target, endpoint: OpenAIEndpoint) -> None:
    """Restart a peer, then meet its first-call costs with a one-word call that shares no turn's head."""
    restart_endpoint(target)
    hello = Call("restart", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
    await replay([Turn("restart", [hello])], endpoint, 1)


def stop_servers(targets: list[Target]) -> None:
    for target in targets:
        if target.process is None:
            continue
        session = target.command is not None  # a peer's shell may have exited and left its server running
        if target.process.poll() is None or (session and _session_alive(target.process.pid)):
            _stop(target.process, session)


def _stop(process: subprocess.Popen, whole_session: bool) -> None:
    """Stop a server; a peer's command runs in a session of its own, its shell and the server it started."""
    def send(sig: int) -> None:
        if whole_session:
            os.killpg(process.pid, sig)
        else:
            process.send_signal(sig)

    send(signal.SIGTERM)
    try:
        process.wait(timeout=15)
        # the shell may exit before the server it started: the session is gone only when its last process is
        deadline = time.time() + 15
        while whole_session and _session_alive(process.pid):
            if time.time() > deadline:
                raise subprocess.TimeoutExpired(str(process.args), 15)
            time.sleep(0.05)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        process.wait()


def _session_alive(pid: int) -> bool:
    try:
        os.killpg(pid, 0)
    except (ProcessLookupError, PermissionError):  # gone, or its id now another user's group
        return False
    return True


async def _served_k(target: Target, endpoint: OpenAIEndpoint) -> int | str:
    """K as the server reports it (specstand's servers: on /metrics), else as the bench was told ("–": none)."""
    served = (await endpoint.scrape_metrics()).get("specstand:num_speculative_tokens")
    if served is not None:
        return int(served) if served > 0 else "–"
    return target.k if target.k is not None else "–"


async def _settle(targets: list[Target], endpoints: dict[str, OpenAIEndpoint], first: Turn,
                  report_config: dict) -> tuple[dict[str, bool], list[Target]]:
    """Serve every target the workload's first turn, not recorded (first-call costs and learning stay out of
    the figures), and find how each one starts a run afresh: its reset route, else a restart."""
    for endpoint in endpoints.values():
        await replay([settling_turn(first)], endpoint, 1)
    report_config["settled_on_first_turn"] = True
    # each run starts from the same state: no prompt cached and no answer remembered from an earlier run
    # (replayed turns repeat, so they would be found whole: x4 on a cold AVX2 demo turn, and suffix
    # decoding drafting the answers of the previous repeat)
    resets = {name: await endpoint.reset_prefix_cache() for name, endpoint in endpoints.items()}
    report_config["prefix_cache_reset_per_run"] = resets
    # a peer with no reset route whose command the bench has is restarted before each run instead
    restarted = [t for t in targets if not resets[t.name] and t.command]
    report_config["restarted_per_run"] = [t.name for t in restarted]
    return resets, restarted


async def run_bench(targets: list[Target], turns: list[Turn], config: BenchConfig) -> str:
    endpoints = {t.name: OpenAIEndpoint(t.url, api_key=config.api_key) for t in targets}
    names = [t.name for t in targets]
    told: set[str] = set()  # the targets whose server was found gone
    k_by_target: dict[str, int | str] = {}
    runs: list[RunResult] = []
    # the machine beside the figures: read bandwidth drifts where neighbours share the host
    machine = {**kernels.machine(), "read_gbs_start": round(kernels.read_bandwidth_gbs(), 1)}
    report_config = {"workload": config.workload, "users": config.users, "repeats": config.repeats,
                     "targets": {t.name: t.url for t in targets}, "machine": machine, **config.extra}

    def report(complete: bool) -> str:
        return write_report(config.out_dir, report_config, runs, turns, names, config.users, config.baseline,
                            k_by_target, complete, config.warm)

    heads = shared_heads(turns)
    report_config["warm"] = {warm: WARM_WORDS[warm] for warm in config.warm}
    report_config["shared_heads"] = len(heads)
    report_config["stagger_s"] = config.stagger_s
    per_run = {u: sum(len(own) for own in assign_turns(turns, u)) for u in config.users}
    total = config.repeats * len(targets) * len(config.warm) * sum(per_run.values())
    try:
        for target in targets:
            k_by_target[target.name] = await _served_k(target, endpoints[target.name])
        resets, restarted = await _settle(targets, endpoints, turns[0], report_config)
        with tqdm(total=total, unit="turn", desc="bench", file=sys.stderr) as bar:
            for repeat, warm, users in itertools.product(range(config.repeats), config.warm, config.users):
                for target in targets:  # interleaved, so drift hits every target alike
                    name = target.name
                    bar.set_postfix_str(f"{name} U={users} warm {warm} repeat {repeat + 1}")
                    gone = server_gone(target)
                    if gone is not None and name not in told:
                        told.add(name)
                        tqdm.write(f"bench: {gone}", file=sys.stderr)
                    endpoint = endpoints[name]
                    if resets[name]:
                        await endpoint.reset_prefix_cache()
                    elif target in restarted:
                        await _restarted(target, endpoint)
                    if warm == "system" and (failed := await warm_up(endpoint, heads)) is not None:
                        tqdm.write(f"bench: {name} did not take the shared heads ({failed}): this run of it starts "
                                   "cold", file=sys.stderr)
                    before = await endpoint.scrape_metrics()
                    records, wall = await replay(turns, endpoint, users, on_turn=lambda _: bar.update(),
                                                 stagger_s=config.stagger_s)
                    if await endpoint.wait_idle() is False:  # the fillers' cancelled calls
                        tqdm.write(f"bench: {name} still ran calls 10 s after the run: the next run may share it "
                                   "with them", file=sys.stderr)
                    after = await endpoint.scrape_metrics()
                    runs.append(RunResult(name, users, repeat, wall, records, _run_delta(before, after), warm))
                    report(complete=False)
        machine["read_gbs_end"] = round(kernels.read_bandwidth_gbs(), 1)
        return report(complete=True)
    finally:
        for endpoint in endpoints.values():
            await endpoint.close()
