import pytest
import torch

from specstand.runner import PassInput, TargetRunner
from specstand.runner.transformer import DecoderModel, linear
from tests.conftest import FAMILIES, tiny_hf_model


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_and_hidden_states_match_transformers(family):
    hf = tiny_hf_model(family)
    runner = TargetRunner(DecoderModel(hf, 512), num_slots=1, capacity=256)
    ids = torch.randint(96, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        reference = hf(ids, output_hidden_states=True)
    slot = runner.cache.allocate()
    taps = (0, 1, 2)
    out = runner.run([PassInput(slot, ids[0].tolist())], ids.shape[1], tap_layers=taps)[0]
    torch.testing.assert_close(out.logits, reference.logits[0].float(), atol=2e-5, rtol=1e-4)
    for layer in taps:
        torch.testing.assert_close(out.taps[layer], reference.hidden_states[layer][0], atol=2e-5, rtol=1e-4)


def test_decode_one_token_at_a_time_matches_full_prefill():
    hf = tiny_hf_model("llama")
    runner = TargetRunner(DecoderModel(hf, 512), num_slots=1, capacity=256)
    ids = torch.randint(96, (30,), generator=torch.Generator().manual_seed(2)).tolist()
    slot = runner.cache.allocate()
    full = runner.run([PassInput(slot, ids)], len(ids))[0].logits
    runner.cache.rollback(slot, 10)
    steps = [runner.run([PassInput(slot, [t])], 1)[0].logits[0] for t in ids[10:]]
    torch.testing.assert_close(torch.stack(steps), full[10:], atol=2e-5, rtol=1e-4)


def test_rejects_unsupported_architecture():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ValueError, match="not supported"):
        DecoderModel(model, 64)


@pytest.mark.parametrize("fp32_prefill", [False, True])
def test_prefill_returns_last_logits_and_all_taps(fp32_prefill):
    hf = tiny_hf_model("qwen3", torch.bfloat16)
    runner = TargetRunner(DecoderModel(hf, 512, fp32_prefill=fp32_prefill), num_slots=1, capacity=256)
    ids = torch.randint(96, (1, 33), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        reference = hf(ids, output_hidden_states=True)
    out = runner.prefill(runner.cache.allocate(), ids[0].tolist(), tap_layers=(1,))
    assert out.logits.shape == (1, 96) and out.taps[1].shape == (33, 64)
    torch.testing.assert_close(out.logits, reference.logits[0, -1:].float(), atol=0.05, rtol=0.05)


@pytest.mark.parametrize(("out_features", "in_features"), [(64, 64), (896, 4864)])  # torch varies on both (Zen 4)
def test_bf16_rows_computed_alone_do_not_depend_on_the_row_count(out_features, in_features):
    """torch's bf16 GEMM may round row i differently with M rows than with 1 (rarely: the bf16 rounding
    hides its fp32 accumulation order); `linear(rows_alone=True)` gives every row its 1-row result."""
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.1).bfloat16()
    x = torch.randn(256 if out_features < 256 else 32, in_features, generator=generator).bfloat16()
    alone = torch.cat([torch.nn.functional.linear(row, weight) for row in x.split(1)])
    for rows in (2, 3, 5, 8, 16, 32):
        together = torch.cat([linear(x[i : i + rows][None], weight, rows_alone=True)[0]
                              for i in range(0, len(x), rows)])
        assert torch.equal(together, alone), rows
