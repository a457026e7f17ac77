from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from specstand.drafters import make_drafter
from specstand.drafters.trained import DrafterLoadError, read_drafter
from specstand.engine import DecodeStats, Engine, EngineConfig, Request
from specstand.interop.speculators import export_speculators, import_dflash_zlab, import_speculators
from specstand.training.config import TrainConfig
from specstand.training.data import load_rows
from specstand.training.trainer import train
from tests.conftest import LONG_RUN


@pytest.fixture(scope="module")
def drafters(tiny_target, tiny_data, tmp_path_factory) -> dict[str, Path]:
    folders = {}
    for method in ("eagle3", "dflash", "dspark", "dflash2", "mtp"):
        folders[method] = tmp_path_factory.mktemp(method)
        train(TrainConfig(method, [str(tiny_data)], str(folders[method]), steps=3, pack_tokens=256,
                          draft_vocab_size=48), tiny_target, log=lambda _: None)
    return folders


@pytest.mark.parametrize("method", ["eagle3", "dflash", "dspark", "dflash2"])
def test_export_import_round_trip_is_bit_exact(method, drafters, tiny_target, tmp_path):
    exported = tmp_path / "speculators"
    export_speculators(drafters[method], tiny_target, exported)
    config = json.loads((exported / "config.json").read_text())
    assert config["speculators_model_type"] == method
    proposal = config["speculators_config"]["proposal_methods"][0]
    assert proposal["proposal_type"] == "greedy" and proposal["speculative_tokens"] >= 1
    # never a path of this machine: a local verifier folder goes by its name
    assert config["speculators_config"]["verifier"]["name_or_path"] == Path(tiny_target.path).name
    assert str(Path(tiny_target.path).parent) not in (exported / "config.json").read_text()
    assert config["draft_vocab_size"] == 48
    tensors = load_file(exported / "model.safetensors")
    spec, original = read_drafter(drafters[method])
    d2t = original["d2t"]
    assert torch.equal(tensors["d2t"] + torch.arange(48), d2t)  # offsets, as speculators stores them
    assert tensors["t2d"].dtype == torch.bool and int(tensors["t2d"].sum()) == 48
    assert tensors["lm_head.weight"].shape == (48, spec.hidden_size)
    vocab = spec.target_vocab_size
    if method == "dspark":
        assert config["sample_from_anchor"] is True and proposal["speculative_tokens"] == spec.block_size
        assert config["markov_rank"] == spec.markov_rank and config["enable_confidence_head"] is True
        assert tensors["markov_head.markov_w1.weight"].shape == (vocab, spec.markov_rank)  # by verifier id
        assert tensors["markov_head.markov_w2.weight"].shape == (48, spec.markov_rank)
        assert tensors["confidence_head.proj.weight"].shape == (1, spec.hidden_size + spec.markov_rank)
    if method == "dflash2":
        nested = config["dflash_config"]
        assert nested["conv_kernel_size"] == config["conv_kernel_size"] == 2
        assert nested["selector_top_k"] == 16 and nested["target_layer_ids"] == [t - 1 for t in spec.tap_layers]
        for name in ("predecessor_codebook", "successor_codebook"):
            assert tensors[f"candidate_selector.{name}"].shape == (vocab, spec.selector_rank)
        assert tensors["layers.0.attention_conv.base_kernel"].shape == (2, 2, spec.hidden_size)
        assert tensors["layers.1.mlp_conv.kernel_projection.weight"].shape == (2 * 2 * spec.hidden_size // 16,
                                                                                spec.hidden_size)
    if method != "eagle3":
        assert config["block_size"] == spec.block_size and config["mask_token_id"] == spec.mask_token_id
        assert config["aux_hidden_state_layer_ids"] == [t - 1 for t in spec.tap_layers]
    else:
        assert "layers.0.hidden_norm.weight" in tensors
        assert config["eagle_aux_hidden_state_layer_ids"] == spec.tap_layers

    back = tmp_path / "back"
    import_speculators(exported, back)
    spec_back, restored = read_drafter(back)
    # the target (and the model card's data target) go by their folder's name, never a path of this machine
    assert replace(spec_back, target=spec.target, trained=spec.trained) == spec
    assert spec_back.target == Path(spec.target).name
    assert spec_back.trained == {**spec.trained, "data": {**spec.trained["data"], "model": Path(spec.target).name}}
    assert restored.keys() == original.keys()
    for name in original:
        assert torch.equal(restored[name], original[name]), name


