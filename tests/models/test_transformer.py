"""pf.Transformer against torch.nn.Transformer with copied weights (post-LN and pre-LN, source, target
and memory padding masks, causal target mask; outputs and gradients), label smoothing against a hand
computation, the paper's learning-rate schedule at known steps, decoding with and without caches,
presets and checkpoints."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from plainformer.checkpoint.format import save_checkpoint
from plainformer.models.transformer import (
    Transformer,
    TransformerConfig,
    label_smoothed_cross_entropy,
)
from plainformer.training.config import TrainConfig
from plainformer.training.optim import lr_at
from tests.reference.seq2seq_reference import TorchSeq2Seq, layer_grads, randomize_norms
from tests.reference.torch_reference import assert_close

VOCAB, PAD, BOS, EOS = 17, 0, 1, 2


def _config(**changes) -> TransformerConfig:
    shape = dict(src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, n_layers=2, n_decoder_layers=3, n_heads=4,
                 d_model=16, d_ff=32, dropout=0.0, max_len=32, pad_id=PAD, bos_id=BOS, eos_id=EOS)
    return TransformerConfig(**{**shape, **changes})


def _model(seed: int = 0, **changes) -> Transformer:
    torch.manual_seed(seed)
    model = Transformer(_config(**changes))
    randomize_norms(model, torch.Generator().manual_seed(seed + 1))  # γ, β and biases away from 1, 0
    return model


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Sources of lengths 6 and 4, targets of lengths 5 and 3 (plus BOS / EOS), right-padded."""
    g = torch.Generator().manual_seed(seed)
    src = torch.randint(3, VOCAB, (2, 6), generator=g)
    src[1, 4:] = PAD
    body = torch.randint(3, VOCAB, (2, 5), generator=g)
    tgt_in = torch.cat((torch.full((2, 1), BOS), body), dim=1)
    tgt_out = torch.cat((body, torch.full((2, 1), PAD)), dim=1)
    tgt_out[0, 5] = EOS
    tgt_in[1, 4:], tgt_out[1, 3], tgt_out[1, 4:] = PAD, EOS, PAD
    return {"src": src, "tgt_in": tgt_in, "tgt_out": tgt_out}


@pytest.mark.parametrize("norm_first", [False, True])
def test_matches_torch_transformer_with_copied_weights(norm_first):
    model = _model(norm_first=norm_first).train()
    reference = TorchSeq2Seq(model).train()
    batch = _batch()
    logits, _ = model(batch["src"], batch["tgt_in"])
    expected = reference(batch["src"], batch["tgt_in"])
    upstream = torch.randn_like(logits)
    (logits * upstream).sum().backward()
    (expected * upstream).sum().backward()
    assert_close(logits, expected, "logits")
    assert_close(model.encoder.embedding.weight.grad, reference.embedding.weight.grad,
                 "shared embedding / output projection gradient")
    ours = [g for layer in [*model.encoder.layers, *model.decoder.layers] for g in layer_grads(layer)]
    theirs = [g for layer in [*reference.body.encoder.layers, *reference.body.decoder.layers]
              for g in layer_grads(layer)]
    for i, (mine, their) in enumerate(zip(ours, theirs, strict=True)):
        assert_close(mine, their, f"layer gradient {i}")
    if norm_first:
        assert_close(model.decoder.norm.weight.grad, reference.body.decoder.norm.weight.grad, "final norm")


@pytest.mark.parametrize("norm_first", [False, True])
def test_matches_torch_transformer_in_eval_mode(norm_first):
    model = _model(seed=4, norm_first=norm_first, dropout=0.1).eval()
    reference = TorchSeq2Seq(model).eval()
    batch = _batch(seed=4)
    with torch.no_grad():
        assert_close(model(batch["src"], batch["tgt_in"])[0], reference(batch["src"], batch["tgt_in"]),
                     "logits")


def test_embeddings_are_shared_and_the_output_projection_is_tied():
    model = Transformer(_config())
    assert model.encoder.embedding is model.decoder.embedding
    assert model.output.weight is model.decoder.embedding.weight
    separate = Transformer(_config(share_embeddings=False, tgt_vocab_size=VOCAB + 3))
    assert separate.encoder.embedding is not separate.decoder.embedding
    assert separate.output.weight is separate.decoder.embedding.weight
    assert separate.output.weight.shape == (VOCAB + 3, 16)


