"""One method registry: a new method is one Drafter and one MethodSpec, and every entry point takes it."""

from __future__ import annotations

import json

import pytest
import torch

from specstand.cli import main
from specstand.drafters import REGISTRY, Draft, Drafter, MethodSpec, SequenceView, make_drafter, register
from specstand.drafters.registry import method_help, trained_methods, training_free_methods, vllm_methods
from specstand.engine import Engine, EngineConfig, Request
from tests.conftest import random_prompts, tiny_decoder


class RepeatDrafter(Drafter):
    """A toy: drafts the last token again, K times."""

    name = "repeat"

    def propose(self, seq: SequenceView, max_tokens: int) -> Draft:
        return Draft([seq.token_ids[-1]] * max_tokens)


TOY = MethodSpec("repeat", "the last token again", make=lambda context: RepeatDrafter())


@pytest.fixture
def toy_method():
    register(TOY)
    yield TOY.name
    REGISTRY.pop(TOY.name)


def test_every_method_is_declared_once_and_named_everywhere():
    assert list(REGISTRY) == ["ngram", "suffix", "schema", "eagle3", "mtp", "dflash", "dspark", "dflash2"]
    assert trained_methods() == ("eagle3", "mtp", "dflash", "dspark", "dflash2")
    assert training_free_methods() == ("none", "ngram", "suffix", "schema")
    assert vllm_methods()["deepseek_mtp"] == "mtp"
    assert all(name in method_help() for name in REGISTRY)
    with pytest.raises(ValueError, match="registered already"):
        register(REGISTRY["ngram"])


def test_a_registered_toy_method_runs_lossless_in_the_engine(toy_method):
    model = tiny_decoder("llama", torch.bfloat16)
    prompts = random_prompts(3, 40, seed=5)

    def answers(method: str) -> list[list[int]]:
        engine = Engine(model, make_drafter(method), EngineConfig(5, 512, 3))
        return [r.output_ids for r in engine.generate([Request(p, 30) for p in prompts])]

    assert answers(toy_method) == answers("none")


def test_a_registered_toy_method_generates_and_serves(toy_method, tiny_model_dir, tmp_path, capsys):
    from tests.server.test_server import LiveServer

    messages = tmp_path / "m.json"
    messages.write_text(json.dumps([{"role": "user", "content": "w3 w4 w3 w4 w3"}]))
    ids = {}
    for method in ("none", toy_method):
        assert main(["generate", "--model", str(tiny_model_dir), "--method", method, "--messages-file",
                     str(messages), "--max-tokens", "16", "--json", "--max-seq-len", "512"]) == 0
        ids[method] = json.loads(capsys.readouterr().out)["token_ids"]
    assert ids[toy_method] == ids["none"]
    live = LiveServer(tiny_model_dir, method=toy_method, max_batch=2, max_queue=4)
    try:
        served = live.client.models.list().data[0].id
        reply = live.client.chat.completions.create(model=served, messages=json.loads(messages.read_text()),
                                                    max_tokens=16, temperature=0)
        assert reply.model_extra["specstand"]["token_ids"] == ids["none"]
    finally:
        live.close()
