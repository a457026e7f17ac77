"""The compiled decode/verify forward: as accurate as transformers' bf16 forward, and a row's logits and
hidden states never depend on the other rows of its pass."""

from __future__ import annotations

import copy

import gguf
import pytest
import torch

from specstand import kernels
from specstand.kernels import q8_0
from specstand.models import gguf_blocks
from specstand.runner import PassInput, TargetRunner
from specstand.runner import runner as runner_module
from specstand.runner.compiled import attach_compiled
from specstand.runner.transformer import DecoderModel
from tests.conftest import FAMILIES, KERNEL_PATHS, random_prompts, tiny_decoder, tiny_hf_model
from tests.engine.test_lossless import assert_every_drafter_answers_as_plain_decoding

pytestmark = pytest.mark.skipif(not KERNEL_PATHS, reason="the kernels do not build on this machine")


# head widths: 16 (the tiny twins), 32, 64 (both presets), 128; each takes its own attention code (on amx,
# 16 the AVX-512 path, the others tile products)
HEAD_DIMS = (16, 32, 64, 128)


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_logits_at_least_as_close_to_fp32_as_transformers_bf16(family, path, head_dim):
    hf = tiny_hf_model(family, torch.bfloat16, head_dim=head_dim)
    reference = copy.deepcopy(hf).float()  # the same (bf16-valued) weights, computed in fp32
    model = DecoderModel(hf, 512)
    attach_compiled(model, path)
    assert model.compiled is not None
    ours, theirs = _errors_against(reference, model, hf)
    assert ours <= theirs
    assert ours < 0.05  # and not merely "no worse": the reference's logits span about +-1


def _errors_against(reference, model: DecoderModel, hf) -> tuple[float, float]:
    """Largest logit error against the fp32 `reference` of `model` (decode passes of 6 rows after a 64-token
    prompt) and of the transformers module `hf`, over the same 24 positions."""
    prompt = random_prompts(1, 90, seed=4)[0]
    runner = TargetRunner(model, num_slots=1, capacity=256)
    slot = runner.cache.allocate()
    runner.prefill(slot, prompt[:64])
    ours = torch.cat([runner.run([PassInput(slot, prompt[i : i + 6])], 6)[0].logits for i in range(64, 88, 6)])
    with torch.no_grad():
        exact = reference(torch.tensor([prompt])).logits[0, 64:88].double()
        theirs = hf(torch.tensor([prompt])).logits[0, 64:88].double()
    return float((ours.double() - exact).abs().max()), float((theirs - exact).abs().max())


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("family", FAMILIES)
def test_q8_0_logits_at_least_as_close_to_fp32_as_transformers_bf16_on_the_same_values(family, path):
    """Q8_0 weights: against the fp32 forward of the values the blocks stand for, no further off than
    transformers' bf16 forward of those values."""
    hf = tiny_hf_model(family, torch.bfloat16, head_dim=64)
    model = DecoderModel(hf, 512)
    attach_compiled(model, path, weight_format="q8_0")
    reference = copy.deepcopy(hf).float()
    with torch.no_grad():  # the blocks' values into the reference (HF layout: quantize the original rows)
        for module in reference.modules():
            if isinstance(module, torch.nn.Linear):
                module.weight.copy_(q8_0.dequantize(*q8_0.quantize(module.weight)))
    assert model.compiled.weight_format == "q8_0"
    ours, theirs = _errors_against(reference, model, copy.deepcopy(reference).bfloat16())
    assert ours <= theirs
    assert ours < 0.05
    assert ours < 0.05