def test_output_bias_is_added_to_the_tied_logits():
    """output_bias (Marian's final_logits_bias): logits = h Eᵀ + b, the projection still tied to E."""
    model = _model(output_bias=True).eval()
    assert model.output.weight is model.decoder.embedding.weight
    with torch.no_grad():
        model.output.bias.copy_(torch.randn(VOCAB, generator=torch.Generator().manual_seed(3)))
        batch = _batch()
        logits, _ = model(batch["src"], batch["tgt_in"])
        hidden = model.decoder(batch["tgt_in"], model.encoder(batch["src"]),
                               tgt_key_padding_mask=batch["tgt_in"] != PAD, memory_key_padding_mask=batch["src"] != PAD)
    assert_close(logits, hidden @ model.decoder.embedding.weight.T + model.output.bias)


def test_a_decoder_that_starts_from_the_pad_token_scores_as_decoding_does():
    """bos_id == pad_id (Marian's decoder start): the padded batch's logits at the real positions, position 0
    included, equal those that decoding computes for each pair alone, unpadded and unmasked."""
    model = _model(bos_id=PAD).eval()
    batch = _batch()
    batch["tgt_in"][:, 0] = PAD
    with torch.no_grad():
        logits, loss = model(**batch)
        for row, (n_src, n_tgt) in enumerate(((6, 6), (4, 4))):
            memory, src_mask = model.encode(batch["src"][row:row + 1, :n_src])
            alone = model.decode(batch["tgt_in"][row:row + 1, :n_tgt], memory, src_mask)
            assert_close(logits[row, :n_tgt], alone[0], f"row {row}")
    assert torch.isfinite(loss)


def test_label_smoothing_matches_a_hand_computation():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 5, generator=g)
    targets = torch.tensor([[4, 1, 0], [2, 0, 0]])  # 0 is padding
    eps, total, count = 0.1, 0.0, 0
    for b in range(2):
        for t in range(3):
            if targets[b, t] == 0:
                continue
            log_p = [x - math.log(sum(math.exp(z) for z in logits[b, t].tolist()))
                     for x in logits[b, t].tolist()]
            q = [(1 - eps) * (k == targets[b, t]) + eps / 5 for k in range(5)]
            total -= sum(qk * lp for qk, lp in zip(q, log_p, strict=True))
            count += 1
    loss = label_smoothed_cross_entropy(logits, targets, eps, ignore_index=0)
    assert abs(loss.item() - total / count) <= 1e-6


def test_loss_is_the_label_smoothed_cross_entropy_over_real_target_tokens():
    model = _model()
    batch = _batch()
    logits, loss = model(**batch)
    real = batch["tgt_out"] != PAD
    smoothed = F.cross_entropy(logits[real], batch["tgt_out"][real], label_smoothing=0.1)
    assert_close(loss, smoothed, "loss")


def test_the_paper_schedule_matches_the_formula_at_known_steps():
    """lrate = d_model^-0.5 · min(step^-0.5, step · warmup^-1.5), d_model 512, warmup 4000."""
    d_model = TransformerConfig.from_preset("base").d_model
    config = TrainConfig.from_preset("transformer-paper", schedule_d_model=d_model)
    for step, expected in ((1, 1.746928e-07), (1000, 1.746928e-04), (4000, 6.987712e-04),
                           (16000, 3.493856e-04)):
        assert lr_at(step, config) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("beam_size", [1, 3])
@pytest.mark.parametrize("norm_first", [False, True])
def test_decoding_with_kv_cache_equals_decoding_without(beam_size, norm_first):
    model = _model(seed=2, norm_first=norm_first).double()  # float64: no near-tie of the CPU's sums decides
    src = _batch(seed=2)["src"]
    cached = model.generate(src, beam_size=beam_size, max_new_tokens=12)
    uncached = model.generate(src, beam_size=beam_size, max_new_tokens=12, use_cache=False)
    assert torch.equal(cached, uncached)


def test_cross_attention_keys_and_values_are_projected_once_per_source(monkeypatch):
    model = _model(seed=3)
    calls = []
    for layer in model.decoder.layers:
        original = layer.cross_attn.project_kv
        monkeypatch.setattr(layer.cross_attn, "project_kv",
                            lambda k, v, original=original: calls.append(k.shape[0]) or original(k, v))
    model.generate(_batch()["src"], beam_size=4, max_new_tokens=10)
    assert calls == [2] * len(model.decoder.layers)  # once per layer, for the 2 sources, not per beam


