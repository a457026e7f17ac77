"""generate and serve on a tiny local model: real output, and one readable line + non-zero exit on bad input."""

from __future__ import annotations

import json
import socket
from types import SimpleNamespace

import pytest

from specstand.cli import main
from tests.cli import run_cli
from tests.conftest import KERNEL_PATHS


def test_generate_json_with_every_method(capsys, tiny_model_dir):
    outputs = {}
    for method, flags in (("none", []), ("ngram", []), ("suffix", []), ("suffix", ["--no-adaptive"]), ("schema", [])):
        code, out, _ = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--method", method,
                            "--prompt", "w3 w4 w5 w3 w4 w5 w3 w4", "--max-tokens", "12", "--json", *flags)
        assert code == 0
        result = json.loads(out)
        assert {"text", "token_ids", "stats", "tokens_per_second"} <= result.keys()
        assert result["stats"]["tau"] >= 1.0 and result["stats"]["target_passes"] >= 1
        assert result["adaptive"] == (not flags)  # adaptive verification unless told --no-adaptive
        outputs[method + "".join(flags)] = result["token_ids"]
    assert outputs["none"] == outputs["ngram"] == outputs["suffix"] == outputs["suffix--no-adaptive"]
    assert outputs["schema"] == outputs["none"]


def test_speculative_config_turns_adaptive_verification_off_or_refuses_a_non_boolean(capsys, tiny_model_dir):
    argv = ["generate", "--model", str(tiny_model_dir), "--prompt", "w3 w4 w3 w4", "--max-tokens", "4", "--json"]
    code, out, _ = run_cli(capsys, *argv, "--speculative-config", '{"method": "suffix", "adaptive": false}')
    assert code == 0 and json.loads(out)["adaptive"] is False
    code, out, _ = run_cli(capsys, *argv, "--speculative-config", '{"method": "suffix"}')
    assert code == 0 and json.loads(out)["adaptive"] is True
    code, out, err = run_cli(capsys, *argv, "--speculative-config", '{"method": "suffix", "adaptive": "no"}')
    assert code != 0 and out == "" and "adaptive must be true or false" in err


@pytest.mark.skipif(not KERNEL_PATHS, reason="q8_0 runs on the kernels, which do not build here")
def test_generate_on_q8_0_weights_is_exact_and_lossless(capsys, tiny_model_dir):
    answers = []
    for method in ("none", "suffix"):
        code, out, _ = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--dtype", "q8_0", "--method",
                            method, "--prompt", "w3 w4 w5 w3 w4 w5 w3 w4", "--max-tokens", "12", "--json")
        assert code == 0
        result = json.loads(out)
        assert result["exact"] is True
        answers.append(result["token_ids"])
    assert answers[0] == answers[1]


def test_q8_0_without_the_kernels_is_one_line(capsys, tiny_model_dir, monkeypatch):
    monkeypatch.setenv("SPECSTAND_KERNEL_PATH", "python")
    code, out, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--dtype", "q8_0", "--prompt", "w1")
    assert code != 0 and out == ""
    assert len(err.strip().splitlines()) == 1 and "compiled kernels" in err


def test_messages_file_uses_the_chat_template(capsys, tiny_model_dir, tmp_path):
    messages = tmp_path / "messages.json"
    messages.write_text(json.dumps([{"role": "user", "content": "w7 w8 w9"}]))
    code, out, _ = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--messages-file", str(messages),
                        "--max-tokens", "4", "--json", "--temperature", "0.8", "--seed", "3")
    assert code == 0
    assert json.loads(out)["prompt_tokens"] == 3


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--method", "magic"], "unknown method"),
        (["--k", "-1"], "--k must be >= 0"),
        (["--max-tokens", "0"], "--max-tokens must be > 0"),
        (["--prompt", "  "], "prompt is empty"),
        (["--prompt", " ".join(["w5"] * 3000)], "exceed the context"),
    ],
)
def test_bad_arguments_give_one_line(capsys, tiny_model_dir, extra, message):
    argv = ["generate", "--model", str(tiny_model_dir), "--dtype", "bf16", "--prompt", "w1 w2", *extra]  # no start line
    code, out, err = run_cli(capsys, *argv)
    assert code != 0 and out == ""
    assert len(err.strip().splitlines()) == 1 and message in err


def test_unknown_model_and_bad_messages_files(capsys, tiny_model_dir, tmp_path):
    code, _, err = run_cli(capsys, "generate", "--model", "no-such-model", "--prompt", "hi")
    assert code != 0 and "unknown model" in err and len(err.strip().splitlines()) == 1
    broken = tmp_path / "broken.json"
    broken.write_text("[{not json")
    wrong_shape = tmp_path / "wrong.json"
    wrong_shape.write_text(json.dumps([{"role": "user"}]))
    for path, message in ((tmp_path / "missing.json", "cannot read"), (broken, "not valid JSON"),
                          (wrong_shape, "needs string 'role' and 'content'")):
        code, _, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--messages-file", str(path))
        assert code != 0 and message in err and len(err.strip().splitlines()) == 1


