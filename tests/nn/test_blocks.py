"""Tests for plainformer.nn.blocks: the encoder and decoder layers and stacks against torch.nn.

EncoderLayer and Encoder against torch.nn.TransformerEncoderLayer / nn.TransformerEncoder with
copied weights, post-LN and pre-LN, padded, in three modes:

- "fast_path": eval under no_grad, where torch runs its fused native kernels (and, in the stack,
  nested tensors that write zeros at padded positions, so only real positions are compared there);
- "eval_grad": eval with gradients, where torch runs its Python reference math;
- "train": train mode with dropout 0, torch's Python reference math again.

DecoderLayer and Decoder against torch.nn.TransformerDecoderLayer / TransformerDecoder with copied
weights (post-LN and pre-LN, padding and causal masks, outputs and gradients); incremental decoding
with the self-attention and memory caches equals the full pass; float64 gradcheck. Comparisons of two of
our own paths (padded or alone, cached or not) run in float64 at 1e-10, whatever the CPU's summation order.
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
from plainformer.nn.blocks import Decoder, DecoderLayer
from tests.reference.seq2seq_reference import (
    layer_grads,
    load_torch_decoder_layer,
    randomize_norms,
)
from tests.reference.torch_reference import (
    assert_close,
    encoder_layer_parameter_grads,
    input_and_parameter_grads,
    load_torch_encoder_layer,
    randomize_biases,
    sinusoidal_by_hand,
    upstream_like,
)

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
    for i, (a, b) in enumerate(zip(_layer_grads(ours, out, x), _layer_grads(theirs, ref, x), strict=True)):
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
    for i, (mine, their) in enumerate(zip(ours.layers, theirs.layers, strict=True)):
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
    for mine, their in zip(ours.layers, theirs.layers, strict=True):
        grads = zip(encoder_layer_parameter_grads(mine), encoder_layer_parameter_grads(their), strict=True)
        for i, (a, b) in enumerate(grads):
            assert_close(a, b, f"gradient {i}")


def test_embedding_is_scaled_by_sqrt_d_model_before_adding_sinusoids():
    ours, _ = _encoder_pair(norm_first=False)
    src = _tokens()
    expected = ours.embedding.weight[src] * math.sqrt(D_MODEL) + sinusoidal_by_hand(6, D_MODEL).float()
    assert_close(ours.embed(src), expected)


@pytest.mark.parametrize("norm_first", [False, True], ids=["post_ln", "pre_ln"])
def test_padded_batch_gives_the_outputs_of_the_unpadded_sequences(norm_first):
    ours, _ = _encoder_pair(norm_first)
    ours.double().eval()  # batched vs alone differ only in summation order: float64, 1e-10
    src = _tokens()
    padded_out = ours(src)
    assert_close(padded_out[0], ours(src[:1])[0])
    assert_close(padded_out[1, :4], ours(src[1:, :4])[0])


def test_an_explicit_key_padding_mask_overrides_pad_id():
    """With every position marked real, the pads of sequence 1 are attended like any token."""
    ours, _ = _encoder_pair(norm_first=False)
    ours.double()  # the stack against its own layers called one by one: float64, 1e-10
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


B, N, M, D, H, D_FF = 2, 5, 7, 16, 4, 32


def _inputs(dtype: torch.dtype = torch.float32, seed: int = 0):
    """Target states x (B, N, D), memory (B, M, D), masks True = real token: the second target row
    ends with 2 pads, the first source row with 3."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(B, N, D, generator=g, dtype=dtype, requires_grad=True)
    memory = torch.randn(B, M, D, generator=g, dtype=dtype, requires_grad=True)
    tgt_real = torch.ones(B, N, dtype=torch.bool)
    tgt_real[1, -2:] = False
    memory_real = torch.ones(B, M, dtype=torch.bool)
    memory_real[0, -3:] = False
    return x, memory, tgt_real, memory_real


def _decoder_layer_pair(norm_first: bool, seed: int = 0) -> tuple[DecoderLayer, nn.TransformerDecoderLayer]:
    torch.manual_seed(seed)
    theirs = nn.TransformerDecoderLayer(D, H, D_FF, dropout=0.0, batch_first=True, norm_first=norm_first)
    randomize_norms(theirs, torch.Generator().manual_seed(seed + 1))
    ours = DecoderLayer(D, H, D_FF, dropout=0.0, norm_first=norm_first)
    load_torch_decoder_layer(ours, theirs)
    return ours, theirs


