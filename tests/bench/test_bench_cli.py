"""The whole stand on a tiny model: servers started, turns replayed, report written."""

import asyncio
import json
import socket
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
import pytest

from specstand.bench import run
from specstand.bench.run import Target, server_gone, settling_turn, workload_context
from specstand.cli import main
from specstand.workloads import Call, Turn, save_workload

SYSTEM = {"role": "system", "content": " ".join(f"w{10 + i % 50}" for i in range(60))}  # an agent's instructions


def test_bench_runs_methods_side_by_side(tmp_path, tiny_model_dir, capsys):
    turns = [Turn(f"t{i}", [
        Call(id="a", messages=[SYSTEM, {"role": "user", "content": f"w{3 + i} w4 w5 w3 w4 w5"}], max_tokens=12,
             expect_json=True),
        Call(id="b", messages=[SYSTEM, {"role": "user", "content": "w7 w8 w7 w8"}], depends_on=["a"], delay_ms=20,
             max_tokens=12),
    ]) for i in range(2)]
    workload = tmp_path / "w.jsonl"
    save_workload(turns, workload)
    out = tmp_path / "report"
    code = main(["bench", "--workload", str(workload), "--model", str(tiny_model_dir), "--method", "none,ngram",
                 "--method", "suffix@fixed", "--users", "1,2", "--repeats", "1", "--warm", "system,none",
                 "--stagger", "0.05", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "| turn p50, U=2 (s) |" in printed and "| identical to none | 100.0% | 100.0% | 100.0% |" in printed
    assert "suffix@fixed" in printed
    assert "| K | – | 5 | 5 |" in printed  # each server's K, as its /metrics reports it
    assert "## Warm: system" in printed and "## Warm: none" in printed
    assert "| run seconds: prompt / decode / draft / other / idle, U=1 |" in printed
    raw = json.loads((out / "report.json").read_text())
    assert raw["complete"] and len(raw["runs"]) == 3 * 2 * 2
    assert raw["config"]["shared_heads"] == 1
    assert raw["config"]["stagger_s"] == 0.05  # user 1 of 2 starts 0.05 s in
    assert "User u started 0.05 s x u into each run" in (out / "report.md").read_text()
    # warm: the system prompt was cached before the run, so more of each prompt is reused than cold
    by_warm = raw["summary_by_warm"]
    for target in ("none", "ngram"):
        warm, cold = by_warm["system"][target]["1"][0], by_warm["none"][target]["1"][0]
        assert warm["prompt_tokens_reused"] > cold["prompt_tokens_reused"]
        assert warm["prompt_tokens_computed"] < cold["prompt_tokens_computed"]
        assert all(warm["engine_s"][phase] >= 0 for phase in ("prompt", "decode", "draft", "other", "idle"))
    assert (out / "time_breakdown.png").exists() and (out / "warm_none" / "time_breakdown.png").exists()
    assert raw["config"]["max_seq_len"] == 256  # sized from the workload: short prompts, 12-token answers
    machine = raw["config"]["machine"]  # the figures' machine, bandwidth measured beside the run
    assert machine["kernel_path"] in ("python", "scalar", "avx2", "avx512bf16", "amx") and machine["cpus"] >= 1
    assert machine["read_gbs_start"] > 0 and machine["read_gbs_end"] > 0
    assert f"kernel path of specstand's targets here: {machine['kernel_path']}" in (out / "report.md").read_text()
    # every run starts with nothing cached: a repeat must not find the previous run's prompts and answers
    assert raw["config"]["prefix_cache_reset_per_run"] == {"none": True, "ngram": True, "suffix@fixed": True}
    assert "prompt cache and drafter memory reset. Before the first run each target served the workload's first " \
        "turn once" in (out / "report.md").read_text()
    ngram = raw["summary"]["ngram"]["1"][0]
    assert ngram["tau"] >= 1.0 and ngram["failed_calls"] == 0
    assert (out / "report.md").read_text().count("|") > 20


def test_bench_argument_errors(tmp_path, capsys):
    workload = tmp_path / "w.jsonl"
    save_workload([Turn("t", [Call(id="a", prompt="p")])], workload)
    for argv, message in (
        (["--users", "0"], "--users needs counts >= 1"),
        (["--users", "a,b"], "comma-separated integers"),
        (["--stagger", "-1"], "--stagger must be >= 0"),
        (["--limit-turns", "0"], "--limit-turns must be >= 1"),
        (["--limit-turns", "-1"], "--limit-turns must be >= 1"),
        (["--method", "none"], "--method needs --model"),
        (["--model", "m", "--method", "none@fixed"], "unknown method"),
        ([], "give --endpoint"),
        (["--endpoint", "nourl"], "NAME=URL"),
        (["--stagger", "inf"], "not a finite number"),  # hung the bench
        (["--endpoint", "a=http://127.0.0.1:9", "--endpoint", "a=http://127.0.0.1:10"], "two targets are named 'a'"),
        (["--endpoint", "suffix=http://127.0.0.1:9", "--model", "m", "--method", "suffix"],
         "two targets are named 'suffix'"),
        # checked before any server starts (an endpoint command, or a model's servers, took minutes first)
        (["--endpoint", "a=http://127.0.0.1:9", "--endpoint-command", "a=exit 1", "--baseline", "typo"],
         "--baseline 'typo' is not one of the targets (a)"),
        (["--endpoint", "a=http://127.0.0.1:9", "--endpoint-command", "a=exit 1", "--out", str(workload)],
         "--out"),
    ):
        code = main(["bench", "--workload", str(workload), "--out", str(tmp_path / "o"), *argv])
        err = capsys.readouterr().err
        assert code != 0 and message in err and len(err.strip().splitlines()) == 1


def test_users_given_twice_are_one_user_count_and_configs_alike_get_their_own_names():
    from specstand.cli.stand import _bench_methods, _parse_users

    assert _parse_users("1,4,1") == [1, 4]  # "1,1" summarised every run twice
    given = SimpleNamespace(method=["suffix,suffix@fixed"], fixed=True, model="m", endpoint=[], speculative_config=[])
    assert _bench_methods(given)[0] == ["suffix", "suffix@fixed"]  # --fixed adds none twice
    config = '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": %d}'
    args = SimpleNamespace(method=[], fixed=False, model="m", endpoint=["peer=http://127.0.0.1:9"],
                           speculative_config=[config % 3, config % 4, config % 5])
    assert [name for name, _ in _bench_methods(args)[1]] == ["ngram-cfg-k5", "ngram-cfg-k5#2", "ngram-cfg-k5#3"]


def test_a_peer_command_whose_shell_exited_is_stopped_with_its_server(tmp_path):
    from specstand.bench.run import _session_alive, stop_servers

    target = Target("bg", "http://127.0.0.1:9", command="sleep 60 & exit 0")  # the server outlives its shell
    target.process = subprocess.Popen(target.command, shell=True, start_new_session=True)
    target.process.wait(timeout=10)
    assert _session_alive(target.process.pid)
    stop_servers([target])
    assert not _session_alive(target.process.pid)


def test_server_context_is_sized_from_the_workload(tiny_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    long_prompt = " ".join(f"w{i % 90}" for i in range(400))
    turns = [Turn("t", [Call(id="a", prompt=long_prompt, max_tokens=100), Call(id="b", prompt="w3", max_tokens=5)])]
    needed = len(tokenizer(long_prompt)["input_ids"]) + 100 + 7 + 1
    assert needed > 256 and workload_context(turns, str(tiny_model_dir), 7) == min(-(-needed // 256) * 256, 1024)
    longer = [Turn("t", [Call(id="a", prompt=long_prompt * 5, max_tokens=100)])]
    assert workload_context(longer, str(tiny_model_dir), 7) == 1024  # the model's own limit


def test_bench_on_a_hybrid_target_changes_no_answer(tmp_path, capsys):
    """A tiny Qwen3.5 twin (gated delta rule beside attention), n-gram and suffix drafts that come and go
    between passes, two users: every answer identical to plain decoding, broken JSON as the baseline's."""
    from tests.conftest import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny-qwen3_5", "qwen3_5")
    turns = [Turn(f"t{i}", [
        Call(id="a", messages=[{"role": "user", "content": f"w{3 + i} w4 w5 w3 w4 w5 w3 w4"}], max_tokens=24,
             expect_json=True),
        Call(id="b", messages=[{"role": "user", "content": "w7 w8 w7 w8 w7"}], depends_on=["a"], max_tokens=24),
    ]) for i in range(3)]
    workload = tmp_path / "w.jsonl"
    save_workload(turns, workload)
    out = tmp_path / "report"
    code = main(["bench", "--workload", str(workload), "--model", str(model_dir), "--method", "none,ngram,suffix",
                 "--users", "1,2", "--repeats", "1", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert "| identical to none | 100.0% | 100.0% | 100.0% |" in printed
    summary = json.loads((out / "report.json").read_text())["summary"]
    for method in ("ngram", "suffix"):
        assert summary[method]["1"][0]["failed_calls"] == 0
    assert summary["suffix"]["1"][0]["tau"] > 1.0  # drafts were accepted, so passes alternated


def test_a_killed_bench_stops_the_servers_it_started(tmp_path, tiny_model_dir):
    turns = [Turn("t", [Call(id="a", messages=[{"role": "user", "content": "w3 w4 w5"}], max_tokens=8)])]
    save_workload(turns, tmp_path / "w.jsonl")
    bench = subprocess.Popen([sys.executable, "-m", "specstand.cli", "bench", "--workload", str(tmp_path / "w.jsonl"),
                              "--model", str(tiny_model_dir), "--method", "none,ngram", "--repeats", "1000",
                              "--out", str(tmp_path / "report")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while not (tmp_path / "report" / "report.json").exists():  # both servers are up and serving
            assert bench.poll() is None and time.monotonic() < deadline
            time.sleep(0.2)
        servers = psutil.Process(bench.pid).children()
        assert len(servers) == 2
        bench.terminate()
        assert bench.wait(timeout=60) != 0
        _, alive = psutil.wait_procs(servers, timeout=30)
        assert alive == []
    finally:
        bench.kill()


def test_a_server_that_died_is_named_with_how(tmp_path):
    killed = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    killed.wait()
    gone = server_gone(Target("schema", "http://127.0.0.1:1", 5, killed, tmp_path / "serve.log"))
    assert gone is not None and "schema server exited with code -9" in gone and "out-of-memory" in gone
    running = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert server_gone(Target("none", "http://127.0.0.1:2", None, running)) is None
    finally:
        running.kill()
        running.wait()
    assert server_gone(Target("remote", "http://127.0.0.1:3")) is None  # an --endpoint: not the bench's to watch


def test_the_warm_up_is_a_whole_turn_without_its_delays():
    calls = [Call("a", prompt="one", delay_ms=50.0), Call("b", prompt="two", depends_on=["a"], delay_ms=20.0)]
    warm_up = settling_turn(Turn("t", calls, "src"))
    assert [c.id for c in warm_up.calls] == ["a", "b"] and [c.delay_ms for c in warm_up.calls] == [0.0, 0.0]
    assert warm_up.calls[1].depends_on == ["a"]
    assert (warm_up.turn_id, warm_up.source) == ("t", "src") and calls[0].delay_ms == 50.0  # the workload is unchanged


PEER = '''
import json, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

with open(sys.argv[2], "a") as starts:  # one line a start: the test counts restarts
    starts.write("started\\n")


class Peer(BaseHTTPRequestHandler):  # an OpenAI server with no /health and no /reset_prefix_cache
    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        found = self.path == "/v1/models"
        self._send(200 if found else 404, {"data": [{"id": "peer"}]} if found else {})

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path != "/v1/chat/completions":
            return self._send(404, {})
        self._send(200, {"choices": [{"message": {"content": "ok"}, "finish_reason": "stop"}],
                         "usage": {"completion_tokens": 1}})

    def log_message(self, *args):
        pass


ThreadingHTTPServer(("127.0.0.1", int(sys.argv[1])), Peer).serve_forever()
'''


def test_a_peer_with_no_reset_route_is_restarted_before_each_run(tmp_path, capsys):
    script, starts = tmp_path / "peer.py", tmp_path / "starts.txt"
    script.write_text(PEER)
    port = _free_port()
    turns = [Turn("t", [Call(id="a", messages=[SYSTEM, {"role": "user", "content": "w3"}], max_tokens=4)])]
    save_workload(turns, tmp_path / "w.jsonl")
    code = main(["bench", "--workload", str(tmp_path / "w.jsonl"), "--endpoint", f"peer=http://127.0.0.1:{port}",
                 "--endpoint-command", f"peer={sys.executable} {script} {port} {starts}", "--users", "1,2",
                 "--repeats", "2", "--warm", "none", "--stagger", "0.01", "--out", str(tmp_path / "report")])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "--stagger with 1 turns for 2 users" in err  # the second user would find the first one's turn cached
    assert starts.read_text().count("started") == 1 + 2 * 2  # the bench's start, then one before each run
    raw = json.loads((tmp_path / "report" / "report.json").read_text())
    assert raw["config"]["restarted_per_run"] == ["peer"]
    assert "peer: the server restarted" in (tmp_path / "report" / "report.md").read_text()
    with pytest.raises(ConnectionError):  # the bench stopped the peer it started
        socket.create_connection(("127.0.0.1", port), timeout=2)
    assert main(["bench", "--workload", str(tmp_path / "w.jsonl"), "--endpoint", f"peer=http://127.0.0.1:{port}",
                 "--endpoint-command", "other=true", "--out", str(tmp_path / "r2")]) != 0
    assert "which no --endpoint gives" in capsys.readouterr().err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_target_gone_mid_bench_fails_its_calls_and_the_bench_goes_on(tmp_path, monkeypatch, capsys):
    """A warm run of a target whose server has gone: its calls fail (the report counts them), the others' runs
    are all measured, and the report is complete."""
    script, port = tmp_path / "peer.py", _free_port()
    script.write_text(PEER)
    peer = subprocess.Popen([sys.executable, str(script), str(port), str(tmp_path / "starts.txt")])
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "the peer did not start"
                time.sleep(0.05)
        monkeypatch.setattr(run.kernels, "read_bandwidth_gbs", lambda: 1.0)
        turns = [Turn("t", [Call(id="a", messages=[SYSTEM, {"role": "user", "content": "w3"}], max_tokens=4)])]
        config = run.BenchConfig("w.jsonl", [1], 2, tmp_path / "report", "peer", warm=("system",))
        targets = [Target("peer", f"http://127.0.0.1:{port}"), Target("gone", f"http://127.0.0.1:{_free_port()}")]
        asyncio.run(run.run_bench(targets, turns, config))
    finally:
        peer.kill()
        peer.wait()
    raw = json.loads((tmp_path / "report" / "report.json").read_text())
    assert raw["complete"] and sorted((r["target"], r["repeat"]) for r in raw["runs"]) == [
        ("gone", 0), ("gone", 1), ("peer", 0), ("peer", 1)]
    assert all(call["error"] for r in raw["runs"] if r["target"] == "gone" for t in r["turns"] for call in t["calls"])
    assert "gone did not take the shared heads" in capsys.readouterr().err
