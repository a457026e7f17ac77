from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from specstand.drafters import make_drafter
from specstand.drafters.registry import trained_methods
from specstand.drafters.trained import load_drafter_model, read_spec, trained_parts
from specstand.engine import DecodeStats, Engine, EngineConfig, Request
from specstand.training.config import TrainConfig
from specstand.training.data import load_rows, subset_turn
from specstand.training.features import TargetFeatures, pack_rows
from specstand.training.losses import dflash_loss, dpace_weights, dspark_loss, target_to_draft
from specstand.training.objectives import BLOCK_OBJECTIVES, chain_objective
from specstand.training.trainer import TRAINER_STATE, train, training_figure
from specstand.verification import SamplingParams
from tests.conftest import FORWARDS, LONG_RUN, tiny_decoder


def _loss(folder: Path, target, data: Path) -> float:
    model = load_drafter_model(folder, target.decoder.weights.embed_tokens, target.decoder.weights.lm_head)
    _, rows = load_rows(data)
    features = TargetFeatures(target.decoder, model.spec.tap_layers, 512)
    pack = pack_rows([features(r.prompt_ids, r.response_ids) for r in rows if r.split == "train"],
                     model.spec.tap_layers)
    t2d = target_to_draft(model.d2t, model.spec.target_vocab_size)
    config = TrainConfig(model.spec.method, [str(data)], "unused", anchors=512)
    with torch.no_grad():
        if model.spec.method in BLOCK_OBJECTIVES:
            generator = torch.Generator().manual_seed(0)
            running_q = torch.zeros(model.num_drafts)
            return BLOCK_OBJECTIVES[model.spec.method](model, pack, t2d, config, generator, running_q)[0].item()
        return chain_objective(model, pack, t2d, config, soft=model.spec.method == "eagle3")[0].item()


@pytest.mark.parametrize("method", list(trained_methods()))
def test_loss_falls(method, trained, tiny_target, tiny_data):
    before = _loss(trained[method, 1], tiny_target, tiny_data)
    after = _loss(trained[method, LONG_RUN], tiny_target, tiny_data)
    assert after < 0.75 * before, (before, after)


@pytest.mark.parametrize("method", sorted(BLOCK_OBJECTIVES))
def test_a_pack_without_an_anchor_teaches_a_block_drafter_nothing(method, trained, tiny_target, tiny_data):
    """Rows whose answers are one token each hold no block to draft: a zero loss that still reaches every
    trained parameter (ranks all-reduce them all), not a crash."""
    model = load_drafter_model(trained[method, 1], tiny_target.decoder.weights.embed_tokens,
                               tiny_target.decoder.weights.lm_head)
    _, rows = load_rows(tiny_data)
    features = TargetFeatures(tiny_target.decoder, model.spec.tap_layers, 512)
    pack = pack_rows([features(r.prompt_ids, r.response_ids[:1]) for r in rows if r.split == "train"][:3],
                     model.spec.tap_layers)
    t2d = target_to_draft(model.d2t, model.spec.target_vocab_size)
    config = TrainConfig(method, [str(tiny_data)], "unused")
    loss, q, accepted = BLOCK_OBJECTIVES[method](model, pack, t2d, config, torch.Generator().manual_seed(0),
                                                 torch.zeros(model.num_drafts))
    loss.backward()
    assert loss.item() == 0 and torch.isnan(q).all() and not accepted.any()
    trained_parameters = [p for p in model.parameters() if p.requires_grad]
    assert trained_parameters and all(p.grad is not None and not p.grad.any() for p in trained_parameters)


@pytest.mark.parametrize("lengths", [(1, 1), (1, 3), (3, 1)])
@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_chain_drafters_train_on_rows_shorter_than_their_chains(method, lengths, trained, tiny_target, tiny_data):
    """Short rows leave a chain's later steps (or every step) nothing to score: those steps are skipped, not
    a crash, and a pack with nothing at all gives a zero loss that still reaches every trained parameter, or
    the other ranks would wait for this one's gradients."""
    model = load_drafter_model(trained[method, 1], tiny_target.decoder.weights.embed_tokens,
                               tiny_target.decoder.weights.lm_head)
    _, rows = load_rows(tiny_data)
    features = TargetFeatures(tiny_target.decoder, model.spec.tap_layers, 512)
    prompt, answer = lengths
    pack = pack_rows([features(rows[0].prompt_ids[:prompt], rows[0].response_ids[:answer])], model.spec.tap_layers)
    config = TrainConfig(method, [str(tiny_data)], "unused")
    loss, _ = chain_objective(model, pack, target_to_draft(model.d2t, model.spec.target_vocab_size), config,
                              soft=method == "eagle3")
    loss.backward()
    assert torch.isfinite(loss) and (loss.item() == 0) == (lengths == (1, 1))
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def _requests(data: Path, target) -> list[Request]:
    _, rows = load_rows(data)
    return [Request(r.prompt_ids, 40, SamplingParams(), target.stop_token_ids) for r in rows if r.split == "train"]