@pytest.mark.parametrize("method", ["dspark", "dflash2"])
def test_import_of_a_checkpoint_made_elsewhere_reads_the_method_fields(method, drafters, tiny_target, tmp_path):
    """Without our own spec in the config (as speculators writes it), the flat/nested fields and the
    verifier-vocabulary tables still give back the same drafter."""
    exported = tmp_path / "speculators"
    export_speculators(drafters[method], tiny_target, exported)
    config = json.loads((exported / "config.json").read_text())
    del config["specstand_spec"]
    if method == "dflash2":  # vLLM/SGLang's nested form alone
        for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k", "block_size"):
            del config[name]
    (exported / "config.json").write_text(json.dumps(config))
    back = tmp_path / "back"
    spec_back = import_speculators(exported, back)
    spec, original = read_drafter(drafters[method])
    for name in ("block_size", "mask_token_id", "tap_layers", "sample_from_anchor", "markov_rank",
                 "enable_confidence_head", "conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        assert getattr(spec_back, name) == getattr(spec, name), name
    restored = read_drafter(back)[1]
    for name in original:
        assert torch.equal(restored[name], original[name]), name


def _tau(folder: Path, target, data: Path) -> float:
    _, rows = load_rows(data)
    requests = [Request(r.prompt_ids, 40) for r in rows if r.split == "train"]
    drafter = make_drafter(read_drafter(folder)[0].method, target.decoder, drafter_path=folder)
    stats = DecodeStats()
    for result in Engine(target.decoder, drafter, EngineConfig(8, 512, 2, adaptive=False)).generate(requests):
        stats.merge(result.stats)
    return stats.tau


@pytest.mark.parametrize("method", ["dspark", "dflash"])
def test_import_follows_the_checkpoints_block_layout(method, trained, tiny_target, tiny_data, tmp_path):
    """DSpark exports say sample_from_anchor=true (the anchor row drafts first), DFlash ones false; the
    import honours the flag both ways: read right, the drafter drafts exactly as before; read one slot
    off, it drafts differently, and DFlash (no Markov head to lean on) gets few drafts right."""
    original = trained[method, LONG_RUN]
    exported = tmp_path / "speculators"
    export_speculators(original, tiny_target, exported)
    config = json.loads((exported / "config.json").read_text())
    assert config["sample_from_anchor"] is (method == "dspark")
    taus = {}
    for flag in (True, False):
        config["sample_from_anchor"] = flag
        (exported / "config.json").write_text(json.dumps(config))
        back = tmp_path / f"back-{flag}"
        assert import_speculators(exported, back).sample_from_anchor is flag
        taus[flag] = _tau(back, tiny_target, tiny_data)
    right, shifted = taus[method == "dspark"], taus[method != "dspark"]
    assert right == _tau(original, tiny_target, tiny_data) > 2.0 and shifted != right, taus
    if method == "dflash":
        assert shifted < 0.6 * right, taus


def test_export_refuses_a_format_that_does_not_exist(drafters, tiny_target, tmp_path):
    with pytest.raises(DrafterLoadError, match="no format"):
        export_speculators(drafters["mtp"], tiny_target, tmp_path / "x")


def test_import_of_a_zlab_dflash_checkpoint_drafts_like_the_original(tiny_target, tiny_data, tmp_path):
    """A z-lab-style folder (Qwen3-like layer config + dflash_config, full vocabulary, no head) written from
    a drafter trained here with the full vocabulary; imported, it must draft the same tokens."""
    full = tmp_path / "full"
    train(TrainConfig("dflash", [str(tiny_data)], str(full), steps=3, pack_tokens=256, draft_vocab_size=10_000),
          tiny_target, log=lambda _: None)
    spec, tensors = read_drafter(full)
    assert spec.draft_vocab_size == spec.target_vocab_size
    zlab = tmp_path / "zlab"
    zlab.mkdir()
    save_file({k: v for k, v in tensors.items() if k != "d2t"}, str(zlab / "model.safetensors"))
    (zlab / "config.json").write_text(json.dumps({
        "architectures": ["DFlashDraftModel"], "model_type": "llama", "hidden_size": spec.hidden_size,
        "intermediate_size": spec.intermediate_size, "num_attention_heads": spec.num_heads,
        "num_key_value_heads": spec.num_kv_heads, "head_dim": spec.head_dim, "num_hidden_layers": spec.num_layers,
        "rms_norm_eps": spec.rms_eps, "rope_theta": spec.rope_theta, "vocab_size": spec.target_vocab_size,
        "block_size": spec.block_size,
        "dflash_config": {"target_layer_ids": [t - 1 for t in spec.tap_layers], "mask_token_id": spec.mask_token_id},
    }))
    imported = tmp_path / "imported"
    import_dflash_zlab(zlab, imported, target=tiny_target.name)
    _, rows = load_rows(tiny_data)
    requests = [Request(r.prompt_ids, 24) for r in rows[:4]]
    outputs = []
    for folder in (full, imported):
        drafter = make_drafter("dflash", tiny_target.decoder, drafter_path=folder)
        results = Engine(tiny_target.decoder, drafter, EngineConfig(7, 512, 1, adaptive=False)).generate(requests)
        outputs.append([(r.output_ids, r.stats.accepted_per_position) for r in results])
    assert outputs[0] == outputs[1]


def test_import_rejects_other_folders(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"speculators_model_type": "medusa"}))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(DrafterLoadError, match="medusa"):
        import_speculators(tmp_path, tmp_path / "out")
    with pytest.raises(DrafterLoadError, match="dflash_config"):
        import_dflash_zlab(tmp_path, tmp_path / "out")