def _grads(*tensors: Tensor) -> list[Tensor]:
    grads = [t.grad.clone() for t in tensors]
    for t in tensors:
        t.grad = None
    return grads


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("causal_by", ["is_causal", "tgt_mask"])
def test_decoder_layer_matches_torch_with_copied_weights(norm_first, causal_by):
    ours, theirs = _decoder_layer_pair(norm_first)
    x, memory, tgt_real, memory_real = _inputs()
    causal = pf.causal_mask(N, N)
    out = ours(x, memory, causal if causal_by == "tgt_mask" else None, is_causal=causal_by == "is_causal",
               tgt_key_padding_mask=tgt_real, memory_key_padding_mask=memory_real)
    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    ours_grads = _grads(x, memory) + layer_grads(ours)

    expected = theirs(x, memory, tgt_mask=~causal, tgt_is_causal=True, tgt_key_padding_mask=~tgt_real,
                      memory_key_padding_mask=~memory_real)
    (expected * upstream).sum().backward()
    theirs_grads = _grads(x, memory) + layer_grads(theirs)
    assert_close(out, expected, "output")
    for i, (mine, their) in enumerate(zip(ours_grads, theirs_grads, strict=True)):
        assert_close(mine, their, f"gradient {i}")


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_layer_matches_torch_in_eval_mode(norm_first):
    ours, theirs = _decoder_layer_pair(norm_first, seed=3)
    ours.eval(), theirs.eval()
    x, memory, tgt_real, memory_real = _inputs(seed=3)
    with torch.no_grad():
        out = ours(x, memory, is_causal=True, tgt_key_padding_mask=tgt_real,
                   memory_key_padding_mask=memory_real)
        expected = theirs(x, memory, tgt_mask=~pf.causal_mask(N, N), tgt_is_causal=True,
                          tgt_key_padding_mask=~tgt_real, memory_key_padding_mask=~memory_real)
    assert_close(out, expected, "output")


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_stack_matches_torch_transformer_decoder(norm_first):
    torch.manual_seed(0)
    vocab, layers = 11, 3
    decoder = Decoder(vocab, D, H, D_FF, layers, max_len=16, pad_id=0, dropout=0.0, norm_first=norm_first)
    layer = nn.TransformerDecoderLayer(D, H, D_FF, dropout=0.0, batch_first=True, norm_first=norm_first)
    theirs = nn.TransformerDecoder(layer, layers, norm=nn.LayerNorm(D) if norm_first else None)
    g = torch.Generator().manual_seed(1)
    for mine, their in zip(decoder.layers, theirs.layers, strict=True):
        randomize_norms(their, g)
        load_torch_decoder_layer(mine, their)
    if norm_first:
        randomize_norms(decoder.norm, g)
        theirs.norm.load_state_dict(decoder.norm.state_dict())
    _, memory, _, memory_real = _inputs(seed=2)
    tgt = torch.randint(1, vocab, (B, N), generator=g)
    tgt[1, -2:] = 0

    out = decoder(tgt, memory, tgt_key_padding_mask=tgt != 0, memory_key_padding_mask=memory_real)
    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    ours_grads = _grads(memory) + [g for mine in decoder.layers for g in layer_grads(mine)]

    x = decoder.embed(tgt).detach()  # E[tgt] · √d_model + PE: the stack's input
    expected = theirs(x, memory, tgt_mask=~pf.causal_mask(N, N), tgt_is_causal=True,
                      tgt_key_padding_mask=tgt == 0, memory_key_padding_mask=~memory_real)
    (expected * upstream).sum().backward()
    theirs_grads = _grads(memory) + [g for their in theirs.layers for g in layer_grads(their)]
    assert_close(out, expected, "output")
    for i, (mine, their) in enumerate(zip(ours_grads, theirs_grads, strict=True)):
        assert_close(mine, their, f"gradient {i}")


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("chunks", [(1, 1, 1, 1, 1), (3, 2), (2, 1, 2)])
def test_incremental_decoding_with_caches_equals_the_full_pass(norm_first, chunks):
    torch.manual_seed(0)
    decoder = Decoder(13, D, H, D_FF, 2, max_len=8, pad_id=0, norm_first=norm_first).double().eval()
    _, memory, _, memory_real = _inputs(torch.float64, seed=4)
    memory = memory.detach()
    tgt = torch.randint(1, 13, (B, N))
    with torch.no_grad():
        full = decoder(tgt, memory, memory_key_padding_mask=memory_real)
        caches = decoder.new_kv_caches(memory)
        pieces, start = [], 0
        for size in chunks:
            pieces.append(decoder(tgt[:, start:start + size], memory, memory_key_padding_mask=memory_real,
                                  kv_caches=caches))
            start += size
    assert_close(torch.cat(pieces, dim=1), full, "cached decoding")


def test_memory_cache_with_repeats_equals_the_cache_of_the_repeated_memory():
    torch.manual_seed(0)
    layer = DecoderLayer(D, H, D_FF).double().eval()
    memory = torch.randn(B, M, D, dtype=torch.float64)
    repeated = layer.memory_kv_cache(memory, repeats=3)
    direct = layer.memory_kv_cache(memory.repeat_interleave(3, dim=0))
    assert repeated.static and repeated.length == M
    assert_close(repeated.keys(), direct.keys(), "keys")
    assert_close(repeated.values(), direct.values(), "values")