@pytest.mark.parametrize("method", list(trained_methods()))
def test_copying_a_deterministic_target_reaches_high_acceptance(method, trained, tiny_target, tiny_data):
    drafter = make_drafter(method, tiny_target.decoder, drafter_path=trained[method, LONG_RUN])
    engine = Engine(tiny_target.decoder, drafter, EngineConfig(5, 512, 2, adaptive=False))
    stats = DecodeStats()
    for result in engine.generate(_requests(tiny_data, tiny_target)):
        stats.merge(result.stats)
    # an untrained drafter is accepted ~1/64 of the time here (64 draft ids); the greedy choices of a
    # random target hinge on small logit gaps, so "high" is set well above chance, not near 1
    assert stats.acceptance_per_position[0] > 0.6 and stats.tau > 2.0, (stats.acceptance_per_position, stats.tau)


@pytest.mark.parametrize(("dtype", "forward"), [(torch.float32, "python")] + [(torch.bfloat16, f) for f in FORWARDS])
@pytest.mark.parametrize("method", list(trained_methods()))
def test_engine_is_token_identical_with_trained_drafters(method, dtype, forward, trained, tiny_target, tiny_data):
    decoder = tiny_decoder("llama", dtype, 512, forward)  # the same weights as the saved tiny model
    requests = _requests(tiny_data, tiny_target)
    plain = Engine(decoder, None, EngineConfig(5, 512, 3, adaptive=False)).generate(requests)
    for steps in (1, LONG_RUN):  # a poor and a good drafter
        drafter = make_drafter(method, decoder, drafter_path=trained[method, steps])
        drafted = Engine(decoder, drafter, EngineConfig(5, 512, 3, adaptive=False)).generate(requests)
        assert [r.output_ids for r in drafted] == [r.output_ids for r in plain]
        # adaptive verification cuts drafts, never answers
        drafter = make_drafter(method, decoder, drafter_path=trained[method, steps])
        adaptive = Engine(decoder, drafter, EngineConfig(5, 512, 3, adaptive=True)).generate(requests)
        assert [r.output_ids for r in adaptive] == [r.output_ids for r in plain]


def test_dpace_weights_match_a_hand_computed_example():
    # q = (0.8, 0.6, 0.4), alpha 0.5 -> a = (0.9, 0.8, 0.7); survival (0.9, 0.72, 0.504);
    # weight_j = sum_{k>=j} survival_k = (2.124, 1.224, 0.504); mean 1.284
    weights = dpace_weights(torch.tensor([0.8, 0.6, 0.4]), alpha=0.5)
    expected = torch.tensor([2.124, 1.224, 0.504]) / 1.284
    torch.testing.assert_close(weights, expected)
    assert weights[0] > weights[1] > weights[2]


def test_accuracy_per_position_is_unknown_where_no_block_reaches_it():
    """D-PACE's running accuracy skips NaN; an accuracy of 0 where there was no data would drag it down."""
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 3, 10, generator=generator)
    labels = torch.randint(0, 10, (4, 3), generator=generator)
    valid = torch.tensor([[True, True, False]] * 4)
    target_probs = torch.softmax(torch.randn(4, 3, 10, generator=generator), -1)
    for q in (dflash_loss(logits, labels, valid, torch.ones(3))[1],
              dspark_loss(logits, target_probs, labels, valid, torch.ones(3), None)[1]):
        assert (q[:2] > 0).all() and torch.isnan(q[2])


def _train_cli(data: Path, out: Path, model_dir: Path, steps: int) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "specstand.cli", "train", "--method", "dflash", "--model", str(model_dir),
         "--dtype", "fp32", "--data", str(data), "--out", str(out), "--steps", str(steps), "--save-every", "5",
         "--pack-tokens", "256", "--draft-vocab", "64"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )


