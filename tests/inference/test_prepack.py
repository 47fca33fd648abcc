"""Tests for plainformer.inference.prepack: linear layers on weights reordered for oneDNN, against float64."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import plainformer as pf
from plainformer.inference.prepack import PackedLinear, prepack, prepack_supported
from tests.reference.tiny_models import GPT_VARIANTS_49, moved_off_start
from tests.reference.torch_reference import assert_close

TINY = dict(vocab_size=53, block_size=24, n_layers=2, n_heads=4, d_model=32, d_ff=64)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 256), (256,), (5, 256), (3, 40, 256)], ids=str)
def test_matches_the_float64_product_in_float32_for_any_number_of_rows(shape, bias):
    """Summation order only: 1e-5 relative to the largest output (entries of ~16 here)."""
    torch.manual_seed(0)
    layer = nn.Linear(256, 64, bias=bias)
    x = torch.randn(*shape)
    with torch.inference_mode():
        out = PackedLinear(layer)(x)
    b = None if layer.bias is None else layer.bias.double()
    expected = nn.functional.linear(x.double(), layer.weight.double(), b)
    assert out.shape == expected.shape and out.dtype == torch.float32
    assert (out.double() - expected).abs().max() <= 1e-5 * expected.abs().max()


@pytest.mark.skipif(not prepack_supported(torch.bfloat16), reason="this CPU's oneDNN packs no bf16 (AVX2 only)")
def test_matches_the_float64_product_up_to_bf16_rounding():
    """fp32 accumulation, one bf16 rounding of the result: within 2 units of 2^-8 of the largest output."""
    torch.manual_seed(0)
    layer = nn.Linear(256, 64).to(torch.bfloat16)
    x = torch.randn(1, 256).bfloat16()
    with torch.inference_mode():
        out = PackedLinear(layer)(x)
    expected = nn.functional.linear(x.double(), layer.weight.double(), layer.bias.double())
    assert out.dtype == torch.bfloat16
    assert (out.double() - expected).abs().max() <= 2 * 2**-8 * expected.abs().max()


# Every attention variant at once: QK-norm, soft-capped scores, ALiBi and a sliding window (its rolling cache).
VARIANTS = dict(pos_encoding="alibi", qk_norm=True, attn_softcap=0.05, sliding_window=5)


@pytest.mark.parametrize("variants", [{}, VARIANTS], ids=["plain", "attention-variants"])
@pytest.mark.parametrize("tie_weights", [True, False])
def test_a_prepacked_gpt_decodes_the_float64_model_logits(tie_weights, variants):
    torch.manual_seed(0)
    model = pf.GPT(pf.GPTConfig(**TINY, tie_weights=tie_weights, **variants)).eval()
    reference = copy.deepcopy(model).double()
    prompt = torch.randint(TINY["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(1))
    prepack(model)
    assert isinstance(model.lm_head, PackedLinear) and isinstance(model.blocks[0].self_attn.W_q, PackedLinear)
    assert isinstance(model.token_embedding.weight, nn.Parameter)
    steps = list(pf.iter_generate(model.decoder(), prompt, 10, temperature=0))
    tokens = torch.stack([t for t, _ in steps], dim=1)
    logits = torch.stack([z for _, z in steps], dim=1)  # (B, 10, V)
    with torch.no_grad():
        full = reference(torch.cat((prompt, tokens), dim=1)[:, :-1])[0][:, prompt.shape[1] - 1:]
    assert_close(logits, full.float(), "logits of the prepacked steps")
    assert torch.equal(tokens, full.argmax(-1))


def test_a_prepacked_gpt_with_every_issue_49_variant_decodes_the_float64_model_logits():
    """The variants' parameters are no linear layers: prepacking passes them by."""
    torch.manual_seed(0)
    model = moved_off_start(pf.GPT(pf.GPTConfig(**TINY, **GPT_VARIANTS_49, pos_encoding="rope"))).eval()
    reference = copy.deepcopy(model).double()
    prompt = torch.randint(TINY["vocab_size"], (2, 5), generator=torch.Generator().manual_seed(1))
    prepack(model)
    assert isinstance(model.lm_head, PackedLinear) and isinstance(model.token_shift.gate, nn.Parameter)
    steps = list(pf.iter_generate(model.decoder(), prompt, 10, temperature=0))
    tokens = torch.stack([t for t, _ in steps], dim=1)
    with torch.no_grad():
        full = reference(torch.cat((prompt, tokens), dim=1)[:, :-1])[0][:, prompt.shape[1] - 1:]
    assert_close(torch.stack([z for _, z in steps], dim=1), full.float(), "logits of the prepacked steps")


def test_what_cannot_be_prepacked_is_refused_with_one_line():
    with pytest.raises(ValueError, match="no linear layer to prepack"):
        prepack(nn.LayerNorm(4))
    with pytest.raises(ValueError, match="cannot prepack torch.float64 weights"):
        prepack(nn.Linear(4, 3).double())
    with pytest.raises(ValueError, match="CPU kernels; 0 is on meta"):
        prepack(nn.Sequential(nn.Linear(4, 3, device="meta")))
    model = pf.add_lora(pf.GPT(pf.GPTConfig(**TINY)), r=2)
    with pytest.raises(ValueError, match="is a LoRA layer: merge it"):
        prepack(model)
