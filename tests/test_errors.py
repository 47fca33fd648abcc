"""Bad input at the public boundary: each case raises the right exception type with a message that
names the argument and what was received (its value, shape or dtype)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import plainformer as pf
from plainformer import _checks
from plainformer.config import Config, field_choices, one_of, positive_int, probability
from plainformer.nn.normalization import make_norm


def _x(*shape: int, **kwargs) -> torch.Tensor:
    return torch.zeros(*shape, **kwargs)


def _mha(*inputs: torch.Tensor, **kwargs):
    return pf.MultiHeadAttention(8, 2)(*inputs, **kwargs)


def _encoder(**kwargs) -> pf.Encoder:
    return pf.Encoder(**{"vocab_size": 10, "d_model": 8, "n_heads": 2, "d_ff": 16, "n_layers": 1,
                         "max_len": 6, **kwargs})


def _ids(*shape: int) -> torch.Tensor:
    return torch.ones(*shape, dtype=torch.long)


def _gpt(**kwargs) -> pf.GPT:
    return pf.GPT(pf.GPTConfig(**{"vocab_size": 10, "block_size": 4, "n_layers": 1, "n_heads": 2,
                                  "d_model": 8, "d_ff": 16, **kwargs}))


def _gpt_after_cached(cached: int):
    """A GPT whose `forward` continues after `cached` positions already in its KV caches."""
    model = _gpt()
    caches = model.new_kv_caches(1)
    model(_ids(1, cached), kv_caches=caches)
    return lambda idx: model(idx, kv_caches=caches)


def _decoder_after_cached(cached: int, tgt: torch.Tensor):
    decoder = pf.Decoder(10, 8, 2, 16, 1, max_len=6)
    memory = _x(1, 2, 8)
    caches = decoder.new_kv_caches(memory)
    decoder(_ids(1, cached), memory, kv_caches=caches)
    return decoder(tgt, memory, kv_caches=caches)


def _cache_holding(positions: int) -> pf.KVCache:
    cache = pf.KVCache(1, 2, 8, 4)
    cache.append(_x(1, 2, positions, 4), _x(1, 2, positions, 4))
    return cache


QKV = (_x(1, 2, 3, 4), _x(1, 2, 5, 4), _x(1, 2, 5, 4))

# (id, call, exception type, fragments the message must contain)
CASES = [
    # ---- scaled_dot_product_attention / attention
    ("q of rank 1", lambda: pf.scaled_dot_product_attention(_x(4), _x(3, 4), _x(3, 4)),
     ValueError, ["q", "(4,)"]),
    ("integer k", lambda: pf.attention(_x(3, 4), _x(3, 4, dtype=torch.long), _x(3, 4)),
     TypeError, ["k", "torch.int64"]),
    ("k dtype differs from q", lambda: pf.attention(_x(3, 4), _x(3, 4, dtype=torch.float64), _x(3, 4)),
     TypeError, ["k", "torch.float64", "torch.float32"]),
    ("v on another device", lambda: pf.attention(_x(3, 4), _x(3, 4), _x(3, 4, device="meta")),
     ValueError, ["v", "meta", "cpu"]),
    ("k head size differs from q", lambda: pf.attention(_x(3, 4), _x(3, 5), _x(3, 5)),
     ValueError, ["k", "(3, 5)", "4"]),
    ("v length differs from k", lambda: pf.attention(_x(3, 4), _x(5, 4), _x(6, 4)),
     ValueError, ["v", "(6, 4)", "(5, 4)"]),
    ("q and k ranks differ", lambda: pf.attention(_x(2, 3, 4), _x(3, 4), _x(3, 4)),
     ValueError, ["q", "k", "(2, 3, 4)", "(3, 4)"]),
    ("kv heads do not divide q heads", lambda: pf.attention(_x(1, 4, 3, 8), _x(1, 3, 3, 8), _x(1, 3, 3, 8)),
     ValueError, ["heads", "(1, 4, 3, 8)", "(1, 3, 3, 8)"]),
    ("mask not broadcastable", lambda: pf.attention(*QKV, _x(3, 7, dtype=torch.bool)),
     ValueError, ["mask", "(3, 7)", "(1, 2, 3, 5)"]),
    ("mask of integer dtype", lambda: pf.scaled_dot_product_attention(*QKV, _x(3, 5, dtype=torch.long)),
     TypeError, ["mask", "torch.int64"]),
    ("mask with too many dimensions", lambda: pf.attention(*QKV, _x(1, 1, 1, 3, 5, dtype=torch.bool)),
     ValueError, ["mask", "5 dimensions"]),
    ("mask on another device", lambda: pf.attention(*QKV, _x(3, 5, dtype=torch.bool, device="meta")),
     ValueError, ["mask", "meta"]),
    ("bad backend name", lambda: pf.attention(*QKV, backend="fast"),
     ValueError, ["backend", "'fast'", "'sdpa'"]),
    ("dropout_p out of range", lambda: pf.attention(*QKV, dropout_p=1.5),
     ValueError, ["dropout_p", "1.5", "[0, 1)"]),
    ("non-positive scale", lambda: pf.scaled_dot_product_attention(*QKV, scale=-1.0),
     ValueError, ["scale", "-1.0"]),
    ("causal_mask of negative size", lambda: pf.causal_mask(-1, 3),
     ValueError, ["n", "-1"]),
    # ---- MultiHeadAttention
    ("d_model not divisible by n_heads", lambda: pf.MultiHeadAttention(10, 3),
     ValueError, ["d_model", "10", "n_heads", "3"]),
    ("n_kv_heads does not divide n_heads", lambda: pf.MultiHeadAttention(16, 4, n_kv_heads=3),
     ValueError, ["n_kv_heads", "3", "n_heads", "4"]),
    ("zero d_model", lambda: pf.MultiHeadAttention(0, 1), ValueError, ["d_model", "0"]),
    ("negative n_heads", lambda: pf.MultiHeadAttention(8, -2), ValueError, ["n_heads", "-2"]),
    ("float d_model", lambda: pf.MultiHeadAttention(8.0, 2), TypeError, ["d_model", "float"]),
    ("attention dropout of 1", lambda: pf.MultiHeadAttention(8, 2, dropout=1.0),
     ValueError, ["dropout", "1.0"]),
    ("bad MHA backend", lambda: pf.MultiHeadAttention(8, 2, backend="cuda"),
     ValueError, ["backend", "'cuda'"]),
    ("query of rank 2", lambda: _mha(_x(3, 8), _x(3, 8), _x(3, 8)),
     ValueError, ["query", "(3, 8)", "(B, seq_len, d_model)"]),
    ("query of the wrong width", lambda: _mha(_x(1, 3, 6), _x(1, 3, 8), _x(1, 3, 8)),
     ValueError, ["query", "(1, 3, 6)", "d_model = 8"]),
    ("integer query", lambda: _mha(*(_x(1, 3, 8, dtype=torch.long),) * 3),
     TypeError, ["query", "torch.int64"]),
    ("key on another device", lambda: _mha(_x(1, 3, 8), _x(1, 3, 8, device="meta"), _x(1, 3, 8)),
     ValueError, ["key", "meta", "cpu"]),
    ("key and value lengths differ", lambda: _mha(_x(1, 3, 8), _x(1, 4, 8), _x(1, 5, 8)),
     ValueError, ["value", "(1, 4, 8)", "(1, 5, 8)"]),
    ("key_padding_mask of the wrong shape", lambda: _mha(*(_x(2, 3, 8),) * 3,
                                                         key_padding_mask=_x(2, 4, dtype=torch.bool)),
     ValueError, ["key_padding_mask", "(2, 4)", "(2, 3)"]),
    ("float key_padding_mask", lambda: _mha(*(_x(2, 3, 8),) * 3, key_padding_mask=_x(2, 3)),
     TypeError, ["key_padding_mask", "torch.float32"]),
    ("MHA mask not broadcastable", lambda: _mha(*(_x(2, 3, 8),) * 3, mask=_x(4, 3, dtype=torch.bool)),
     ValueError, ["mask", "(4, 3)", "(2, 2, 3, 3)"]),
    ("kv cache of other heads", lambda: _mha(*(_x(1, 3, 8),) * 3, kv_cache=pf.KVCache(1, 4, 8, 2)),
     ValueError, ["k", "(1, 2, 3, 4)", "(1, 4, n, 2)"]),
    # ---- positions (checked where they enter: the models, attention; the encodings check nothing)
    ("odd d_model for sinusoids", lambda: pf.SinusoidalPositionalEncoding(7, 10),
     ValueError, ["d_model", "even", "7"]),
    ("sequence longer than block_size", lambda: _gpt(pos_encoding="sinusoidal")(_ids(1, 5)),
     ValueError, ["idx", "5 positions", "block_size=4"]),
    ("cached positions past block_size", lambda: _gpt_after_cached(3)(_ids(1, 2)),
     ValueError, ["idx", "2 positions after 3 cached", "block_size=4"]),
    ("decoder positions past max_len", lambda: _decoder_after_cached(4, _ids(1, 3)),
     ValueError, ["tgt", "length 7", "max_len=6"]),
    ("token ids of rank 1 for a GPT", lambda: _gpt()(torch.ones(3, dtype=torch.long)),
     ValueError, ["idx", "(3,)", "(B, n)"]),
    ("zero max_len", lambda: pf.LearnedPositionalEmbedding(8, 0), ValueError, ["max_len", "0"]),
    ("odd head_dim for rope", lambda: pf.RotaryEmbedding(7, 10), ValueError, ["head_dim", "even", "7"]),
    ("rope base not above 1", lambda: pf.RotaryEmbedding(8, 10, base=1.0), ValueError, ["base", "1.0"]),
    ("rope of the wrong head_dim", lambda: _mha(*(_x(1, 3, 8),) * 3, rope=pf.RotaryEmbedding(6, 10)),
     ValueError, ["rope", "head_dim = 6", "head_dim = 4"]),
    ("rope positions past max_len", lambda: _mha(*(_x(1, 3, 8),) * 3, rope=pf.RotaryEmbedding(4, 4),
                                                 kv_cache=_cache_holding(2)),
     ValueError, ["rotated positions", "length 5", "max_len=4"]),
    # ---- feed-forward, norms, layers
    ("bad activation", lambda: pf.FeedForward(8, 16, activation="tanh"),
     ValueError, ["activation", "'tanh'", "'relu'"]),
    ("zero d_ff", lambda: pf.FeedForward(8, 0), ValueError, ["d_ff", "0"]),
    ("string dropout", lambda: pf.FeedForward(8, 16, dropout="0.1"), TypeError, ["dropout", "str"]),
    ("layer input of the wrong width", lambda: pf.EncoderLayer(8, 2, 16)(_x(2, 3, 7)),
     ValueError, ["x", "(2, 3, 7)", "d_model = 8"]),
    ("rmsnorm layer memory of the wrong width",
     lambda: pf.DecoderLayer(8, 2, 16, norm="rmsnorm")(_x(2, 3, 8), _x(2, 4, 7)),
     ValueError, ["memory", "(2, 4, 7)", "d_model = 8"]),
    ("bad norm kind", lambda: make_norm("batchnorm", 8), ValueError, ["norm", "'batchnorm'"]),
    ("negative layer dropout", lambda: pf.EncoderLayer(8, 2, 16, dropout=-0.1),
     ValueError, ["dropout", "-0.1"]),
    # ---- Encoder
    ("token id out of range", lambda: _encoder()(torch.tensor([[1, 10]])),
     ValueError, ["src", "[1, 10]", "vocab_size=10"]),
    ("negative token id", lambda: _encoder()(torch.tensor([[-1, 2]])),
     ValueError, ["src", "[-1, 2]", "[0, 10)"]),
    ("float token ids", lambda: _encoder()(_x(1, 3)), TypeError, ["src", "torch.float32"]),
    ("token ids of rank 1", lambda: _encoder()(torch.ones(3, dtype=torch.long)),
     ValueError, ["src", "(3,)", "(B, n)"]),
    ("source longer than max_len", lambda: _encoder()(torch.ones(1, 7, dtype=torch.long)),
     ValueError, ["src", "length 7", "max_len=6"]),
    ("zero vocab_size", lambda: _encoder(vocab_size=0), ValueError, ["vocab_size", "0"]),
    ("negative d_model", lambda: _encoder(d_model=-8), ValueError, ["d_model", "-8"]),
    ("zero n_layers", lambda: _encoder(n_layers=0), ValueError, ["n_layers", "0"]),
    ("pad_id out of range", lambda: _encoder(pad_id=10), ValueError, ["pad_id", "10", "vocab_size=10"]),
    ("string pad_id", lambda: _encoder(pad_id="0"), TypeError, ["pad_id", "str"]),
    ("encoder dropout above 1", lambda: _encoder(dropout=2.0), ValueError, ["dropout", "2.0"]),
    # ---- KV cache
    ("zero cache batch", lambda: pf.KVCache(0, 2, 8, 4), ValueError, ["batch_size", "0"]),
    ("cache overflow", lambda: pf.KVCache(1, 1, 2, 4).append(_x(1, 1, 3, 4), _x(1, 1, 3, 4)),
     ValueError, ["3 new positions", "max_len=2"]),
]


@pytest.mark.parametrize("call,error,fragments", [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_bad_input_is_refused_with_a_message_naming_argument_and_value(call, error, fragments):
    with pytest.raises(error) as raised:
        call()
    assert type(raised.value) is error
    message = str(raised.value)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from {message!r}"



# ----------------------------------------------------------------------------- declared field checks

@dataclasses.dataclass
class _ToyConfig(Config):
    width: int = positive_int(4)
    depth: int | None = positive_int(None)
    rate: float = probability(0.0)
    kind: str = one_of("a", ("a", "b"))
    low: int = 1
    high: int = 2

    def validate(self) -> None:
        if self.low >= self.high:
            raise ValueError(f"low ({self.low}) must be below high ({self.high})")


@pytest.mark.parametrize("values, error, message", [
    (dict(width=0), ValueError, "width must be a positive integer, got 0"),
    (dict(width="4"), TypeError, "width must be an int, got str '4'"),  # the type first, then the constraint
    (dict(depth=-1), ValueError, "depth must be a positive integer, got -1"),
    (dict(rate=1.0), ValueError, r"rate must be in \[0, 1\), got 1.0"),
    (dict(kind="c"), ValueError, "kind must be one of 'a', 'b'; got 'c'"),
    (dict(low=3), ValueError, r"low \(3\) must be below high \(2\)"),  # a rule across fields: validate()
])
def test_a_config_checks_the_constraint_declared_with_each_field(values, error, message):
    with pytest.raises(error, match=message):
        _ToyConfig(**values)
    assert _ToyConfig(depth=None).depth is None  # None, where allowed, skips the constraint


def test_a_declared_field_keeps_its_default_and_round_trips():
    config = _ToyConfig(width=8)
    assert (_ToyConfig().width, config.replace(rate=0.5).width) == (4, 8)
    assert _ToyConfig.from_json(config.to_json()) == config


def test_the_choices_of_a_field_are_those_it_was_declared_one_of():
    assert field_choices(_ToyConfig, "kind") == ("a", "b")
    assert field_choices(_ToyConfig, "width") is None and field_choices(_ToyConfig, "low") is None


# ----------------------------------------------------------------------------- checked once

@pytest.fixture
def outer_checks(monkeypatch):
    """(check function, the name it checks) of every outermost `_checks.check_*` call made while the
    test runs (a check that another check calls is part of that one)."""
    calls: list[tuple[str, object]] = []
    depth = [0]

    def recording(name: str, check):
        def recorded(*args, **kwargs):
            if depth[0] == 0:
                calls.append((name, args[0] if args else None))
            depth[0] += 1
            try:
                return check(*args, **kwargs)
            finally:
                depth[0] -= 1
        return recorded

    for name in dir(_checks):
        if name.startswith("check_"):
            monkeypatch.setattr(_checks, name, recording(name, getattr(_checks, name)))
    return calls


GPT_SHAPE = dict(vocab_size=10, block_size=8, n_layers=2, n_heads=2, d_model=8, d_ff=16)
MODELS = [
    ("gpt", pf.GPT, lambda: pf.GPTConfig(**GPT_SHAPE)),
    ("gpt moe rope", pf.GPT, lambda: pf.GPTConfig(**GPT_SHAPE, pos_encoding="rope", n_experts=2, top_k=1,
                                                  n_shared_experts=1)),
    ("gpt sinusoidal rmsnorm", pf.GPT, lambda: pf.GPTConfig(**GPT_SHAPE, pos_encoding="sinusoidal", norm="rmsnorm")),
    ("bert", pf.BertModel, lambda: pf.BertConfig(vocab_size=10, max_len=8, n_layers=1, n_heads=2, d_model=8,
                                                 d_ff=16)),
    ("transformer", pf.Transformer, lambda: pf.TransformerConfig(src_vocab_size=10, tgt_vocab_size=10,
                                                                 n_layers=1, n_heads=2, d_model=8, d_ff=16,
                                                                 max_len=8)),
]


@pytest.mark.parametrize("model, config", [m[1:] for m in MODELS], ids=[m[0] for m in MODELS])
def test_a_model_built_from_its_validated_config_checks_no_field_again(model, config, outer_checks):
    config = config()
    outer_checks.clear()
    model(config)
    assert outer_checks == [("check_type", "config")]


LAYERS = [
    ("encoder layer", lambda: pf.EncoderLayer(8, 2, 16, attention_dropout=0.0, norm="rmsnorm")),
    ("decoder layer", lambda: pf.DecoderLayer(8, 2, 16, n_kv_heads=1)),
    ("encoder", lambda: pf.Encoder(10, 8, 2, 16, 2, max_len=6, pad_id=0)),
    ("decoder", lambda: pf.Decoder(10, 8, 2, 16, 2, max_len=6)),
    ("moe", lambda: pf.MoEFeedForward(8, 16, 4, 2, n_shared_experts=1, capacity_factor=1.0)),
]


@pytest.mark.parametrize("build", [layer[1] for layer in LAYERS], ids=[layer[0] for layer in LAYERS])
def test_a_layer_built_on_its_own_checks_each_argument_once(build, outer_checks):
    build()
    assert outer_checks and len(outer_checks) == len(set(outer_checks)), outer_checks


def test_a_gpt_forward_checks_each_input_once(outer_checks):
    model = pf.GPT(pf.GPTConfig(**GPT_SHAPE, n_experts=2, top_k=1)).train()  # MoE: its losses too
    outer_checks.clear()
    model(_ids(2, 5), _ids(2, 5), kv_caches=model.new_kv_caches(2))
    assert outer_checks and len(outer_checks) == len(set(outer_checks)), outer_checks
