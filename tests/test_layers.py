"""EncoderLayer and Encoder against torch.nn.TransformerEncoderLayer / nn.TransformerEncoder with
copied weights, post-LN and pre-LN, padded, in three modes:

- "fast_path": eval under no_grad, where torch runs its fused native kernels (and, in the stack,
  nested tensors that write zeros at padded positions, so only real positions are compared there);
- "eval_grad": eval with gradients, where torch runs its Python reference math;
- "train": train mode with dropout 0, torch's Python reference math again.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import Tensor, nn

import plainformer as pf
from _torch_reference import (assert_close, encoder_layer_parameter_grads, input_and_parameter_grads,
                              load_torch_encoder_layer, randomize_biases, sinusoidal_by_hand, upstream_like)

D_MODEL, N_HEADS, D_FF = 8, 2, 16
MODES = ["fast_path", "eval_grad", "train"]


def _layer_pair(norm_first: bool, seed: int = 0, dtype: torch.dtype = torch.float32):
    torch.manual_seed(seed)
    theirs = nn.TransformerEncoderLayer(D_MODEL, N_HEADS, D_FF, dropout=0.0, activation="relu",
                                        batch_first=True, norm_first=norm_first, dtype=dtype)
    randomize_biases(theirs, torch.Generator().manual_seed(seed))
    ours = pf.EncoderLayer(D_MODEL, N_HEADS, D_FF, dropout=0.0, activation="relu", norm_first=norm_first).to(dtype)
    load_torch_encoder_layer(ours, theirs)
    return ours, theirs


def _padded(batch: int, length: int) -> Tensor:
    """torch's convention, True = padding: the second sequence has its last two positions padded."""
    padded = torch.zeros(batch, length, dtype=torch.bool)
    padded[1, length - 2:] = True
    return padded


def _set_mode(mode: str, *modules: nn.Module) -> None:
    for module in modules:
        module.train(mode == "train")