def test_vllm_speculative_config_stands_for_method_k_and_ngram_sizes(capsys, tiny_model_dir):
    config = ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4, '
              '"adaptive": false}')
    code, out, _ = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--speculative-config", config,
                        "--prompt", "w3 w4 w5 w3 w4 w5 w3 w4", "--max-tokens", "12", "--json")
    assert code == 0
    stats = json.loads(out)["stats"]
    assert stats["passes_with_draft"] > 0 and 0 < len(stats["drafted_per_position"]) <= 3  # K from the config
    code, out, _ = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--speculative-config",
                        '{"method": "schema", "num_speculative_tokens": 4}', "--prompt", "w3 w4", "--max-tokens", "4",
                        "--json")
    assert code == 0 and json.loads(out)["method"] == "schema"
    for bad, message in [
        ("{not json", "not valid JSON"),
        ('{"method": "medusa"}', "method 'medusa'"),
        ('{"method": "ngram", "draft_tensor_parallel_size": 2}', "draft_tensor_parallel_size not supported"),
        ('{"method": "suffix", "prompt_lookup_max": 4}', "belong to method ngram"),
        ('{"method": "ngram", "num_speculative_tokens": "five"}', "must be an integer"),
    ]:
        code, _, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--speculative-config", bad,
                            "--prompt", "w3")
        assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    code, _, err = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--speculative-config", config,
                        "--method", "suffix", "--prompt", "w3")
    assert code == 2 and "not both" in err


class _Stop(Exception):
    """Raised by a stand-in for build_server: the test has what it wanted, nothing is served."""


def _serve_config(monkeypatch, *argv: str):
    """What `specstand serve ARGV` would load and serve, without loading or serving."""
    import specstand.models
    import specstand.server
    from specstand.cli import serving

    seen = {}
    monkeypatch.setattr(specstand.models, "load_model",
                        lambda model, dtype, max_seq_len, log: seen.setdefault("load", (model, dtype, max_seq_len)))
    def build(load, config):
        load()
        seen["config"] = config
        raise _Stop

    monkeypatch.setattr(specstand.server, "build_server", build)
    # no port is taken: the socket it would listen on is a stand-in that names the port asked for
    monkeypatch.setattr(serving, "_listening_socket",
                        lambda host, port: SimpleNamespace(getsockname=lambda: (host, port)))
    with pytest.raises(_Stop):
        main(["serve", *argv])
    return seen["load"], seen["config"]


def test_serve_takes_vllm_spellings(monkeypatch):
    monkeypatch.delenv("SPECSTAND_API_KEY", raising=False)
    ours = _serve_config(monkeypatch, "--model", "m1", "--max-seq-len", "1024", "--max-batch", "3", "--dtype", "fp32",
                         "--served-model-name", "x", "--enable-auto-tool-choice", "--host", "0.0.0.0", "--port", "9")
    vllms = _serve_config(monkeypatch, "m1", "--max-model-len", "1024", "--max-num-seqs", "3", "--dtype", "float32",
                          "--served-model-name", "x", "--enable-auto-tool-choice", "--tool-call-parser", "json")
    assert ours == vllms
    (model, dtype, max_seq_len), config = ours
    assert (model, dtype, max_seq_len, config.max_batch, config.served_name) == ("m1", "fp32", 1024, 3, "x")
    assert config.tool_call_parser == "json" and config.api_key is None  # the preset default when none is named
    load, config = _serve_config(monkeypatch, "m1", "--dtype", "auto", "--tool-call-parser", "hermes")
    assert load[1] == "auto" and config.tool_call_parser is None  # no auto tool choice: answers stay content
    assert _serve_config(monkeypatch, "m1", "--dtype", "bfloat16", "--enable-auto-tool-choice",
                         "--tool-call-parser", "hermes")[1].tool_call_parser == "hermes"
    monkeypatch.setenv("SPECSTAND_API_KEY", "from-env")
    assert _serve_config(monkeypatch, "m1")[1].api_key == "from-env"
    assert _serve_config(monkeypatch, "m1", "--api-key", "flag")[1].api_key == "flag"


def test_serve_on_a_taken_port_says_so_before_loading_the_model(capsys, tiny_model_dir):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        code, _, err = run_cli(capsys, "serve", "--model", str(tiny_model_dir), "--port", str(port))
    assert code != 0 and err.strip().splitlines() == [f"specstand: error: cannot listen on 127.0.0.1:{port}: "
                                                      "Address already in use"]


def test_tool_call_parser_names_match_the_server():
    from specstand.cli.serving import TOOL_CALL_PARSERS
    from specstand.server.tool_calls import PARSERS

    assert tuple(TOOL_CALL_PARSERS) == PARSERS


@pytest.mark.parametrize("argv, words", [
    (["/no/such/model", "--request-timeout", "0"], "--request-timeout"),  # checked before the model loads
    (["/no/such/model", "--max-num-seqs", "0"], "--max-batch"),
    (["a", "--model", "b"], "two models given"),
    (["m", "--dtype", "float16"], "unknown dtype 'float16'"),
    (["m", "--tool-call-parser", "pythonic"], "invalid choice"),
    (["m", "--port", "70000"], "--port"),
    (["m", "--prefix-cache-gb", "inf"], "not a finite number"),  # overflowed: a traceback
])
def test_serve_refuses_bad_flags_before_loading(capsys, argv, words):
    code, out, err = run_cli(capsys, "serve", *argv)
    assert code == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and words in err


def test_generate_waits_seconds_not_minutes_for_quiet_cpus(capsys, tiny_model_dir, monkeypatch):
    import specstand.engine.quiet_profile as quiet_profile

    waits = []

    def profile_now(profile, threads, wait_s=None):
        waits.append(wait_s)
        return profile()

    monkeypatch.delenv("SPECSTAND_QUIET_WAIT_S", raising=False)
    monkeypatch.setattr(quiet_profile, "profile_when_quiet", profile_now)
    code, _, _ = run_cli(capsys, "generate", "--model", str(tiny_model_dir), "--method", "ngram", "--prompt", "w3 w4",
                         "--max-tokens", "4")
    assert code == 0 and waits == [10.0]  # a server waits up to 120 s