@pytest.mark.parametrize(("field", "value", "named"), [
    ("num_attention_heads", 0, "num_heads"), ("hidden_size", -8, "hidden_size"),
    ("num_key_value_heads", 3, "num_kv_heads"), ("rope_theta", -1.0, "rope_theta"),
])
def test_import_range_checks_the_config(field, value, named, drafters, tiny_target, tmp_path):
    exported = tmp_path / "speculators"
    export_speculators(drafters["eagle3"], tiny_target, exported)
    config = json.loads((exported / "config.json").read_text())
    del config["specstand_spec"]  # as a checkpoint made elsewhere
    config["transformer_layer_config"][field] = value
    (exported / "config.json").write_text(json.dumps(config))
    with pytest.raises(DrafterLoadError, match=named):
        import_speculators(exported, tmp_path / "back")
    assert not (tmp_path / "back").exists()


def test_import_refuses_a_d2t_that_maps_two_draft_ids_to_one_target_id(drafters, tiny_target, tmp_path):
    """Sampled drafts scatter q by d2t: a repeated target id would be one token drawn under two columns."""
    exported = tmp_path / "speculators"
    export_speculators(drafters["eagle3"], tiny_target, exported)
    tensors = load_file(exported / "model.safetensors")
    target_ids = tensors["d2t"] + torch.arange(len(tensors["d2t"]))
    target_ids[1] = target_ids[0]
    tensors["d2t"] = target_ids - torch.arange(len(target_ids))  # stored as offsets
    save_file(tensors, str(exported / "model.safetensors"))
    with pytest.raises(DrafterLoadError, match="two draft ids to one target id"):
        import_speculators(exported, tmp_path / "back")


@pytest.mark.parametrize(("change", "named"), [
    (lambda config: [1], "holds a list, not a JSON object"),
    (lambda config: {**config, "specstand_spec": {**config["specstand_spec"], "colour": 1}}, "colour"),
    (lambda config: {k: v for k, v in config.items() if k not in ("specstand_spec", "draft_vocab_size")},
     "has no 'draft_vocab_size'"),
    (lambda config: {**{k: v for k, v in config.items() if k != "specstand_spec"}, "transformer_layer_config": 3},
     "not a drafter config this reads"),
])
def test_import_names_what_is_wrong_with_a_config(change, named, drafters, tiny_target, tmp_path):
    exported = tmp_path / "speculators"
    export_speculators(drafters["dflash"], tiny_target, exported)
    (exported / "config.json").write_text(json.dumps(change(json.loads((exported / "config.json").read_text()))))
    with pytest.raises(DrafterLoadError, match=named):
        import_speculators(exported, tmp_path / "back")
    assert not (tmp_path / "back").exists()