def test_reordering_a_decoder_cache_moves_both_caches():
    torch.manual_seed(0)
    decoder = Decoder(13, D, H, D_FF, 1, max_len=8)
    memory = torch.randn(3, M, D)
    (cache,) = decoder.new_kv_caches(memory)
    cache.self_attn.append(torch.randn(3, H, 2, D // H), torch.randn(3, H, 2, D // H))
    before = cache.self_attn.keys().clone(), cache.cross_attn.keys().clone()
    order = torch.tensor([2, 2, 0])
    cache.reorder(order)
    assert torch.equal(cache.self_attn.keys(), before[0][order])
    assert torch.equal(cache.cross_attn.keys(), before[1][order])


def test_gradcheck_float64_decoder_layer():
    torch.manual_seed(0)
    layer = DecoderLayer(8, 2, 12, dropout=0.0).double()
    x, memory, tgt_real, memory_real = (t[..., :8] if t.is_floating_point() else t
                                        for t in _inputs(torch.float64))
    x, memory = x.detach()[:, :3].requires_grad_(), memory.detach().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, b: layer(a, b, is_causal=True, tgt_key_padding_mask=tgt_real[:, :3],
                           memory_key_padding_mask=memory_real), (x, memory))


@pytest.mark.parametrize("call, match", [
    (lambda d, m: d(torch.randint(0, 13, (B, 9)), m), "max_len"),
    (lambda d, m: d(torch.full((B, 2), 13), m), "tgt"),
    (lambda d, m: d(torch.randint(0, 13, (B, 2)), m[0]), "key"),
    (lambda d, m: d(torch.randint(0, 13, (B, 2)), m, kv_caches=d.new_kv_caches(m)[:1]), "kv_caches"),
    (lambda d, m: d.new_kv_caches(m, repeats=0), "repeats"),
    (lambda d, m: d(torch.randint(0, 13, (B, 2)), m, memory_key_padding_mask=torch.ones(B, 3, dtype=torch.bool)),
     "key_padding_mask"),
])
def test_bad_input_raises_value_error_naming_the_argument(call, match):
    decoder = Decoder(13, D, H, D_FF, 2, max_len=8)
    with pytest.raises(ValueError, match=match):
        call(decoder, torch.randn(B, M, D))


def test_bad_constructor_arguments_raise():
    with pytest.raises(ValueError, match="pad_id"):
        Decoder(13, D, H, D_FF, 2, max_len=8, pad_id=13)
    with pytest.raises(ValueError, match="n_layers"):
        Decoder(13, D, H, D_FF, 0, max_len=8)
    with pytest.raises(ValueError, match="dropout"):
        DecoderLayer(D, H, D_FF, dropout=1.5)


def test_a_reorder_within_each_sources_rows_keeps_the_memory_cache_without_copying():
    torch.manual_seed(0)
    decoder = Decoder(13, D, H, D_FF, 1, max_len=8)
    (cache,) = decoder.new_kv_caches(torch.randn(2, M, D), repeats=2)  # rows 0, 1: source 0; 2, 3: source 1
    memory_keys = cache.cross_attn.keys().clone()  # a reorder may write the cache's buffers in place
    held_at = cache.cross_attn.keys().data_ptr()
    cache.reorder(torch.tensor([1, 1, 3, 2]))
    assert cache.cross_attn.keys().data_ptr() == held_at
    assert torch.equal(cache.cross_attn.keys(), memory_keys[torch.tensor([1, 1, 3, 2])])
    cache.reorder(torch.tensor([2, 3, 0, 1]))  # rows change source: the memory cache follows
    assert torch.equal(cache.cross_attn.keys(), memory_keys[torch.tensor([2, 3, 0, 1])])


def test_a_reorder_declared_within_beams_keeps_the_memory_cache_without_reading_the_indices(monkeypatch):
    """Beam search promises that rows stay among their sentence's beams: the memory cache is kept
    without comparing sources (torch.equal, a host sync per layer and step on a GPU)."""
    torch.manual_seed(0)
    decoder = Decoder(13, D, H, D_FF, 1, max_len=8)
    (cache,) = decoder.new_kv_caches(torch.randn(2, M, D), repeats=2)
    memory_keys = cache.cross_attn.keys()
    own = torch.randn(4, H, 1, D // H)
    cache.self_attn.append(own, own)
    monkeypatch.setattr(torch, "equal", lambda *args: pytest.fail("the indices were read"))
    cache.reorder(torch.tensor([1, 1, 3, 2]), group_size=2)
    monkeypatch.undo()
    assert cache.cross_attn.keys().data_ptr() == memory_keys.data_ptr()
    assert torch.equal(cache.self_attn.keys()[:, :, 0], own[torch.tensor([1, 1, 3, 2]), :, 0])