def test_a_killed_training_run_resumes_to_the_same_weights(tiny_data, tiny_model_dir, tmp_path):
    straight, interrupted = tmp_path / "straight", tmp_path / "interrupted"
    uninterrupted = _train_cli(tiny_data, straight, tiny_model_dir, 30)  # beside the other: two cores, two runs
    process = _train_cli(tiny_data, interrupted, tiny_model_dir, 30)
    deadline = time.time() + 300
    while time.time() < deadline:  # kill it once a mid-run checkpoint exists
        state = interrupted / TRAINER_STATE
        if state.is_file() and torch.load(state, weights_only=True)["step"] >= 10:
            break
        time.sleep(0.05)
    process.kill()
    process.wait()
    straight_output = uninterrupted.communicate(timeout=300)[0]
    assert uninterrupted.returncode == 0, straight_output
    step = torch.load(interrupted / TRAINER_STATE, weights_only=True)["step"]
    assert 10 <= step < 30
    resumed = _train_cli(tiny_data, interrupted, tiny_model_dir, 30)
    output = resumed.communicate(timeout=300)[0]
    assert resumed.returncode == 0, output
    assert f"resuming dflash from step {step}" in output
    a, b = load_file(straight / "model.safetensors"), load_file(interrupted / "model.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


class _Exploit:
    """Unpickling this would run code; a weights-only load refuses it."""

    def __reduce__(self):
        return (print, ("this ran while loading",))


def test_resume_refuses_a_changed_config_and_unsafe_state(tiny_target, tiny_data, tmp_path):
    def config(**changes):
        settings = {"steps": 2, "pack_tokens": 256, "draft_vocab_size": 64, **changes}
        return TrainConfig("mtp", [str(tiny_data)], str(tmp_path), **settings)

    train(config(), tiny_target, log=lambda _: None)
    assert (tmp_path / "model.safetensors").is_file() and (tmp_path / TRAINER_STATE).is_file()
    with pytest.raises(ValueError, match="lr=0.001, not 0.002"):
        train(config(steps=3, lr=2e-3), tiny_target, log=lambda _: None)
    train(config(steps=3, save_every=1), tiny_target, log=lambda _: None)  # longer and saved more often: fine
    assert torch.load(tmp_path / TRAINER_STATE, weights_only=True)["step"] == 3
    state = torch.load(tmp_path / TRAINER_STATE, weights_only=True)
    renamed = dict(state["model"])
    name = next(k for k in renamed if k != "d2t")
    renamed["old." + name] = renamed.pop(name)  # as a version that named a layer otherwise would have saved it
    torch.save({**state, "model": renamed}, tmp_path / TRAINER_STATE)
    with pytest.raises(ValueError, match="do not match this drafter"):
        train(config(steps=4), tiny_target, log=lambda _: None)
    torch.save({**state, "data_digest": "0" * 64}, tmp_path / TRAINER_STATE)  # the data written again since
    with pytest.raises(ValueError, match="other rows than"):
        train(config(steps=4), tiny_target, log=lambda _: None)
    torch.save({"step": 1, "config": {}, "payload": _Exploit()}, tmp_path / TRAINER_STATE)
    with pytest.raises(ValueError, match="cannot resume from"):
        train(config(steps=4), tiny_target, log=lambda _: None)


def test_a_data_fraction_trains_on_its_subset_of_the_turns(tiny_target, tiny_data, tmp_path):
    _, rows = load_rows(tiny_data)
    wanted = sum(r.split == "train" and bool(r.response_ids) and subset_turn(r.turn_id, 0.5) for r in rows)
    assert 0 < wanted < sum(r.split == "train" for r in rows)
    train(TrainConfig("mtp", [str(tiny_data)], str(tmp_path), steps=1, pack_tokens=256, draft_vocab_size=64,
                      data_fraction=0.5), tiny_target, log=lambda _: None)
    assert read_spec(tmp_path).trained["train_rows"] == wanted
    with pytest.raises(ValueError, match="not in"):
        TrainConfig("mtp", [str(tiny_data)], str(tmp_path), data_fraction=0.0)


def test_trainings_sharing_the_target_features_each_train_on_their_own_rows(tiny_target, tiny_data, tmp_path):
    """One features object, a half-data run first: the full run then gets the same weights as with features of
    its own (features are looked up by the row's tokens, not by its place in a run's list of rows)."""
    def run(out: str, fraction: float, features: TargetFeatures | None = None) -> dict:
        config = TrainConfig("dflash", [str(tiny_data)], str(tmp_path / out), steps=3, pack_tokens=128,
                             draft_vocab_size=64, data_fraction=fraction)
        return train(config, tiny_target, log=lambda _: None, features=features).state_dict()

    taps = trained_parts("dflash").tap_layers(tiny_target.decoder.shape.num_layers, 5)
    shared = TargetFeatures(tiny_target.decoder, taps, 512)
    run("half", 0.5, shared)
    alone, after_half = run("alone", 1.0), run("shared", 1.0, shared)
    assert all(torch.equal(alone[name], after_half[name]) for name in alone)


@pytest.fixture(scope="module")
def family_drafters(tiny_target, tmp_path_factory) -> dict[tuple[str, str], Path]:
    """Each trained method, briefly trained on the Qwen2 (q/k/v biases) and Qwen3 (q/k norms) twins (with
    the Llama twin's word-level tokenizer: the same 96 ids)."""
    from dataclasses import replace

    from specstand.runner.transformer import DecoderModel
    from specstand.training.data import generate_rows, save_rows
    from tests.conftest import save_tiny_model, tiny_hf_model, tiny_turns

    folders = {}
    for family in ("qwen2", "qwen3"):
        folder = save_tiny_model(tmp_path_factory.mktemp(f"tiny-{family}"), family)  # its config.json
        target = replace(tiny_target, name=str(folder), path=str(folder),
                         decoder=DecoderModel(tiny_hf_model(family), 512))
        data = tmp_path_factory.mktemp(f"data-{family}")
        save_rows(data, generate_rows(target, tiny_turns(), 0.2, SamplingParams(), 4, 512), {"model": family})
        for method in trained_methods():
            out = tmp_path_factory.mktemp(f"{family}-{method}")
            train(TrainConfig(method, [str(data)], str(out), steps=8, pack_tokens=256, lr=3e-3, draft_vocab_size=64),
                  target, log=lambda _: None)
            folders[family, method] = out
    return folders


@pytest.mark.parametrize("forward", [FORWARDS[0], FORWARDS[-1]])  # the Python forward and the best kernels
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_trained_drafters_are_lossless_on_every_family_over_shared_heads(family, forward, family_drafters):
    """Batch 3, prompts of three prefill blocks sharing the first two (reused from the cache)."""
    from tests.conftest import random_prompts

    decoder = tiny_decoder(family, torch.float32 if forward == "python" else torch.bfloat16, 512, forward)
    head = random_prompts(1, 150, seed=40)[0]
    requests = [Request(head + tail, 32) for tail in random_prompts(5, 20, seed=41)]
    plain = [Engine(decoder, None, EngineConfig(5, 512, 1)).generate([r])[0].output_ids for r in requests]
    for method in trained_methods():
        drafter = make_drafter(method, decoder, drafter_path=family_drafters[family, method])
        drafted = Engine(decoder, drafter, EngineConfig(5, 512, 3, adaptive=False)).generate(requests)
        assert [r.output_ids for r in drafted] == plain, method
        assert sum(r.stats.cached_prompt_tokens for r in drafted) >= 4 * 128
        assert sum(r.stats.passes_with_draft for r in drafted) > 0, method


@pytest.mark.parametrize("family", ["gemma3", "lfm2", "qwen3_5"])
def test_drafters_train_on_hybrid_targets_and_stay_lossless(family, tiny_target, tmp_path):
    """Taps of sliding-window, short-convolution and delta-rule layers feed training as any layer's do:
    a block drafter (taps of several layers) and EAGLE-3, briefly trained on a hybrid twin's own answers,
    draft on it with every answer token-identical to plain decoding."""
    from dataclasses import replace

    from specstand.training.data import generate_rows, save_rows
    from tests.conftest import random_prompts, save_tiny_model, tiny_hybrid, tiny_turns

    folder = save_tiny_model(tmp_path / f"tiny-{family}", family)
    decoder = tiny_hybrid(family)
    target = replace(tiny_target, name=str(folder), path=str(folder), decoder=decoder)
    data = tmp_path / "data"
    save_rows(data, generate_rows(target, tiny_turns(8), 0.25, SamplingParams(), 4, 512), {"model": family})
    requests = [Request(p, 32) for p in random_prompts(4, 40, seed=42)]
    plain = [r.output_ids for r in Engine(decoder, None, EngineConfig(5, 512, 1)).generate(requests)]
    for method in ("dflash", "eagle3"):
        out = tmp_path / method
        train(TrainConfig(method, [str(data)], str(out), steps=8, pack_tokens=256, lr=3e-3, draft_vocab_size=64),
              target, log=lambda _: None)
        drafter = make_drafter(method, decoder, drafter_path=out)
        drafted = Engine(decoder, drafter, EngineConfig(5, 512, 2, adaptive=False)).generate(requests)
        assert [r.output_ids for r in drafted] == plain, method
        assert sum(r.stats.passes_with_draft for r in drafted) > 0, method


def test_the_training_plot_shows_every_draft_position():
    """A 7-step drafter's plot drew positions 0-3 only: its deep positions, where it differs, were missing."""
    import matplotlib.pyplot as plt

    entries = [{"step": step, "loss": 1.0 / step, "accepted": [0.9 - 0.1 * i for i in range(7)]} for step in (1, 2)]
    fig = training_figure(entries)
    acceptance = fig.axes[1]
    assert [line.get_label() for line in acceptance.get_lines()] == [f"position {i}" for i in range(7)]
    assert list(acceptance.get_lines()[6].get_ydata()) == pytest.approx([0.3, 0.3])
    plt.close(fig)