@pytest.mark.parametrize("weight_format", ["bf16", "q8_0"])
@pytest.mark.parametrize("head_dim", HEAD_DIMS)
@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_rows_are_bit_identical_whatever_shares_the_pass(family, path, head_dim, weight_format):
    """Three requests at different cache lengths; each row computed alone equals the same row computed in
    passes of every mix of request counts and row counts (1..K+1 rows each)."""
    model = tiny_decoder(family, torch.bfloat16, forward=path, head_dim=head_dim, weight_format=weight_format)
    runner = TargetRunner(model, num_slots=3, capacity=400)
    prompts = [random_prompts(1, n, seed=n)[0] for n in (64, 150, 220)]
    tails = random_prompts(3, 12, seed=9)
    slots = [runner.cache.allocate() for _ in prompts]
    for slot, prompt in zip(slots, prompts, strict=True):
        runner.prefill(slot, prompt)

    def compute(groups: list[list[int]]) -> list[torch.Tensor]:
        """Run the tails in passes: groups[p][i] is how many rows request i adds in pass p."""
        for slot, prompt in zip(slots, prompts, strict=True):
            runner.cache.rollback(slot, len(prompt))
        rows: list[list[torch.Tensor]] = [[] for _ in slots]
        done = [0] * len(slots)
        for counts in groups:
            inputs = [PassInput(slots[i], tails[i][done[i] : done[i] + n]) for i, n in enumerate(counts) if n]
            outputs = runner.run(inputs, max(counts), tap_layers=(1, 2))
            for (i, n), out in zip([(i, n) for i, n in enumerate(counts) if n], outputs, strict=True):
                rows[i].append(torch.cat([out.logits, out.taps[1].float(), out.taps[2].float()], dim=1))
                done[i] += n
        return [torch.cat(r) for r in rows]

    alone = compute([[1 if i == j else 0 for j in range(3)] for _ in range(12) for i in range(3)])
    for groups in ([[6, 1, 3], [6, 11, 9]], [[12, 12, 12]], [[1, 2, 3], [4, 5, 6], [7, 5, 3]]):
        mixed = compute(groups)
        for i in range(3):
            assert torch.equal(mixed[i], alone[i]), (groups, i)


@pytest.mark.parametrize("weight_format", ["bf16", "q8_0"])
@pytest.mark.parametrize("chunk", [512, 48])
@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_prompt_blocks_equal_one_row_at_a_time_where_the_kernels_compute_prompts(path, chunk, weight_format,
                                                                                 monkeypatch):
    """On amx/avx512bf16/avx2 prompts run through the kernels too: a 150-token prompt in passes of `chunk` rows
    (logits from the last one only) leaves the same cache and last logits, to the bit, as feeding it one
    token a pass."""
    monkeypatch.setattr(runner_module, "PROMPT_CHUNK", chunk)
    model = tiny_decoder("qwen2", torch.bfloat16, forward=path, head_dim=64, weight_format=weight_format)
    runner = TargetRunner(model, 2, 256)
    assert runner.compiled_prompts == (path in ("amx", "avx512bf16", "avx2"))
    if not runner.compiled_prompts:
        pytest.skip(f"on {path} torch computes prompt blocks (the Python forward's tests cover them)")
    prompt = random_prompts(1, 150, seed=3)[0]
    blocks, single = runner.cache.allocate(), runner.cache.allocate()
    last = runner.prefill(blocks, prompt, tap_layers=(1,))
    taps = []
    for token in prompt:
        one = runner.run([PassInput(single, [token])], 1, tap_layers=(1,))[0]
        taps.append(one.taps[1])
    assert torch.equal(last.logits, one.logits)
    assert torch.equal(last.taps[1], torch.cat(taps))
    assert torch.equal(runner.cache.keys[:, blocks, :, :150], runner.cache.keys[:, single, :, :150])
    assert torch.equal(runner.cache.values[:, blocks, :, :150], runner.cache.values[:, single, :, :150])


def test_the_compiled_forward_refuses_rows_past_the_cache():
    runner = TargetRunner(tiny_decoder("llama", torch.bfloat16, forward=KERNEL_PATHS[-1]), 1, 128)
    keys = runner.cache.keys
    with pytest.raises(RuntimeError, match="past the cache"):
        runner.compiled.forward([3], [0], [keys.shape[3]], keys, runner.cache.values)
    with pytest.raises(RuntimeError, match="vocabulary"):
        runner.compiled.forward([10_000], [0], [0], keys, runner.cache.values)


def test_the_python_forward_can_be_forced_and_fp32_keeps_it(monkeypatch):
    model = DecoderModel(tiny_hf_model("llama", torch.bfloat16), 512)
    monkeypatch.setenv(kernels.PATH_ENV, "python")
    logged: list[str] = []
    assert attach_compiled(model, kernels.chosen_path()[0], logged.append) is None and model.compiled is None
    assert logged == [] and model.kernel_path == "python"  # asked for: nothing to warn about
    monkeypatch.delenv(kernels.PATH_ENV)
    path = kernels.chosen_path()[0]
    assert attach_compiled(model, path) is not None and TargetRunner(model, 1, 128).compiled is model.compiled
    assert model.kernel_path == path
    fp32 = DecoderModel(tiny_hf_model("llama", torch.float32), 512)
    assert attach_compiled(fp32, path, logged.append) is None and logged == []  # fp32 runs the Python forward