@pytest.mark.parametrize("padding", [False, True], ids=["unpadded", "padded"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
def test_encoder_layer_matches_torch_transformer_encoder_layer(norm_first, mode, padding):
    ours, theirs = _layer_pair(norm_first)
    _set_mode(mode, ours, theirs)
    x = torch.randn(2, 5, D_MODEL, generator=torch.Generator().manual_seed(1))
    padded = _padded(2, 5) if padding else None
    our_mask = None if padded is None else ~padded
    if mode == "fast_path":
        with torch.no_grad():
            assert_close(ours(x, key_padding_mask=our_mask), theirs(x, src_key_padding_mask=padded))
        return
    x.requires_grad_()
    out, ref = ours(x, key_padding_mask=our_mask), theirs(x, src_key_padding_mask=padded)
    assert_close(out, ref, "output")
    for i, (a, b) in enumerate(zip(_layer_grads(ours, out, x), _layer_grads(theirs, ref, x))):
        assert_close(a, b, f"gradient {i}")


def _layer_grads(layer: nn.Module, output: Tensor, x: Tensor) -> list[Tensor]:
    return input_and_parameter_grads(layer, output, (x,), encoder_layer_parameter_grads)


def test_encoder_layer_applies_a_causal_mask_like_torch():
    ours, theirs = _layer_pair(norm_first=True, dtype=torch.float64)
    x = torch.randn(2, 5, D_MODEL, dtype=torch.float64)
    causal = nn.Transformer.generate_square_subsequent_mask(5, dtype=torch.float64)
    assert_close(ours(x, is_causal=True), theirs(x, src_mask=causal, is_causal=True))


def test_gradcheck_float64_encoder_layer():
    ours, _ = _layer_pair(norm_first=False, dtype=torch.float64)
    x = torch.randn(2, 3, D_MODEL, dtype=torch.float64, requires_grad=True)
    keep = torch.ones(2, 3, dtype=torch.bool)
    keep[1, -1] = False
    assert torch.autograd.gradcheck(lambda x: ours(x, key_padding_mask=keep), (x,))


# ----------------------------------------------------------------------------- the stack

VOCAB, MAX_LEN, PAD = 11, 10, 0


def _encoder_pair(norm_first: bool):
    """Our 3-layer Encoder and torch's nn.TransformerEncoder (+ final LayerNorm when pre-LN)."""
    torch.manual_seed(0)
    ours = pf.Encoder(VOCAB, D_MODEL, N_HEADS, D_FF, 3, MAX_LEN, pad_id=PAD, dropout=0.0,
                      norm_first=norm_first)
    layer = nn.TransformerEncoderLayer(D_MODEL, N_HEADS, D_FF, dropout=0.0, batch_first=True,
                                       norm_first=norm_first)
    with warnings.catch_warnings():  # torch warns that pre-LN turns its nested-tensor path off
        warnings.simplefilter("ignore")
        theirs = nn.TransformerEncoder(layer, 3, norm=nn.LayerNorm(D_MODEL) if norm_first else None)
    for i, (mine, their) in enumerate(zip(ours.layers, theirs.layers)):
        randomize_biases(their, torch.Generator().manual_seed(i))
        load_torch_encoder_layer(mine, their)
    if norm_first:
        randomize_biases(theirs.norm, torch.Generator().manual_seed(9))
        ours.norm.load_state_dict(theirs.norm.state_dict())
    return ours, theirs


def _tokens() -> Tensor:
    src = torch.randint(1, VOCAB, (2, 6), generator=torch.Generator().manual_seed(2))
    src[1, 4:] = PAD
    return src


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
def test_encoder_stack_matches_torch_transformer_encoder(norm_first, mode):
    """torch's stack reads our embeddings and the padding mask src == pad_id; ours derives both."""
    ours, theirs = _encoder_pair(norm_first)
    _set_mode(mode, ours, theirs)
    src = _tokens()
    real = src != PAD
    if mode == "fast_path":
        with torch.no_grad():
            out, ref = ours(src), theirs(ours.embed(src), src_key_padding_mask=~real)
        assert_close(out[real], ref[real])
        return
    out, ref = ours(src), theirs(ours.embed(src).detach(), src_key_padding_mask=~real)
    assert_close(out, ref, "output")
    out.backward(upstream_like(out))
    ref.backward(upstream_like(ref))
    for mine, their in zip(ours.layers, theirs.layers):
        for i, (a, b) in enumerate(zip(encoder_layer_parameter_grads(mine), encoder_layer_parameter_grads(their))):
            assert_close(a, b, f"gradient {i}")


def test_embedding_is_scaled_by_sqrt_d_model_before_adding_sinusoids():
    ours, _ = _encoder_pair(norm_first=False)
    src = _tokens()
    expected = ours.embedding.weight[src] * math.sqrt(D_MODEL) + sinusoidal_by_hand(6, D_MODEL).float()
    assert_close(ours.embed(src), expected)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
def test_padded_batch_gives_the_outputs_of_the_unpadded_sequences(norm_first):
    ours, _ = _encoder_pair(norm_first)
    ours.eval()
    src = _tokens()
    padded_out = ours(src)
    assert_close(padded_out[0], ours(src[:1])[0])
    assert_close(padded_out[1, :4], ours(src[1:, :4])[0])


def test_an_explicit_key_padding_mask_overrides_pad_id():
    """With every position marked real, the pads of sequence 1 are attended like any token."""
    ours, _ = _encoder_pair(norm_first=False)
    src = _tokens()
    keep = torch.ones_like(src, dtype=torch.bool)
    x = ours.embed(src)
    for layer in ours.layers:
        x = layer(x, key_padding_mask=keep)
    out = ours(src, key_padding_mask=keep)
    assert_close(out, ours.norm(x))
    assert (out[1, :4] - ours(src)[1, :4]).abs().max() > 1e-3


# ----------------------------------------------------------------------------- properties

@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 2**16), n=st.integers(2, 7), norm_first=st.booleans())
def test_encoder_layers_without_positions_are_permutation_equivariant(seed, n, norm_first):
    """Self-attention and FFN treat positions as a set: permuting inputs (and the padding mask)
    permutes the outputs of a stack of EncoderLayers."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    stack = nn.ModuleList(pf.EncoderLayer(D_MODEL, N_HEADS, D_FF, dropout=0.0, norm_first=norm_first)
                          for _ in range(2)).double()
    x = torch.randn(2, n, D_MODEL, generator=g, dtype=torch.float64)
    keep = torch.rand(2, n, generator=g) < 0.7
    keep[:, 0] = True
    permutation = torch.randperm(n, generator=g)

    def run(x: Tensor, keep: Tensor) -> Tensor:
        for layer in stack:
            x = layer(x, key_padding_mask=keep)
        return x

    assert_close(run(x[:, permutation], keep[:, permutation]), run(x, keep)[:, permutation])
