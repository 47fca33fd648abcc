"""DecoderLayer and Decoder against torch.nn.TransformerDecoderLayer / TransformerDecoder with copied
weights (post-LN and pre-LN, padding and causal masks, outputs and gradients); incremental decoding
with the self-attention and memory caches equals the full pass; float64 gradcheck."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

import plainformer as pf
from plainformer.decoder import Decoder, DecoderLayer
from _seq2seq_reference import layer_grads, load_torch_decoder_layer, randomize_norms
from _torch_reference import assert_close

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


def _layer_pair(norm_first: bool, seed: int = 0) -> tuple[DecoderLayer, nn.TransformerDecoderLayer]:
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
    ours, theirs = _layer_pair(norm_first)
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
    ours, theirs = _layer_pair(norm_first, seed=3)
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
    for mine, their in zip(decoder.layers, theirs.layers):
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
    decoder = Decoder(13, D, H, D_FF, 2, max_len=8, pad_id=0, norm_first=norm_first).eval()
    _, memory, _, memory_real = _inputs(seed=4)
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
    layer = DecoderLayer(D, H, D_FF).eval()
    memory = torch.randn(B, M, D)
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
    memory_keys = cache.cross_attn.keys()
    cache.reorder(torch.tensor([1, 1, 3, 2]))
    assert cache.cross_attn.keys().data_ptr() == memory_keys.data_ptr()
    assert torch.equal(cache.cross_attn.keys(), memory_keys[torch.tensor([1, 1, 3, 2])])
    cache.reorder(torch.tensor([2, 3, 0, 1]))  # rows change source: the memory cache follows
    assert torch.equal(cache.cross_attn.keys(), memory_keys[torch.tensor([2, 3, 0, 1])])
