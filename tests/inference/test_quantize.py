"""Weight-only int8: the rows' scales, each kernel against the computation it stands for, a GPT
quantized whole, and what is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import plainformer as pf
from plainformer.inference import quantize as quantize_module
from plainformer.inference.quantize import Int8Linear, quantize_rows
from tests.reference.tiny_models import GPT_VARIANTS_49, moved_off_start

FBGEMM = "fbgemm" in torch.backends.quantized.supported_engines


def _linear(d_in: int = 48, d_out: int = 40, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(d_in, d_out)


def test_each_row_is_scaled_by_its_largest_weight_and_rounded_to_the_nearest_step():
    weight = _linear().weight.detach()
    weight[3] = 0.0  # an all-zero row
    q, scale = quantize_rows(weight)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127 and scale.shape == (40,)
    assert torch.equal(scale[3], torch.tensor(1.0)) and not q[3].any()
    torch.testing.assert_close(scale[0], weight[0].abs().max() / 127)
    assert ((q.float() * scale[:, None] - weight).abs() <= scale[:, None] / 2 + 1e-7).all()


def test_the_dequant_kernel_is_x_times_q_s_transposed_plus_b_in_float64():
    linear = _linear()
    layer = Int8Linear(linear, "dequant")
    x = torch.randn(3, 5, 48)
    q, scale = quantize_rows(linear.weight)
    expected = x.double() @ (q.double() * scale.double()[:, None]).T + linear.bias.detach().double()
    torch.testing.assert_close(layer(x).double(), expected, rtol=0, atol=1e-5)


@pytest.mark.skipif(not FBGEMM, reason="this torch has no fbgemm quantized engine")
def test_the_fbgemm_kernel_errs_by_at_most_its_7_bit_activation_step():
    """fbgemm quantizes x per tensor to 7 bits (reduce_range): each input is off by at most half a step
    (max x - min x) / 127, so an output is off by at most that times Σ_i |Q_oi s_o|."""
    linear = _linear(d_in=768, d_out=64)
    fbgemm, exact = Int8Linear(linear, "fbgemm"), Int8Linear(linear, "dequant")
    x = torch.randn(4, 768)
    step = float(x.max() - x.min()) / 127
    bound = step / 2 * exact.dequantized().abs().sum(dim=1) + 1e-4  # (out,)
    assert ((fbgemm(x) - exact(x)).abs() <= bound).all()


def _gpt(**variants) -> pf.GPT:
    torch.manual_seed(0)
    return pf.GPT(pf.GPTConfig(vocab_size=37, block_size=16, n_layers=2, n_heads=2, d_model=32, d_ff=64,
                               **variants)).eval()


# Every attention variant at once: QK-norm, soft-capped scores, ALiBi and a sliding window (its rolling cache).
VARIANTS = dict(pos_encoding="alibi", qk_norm=True, attn_softcap=0.05, sliding_window=5)


@pytest.mark.parametrize("variants", [{}, VARIANTS], ids=["plain", "attention-variants"])
def test_a_quantized_gpt_computes_with_the_int8_weights_of_every_linear_layer_and_its_head(variants):
    model, reference = _gpt(**variants), _gpt(**variants)
    pf.quantize(model, kernel="dequant")
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert isinstance(model.lm_head, Int8Linear) and model.token_embedding.weight.dtype == torch.float32
    with torch.no_grad():  # the reference: a float32 GPT whose linear weights are Q · s
        for name, module in reference.named_modules():
            if isinstance(module, nn.Linear) and name != "lm_head":
                q, scale = quantize_rows(module.weight)
                module.weight.copy_(q.float() * scale[:, None])
        idx = torch.randint(0, 37, (2, 12), generator=torch.Generator().manual_seed(1))
        hidden = reference.norm(reference.hidden_states(idx))
        q, scale = quantize_rows(reference.lm_head.weight)
        torch.testing.assert_close(model(idx)[0], hidden @ (q.float() * scale[:, None]).T, rtol=0, atol=1e-5)
    assert len(model.generate(idx[:1, :4], 6, temperature=0)[0]) == 10  # the decoder runs the int8 head


def test_a_gpt_with_every_issue_49_variant_quantizes_its_linears_alone_and_decodes_its_full_pass():
    """The variants' parameters are no linear layers: they stay float32, and the int8 model equals the float32
    one whose linear weights are Q · s; its cached decoding equals its own full pass."""
    config = pf.GPTConfig(vocab_size=37, block_size=16, n_layers=2, n_heads=2, d_model=32, d_ff=64, **GPT_VARIANTS_49)
    torch.manual_seed(0)
    model = moved_off_start(pf.GPT(config)).eval()
    reference = copy.deepcopy(model)
    pf.quantize(model, kernel="dequant")
    assert isinstance(model.lm_head, Int8Linear) and model.blocks[1].value_residual.lam.dtype == torch.float32
    idx = torch.randint(0, 37, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for module in reference.modules():
            if isinstance(module, nn.Linear):
                q, scale = quantize_rows(module.weight)
                module.weight.copy_(q.float() * scale[:, None])
        torch.testing.assert_close(model(idx)[0], reference(idx)[0], rtol=0, atol=1e-5)
        steps = list(pf.iter_generate(model.decoder(), idx[:, :4], 8, temperature=0))
        tokens = torch.stack([t for t, _ in steps], dim=1)
        full = model(torch.cat((idx[:, :4], tokens), dim=1)[:, :-1])[0][:, 3:]
    torch.testing.assert_close(torch.stack([z for _, z in steps], dim=1), full, rtol=0, atol=1e-5)


@pytest.mark.parametrize("model, mode, message", [
    (_gpt(), "int4", "mode must be 'int8'"),
    (_gpt().to(torch.bfloat16), "int8", "quantize takes a float32 model, got torch.bfloat16"),
    (pf.GPT(pf.GPTConfig(vocab_size=11, block_size=8, n_layers=1, n_heads=2, d_model=16, d_ff=32, n_experts=2,
                         top_k=1, activation="swiglu")), "int8", "holds the stacked weights of its experts"),
    (pf.add_lora(_gpt(), r=2), "int8", "is a LoRA layer: merge it into its weight first"),
])
def test_what_int8_cannot_quantize_is_refused_naming_it(model, mode, message):
    with pytest.raises(ValueError, match=message):
        pf.quantize(model, mode, kernel="dequant")


def test_where_no_int8_kernel_beats_fp32_it_says_so_once_and_runs_dequantized(monkeypatch):
    monkeypatch.setattr(quantize_module, "fastest", lambda calls: ("fp32", {"fp32": 0.5, "fbgemm": 1.0}))
    said: list[str] = []
    kernel = quantize_module.fastest_kernel(torch.device("cpu"), said.append)
    assert kernel == "dequant" and len(said) == 1 and "dequantized, slower than fp32" in said[0]
    assert quantize_module.fastest_kernel(torch.device("meta"), said.append) == "dequant" and len(said) == 2