def _constant_model(token: int, **changes) -> Transformer:
    """A model whose decoder output is the same vector at every position, so it predicts `token`
    (never EOS) whatever the input: the last LayerNorm has γ = 0, β = 1, and E[token] points along 1."""
    model = _model(seed=5, **changes)
    with torch.no_grad():
        model.decoder.layers[-1].norm3.weight.zero_()
        model.decoder.layers[-1].norm3.bias.fill_(1.0)
        model.decoder.embedding.weight[token] += 10.0
    return model


@pytest.mark.parametrize("beam_size", [1, 2])
def test_output_stops_at_source_length_plus_50(beam_size):
    model = _constant_model(7, max_len=64)
    out = model.generate(_batch()["src"], beam_size=beam_size)  # sources of 6 and 4 tokens
    assert out.shape == (2, 1 + 56)
    assert (out[0, 1:] == 7).all()
    assert (out[1, 1:55] == 7).all() and (out[1, 55:] == EOS).all()


def test_output_length_is_capped_by_max_len():
    out = _constant_model(7, max_len=40).generate(_batch()["src"])
    assert out.shape == (2, 1 + 40) and (out[:, 1:] == 7).all()


def test_relu2_from_the_shared_activations_reaches_every_feed_forward():
    model = _model(activation="relu2")
    layers = [*model.encoder.layers, *model.decoder.layers]
    assert [layer.ff.activation for layer in layers] == ["relu2"] * len(layers)


def test_presets_follow_the_paper():
    base = Transformer(TransformerConfig.from_preset("base", src_vocab_size=37000, tgt_vocab_size=37000))
    assert 0.95 * 65e6 < base.num_parameters() < 65e6  # Table 3: 65M (shared 37000-token BPE)
    big = TransformerConfig.from_preset("big")
    assert (big.n_layers, big.d_model, big.n_heads, big.d_ff, big.dropout) == (6, 1024, 16, 4096, 0.3)


def test_checkpoint_round_trip_gives_the_same_logits(tmp_path):
    from plainformer.data.seq2seq import make_task, train_tokenizer

    tokenizer = train_tokenizer(make_task("copy", sizes={"train": 50, "val": 5, "test": 5}))
    model = _model(src_vocab_size=tokenizer.vocab_size, tgt_vocab_size=tokenizer.vocab_size).eval()
    save_checkpoint(tmp_path / "ckpt", model=model, family=model.family,
                    model_config=model.config.to_dict(), tokenizer=tokenizer)
    loaded = Transformer.from_checkpoint(tmp_path / "ckpt")
    batch = _batch()
    assert torch.equal(loaded(**batch)[0], model(**batch)[0])
    assert loaded.tokenizer.encode("abc") == tokenizer.encode("abc")
    assert loaded.translate(["", "abc"])[0] == ""


@pytest.mark.parametrize("changes, match", [
    (dict(src_vocab_size=10, tgt_vocab_size=11), "share_embeddings"),
    (dict(bos_id=EOS), "eos_id must differ"),
    (dict(eos_id=PAD), "eos_id must differ"),
    (dict(eos_id=VOCAB), "eos_id"),
    (dict(d_model=18), "divisible"),
    (dict(n_decoder_layers=0), "n_decoder_layers"),
    (dict(label_smoothing=1.0), "label_smoothing"),
    (dict(activation="tanh"), "activation"),
])
def test_bad_config_raises_naming_the_field(changes, match):
    with pytest.raises(ValueError, match=match):
        _config(**changes)


def test_bad_inputs_raise_value_errors():
    model = _model()
    batch = _batch()
    with pytest.raises(ValueError, match="batch size"):
        model(batch["src"][:1], batch["tgt_in"])
    with pytest.raises(ValueError, match="tgt_out"):
        model(batch["src"], batch["tgt_in"], batch["tgt_out"][:, :2])
    with pytest.raises(ValueError, match="src"):
        model(batch["src"] + VOCAB, batch["tgt_in"])
    with pytest.raises(ValueError, match="tokenizer"):
        model.translate(["abc"])
    with pytest.raises(TypeError, match="config"):
        Transformer({"d_model": 16})