def test_q8_0_without_the_kernels_is_refused_not_run_as_bf16(monkeypatch):
    monkeypatch.setenv(kernels.PATH_ENV, "python")
    model = DecoderModel(tiny_hf_model("llama", torch.bfloat16), 512)
    with pytest.raises(kernels.KernelsUnavailable, match="python"):
        attach_compiled(model, kernels.chosen_path()[0], weight_format="q8_0")
    with pytest.raises(ValueError, match="unknown weight format"):
        attach_compiled(model, KERNEL_PATHS[-1], weight_format="q4")


def test_logits_a_caller_still_holds_are_never_overwritten_by_the_next_pass():
    """The decoder reuses its logits tensor only once nobody holds it or a view of it."""
    runner = TargetRunner(tiny_decoder("llama", torch.bfloat16, forward=KERNEL_PATHS[-1]), 1, 128)
    keys, values = runner.cache.keys, runner.cache.values

    def logits(token: int, position: int) -> torch.Tensor:
        return runner.compiled.forward([token, token + 1], [0, 0], [position, position + 1], keys, values)[0]

    held = logits(3, 0)
    view = logits(5, 2)[1]
    kept = held.clone(), view.clone()
    fresh = logits(7, 4)  # reuses nothing held: both tensors above are still alive
    assert torch.equal(held, kept[0]) and torch.equal(view, kept[1])
    assert not torch.equal(fresh, held)
    del held, view, fresh
    again = [logits(9, 6).clone() for _ in range(2)]  # the buffer is free now: reused, same results
    assert torch.equal(again[0], again[1])


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_a_request_near_the_end_of_its_cache_shares_a_pass_with_a_long_prompt_chunk(path):
    """Compiled passes compute real rows only (no padding to the widest request), so only a request's own
    rows count against its capacity: a decode row a few positions from the end rides beside a 100-row chunk."""
    model = tiny_decoder("llama", torch.bfloat16, forward=path)
    runner = TargetRunner(model, num_slots=2, capacity=256)
    near_end, fresh = runner.cache.allocate(), runner.cache.allocate()
    runner.run([PassInput(near_end, random_prompts(1, 250, seed=5)[0])], 250)
    outputs = runner.run([PassInput(near_end, [3, 4]), PassInput(fresh, random_prompts(1, 100, seed=6)[0], "last")],
                         100)
    assert [len(o.logits) for o in outputs] == [2, 1]
    assert runner.cache.lengths[near_end] == 252 and runner.cache.lengths[fresh] == 100


@pytest.mark.parametrize("path", KERNEL_PATHS)
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_published_q8_0_blocks_run_as_given(family, path):
    """A GGUF's own blocks (Q5_0 here: negative scales, 5-bit integers), by transformers name: the compiled
    rows use them, the Python forward holds the values they stand for, and drafting stays lossless."""
    hf = tiny_hf_model(family, torch.bfloat16)
    published = {}
    for name, parameter in hf.named_parameters():
        if parameter.dim() == 2 and "embed" not in name:
            raw = gguf.quants.quantize(parameter.detach().float().numpy(), gguf.GGMLQuantizationType.Q5_0)
            published[name] = gguf_blocks.integer_blocks(raw, "Q5_0", parameter.shape[1])
    model = DecoderModel(hf, 512)
    attach_compiled(model, path, weight_format="q8_0", published=published)
    head = q8_0.dequantize(*published["lm_head.weight"])
    assert torch.equal(model.weights.lm_head, head.bfloat16())
    down = q8_0.dequantize(*published["model.layers.1.mlp.down_proj.weight"])
    assert torch.equal(model.weights.layers[1].down, down.bfloat16())
    assert_every_drafter_answers_as_plain_decoding(model, random_prompts(4, 40, seed=8))
    with pytest.raises(ValueError, match="lack"):
        attach_compiled(DecoderModel(tiny_hf_model(family, torch.bfloat16), 512), path, weight_format="q8_0",
                        published={"lm_head.weight": published["lm_head.weight"]})


@pytest.mark.parametrize("path", KERNEL_PATHS)
def test_the_mlp_runs_fused_on_amx_with_bf16_weights_only(path):
    """Which forward takes the fused gate/up + SiLU kernel (tested bit for bit against the unfused one in
    tests/kernels/test_fused_mlp.py): every layer on amx with bf16 weights, no layer elsewhere or on q8_0."""
    for weight_format in ("bf16", "q8_0"):
        model = DecoderModel(tiny_hf_model("llama", torch.bfloat16), 512)  # intermediate 128: the kernel takes it
        compiled = attach_compiled(model, path, weight_format=weight_format)
        expected = model.shape.num_layers if path == "amx" and weight_format == "bf16" else 0
        assert compiled.fused_mlp_layers == expected
